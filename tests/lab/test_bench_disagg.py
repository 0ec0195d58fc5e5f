"""`tokenbus bench-disagg`: its driver on the tiny model runs colocated and 1P+1D stacks on one mixed
workload and reports what it says (the long prompts prefilled remotely, their KV pulled over NATS);
a configuration that cannot run fails the command; its workload, KV figures and goal are what they
say; the command parses."""
from argparse import Namespace

import orjson
import pytest

from lab.benchmarks import disagg as bd
from ops.cli import parser
from schemas.messages import Heartbeat, KvTransfer


def bench_args(model: str, **kw) -> Namespace:
    defaults = {"model": model, "chat_streams": 3, "chat_input_len": [20, 40], "chat_output": 8, "long_requests": 2,
                "long_rate": 2.0, "long_len": None, "long_output": 4, "max_local_prefill": None, "large": False,
                "threads": 1, "max_num_batched_tokens": 128, "seed": 0, "data_dir": None, "json": None, "plot": None}
    return Namespace(**{**defaults, **kw})


@pytest.mark.slow
def test_colocated_and_disaggregated_run_the_same_workload_and_the_long_prompts_kv_crosses_nats(
        tiny_model, tmp_path, capsys):
    path, png = tmp_path / "r.json", tmp_path / "r.png"
    long_len = 1024                            # 8 steps of 128 tokens: chunked on both sides
    assert bd.main(bench_args(tiny_model, long_len=long_len, json=str(path), plot=str(png),
                              data_dir=str(tmp_path / "data"))) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    report = orjson.loads(path.read_bytes())
    assert report["long_len"] == long_len and report["max_local_prefill"] == (40 + long_len) // 2
    workers = {name: r["workers"] for name, r in report["results"].items()}
    assert workers == {"colocated": {"w0": "both", "w1": "both"}, "disagg": {"p0": "prefill", "d0": "decode"}}
    for name, r in report["results"].items():
        assert r["long_requests"] == 2 and r["chat_requests"] >= 3, name
        assert r["output_tokens"] == 8 * r["chat_requests"] + 4 * 2, name   # every request to its length
        assert r["output_tokens_per_s"] > 0 and r["seconds"] > 0.5, name     # the second long prompt came at 0.5 s
        for key in ("chat_tpot_ms", "chat_itl_ms", "chat_ttft_ms", "long_ttft_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p99"], (name, key)
        assert sum(r["finished_per_worker"].values()) >= r["chat_requests"] + 2, name
    assert report["results"]["colocated"]["kv_transfer"] is None
    disagg = report["results"]["disagg"]
    assert sum(v for k, v in disagg["router_prefill"].items() if k.startswith("remote")) == 2
    kv = disagg["kv_transfer"]
    assert kv["handoffs"] == kv["transfers"] == 2 and kv["failures"] == kv["recomputes"] == 0
    assert kv["pulled_blocks"] == 2 * (long_len // 16) and kv["pulled_bytes"] > 0
    assert kv["nats_mb_per_s"] > 0 and kv["socket_mb_per_s"] > 0 and kv["socket_vs_nats"] > 0
    [goal] = report["goals"]
    assert (goal["disagg"], goal["colocated"]) == ("disagg", "colocated") and goal["throughput_ratio"] > 0
    out = capsys.readouterr().out
    assert "goal, disagg vs colocated: chat TPOT p99" in out and "a loopback TCP copy of the same bytes" in out


def test_a_configuration_that_cannot_run_is_named_and_fails_the_command(tiny_model, monkeypatch, capsys):
    def measure(model, roles, w, args, data_dir):
        if roles.prefill:
            raise RuntimeError("the stack did not start")
        return fake_row()

    monkeypatch.setattr(bd, "measure", measure)
    assert bd.main(bench_args(tiny_model, long_len=512)) == 1
    captured = capsys.readouterr()
    assert "disagg       unavailable: RuntimeError: the stack did not start" in captured.out
    assert "bench-disagg: disagg did not run: RuntimeError: the stack did not start" in captured.err


def fake_row(tpot_p99: float = 10.0, tps: float = 100.0) -> dict:
    figure = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": tpot_p99}
    return {"workers": {"w0": "both"}, "chat_tpot_ms": figure, "chat_itl_ms": figure, "long_ttft_ms": figure,
            "output_tokens_per_s": tps, "chat_requests": 3, "router_prefill": {}, "kv_transfer": None}


def test_the_goal_is_tpot_p99_twice_lower_with_throughput_within_ten_percent():
    rows = {"colocated": fake_row(20.0, 100.0), "disagg": fake_row(10.0, 90.0)}
    [goal] = bd.compare(rows)
    assert (goal["chat_tpot_p99_lower"], goal["throughput_ratio"], goal["met"]) == (2.0, 0.9, True)
    rows["disagg"] = fake_row(10.1, 100.0)
    assert bd.compare(rows)[0]["met"] is False
    rows["disagg"] = fake_row(5.0, 89.0)
    assert bd.compare(rows)[0]["met"] is False
    assert bd.compare({"colocated": fake_row(), "disagg": {"error": "x"}}) == []


def test_the_workload_is_the_same_token_ids_for_the_same_seed_and_fits_the_context():
    args = bench_args("tiny", chat_input_len=[10, 20])
    w = bd.workload(args, 4096, 4096)
    assert len(w.long_prompts) == 2 and {len(p) for p in w.long_prompts} == {bd.LONG_LEN}   # 2048 fits in 4096
    assert w.long_prompts == bd.workload(args, 4096, 4096).long_prompts
    a, b = w.chats(), w.chats()
    first = [next(a) for _ in range(20)]
    assert first == [next(b) for _ in range(20)] and all(10 <= len(p) <= 20 for p in first)
    warm = w.chats("warm-chat")
    assert not set(map(tuple, first)) & {tuple(next(warm)) for _ in range(20)}       # the warm-up's are others
    assert all(16 <= t < 4096 for p in first + w.long_prompts for t in p) and w.long_interval == 0.5
    assert {len(p) for p in bd.workload(args, 4096, 1024).long_prompts} == {1024 - 4 - 1}   # the context's most
    with pytest.raises(ValueError, match="--long-len 1021 \\+ --long-output 4 must stay under the model's context"):
        bd.workload(bench_args("tiny", long_len=1021), 4096, 1024)
    with pytest.raises(ValueError, match="--chat-input-len up to 40 must be shorter than the long prompts, 40"):
        bd.workload(bench_args("tiny", long_len=40), 4096, 1024)


def beat(worker: str, role: str, **kv) -> Heartbeat:
    return Heartbeat(worker, 0.0, "m", 16, 8, 0, 0, 100, 100, 0, 0, 0, role=role,
                     kv_transfer=KvTransfer(**kv) if role != "both" else None)


def test_kv_figures_are_the_decode_workers_pulls_during_the_run_against_a_loopback_copy():
    before = {"p0": beat("p0", "prefill", handoffs=1), "d0": beat("d0", "decode", transfers=1, pulled_bytes=10**6,
                                                                   transfer_seconds=0.5)}
    after = {"p0": beat("p0", "prefill", handoffs=3), "d0": beat("d0", "decode", transfers=3, pulled_blocks=4,
                                                                  pulled_bytes=5 * 10**6, transfer_seconds=0.7,
                                                                  transfer_ms_p50=90.0, transfer_ms_p99=120.0)}
    kv = bd.kv_pulls(before, after)
    assert (kv["handoffs"], kv["transfers"], kv["pulled_bytes"], kv["transfer_seconds"]) == (2, 2, 4 * 10**6, 0.2)
    assert kv["nats_mb_per_s"] == 20.0 and (kv["transfer_ms_p50"], kv["transfer_ms_p99"]) == (90.0, 120.0)
    assert bd.kv_pulls({"w0": beat("w0", "both")}, {"w0": beat("w0", "both")}) is None
    assert bd.socket_copy(3 * bd.SOCKET_MESSAGE + 12345) > 0


def test_the_command_parses_with_its_defaults():
    args = parser().parse_args(["bench-disagg"])
    assert (args.model, args.chat_streams, args.chat_input_len, args.chat_output, args.long_requests, args.long_rate,
            args.long_len, args.threads, args.max_num_batched_tokens, args.large) == (
        "smollm2-135m-instruct", 8, [100, 300], 64, 6, 0.1, None, 1, 2048, False)
    args = parser().parse_args(["bench-disagg", "--large", "--long-len", "1500", "--json", "r.json"])
    assert args.large and args.long_len == 1500 and args.json == "r.json"

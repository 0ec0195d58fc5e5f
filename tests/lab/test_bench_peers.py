"""`tokenbus bench-peers`: its driver against fake servers (tests/lab/fake_servers.py) that stream one
token per chunk after a known TTFT and gap, as llama-server's /v1/completions and the websocket
protocol do; its schedule around an in-process engine; its figures from known timings. Never builds
llama.cpp (a fake binary stands in where one is started)."""
import asyncio
import collections
import itertools
from argparse import Namespace
from pathlib import Path

import numpy as np
import orjson
import pytest

from lab.common.results import Result
from lab.common.turns import Turn, Workload, closed_loop, figures
from lab.peers import bench as bp
from lab.peers import llamacpp
from ops.cli import parser
from tests.lab.fake_servers import TIMER_SLACK_MS, Traffic, serving
from workers.models.config import ModelConfig

TTFT, ITL = 0.05, 0.005


def workload_args(**kw) -> Namespace:
    defaults = {"num_requests": 12, "concurrency": 4, "input_len": [5, 40], "output_len": 6, "single_requests": 3,
                "single_input_len": 20, "single_output_len": 5, "conversations": 3, "turns": 3, "system_len": 10,
                "user_len": [2, 5], "reply_len": 4, "chat_concurrency": 2}
    return Namespace(**{**defaults, **kw})


def run_through(url: str, w: Workload, proto: str):
    connect = bp.openai(url) if proto == "openai" else bp.websocket(url.replace("http", "ws") + "/ws", w.concurrency)
    return asyncio.run(bp.through(connect, w))


@pytest.mark.parametrize("proto", ["openai", "ws"])
def test_the_driver_sends_the_exact_ids_and_lengths_with_exactly_the_concurrency_in_flight(proto):
    w = bp.build("concurrent", workload_args(), vocab=1000, seed=0)
    traffic = Traffic()
    with serving(ttft=TTFT, itl=ITL, traffic=traffic) as port:
        results, seconds = run_through(f"http://127.0.0.1:{port}", w, proto)
    prompt = "prompt" if proto == "openai" else "prompt_token_ids"
    sent = sorted((r[prompt], r["max_tokens"]) for r in traffic.requests)
    assert sent == sorted((t.prompt, t.max_tokens) for t in w.turns)          # every prompt once, token ids as drawn
    assert all(r["temperature"] == 0 and r["ignore_eos"] is True for r in traffic.requests)
    assert traffic.most_in_flight == 4                                        # 12 requests, 4 at a time
    assert len(results) == 12 and all(r.error is None for r in results)
    f = figures(w, results, seconds)
    assert f["output_tokens"] == f["output_tokens_asked"] == 72 and f["failed"] == 0
    assert f["output_tokens_per_s"] == pytest.approx(72 / seconds, rel=0.01)
    assert TTFT * 1e3 - TIMER_SLACK_MS <= f["ttft_ms"]["p50"] < TTFT * 1e3 + 60
    assert ITL * 1e3 - TIMER_SLACK_MS <= f["tpot_ms"]["p50"] < ITL * 1e3 + 15
    assert seconds >= 3 * (TTFT + 5 * ITL)                                    # three waves of four, one after another


def test_chat_turns_go_in_order_each_after_the_one_before_behind_the_shared_system_prompt():
    w = bp.build("chat", workload_args(), vocab=1000, seed=0)
    traffic = Traffic()
    with serving(ttft=0.02, itl=0.002, traffic=traffic) as port:
        results, _ = run_through(f"http://127.0.0.1:{port}", w, "openai")
    assert len(results) == 9 and traffic.most_in_flight == 2               # 3 conversations, 2 at a time
    system = w.conversations[0][0].prompt[:10]
    arrival = {tuple(r["prompt"]): i for i, r in enumerate(traffic.requests)}
    for conv in w.conversations:
        order = [arrival[tuple(t.prompt)] for t in conv]
        assert order == sorted(order)                                        # turn k+1 after turn k
        assert all(t.prompt[:10] == system for t in conv)
        for a, b in itertools.pairwise(conv):             # the history: prompt, a reply, a user turn
            assert b.prompt[:len(a.prompt)] == a.prompt and len(b.prompt) >= len(a.prompt) + 4 + 2


def test_the_other_workloads_are_what_their_flags_say():
    args = workload_args()
    single = bp.build("single", args, vocab=1000, seed=0)
    assert single.concurrency == 1 and [(len(t.prompt), t.max_tokens) for t in single.turns] == [(20, 5)] * 3
    concurrent = bp.build("concurrent", args, vocab=1000, seed=0)
    assert all(5 <= len(t.prompt) <= 40 and t.max_tokens == 6 for t in concurrent.turns)
    assert all(16 <= i < 1000 for t in concurrent.turns for i in t.prompt)  # no special tokens
    assert bp.build("concurrent", args, 1000, 0) == concurrent != bp.build("concurrent", args, 1000, 1)  # per round


class FakeEngine:
    """Ends each turn `steps` polls after it was submitted; records the submissions."""

    def __init__(self, steps: int = 3):
        self.steps, self.live, self.submitted, self.most = steps, {}, [], 0

    def submit(self, key, turn):
        self.live[key] = [self.steps, Result(0.0, prompt_tokens=len(turn.prompt)), turn]
        self.submitted.append(turn)
        self.most = max(self.most, len(self.live))

    def poll(self):
        done = []
        for key, entry in list(self.live.items()):
            entry[0] -= 1
            entry[1].chunks.append(1.0)
            if entry[0] == 0:
                entry[1].end, entry[1].output_tokens = 2.0, entry[2].max_tokens
                done.append((key, self.live.pop(key)[1]))
        return done


@pytest.mark.parametrize("name", ["concurrent", "chat"])
def test_the_in_process_loop_keeps_the_same_schedule(name):
    w = bp.build(name, workload_args(), vocab=1000, seed=0)
    engine = FakeEngine()
    results, _ = closed_loop(w, engine)
    assert len(results) == len(w.turns) and engine.most == w.concurrency
    assert sorted(map(tuple, (t.prompt for t in engine.submitted))) == sorted(tuple(t.prompt) for t in w.turns)
    position = {tuple(t.prompt): i for i, t in enumerate(engine.submitted)}
    for conv in w.conversations:
        order = [position[tuple(t.prompt)] for t in conv]
        assert order == sorted(order)


def test_figures_from_known_timings():
    # request i: sent at 0, first token at 10·(i+1) ms, then 4 more tokens 2 ms apart
    results = [Result(0.0, chunks=[0.01 * (i + 1)], end=0.01 * (i + 1) + 0.008, output_tokens=5) for i in range(10)]
    results.append(Result(0.0, end=0.1, error="http_500"))
    w = Workload("concurrent", [[Turn([1, 2], 5)] for _ in range(11)], 4)
    f = figures(w, results, seconds=2.0)
    ttfts = [10.0 * (i + 1) for i in range(10)]
    assert f["ttft_ms"]["p50"] == pytest.approx(np.percentile(ttfts, 50)) == pytest.approx(55.0)
    assert f["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    assert f["tpot_ms"]["p50"] == pytest.approx(2.0) and f["tpot_ms"]["p99"] == pytest.approx(2.0)
    assert f["output_tokens"] == 50 and f["output_tokens_asked"] == 55 and f["output_tokens_per_s"] == 25.0
    assert f["failed"] == 1 and f["errors"] == {"http_500": 1}
    top = bp.best([{**f, "output_tokens_per_s": 20.0}, f])
    assert top["output_tokens_per_s"] == 25.0 and top["rounds_output_tokens_per_s"] == [20.0, 25.0]
    assert top["round"] == 1


def test_the_flops_count_weights_per_position_the_head_per_sampled_token_and_attention_per_pair():
    cfg = ModelConfig("llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=3, num_heads=2,
                      num_kv_heads=1, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                      max_model_len=64, tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False,
                      qk_norm=False, eos_token_ids=(), dtype="float32")
    w = Workload("x", [[Turn([1, 2, 3], 2)]], 1)
    weights = 3 * (2 * 4 * 4 + 2 * 4 * 2 + 3 * 4 * 8)       # q, o; k, v; gate, up, down
    positions = 3 + 2 - 1                                    # the prompt and the first output fed back
    pairs = 1 + 2 + 3 + 4                                    # causal: position i sees i + 1 keys
    assert bp.model_flops(cfg, w) == 2 * weights * positions + 2 * 4 * 10 * 2 + 4 * 3 * 4 * pairs


def test_ratios_are_to_llama_cpp_at_the_same_precision_and_the_peak_at_the_engines():
    def row(tps, ttft, tpot, seconds=1.0):
        return {"output_tokens_per_s": tps, "seconds": seconds, "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot},
                "round": 1}

    rows = {"engine": row(300, 50, 10), "engine-bf16": row(400, 40, 8), "hf-cb": {"error": "no"},
            "llama-f32": row(200, 100, 20), "llama-bf16": {"error": "cannot build llama-server: no cmake"},
            "llama-q4_1": row(100, 10, 5)}
    bp.compare(rows, flops=[5e9, 1e9], peaks={"fp32": 10.0, "bf16": 100.0})   # the best rounds were the second
    assert rows["engine"]["vs_llama_cpp"] == {"output_tokens_per_s": 1.5, "ttft_ms_p50": 0.5, "tpot_ms_p50": 0.5}
    assert rows["engine-bf16"]["vs_llama_cpp"] is None                  # its peer could not run
    assert rows["llama-q4_1"]["vs_llama_cpp"]["output_tokens_per_s"] == 1.0    # its own precision
    assert rows["llama-q4_1"]["share_of_peak"] is None
    assert rows["engine"]["share_of_peak"] == 0.1 and rows["engine-bf16"]["share_of_peak"] == 0.01
    assert "vs_llama_cpp" not in rows["hf-cb"]


def test_a_server_that_exits_is_reported_with_the_tail_of_its_log(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: failed to load model'\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(llamacpp.PeerError, match="exited with code 1:\nerror: failed to load model"), \
            llamacpp.serve(fake, tmp_path / "m.gguf", parallel=2, ctx_per_slot=64, threads=1, log=tmp_path / "l.log"):
        pass


def test_a_server_that_crashes_at_load_is_run_again_with_no_repack_and_says_so(monkeypatch, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'load_tensors: AMX model buffer size = 95 MiB'\nkill -SEGV $$\n")
    fake.chmod(0o755)
    with pytest.raises(llamacpp.Crashed, match="exited with code -11"), \
            llamacpp.serve(fake, tmp_path / "m.gguf", parallel=1, ctx_per_slot=64, threads=1, log=tmp_path / "l.log"):
        pass
    calls = []

    def serve(self, name, model_name, model, rounds, threads, vocab, extra=()):
        calls.append(extra)
        if not extra:
            raise llamacpp.Crashed("llama-server exited with code -11:\nload_tensors: AMX")
        return {"runs": [], "flags": {"extra": list(extra)}}

    monkeypatch.setattr(bp.Llama, "serve", serve)
    r = bp.Llama(str(fake), tmp_path).run("llama-q4_1", "smollm2-135m-instruct", "m", [], 1, 1000)
    assert calls == [(), ("--no-repack",)]
    assert r["note"] == "its defaults crashed it at load (llama-server exited with code -11): run with --no-repack"


def test_a_failed_build_is_tried_once_and_each_llama_engine_says_why(monkeypatch, tmp_path):
    calls = []

    def fail(log):
        calls.append(1)
        raise llamacpp.PeerError("cmake exited with code 1: no compiler")

    monkeypatch.setattr(llamacpp, "ensure_server", fail)
    llama = bp.Llama(None, tmp_path)
    w = bp.build("single", workload_args(), 1000, 0)
    args = Namespace(threads=1, model="smollm2-135m-instruct")
    for name in ("llama-f32", "llama-q4_1"):
        r = bp.measure(name, args, "unused", [w], llama, tmp_path, vocab=1000)
        assert r == {"error": "cannot build llama-server: cmake exited with code 1: no compiler"}
    assert calls == [1]


def test_peak_gflops_is_a_measured_rate():
    assert bp.peak_gflops("float32", n=64) > 0


def test_the_cli_takes_every_flag():
    args = parser().parse_args(["bench-peers", "--engines", "engine", "llama-f32", "--workloads", "single",
                                "--peak-gflops", "300", "--peak-gflops-bf16", "1500", "--repeat", "2"])
    assert args.engines == ["engine", "llama-f32"] and args.peak_gflops == 300 and args.func is not None
    assert parser().parse_args(["bench-peers"]).engines == list(bp.ENGINES)     # all, in the module's order
    for bad in (["--workloads", "nope"], ["--engines", "vllm"]):
        with pytest.raises(SystemExit):
            parser().parse_args(["bench-peers", *bad])


@pytest.mark.parametrize("name", ["engine", "hf-generate", "hf-generate-bf16", "hf-cb"])
def test_each_in_process_engine_runs_every_request_to_its_length(name, tiny_model):
    w = bp.build("chat", workload_args(conversations=2, turns=2), vocab=256, seed=0)
    r = bp.local(name, tiny_model, [w], threads=1)
    (run,) = r["runs"]
    assert run["output_tokens"] == run["output_tokens_asked"] == 16 and run["failed"] == 0
    assert run["ttft_ms"]["p50"] > 0 and run["tpot_ms"]["p50"] > 0 and r["peak_rss_bytes"] > 0


@pytest.mark.slow
def test_the_command_reports_the_peer_that_cannot_run_and_runs_the_rest(tiny_model, tmp_path, capsys):
    args = parser().parse_args([
        "bench-peers", "--model", tiny_model, "--engines", "engine", "llama-f32", "--workloads", "single",
        "--single-requests", "2", "--single-input-len", "8", "--single-output-len", "3", "--peak-gflops", "100",
        "--peak-gflops-bf16", "1000", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.svg")])
    report = bp.main(args)
    rows = report["workloads"]["single"]["engines"]
    assert rows["engine"]["output_tokens"] == 6 and rows["engine"]["vs_llama_cpp"] is None
    assert "llama.cpp serves a catalogue model" in rows["llama-f32"]["error"]
    assert orjson.loads((tmp_path / "r.json").read_bytes()) == orjson.loads(orjson.dumps(report))
    assert b"<svg" in (tmp_path / "r.svg").read_bytes()
    out = capsys.readouterr().out
    assert "llama-f32 (llama.cpp server, F32" in out and "unavailable: llama.cpp serves" in out


@pytest.mark.slow
def test_the_gguf_written_from_our_checkpoint_reads_back_as_the_checkpoint(smollm2, smollm2_gguf, tmp_path):
    from safetensors.torch import load_file

    from workers.models import gguf

    out = tmp_path / "bf16.gguf"
    llamacpp.write_gguf(Path(smollm2_gguf), Path(smollm2), out, "bf16")
    assert gguf.hf_config(out) == gguf.hf_config(smollm2_gguf, gguf.stored_dtype(out)) and \
        gguf.stored_dtype(out) == "bfloat16"
    assert gguf.meta(out, "tokenizer.ggml.tokens") == gguf.meta(smollm2_gguf, "tokenizer.ggml.tokens")
    ours = load_file(f"{smollm2}/model.safetensors")
    back = dict(gguf.tensors(out))
    assert back.keys() == ours.keys()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight", "model.norm.weight"):
        assert back[name][:].equal(ours[name].float()), name
    kinds = collections.Counter(t.tensor_type.name for t in gguf.read(out).tensors)
    assert set(kinds) == {"BF16", "F32"} and kinds["F32"] == 61              # the norms stay F32

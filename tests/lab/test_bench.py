"""`tokenbus bench` against fake gateways (tests/lab/fake_servers.py) that stream max_tokens one-token
chunks after a known TTFT and inter-token gap, over the websocket protocol and the OpenAI SSE API."""
import asyncio
import random

import orjson
import pytest

from lab.benchmarks import load as bench
from lab.common.corpus import Corpus, length
from lab.common.results import Result
from ops.cli import parser
from tests.lab.fake_servers import TIMER_SLACK_MS, serving

TTFT, ITL = 0.03, 0.004


def run(url: str, tiny_model: str, tmp_path, *extra: str) -> dict:
    args = parser().parse_args(["bench", "--url", url, "--model", tiny_model, "--num-requests", "12",
                                "--concurrency", "4", "--input-len", "32", "--output-len", "10", "--range-ratio", "0",
                                "--json", str(tmp_path / "r.json"), "--no-progress", *extra])
    report = bench.main(args)
    assert orjson.loads((tmp_path / "r.json").read_bytes()) == orjson.loads(orjson.dumps(report))
    return report


@pytest.mark.serial                   # it times the fake's stream
@pytest.mark.parametrize("proto", ["ws", "openai"])
def test_bench_measures_a_known_stream_and_writes_the_json_and_the_png(proto, tiny_model, tmp_path, capsys):
    with serving(ttft=TTFT, itl=ITL) as port:
        url = f"ws://127.0.0.1:{port}/ws" if proto == "ws" else f"http://127.0.0.1:{port}"
        r = run(url, tiny_model, tmp_path, "--plot", str(tmp_path / "p.png"))
    assert r["protocol"] == proto and r["requests"] == {"completed": 12, "failed": 0, "total": 12}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(r[key]) == {"mean", "p50", "p90", "p99"} and r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
    assert TTFT * 1e3 - TIMER_SLACK_MS <= r["ttft_ms"]["p50"] < TTFT * 1e3 + 60
    low = ITL * 1e3 - TIMER_SLACK_MS
    assert low <= r["tpot_ms"]["p50"] < ITL * 1e3 + 15 and low <= r["itl_ms"]["p50"] < ITL * 1e3 + 15
    assert r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"] + 9 * low
    assert r["output_tokens"] == 120 and r["output_tokens_per_s"] == pytest.approx(120 / r["duration_s"], rel=0.01)
    assert r["input_tokens"] > 0 and r["errors"] == {} and r["goodput"] is None     # no SLO given: no goodput
    assert r["client"]["cpu_us_per_token"] > 0 and r["client"]["cpu_share_of_one_core"] > 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "TTFT (ms)" in out and "requests completed / failed 12 / 0" in out


def test_both_plots_have_a_legend_naming_every_line_of_both_axes():
    results = [Result(start=i * 0.1, chunks=[i * 0.1 + 0.05 + j * 0.01 for j in range(5)], end=i * 0.1 + 0.1,
                            output_tokens=5) for i in range(20)]
    cdf, tput, twin = bench.figure(results).axes
    assert [t.get_text() for t in cdf.get_legend().get_texts()] == ["TTFT", "TPOT", "ITL", "E2E"]
    lines = [line.get_label() for line in tput.get_lines() + twin.get_lines()]
    assert [t.get_text() for t in tput.get_legend().get_texts()] == lines == ["output tokens/s",
                                                                               "requests completed/s"]


@pytest.mark.parametrize(("proto", "code"), [("ws", "too_many_requests"), ("openai", "rate_limited")])
def test_errors_are_counted_by_code_and_goodput_follows_the_slos(proto, code, tiny_model, tmp_path):
    with serving(ttft=TTFT, itl=ITL, fail_every=4) as port:
        url = f"ws://127.0.0.1:{port}/ws" if proto == "ws" else f"http://127.0.0.1:{port}"
        loose = run(url, tiny_model, tmp_path, "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000")
        tight = run(url, tiny_model, tmp_path, "--slo-ttft-ms", str(TTFT * 1e3 / 2))
    assert loose["requests"] == {"completed": 9, "failed": 3, "total": 12} and loose["errors"] == {code: 3}
    assert loose["goodput"]["good"] == 9 and loose["goodput"]["fraction"] == 0.75
    assert tight["goodput"]["good"] == 0 and tight["goodput"]["slo_tpot_ms"] is None


@pytest.mark.parametrize("proto", ["ws", "openai"])
def test_the_api_key_is_sent_as_a_bearer_token(proto, tiny_model, tmp_path):
    with serving(key="sk-1") as port:
        url = f"ws://127.0.0.1:{port}/ws" if proto == "ws" else f"http://127.0.0.1:{port}"
        r = run(url, tiny_model, tmp_path, "--api-key", "sk-1", "--num-requests", "2")
        assert r["requests"]["completed"] == 2
        if proto == "ws":
            with pytest.raises(ValueError, match="403"):
                run(url, tiny_model, tmp_path, "--api-key", "wrong")
        else:
            with pytest.raises(ValueError, match="/v1/models"):           # the model lookup is refused first
                run(url, tiny_model, tmp_path, "--api-key", "wrong")
            refused = run(url, tiny_model, tmp_path, "--api-key", "wrong", "--served-model", "fake-model")
            assert refused["errors"] == {"invalid_api_key": 12}


def test_poisson_arrivals_spread_the_requests_over_time(tiny_model, tmp_path):
    with serving(ttft=0.001, itl=0.0) as port:
        r = run(f"ws://127.0.0.1:{port}/ws", tiny_model, tmp_path, "--request-rate", "100", "--num-requests", "40")
    assert r["requests"]["completed"] == 40 and r["workload"]["request_rate"] == 100
    assert r["duration_s"] > 0.15                     # 40 arrivals at 100/s take about 0.4 s


def test_a_request_past_the_timeout_is_an_error_and_the_run_goes_on(tiny_model, tmp_path):
    with serving(ttft=1.0, itl=0.0) as port:
        r = run(f"ws://127.0.0.1:{port}/ws", tiny_model, tmp_path, "--timeout", "0.3", "--num-requests", "4")
    assert r["requests"]["failed"] == 4 and r["errors"] == {"timeout": 4}


class Recorder:
    """A client that answers every request with a reply naming its turn, and keeps what it was sent."""

    def __init__(self):
        self.sent: list[list[dict]] = []

    async def request(self, messages, max_tokens):
        self.sent.append([dict(m) for m in messages])
        r = Result(0.0, chunks=[0.01, 0.02], end=0.03, prompt_tokens=1, output_tokens=max_tokens)
        r.parts = [f"reply {len(messages) // 2}"]
        return r


def test_chat_conversations_send_their_history_and_average_the_scaled_seed_input(tiny_model):
    args = parser().parse_args(["bench", "--workload", "chat", "--num-requests", "10", "--turns", "4", "--scale",
                                "0.1", "--concurrency", "2", "--no-progress"])
    corpus = Corpus(bench.load_tokenizer(tiny_model))
    convs = bench.workload(args, corpus)
    assert [len(c.users) for c in convs] == [4, 4, 2] and all(c.max_tokens == [40] * len(c.users) for c in convs)
    user = len(corpus.tok.encode(convs[0].users[0]).ids)
    turn_inputs = [i * user + (i - 1) * 40 for i in range(1, 5)]
    assert sum(turn_inputs) / 4 == pytest.approx(300, rel=0.1)          # 3000 input tokens × 0.1
    rec = Recorder()
    results, _ = asyncio.run(bench.drive(args, convs, rec, bench.tqdm(disable=True)))
    assert len(results) == 10
    fourth = next(s for s in rec.sent if len(s) == 7)                    # turn 4: 4 user messages, 3 replies
    assert [m["role"] for m in fourth] == ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in fourth[1::2]] == ["reply 0", "reply 1", "reply 2"]


def test_shared_prefix_requests_start_with_one_of_a_few_system_prompts(tiny_model):
    args = parser().parse_args(["bench", "--workload", "shared-prefix", "--num-requests", "20", "--num-prefixes", "3",
                                "--prefix-len", "200", "--input-len", "20"])
    convs = bench.workload(args, Corpus(bench.load_tokenizer(tiny_model)))
    prefixes = {c.head[0]["content"] for c in convs}
    assert len(prefixes) == 3 and all(c.head[0]["role"] == "system" for c in convs)
    assert len({c.users[0] for c in convs}) == 20


def test_lengths_follow_their_distribution():
    rng = random.Random(0)
    uniform = [length(rng, 100, 0.5, "uniform") for _ in range(2000)]
    lognormal = [length(rng, 100, 0.5, "lognormal") for _ in range(4000)]
    assert min(uniform) >= 50 and max(uniform) <= 150 and sum(uniform) / 2000 == pytest.approx(100, rel=0.05)
    assert sum(lognormal) / 4000 == pytest.approx(100, rel=0.08) and max(lognormal) > 200
    assert {length(rng, 7, 0.0, "uniform") for _ in range(10)} == {7}


def test_a_dataset_file_gives_prompts_or_messages_with_their_max_tokens(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n'
                    '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}\n')
    convs = bench.dataset(path, 3, 16)
    assert [(c.head, c.users, c.max_tokens) for c in convs] == [
        ([], ["hello"], [3]), ([{"role": "system", "content": "be brief"}], ["hi"], [16]), ([], ["hello"], [3])]

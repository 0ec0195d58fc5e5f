"""Operations against the real stack (one worker, every service its own process): one grep follows a
request through every service's log, bench agrees with the gateway's own histograms, replay reproduces
greedy and seeded sampled requests and names the first position a changed engine setting changes."""
import asyncio
import json
import math
import os
import re
import signal
import time
import urllib.request

import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import bus
from lab.benchmarks import load as bench
from ops import procs, records, replay
from ops.cli import parser
from ops.status import read_registry
from schemas import subjects
from tests.e2e.conftest import WORKER_ARGS, collect, completions, connect, send, start_stack
from workers import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = start_stack(tiny_model, tmp_path_factory.mktemp("ops"), workers=1)
    yield s
    s.stop()


def generate(stack, frames: list[dict]) -> dict[str, dict]:
    async def run():
        async with connect(stack) as ws:
            for f in frames:
                await send(ws, {"type": "generate", **f})
            return await collect(ws, {f["id"] for f in frames})
    return asyncio.run(run())


def logs(stack) -> dict[str, list[dict]]:
    out = {}
    for name in ("gateway", "tokenizer", "router", "w0"):
        lines = (stack.data_dir / "logs" / f"{name}.log").read_text().splitlines()
        out[name] = [orjson.loads(line) for line in lines if line.startswith("{")]
    return out


def test_one_grep_of_the_request_id_follows_a_request_through_every_service(stack):
    generate(stack, [{"id": "grep-me", "prompt": "The engine", "max_tokens": 5}])
    time.sleep(0.5)                                               # the last log lines reach the files
    accepted = next(e for e in logs(stack)["gateway"] if e.get("client_id") == "grep-me")
    rid = accepted["request_id"]
    found = {name: [e for e in events if rid in orjson.dumps(e).decode()] for name, events in logs(stack).items()}
    assert {name: [e["event"] for e in events] for name, events in found.items()} == {
        "gateway": ["request accepted", "request ended"], "tokenizer": ["tokenized"], "router": ["routed"],
        "w0": ["request started", "request finished"]}
    for name, events in found.items():
        assert all(e["request_id"] == rid and e["tenant"] == "default" for e in events), name
    assert all(e["worker"] == "w0" for name in ("router", "w0") for e in found[name])
    assert found["gateway"][1]["worker"] == "w0"


def scrape(stack) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def buckets(before: dict, after: dict, name: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of what a histogram observed between two scrapes."""
    out = []
    for (sample, labels), value in after.items():
        if sample == f"{name}_bucket" and dict(labels)["tenant"] == "default":
            le = float(dict(labels)["le"])
            out.append((le, value - before.get((sample, labels), 0.0)))
    return sorted(out)


def quantile(q: float, bs: list[tuple[float, float]]) -> tuple[float, int]:
    """Prometheus' histogram_quantile (linear within a bucket) and the bucket's index."""
    rank, prev_le, prev_count = q * bs[-1][1], 0.0, 0.0
    for i, (le, count) in enumerate(bs):
        if count >= rank:
            value = prev_le if math.isinf(le) else prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
            return value, i
        prev_le, prev_count = le, count
    raise AssertionError("empty histogram")


def test_bench_writes_json_and_png_and_agrees_with_the_gateway_histograms(stack, tiny_model, tmp_path):
    settle = max(2 * subjects.HEARTBEAT_SECONDS, subjects.ROUTER_STATS_SECONDS) + 0.5
    time.sleep(settle)               # earlier tests' requests reach the workers' heartbeats and the router's stats
    before = scrape(stack)
    args = parser().parse_args(["bench", "--url", stack.url, "--model", tiny_model, "--num-requests", "24",
                                "--concurrency", "4", "--input-len", "48", "--output-len", "16", "--range-ratio", "0",
                                "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"),
                                "--no-progress"])
    bench.main(args)
    time.sleep(settle)
    after = scrape(stack)
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["requests"] == {"completed": 24, "failed": 0, "total": 24} and r["output_tokens"] == 24 * 16
    assert all(r[k]["p50"] > 0 for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")) and r["output_tokens_per_s"] > 0
    assert (tmp_path / "b.png").stat().st_size > 10_000

    def moved(name, labels=(("tenant", "default"),)):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("tokenbus_requests_total", (("finish_reason", "length"), ("tenant", "default"))) == 24
    assert moved("tokenbus_generation_tokens_total") == 24 * 16
    assert moved("tokenbus_worker_generation_tokens_total", (("worker", "w0"),)) == 24 * 16
    assert moved("tokenbus_worker_requests_finished_total", (("worker", "w0"),)) == 24
    assert moved("tokenbus_prefix_cache_queries_total", (("worker", "w0"),)) > 0
    assert after[("tokenbus_kv_blocks_total", (("worker", "w0"),))] == 512

    def routers(name):                                          # summed over the routers (one, named by its pid)
        return sum(v for (n, _), v in after.items() if n == name) - sum(v for (n, _), v in before.items() if n == name)

    assert routers("tokenbus_router_decisions_total") == 24 and routers("tokenbus_router_completed_total") == 24
    assert routers("tokenbus_router_prompt_tokens_total") == moved("tokenbus_prompt_tokens_total")
    assert after[("tokenbus_routers", ())] == 1
    for name, key in (("tokenbus_time_to_first_token_seconds", "ttft_ms"),
                      ("tokenbus_e2e_request_latency_seconds", "e2e_ms"),
                      ("tokenbus_time_per_output_token_seconds", "tpot_ms")):
        bs = buckets(before, after, name)
        assert bs[-1][1] == 24, name
        mean = (after[(f"{name}_sum", (("tenant", "default"),))] - before.get((f"{name}_sum", (("tenant", "default"),)),
                                                                              0.0)) / 24
        assert abs(r[key]["mean"] / 1e3 - mean) <= 0.25 * mean + 0.02, (name, r[key]["mean"], mean)
        bounds = [0.0] + [le for le, _ in bs]
        for q in (0.5, 0.9):
            seen = r[key][f"p{int(q * 100)}"] / 1e3
            # the client's percentile falls within the gateway's buckets of the quantiles q ± 0.15 (24 samples
            # leave gaps between order statistics), widened by one bucket each side
            lo, hi = quantile(max(q - 0.15, 0.01), bs)[1], quantile(min(q + 0.15, 1.0), bs)[1]
            assert bounds[max(lo - 1, 0)] <= seen <= bounds[min(hi + 2, len(bounds) - 1)], (name, q, seen, bs)


def record_of(nats_url: str, prompt: list[int]):
    return next(r for r in asyncio.run(completions(nats_url)) if r.prompt_token_ids == prompt)


def replay_args(stack, *args: str):
    return parser().parse_args(["replay", *args, "--nats-url", stack.nats_url, "--timeout", "60"])


def test_replay_reproduces_greedy_seeded_and_unseeded_sampled_and_stopped_requests(stack, tiny_model, tmp_path,
                                                                                    capsys):
    full = LLM(tiny_model).generate([[30, 31, 32, 33]], SamplingParams(max_tokens=40, temperature=0,
                                                                        ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:][:3]
    cases = [{"prompt_token_ids": [20, 21, 22, 23], "max_tokens": 24, "temperature": 0},
             {"prompt_token_ids": [24, 25, 26, 27], "max_tokens": 24, "temperature": 0.9, "seed": 11},
             {"prompt_token_ids": [28, 29, 30, 31], "max_tokens": 24, "temperature": 1.0, "top_k": 20},
             {"prompt_token_ids": [30, 31, 32, 33], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
              "stop": [stop]},
             {"prompt_token_ids": [34, 35, 36, 37], "max_tokens": 24, "temperature": 1.0, "seed": 5,
              "regex": "[0-9]{2,6}-[a-z]{1,8}"}]
    got = generate(stack, [{"id": f"c{i}", **c} for i, c in enumerate(cases)])
    assert got["c3"]["end"]["finish_reason"] == "stop"
    assert re.fullmatch("[0-9]{2,6}-[a-z]{1,8}", got["c4"]["text"]), got["c4"]
    time.sleep(0.5)
    recs = [record_of(stack.nats_url, c["prompt_token_ids"]) for c in cases]
    assert recs[2].sampling.seed is not None and recs[3].finish_reason == "abort"   # the tokenizer drew a seed
    assert recs[4].sampling.regex == "[0-9]{2,6}-[a-z]{1,8}"                      # the constraint is logged

    assert replay.main(replay_args(stack, "--last", "5", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == {"replayed": 5, "identical": 5, "skipped": 0, "diffs": []}

    for rec in (recs[1], recs[4]):                  # offline, from an exported file
        path = tmp_path / f"{rec.id}.jsonl"
        assert asyncio.run(records.export(stack.nats_url, path, request_id=rec.id)) == 1
        assert replay.main(replay_args(stack, "--file", str(path), "--model", tiny_model)) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[1].split()[:3] == [rec.id, "identical", str(len(rec.output_token_ids))]
        assert table[-1] == "1 replayed: 1 identical, 0 differing, 0 failed"


def test_a_worker_whose_heartbeat_only_lapsed_gets_work_again_and_nothing_loops(stack):
    """Stopped past WORKER_TTL (as a starved process is), the worker is declared gone: the router deletes
    its consumer and moves its queue. When it resumes, it recreates its consumer, and the router, finding it
    the only pick, leaves the rest to it instead of re-publishing to its own subject forever."""
    w0 = stack.children["w0"].pid

    async def run():
        async with connect(stack) as ws:
            os.kill(w0, signal.SIGSTOP)
            try:
                await send(ws, {"type": "generate", "id": "during", "prompt": "The engine", "max_tokens": 4,
                                    "ignore_eos": True})
                await asyncio.sleep(subjects.WORKER_TTL + 2)
            finally:
                os.kill(w0, signal.SIGCONT)
            async with asyncio.timeout(15):     # the gateway's admission refuses work while no worker is registered
                while not [b for b in await read_registry(stack.nats_url) if b.worker == "w0"]:
                    await asyncio.sleep(0.1)
            after = {"type": "generate", "id": "after", "prompt": "A paged", "max_tokens": 4, "ignore_eos": True}
            await send(ws, after)
            got = await collect(ws, {"during", "after"}, timeout=60)
            deadline = time.monotonic() + 10
            # the gateway's view of the registry may trail the test's read by a moment: retry, as Retry-After says
            while got["after"]["end"].get("code") == "unavailable" and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                await send(ws, after)
                got |= await collect(ws, {"after"}, timeout=60)
            return got

    got = asyncio.run(run())
    assert all(g["end"]["type"] == "done" and len(g["token_ids"]) == 4 for g in got.values()), got
    assert any(e["event"] == "worker left" for e in logs(stack)["router"])

    async def work_published():
        nc = await bus.connect(stack.nats_url, "test")
        try:
            return (await nc.jetstream().stream_info(subjects.WORK_STREAM)).state.last_seq
        finally:
            await nc.close()

    first = asyncio.run(work_published())
    time.sleep(1)
    assert asyncio.run(work_published()) == first < 1000                # no work item circles


def test_replay_names_the_first_position_a_changed_engine_setting_changes(stack, tiny_model, capsys):
    """The worker restarted in the other dtype (float32 where the default is bfloat16, and the reverse):
    replay of a request it served in the default differs exactly where the offline engine in the other
    dtype leaves the default's output."""
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42], [7, 300, 9, 1000, 12], [100, 200, 300, 400]]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    default = LLM(tiny_model)
    other = "float32" if default.engine.dtype == torch.bfloat16 else "bfloat16"
    logged = [o.token_ids for o in default.generate(prompts, params)]
    changed = [o.token_ids for o in LLM(tiny_model, dtype=other).generate(prompts, params)]
    where = [replay.first_difference(a, b) for a, b in zip(logged, changed)]
    k = next(i for i, p in enumerate(where) if p is not None and p > 0)
    got = generate(stack, [{"id": "dtype", "prompt_token_ids": prompts[k], "max_tokens": 64, "temperature": 0,
                            "ignore_eos": True}])["dtype"]
    assert got["token_ids"] == logged[k]
    time.sleep(0.5)
    rid = record_of(stack.nats_url, prompts[k]).id

    procs.stop([stack.children["w0"]])
    stack.spawn("w0", "workers.service", "--nats-url", stack.nats_url, "--model", tiny_model, "--id", "w0",
                *WORKER_ARGS, "--dtype", other)
    stack.wait_ready()
    assert replay.main(replay_args(stack, "--request-id", rid, "--json", "--model", tiny_model)) == 1
    result = json.loads(capsys.readouterr().out)
    assert (result["replayed"], result["identical"]) == (1, 0)
    [diff] = result["diffs"]
    assert diff["request_id"] == rid and diff["position"] == where[k]
    assert (diff["logged_token"], diff["replayed_token"]) == (logged[k][where[k]], changed[k][where[k]])
    assert diff["logged_text"] != diff["replayed_text"] and diff["replayed_tokens"] == 64

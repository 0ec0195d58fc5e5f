"""The gateway's /metrics: Prometheus text that the official parser reads, per-tenant request metrics that
move as requests run through the gateway (fake downstream), per-worker metrics from the heartbeats,
per-router metrics from the routers' stats records, the streams' sizes and the stages' consumers' lag from
JetStream, and the disaggregated series (roles, KV transfers, prefill decisions) from the collectors directly."""
import asyncio
import dataclasses
import time
import urllib.request

import nats.errors
import nats.js.errors
import orjson
import pytest
from nats.js import api
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer
from websockets.asyncio.client import connect

import bus
from schemas import subjects
from schemas.messages import Heartbeat, KvTransfer, RouterStats, Speculation, encode
from services.gateway.metrics import STAGES, Metrics, bus_infos, lagging
from tests.services.fake_pipeline import Downstream, gateway

HISTOGRAMS = ("tokenbus_time_to_first_token_seconds", "tokenbus_time_per_output_token_seconds",
              "tokenbus_e2e_request_latency_seconds", "tokenbus_queue_time_seconds")


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of everything /metrics exposes."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(scrape_text(url)) for s in family.samples}


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


async def slow_echo(down: Downstream, req) -> None:
    """Three tokens 20 ms apart, then a final chunk with the worker's timing."""
    await asyncio.sleep(0.02)
    ids = down.ids(" one two three")[:3]
    for i, t in enumerate(ids[:-1]):
        await down.publish(req.id, down.chunk(req.id, i, [t]))
        await asyncio.sleep(0.02)
    final = down.final(req.id, 2, ids[-1:])
    final.timing, final.worker = {"queue_ms": 12.0, "ttft_ms": 5.0, "e2e_ms": 50.0}, "w7"
    await down.publish(req.id, final)


def test_metrics_parse_and_move_as_requests_run_and_fail(nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")

    async def body():
        async with gateway(nats_url, tiny_model, tok, script=slow_echo) as down:
            before = await asyncio.to_thread(scrape, down.http)
            async with connect(down.ws) as ws:
                for i in range(2):
                    await ws.send(orjson.dumps({"type": "generate", "id": f"r{i}", "prompt": "hi"}).decode())
                await ws.send('{"type": "generate", "id": "bad", "prompt": "x", "max_tokens": 0}')
                ends = 0
                while ends < 3:
                    ends += orjson.loads(await ws.recv())["type"] in ("done", "error")
            return before, await asyncio.to_thread(scrape, down.http)

    before, after = asyncio.run(asyncio.wait_for(body(), 30))
    tenant = (("tenant", "default"),)
    assert not any(name.startswith(HISTOGRAMS) for name, _ in before)
    assert after[("tokenbus_requests_total", (("finish_reason", "length"), *tenant))] == 2
    assert after[("tokenbus_request_errors_total", (("code", "invalid_request"), *tenant))] == 1
    assert after[("tokenbus_generation_tokens_total", tenant)] == 6
    assert after[("tokenbus_prompt_tokens_total", tenant)] == 18
    for name in HISTOGRAMS:
        assert after[(f"{name}_count", tenant)] == 2, name
    assert 0.02 <= after[("tokenbus_time_to_first_token_seconds_sum", tenant)] / 2 < 1.0     # counts the wait
    assert 0.015 <= after[("tokenbus_time_per_output_token_seconds_sum", tenant)] / 2 < 1.0
    assert after[("tokenbus_queue_time_seconds_sum", tenant)] == 0.024
    le = after[("tokenbus_e2e_request_latency_seconds_bucket", (("le", "0.03"), *tenant))]
    assert le == 0 and after[("tokenbus_e2e_request_latency_seconds_bucket", (("le", "+Inf"), *tenant))] == 2


def test_worker_metrics_come_from_the_heartbeats_of_live_workers(nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")

    async def body():
        async with gateway(nats_url, tiny_model, tok, workers=0) as down:
            empty = await asyncio.to_thread(scrape, down.http)
            kv = await bus.registry(down.nc.jetstream())
            await kv.put("w1", encode(Heartbeat("w1", time.time(), "tiny", 16, 8, running=3, waiting=2,
                                                kv_blocks_total=64, kv_blocks_free=40, prefix_cache_queries=100,
                                                prefix_cache_hits=25, requests_finished=7, preemptions=1,
                                                prompt_tokens=300, generation_tokens=90)))
            await kv.put("w0", encode(Heartbeat("w0", time.time() - 60, "tiny", 16, 8, 9, 9, 9, 9, 9, 9, 9)))
            return empty, await asyncio.to_thread(scrape, down.http)

    empty, m = asyncio.run(asyncio.wait_for(body(), 30))
    assert empty[("tokenbus_workers", ())] == 0
    w1 = (("worker", "w1"),)
    assert m[("tokenbus_workers", ())] == 1                                   # w0's heartbeat is stale
    assert (m[("tokenbus_num_requests_running", w1)], m[("tokenbus_num_requests_waiting", w1)]) == (3, 2)
    assert (m[("tokenbus_kv_blocks_used", w1)], m[("tokenbus_kv_blocks_total", w1)]) == (24, 64)
    assert (m[("tokenbus_prefix_cache_queries_total", w1)], m[("tokenbus_prefix_cache_hits_total", w1)]) == (100, 25)
    assert m[("tokenbus_num_preemptions_total", w1)] == 1 and m[("tokenbus_worker_requests_finished_total", w1)] == 7
    assert m[("tokenbus_worker_prompt_tokens_total", w1)] == 300
    assert m[("tokenbus_worker_generation_tokens_total", w1)] == 90
    assert ("tokenbus_num_requests_running", (("worker", "w0"),)) not in m


def test_speculation_metrics_come_from_the_workers_that_speculate_and_are_absent_without_one(nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    plain = Heartbeat("w1", 0.0, "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0)
    spec = Speculation("ngram", k=3, k_max=4, adaptive=True, rows=2, acceptance_estimate=0.61, drafts=40,
                       draft_tokens=120, accepted_tokens=75, acceptance_rate=0.625, mean_acceptance_length=1.875,
                       acceptance_per_position=[0.8, 0.65, 0.5])

    async def body():
        async with gateway(nats_url, tiny_model, tok, workers=0) as down:
            kv = await bus.registry(down.nc.jetstream())
            await kv.put("w1", encode(dataclasses.replace(plain, ts=time.time())))
            without = await asyncio.to_thread(scrape_text, down.http)
            await kv.put("w2", encode(dataclasses.replace(plain, worker="w2", ts=time.time(), speculation=spec)))
            return without, await asyncio.to_thread(scrape, down.http)

    without, m = asyncio.run(asyncio.wait_for(body(), 30))
    assert "tokenbus_worker_requests_finished" in without and "tokenbus_spec_decode" not in without
    w2 = (("worker", "w2"),)
    expected = {"drafts_total": 40, "draft_tokens_total": 120, "accepted_tokens_total": 75, "k": 3,
                "acceptance_rate": 0.625, "mean_acceptance_length": 1.875, "acceptance_estimate": 0.61}
    assert {k: m[(f"tokenbus_spec_decode_{k}", w2)] for k in expected} == expected
    assert [m[("tokenbus_spec_decode_acceptance_by_position", (("position", str(i)), *w2))] for i in range(3)] == [
        0.8, 0.65, 0.5]
    spec_series = [labels for name, labels in m if name.startswith("tokenbus_spec_decode")]
    assert len(spec_series) == 10 and all(dict(labels)["worker"] == "w2" for labels in spec_series)   # none of w1


def test_router_metrics_come_from_the_stats_of_live_routers(nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")

    async def body():
        async with gateway(nats_url, tiny_model, tok) as down:
            empty = await asyncio.to_thread(scrape, down.http)
            now = time.time()
            live = RouterStats("r1", now, "prefix", routed=10, guarded=2, completed=8, prompt_tokens=800,
                               predicted_hit_tokens=480, actual_hit_tokens=512, exact=6, snapshots=3, gaps=1,
                               routed_to={"w0": 7, "w1": 3}, index_blocks={"w0": 40, "w1": 12})
            gone = RouterStats("r0", now - 60, "round-robin", 9, 9, 9, 9, 9, 9, 9, 9, 9)
            for stats in (live, gone):
                await down.nc.publish(subjects.router_stats(stats.router), encode(stats))
            await down.nc.publish(subjects.router_stats("r2"), b"garbage")
            await down.nc.flush()
            await asyncio.sleep(0.2)
            return empty, await asyncio.to_thread(scrape, down.http)

    empty, m = asyncio.run(asyncio.wait_for(body(), 30))
    assert empty[("tokenbus_routers", ())] == 0
    assert m[("tokenbus_routers", ())] == 1                                   # r0's record is stale, r2's garbage
    r1 = (("policy", "prefix"), ("router", "r1"))
    expected = {"decisions": 10, "guarded": 2, "completed": 8, "prompt_tokens": 800, "predicted_hit_tokens": 480,
                "actual_hit_tokens": 512, "exact_predictions": 6, "snapshot_requests": 3, "kv_event_gaps": 1}
    assert {k: m[(f"tokenbus_router_{k}_total", r1)] for k in expected} == expected
    assert m[("tokenbus_router_routed_total", (("router", "r1"), ("worker", "w0")))] == 7
    assert m[("tokenbus_router_routed_total", (("router", "r1"), ("worker", "w1")))] == 3
    assert m[("tokenbus_router_index_blocks", (("router", "r1"), ("worker", "w0")))] == 40
    assert not any(dict(labels).get("router") in ("r0", "r2") for _, labels in m)


def test_bus_metrics_count_each_streams_messages_and_the_stages_consumers_undelivered_and_unacked(nats_url,
                                                                                                   tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")

    async def body():
        async with gateway(nats_url, tiny_model, tok, requests=False) as down:    # fake0 has a heartbeat
            js = down.nc.jetstream()
            before = await asyncio.to_thread(scrape, down.http)
            await js.add_consumer(subjects.REQUESTS_STREAM, bus.router())
            await js.add_consumer(subjects.WORK_STREAM, bus.worker_consumer("fake0"))
            for i in range(3):
                await js.publish(subjects.request_new("t", f"r{i}"), b"request")
                await js.publish(subjects.work("fake0", f"r{i}"), b"work item")
            await js.publish(subjects.dead("t", "r0"), b"dead letter")
            router = await js.pull_subscribe_bind(subjects.ROUTER_DURABLE, subjects.REQUESTS_STREAM)
            taken = []
            while len(taken) < 3:
                taken += await router.fetch(3 - len(taken), timeout=5)
            for msg in taken:                                        # the router routed all three
                await msg.ack_sync()
            worker = await js.pull_subscribe_bind(subjects.worker_durable("fake0"), subjects.WORK_STREAM)
            await worker.fetch(1, timeout=5)                         # the worker runs one, not acked yet
            return before, await asyncio.to_thread(scrape, down.http)

    before, m = asyncio.run(asyncio.wait_for(body(), 30))
    streams = {dict(labels)["stream"]: v for (name, labels), v in before.items() if name == "tokenbus_stream_messages"}
    assert streams == dict.fromkeys(subjects.STREAM_NAMES, 0)
    consumers = {tuple(sorted(dict(labels).values())) for name, labels in before
                 if name == "tokenbus_consumer_pending_messages"}
    assert consumers == {("TB_USAGE", "recorder")}           # made with its stream; the others not made yet

    def held(name, stream):
        return m[(name, (("stream", stream),))]

    assert held("tokenbus_stream_messages", "TB_DEAD") == 1 and held("tokenbus_stream_bytes", "TB_DEAD") > 0
    assert held("tokenbus_stream_messages_stored_total", "TB_DEAD") == 1
    assert held("tokenbus_stream_messages", "TB_REQUESTS") == 3 and held("tokenbus_stream_messages", "TB_WORK") == 3
    assert held("tokenbus_stream_messages", "TB_RESULTS") == 0

    def lag(stream, consumer):
        labels = (("consumer", consumer), ("stream", stream))
        return m[("tokenbus_consumer_pending_messages", labels)], m[("tokenbus_consumer_ack_pending_messages", labels)]

    assert lag("TB_REQUESTS", "router") == (0, 0)
    assert lag("TB_WORK", "worker-fake0") == (2, 1)
    assert lag("TB_USAGE", "recorder") == (0, 0)
    assert ("tokenbus_consumer_pending_messages", (("consumer", "router"), ("stream", "TB_ROUTE"))) not in m


class Log:
    def __init__(self):
        self.warnings = []

    def warning(self, event, **fields):
        self.warnings.append((event, fields))


def test_bus_reads_that_fail_or_take_too_long_are_left_out_and_logged_in_one_line(monkeypatch):
    monkeypatch.setattr("services.gateway.metrics.READ_TIMEOUT", 0.05)

    class Js:
        async def stream_info(self, name):
            if name == subjects.WORK_STREAM:
                raise nats.errors.TimeoutError
            if name == subjects.DEAD_STREAM:
                await asyncio.sleep(1)                                      # past READ_TIMEOUT
            if name == subjects.ROUTE_STREAM:
                raise nats.js.errors.NotFoundError                          # not made yet: no failure
            return api.StreamInfo(api.StreamConfig(name=name), api.StreamState(5, 500, 1, 5, 1))

        async def consumer_info(self, stream, durable):
            raise nats.js.errors.NotFoundError

    class Broken(Js):
        async def consumer_info(self, stream, durable):
            return 1 / 0

    log = Log()
    streams, consumers = asyncio.run(bus_infos(Js(), ["w0"], log))
    assert [i.config.name for i in streams] == ["TB_REQUESTS", "TB_RESULTS", "TB_USAGE"] and consumers == []
    assert [(event, fields["reads"], fields["of"]) for event, fields in log.warnings] == [("bus read failed", 2, 11)]
    assert lagging(["w0", "bad id"]) == [*STAGES, ("TB_WORK", "worker-w0")]       # one stream each: no partitions
    with pytest.raises(ZeroDivisionError):                                  # a bug is raised, not logged
        asyncio.run(bus_infos(Broken(), [], log))


def collected(metrics) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a Metrics' registry, as the parser reads its text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in family.samples}


def test_kv_transfer_metrics_come_per_worker_and_role_from_disaggregated_workers_only():
    plain = Heartbeat("w0", time.time(), "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0)
    metrics = Metrics()
    metrics.workers.beats = [plain]
    without = generate_latest(metrics.registry).decode()
    assert "tokenbus_kv_transfer" not in without
    assert collected(metrics)[("tokenbus_worker_role", (("role", "both"), ("worker", "w0")))] == 1
    prefill = KvTransfer(handoffs=5, leases=2, served_blocks=40, served_bytes=12_000)
    decode = KvTransfer(transfers=5, pulled_blocks=38, pulled_bytes=11_400, cached_blocks=2, failures=1, recomputes=1,
                        transfer_seconds=0.25, transfer_ms_p50=40.0, transfer_ms_p99=90.5)
    metrics.workers.beats = [dataclasses.replace(plain, worker="d0", role="decode", kv_transfer=decode),
                             dataclasses.replace(plain, worker="p0", role="prefill", kv_transfer=prefill), plain]
    m = collected(metrics)
    d0, p0 = (("role", "decode"), ("worker", "d0")), (("role", "prefill"), ("worker", "p0"))
    assert [m[("tokenbus_worker_role", labels)] for labels in (d0, p0)] == [1, 1]
    counters = {"transfers": 5, "pulled_blocks": 38, "pulled_bytes": 11_400, "cached_blocks": 2, "failures": 1,
                "recomputes": 1, "seconds": 0.25, "handoffs": 0}
    assert {k: m[(f"tokenbus_kv_transfer_{k}_total", d0)] for k in counters} == counters
    assert (m[("tokenbus_kv_transfer_ms_p50", d0)], m[("tokenbus_kv_transfer_ms_p99", d0)]) == (40.0, 90.5)
    assert (m[("tokenbus_kv_transfer_handoffs_total", p0)], m[("tokenbus_kv_transfer_leases", p0)]) == (5, 2)
    assert (m[("tokenbus_kv_transfer_served_blocks_total", p0)], m[("tokenbus_kv_transfer_served_bytes_total", p0)]) \
        == (40, 12_000)
    kvx = [dict(labels)["worker"] for name, labels in m if name.startswith("tokenbus_kv_transfer")]
    assert len(kvx) == 2 * 13 and set(kvx) == {"d0", "p0"}                  # none of the colocated w0


def test_router_prefill_decisions_are_split_into_where_and_why_and_absent_without_prefill_workers():
    metrics = Metrics()
    metrics.routers.seen(RouterStats("r0", time.time(), "prefix", 3, 0, 3, 30, 0, 0, 0, 0, 0))
    assert "tokenbus_router_prefill" not in generate_latest(metrics.registry).decode()
    assert "tokenbus_router_handoffs" not in generate_latest(metrics.registry).decode()
    metrics.routers.seen(RouterStats("r1", time.time(), "prefix", 9, 0, 9, 900, 0, 0, 0, 0, 0, handoffs=4,
                                     prefill={"remote:long": 4, "local:short": 3, "local:prefill_queue": 2}))
    m = collected(metrics)
    decisions = {(dict(labels)["where"], dict(labels)["why"]): v for (name, labels), v in m.items()
                 if name == "tokenbus_router_prefill_decisions_total" and dict(labels)["router"] == "r1"}
    assert decisions == {("remote", "long"): 4, ("local", "short"): 3, ("local", "prefill_queue"): 2}
    assert m[("tokenbus_router_handoffs_total", (("router", "r1"),))] == 4
    assert not any(dict(labels).get("router") == "r0" for name, labels in m if "prefill" in name or "handoff" in name)


def test_kv_tier_metrics_come_per_worker_and_tier_from_workers_with_tiers_only():
    plain = Heartbeat("w0", time.time(), "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0)
    metrics = Metrics()
    metrics.workers.beats = [plain]
    assert "tokenbus_kv_tier" not in generate_latest(metrics.registry).decode()
    tiers = {"host_hits": 7.0, "host_blocks": 3.0, "host_bytes": 3e6, "host_bytes_in": 9e6, "host_bytes_out": 7e6,
             "host_seconds": 0.01, "disk_hits": 2.0, "disk_blocks": 40.0, "disk_bytes": 4e7, "disk_bytes_in": 4e7,
             "disk_bytes_out": 2e6, "disk_seconds": 0.5, "disk_corrupt": 0.0}
    metrics.workers.beats = [dataclasses.replace(plain, worker="w1", kv_tiers=tiers), plain]
    m = collected(metrics)
    host, disk = (("tier", "host"), ("worker", "w1")), (("tier", "disk"), ("worker", "w1"))
    assert (m[("tokenbus_kv_tier_hits_total", host)], m[("tokenbus_kv_tier_hits_total", disk)]) == (7, 2)
    assert (m[("tokenbus_kv_tier_bytes", disk)], m[("tokenbus_kv_tier_seconds_total", disk)]) == (4e7, 0.5)
    assert {dict(labels)["worker"] for name, labels in m if name.startswith("tokenbus_kv_tier")} == {"w1"}

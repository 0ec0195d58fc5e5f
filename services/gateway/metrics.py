"""Prometheus metrics at /metrics, for the whole cluster, from two sources:
- what this gateway sees of each request it serves (per tenant): latency histograms, tokens,
  finish reasons and error codes. TTFT runs from the generate frame's arrival to the first token,
  so it counts every queue on the way (JetStream, tokenizer, router, the worker's waiting list);
- what every worker pushes over NATS in its heartbeat (per worker, read from the tb_workers
  bucket at scrape time): running and waiting requests, KV blocks, prefix-cache tokens,
  preemptions, tokens and finished requests, counted since the worker started; for a worker that
  speculates, its drafts, their acceptance and its current k (tokenbus_spec_decode_*); its role
  (tokenbus_worker_role); for a disaggregated worker, its KV transfers (tokenbus_kv_transfer_*, by
  worker and role); for a worker with a prefix cache in tiers, each tier's hits, blocks, bytes and copy
  time (tokenbus_kv_tier_*, by worker and tier);
- what every router pushes on tb.router.stats.<router> each second (per router, the latest record
  kept by a core subscription): its decisions per worker, the guard's interventions, the
  predicted vs actual prefix-hit tokens of the requests it routed, and with prefill workers where it
  had each prompt prefilled and why, and its handoffs to decode workers, counted since it started;
- what JetStream says at scrape time (stream and consumer infos, one API request each, all at once): every
  tokenbus stream's messages and bytes (TB_DEAD's: the dead letters), and the lag of the stages' durable
  consumers: the routers' on TB_REQUESTS and TB_ROUTE, each live worker's on TB_WORK, the recorders' on
  TB_USAGE and TB_RESULTS (tokenbus_stream_*, tokenbus_consumer_*; each partition's stream by its name).
With several gateways, sum the per-tenant series over them; the per-worker, per-router and bus series
are the same on every gateway."""
import asyncio
import contextlib
import time

import nats.errors
import nats.js.errors
from nats.js import api
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bus import live_workers
from schemas import subjects
from schemas.messages import Heartbeat, RouterStats, decode
from schemas.wire import WireError

disable_created_metrics()                  # no *_created series: counters start at the process's start

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
           5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
PER_TOKEN = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
             0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
READ_TIMEOUT = 2.0
ROUTER_TTL = 3 * subjects.ROUTER_STATS_SECONDS     # a router silent for this long has left

# heartbeat field -> (metric name, kind, help); labelled by worker
WORKER_METRICS = {
    "running": ("tokenbus_num_requests_running", "gauge", "Requests in the engine's running batch."),
    "waiting": ("tokenbus_num_requests_waiting", "gauge", "Requests waiting in the engine for a slot."),
    "kv_blocks_used": ("tokenbus_kv_blocks_used", "gauge", "KV cache blocks in use."),
    "kv_blocks_total": ("tokenbus_kv_blocks_total", "gauge", "KV cache blocks in the pool."),
    "prefix_cache_queries": ("tokenbus_prefix_cache_queries", "counter", "Prompt tokens looked up in the cache."),
    "prefix_cache_hits": ("tokenbus_prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache."),
    "preemptions": ("tokenbus_num_preemptions", "counter", "Requests preempted (recomputed later)."),
    "forks": ("tokenbus_num_forks", "counter", "Choices (n > 1) admitted onto a sibling's computed prompt."),
    "prompt_tokens": ("tokenbus_worker_prompt_tokens", "counter", "Prompt tokens of the requests a worker took."),
    "generation_tokens": ("tokenbus_worker_generation_tokens", "counter", "Tokens a worker generated."),
    "requests_finished": ("tokenbus_worker_requests_finished", "counter", "Requests a worker finished."),
}
# Heartbeat.speculation field -> (metric name, kind, help); labelled by worker, for the workers that speculate
SPEC_METRICS = {
    "drafts": ("tokenbus_spec_decode_drafts", "counter", "Requests' verify steps that had draft tokens."),
    "draft_tokens": ("tokenbus_spec_decode_draft_tokens", "counter", "Draft tokens verified."),
    "accepted_tokens": ("tokenbus_spec_decode_accepted_tokens", "counter", "Draft tokens accepted."),
    "k": ("tokenbus_spec_decode_k", "gauge", "Draft tokens per request the worker last chose (0: off)."),
    "acceptance_rate": ("tokenbus_spec_decode_acceptance_rate", "gauge", "Accepted over verified draft tokens."),
    "mean_acceptance_length": ("tokenbus_spec_decode_mean_acceptance_length", "gauge",
                               "Accepted draft tokens per verify step that had drafts."),
    "acceptance_estimate": ("tokenbus_spec_decode_acceptance_estimate", "gauge",
                            "The moving average of the per-token acceptance that an adaptive k is chosen by."),
}

# Heartbeat.kv_transfer field -> (metric name, kind, help); labelled by worker and role, for disaggregated workers
KV_TRANSFER_METRICS = {
    "handoffs": ("tokenbus_kv_transfer_handoffs", "counter", "Requests a prefill worker prefilled and handed off."),
    "leases": ("tokenbus_kv_transfer_leases", "gauge", "KV offers a prefill worker holds pinned for decode workers."),
    "served_blocks": ("tokenbus_kv_transfer_served_blocks", "counter", "KV blocks a prefill worker served."),
    "served_bytes": ("tokenbus_kv_transfer_served_bytes", "counter", "Bytes of KV a prefill worker served."),
    "transfers": ("tokenbus_kv_transfer_transfers", "counter",
                  "Handed-off requests whose KV a decode worker pulled or tried to."),
    "pulled_blocks": ("tokenbus_kv_transfer_pulled_blocks", "counter", "KV blocks a decode worker pulled."),
    "pulled_bytes": ("tokenbus_kv_transfer_pulled_bytes", "counter", "Bytes of KV a decode worker pulled."),
    "cached_blocks": ("tokenbus_kv_transfer_cached_blocks", "counter",
                      "Offered KV blocks a decode worker held already (not pulled)."),
    "failures": ("tokenbus_kv_transfer_failures", "counter",
                 "Transfers that failed (a timeout, a gone prefill worker, a mismatch)."),
    "recomputes": ("tokenbus_kv_transfer_recomputes", "counter",
                   "Requests that computed the KV a failed transfer lacked."),
    "transfer_seconds": ("tokenbus_kv_transfer_seconds", "counter", "Time spent in transfers, all together."),
    "transfer_ms_p50": ("tokenbus_kv_transfer_ms_p50", "gauge", "Median transfer time over the recent transfers, ms."),
    "transfer_ms_p99": ("tokenbus_kv_transfer_ms_p99", "gauge", "99th percentile of the recent transfer times, ms."),
}

# Heartbeat.kv_tiers key after "<tier>_" -> (metric name, kind, help); labelled by worker and tier (host, disk),
# for the workers with a prefix cache in tiers
KV_TIER_METRICS = {
    "hits": ("tokenbus_kv_tier_hits", "counter", "Prefix-cache blocks copied up to the pool from this tier."),
    "blocks": ("tokenbus_kv_tier_blocks", "gauge", "Blocks this tier holds."),
    "bytes": ("tokenbus_kv_tier_bytes", "gauge", "Bytes this tier holds."),
    "bytes_in": ("tokenbus_kv_tier_bytes_in", "counter", "Bytes copied down into this tier."),
    "bytes_out": ("tokenbus_kv_tier_bytes_out", "counter", "Bytes copied up from this tier."),
    "seconds": ("tokenbus_kv_tier_seconds", "counter", "Time spent copying into and out of this tier."),
}


class Workers:
    """A collector of the latest heartbeats (set just before each scrape)."""

    def __init__(self):
        self.beats: list[Heartbeat] = []

    def collect(self):
        live = GaugeMetricFamily("tokenbus_workers", "Workers with a live heartbeat.", value=len(self.beats))
        role = GaugeMetricFamily("tokenbus_worker_role", "1 for each live worker, labelled with its role (both: "
                                 "colocated; prefill, decode: disaggregated).", labels=["worker", "role"])
        for hb in self.beats:
            role.add_metric([hb.worker, hb.role], 1)
        families = [live, role, *per_worker(WORKER_METRICS, [([hb.worker], hb) for hb in self.beats], value)]
        spec = [([hb.worker], hb.speculation) for hb in self.beats if hb.speculation is not None]
        if spec:                           # none: no series, not even their HELP lines
            families += per_worker(SPEC_METRICS, spec, getattr)
            by_position = GaugeMetricFamily("tokenbus_spec_decode_acceptance_by_position", "Accepted over verified "
                                            "draft tokens at each draft position (0: the first draft).",
                                            labels=["worker", "position"])
            for (worker,), s in spec:
                for i, rate in enumerate(s.acceptance_per_position):
                    by_position.add_metric([worker, str(i)], rate)
            families.append(by_position)
        kvx = [([hb.worker, hb.role], hb.kv_transfer) for hb in self.beats if hb.kv_transfer is not None]
        if kvx:                            # no disaggregated worker: no series
            families += per_worker(KV_TRANSFER_METRICS, kvx, getattr, ["worker", "role"])
        tiers = [([hb.worker, t], (t, hb.kv_tiers)) for hb in self.beats for t in ("host", "disk")
                 if f"{t}_hits" in hb.kv_tiers]
        if tiers:                          # no worker with tiers: no series
            families += per_worker(KV_TIER_METRICS, tiers, lambda src, f: src[1].get(f"{src[0]}_{f}", 0),
                                   ["worker", "tier"])
        return families


def per_worker(metrics: dict, sources: list[tuple[list[str], object]], read, labels=("worker",)) -> list:
    """A family per metric, a sample per (label values, source): read(source, field)."""
    families = []
    for field, (name, kind, doc) in metrics.items():
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=list(labels))
        for values, source in sources:
            family.add_metric(values, read(source, field))
        families.append(family)
    return families


# RouterStats field -> (metric name, help); counters labelled by router
ROUTER_COUNTERS = {
    "routed": ("tokenbus_router_decisions", "Routing decisions, re-routes included."),
    "guarded": ("tokenbus_router_guarded", "Decisions where the load guard ruled out a worker."),
    "completed": ("tokenbus_router_completed", "Routed requests whose completion the router has seen."),
    "prompt_tokens": ("tokenbus_router_prompt_tokens", "Prompt tokens of the completed routed requests."),
    "predicted_hit_tokens": ("tokenbus_router_predicted_hit_tokens",
                             "Prefix-cache hit tokens the router predicted for the completed requests."),
    "actual_hit_tokens": ("tokenbus_router_actual_hit_tokens",
                          "Prefix-cache hit tokens the workers reported for the same requests."),
    "exact": ("tokenbus_router_exact_predictions", "Completed requests whose actual hit equalled the prediction."),
    "snapshots": ("tokenbus_router_snapshot_requests", "KV snapshots the router asked workers for."),
    "gaps": ("tokenbus_router_kv_event_gaps", "Gaps seen in the workers' KV event sequence numbers."),
}


class Routers:
    """A collector of the latest RouterStats of every router (fed by a core subscription)."""

    def __init__(self):
        self.latest: dict[str, RouterStats] = {}

    def seen(self, stats: RouterStats) -> None:
        self.latest[stats.router] = stats

    def live(self) -> list[RouterStats]:
        now = time.time()
        for name in [n for n, s in self.latest.items() if now - s.ts >= ROUTER_TTL]:
            del self.latest[name]
        return sorted(self.latest.values(), key=lambda s: s.router)

    def collect(self):
        routers = self.live()
        families = [GaugeMetricFamily("tokenbus_routers", "Routers publishing their stats.", value=len(routers))]
        for field, (name, doc) in ROUTER_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["router", "policy"])
            for s in routers:
                family.add_metric([s.router, s.policy], getattr(s, field))
            families.append(family)
        routed = CounterMetricFamily("tokenbus_router_routed", "Decisions per chosen worker.",
                                     labels=["router", "worker"])
        index = GaugeMetricFamily("tokenbus_router_index_blocks", "Block hashes in the router's index of "
                                  "a worker's prefix cache.", labels=["router", "worker"])
        for s in routers:
            for worker, n in sorted(s.routed_to.items()):
                routed.add_metric([s.router, worker], n)
            for worker, n in sorted(s.index_blocks.items()):
                index.add_metric([s.router, worker], n)
        return [*families, routed, index, *prefill_families(routers)]


def prefill_families(routers: list[RouterStats]) -> list:
    """Where each router had prompts prefilled and why ("remote:long" -> where=remote, why=long), and its
    handoffs; none while no router has made a prefill decision or a handoff (no prefill workers)."""
    pd = [s for s in routers if s.prefill or s.handoffs]
    if not pd:
        return []
    decisions = CounterMetricFamily("tokenbus_router_prefill_decisions", "Where the router had a prompt prefilled "
                                    "(remote: a prefill worker, local: its decode worker) and why.",
                                    labels=["router", "where", "why"])
    handoffs = CounterMetricFamily("tokenbus_router_handoffs", "Prefilled requests the router placed on a decode "
                                   "worker.", labels=["router"])
    for s in pd:
        for key, n in sorted(s.prefill.items()):
            where, _, why = key.partition(":")
            decisions.add_metric([s.router, where, why], n)
        handoffs.add_metric([s.router], s.handoffs)
    return [decisions, handoffs]


def value(hb: Heartbeat, field: str) -> float:
    return hb.kv_blocks_total - hb.kv_blocks_free if field == "kv_blocks_used" else getattr(hb, field)


class BreakerState:
    """A collector of the fallback's circuit breaker state (closed, open, half_open: its cooldown is over)."""

    def __init__(self, breaker):
        self.breaker = breaker

    def collect(self):
        state = self.breaker.shown(time.monotonic())
        family = GaugeMetricFamily("tokenbus_fallback_breaker_state", "The fallback upstream's circuit breaker: 1 "
                                   "for its state (closed: forwarding; open: not, for the cooldown; half_open: the "
                                   "next request probes).", labels=["state"])
        for s in ("closed", "open", "half_open"):
            family.add_metric([s], float(s == state))
        return [family]


class Bus:
    """A collector of the streams' and the stages' consumers' infos (read just before each scrape)."""

    def __init__(self):
        self.streams: list[api.StreamInfo] = []
        self.consumers: list[api.ConsumerInfo] = []

    def collect(self):
        messages = GaugeMetricFamily("tokenbus_stream_messages", "Messages a tokenbus stream holds (TB_DEAD's: the "
                                     "dead letters of the last LOG_MAX_AGE, 7 days).", labels=["stream"])
        size = GaugeMetricFamily("tokenbus_stream_bytes", "Bytes a tokenbus stream holds.", labels=["stream"])
        stored = CounterMetricFamily("tokenbus_stream_messages_stored", "Messages a tokenbus stream has stored since "
                                     "it was made, those removed since included (its last sequence number).",
                                     labels=["stream"])
        for info in self.streams:
            name, state = info.config.name, info.state
            messages.add_metric([name], state.messages)
            size.add_metric([name], state.bytes)
            stored.add_metric([name], state.last_seq)
        pending = GaugeMetricFamily("tokenbus_consumer_pending_messages", "Messages a stage's durable consumer has "
                                    "not delivered yet (JetStream's num_pending): its lag.",
                                    labels=["stream", "consumer"])
        unacked = GaugeMetricFamily("tokenbus_consumer_ack_pending_messages", "Messages a stage's durable consumer "
                                    "delivered and not acked yet (JetStream's num_ack_pending): in work, or waiting "
                                    "out ack_wait to be delivered again.", labels=["stream", "consumer"])
        for info in self.consumers:
            pending.add_metric([info.stream_name, info.name], info.num_pending)
            unacked.add_metric([info.stream_name, info.name], info.num_ack_pending)
        return [messages, size, stored, pending, unacked]


# (stream, durable) of the stages' consumers whose lag /metrics shows, besides each live worker's on TB_WORK
STAGES = [(subjects.REQUESTS_STREAM, subjects.ROUTER_DURABLE), (subjects.ROUTE_STREAM, subjects.ROUTER_DURABLE),
          (subjects.USAGE_STREAM, subjects.RECORDER_DURABLE), (subjects.RESULTS_STREAM, subjects.RECORDER_DURABLE)]


def lagging(workers: list[str]) -> list[tuple[str, str]]:
    """(stream, durable) of STAGES and of each worker's work consumer, in every partition."""
    work = [(subjects.WORK_STREAM, subjects.worker_durable(w)) for w in workers if subjects.TOKEN.fullmatch(w)]
    return [(subjects.stream(base, p), durable) for base, durable in [*STAGES, *work] for p in subjects.parts()]


async def bus_infos(js, workers: list[str], log) -> tuple[list[api.StreamInfo], list[api.ConsumerInfo]]:
    """The infos of every tokenbus stream (each partition's) and of the consumers lagging(workers) names, asked
    all at once, each answer awaited READ_TIMEOUT at most. A stream or consumer not made yet is left out (it
    holds nothing); so is one whose read failed, the failures logged in one line."""
    streams = [subjects.stream(base, p) for base in subjects.STREAM_NAMES for p in subjects.parts()]
    reads = [*map(js.stream_info, streams), *(js.consumer_info(name, durable) for name, durable in lagging(workers))]
    answers = await asyncio.gather(*(asyncio.wait_for(r, READ_TIMEOUT) for r in reads), return_exceptions=True)
    failed = [a for a in answers if isinstance(a, BaseException) and not isinstance(a, nats.js.errors.NotFoundError)]
    for e in failed:
        if not isinstance(e, nats.errors.Error | TimeoutError):
            raise e
    if failed:
        e = failed[0]
        log.warning("bus read failed", reads=len(failed), of=len(reads), error=str(e) or type(e).__name__)
    streams = [a for a in answers if isinstance(a, api.StreamInfo)]
    return streams, [a for a in answers if isinstance(a, api.ConsumerInfo)]


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("tokenbus_time_to_first_token_seconds", "From the request's arrival at the gateway "
                              "to its first token, queueing included.", ["tenant"], buckets=LATENCY, registry=r)
        self.tpot = Histogram("tokenbus_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", ["tenant"], buckets=PER_TOKEN, registry=r)
        self.e2e = Histogram("tokenbus_e2e_request_latency_seconds", "From the request's arrival at the gateway "
                             "to its last frame.", ["tenant"], buckets=LATENCY, registry=r)
        self.queue = Histogram("tokenbus_queue_time_seconds", "From acceptance at the gateway until a worker took "
                               "the request.", ["tenant"], buckets=LATENCY, registry=r)
        self.requests = Counter("tokenbus_requests", "Requests finished, by finish reason.",
                                ["tenant", "finish_reason"], registry=r)
        self.errors = Counter("tokenbus_request_errors", "Error frames sent, by code.", ["tenant", "code"], registry=r)
        self.prompt_tokens = Counter("tokenbus_prompt_tokens", "Prompt tokens of finished requests.", ["tenant"],
                                     registry=r)
        self.generation_tokens = Counter("tokenbus_generation_tokens", "Tokens generated for finished requests.",
                                         ["tenant"], registry=r)
        self.recoveries = Counter("tokenbus_stream_checks", "Streams checked for missing tokens, by cause (gap: a "
                                  "chunk came past missing ones; stall: silent for STALL_SECONDS; resume: a client "
                                  "resumed the stream) and by what answered (outcome: its end record, resend: "
                                  "the worker, none).", ["cause", "source"], registry=r)
        self.deadlines = Counter("tokenbus_request_timeouts", "Requests ended with a timeout error at the gateway's "
                                 "--request-timeout.", ["tenant"], registry=r)
        self.fallbacks = Counter("tokenbus_fallback_requests", "Requests the cluster could not take that went to the "
                                 "fallback upstream, by outcome (ok; failed: a connect error, timeout, 5xx or cut "
                                 "stream; refused: the upstream's 4xx; aborted: the client left; open: not "
                                 "forwarded, the breaker is open).", ["tenant", "outcome"], registry=r)
        self.lease_round_trips = Counter("tokenbus_rate_limit_lease_round_trips", "Compare-and-set round trips to "
                                         "tenants' shared token buckets (tb_limits), by what they did: draw (a "
                                         "request the lease did not cover) or give_back.", ["op"], registry=r)
        self.lease_conflicts = Counter("tokenbus_rate_limit_lease_conflicts", "Compare-and-sets on tb_limits that "
                                       "another gateway's came before, read again and retried.", registry=r)
        self.limits_fallback = Gauge("tokenbus_rate_limit_fallback", "1 while tb_limits is unreachable and this "
                                     "gateway admits from 1/N of each tenant's limit, else 0.", registry=r)
        self.limits_gateways = Gauge("tokenbus_rate_limit_gateways", "Live gateways sharing the tenants' limits "
                                     "(N), as this gateway last counted them.", registry=r)
        self.connections = Gauge("tokenbus_gateway_connections", "Clients this gateway serves now: open websockets "
                                 "and HTTP requests in flight (an SSE stream is one until its last event).",
                                 registry=r)
        self.workers = Workers()
        r.register(self.workers)
        self.routers = Routers()
        r.register(self.routers)
        self.bus = Bus()
        r.register(self.bus)

    async def on_router_stats(self, msg) -> None:
        with contextlib.suppress(WireError):               # a bad record is not worth a log line a second
            self.routers.seen(decode(msg.data, RouterStats))

    def observe(self, tenant: str, frame: dict, queue_ms: float | None = None) -> None:
        """Counts a request's last frame: a done frame (its timing in ms, its usage) or an error frame."""
        if frame["type"] == "error":
            self.error(tenant, frame["code"])
            return
        self.requests.labels(tenant, frame["finish_reason"]).inc()
        usage, timing = frame["usage"], frame["timing"]
        self.prompt_tokens.labels(tenant).inc(usage["prompt_tokens"])
        self.generation_tokens.labels(tenant).inc(usage["completion_tokens"])
        ttft, e2e, n = timing["ttft_ms"], timing["e2e_ms"], usage["completion_tokens"]
        self.e2e.labels(tenant).observe(e2e / 1e3)
        if ttft is not None:
            self.ttft.labels(tenant).observe(ttft / 1e3)
            if n > 1:
                self.tpot.labels(tenant).observe((e2e - ttft) / 1e3 / (n - 1))
        if queue_ms is not None:
            self.queue.labels(tenant).observe(queue_ms / 1e3)

    def error(self, tenant: str, code: str) -> None:
        self.errors.labels(tenant, code).inc()

    def fallback(self, tenant: str, outcome: str) -> None:
        self.fallbacks.labels(tenant, outcome).inc()

    def watch(self, breaker) -> None:
        """tokenbus_fallback_breaker_state{state}: 1 for the fallback breaker's state, 0 for the others."""
        self.registry.register(BreakerState(breaker))

    def recovered(self, cause: str, source: str) -> None:
        self.recoveries.labels(cause, source).inc()

    def deadline(self, tenant: str) -> None:
        self.deadlines.labels(tenant).inc()

    async def render(self, kv, log, js=None) -> bytes:
        """The registry's text, the heartbeats (kv: the tb_workers bucket) and, given the JetStream context,
        the bus's stream and consumer infos read first."""
        self.workers.beats = await heartbeats(kv, log)
        workers = [hb.worker for hb in self.workers.beats]
        if js is not None:
            self.bus.streams, self.bus.consumers = await bus_infos(js, workers, log)
        return generate_latest(self.registry)


async def heartbeats(kv, log) -> list[Heartbeat]:
    """The latest heartbeat of every live worker in the registry bucket; none if it cannot be read."""
    try:
        async with asyncio.timeout(READ_TIMEOUT):
            return await live_workers(kv)
    except (nats.errors.Error, TimeoutError) as e:
        log.warning("registry read failed", error=str(e) or type(e).__name__)
        return []

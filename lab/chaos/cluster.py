"""The throughput cost of a replicated bus and of an fsync before every acknowledgement, side by side in
one run (`tokenbus chaos --cluster`): one nats-server and a 3-node cluster (R3 streams), each with NATS's
default fsync (every 2 minutes) and with `sync_interval: always`, on this machine's disk and loopback;
and the cluster with fsync always in 3 partitions (`--bus-partitions 3`: what sharding the durable path
buys).

Per layout, fresh servers and stores:
- the bus: acknowledged JetStream publishes of 1 KiB to TB_REQUESTS (this build's stream config; each
  publish a request id of its own, spread over the partitions), one at a time (latency p50, p99) and
  PUBLISH_INFLIGHT at a time on each of PUBLISHERS connections (publishes/s), best of ROUNDS;
- the pipeline: short greedy requests through the whole stack (gateway, tokenizer, router, workers and
  back), REQUEST_INFLIGHT at a time on the tiny model (requests/s, latency p50), best of PIPELINE_ROUNDS."""
import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import websockets

import bus as nats_bus
from ops import bus as ops_bus
from ops import cluster, procs
from ops.up import Stack, prepare
from schemas import subjects

LAYOUTS = [(1, "2m", 1), (1, "always", 1), (3, "2m", 1), (3, "always", 1),     # (servers, sync_interval,
           (3, "always", 3), (9, "always", 3)]                                   #  partitions)
PUBLISH_SIZE = 1024
PUBLISHES = 300                 # one at a time
PUBLISH_BURST = 3000            # PUBLISH_INFLIGHT at a time
PUBLISH_INFLIGHT = 64
PUBLISHERS = 3                  # connections publishing the burst (one client's loop must not be the limit)
REQUEST_INFLIGHT = 16
REQUEST_TOKENS = 8
ROUNDS = 3                      # of the bus, the layouts interleaved; the best counts
PIPELINE_ROUNDS = 2             # of the pipeline, likewise


@dataclass(slots=True)
class Row:
    servers: int
    sync: str
    publish_p50_ms: float = 0.0
    publish_p99_ms: float = 0.0
    publishes_per_s: float = 0.0
    requests_per_s: float = 0.0
    request_p50_ms: float = 0.0
    busiest_cpu_ms: float = 0.0         # CPU ms per 1,000 burst publishes of the busiest server (of that round)
    partitions: int = 1

    @property
    def layout(self) -> str:
        layout = "1 server, R1" if self.servers == 1 else f"{self.servers} servers, R{subjects.REPLICAS}"
        return layout + (f", {self.partitions} partitions" if self.partitions > 1 else "")


def measure(model: str, root: Path, requests: int, workers: int) -> list[Row]:
    """Every layout's bus measured ROUNDS times and its pipeline PIPELINE_ROUNDS times, the layouts
    interleaved; the best round counts (others' load on a shared machine only slows)."""
    rows = [Row(servers, sync, partitions=n) for servers, sync, n in LAYOUTS]
    for i in range(ROUNDS):
        for row in rows:
            nodes = cluster.local_nodes(row.servers, root / f"bus-{row.servers}-{row.sync}-{row.partitions}-{i}")
            blocks = ops_bus.config(None, None, row.partitions)
            children = [cluster.start(n, nodes, None, row.sync, blocks, row.partitions) for n in nodes]
            try:
                cluster.wait_ready(nodes)
                asyncio.run(bus(cluster.url(nodes), row, [c.pid for c in children]))
            finally:
                procs.stop(children)
    for i in range(PIPELINE_ROUNDS):
        for row in rows:
            where = root / f"stack-{row.servers}-{row.sync}-{row.partitions}-{i}"
            stack = Stack(model, procs.free_port(), where, workers=workers, nats_sync=row.sync,
                          nats_nodes=cluster.local_nodes(row.servers, where), partitions=row.partitions)
            try:
                stack.start()
                stack.wait_ready()
                asyncio.run(pipeline(stack.url, requests, row))
            finally:
                stack.stop()
    return rows


async def bus(url: str, row: Row, pids: list[int]) -> None:
    await prepare(url, partitions=row.partitions)
    ncs = [await nats_bus.connect(url, f"bench-cluster-{k}") for k in range(PUBLISHERS)]
    nc, payload = ncs[0], bytes(PUBLISH_SIZE)
    js = nc.jetstream()
    try:
        took = []
        for i in range(PUBLISHES):
            start = time.perf_counter()
            await js.publish(subjects.request_new("bench", f"one-{i}"), payload, headers=subjects.msg_id(f"one-{i}"))
            took.append(time.perf_counter() - start)
        took.sort()
        p50, p99 = round(1000 * took[len(took) // 2], 2), round(1000 * took[int(len(took) * 0.99)], 2)
        if not row.publishes_per_s or p50 < row.publish_p50_ms:
            row.publish_p50_ms, row.publish_p99_ms = p50, p99
        rooms = [asyncio.Semaphore(PUBLISH_INFLIGHT) for _ in ncs]
        jss = [c.jetstream() for c in ncs]

        async def one(i: int) -> None:
            async with rooms[i % PUBLISHERS]:
                await jss[i % PUBLISHERS].publish(subjects.request_new("bench", f"many-{i}"), payload,
                                                  headers=subjects.msg_id(f"many-{i}"), timeout=30)
        cpu, start = [procs.cpu_seconds(p) for p in pids], time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(PUBLISH_BURST)))
        rate = round(PUBLISH_BURST / (time.perf_counter() - start))
        if rate > row.publishes_per_s:
            busiest = max(procs.cpu_seconds(p) - c for p, c in zip(pids, cpu))
            row.publishes_per_s, row.busiest_cpu_ms = rate, round(1e6 * busiest / PUBLISH_BURST, 1)
    finally:
        for c in ncs:
            await c.close()


async def pipeline(url: str, requests: int, row: Row) -> None:
    """Greedy requests of REQUEST_TOKENS tokens, REQUEST_INFLIGHT connections each sending one at a time;
    a few first, untimed, so that no layout pays the engine's warm-up."""
    async def client(ids: range, latencies: list[float]) -> None:
        async with websockets.connect(url, max_size=None) as ws:
            for i in ids:
                start = time.perf_counter()
                await ws.send(orjson.dumps({"type": "generate", "id": f"r{i}", "prompt": f"bench request {i}",
                                            "max_tokens": REQUEST_TOKENS, "temperature": 0,
                                            "ignore_eos": True}).decode())
                while (frame := orjson.loads(await ws.recv()))["type"] == "delta":
                    pass
                if frame["type"] != "done":
                    raise RuntimeError(f"request r{i} ended with {frame}")
                latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(client(range(-k - 1, -k), []) for k in range(REQUEST_INFLIGHT)))    # every worker warm
    latencies: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(*(client(range(k, requests, REQUEST_INFLIGHT), latencies) for k in range(REQUEST_INFLIGHT)))
    rate = round(requests / (time.perf_counter() - start), 1)
    if rate > row.requests_per_s:
        row.requests_per_s, row.request_p50_ms = rate, round(1000 * statistics.median(latencies), 1)


COLUMNS = ("layout", "sync", "publish p50 ms", "publish p99 ms",
           f"publishes/s ({PUBLISHERS}×{PUBLISH_INFLIGHT} in flight)", "busiest server CPU ms / 1k",
           f"requests/s ({REQUEST_INFLIGHT} in flight)", "request p50 ms")


def table(rows: list[Row]) -> str:
    """Each rate also relative to the first row (one server, NATS's default fsync)."""
    def rel(value: float, first: float) -> str:
        return f"{value:g}" if value == first or not first else f"{value:g} ({100 * (value / first - 1):+.0f}%)"
    base, lines = rows[0], [list(COLUMNS)]
    for row in rows:
        lines.append([row.layout, row.sync, f"{row.publish_p50_ms:g}", f"{row.publish_p99_ms:g}",
                      rel(row.publishes_per_s, base.publishes_per_s), f"{row.busiest_cpu_ms:g}",
                      rel(row.requests_per_s, base.requests_per_s),
                      f"{row.request_p50_ms:g}"])
    widths = [max(len(r[i]) for r in lines) for i in range(len(COLUMNS))]
    text = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in lines]
    return "\n".join([text[0], "-" * len(text[0]), *text[1:]])


def as_json(rows: list[Row]) -> list[dict]:
    return [{"layout": r.layout, **asdict(r)} for r in rows]

"""`tokenbus bench-bus`: the pipeline and its bus at GPU token rates. The workers run the mock engine (the
real scheduler and KV cache, each step held for the roofline's time on --tp × --mock-gpu: docs/engine.md#the-
mock-engine) on a model of the seed's shape (llama-3-70b's layers by default, SmolLM2's tokenizer, so prompts
are real text), so the engine runs at an H100 node's speed and the bus and the services are what is measured.

Each bus (`single`: one nats-server; `cluster`: 3 nodes, R3 streams) and fsync (`default`: NATS's, every 2
minutes; `always`: before every acknowledgement) gets a stack of its own; on it, each protocol (`ws`: the
websocket protocol over --connections sockets; `sse`: streamed text completions, one HTTP connection per
stream) runs each --rate in turn: Poisson arrivals for --duration seconds, open loop (a request is sent at
its time whether or not earlier ones finished), each a prompt of --input-len tokens asking for exactly
--output-len. Per run:

- requests/s and tokens/s sustained (the rate at which requests completed, from the first end to the last);
- TTFT added by the pipeline: per request, the gateway's TTFT (its usage record) minus the worker's (its
  completion record: work item taken → first token), so the engine's queue and prefill are not counted;
  the client's own TTFT beside it;
- inter-token latency added: the clients' gaps between token chunks against the mock's own step times
  (each step's seconds from the workers' --step-trace, once per request it sampled for), p50 and p99;
- CPU: each process's CPU seconds over the run, in cores, and per request and per 1,000 streamed tokens net
  of what it uses idle (heartbeats, timers: measured for --idle seconds before the runs, its rate times
  the run's time subtracted), so that the per-request figures are what a request costs; a worker is split
  into its event loop's thread (the worker service: intake, chunks, records) and the rest (the engine's
  thread), and `pipeline` sums every service and nats-server but not the engine;
- durable writes: messages stored in JetStream (the streams' last sequence, key-value buckets included) and
  publishes on durable subjects with their bytes (a duplicate the broker drops counts as a publish, not a
  store), per request; the heartbeats' buckets (workers, gateways) apart, in writes per second;
- which component saturates first: the busiest process (in cores) at the highest rate, and whether the
  stack kept up with the offered rate.

With --calibration FILE it writes what `tokenbus plan --bus-calibration` reads: each role's CPU (gateway,
tokenizer, router, worker service, broker) as ms a request + ms per 1,000 output tokens, fitted over the
runs of the last bus given (two or more --output-len tell the two apart), and the durable writes a request.
"""
import asyncio
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
from tokenizers import Tokenizer

import bus
from lab.common.clients import HttpClient, WsClient
from lab.common.corpus import Corpus
from lab.common.results import Result, finish, fmt, stats
from ops import cluster
from ops.plan import MODELS
from ops.procs import cpu_seconds, free_port
from ops.up import Stack
from schemas import subjects
from schemas.messages import Completion, Usage, decode
from workers.models.catalogue import resolve
from workers.service.records import USAGE_BACKUP_SECONDS

BUSES = {"single": 1, "cluster": 3}
FSYNCS = ("default", "always")
PROTOCOLS = ("ws", "sse")
DURABLE = (subjects.REQUESTS_SUBJECTS, subjects.ROUTE_SUBJECTS, subjects.WORK_SUBJECTS, subjects.RESULTS_SUBJECTS,
           subjects.USAGE_SUBJECTS, subjects.DEAD_SUBJECTS, "$KV.>")
PERIODIC = (f"KV_{subjects.WORKERS_BUCKET}", f"KV_{subjects.GATEWAYS_BUCKET}")   # heartbeats: writes/s, not per request
KEPT_UP = 0.9               # sustained over offered at or above this: the stack kept up


def shaped_model(source: str, shape: str, into: Path) -> str:
    """`source`'s tokenizer and files (its weights linked, for the stack's revision; the mock never loads them) with
    config.json reshaped to `shape`'s layers (ops/plan.py MODELS), its vocabulary kept."""
    src, path = Path(resolve(source)), into / f"mock-{shape}"
    path.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors" or f.suffix == ".gguf":
            (path / f.name).symlink_to(f)
        elif f.is_file() and f.name != "tokenbus_revision.json":
            shutil.copy2(f, path / f.name)
    config = json.loads((src / "config.json").read_text())
    layers = {k: v for k, v in MODELS[shape].items() if k not in ("vocab_size", "tie_word_embeddings", "torch_dtype")}
    (path / "config.json").write_text(json.dumps({**config, **layers}))
    return str(path)


# -- what the bus and the processes did over a run ------------------------------------------------

class Watch:
    """Everything published on the durable subjects during a run (counted with its bytes, by stream), and the
    records of the run's requests: the gateways' usage records and the workers' completion records."""

    def __init__(self):
        self.publishes: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.gateway_ttft: dict[str, float] = {}
        self.worker_ttft: dict[str, float] = {}

    async def on(self, msg) -> None:
        head = msg.subject.split(".")
        key = "$KV." + head[1] if head[0] == "$KV" else ".".join(head[:2])
        self.publishes[key] = self.publishes.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + len(msg.data) + sum(len(k) + len(v) for k, v in
                                                                       (msg.headers or {}).items())
        if key == "tb.usage":
            u = decode(msg.data, Usage)
            if "ttft_ms" in u.timing:                # the gateway's (the worker's backup has none)
                self.gateway_ttft[u.id] = u.timing["ttft_ms"]
        elif key == "tb.done":
            c = decode(msg.data, Completion)
            if "ttft_ms" in c.timing:
                self.worker_ttft[c.id] = c.timing["ttft_ms"]

    def added_ttft(self) -> list[float]:
        return [g - self.worker_ttft[rid] for rid, g in self.gateway_ttft.items() if rid in self.worker_ttft]


def thread_cpu(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_now(stack: Stack) -> dict[str, float]:
    """CPU seconds of each process of the stack; a worker as its event loop's thread (`w0`, the service) and
    the rest of it (`w0.engine`)."""
    out = {}
    for name, p in stack.children.items():
        total = cpu_seconds(p.pid)
        if name in stack.worker_plan:
            out[name] = thread_cpu(p.pid, p.pid)
            out[f"{name}.engine"] = total - out[name]
        else:
            out[name] = total
    return out


async def stored(js) -> dict[str, int]:
    """Each stream's last sequence: messages stored so far, deleted or not."""
    return {s.config.name: s.state.last_seq for s in await js.streams_info()}


def engine_gaps(trace_dir: Path, since: float, until: float) -> list[float]:
    """The mock's own inter-token times over [since, until]: each step's seconds, once per request it sampled
    for (ms)."""
    gaps = []
    for f in trace_dir.glob("trace-*.jsonl"):
        for line in f.read_bytes().splitlines():
            t = orjson.loads(line)
            if since <= t["at"] <= until and t["sampled"]:
                gaps += [t["seconds"] * 1e3] * t["sampled"]
    return gaps


def client_gaps(results: list[Result]) -> list[float]:
    return [(b - a) * 1e3 for r in results for a, b in zip(r.chunks, r.chunks[1:])]


# -- one run: a rate on a protocol ----------------------------------------------------------------

def idle_cores(stack: Stack, seconds: float) -> dict[str, float]:
    """Each process's CPU with no request in flight (heartbeats, timers, polls), in cores."""
    before = cpu_now(stack)
    time.sleep(seconds)
    return {k: max(0.0, v - before.get(k, 0.0)) / seconds for k, v in cpu_now(stack).items()}


async def run(stack: Stack, trace_dir: Path, protocol: str, rate: float, output_len: int, prompts: list[str], args,
              idle: dict[str, float]) -> dict:
    """Poisson arrivals at `rate` for --duration seconds, open loop; what it cost (the module's docstring)."""
    client = (WsClient(stack.url, args.connections, None, {}) if protocol == "ws" else
              HttpClient(stack.http, None, None, {}, endpoint="/completions"))
    await client.open()
    nc = await bus.connect(stack.nats_url, "bench-bus", role="admin")
    js, watch, rng = nc.jetstream(), Watch(), random.Random(f"{args.seed}-{protocol}-{rate}")
    try:
        for s in DURABLE:
            await nc.subscribe(s, cb=watch.on)
        before, cpu0, t0 = await stored(js), cpu_now(stack), time.monotonic()
        tasks, at, late, open_max = [], 0.0, [], 0
        while (at := at + rng.expovariate(rate)) < args.duration:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            late.append((time.monotonic() - t0 - at) * 1e3)
            fields = {"prompt": prompts[len(tasks) % len(prompts)], "max_tokens": output_len}
            tasks.append(asyncio.create_task(client.send(fields)))
            open_max = max(open_max, sum(not t.done() for t in tasks))
        results = await asyncio.wait_for(asyncio.gather(*tasks), args.timeout)
        t_end = time.monotonic()
        await asyncio.sleep(USAGE_BACKUP_SECONDS + 1)      # the workers' backup usage records, published late
        await nc.flush()
        after, cpu1, t_cpu = await stored(js), cpu_now(stack), time.monotonic()
    finally:
        await client.close()
        await nc.close()
    ok = [r for r in results if r.error is None and r.chunks]
    ends = sorted(r.end for r in ok)
    n, tokens = len(ok), sum(r.output_tokens for r in ok)
    sustained = (n - 1) / (ends[-1] - ends[0]) if n > 1 and ends[-1] > ends[0] else None   # the rate of completions
    window = t_cpu - t0                           # what the CPU figures span: the run and the records after it
    used = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
    net = {k: max(0.0, v - idle.get(k, 0.0) * window) for k, v in used.items()}   # what the requests cost
    pipeline = sum(v for k, v in net.items() if not k.endswith(".engine"))
    writes = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    per_request = sum(v for k, v in writes.items() if k not in PERIODIC)
    periodic = sum(v for k, v in writes.items() if k in PERIODIC)
    published = sum(v for k, v in watch.publishes.items() if f"KV_{k[4:]}" not in PERIODIC)
    c_gaps, e_gaps = client_gaps(ok), engine_gaps(trace_dir, t0, t_end)
    itl, engine_itl = stats(c_gaps), stats(e_gaps)
    busiest = max((k for k in used if not k.endswith(".engine")), key=lambda k: used[k])
    return {
        "protocol": protocol, "offered_rps": rate, "output_len": output_len, "requests": len(results),
        "errors": len(results) - n, "completed": n, "tokens": tokens,
        "sustained_rps": sustained and round(sustained, 2),
        "tokens_per_s": sustained and round(sustained * tokens / n, 1),
        "streams_max": open_max, "arrival_late_ms": stats(late),
        "ttft_ms": stats([r.ttft * 1e3 for r in ok]), "ttft_added_ms": stats(watch.added_ttft()),
        "itl_ms": itl, "engine_itl_ms": engine_itl,
        "itl_added_ms": {q: None if itl[q] is None or engine_itl[q] is None else round(itl[q] - engine_itl[q], 3)
                         for q in ("p50", "p99")},
        "cpu_s": {k: round(v, 3) for k, v in used.items()},
        "cores": {k: round(v / window, 3) for k, v in used.items()},
        "idle_cores": {k: round(v, 4) for k, v in idle.items()},
        "cpu_ms_per_request": {k: round(v / n * 1e3, 3) for k, v in net.items()} if n else {},
        "cpu_ms_per_1k_tokens": {k: round(v / tokens * 1e6, 3) for k, v in net.items()} if tokens else {},
        "pipeline_cpu_ms_per_request": round(pipeline / n * 1e3, 3) if n else None,
        "pipeline_cpu_ms_per_1k_tokens": round(pipeline / tokens * 1e6, 3) if tokens else None,
        "durable": {"stored_per_request": round(per_request / n, 2) if n else None,
                    "publishes_per_request": round(published / n, 2) if n else None,
                    "heartbeat_writes_per_s": round(periodic / (t_end - t0), 2),
                    "bytes_per_request": round(sum(v for k, v in watch.bytes.items()
                                                   if f"KV_{k[4:]}" not in PERIODIC) / n) if n else None,
                    "stored_by_stream": writes, "publishes_by_subject": watch.publishes},
        "busiest": {"process": busiest, "cores": round(used[busiest] / window, 3)},
    }


async def warm_up(stack: Stack, protocol: str, prompts: list[str], args) -> None:
    """A few requests at once before the timed runs: connections, the first request's costs."""
    client = (WsClient(stack.url, args.connections, None, {}) if protocol == "ws" else
              HttpClient(stack.http, None, None, {}, endpoint="/completions"))
    await client.open()
    try:
        await asyncio.gather(*(client.send({"prompt": p, "max_tokens": 4}) for p in prompts[:8]))
    finally:
        await client.close()


# -- a stack per bus ------------------------------------------------------------------------------

def start(model: str, bus_name: str, fsync: str, home: Path, args) -> Stack:
    data = home / f"{bus_name}-{fsync}"
    data.mkdir()
    trace = ["--step-trace", str(data / "trace-{worker}.jsonl")]
    nodes = BUSES[bus_name]
    stack = Stack(model, free_port(), data, nats_port=free_port(), workers=args.workers,
                  worker_args=["--engine", "mock", "--mock-gpu", args.mock_gpu, "--tp", str(args.tp),
                               "--max-num-seqs", str(args.max_num_seqs), *trace],
                  nats_nodes=cluster.local_nodes(nodes, data) if nodes > 1 else [],
                  nats_sync="always" if fsync == "always" else "2m" if nodes > 1 else None)   # None: NATS's, 2m
    stack.start()
    stack.wait_ready()
    return stack


def series(args, model: str, prompts: list[str], home: Path) -> list[dict]:
    rows = []
    for bus_name in args.bus:
        for fsync in args.fsync:
            stack = start(model, bus_name, fsync, home, args)
            try:
                for protocol in args.protocol:
                    asyncio.run(warm_up(stack, protocol, prompts, args))
                    idle = idle_cores(stack, args.idle)
                    for rate in args.rate:
                        for n in args.output_len:
                            row = asyncio.run(run(stack, stack.data_dir, protocol, rate, n, prompts, args, idle))
                            rows.append({"bus": bus_name, "fsync": fsync, **row})
                            print(line(rows[-1]), flush=True)
            finally:
                stack.stop()
    return rows


def saturation(rows: list[dict]) -> list[dict]:
    """For each bus, fsync and protocol: the busiest process at its highest rate, and whether it kept up."""
    out = []
    for key in dict.fromkeys((r["bus"], r["fsync"], r["protocol"]) for r in rows):
        top = max((r for r in rows if (r["bus"], r["fsync"], r["protocol"]) == key), key=lambda r: r["offered_rps"])
        out.append({"bus": key[0], "fsync": key[1], "protocol": key[2], "rate": top["offered_rps"],
                    "kept_up": (top["sustained_rps"] or 0) >= KEPT_UP * top["offered_rps"], **top["busiest"]})
    return out


def main(args) -> int:
    if args.input_len < 1 or min(args.output_len) < 2:
        raise SystemExit("--input-len must be at least 1 and --output-len at least 2 (an inter-token gap)")
    with tempfile.TemporaryDirectory(prefix="tokenbus-bench-bus-") as tmp:
        home = Path(tmp)
        model = shaped_model(args.model, args.shape, home)
        corpus, rng = Corpus(Tokenizer.from_file(str(Path(model) / "tokenizer.json"))), random.Random(args.seed)
        prompts = [corpus.text(rng, args.input_len) for _ in range(64)]
        rows = series(args, model, prompts, home)
    report = {"workload": {"shape": args.shape, "mock_gpu": args.mock_gpu, "tp": args.tp, "workers": args.workers,
                           "input_len": args.input_len, "output_lens": args.output_len, "duration_s": args.duration,
                           "connections": args.connections},
              "runs": rows, "saturation": saturation(rows)}
    if args.calibration:
        Path(args.calibration).write_text(json.dumps(calibration(rows, args), indent=2) + "\n")
    failures = [f"{r['bus']}/{r['fsync']}/{r['protocol']} at {r['offered_rps']}/s: {r['errors']} requests failed"
                for r in rows if r["errors"]]
    return finish("bench-bus", report, args, table, plot, failures)


# -- what `tokenbus plan` reads ------------------------------------------------------------------

ROLES = {"gateway": r"gateway\d*", "tokenizer": r"tokenizer", "router": r"router\d*", "worker_service": r"[wpd]\d+",
         "broker": r"nats|tb-\d+"}


def calibration(rows: list[dict], args) -> dict:
    """Each role's CPU as ms a request + ms per 1,000 output tokens, fitted by least squares over the runs of one
    bus (the last given: the one closest to production when `cluster always` is), summed over the role's
    processes (a cluster's three nodes are the broker's cost, replication included). With one output length
    tokens and requests cannot be told apart: all of it is a request's (`tokens_separated`: false)."""
    bus_name, fsync = rows[-1]["bus"], rows[-1]["fsync"]
    mine = [r for r in rows if (r["bus"], r["fsync"]) == (bus_name, fsync) and r["completed"]]
    separated = len({r["output_len"] for r in mine}) > 1
    x = np.array([[r["completed"], r["tokens"] / 1e3] for r in mine], dtype=float)
    roles = {}
    for role, pattern in ROLES.items():
        y = np.array([sum(v * r["completed"] / 1e3 for k, v in r["cpu_ms_per_request"].items()
                          if re.fullmatch(pattern, k)) for r in mine])
        a, b = np.linalg.lstsq(x, y, rcond=None)[0] if separated else (y.sum() / x[:, 0].sum(), 0.0)
        if b < 0:
            a, b = y.sum() / x[:, 0].sum(), 0.0
        elif a < 0:
            a, b = 0.0, y.sum() / x[:, 1].sum()
        roles[role] = {"ms_per_request": round(a * 1e3, 3), "ms_per_1k_tokens": round(b * 1e3, 3)}
    d = [r["durable"] for r in mine]
    return {"measured": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
            "bus": bus_name, "fsync": fsync, "nodes": BUSES[bus_name], "input_len": args.input_len,
            "output_lens": sorted({r["output_len"] for r in mine}), "tokens_separated": separated, "roles": roles,
            "durable": {k: round(float(np.median([x[k] for x in d])), 2)
                        for k in ("stored_per_request", "publishes_per_request", "bytes_per_request")}}


# -- output ---------------------------------------------------------------------------------------

def line(r: dict) -> str:
    d = r["durable"]
    return (f"{r['bus']:7} {r['fsync']:7} {r['protocol']:3} {r['offered_rps']:7.1f} {fmt(r['sustained_rps']):>7} "
            f"{fmt(r['tokens_per_s'], '.0f'):>9} {r['streams_max']:6} {fmt(r['ttft_added_ms']['p50']):>6} "
            f"{fmt(r['ttft_added_ms']['p99']):>6} {fmt(r['itl_added_ms']['p50'], '.2f'):>6} "
            f"{fmt(r['itl_added_ms']['p99'], '.2f'):>6} {fmt(r['pipeline_cpu_ms_per_request'], '.2f'):>8} "
            f"{fmt(r['pipeline_cpu_ms_per_1k_tokens'], '.1f'):>8} {fmt(d['stored_per_request'], '.1f'):>6} "
            f"{fmt(d['bytes_per_request'], '.0f'):>7} {r['busiest']['process']}:{r['busiest']['cores']:.2f}")


HEADER = ("bus     fsync   pro offered  sustd     tok/s  strms  +ttft  +ttft   +itl   +itl cpu ms/r cpu ms/k stored "
          "bytes/r busiest\n"
          "                    req/s  req/s                   p50    p99    p50    p99  pipeline pipeline  /req")


def table(report: dict) -> str:
    rows = [HEADER, *(line(r) for r in report["runs"])]
    rows.append("\nsaturates first (the busiest process at the highest rate, in cores):")
    rows += [f"  {s['bus']}/{s['fsync']}/{s['protocol']} at {s['rate']}/s: {s['process']} {s['cores']:.2f} cores"
             f"{'' if s['kept_up'] else ' (fell behind the offered rate)'}" for s in report["saturation"]]
    costs = {}
    for r in report["runs"]:
        for k, v in r["cpu_ms_per_request"].items():
            costs.setdefault(k, []).append(v)
    rows.append("\nCPU ms per request, each process (median over runs): " +
                ", ".join(f"{k} {np.median(v):.2f}" for k, v in sorted(costs.items())))
    return "\n".join(rows)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in dict.fromkeys((r["bus"], r["fsync"], r["protocol"]) for r in report["runs"]):
        rs = [r for r in report["runs"] if (r["bus"], r["fsync"], r["protocol"]) == key]
        label = "/".join(key)
        a.plot([r["offered_rps"] for r in rs], [r["sustained_rps"] for r in rs], "o-", label=label)
        b.plot([r["offered_rps"] for r in rs], [r["ttft_added_ms"]["p99"] for r in rs], "o-", label=label)
    a.set(xlabel="offered requests/s", ylabel="sustained requests/s", title="throughput")
    b.set(xlabel="offered requests/s", ylabel="ms", title="TTFT added by the pipeline, p99")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)

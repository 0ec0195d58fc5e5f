"""`tokenbus bench-pipeline`: the same workload through the whole pipeline (websocket → gateway →
JetStream → tokenizer → router → worker → core NATS → gateway → websocket, every stage its own
process) and through the offline engine in this process (`LLM.generate`, as vLLM's offline
throughput benchmark uses its `LLM`: token ids in, tokens and text out), side by side in one run.

Two measurements, the sides taking turns for --repeat rounds, each side's best round counting
(noise from the machine's neighbours only ever slows a run); each round draws fresh prompts (the
same for both sides) so no prefix cache carries over:
- throughput: N requests of random tokens at once, EOS ignored; output tokens per second;
- TTFT at low load: requests one at a time, each prompt once on the engine and at once through
  the pipeline; the engine's TTFT is add_request → the step that yields the first token, the
  pipeline's is the client's send → the first delta frame. What the pipeline adds is the median
  of the per-request differences (the median over rounds of each round's median).

Where the pipeline's time goes: the CPU time each process of the stack (and the client, this
process) used in the best throughput round, in cores (CPU seconds / wall seconds) and per output
token: on a machine with few cores every core-second another process takes is taken from the
worker's engine. With --bus-stats, one more (untimed) round counts the messages on the bus per
output token, by subject. With --stand-in STEP_MS the worker's engine is a stand-in (`python -m
lab.benchmarks.pipeline`, this module's other half) whose step sleeps STEP_MS and gives every running
request a token: the pipeline alone at a given engine speed, its CPU per token free of the engine's.
"""
import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
import torch
import websockets
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

import bus
from bus.log import configure
from ops.procs import cpu_seconds, free_port
from ops.up import Stack
from schemas import subjects
from schemas.sampling import SamplingParams
from workers import LLM
from workers.engine.engine import LLMEngine
from workers.engine.request import Request, Status
from workers.models.catalogue import resolve
from workers.models.gguf import hf_dir
from workers.service import WorkerService


def workload(seed: int, n: int, input_len, output_len, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(16, vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(n)]


# -- the engine side ------------------------------------------------------------------------------

def engine_run(llm: LLM, requests) -> tuple[int, float]:
    """The output tokens of every request, and the seconds they took."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate([prompt for prompt, _ in requests], params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - start


# -- where the CPU goes ---------------------------------------------------------------------------

def measured(pids: dict[str, int], run, *args) -> tuple[float, dict[str, dict[str, float]]]:
    """The output tokens/s of run(*args) (which returns tokens and seconds), and the CPU each process used
    meanwhile: in cores (CPU seconds / wall seconds) and in microseconds per output token."""
    before, start = {name: cpu_seconds(pid) for name, pid in pids.items()}, time.perf_counter()
    tokens, seconds = run(*args)
    wall = time.perf_counter() - start
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return tokens / seconds, {name: {"cores": cpu / wall, "us_per_token": cpu / tokens * 1e6}
                              for name, cpu in used.items()}


async def bus_counts(nats_url: str, url: str, requests) -> dict[str, float]:
    """Messages on the bus per output token during one pipeline run, by subject (the first two tokens
    of it; a request or worker id in it counted as `*`). Counting subscribes to everything, which costs
    the server a copy of each message: this round is not timed."""
    counts: dict[str, int] = {}

    async def count(msg) -> None:
        parts = msg.subject.split(".")
        key = f"{parts[0]}.*" if parts[0].startswith("_INBOX") else ".".join(parts[:2]) + ".*" * (len(parts) > 2)
        counts[key] = counts.get(key, 0) + 1

    nc = await bus.connect(nats_url, "bench-pipeline", role="admin")
    try:
        await nc.subscribe(">", cb=count)
        tokens, _ = await pipeline_run(url, requests)
        await nc.flush()
    finally:
        await nc.close()
    return {k: round(v / tokens, 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def engine_ttft(engine: LLMEngine, rid: str, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        if engine.step() and first is None:
            first = time.perf_counter()
    return (first - start) * 1e3


# -- the pipeline side ----------------------------------------------------------------------------

def frame(i: int, prompt: list[int], n: int) -> str:
    return orjson.dumps({"type": "generate", "id": str(i), "prompt_token_ids": prompt, "max_tokens": n,
                         "temperature": 0, "ignore_eos": True}).decode()


def pipeline_throughput(url: str, requests) -> tuple[int, float]:
    return asyncio.run(pipeline_run(url, requests))


class Socket:
    """A websocket client on websockets' sans-I/O protocol, reading straight from the socket. The client
    shares this machine with the engine, and the asyncio client's machinery (a task wake-up and a queue
    per frame) cost it twice the CPU per frame."""

    def __init__(self, url: str):
        self.uri = parse_uri(url)
        self.ws = ClientProtocol(self.uri, max_size=None)

    async def __aenter__(self) -> "Socket":
        self.reader, self.writer = await asyncio.open_connection(self.uri.host, self.uri.port)
        self.ws.send_request(self.ws.connect())
        self.flush()
        while not (events := await self.receive()):
            pass
        if not isinstance(events[0], Response) or events[0].status_code != 101:
            raise RuntimeError(f"websocket handshake refused: {events[0]}")
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()

    def send(self, text: str) -> None:
        self.ws.send_text(text.encode())
        self.flush()

    def flush(self) -> None:
        self.writer.write(b"".join(self.ws.data_to_send()))

    async def receive(self) -> list:
        """What the next read from the socket completed: the handshake's response, then frames."""
        data = await self.reader.read(1 << 20)
        if not data:
            raise ConnectionError("the gateway closed the websocket")
        self.ws.receive_data(data)
        if pong := self.ws.data_to_send():         # the protocol's answers (a ping's pong)
            self.writer.write(b"".join(pong))
        return self.ws.events_received()

    async def frames(self) -> list[dict]:
        """The JSON text frames the next read completed."""
        return [orjson.loads(f.data) for f in await self.receive() if f.opcode == Opcode.TEXT]


async def pipeline_run(url: str, requests) -> tuple[int, float]:
    """Sends every request at once on one websocket: the output tokens of all, and the seconds from the
    first send to the last done frame."""
    async with Socket(url) as ws:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(requests):
            ws.send(frame(i, prompt, n))
        tokens, pending = 0, len(requests)
        while pending:
            for msg in await ws.frames():
                if msg["type"] == "error":
                    raise RuntimeError(f"pipeline error: {msg}")
                if msg["type"] == "done":
                    tokens += msg["usage"]["completion_tokens"]
                    pending -= 1
        return tokens, time.perf_counter() - start


async def paired_ttfts(url: str, engine: LLMEngine, requests) -> list[tuple[float, float]]:
    """(engine, pipeline) TTFT of each request, the two taken back to back so that both see the same
    moment of the machine's noise."""
    pairs = []
    async with websockets.connect(url, max_size=None) as ws:
        for i, (prompt, n) in enumerate(requests):
            on_engine = engine_ttft(engine, f"l{i}", prompt, n)
            start, first = time.perf_counter(), None
            await ws.send(frame(i, prompt, n))
            while True:
                msg = orjson.loads(await ws.recv())
                if msg["type"] == "delta" and first is None:
                    first = time.perf_counter()
                if msg["type"] in ("done", "error"):
                    break
            pairs.append((on_engine, (first - start) * 1e3))
    return pairs


# -- the stand-in engine (--stand-in; python -m lab.benchmarks.pipeline) ------------------------------

class StandIn:
    """The engine as the worker service uses it, without a model: a step sleeps `step_ms` (the forward,
    using no CPU, so that what the pipeline costs is all that is measured) and gives each running
    request (the first max_num_seqs, in arrival order) one random token; a request ends at max_tokens."""

    def __init__(self, step_ms: float, max_num_seqs: int, vocab: int, block_size: int = 16):
        self.step_s, self.vocab, self.rng = step_ms / 1e3, vocab, random.Random(0)
        self.device = torch.device("cpu")
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs, block_size=block_size, scheduling_policy="fcfs")
        blocks = lambda n: -(-n // block_size)  # noqa: E731
        self.kv = SimpleNamespace(record_changes=lambda: None, changes=None, cached=(), num_blocks=1 << 20,
                                  num_blocks_for=blocks, unpin=lambda owner: None,
                                  new_blocks=lambda hashes, n: blocks(n), held=lambda: ([], []))   # nothing cached
        self.scheduler = SimpleNamespace(suspect=lambda: None, waiting=[], queued_blocks=lambda: 0)
        self.requests: dict[str, Request] = {}

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, salt: str | None = None,
                    output=(), isolate: bool = False, seed: int | None = None, priority: int = 0, tenant: str = "",
                    weight: float = 1.0, block_hashes: list[int] = (), group: str = "") -> Request:
        req = Request(rid, [*prompt, *output], len(prompt), params, 0, self.config.block_size, salt,
                      block_hashes=list(block_hashes))
        req.num_resumed_tokens = req.num_cached_tokens = 0
        self.requests[rid] = req
        return req

    def abort(self, rid: str) -> Request | None:
        req = self.requests.pop(rid, None)
        if req is not None:
            req.status, req.finish_reason = Status.FINISHED, "abort"
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_alive(self) -> None:
        pass

    def stats(self) -> dict:
        n, cap = len(self.requests), self.config.max_num_seqs
        return {"running": min(n, cap), "waiting": max(n - cap, 0), "kv_blocks_total": self.kv.num_blocks,
                "kv_blocks_free": self.kv.num_blocks, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                "preemptions": 0, "forks": 0}

    def step(self) -> list[Request]:
        time.sleep(self.step_s)
        batch = list(self.requests.values())[:self.config.max_num_seqs]
        for req in batch:
            req.append(self.rng.randrange(self.vocab))
            if req.num_output_tokens >= req.params.max_tokens:
                req.status, req.finish_reason = Status.FINISHED, "length"
                del self.requests[req.request_id]
        return batch


async def serve_stand_in(args) -> None:
    """A worker process whose engine is a StandIn: the real WorkerService around it."""
    log = configure("worker").bind(worker="w0")
    nc = await bus.connect(args.nats_url, "worker-w0", log, role="worker")
    engine = StandIn(args.step_ms, args.max_num_seqs, args.vocab)
    await WorkerService(nc, engine, "w0", args.served_model_name, log, args.chunk_rate).run()


STAND_IN_ARGS = ("--max-num-seqs=", "--chunk-rate=")     # the worker's options a stand-in takes too


def stand_in_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.pipeline",
                                description="A worker with a stand-in engine.")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--step-ms", type=float, required=True, help="milliseconds one step sleeps")
    p.add_argument("--vocab", type=int, required=True, help="token ids are drawn below this")
    p.add_argument("--served-model-name", required=True, help="the model the gateway routes to (required)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--chunk-rate", type=subjects.chunk_rate, default=subjects.CHUNK_RATE)
    return p


# -- the run --------------------------------------------------------------------------------------

def main(args) -> dict:
    model = resolve(args.model or "tiny")
    options = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype}
    worker_args = [f"--{k.replace('_', '-')}={v}" for k, v in options.items() if v is not None]
    worker_args += [f"--chunk-rate={args.chunk_rate}"] if args.chunk_rate is not None else []
    if args.threads:
        torch.set_num_threads(args.threads)
        worker_args.append(f"--threads={args.threads}")
    llm = LLM(model, **options) if args.stand_in is None else None
    vocab = orjson.loads(Path(hf_dir(model), "config.json").read_bytes())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(model, free_port(), Path(tmp), nats_port=free_port(), workers=int(llm is not None),
                      worker_args=worker_args)
        try:
            stack.start()
            if llm is None:
                stack.spawn("w0", "lab.benchmarks.pipeline", "--nats-url", stack.nats_url, f"--step-ms={args.stand_in}",
                            f"--vocab={vocab}",
                            f"--served-model-name={os.path.basename(os.path.normpath(model))}",
                            *(a for a in worker_args if a.startswith(STAND_IN_ARGS)), role="worker")
                stack.workers = 1
            stack.wait_ready()
            pids = {"worker" if name == "w0" else name: p.pid for name, p in stack.children.items()}
            results = rounds(args, llm, stack.url, vocab, {**pids, "client": os.getpid()})
            if args.bus_stats:
                batch = workload(args.seed, args.num_requests, args.input_len, args.output_len, vocab)
                results["bus"] = asyncio.run(bus_counts(stack.nats_url, stack.url, batch))
        finally:
            stack.stop()
    report = summary(args, results)
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if args.json else table(report))
    return report


def rounds(args, llm: LLM | None, url: str, vocab: int, pids: dict[str, int]) -> dict[str, list]:
    """The sides in turns, round by round (the pipeline alone with a stand-in engine: llm None)."""
    results = {"engine_tps": [], "pipeline_tps": [], "engine_cpu": [], "pipeline_cpu": [],
               "engine_ttft": [], "pipeline_ttft": [], "ttft_added": []}
    warm = workload(args.seed - 1, 4, (16, 32), (4, 8), vocab)
    if llm is not None:
        engine_run(llm, warm)
    pipeline_throughput(url, warm)
    for r in range(args.repeat):
        batch = workload(args.seed + r, args.num_requests, args.input_len, args.output_len, vocab)
        if llm is not None:
            tps, used = measured({"engine": os.getpid()}, engine_run, llm, batch)
            results["engine_tps"].append(tps)
            results["engine_cpu"].append(used)
        tps, used = measured(pids, pipeline_throughput, url, batch)
        results["pipeline_tps"].append(tps)
        results["pipeline_cpu"].append(used)
        if llm is not None and args.ttft_requests:
            single = workload(args.seed + 1000 + r, args.ttft_requests, args.input_len, (args.ttft_output_len,) * 2,
                              vocab)
            pairs = asyncio.run(paired_ttfts(url, llm.engine, single))
            results["engine_ttft"].append(statistics.median(e for e, _ in pairs))
            results["pipeline_ttft"].append(statistics.median(p for _, p in pairs))
            results["ttft_added"].append(statistics.median(p - e for e, p in pairs))
    return results


def summary(args, results: dict[str, list]) -> dict:
    def best(side: str) -> tuple[float | None, dict]:
        tps = results[f"{side}_tps"]
        if not tps:
            return None, {}
        i = max(range(len(tps)), key=tps.__getitem__)
        return tps[i], rounded_cpu(results[f"{side}_cpu"][i])

    (e_tps, e_cpu), (p_tps, p_cpu) = best("engine"), best("pipeline")
    ttft = bool(results["ttft_added"])
    rounded = {k: [round(v, 2) for v in vs] for k, vs in results.items() if k.endswith(("_tps", "_ttft", "_added"))}
    return {
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
                     "ttft_requests": args.ttft_requests, "max_num_seqs": args.max_num_seqs, "repeat": args.repeat,
                     "dtype": args.dtype, "threads": args.threads, "chunk_rate": args.chunk_rate,
                     "stand_in_step_ms": args.stand_in},
        "engine_output_tokens_per_s": round(e_tps, 1) if e_tps else None,
        "pipeline_output_tokens_per_s": round(p_tps, 1),
        "throughput_ratio": round(p_tps / e_tps, 3) if e_tps else None,
        "engine_ttft_ms_median": round(min(results["engine_ttft"]), 2) if ttft else None,
        "pipeline_ttft_ms_median": round(min(results["pipeline_ttft"]), 2) if ttft else None,
        "ttft_added_ms_median": round(statistics.median(results["ttft_added"]), 2) if ttft else None,
        "engine_cpu": e_cpu,
        "pipeline_cpu": p_cpu,
        "pipeline_cpu_but_worker": {k: round(sum(u[k] for name, u in p_cpu.items() if name != "worker"), 3)
                                    for k in ("cores", "us_per_token")},
        "bus_messages_per_token": results.get("bus"),
        "rounds": rounded,
    }


def rounded_cpu(used: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {name: {"cores": round(u["cores"], 3), "us_per_token": round(u["us_per_token"], 1)}
            for name, u in used.items()}


def table(r: dict) -> str:
    w = r["workload"]
    stand_in = w["stand_in_step_ms"] is not None
    return "\n".join([
        f"workload: {w['num_requests']} requests at once, prompts {w['input_len'][0]}-{w['input_len'][1]} tokens, "
        f"outputs {w['output_len'][0]}-{w['output_len'][1]}; best of {w['repeat']} rounds",
        *([f"the worker's engine is a stand-in whose step sleeps {w['stand_in_step_ms']:g} ms: the pipeline alone",
           f"{'output tokens/s':24}{r['pipeline_output_tokens_per_s']:>12.1f}"] if stand_in else [
            f"{'':24}{'engine':>12}{'pipeline':>12}{'ratio / added':>16}",
            f"{'output tokens/s':24}{r['engine_output_tokens_per_s']:>12.1f}{r['pipeline_output_tokens_per_s']:>12.1f}"
            f"{r['throughput_ratio']:>15.1%}"]),
        *([f"{'TTFT median (ms)':24}{r['engine_ttft_ms_median']:>12.2f}{r['pipeline_ttft_ms_median']:>12.2f}"
           f"{r['ttft_added_ms_median']:>+15.2f}   ({w['ttft_requests']} requests one at a time)"]
          if r["ttft_added_ms_median"] is not None else []),
        "CPU in the best round (cores; µs per output token):",
        *(f"  {side:9}{name:10}{u['cores']:>6.2f}{u['us_per_token']:>10.1f}"
          for side in ("engine", "pipeline") for name, u in r[f"{side}_cpu"].items()),
        f"  {'pipeline':9}{'the rest':10}{r['pipeline_cpu_but_worker']['cores']:>6.2f}"
        f"{r['pipeline_cpu_but_worker']['us_per_token']:>10.1f}   (every process but the worker)",
        *([f"bus messages per output token: {', '.join(f'{k} {v:g}' for k, v in bus.items())}"]
          if (bus := r["bus_messages_per_token"]) else []),
    ])


if __name__ == "__main__":
    bus.run(serve_stand_in(stand_in_parser().parse_args()))

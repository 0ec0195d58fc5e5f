"""`tokenbus sim-check`: how well `tokenbus sim`, with the CPU cost fitted on this machine, predicts the
real CPU stack.

For each worker count and workload, a fresh stack (`tokenbus up`'s processes: nats-server, tokenizer,
router, the workers, the gateway) is warmed with prompts of every length the run sends, then:
1. probes, one request at a time on the idle stack, measure what the simulator takes as constants:
   the dispatch (the gateway accepting a request → its worker receiving it: the completion records'
   queue_ms), the stream (a token sampled → the client: the rest of the client's TTFT beyond the
   worker's), and from a short prompt's decode steps and a long prompt's prefill, how much slower the
   engine's steps are in the stack than alone (the scale of the fitted cost) and each step's work
   outside the engine (the overhead); then, with every worker decoding a long request, how many of a
   busy worker's steps a new request waits before it joins the engine (the intake: the worker reads
   its work between steps, and the item's checks take replies from the bus), and how much slower the
   steps run beside each other than alone, beyond the share of the cores (the contention: workers
   stepping at once share the memory's bandwidth and the caches; from the workers' traced steps, the
   busy probes' against the idle ones', for decodes and for long prefills beside the others' decodes);
2. a pilot of the workload runs (`pilot_args`: the same rate and concurrency, a third of Poisson's requests,
   half of each conversation's turns, drawn from another seed, so other prompts); it runs again after the
   measured runs (step 3), from yet another seed;
3. the workload runs through the gateway's websocket as token ids, greedy, EOS ignored, so every
   output has its max_tokens (`--repeat N`: N times from the same seed, in other token ids so each run
   starts with a cold prefix cache; Poisson's requests are then the same, a chat's draws interleave as
   its replies come; `--repeat N M`: N times the first of `--workloads`, M times the second):
   - poisson: one-turn requests of random prompts, Poisson arrivals;
   - chat: conversations of several turns behind a few shared system prompts, each turn the whole
     history (with the replies the model gave) plus a new user message, after a pause to type it;
4. the idle probes run again (on prompts the stack has not seen): an idle stack's steps move by ±10%
   between one probe and the next on a shared machine, so the scale and constants are the means of
   the two rounds;
5. what the client sent — each request's time from the start, its prompt and max_tokens — is replayed
   in `lab.capacity.sim.simulate` with the workers' engine settings, thread count and the probes' constants, a
   busy worker taking a request the probed number of its steps after it comes, each step's time the
   fitted cost at the pilots' speed (`run_speed` on the pilots' steps, both pilots together) drawn about
   with the spread the idle probes' steps had about the fit (the jitter). The pilots time the workload's
   own kind of steps, which one scale probed on a lone long prefill does not: the fit puts a lone
   prefill of 128-512 tokens 3-12% short and a chat's small prefills beside decodes about right, so the
   idle probes' scale ran 5.5% long on the chat's steps on average (its replay is kept beside as
   `probed_speed`). Each run is replayed `--replicas` times, each replay drawing its own jitter, and
   the simulated figures are the replays' means: which worker a few steps' timing puts a burst of a
   chat's turns on decides its p99, so one replay is one draw of it, as the real run is. With several
   runs the figures compared are the runs' means, and each real figure's spread ((largest − smallest) /
   mean) says how far the real stack itself moves on the same workload: an error below it is noise;
6. the same replay runs again at the run's own speed (`run_speed`): the scale of the fitted cost that
   times the real workers' steps (each worker appends its steps' shapes and durations to the file
   --step-trace names), so that the machine's drift between the pilots and the run (±10% over minutes on
   a shared machine) is told apart from what the simulator models: queueing, batching, routing, the
   sharing of the cores. Only the steps' durations go in, no request's latency.
Figures as `tokenbus bench` defines them, per request on the client: TTFT (send → first token), TPOT
((e2e − TTFT) / (output tokens − 1)); throughput: output tokens / (the last end − the first send).
Each worker gets max(1, (cores − 1) // workers) torch threads; the cost is fitted at that count. The
simulated workers share the machine's cores by processor sharing (3 workers on 2 cores: each step 1.5×
as long while all step), less what the stack's other processes take (nats-server, tokenizer, router,
gateway and this client; `Meter`, from /proc) while every worker is busy in the intake probe
(SimConfig.background_cores): 3 workers on 2 cores fill them, and those processes' 0.07 cores
lengthen every step by about 4%.
`--steps` shows the real and simulated steps side by side (`steps_report`).
"""
import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import websockets

from lab.capacity import cost as sim_cost
from lab.capacity import sim
from lab.common.records import records, results_seq
from lab.common.results import Result
from ops.procs import cpu_seconds, free_port
from ops.up import Stack
from schemas import subjects
from workers.models.catalogue import resolve
from workers.models.config import ModelConfig

REQUEST_TIMEOUT = 300.0       # seconds; a request slower than this means the stack is broken
PROBES = 12                   # idle requests of each kind, one at a time (6 moved the step scale by ±10%)
PROBE_PROMPT, PROBE_OUTPUT = 32, 24
PROBE_LONG = 384
BUSY_OUTPUT = 256             # tokens of each request that keeps a worker busy while the intake is probed
METRICS = (("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99"))


@dataclass(slots=True)
class Sent:
    """One request as the client sent it and saw it."""
    at: float                     # seconds from the run's start
    prompt: list[int]
    max_tokens: int
    result: Result
    output: list[int] = field(default_factory=list)


class Client:
    """Many requests on one websocket, as token ids; frames go to the queue of their id."""

    def __init__(self, ws, t0: float):
        self.ws, self.t0, self.queues, self.n = ws, t0, {}, 0
        self.sent: list[Sent] = []                # every request sent, as it goes

    async def read(self) -> None:
        async for raw in self.ws:
            t = time.perf_counter()
            frame = orjson.loads(raw)
            self.queues[frame["id"]].put_nowait((t, frame))

    async def send(self, prompt: list[int], max_tokens: int) -> Sent:
        self.n += 1
        rid, queue = str(self.n), asyncio.Queue()
        self.queues[rid] = queue
        s = Sent(time.perf_counter() - self.t0, prompt, max_tokens, Result(time.perf_counter()))
        self.sent.append(s)
        await self.ws.send(orjson.dumps({"type": "generate", "id": rid, "prompt_token_ids": prompt,
                                         "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).decode())
        while True:
            t, frame = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT)
            if frame["type"] == "error":
                raise RuntimeError(f"a request of {len(prompt)} prompt tokens failed: {frame}")
            if frame["type"] == "delta" and frame["token_ids"]:
                s.result.chunks.append(t)
                s.output += frame["token_ids"]
            if frame["type"] == "done":
                del self.queues[rid]
                s.result.end, s.result.output_tokens = t, len(s.output)
                return s


@contextlib.asynccontextmanager
async def connect(url: str):
    async with websockets.connect(url, max_size=None, compression=None) as ws:
        c = Client(ws, time.perf_counter())
        reader = asyncio.create_task(c.read())
        try:
            yield c
        finally:
            reader.cancel()


# -- workloads ------------------------------------------------------------------------------------

def tokens(rng: random.Random, n: int, vocab: int, shift: int = 0) -> list[int]:
    """n random ids from 16 on; a `shift` moves each id along by as many (a repeat's same draws, other ids)."""
    return [16 + (rng.randrange(16, vocab) - 16 + shift) % (vocab - 16) for _ in range(n)]


async def poisson(c: Client, args, workers: int, vocab: int, seed: int, shift: int = 0) -> list[Sent]:
    rng = random.Random(seed)
    asks, at = [], 0.0
    for _ in range(args.requests * workers):
        asks.append((at, tokens(rng, rng.randint(*args.prompt_len), vocab, shift), rng.randint(*args.output_len)))
        at += rng.expovariate(args.rate * workers)

    async def one(at: float, prompt: list[int], n: int) -> Sent:
        await asyncio.sleep(max(0.0, c.t0 + at - time.perf_counter()))
        return await c.send(prompt, n)
    return list(await asyncio.gather(*(one(*a) for a in asks)))


async def chat(c: Client, args, workers: int, vocab: int, seed: int, shift: int = 0) -> list[Sent]:
    rng = random.Random(seed)
    systems = [tokens(rng, args.system_len, vocab, shift) for _ in range(args.system_prompts)]
    sent: list[Sent] = []

    async def conversation(k: int) -> None:
        history = list(systems[k % len(systems)])
        await asyncio.sleep(rng.uniform(0, args.think))
        for _ in range(args.turns):
            history += tokens(rng, rng.randint(*args.user_len), vocab, shift)
            s = await c.send(list(history), args.reply_len)
            sent.append(s)
            history += s.output
            await asyncio.sleep(rng.uniform(0, args.think))
    await asyncio.gather(*(conversation(k) for k in range(args.conversations * workers)))
    return sent


WORKLOADS = {"poisson": poisson, "chat": chat}


async def drive(url: str, run, *a) -> list[Sent]:
    async with connect(url) as c:
        return await run(c, *a)


# -- the stack ------------------------------------------------------------------------------------

def threads_for(workers: int) -> int:
    """A worker's share of the cores, one left to the other services: OpenMP threads that outnumber the
    cores they get stall at every barrier (a busy neighbour makes a step tens of times slower)."""
    return max(1, ((os.cpu_count() or 1) - 1) // workers)


def start(model: str, workers: int, args, data_dir: Path) -> Stack:
    threads = threads_for(workers)
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": str(threads)}
    stack = Stack(model, free_port(), data_dir, nats_port=free_port(), workers=workers,
                  worker_args=["--threads", str(threads), "--num-kv-blocks", str(args.kv_blocks),
                               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                               str(args.max_num_batched_tokens), "--block-size", str(args.block_size),
                               "--step-trace", str(data_dir / "steps.jsonl")],      # for run_speed
                  worker_env=env)
    stack.start()
    stack.wait_ready()
    return stack


async def warm(url: str, args, workers: int, vocab: int) -> None:
    """Each worker's first steps of a shape are slow (allocations, kernels): prompts of every length the
    run sends, a few at once per worker, twice, of tokens the run never sends."""
    rng = random.Random("warm")
    longest = max(args.prompt_len[1], args.system_len + args.turns * (args.user_len[1] + args.reply_len))
    lengths = [16, 64, 256, longest // 2, longest]
    async with connect(url) as c:
        for _ in range(2):
            await asyncio.gather(*(c.send(tokens(rng, min(n, args.max_model_len - 20), vocab), 8)
                                   for n in lengths for _ in range(workers)))


@dataclass(slots=True)
class Scaled:
    """A cost model's steps, `scale` times as long (`decode_scale` for steps that only decode): the engine's
    steps inside the stack, which shares the cores with the other services, against the same steps alone
    (where the cost was fitted). The two differ: a step that prefills spends its time in large matmuls, a
    decode step in the per-step work a busy neighbour slows differently."""
    cost: sim_cost.StepCost
    scale: float
    decode_scale: float

    @property
    def name(self) -> str:
        return f"{self.cost.name} × {self.scale:.2f} (decode × {self.decode_scale:.2f})"

    def seconds(self, shape: sim_cost.StepShape) -> float:
        return (self.scale if shape.tokens > shape.rows else self.decode_scale) * self.cost.seconds(shape)


def probe(stack: Stack, cost: sim_cost.StepCost, vocab: int, seed: str = "probe") -> tuple[Scaled, dict]:
    """The stack's step cost and the constants outside the engine, from idle requests one at a time (see the
    module's doc): short prompts that decode and long ones whose first step is one prefill, in turn. A worker's
    TPOT is scale × the decode step's cost + the overhead, its TTFT of a long prompt scale × the prefill's +
    the overhead."""
    rng = random.Random(seed)
    after = asyncio.run(results_seq(stack.nats_url))
    asks = [(PROBE_PROMPT, PROBE_OUTPUT), (PROBE_LONG, 2)] * PROBES      # in turn: a drift moves both kinds alike

    async def serial() -> list[Sent]:
        async with connect(stack.url) as c:
            return [await c.send(tokens(rng, n, vocab), m) for n, m in asks]
    sent = asyncio.run(serial())
    recs = sorted(asyncio.run(records(stack.nats_url, after, len(asks))), key=lambda r: r.created)
    short, long = recs[0::2], recs[1::2]
    tpot = statistics.median((r.timing["e2e_ms"] - r.timing["ttft_ms"]) / 1e3 / (PROBE_OUTPUT - 1) for r in short)
    ttft = statistics.median(r.timing["ttft_ms"] / 1e3 for r in long)
    scaled, overhead = scales(cost, tpot, ttft)
    dispatch = statistics.median(r.timing["queue_ms"] for r in recs) / 1e3
    client_over_worker = statistics.median(s.result.ttft - r.timing["ttft_ms"] / 1e3 for s, r in zip(sent, recs))
    consts = {"dispatch_s": dispatch, "stream_s": max(0.0, client_over_worker - dispatch),
              "step_overhead_s": overhead}
    return scaled, consts


def scales(cost: sim_cost.StepCost, tpot: float, ttft: float) -> tuple[Scaled, float]:
    """The scales and the step overhead from the probes' TPOT (a one-row decode) and TTFT of a long prompt
    (its prefill), TTFT − TPOT being the prefill's cost beyond a decode step's: the scale, then the decode
    scale at most that, the rest of the TPOT the overhead. Below 1 where the machine runs faster now than
    when the cost was fitted: a floor at 1 held the probes at 1.0 in 6 of 8 rounds of run Q, whose own steps
    ran at 0.91-0.95 at 1 worker, and put the chat's TTFT there 21% high."""
    decode, prefill = sim_cost.StepShape(), sim_cost.StepShape()
    decode.add(1, PROBE_PROMPT + PROBE_OUTPUT // 2, 1)
    prefill.add(PROBE_LONG, PROBE_LONG, 1)
    scale = (ttft - tpot) / (cost.seconds(prefill) - cost.seconds(decode))
    decode_scale = min(scale, tpot / cost.seconds(decode))
    return Scaled(cost, scale, decode_scale), max(0.0, tpot - scale * cost.seconds(decode))


def intake(stack: Stack, cost: Scaled, consts: dict, workers: int, vocab: int, meter: "Meter",
           spans: list[tuple[float, float]]) -> int:
    """How many of a busy worker's steps a request waits before it joins the engine: each worker decodes a
    long request while short ones (one output token) come one at a time. A short request's TTFT is the
    dispatch and the stream, the rest of the step under way (half a step on average), the intake's steps,
    and the step that prefills it; each is timed by the long request's token gaps on the short one's
    worker (the completion records say which), and short requests that found an idle worker are left out.
    While the short ones come, `meter` appends the other processes' cores beside the busy workers to
    `spans`. Then long prompts come one at a time, each prefilled beside the others' decodes (`contention`)."""
    rng = random.Random("intake")
    after = asyncio.run(results_seq(stack.nats_url))
    time.sleep(2 * subjects.HEARTBEAT_SECONDS)   # the router sees every worker idle: one long request each

    async def run() -> tuple[list[Sent], list[Sent], list[Sent]]:
        async with connect(stack.url) as c:
            busy = [asyncio.ensure_future(c.send(tokens(rng, PROBE_PROMPT, vocab), BUSY_OUTPUT))
                    for _ in range(workers)]
            while not all(s.result.chunks for s in c.sent):
                await asyncio.sleep(0.01)
            with meter.span(spans):
                probes = [await c.send(tokens(rng, PROBE_PROMPT, vocab), 1) for _ in range(PROBES * workers)]
            long = [await c.send(tokens(rng, PROBE_LONG, vocab), 1) for _ in range(PROBES // 2 * workers)]
            return list(await asyncio.gather(*busy)), probes, long
    busy, probes, long = asyncio.run(run())
    worker = {tuple(r.prompt_token_ids): r.worker
              for r in asyncio.run(records(stack.nats_url, after, len(busy) + len(probes) + len(long)))}
    start, end = min(p.result.start for p in probes), max(p.result.end for p in probes)
    gaps: dict[str, list[float]] = {}
    for s in busy:
        gaps.setdefault(worker[tuple(s.prompt)], []).extend(
            b - a for a, b in itertools.pairwise(s.result.chunks) if start <= a and b <= end)
    prefill, decode = sim_cost.StepShape(), sim_cost.StepShape()
    prefill.add(PROBE_PROMPT, PROBE_PROMPT, 1)
    for shape in (prefill, decode):
        shape.add(1, PROBE_PROMPT + BUSY_OUTPUT // 2, 1)
    prefill_steps = cost.seconds(prefill) / cost.seconds(decode)
    waits = [(p.result.ttft - consts["dispatch_s"] - consts["stream_s"]) / statistics.median(g) - prefill_steps - 0.5
             for p in probes if (g := gaps.get(worker[tuple(p.prompt)]))]
    return max(0, round(statistics.median(waits))) if waits else 0


# -- the other processes ----------------------------------------------------------------------------

@dataclass(slots=True)
class Meter:
    """The cores the stack's processes other than the workers (nats-server, tokenizer, router, gateway) and
    this client take over a span: what the workers' steps share the cores with. A worker's own work between
    its steps is the probed step overhead."""
    pids: list[int]

    @classmethod
    def of(cls, stack: Stack) -> "Meter":
        return cls([p.pid for name, p in stack.children.items() if name not in stack.worker_plan] + [os.getpid()])

    @contextlib.contextmanager
    def span(self, into: list[tuple[float, float]]):
        """Appends (seconds, CPU seconds) of what runs inside to `into`."""
        cpu, t = self.read(), time.monotonic()
        yield
        into.append((time.monotonic() - t, self.read() - cpu))

    def read(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids)


def cores(spans: list[tuple[float, float]]) -> float:
    """The mean cores over metered spans."""
    return sum(c for _, c in spans) / sum(t for t, _ in spans)


# -- one configuration ----------------------------------------------------------------------------

def real_figures(sent: list[Sent]) -> dict:
    ok = [s.result for s in sent]
    start = min(r.start for r in ok)
    out = sum(r.output_tokens for r in ok)
    return {"ttft_s": sim.percentiles([r.ttft for r in ok]),
            "tpot_s": sim.percentiles([r.tpot for r in ok if r.tpot is not None]),
            "output_tokens_per_s": out / (max(r.end for r in ok) - start), "requests": len(ok),
            "output_tokens": out}


def simulated(sent: list[Sent], cost, consts: dict, workers: int, args, trace: bool = False, seed: int = 0) -> dict:
    t0 = min(s.at for s in sent)
    arrivals = sorted((sim.Arrival(s.at - t0, s.prompt, s.max_tokens, output=s.output) for s in sent),
                      key=lambda a: a.at)
    consts = dict(consts)
    beside = (consts.pop("contention_decode", 0.0), consts.pop("contention_prefill", 0.0))
    cfg = sim.SimConfig(workers=workers, cost=cost, block_size=args.block_size, num_blocks=args.kv_blocks,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, rate=0.0, drain=REQUEST_TIMEOUT,
                        trace=trace, contention=beside, seed=seed, **consts)
    r = sim.simulate(cfg, arrivals)
    out = r["output_tokens_per_s"] * r["sim_seconds"]
    return {"ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "ttft_samples": r["samples"]["ttft"],
            "output_tokens_per_s": out / (r["sim_seconds"] + consts["stream_s"]), "requests": r["finished"],
            "output_tokens": out, "prefix_hit_rate": r["prefix_hit_rate"], "preemptions": r["preemptions"]} \
        | ({k: r[k] for k in ("steps", "tracks")} if trace else {})


def replicated(sent: list[Sent], cost, consts: dict, workers: int, args, trace: bool = False) -> dict:
    """The simulator's figures for one run: the means over `args.replicas` replays, each drawing its steps'
    jitter (consts["jitter"]) from a seed of its own. Where a few steps' timing decides which worker a turn
    goes to, one replay is one draw of where the turns pile up, and a p99 of a hundred turns is its second
    largest; the real run is one draw too, the mean of the replays what the simulator predicts for it. The
    first replay's steps and requests (`trace`) stand for the rest; the TTFT samples are all of theirs."""
    runs = [simulated(sent, cost, consts, workers, args, trace and seed == 0, seed)
            for seed in range(args.replicas if consts.get("jitter") else 1)]
    out = mean_figures(runs)
    out["ttft_samples"] = [t for r in runs for t in r["ttft_samples"]]
    return out


# -- steps (--steps) ------------------------------------------------------------------------------

def trace_steps(path: Path) -> list[dict]:
    """The real workers' steps: their --step-trace lines."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line] if path.exists() else []


def traced(steps: list[dict], windows: list[tuple[float, float]]) -> list[dict]:
    """The steps that started within one of the windows."""
    return [t for t in steps if any(a <= t["at"] <= b for a, b in windows)]


def kinds(steps: list[dict]) -> tuple[tuple[str, list[dict]], ...]:
    """The decode-only steps and those that prefill."""
    return (("decode", [t for t in steps if t["tokens"] == t["rows"]]),
            ("prefill", [t for t in steps if t["tokens"] > t["rows"]]))


def step_stats(steps: list[dict], seconds: str) -> dict:
    """Counts and means of steps of each kind; `seconds` names the field that times a step."""
    out = {"steps": len(steps)}
    for kind, part in kinds(steps):
        out[kind] = {"steps": len(part), "rows": statistics.fmean(t["rows"] for t in part) if part else 0.0,
                     "tokens": statistics.fmean(t["tokens"] for t in part) if part else 0.0,
                     "kv_read": statistics.fmean(t["kv_read"] for t in part) if part else 0.0,
                     "seconds": statistics.fmean(t[seconds] for t in part) if part else 0.0,
                     "total_s": sum(t[seconds] for t in part)}
    return out


def shape_of(t: dict) -> sim_cost.StepShape:
    return sim_cost.StepShape(t["tokens"], t["rows"], t["sampled"], t["attention"], t["kv_read"])


def stepping(real: list[dict]) -> dict[int, int]:
    """How many workers were stepping at each real step's middle (by id()), its own worker included."""
    spans = [(t["at"], t["at"] + t["loop_s"]) for t in real]
    return {id(t): sum(a <= t["at"] + t["loop_s"] / 2 < b for a, b in spans) for t in real}


def shared(real: list[dict], cores: float, contention: tuple[float, float] = (0.0, 0.0)) -> dict[int, float]:
    """How much longer each real step ran (by id()) than alone, as the simulator slows it (`lab.capacity.sim`'s
    rates): n workers stepping at its middle, on `cores` (those the other processes left), each get
    min(1, cores / n) of a core, and run 1 + contention (of its kind) × (min(n, cores) − 1) slower."""
    n = stepping(real)
    return {id(t): sim.slowdown(n[id(t)], cores, contention[t["tokens"] > t["rows"]]) for t in real}


def speed(steps: list[dict], slow: dict[int, float], cost: sim_cost.StepCost, overhead: float) -> float:
    """The scale of the fitted cost that times these steps: Σ (loop time / its slowdown − the overhead) / Σ the
    fitted cost, the mean speed, which a queue follows."""
    return sum(t["loop_s"] / slow[id(t)] - overhead for t in steps) / sum(cost.seconds(shape_of(t)) for t in steps)


def contention(idle: list[dict], busy: list[dict], cost: sim_cost.StepCost, overhead: float,
               cores: float) -> tuple[float, float]:
    """How much longer a step runs per other core in use by a worker stepping beside it, beyond the share
    of the cores (`shared`), for decode-only steps and for steps that prefill: the probes' steps with
    every worker busy (`intake`: the long requests' decodes, the long prompts' prefills) against the idle
    probes' (`probe`: one request at a time), each as Σ (loop time / the share − the overhead) / Σ the
    fitted cost. 0 where no step ran beside another (one worker)."""
    def picked(steps: list[dict], prefill: bool) -> list[dict]:
        return [t for t in steps if (t["tokens"] >= PROBE_LONG if prefill else t["tokens"] == t["rows"])]
    beside = {k: max(0.0, min(n, cores) - 1) for k, n in stepping(busy).items()}
    out = []
    for prefill in (False, True):
        alone, together = picked(idle, prefill), [t for t in picked(busy, prefill) if beside[id(t)] > 0]
        if not alone or not together:
            out.append(0.0)
            continue
        weight = [cost.seconds(shape_of(t)) for t in together]
        k = sum(w * beside[id(t)] for w, t in zip(weight, together)) / sum(weight)
        ratio = speed(together, shared(busy, cores), cost, overhead) / speed(alone, shared(idle, cores), cost, overhead)
        out.append(max(0.0, (ratio - 1) / k))
    return out[0], out[1]


def jitter(idle: list[dict], cost: sim_cost.StepCost, overhead: float) -> float:
    """How far a step alone strays from the fitted cost, as the simulator draws it (SimConfig.jitter): the
    standard deviation of log(loop time − the overhead) − log(the fitted cost) over the idle probes' steps
    (one request at a time, so each ran alone), each kind about its own median (the scales differ), read
    from the interquartile range (IQR / 1.349, a normal's) so that one stalled step does not set it."""
    logs = []
    for _, part in kinds(idle):
        own = [math.log((t["loop_s"] - overhead) / fitted) for t in part
               if t["loop_s"] > overhead and (fitted := cost.seconds(shape_of(t))) > 0]
        if own:
            mid = statistics.median(own)
            logs += [x - mid for x in own]
    if len(logs) < 4:
        return 0.0
    q = statistics.quantiles(logs, n=4)
    return (q[2] - q[0]) / 1.349


def run_speed(real: list[dict], cost: "Scaled", overhead: float, cores: float,
              contention: tuple[float, float] = (0.0, 0.0)) -> "Scaled":
    """The scale of the fitted cost that times the run's own steps, for each kind (`speed`: the mean, where
    the median step's left out the occasional slow one and put Poisson's TTFT p50 at 1 worker 12% low).
    A kind the run has no step of keeps the probed scale. Only the steps' durations go in, no request's
    latency."""
    slow = shared(real, cores, contention)
    scales = {kind: speed(part, slow, cost.cost, overhead) for kind, part in kinds(real) if part}
    return Scaled(cost.cost, scales.get("prefill", cost.scale), scales.get("decode", cost.decode_scale))


def steps_report(real: list[dict], simd: list[dict], cost: "Scaled", overhead: float, cores: float,
                 contention: tuple[float, float] = (0.0, 0.0)) -> dict:
    """The real steps against the simulator's (counts, shapes, wall times), and the scaled cost (+ the step
    overhead) on the real steps' own shapes against their loop times, slowed as the simulator slows them
    (`shared`; cores: those the other processes left, as metered over the runs): whether an error comes
    from the cost of a step or from what the steps are."""
    slow = shared(real, cores, contention)
    fit = {}
    for kind, part in kinds(real):
        guess = [(cost.seconds(shape_of(t)) + overhead) * slow[id(t)] for t in part]
        fit[kind] = {"median_error": statistics.median(g / t["loop_s"] - 1 for g, t in zip(guess, part)) if part
                     else None,
                     "total_error": sum(guess) / sum(t["loop_s"] for t in part) - 1 if part else None}
    simd = [t | {"wall_s": t["end"] - t["at"]} for t in simd if "end" in t]
    return {"real": step_stats(real, "loop_s"), "sim": step_stats(simd, "wall_s"), "cost_on_real_steps": fit}


def errors(real: dict, simd: dict) -> dict:
    err = {f"{m[:-2]}_{q}": simd[m][q] / real[m][q] - 1 for m, q in METRICS}
    err["throughput"] = simd["output_tokens_per_s"] / real["output_tokens_per_s"] - 1
    return {k: round(v, 4) for k, v in err.items()}


def averaged(probes: list[tuple[Scaled, dict]]) -> tuple[Scaled, dict]:
    """The probes' scales and constants, each the mean of its rounds (before and after the workload)."""
    scaled = Scaled(probes[0][0].cost, statistics.fmean(p.scale for p, _ in probes),
                    statistics.fmean(p.decode_scale for p, _ in probes))
    return scaled, {k: statistics.fmean(c[k] for _, c in probes) for k in probes[0][1]}


def mean_figures(runs: list[dict]) -> dict:
    """Figures of several runs of one workload: each percentile, rate and share the runs' mean."""
    out = dict(runs[0])
    for m in ("ttft_s", "tpot_s"):
        out[m] = {q: statistics.fmean(r[m][q] for r in runs) for q in runs[0][m]}
    for m in ("output_tokens_per_s", "prefix_hit_rate", "preemptions"):
        if m in out:
            out[m] = statistics.fmean(r[m] for r in runs)
    return out


def spread(runs: list[dict]) -> dict:
    """How far runs of the same workload moved: (largest − smallest) / mean, per compared figure."""
    values = {f"{m[:-2]}_{q}": [r[m][q] for r in runs] for m, q in METRICS}
    values["throughput"] = [r["output_tokens_per_s"] for r in runs]
    return {k: round((max(v) - min(v)) / statistics.fmean(v), 4) for k, v in values.items()}


SHIFT = 7919                  # a repeat's token ids move by this many: the same draws, a cold prefix cache
PILOT_SEED = 1000             # a pilot's workload is drawn from the run's seed + this (+ 1 for the one after)


def pilot_args(args):
    """A pilot of the workload: the same rate and concurrency (requests/s, conversations), a third of Poisson's
    requests and half of each conversation's turns."""
    return argparse.Namespace(**{**vars(args), "requests": -(-args.requests // 3), "turns": max(1, args.turns // 2)})


def pilot(stack: Stack, name: str, args, workers: int, vocab: int, seed: int, windows: list) -> int:
    """A pilot of the workload (`pilot_args`, drawn from `seed`) on the stack; its window goes to `windows`.
    Returns how many requests it sent."""
    began = time.monotonic()
    sent = asyncio.run(drive(stack.url, WORKLOADS[name], pilot_args(args), workers, vocab, seed))
    windows.append((began, time.monotonic()))
    return len(sent)


def timed(runs: list, cost: Scaled, consts: dict, workers: int, args) -> dict:
    """The runs replayed with steps timed by `cost`: the mean figures of their replays."""
    return mean_figures([{k: v for k, v in replicated(sent, cost, consts, workers, args).items()
                          if k != "ttft_samples"} for sent, _ in runs])


def check(model: str, workers: int, cost, args, vocab: int, data_dir: Path) -> list[dict]:
    threads = threads_for(workers)
    rows = []
    for k, name in enumerate(args.workloads):
        stack = start(model, workers, args, data_dir / f"{name}-{workers}")
        meter = Meter.of(stack)
        runs, busy, loads = [], [], []               # busy, loads: metered spans of the other processes
        try:
            asyncio.run(warm(stack.url, args, workers, vocab))
            marks = [time.monotonic()]          # the idle probes' and the busy ones' windows in the step trace
            probes = [probe(stack, cost, vocab)]
            marks.append(time.monotonic())
            intake_steps = intake(stack, *probes[0], workers, vocab, meter, busy)
            marks.append(time.monotonic())
            windows, pilots = [], []                   # the runs' and the pilots' windows in the step trace
            piloted_requests = pilot(stack, name, args, workers, vocab, args.seed + k + PILOT_SEED, pilots)
            for rep in range(args.repeat[k]):
                after, began = asyncio.run(results_seq(stack.nats_url)), time.monotonic()
                with meter.span(loads):
                    sent = asyncio.run(drive(stack.url, WORKLOADS[name], args, workers, vocab, args.seed + k,
                                             rep * SHIFT))
                windows.append((began, time.monotonic()))
                runs.append((sent, asyncio.run(records(stack.nats_url, after, len(sent)))))
            piloted_requests += pilot(stack, name, args, workers, vocab, args.seed + k + PILOT_SEED + 1, pilots)
            probes.append(probe(stack, cost, vocab, "probe after"))
        finally:
            stack.stop()
        scaled, consts = averaged(probes)
        consts["intake_steps"], consts["cores"] = intake_steps, os.cpu_count() or 1
        consts["background_cores"], metered = cores(busy), cores(loads)
        trace = trace_steps(data_dir / f"{name}-{workers}" / "steps.jsonl")
        free = consts["cores"] - consts["background_cores"]
        idle = traced(trace, [marks[:2]])
        consts["contention_decode"], consts["contention_prefill"] = contention(
            idle, traced(trace, [marks[1:]]), cost, consts["step_overhead_s"], free)
        beside = (consts["contention_decode"], consts["contention_prefill"])
        consts["jitter"] = jitter(idle, cost, consts["step_overhead_s"])
        reals = [real_figures(sent) for sent, _ in runs]
        pilot_steps = traced(trace, pilots)
        piloted = run_speed(pilot_steps, scaled, consts["step_overhead_s"], free, beside)
        sims = [replicated(sent, piloted, consts, workers, args, args.steps) for sent, _ in runs]
        real_steps = traced(trace, windows)
        at_speed = run_speed(real_steps, scaled, consts["step_overhead_s"], free, beside)
        speed_simd, idle_simd = (timed(runs, speed, consts, workers, args) for speed in (at_speed, scaled))
        sim_steps = [t for simd in sims for t in simd.pop("steps", ())]
        sim_requests = [simd.pop("tracks", ()) for simd in sims]
        recs = [r for _, rs in runs for r in rs]
        samples = [t for simd in sims for t in simd.pop("ttft_samples")]
        real, simd = mean_figures(reals), mean_figures(sims)
        real["dispatch_s"] = sim.percentiles([r.timing["queue_ms"] / 1e3 for r in recs])
        real["worker_ttft_s"] = sim.percentiles([r.timing["ttft_ms"] / 1e3 for r in recs])
        real["intake_s"] = sim.percentiles([r.timing["intake_ms"] / 1e3 for r in recs if "intake_ms" in r.timing])
        simd["dispatch_s"] = sim.percentiles([consts["dispatch_s"]])
        simd["worker_ttft_s"] = sim.percentiles([t - consts["dispatch_s"] - consts["stream_s"] for t in samples])
        row = {"workload": name, "workers": workers, "threads": threads, "runs": len(runs), "real": real,
               "sim": simd, "error": errors(real, simd), "step_scale": round(piloted.scale, 3),
               "decode_scale": round(piloted.decode_scale, 3),
               "pilot_requests": piloted_requests, "pilot_steps": len(pilot_steps),
               "probes": [{"step_scale": round(p.scale, 3), "decode_scale": round(p.decode_scale, 3)}
                          for p, _ in probes],
               "probed_speed": {"step_scale": round(scaled.scale, 3), "decode_scale": round(scaled.decode_scale, 3),
                                "sim": idle_simd, "error": errors(real, idle_simd)},
               "constants": {k: round(v, 6) for k, v in consts.items()},
               "background_cores": {"probed": round(consts["background_cores"], 4), "runs": round(metered, 4)},
               "run_speed": {"step_scale": round(at_speed.scale, 3), "decode_scale": round(at_speed.decode_scale, 3),
                             "sim": speed_simd, "error": errors(real, speed_simd)}}
        if len(runs) > 1:
            row["real_runs"], row["real_spread"] = reals, spread(reals)
        if args.steps:
            row["steps"] = steps_report(real_steps, sim_steps, piloted, consts["step_overhead_s"],
                                        consts["cores"] - metered, beside)
            row["requests"] = [paired(sent, recs, simr, consts["stream_s"])
                               for (sent, recs), simr in zip(runs, sim_requests)]
        rows.append(row)
    return rows


def main(args) -> int:
    if args.replicas < 1:
        raise SystemExit(f"--replicas {args.replicas}: at least 1 replay of each run")
    if len(args.repeat) not in (1, len(args.workloads)) or min(args.repeat) < 1:
        raise SystemExit(f"--repeat {' '.join(map(str, args.repeat))}: one count of at least 1 for every workload, "
                         f"or one for each of --workloads {' '.join(args.workloads)}")
    args.repeat = args.repeat * len(args.workloads) if len(args.repeat) == 1 else args.repeat   # one per workload
    model = resolve(args.model or "tiny")
    cfg = ModelConfig.load(model)
    args.max_model_len = cfg.max_model_len
    report = {"model": Path(model).name, "fits": {}, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.data_dir or tmp)
        for workers in args.workers:
            cost = sim_cost.load_or_fit(model, threads_for(workers))
            report["fits"][f"{threads_for(workers)}t"] = cost.to_json()
            report["results"] += check(model, workers, cost, args, cfg.vocab_size, data_dir)
    report["worst_error"] = round(max(abs(v) for r in report["results"] for v in r["error"].values()), 4)
    for key in ("run_speed", "probed_speed"):
        report[f"worst_error_{key}"] = round(max(abs(v) for r in report["results"]
                                                 for v in r[key]["error"].values()), 4)
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if args.json else table(report))
    return 0


def paired(sent: list[Sent], recs: list, simd: list[dict], stream_s: float) -> list[dict]:
    """Each request of a run as the client saw it on the real stack and in the simulator, in arrival order:
    its arrival, prompt and output tokens, prefix-cache hit, worker, TTFT and TPOT, and where its TTFT went:
    `queue`, from the gateway into the engine (real: the record's queue_ms, of it `intake` from the work
    stream; sim: from its arrival to its first step), and `engine`, from there to its first token."""
    real = {tuple(r.prompt_token_ids): r for r in recs}
    out = []
    for s, m in zip(sorted(sent, key=lambda s: s.at), simd):
        r = real.get(tuple(s.prompt))
        n = s.result.output_tokens
        timing = {k: round(r.timing[k + "_ms"] / 1e3, 4) if r and r.timing.get(k + "_ms") is not None else None
                  for k in ("queue", "intake", "ttft")}
        out.append({"at": round(s.at, 4), "prompt": len(s.prompt), "output": n,
                    "real": {"worker": r.worker if r else "", "cached": r.usage.get("cached_tokens") if r else None,
                             "ttft": round(s.result.ttft, 4), "tpot": s.result.tpot and round(s.result.tpot, 4),
                             "queue": timing["queue"], "intake": timing["intake"], "engine": timing["ttft"]},
                    "sim": {"worker": m["worker"], "cached": m["cached"],
                            "ttft": round(m["first"] + stream_s - m["arrival"], 4) if m["first"] >= 0 else None,
                            "tpot": round((m["end"] - m["first"]) / (n - 1), 4) if m["end"] >= 0 and n > 1 else None,
                            "queue": round(m["began"] - m["arrival"], 4) if m["began"] >= 0 else None,
                            "engine": round(m["first"] - m["began"], 4) if m["first"] >= 0 else None}})
    return out


def step_lines(s: dict) -> list[str]:
    lines = [f"{'steps':16}{'real':>12}{'sim':>12}   (decode-only | with a prefill: count, mean rows, tokens, "
             "context read, ms, total s)"]
    for kind in ("decode", "prefill"):
        r, m = s["real"][kind], s["sim"][kind]
        for label, key, f in (("count", "steps", "{:.0f}"), ("rows", "rows", "{:.1f}"),
                              ("tokens", "tokens", "{:.1f}"), ("context", "kv_read", "{:.0f}"),
                              ("ms", "seconds", "{:.1f}"), ("total s", "total_s", "{:.1f}")):
            scale = 1e3 if key == "seconds" else 1
            lines.append(f"{'  ' + kind + ' ' + label:16}{f.format(r[key] * scale):>12}{f.format(m[key] * scale):>12}")
    for kind, e in s["cost_on_real_steps"].items():
        if e["median_error"] is not None:
            lines.append(f"  cost on the real {kind} steps: median error {e['median_error']:+.1%}, "
                         f"total {e['total_error']:+.1%}")
    return lines


def fmt(p: dict) -> str:
    return f"{p['p50'] * 1e3:.0f}/{p['p99'] * 1e3:.0f}"


def table(r: dict) -> str:
    lines = [f"tokenbus sim-check: {r['model']}; the simulator with the CPU cost fitted on this machine against "
             "the real stack (error = sim / real − 1)"]
    for name, f in r["fits"].items():
        q = f["quality"]
        lines.append(f"fit {name}: R² {q['r2']:.3f}, held-out step error median {q['median_rel_error']:.1%}, "
                     f"p90 {q['p90_rel_error']:.1%} ({q['held_out_steps']} steps)")
    for row in r["results"]:
        real, simd, err, c = row["real"], row["sim"], row["error"], row["constants"]
        spreads = row.get("real_spread")
        before, after = row["probes"][0], row["probes"][-1]
        lines.append("")
        lines.append(f"{row['workload']}, {row['workers']} worker(s) × {row['threads']} thread(s) "
                     f"on {c['cores']:g} cores: "
                     f"{real['requests']} requests × {row['runs']} run(s); dispatch {c['dispatch_s'] * 1e3:.1f} ms, "
                     f"stream {c['stream_s'] * 1e3:.1f} ms, step overhead {c['step_overhead_s'] * 1e3:.2f} ms, intake "
                     f"{c['intake_steps']} steps, contention per other core decode {c['contention_decode']:.1%}, "
                     f"prefill {c['contention_prefill']:.1%}, jitter {c.get('jitter', 0):.1%}, "
                     f"steps × {row['step_scale']:.2f} (decode × {row['decode_scale']:.2f}), timed on the "
                     f"pilots' {row['pilot_steps']} steps of {row['pilot_requests']} requests")
        idle = row["probed_speed"]
        lines.append(f"at the idle probes' speed: steps × {idle['step_scale']:.2f} (decode × "
                     f"{idle['decode_scale']:.2f}; before/after {before['step_scale']:.2f}/{after['step_scale']:.2f}, "
                     f"decode {before['decode_scale']:.2f}/{after['decode_scale']:.2f}), errors "
                     + ", ".join(f"{k} {v:+.1%}" for k, v in idle["error"].items()))
        bg = row["background_cores"]
        lines.append(f"other processes: {bg['probed']:.3f} cores beside the busy workers (the intake probe's; "
                     f"the simulator's), {bg['runs']:.3f} metered over the runs")
        fast = row["run_speed"]
        lines.append(f"at the run's speed: steps × {fast['step_scale']:.2f} (decode × {fast['decode_scale']:.2f}), "
                     "from the real steps' own durations")
        lines.append(f"{'':16}{'real':>12}{'sim':>12}{'error':>10}{'run speed':>12}{'error':>10}"
                     + (f"{'real spread':>13}" if spreads else ""))
        for m, q in METRICS:
            key = m[:-2] + "_" + q
            lines.append(f"{m[:-2].upper() + ' ' + q + ' (ms)':16}{real[m][q] * 1e3:>12.1f}{simd[m][q] * 1e3:>12.1f}"
                         f"{err[key]:>+10.1%}{fast['sim'][m][q] * 1e3:>12.1f}{fast['error'][key]:>+10.1%}"
                         + (f"{spreads[key]:>13.1%}" if spreads else ""))
        for m, name in (("dispatch_s", "dispatch"), ("intake_s", "of it intake"), ("worker_ttft_s", "worker TTFT")):
            lines.append(f"{'  ' + name + ' p50/p99':16}{fmt(real[m]):>12}{fmt(simd[m]) if m in simd else '-':>12}")
        lines.append(f"{'output tok/s':16}{real['output_tokens_per_s']:>12.1f}{simd['output_tokens_per_s']:>12.1f}"
                     f"{err['throughput']:>+10.1%}{fast['sim']['output_tokens_per_s']:>12.1f}"
                     f"{fast['error']['throughput']:>+10.1%}" + (f"{spreads['throughput']:>13.1%}" if spreads else ""))
        if "steps" in row:
            lines += step_lines(row["steps"])
    lines.append("")
    lines.append(f"worst error: {r['worst_error']:.1%} (at the run's speed: {r['worst_error_run_speed']:.1%}; "
                 f"at the idle probes': {r['worst_error_probed_speed']:.1%})")
    return "\n".join(lines)

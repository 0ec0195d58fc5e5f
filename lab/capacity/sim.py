"""`tokenbus sim`: a discrete-event simulation of a cluster that runs the project's own scheduling code.

Each simulated worker is one real `Scheduler` over one real `KVCacheManager`; the router is one real
`Registry` (services/router/policy.py) with its real `KvIndex`, fed the heartbeats and KV events the
workers would publish. Nothing of the model runs: a step's duration comes from a cost model of its
shape (lab/capacity/cost.py: the plan's roofline for GPUs, a fit of the real engine for this CPU), and its
sampled tokens are drawn at random. So a change to the scheduler's or the router's policy changes the
simulation, and the simulation says what it would do to a fleet.

Events, in time order: an arrival (routed after `dispatch_s`, the gateway → tokenizer → router → worker
path), a step's end (its tokens applied with `Scheduler.update`, the KV events sent to the router's
index, the next step scheduled at once), a heartbeat (every HEARTBEAT_SECONDS per worker), and with
disaggregated serving a handoff and a KV transfer's end.

Workloads: Poisson arrivals of multi-turn chats, or a replayed log (`tokenbus log export`). A chat turn
is a new conversation with probability 1/turns, else the next turn of the conversation idle longest:
its prompt is the whole history (the system prompt, every user message and answer) and a new user
message, so prefix caching and prefix-aware routing meet the sharing a chat product has; the system
prompts are shared by every conversation that drew them.

Scale: a fleet is `cells` router cells of identical make-up, each with its own router and its share of
the arrivals (the gateway pins a conversation to a cell). Cells are independent, so `sample_cells` of
them are simulated — in parallel processes — and stand for all: docs/capacity.md says why one router
cannot pick among a thousand workers at 5k requests/s, and measures the simulator's speed.
"""
import dataclasses
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from lab.capacity.cost import RooflineCost, StepCost, StepShape
from schemas.hashing import hash_blocks
from schemas.messages import MAX_WEIGHT, MIN_WEIGHT, Heartbeat, KvEvent
from schemas.sampling import SamplingParams
from schemas.subjects import HEARTBEAT_SECONDS
from services.router.policy import Choice, Options, Registry
from workers.engine.kv_cache import KVCacheManager
from workers.engine.request import Request
from workers.engine.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True, slots=True)
class SimTenant:
    """A tenant of the simulated product: its share of the arrivals (of conversations: a conversation keeps
    its tenant), and what its API key gives its requests, the fair policy's weight and a priority."""
    name: str
    share: float = 1.0
    weight: float = 1.0
    priority: int = 0


def parse_tenant(text: str) -> SimTenant:
    """NAME:SHARE[:WEIGHT[:PRIORITY]], as `--tenant` takes it."""
    parts = text.split(":")
    try:
        if not 2 <= len(parts) <= 4 or not parts[0]:
            raise ValueError
        name, share, *rest = parts
        t = SimTenant(name, float(share), float(rest[0]) if rest else 1.0, int(rest[1]) if len(rest) > 1 else 0)
    except ValueError:
        raise ValueError(f"--tenant {text!r}: expected NAME:SHARE[:WEIGHT[:PRIORITY]], e.g. batch:0.8:1:5") from None
    if t.share <= 0 or not MIN_WEIGHT <= t.weight <= MAX_WEIGHT:
        raise ValueError(f"--tenant {text!r}: the share must be above 0 and the weight in [{MIN_WEIGHT:g}, "
                         f"{MAX_WEIGHT:g}]")
    return t


@dataclass(slots=True)
class Arrival:
    at: float                    # seconds from the start of the run
    prompt: list[int]            # token ids
    max_tokens: int
    conversation: str = ""
    output: list[int] | None = None   # the tokens it got (a replay): sampled in turn, so that a next turn that
                                      # carries them in its prompt finds them in the prefix cache, as it did


@dataclass
class SimConfig:
    # the fleet: `cells` router cells, each with these workers
    workers: int = 1             # colocated workers (role both) per cell
    prefill_workers: int = 0     # per cell
    decode_workers: int = 0      # per cell
    cells: int = 1
    sample_cells: int = 0        # cells simulated (0: all); they stand for the rest
    processes: int = 1           # cells simulated at once
    # each worker's engine
    cost: StepCost | None = None
    block_size: int = 16
    num_blocks: int = 4096       # KV blocks per worker
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    # the router
    policy: str = "prefix"
    router: dict = field(default_factory=dict)   # services.router.policy.Options fields
    # latencies outside the engine
    dispatch_s: float = 0.0      # arrival -> the worker's queue (gateway, tokenizer, router, bus)
    stream_s: float = 0.0        # a sampled token -> the client
    step_overhead_s: float = 0.0 # per step, outside the engine's step (publishing tokens)
    cores: float = 0.0           # CPU cores the workers share, each busy one an equal share (0: a device each)
    background_cores: float = 0.0  # of those, what the other processes take (the bus, the services, the client)
    contention: tuple[float, float] = (0.0, 0.0)   # CPU workers: how much longer a step runs per other core
                                 # in use by a worker stepping beside it (memory bandwidth, caches), beyond the
                                 # share of the cores: (decode-only steps, steps that prefill)
    jitter: float = 0.0          # each step's time × e^(N(0, jitter) − jitter²/2), a factor of mean 1: a real
                                 # step's spread around the cost model (sim-check measures it on steps alone)
    intake_steps: int = 0        # a request reaching a busy worker joins its queue after this many of its steps
                                 # (a real worker takes work between steps, and its checks wait on the bus)
    # the workload: Poisson chats (unless arrivals are given)
    rate: float = 10.0           # requests/s over the whole fleet
    duration: float = 60.0       # seconds of arrivals
    warmup: float = 0.0          # requests arriving before this are run but not measured
    drain: float = 120.0         # seconds after the arrivals end that unfinished requests are awaited
    turns: int = 8               # per conversation
    system_tokens: int = 1000
    system_prompts: int = 8
    user_tokens: int = 100       # per turn
    output_tokens: int = 400     # per turn
    vocab_size: int = 32000
    # speculative decoding
    spec_k: int = 0              # draft tokens per decoding request and step (0: off)
    spec_acceptance: float = 0.7 # each draft token kept with this probability, up to the first rejected
    spec_draft_cost: float = 0.0 # a draft token's cost, as a share of the target's decode step (0: n-gram)
    spec_max_batch: int = 1 << 30  # no drafting above this many requests in a step
    # disaggregation
    kv_bandwidth: float = 300e6  # bytes/s of one KV transfer
    kv_bytes_per_token: float = 0.0
    kv_latency_s: float = 0.002  # per transfer, on top of its bytes
    # SLOs
    ttft_slo: float = 0.7
    tpot_slo: float = 0.04
    seed: int = 0
    scheduler: Callable[[SchedulerConfig, KVCacheManager], Scheduler] = Scheduler   # the policy under test
    scheduling_policy: str = "fcfs"   # the workers' (SchedulerConfig.policy): fcfs, priority or fair
    tenants: tuple[SimTenant, ...] = (SimTenant("default"),)
    trace: bool = False          # the result's "steps" (every step's worker, start, end, seconds and shape) and
                                 # "tracks" (each request's worker, arrival, first step, first token, end,
                                 # cached tokens)

    @property
    def cell_workers(self) -> int:
        return self.workers + self.prefill_workers + self.decode_workers


@dataclass(slots=True)
class Conversation:
    id: str
    tokens: list[int]            # the history
    hashes: list[int]            # block hashes of its full blocks
    turn: int = 0
    tenant: SimTenant | None = None


@dataclass(slots=True)
class Track:
    """One request as the client sees it."""
    arrival: float
    prompt: int
    max_tokens: int
    conversation: Conversation | None = None
    measured: bool = True
    cached: int = -1             # prefix-cache hit where it was prefilled
    began: float = -1.0          # when its first step began (traced only)
    first: float = -1.0          # when its first token was sampled
    end: float = -1.0
    tokens: int = 0
    worker: str = ""
    choice: Choice | None = None
    tenant: str = ""
    output: list[int] | None = None   # the tokens it is known to sample (Arrival.output)


class Worker:
    """One simulated worker: the real scheduler and KV manager, stepping in simulated time."""

    def __init__(self, name: str, role: str, cfg: SimConfig):
        self.name, self.role = name, role
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size)
        self.kv.record_changes()
        self.sched = cfg.scheduler(SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                                                   policy=cfg.scheduling_policy), self.kv)
        self.busy = False
        self.batch = None
        self.left = 0.0                                 # CPU workers: seconds of the step's work left, at one core
        self.prefilling = False                         # the step under way prefills
        self.started = 0.0                              # when the step under way started
        self.token = 0                                  # CPU workers: the valid end event of the step under way
        self.hb: Heartbeat | None = None                # the last heartbeat built (between steps; set by run)
        self.beat_due = False                           # one fell due during the step under way
        self.intake: list[list] = []                    # [steps left, request] not in the scheduler yet
        self.seq = 0                                    # KV events sent
        self.finished = self.prompt_tokens = self.generation_tokens = 0
        self.busy_s = 0.0
        self.steps = 0
        self.step_tokens = 0
        self.kv_use: list[float] = []                   # at each heartbeat
        self.load: list[int] = []                       # running + waiting at each heartbeat

    def heartbeat(self, now: float, cfg: SimConfig) -> Heartbeat:
        s, kv = self.sched, self.kv
        return Heartbeat(self.name, now, "sim", kv.block_size, cfg.max_num_seqs, len(s.running), len(s.waiting),
                         kv.num_blocks, kv.num_free_blocks, kv.prefix_queries, kv.prefix_hits, self.finished,
                         s.num_preemptions, self.prompt_tokens, self.generation_tokens,
                         s.queued_blocks(), role=self.role)


class Cell:
    """One router cell: its router, its workers and its share of the arrivals."""

    def __init__(self, cfg: SimConfig, index: int, arrivals: list[Arrival] | None = None):
        self.cfg, self.index = cfg, index
        self.rng = random.Random(cfg.seed * 1_000_003 + index)          # sampled tokens, drafts kept
        self.arrivals_rng = random.Random(cfg.seed * 1_000_003 + index + 500_000)  # prompts
        self.clock = random.Random(cfg.seed * 1_000_003 + index + 700_000)  # arrival times: the same under any policy
        self.noise = random.Random(cfg.seed * 1_000_003 + index + 900_000)  # the steps' jitter
        self.registry = Registry(Options(policy=cfg.policy, **cfg.router))
        names = ([(f"w{i}", "both") for i in range(cfg.workers)] + [(f"p{i}", "prefill") for i in
                 range(cfg.prefill_workers)] + [(f"d{i}", "decode") for i in range(cfg.decode_workers)])
        self.workers = {name: Worker(name, role, cfg) for name, role in names}
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.shared_at = 0.0                            # CPU workers: when the steps' work left was last counted
        self.tracks: dict[str, Track] = {}
        self.unfinished = 0
        self.idle: deque[Conversation] = deque()
        self.systems = [self.tokens(cfg.system_tokens, self.arrivals_rng) for _ in range(max(cfg.system_prompts, 1))]
        self.system_hashes = [hash_blocks(s, cfg.block_size) for s in self.systems]
        self.conversations = 0
        self.route_s = 0.0
        self.routes = 0
        self.handoffs = 0
        self.rate = cfg.rate / cfg.cells
        self.arrivals = arrivals
        self.end = cfg.duration
        self.steps: list[dict] = []                     # cfg.trace: every step, as it starts
        self.stepping: dict[str, dict] = {}             # cfg.trace: each busy worker's step under way

    # -- the event queue --------------------------------------------------------------------------

    def at(self, t: float, fn, arg=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, arg))

    def run(self) -> dict:
        started = time.perf_counter()
        for i, w in enumerate(self.workers.values()):
            w.hb = w.heartbeat(0.0, self.cfg)
            self.registry.update(w.hb)
            self.registry.index.load_snapshot(w.name, 0, [])
            self.at(HEARTBEAT_SECONDS * (i + 1) / len(self.workers), self.beat, w)
        if self.arrivals is not None:
            for a in self.arrivals:
                self.at(a.at, self.arrive, a)
            self.end = max((a.at for a in self.arrivals), default=0.0)
        elif self.rate > 0:
            self.at(self.clock.expovariate(self.rate), self.arrive)
        limit = self.end + self.cfg.drain
        while self.events:
            t, _, fn, arg = heapq.heappop(self.events)
            if t > limit or (t > self.end and self.done()):
                break
            self.now = t
            fn(arg)
        return self.summary(time.perf_counter() - started)

    def done(self) -> bool:
        return self.unfinished == 0

    # -- arrivals ---------------------------------------------------------------------------------

    def tokens(self, n: int, rng: random.Random | None = None) -> list[int]:
        rand = (rng or self.rng).randrange
        return [rand(16, self.cfg.vocab_size) for _ in range(n)]

    def chat_turn(self) -> tuple[list[int], list[int], Conversation]:
        """The next chat request: a new conversation's first turn, or the next turn of the one idle longest."""
        cfg = self.cfg
        conv = None
        rng = self.arrivals_rng
        if self.idle and rng.random() >= 1 / cfg.turns:
            conv = self.idle.popleft()
        if conv is not None and len(conv.tokens) + cfg.user_tokens + cfg.output_tokens > cfg.max_model_len:
            conv = None                                 # its history outgrew the context: the user starts over
        if conv is None:
            self.conversations += 1
            k = rng.randrange(len(self.systems))
            # one tenant draws nothing: the prompts' random stream stays what it was before tenants
            tenant = self.cfg.tenants[0] if len(self.cfg.tenants) == 1 else rng.choices(
                self.cfg.tenants, [t.share for t in self.cfg.tenants])[0]
            conv = Conversation(f"c{self.index}.{self.conversations}", self.systems[k], self.system_hashes[k],
                                tenant=tenant)
        prompt = conv.tokens + self.tokens(cfg.user_tokens, rng)
        conv.turn += 1
        return prompt, hash_blocks(prompt, cfg.block_size, None, conv.hashes), conv

    def arrive(self, a: Arrival | None) -> None:
        cfg = self.cfg
        if a is None:
            prompt, hashes, conv = self.chat_turn()
            max_tokens = cfg.output_tokens
            nxt = self.now + self.clock.expovariate(self.rate)
            if nxt < cfg.duration:
                self.at(nxt, self.arrive)
        else:
            prompt, hashes, conv, max_tokens = a.prompt, hash_blocks(a.prompt, cfg.block_size), None, a.max_tokens
        rid = f"r{self.index}.{len(self.tracks)}"
        tenant = conv.tenant if conv is not None else cfg.tenants[0]      # a replayed request: the first tenant
        self.tracks[rid] = Track(self.now, len(prompt), max_tokens, conv, self.now >= cfg.warmup, tenant=tenant.name,
                                 output=a.output if a is not None else None)
        self.unfinished += 1
        req = Request(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0,
                      cfg.block_size, block_hashes=hashes[:len(prompt) // cfg.block_size], priority=tenant.priority,
                      tenant=tenant.name, weight=tenant.weight)
        self.at(self.now + cfg.dispatch_s, self.route, req)

    def route(self, req: Request, handoff: bool = False) -> Choice | None:
        started = time.perf_counter()
        choice = self.registry.pick(self.now, req.token_ids[:req.num_prompt_tokens], None, handoff,
                                    {self.cfg.block_size: req.block_hashes})
        self.route_s += time.perf_counter() - started
        self.routes += 1
        if choice is None:                              # no worker alive for it: the router waits for one
            self.at(self.now + HEARTBEAT_SECONDS, self.route_handoff if handoff else self.route, req)
            return None
        if handoff:
            return choice
        track = self.tracks[req.request_id]
        track.worker, track.choice = choice.worker, choice
        w = self.workers[choice.worker]
        w.prompt_tokens += req.num_prompt_tokens
        if w.busy and self.cfg.intake_steps:
            w.intake.append([self.cfg.intake_steps, req])
            return choice
        w.sched.add(req)
        self.start(w)
        return choice

    # -- steps ------------------------------------------------------------------------------------

    def start(self, w: Worker) -> None:
        if w.busy or not w.sched.has_unfinished():
            return
        cfg = self.cfg
        batch = w.sched.schedule()
        if not batch.requests:                          # no blocks for anyone: a finish or a transfer frees some
            return
        if cfg.spec_k and len(batch.requests) <= cfg.spec_max_batch:
            self.draft(w, batch)
        shape = StepShape()
        drafted = 0
        for req, n, samples, drafts in zip(batch.requests, batch.num_new_tokens, batch.samples, batch.drafts):
            shape.add(n, req.num_computed_tokens + n, (1 + len(drafts)) if samples else 0)
            drafted += len(drafts)
        seconds = cfg.cost.seconds(shape)
        if cfg.jitter:
            seconds *= math.exp(self.noise.gauss(0.0, cfg.jitter) - cfg.jitter ** 2 / 2)
        seconds += cfg.step_overhead_s
        if drafted and cfg.spec_draft_cost:
            seconds += cfg.spec_draft_cost * cfg.spec_k * cfg.cost.seconds(
                StepShape(shape.rows, shape.rows, shape.rows, float(shape.kv_read), shape.kv_read))
        w.steps += 1
        w.step_tokens += shape.tokens
        if cfg.trace:                                   # "seconds" at a whole core; "end" when it ended
            self.steps.append(step := {"worker": w.name, "at": self.now, "seconds": seconds, **asdict(shape)})
            self.stepping[w.name] = step
            for req in batch.requests:
                if (track := self.tracks[req.request_id]).began < 0:
                    track.began = self.now
        if cfg.cores:                                   # CPU workers beyond the cores time-share them
            self.advance()                              # at the share before this worker joins
        w.busy, w.batch, w.started, w.prefilling = True, batch, self.now, shape.tokens > shape.rows
        if cfg.cores:
            w.left = seconds
            self.reschedule()
        else:
            self.at(self.now + seconds, self.step_end, w)

    # -- CPU workers sharing the cores (cfg.cores) ---------------------------------------------------
    # Processor sharing: while n workers step, each runs at min(1, cores / n) of a core, so a step's
    # end moves whenever another worker starts or ends one. The other processes take background_cores
    # of them: that slows the steps only while the workers fill the rest. Steps running side by side
    # also slow each other beyond that (they share the memory's bandwidth and the caches): by
    # cfg.contention of their kind per other core in use, min(n, cores) − 1.

    def rates(self) -> list[tuple[Worker, float]]:
        """Each stepping worker and its speed, in cores: 1 / its `slowdown`."""
        busy = [w for w in self.workers.values() if w.busy]
        cores = self.cfg.cores - self.cfg.background_cores
        return [(w, 1 / slowdown(len(busy), cores, self.cfg.contention[w.prefilling])) for w in busy]

    def advance(self) -> None:
        """Counts the work the steps under way did since the last count, at the speeds they had."""
        dt = self.now - self.shared_at
        for w, rate in self.rates():
            w.left -= dt * rate
        self.shared_at = self.now

    def reschedule(self) -> None:
        """Each step under way ends when its work left is done at today's speeds (earlier ends are void)."""
        for w, rate in self.rates():
            w.token = self.seq + 1
            self.at(self.now + max(w.left, 0.0) / rate, self.shared_end, (w, w.token))

    def shared_end(self, arg) -> None:
        w, token = arg
        if token != w.token:
            return
        self.advance()
        self.step_end(w)
        if not w.busy:                                  # a next step's start rescheduled the others already
            self.reschedule()

    def draft(self, w: Worker, batch) -> None:
        """Draft tokens for the decoding requests: random ones, which the step keeps with the acceptance rate."""
        for i, req in enumerate(batch.requests):
            if batch.samples[i] and req.num_computed_tokens >= req.num_prompt_tokens:
                w.sched.add_drafts(batch, i, self.tokens(self.cfg.spec_k))

    def sample(self, req: Request, drafts: list[int]) -> list[int]:
        known = self.tracks[req.request_id].output
        if known and req.num_output_tokens < len(known) and not drafts:
            return [known[req.num_output_tokens]]
        p, keep = self.cfg.spec_acceptance, 0
        while keep < len(drafts) and self.rng.random() < p:
            keep += 1
        token = self.rng.randrange(16, self.cfg.vocab_size)
        if keep < len(drafts) and token == drafts[keep]:
            token = 16 + (token - 15) % (self.cfg.vocab_size - 16)
        return drafts[:keep] + [token]

    def step_end(self, w: Worker) -> None:
        batch, w.busy, w.batch = w.batch, False, None
        if self.cfg.trace:
            self.stepping.pop(w.name)["end"] = self.now
        w.busy_s += self.now - w.started
        tokens = [self.sample(r, d) for r, d, s in zip(batch.requests, batch.drafts, batch.samples) if s]
        updated = w.sched.update(batch, tokens, [[None] * len(t) for t in tokens])
        for req in updated:
            track = self.tracks[req.request_id]
            if track.first < 0:
                track.first, track.cached = self.now, req.num_cached_tokens
            if req.finished:
                self.finish(w, req, track)
            elif w.role == "prefill":
                self.hand_off(w, req)
        w.generation_tokens += sum(map(len, tokens))
        stored, removed = w.kv.take_changes()
        if stored or removed:
            w.seq += 1
            self.registry.index.apply(KvEvent(w.name, w.seq, stored, removed))
        if w.beat_due:
            w.beat_due, w.hb = False, w.heartbeat(self.now, self.cfg)
            self.registry.update(w.hb)
        self.take_intake(w)
        self.start(w)

    def take_intake(self, w: Worker) -> None:
        """After a step: the requests whose intake is done join the queue (all of them on an idle worker)."""
        idle = not w.sched.has_unfinished()
        for item in w.intake:
            item[0] -= 1
            if item[0] <= 0 or idle:
                w.sched.add(item[1])
        w.intake = [item for item in w.intake if item[0] > 0 and not idle]

    def finish(self, w: Worker, req: Request, track: Track) -> None:
        track.end, track.tokens = self.now, req.num_output_tokens
        self.unfinished -= 1
        w.finished += 1
        if track.choice is not None:
            self.registry.finished(track.choice)
        conv = track.conversation
        if conv is not None and conv.turn < self.cfg.turns:
            conv.tokens, conv.hashes = req.token_ids, req.block_hashes
            self.idle.append(conv)

    def beat(self, w: Worker) -> None:
        """A worker's heartbeat, as workers/service/ sends it: built between steps, so one that falls due
        during a step goes out as the last one again with a fresh time (the side thread's stand-in, which
        the router takes as no news), and a fresh one is built when the step ends."""
        if w.busy:
            self.registry.update(dataclasses.replace(w.hb, ts=self.now))
            w.beat_due = True
        else:
            w.hb = w.heartbeat(self.now, self.cfg)
            self.registry.update(w.hb)
        kv = w.kv
        w.kv_use.append(1 - kv.num_free_blocks / kv.num_blocks)
        w.load.append(len(w.sched.running) + len(w.sched.waiting))
        self.at(self.now + HEARTBEAT_SECONDS, self.beat, w)

    # -- disaggregated serving --------------------------------------------------------------------

    def hand_off(self, p: Worker, req: Request) -> None:
        """A prefill worker's request has its first token: its prompt's blocks are leased, the request
        leaves the engine and goes back to the router for a decode worker, as workers/service/ does."""
        bs = self.cfg.block_size
        offer = p.kv.pin(f"lease:{req.request_id}", req.block_hashes[:req.num_prompt_tokens // bs])
        p.sched.abort(req)
        track = self.tracks[req.request_id]
        if track.choice is not None:
            self.registry.finished(track.choice)
        self.handoffs += 1
        resumed = Request(req.request_id, list(req.token_ids), req.num_prompt_tokens, req.params, 0, bs,
                          block_hashes=req.block_hashes)
        self.at(self.now + self.cfg.dispatch_s, self.route_handoff, (resumed, p, offer))

    def route_handoff(self, arg) -> None:
        req, p, offer = arg
        choice = self.route(req, handoff=True)
        if choice is None:
            return
        d = self.workers[choice.worker]
        track = self.tracks[req.request_id]
        track.worker, track.choice = d.name, choice
        held = set(d.kv.pin(req.request_id, offer))
        missing = [h for h in offer if h not in held]
        blocks = d.kv.reserve(req.request_id, len(missing))
        cfg = self.cfg
        seconds = cfg.kv_latency_s + len(blocks) * cfg.block_size * cfg.kv_bytes_per_token / cfg.kv_bandwidth
        self.at(self.now + seconds, self.pulled, (req, p, d, list(zip(blocks, missing))))

    def pulled(self, arg) -> None:
        req, p, d, written = arg
        for block, h in written:
            d.kv.register(block, h)
        p.kv.unpin(f"lease:{req.request_id}")
        d.sched.add(req)
        self.start(d)
        self.start(p)

    # -- results ----------------------------------------------------------------------------------

    def summary(self, wall_s: float) -> dict:
        cfg = self.cfg
        rows = []
        for t in self.tracks.values():
            if not t.measured:
                continue
            done = t.end >= 0
            ttft = (t.first if t.first >= 0 else self.now) + cfg.stream_s - t.arrival
            e2e = (t.end + cfg.stream_s - t.arrival) if done else None
            tpot = (t.end - t.first) / (t.tokens - 1) if done and t.tokens > 1 else None
            rows.append((ttft, tpot, e2e, t.tokens, t.prompt, max(t.cached, 0), done, t.tenant))
        workers = []
        for w in self.workers.values():
            workers.append({"cell": self.index, "worker": w.name, "role": w.role, "requests": w.finished,
                            "steps": w.steps, "busy_share": w.busy_s / max(self.now, 1e-9),
                            "tokens_per_step": w.step_tokens / max(w.steps, 1),
                            "kv_use_mean": sum(w.kv_use) / max(len(w.kv_use), 1),
                            "kv_use_max": max(w.kv_use, default=0),
                            "load_mean": sum(w.load) / max(len(w.load), 1), "preemptions": w.sched.num_preemptions})
        return {"rows": rows, "workers": workers, "sim_seconds": self.now, "wall_seconds": wall_s,
                "route_seconds": self.route_s, "routes": self.routes, "handoffs": self.handoffs, "steps": self.steps,
                "tracks": [{"worker": t.worker, "arrival": t.arrival, "began": t.began, "first": t.first,
                            "end": t.end, "cached": t.cached} for t in self.tracks.values()] if cfg.trace else []}


def slowdown(stepping: int, cores: float, contention: float) -> float:
    """How much longer a CPU worker's step runs than on a core of its own while `stepping` workers step on
    `cores` (itself included): processor sharing's max(1, stepping / cores), times 1 + the contention of the
    step's kind per other core in use, min(stepping, cores) − 1."""
    return max(1.0, stepping / cores) * (1 + contention * max(0.0, min(stepping, cores) - 1))


def run_cell(args) -> dict:
    cfg, index, arrivals = args
    return Cell(cfg, index, arrivals).run()


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = sorted(values)

    def q(p: float) -> float:
        x = p * (len(v) - 1)
        lo = math.floor(x)
        return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)
    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(v) / len(v)}


def simulate(cfg: SimConfig, arrivals: list[Arrival] | None = None) -> dict:
    """Runs the simulation (the cells it samples, in parallel processes when asked); the fleet's figures."""
    if cfg.cost is None:
        raise ValueError("SimConfig.cost: a step cost model is needed")
    if arrivals is not None and cfg.cells != 1:
        raise ValueError("a replayed log runs on one cell")
    if cfg.jitter < 0:
        raise ValueError(f"SimConfig.jitter: the spread of a step's time must be at least 0, not {cfg.jitter}")
    cells = min(cfg.sample_cells or cfg.cells, cfg.cells)
    jobs = [(cfg, i, arrivals) for i in range(cells)]
    started = time.perf_counter()
    if cfg.processes > 1 and cells > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(min(cfg.processes, cells)) as pool:
            parts = pool.map(run_cell, jobs)
    else:
        parts = [run_cell(job) for job in jobs]
    return merge(cfg, parts, cells, time.perf_counter() - started)


def merge(cfg: SimConfig, parts: list[dict], cells: int, wall_s: float) -> dict:
    rows = [r for p in parts for r in p["rows"]]
    done = [r for r in rows if r[6]]
    span = max(cfg.duration - cfg.warmup, 1e-9) if cfg.rate else max((p["sim_seconds"] for p in parts), default=1)
    good = [r for r in done if r[0] <= cfg.ttft_slo and (r[1] is None or r[1] <= cfg.tpot_slo)]
    scale = cfg.cells / cells
    prompt = sum(r[4] for r in rows)
    routes = sum(p["routes"] for p in parts)
    return {
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("cost", "scheduler")}
        | {"cost": cfg.cost.name, "scheduler": getattr(cfg.scheduler, "__name__", str(cfg.scheduler))},
        "nodes": cfg.cells * cfg.cell_workers,
        "cells_simulated": cells,
        "requests": len(rows) * scale,
        "finished": len(done) * scale,
        "unfinished": (len(rows) - len(done)) * scale,
        "ttft_s": percentiles([r[0] for r in rows]),
        "tpot_s": percentiles([r[1] for r in done if r[1] is not None]),
        "e2e_s": percentiles([r[2] for r in done]),
        "requests_per_s": len(done) * scale / span,
        "output_tokens_per_s": sum(r[3] for r in done) * scale / span,
        "goodput_rps": len(good) * scale / span,
        "slo_attainment": len(good) / max(len(rows), 1),
        "slo": {"ttft_s": cfg.ttft_slo, "tpot_s": cfg.tpot_slo},
        "meets_slo": meets(rows, done, cfg),
        "prefix_hit_rate": sum(r[5] for r in rows) / max(prompt, 1),
        "preemptions": sum(w["preemptions"] for p in parts for w in p["workers"]) * scale,
        "handoffs": sum(p["handoffs"] for p in parts) * scale,
        "router_us_per_decision": 1e6 * sum(p["route_seconds"] for p in parts) / max(routes, 1),
        "workers": [w for p in parts for w in p["workers"]],
        "tenants": by_tenant(rows, cfg) if len(cfg.tenants) > 1 else {},
        "samples": {"ttft": [r[0] for r in rows], "tpot": [r[1] for r in done if r[1] is not None]},
        "sim_seconds": max((p["sim_seconds"] for p in parts), default=0.0),
        "wall_seconds": wall_s,
    } | ({k: [s for p in parts for s in p[k]] for k in ("steps", "tracks")} if cfg.trace else {})


def by_tenant(rows: list, cfg: SimConfig) -> dict:
    """Per tenant: its requests, TTFT and TPOT percentiles, and its share of the output tokens generated."""
    generated = sum(r[3] for r in rows) or 1
    out = {}
    for t in cfg.tenants:
        mine = [r for r in rows if r[7] == t.name]
        done = [r for r in mine if r[6]]
        out[t.name] = {"share": t.share, "weight": t.weight, "priority": t.priority, "requests": len(mine),
                       "finished": len(done), "ttft_s": percentiles([r[0] for r in mine]),
                       "tpot_s": percentiles([r[1] for r in done if r[1] is not None]),
                       "token_share": sum(r[3] for r in mine) / generated}
    return out


def meets(rows: list, done: list, cfg: SimConfig) -> bool:
    """Every measured request finished, and the p99 TTFT and TPOT are within the SLOs."""
    if not rows or len(done) < len(rows):
        return False
    tpot = percentiles([r[1] for r in done if r[1] is not None])["p99"]
    return percentiles([r[0] for r in rows])["p99"] <= cfg.ttft_slo and (tpot is None or tpot <= cfg.tpot_slo)


def search(cfg: SimConfig, arrivals: list[Arrival] | None = None, most: int = 4096) -> tuple[int, dict]:
    """The fewest colocated workers per cell that meet the SLOs at cfg.rate (or on the replayed arrivals):
    doubling, then bisection."""
    import dataclasses
    tried: dict[int, dict] = {}

    def ok(n: int) -> bool:
        r = tried[n] = simulate(dataclasses.replace(cfg, workers=n), arrivals)
        print(f"search: {n} workers a cell: p99 TTFT {r['ttft_s']['p99'] * 1e3:,.0f} ms, p99 TPOT "
              f"{(r['tpot_s']['p99'] or 0) * 1e3:,.1f} ms, {r['unfinished']:,.0f} unfinished: "
              f"{'meets' if r['meets_slo'] else 'misses'} the SLOs", file=sys.stderr, flush=True)
        return r["meets_slo"]
    lo, hi = 0, max(cfg.workers, 1)
    while not ok(hi):
        if hi >= most:
            return -1, tried[hi]
        lo, hi = hi, min(hi * 2, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi, tried[hi]


def ms(d: dict, k: str) -> str:
    """A percentile of seconds as whole ms."""
    return "-" if d[k] is None else f"{d[k] * 1e3:,.0f}"


def table(r: dict) -> str:
    c = r["config"]
    roles = [f"{c['workers']} colocated"] + [f"{c[k]} {k.split('_')[0]}" for k in ("prefill_workers", "decode_workers")
                                             if c[k]]
    lines = [
        f"sim: {r['nodes']:,} workers = {c['cells']} cell(s) × ({', '.join(roles)}); {r['cells_simulated']} cell(s) "
        f"simulated; cost: {c['cost']}; router: {c['policy']}; scheduler: {c['scheduler']} "
        f"({c['scheduling_policy']})",
        f"     {c['rate']:g} requests/s for {c['duration']:g} s; {r['sim_seconds']:.0f} simulated seconds in "
        f"{r['wall_seconds']:.1f} s of wall time",
        f"requests     {r['requests']:,.0f} measured, {r['unfinished']:,.0f} unfinished",
        f"TTFT ms      p50 {ms(r['ttft_s'], 'p50')}  p90 {ms(r['ttft_s'], 'p90')}  p99 {ms(r['ttft_s'], 'p99')}",
        f"TPOT ms      p50 {ms(r['tpot_s'], 'p50')}  p90 {ms(r['tpot_s'], 'p90')}  p99 {ms(r['tpot_s'], 'p99')}",
        f"e2e ms       p50 {ms(r['e2e_s'], 'p50')}  p99 {ms(r['e2e_s'], 'p99')}",
        f"throughput   {r['requests_per_s']:,.1f} requests/s, {r['output_tokens_per_s']:,.0f} output tokens/s",
        f"goodput      {r['goodput_rps']:,.1f} requests/s within TTFT {c['ttft_slo'] * 1e3:g} ms and TPOT "
        f"{c['tpot_slo'] * 1e3:g} ms ({r['slo_attainment']:.1%} of requests); p99s within the SLOs: "
        f"{'yes' if r['meets_slo'] else 'no'}",
        f"prefix hits  {r['prefix_hit_rate']:.1%} of prompt tokens; preemptions {r['preemptions']:,.0f}; "
        f"handoffs {r['handoffs']:,.0f}; router {r['router_us_per_decision']:.0f} µs a decision",
        *tenant_lines(r),
        "",
        f"{'cell':>4} {'worker':>6} {'role':>7} {'requests':>8} {'busy':>6} {'load':>6} {'KV mean':>7} {'KV max':>6}"
        f" {'preempt':>7}",
    ]
    for w in r["workers"][:64]:
        lines.append(f"{w['cell']:>4} {w['worker']:>6} {w['role']:>7} {w['requests']:>8} {w['busy_share']:>6.0%} "
                     f"{w['load_mean']:>6.1f} {w['kv_use_mean']:>7.0%} {w['kv_use_max']:>6.0%} {w['preemptions']:>7}")
    if len(r["workers"]) > 64:
        lines.append(f"... {len(r['workers']) - 64} more workers (--json has them all)")
    return "\n".join(lines)


def tenant_lines(r: dict) -> list[str]:
    if not r.get("tenants"):
        return []
    lines = ["", f"{'tenant':<12} {'share':>6} {'weight':>6} {'prio':>4} {'requests':>8} {'TTFT p50':>9} "
                 f"{'TTFT p99':>9} {'TPOT p50':>9} {'tokens':>7}"]
    for name, t in r["tenants"].items():
        lines.append(f"{name:<12} {t['share']:>6.0%} {t['weight']:>6g} {t['priority']:>4} {t['requests']:>8} "
                     f"{ms(t['ttft_s'], 'p50'):>9} {ms(t['ttft_s'], 'p99'):>9} {ms(t['tpot_s'], 'p50'):>9} "
                     f"{t['token_share']:>7.1%}")
    return lines


# -- the command ------------------------------------------------------------------------------------

def gpu_config(args) -> SimConfig:
    """The simulation of args' fleet, its step costs and KV pool from the plan of its model and GPU."""
    from ops import plan as planning
    _, model = planning.model_config(args.model)
    eff = planning.Efficiency(args.mfu, args.mbu, args.memory_utilization)
    plan = planning.Plan(model, planning.GPUS[args.gpu], args.tp, planning.Workload(), eff)
    kv_blocks = args.kv_blocks or int(plan.kv_per_node() / (plan.kv_bytes_per_token() * args.block_size))
    if kv_blocks <= 0:
        raise SystemExit(f"--model {args.model} does not fit {args.tp} × {args.gpu}: no memory left for KV")
    return config(args, RooflineCost(plan), kv_blocks, plan.kv_bytes_per_token())


def cpu_config(args) -> SimConfig:
    """The simulation of CPU workers: each step's cost fitted on this machine's real engine (lab.capacity.cost),
    the workers sharing its cores."""
    from lab.capacity import cost as sim_cost
    from workers.models.catalogue import resolve
    from workers.models.config import ModelConfig
    model = ModelConfig.load(resolve(args.model))
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4     # float32, the CPU default
    cfg = config(args, sim_cost.load_or_fit(args.model, args.threads), args.kv_blocks or 2000, kv_per_token)
    cfg.cores, cfg.background_cores, cfg.contention = args.cores, args.background_cores, tuple(args.contention)
    return cfg


def config(args, cost: StepCost, kv_blocks: int, kv_bytes_per_token: float) -> SimConfig:
    if args.jitter < 0:
        raise SystemExit(f"--jitter {args.jitter}: the spread of a step's time must be at least 0")
    router = {"alpha": args.alpha, "max_local_prefill": args.max_local_prefill,
              "max_prefill_queue": args.max_prefill_queue}
    return SimConfig(
        workers=args.workers, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        cells=args.cells, sample_cells=args.sample_cells, processes=args.processes, cost=cost,
        block_size=args.block_size, num_blocks=kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len, policy=args.policy,
        router=router, dispatch_s=args.dispatch_ms / 1e3, stream_s=args.stream_ms / 1e3, rate=args.rate,
        duration=args.duration, warmup=args.warmup, turns=args.turns, system_tokens=args.system_tokens,
        system_prompts=args.system_prompts, user_tokens=args.user_tokens, output_tokens=args.output_tokens,
        spec_k=args.spec_k, spec_acceptance=args.spec_acceptance, spec_draft_cost=args.spec_draft_cost,
        spec_max_batch=args.spec_max_batch, kv_bandwidth=args.kv_gb_per_s * 1e9,
        kv_bytes_per_token=kv_bytes_per_token, ttft_slo=args.ttft_slo_ms / 1e3, tpot_slo=args.tpot_slo_ms / 1e3,
        seed=args.seed, scheduling_policy=args.scheduling_policy, tenants=tenants(args.tenant), jitter=args.jitter)


def tenants(texts: list[str] | None) -> tuple[SimTenant, ...]:
    try:
        return tuple(parse_tenant(t) for t in texts) if texts else (SimTenant("default"),)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def replayed(path: str) -> list[Arrival]:
    """The requests of a `tokenbus log export` file, at their times: each asks for as many tokens as it got."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise SystemExit(f"--replay {path}: no records")
    t0 = min(r["created"] for r in records)
    return sorted((Arrival(r["created"] - t0, r["prompt_token_ids"], max(len(r["output_token_ids"]), 1),
                           r.get("id", ""), r["output_token_ids"]) for r in records), key=lambda a: a.at)


def plot(r: dict, path: str) -> None:
    """TTFT and TPOT CDFs against their SLOs, and each worker's load and KV use."""
    import numpy as np
    from matplotlib.figure import Figure
    fig = Figure(figsize=(15, 4.5))
    ttft, tpot, workers = fig.subplots(1, 3)
    for ax, key, slo, name in ((ttft, "ttft", r["slo"]["ttft_s"], "TTFT"), (tpot, "tpot", r["slo"]["tpot_s"], "TPOT")):
        xs = np.sort(np.array(r["samples"][key], dtype=float) * 1e3)
        if len(xs):
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
        ax.axvline(slo * 1e3, color="tab:red", linestyle="--", label="SLO")
        ax.set(xlabel="ms", ylabel="fraction of requests", title=f"{name} CDF")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ws = r["workers"][:64]
    x = np.arange(len(ws))
    workers.bar(x, [w["kv_use_mean"] for w in ws], label="KV use (mean)")
    workers.plot(x, [w["busy_share"] for w in ws], "o", color="tab:orange", label="busy share")
    workers.set(xlabel="worker", ylabel="share", title="per worker", ylim=(0, 1.05))
    workers.legend()
    fig.savefig(path, dpi=100)


def main(args) -> None:
    cfg = cpu_config(args) if args.gpu == "cpu" else gpu_config(args)
    arrivals = replayed(args.replay) if args.replay else None
    if args.search:
        workers, r = search(cfg, arrivals)
        r["search"] = {"rate": cfg.rate, "workers_per_cell": workers, "nodes": workers * cfg.cells if workers > 0
                       else None}
    else:
        r = simulate(cfg, arrivals)
    if args.plot:
        plot(r, args.plot)
    r.pop("samples", None)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(table(r))
    if args.search:
        s = r["search"]
        print(f"\nsearch: {s['nodes']} workers ({s['workers_per_cell']} per cell × {cfg.cells}) meet the SLOs at "
              f"{cfg.rate:g} requests/s" if s["nodes"] else "\nsearch: no worker count up to 4096 meets the SLOs")

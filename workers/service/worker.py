"""The worker service: an asyncio loop that alternates engine steps with publishing their tokens.

Runs on the event loop (the process's main thread); the engine steps on the step thread. Each turn of
the step loop runs one engine step on the step thread (workers/stepper.py), publishes every request's
new tokens (core NATS writes are buffered: publishing never waits on the network), then yields so
that what the loop took from the bus during the step (work items whose checks are done, cancels)
reaches the engine before the next one. The engine lock keeps every other use of the engine (adds,
aborts, pins, stats) out of a step. A side thread (workers/sideline.py) sends the heartbeat while a
step runs for seconds, and serves KV transfer bytes (workers/kv_transfer.py).

WorkerService builds the parts, each a module beside this one with the threads it runs on stated at
its top, and hands each the shared State (state.py: the bus, the engine and its lock, the `running`
table, the counts) and the parts it calls: records.py (end records, usage records, dead
letters; it calls no other part), streaming.py (token chunks, resends, handoffs; calls records),
intake.py (work items into the engine, strikes, cancels; calls streaming and records), registry.py
(heartbeats, suspects, KV events, leaving; reads intake's `taken`, calls back `fail`). This module
holds the step loop, the side thread and the bus's subscriptions."""
import asyncio
import time

import orjson

import bus
from bus.lifecycle import Life, first
from schemas import subjects
from workers.distributed import WorkerFailure
from workers.engine.engine import LLMEngine
from workers.faults import NO_FAULTS, Faults
from workers.kv_transfer import NatsKvTransport
from workers.service.intake import Intake
from workers.service.records import Records
from workers.service.registry import LEAVE_WAIT, Registry
from workers.service.state import State
from workers.service.streaming import Streaming
from workers.sideline import Sideline
from workers.stepper import Stepper

DRAIN_POLL = 0.1               # seconds between a draining worker's looks at what it holds


class WorkerService:
    def __init__(self, nc, engine: LLMEngine, worker_id: str, model_name: str, log,
                 chunk_rate: float = subjects.CHUNK_RATE, role: str = "both",
                 kv_load_failure_policy: str = "recompute", nats_url: str | None = None, revision: str = "",
                 stepper: Stepper | None = None, faults: Faults = NO_FAULTS, step_trace: str | None = None,
                 blamed: str = "", life: Life | None = None):
        self.state = s = State(nc, nc.jetstream(), engine, asyncio.Lock(), subjects.token("worker", worker_id), log)
        self.nc, self.engine, self.engine_lock, self.id, self.log = nc, engine, s.engine_lock, s.id, log
        self.running = s.running
        self.model_name, self.role, self.revision = model_name, role, revision   # revision: schemas/revision.py
        self.wake = asyncio.Event()                  # set when work arrives for an idle engine
        self.stop = asyncio.Event()                  # a failure: stop at once
        self.life = life or Life("worker", self.id, log)   # SIGTERM and tokenbus drain: bus/lifecycle.py
        self.failed = False
        self.stepper = stepper                       # the step thread (run() starts one if none is given)
        self.nats_url = nats_url                     # for the side thread's connection (default: nc's servers)
        self.side: Sideline | None = None
        self.transport = NatsKvTransport(nc, self.id, engine, log, self.engine_lock, faults)
        self.records = Records(s)
        self.streaming = Streaming(s, self.records, self.transport, chunk_rate, faults)
        self.intake = Intake(s, self.records, self.streaming, self.transport, self.wake, kv_load_failure_policy,
                             blamed)
        self.registry = Registry(s, self.transport, self.intake.taken, self.fail, model_name, role, revision)
        if faults:                                   # injected on purpose (tests, chaos): workers/faults.py
            log.warning("injected faults on (tests and chaos only)", faults=str(faults))
        self.step_trace = step_trace                 # a file for each step's shape and times (--step-trace)
        if step_trace is not None:
            engine.trace = []

    async def run(self) -> None:
        await self.open_bus()
        await self.start_side()
        await self.registry.heartbeat()
        self.side.spawn(self.registry.stand_in_beats(self.side.nc))
        self.log.info("worker ready", model=self.model_name, revision=self.revision,
                      kv_blocks=self.engine.kv.num_blocks, role=self.role)
        own = self.stepper is None               # a stepper given is its giver's to close (after the engine)
        self.stepper = self.stepper or Stepper(self.engine)
        loops = [asyncio.create_task(f()) for f in (self.step_loop, self.intake.fetch_loop,
                                                     self.registry.heartbeat_loop, self.intake.progress_loop)]
        self.life.ready = True
        await first(self.stop.wait(), self.life.asked.wait())
        handed_over = await self.drain() if self.life.draining.is_set() and not self.stop.is_set() else \
            len(self.running)
        for t in loops:
            t.cancel()
        await self.stepper.finish(LEAVE_WAIT)   # the engine is closed after this: no step may be under way
        if own:
            self.stepper.close()
        await self.registry.leave(self.side)
        await self.life.left(handed_over)
        await bus.close(self.nc)

    async def drain(self) -> int:
        """The worker says it is draining (the router and admission choose it no more), runs what it holds
        and what was routed to it before they saw that, until it holds nothing or its drain timeout passes;
        returns the requests it hands over (the router moves them at once when it leaves, each continuing
        from the tokens its client has, without a strike)."""
        self.registry.draining = True
        await self.registry.say_draining()
        self.log.info("draining", running=len(self.running), drain_timeout=self.life.drain_timeout)
        settled = time.monotonic() + subjects.DRAIN_SETTLE
        while not (self.stop.is_set() or self.life.stopping.is_set()):
            if time.monotonic() >= settled and await self.holds_nothing():
                return 0
            if time.monotonic() >= self.life.deadline:
                break
            await asyncio.sleep(DRAIN_POLL)
        held = sorted(self.running)
        self.log.warning("drain ended with requests held: handing them over", requests=held,
                         why="stopped" if self.stop.is_set() or self.life.stopping.is_set() else
                         f"--drain-timeout {self.life.drain_timeout:g} s passed")
        return len(held)

    async def holds_nothing(self) -> bool:
        """Nothing runs here, nothing is on its way in, and nothing waits in its work queue."""
        if self.running or self.intake.admitting or self.intake.pulling:
            return False
        for p in subjects.parts():
            try:
                info = await self.state.js.consumer_info(subjects.stream(subjects.WORK_STREAM, p),
                                                         subjects.worker_durable(self.id))
            except bus.BUS_ERRORS:
                return False
            if info.num_pending or info.num_ack_pending:
                return False
        return True

    async def open_bus(self) -> None:
        """The streams and buckets the worker uses, and its subscriptions (cancels, resends, KV snapshots)."""
        await bus.ensure_streams(self.state.js)
        await self.registry.open()
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self.intake.on_cancel)
        await self.nc.subscribe(subjects.RESEND_ALL, cb=self.streaming.on_resend)
        self.engine.kv.record_changes()
        await self.nc.subscribe(subjects.kv_snapshot(self.id), cb=self.registry.on_snapshot)

    async def start_side(self) -> None:
        """The side thread, on a connection of its own; the KV transfers' bytes move there."""
        servers = self.nats_url or ",".join(u.geturl() for u in self.nc.servers)
        self.side = Sideline(servers, f"worker-{self.id}-side", self.log)
        await self.side.start()
        await self.transport.start(self.side)

    # -- the step loop --------------------------------------------------------------------------

    async def step_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self.wake.clear()
                await self.wake.wait()
            async with self.engine_lock:         # behind the adds and cancels that came during the last step
                await self.registry.announce_suspect()
                started = time.monotonic()
                try:
                    updated = await self.stepper.step()
                except Exception as e:           # a failure no request could be blamed for: stop
                    self.fail(e)
                    return
            seconds = time.monotonic() - started
            now, interval = time.time(), self.streaming.chunk_interval()
            for req in updated:
                await self.streaming.emit(req, now, interval)
            if self.engine.kv.changes:
                await self.registry.publish_kv()
            await self.intake.between_steps(seconds)
            if self.step_trace is not None:
                self.trace_steps(started)

    def trace_steps(self, started: float) -> None:
        """The --step-trace lines of the steps just run: the engine's shape and seconds, and the loop's whole
        step (the engine's, the chunks, the KV events, the intake)."""
        now = time.monotonic()
        with open(self.step_trace, "ab") as f:
            for t in self.engine.trace:
                f.write(orjson.dumps({"worker": self.id, "at": started, "loop_s": now - started, "seconds": t.seconds,
                                      "rows": t.num_requests, "tokens": t.num_tokens, "sampled": t.num_sampled,
                                      "attention": t.attention, "kv_read": t.kv_read}) + b"\n")
        self.engine.trace.clear()

    def fail(self, error: Exception) -> None:
        """A failure no request can be blamed for (a dead tensor-parallel rank): the worker stops; what it
        held is logged here and re-routed by the router, each taken item with a strike."""
        self.failed = True
        self.log.error("engine failed; stopping", error=str(error) if isinstance(error, WorkerFailure) else repr(error))
        for rid, run in self.running.items():
            self.log.error("request held at failure", request_id=rid, tenant=run.item.request.tenant,
                           attempt=run.item.attempt, strikes=run.strikes, sent=run.sent)
        self.stop.set()

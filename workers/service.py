"""The worker process: an asyncio loop that alternates engine steps with publishing their tokens.

Each turn of the step loop runs one engine step on the step thread (workers/stepper.py), publishes
every request's new tokens (core NATS writes are buffered: publishing never waits on the network),
then yields so that what the loop took from the bus during the step (work items whose checks are
done, cancels) reaches the engine before the next one. The engine lock keeps every other use of the
engine (adds, aborts, pins, stats) out of a step. A side thread (workers/sideline.py) sends the
heartbeat while a step runs for seconds, and serves KV transfer bytes."""
import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass

import nats
import nats.errors
import nats.js.errors
import orjson
import torch

from schemas import subjects
from schemas.detokenizer import PROMPT_CONTEXT
from schemas.hashing import hash_blocks
from schemas.log import configure
from schemas.messages import (
    SCHEDULING_POLICIES,
    Cancel,
    Completion,
    DeadLetter,
    ErrorChunk,
    FinalChunk,
    Heartbeat,
    KvEvent,
    KvSnapshot,
    Logprobs,
    Outcome,
    Prefilled,
    Progress,
    Resend,
    Speculation,
    TokenChunk,
    TokenizedRequest,
    Usage,
    WireError,
    WorkItem,
    decode,
    encode,
    ending,
    received,
)
from schemas.revision import revision as revision_of
from schemas.sampling import SamplingParams
from workers.distributed import WorkerFailure
from workers.engine import speculative
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.request import Request
from workers.kv_transfer import NatsKvTransport
from workers.models import catalogue
from workers.sideline import MAX_STEP_SECONDS, Sideline
from workers.stepper import Stepper

LEAVE_WAIT = 2.0               # seconds a stopping worker waits for the ends it is storing
CANCEL_MEMORY = 120.0          # seconds a cancel for a request not seen yet is remembered
FETCH_BATCH = 64
USAGE_BACKUP_SECONDS = 5.0     # the worker's usage record waits for the gateway's (same message id) to win
INTAKE_TURNS = 4               # event-loop turns between steps: a message takes a few to reach its handler
INTAKE_WAIT = 0.1              # × the step's time (at most MAX_INTAKE_WAIT) the loop waits for items' checks
MAX_INTAKE_WAIT = 0.1          # seconds
PROGRESS_TIMEOUT = 0.5         # seconds a worker waits for the gateway to say what a moved request's client has
DROP_CHUNKS = "TB_TEST_DROP_CHUNKS"   # test hook, off when unset: "2,final" drops chunk 2 and the final chunk
                                      # of every request on tb.out (the gateway must recover them)
STEP_TRACE = "TB_STEP_TRACE"   # a file path, off when unset: each step's shape and times as JSON lines
                               # (`tokenbus sim-check --steps` compares them with the simulator's)


def drops() -> set[str]:
    """The chunks the DROP_CHUNKS test hook drops: chunk numbers, and "final"."""
    return {p.strip() for p in os.environ.get(DROP_CHUNKS, "").split(",") if p.strip()}


@dataclass(slots=True)
class Running:
    """What the service knows of a request in the engine."""
    item: WorkItem
    msg: object                     # the JetStream message, acked when the request ends
    received: float                 # time.time() it arrived
    first_token: float = 0.0
    sent: int = 0                   # output tokens published
    seq: int = 0                    # chunks published
    published: float = 0.0          # time.time() of its last chunk
    subject: str = ""               # tb.out.<request id>
    strikes: int = 0                # workers it failed or crashed before this one (redeliveries included)
    cached_tokens: int = -1         # a handed-off request: the prefill worker's prefix hit (-1: the engine's)
    stored: float = 0.0             # time.time() its work item was stored in the stream (0: not known)

    @property
    def tail(self) -> list[int]:
        """The detokenizer's context, sent with the first chunk only."""
        return self.item.request.prompt_token_ids[-PROMPT_CONTEXT:] if self.seq == 0 else []


class WorkerService:
    def __init__(self, nc, engine: LLMEngine, worker_id: str, model_name: str, log,
                 chunk_rate: float = subjects.CHUNK_RATE, role: str = "both",
                 kv_load_failure_policy: str = "recompute", nats_url: str | None = None, revision: str = "",
                 stepper: Stepper | None = None):
        self.nc, self.js = nc, nc.jetstream()
        self.engine, self.id, self.model_name, self.log = engine, subjects.token("worker", worker_id), model_name, log
        self.chunk_rate = chunk_rate                 # 0: a chunk per stream per step, however many streams
        self.running: dict[str, Running] = {}
        self.cancelled: dict[str, float] = {}        # cancels that came before their request
        self.finished = 0
        self.admitting = 0                           # work items being taken (their checks on the bus)
        self.taken: dict[int, tuple[int, list[int]]] = {}   # by id() of the message: the requests on their
        #                   way into the engine, (prompt tokens, their block hashes), which a heartbeat counts
        self.checking: set[int] = set()              # id() of the work items whose checks are under way
        self.checked = asyncio.Event()               # set when none is
        self.prompt_tokens = self.generation_tokens = 0     # counters for the heartbeat (metrics)
        self.tasks: set[asyncio.Task] = set()
        self.wake = asyncio.Event()                  # set when work arrives for an idle engine
        self.stop = asyncio.Event()
        self.failed = False
        self.kv_seq = 0                              # KV events published
        self.suspect = ""                            # the request the last heartbeat said runs alone
        self.blamed = ""                             # the one this worker's previous life said so of, if any
        self.spec_k: int | None = None               # k at the last look where some request could draft
        self.drops = drops()                         # test hook only: chunks not published
        self.role, self.kv_load_failure_policy = role, kv_load_failure_policy
        self.engine_lock = asyncio.Lock()           # held for each step; taken by whatever else touches the engine
        self.stepper = stepper                       # the step thread (run() starts one if none is given)
        self.transport = NatsKvTransport(nc, self.id, engine, log, self.engine_lock)
        self.pulling: dict[str, object] = {}         # request id -> its work item's message, while its KV comes
        self.nats_url = nats_url                     # for the side thread's connection (default: nc's servers)
        self.side: Sideline | None = None
        self.beat: Heartbeat | None = None           # the last heartbeat the step loop built, and when
        self.revision = revision                     # of the model it serves (schemas/revision.py)
        self.beat_at = 0.0
        if self.drops:
            log.warning("test hook: dropping chunks on purpose", hook=DROP_CHUNKS, chunks=sorted(self.drops))
        self.step_trace = os.environ.get(STEP_TRACE) or None        # diagnostics only
        if self.step_trace is not None:
            engine.trace = []

    async def run(self) -> None:
        await subjects.ensure_streams(self.js)
        self.registry = await subjects.registry(self.js)
        self.suspects = await subjects.suspects(self.js)
        self.outcomes = await subjects.outcomes(self.js)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self.on_cancel)
        await self.nc.subscribe(subjects.RESEND_ALL, cb=self.on_resend)
        self.engine.kv.record_changes()
        await self.nc.subscribe(subjects.kv_snapshot(self.id), cb=self.on_snapshot)
        servers = self.nats_url or ",".join(u.geturl() for u in self.nc.servers)
        self.side = Sideline(servers, f"worker-{self.id}-side", self.log)
        await self.side.start()
        await self.transport.start(self.side)
        await self.heartbeat()
        self.side.spawn(self.stand_in_beats())
        self.log.info("worker ready", model=self.model_name, revision=self.revision,
                      kv_blocks=self.engine.kv.num_blocks, role=self.role)
        own = self.stepper is None               # a stepper given is its giver's to close (after the engine)
        self.stepper = self.stepper or Stepper(self.engine)
        loops = [asyncio.create_task(f()) for f in (self.step_loop, self.fetch_loop, self.heartbeat_loop,
                                                     self.progress_loop)]
        await self.stop.wait()
        for t in loops:
            t.cancel()
        await self.stepper.finish(LEAVE_WAIT)   # the engine is closed after this: no step may be under way
        if own:
            self.stepper.close()
        await self.leave()

    async def leave(self) -> None:
        """Lets the ends being stored (outcomes, records, dead letters) finish for up to LEAVE_WAIT
        seconds (what is left stays unacked and is redelivered), deregisters, closes."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=LEAVE_WAIT)
        if self.side is not None:                # before the deregistration: it could write a heartbeat after it
            await self.side.stop()
        try:
            await self.registry.delete(self.id)
            await subjects.close(self.nc)
        except Exception as e:                   # the server may be gone already
            self.log.warning("leaving uncleanly", error=str(e))

    # -- the step loop --------------------------------------------------------------------------

    async def step_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self.wake.clear()
                await self.wake.wait()
            async with self.engine_lock:         # behind the adds and cancels that came during the last step
                await self.announce_suspect()
                started = time.monotonic()
                try:
                    updated = await self.stepper.step()
                except Exception as e:           # a failure no request could be blamed for: stop
                    self.fail(e)
                    return
            seconds = time.monotonic() - started
            now, interval = time.time(), self.chunk_interval()
            for req in updated:
                await self.emit(req, now, interval)
            if self.engine.kv.changes:
                await self.publish_kv()
            await self.intake(seconds)
            if self.step_trace is not None:
                self.trace_steps(started)

    def trace_steps(self, started: float) -> None:
        """The STEP_TRACE lines of the steps just run: the engine's shape and seconds, and the loop's whole
        step (the engine's, the chunks, the KV events, the intake)."""
        now = time.monotonic()
        with open(self.step_trace, "ab") as f:
            for t in self.engine.trace:
                f.write(orjson.dumps({"worker": self.id, "at": started, "loop_s": now - started, "seconds": t.seconds,
                                      "rows": t.num_requests, "tokens": t.num_tokens, "sampled": t.num_sampled,
                                      "attention": t.attention, "kv_read": t.kv_read}) + b"\n")
        self.engine.trace.clear()

    async def intake(self, step_seconds: float) -> None:
        """Between steps: the work items whose checks finished during the step, and the cancels, take the
        engine lock before the next step does; the items whose checks are still on the bus (a reply that
        lands as the step ends) get up to INTAKE_WAIT × the step's time to finish. Since the engine steps
        on its own thread this rarely applies (docs/decisions.md). The wait is bounded: a slow bus costs
        each step at most INTAKE_WAIT of its time."""
        for _ in range(INTAKE_TURNS):
            await asyncio.sleep(0)
        if self.checking:
            self.checked.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(INTAKE_WAIT * step_seconds, MAX_INTAKE_WAIT)):
                    await self.checked.wait()

    def chunk_interval(self) -> float:
        """Seconds between two chunks of a stream, at least: under load (more streams than chunk_rate
        allows at a chunk per step each) a chunk carries the tokens of several steps. Each chunk costs
        every stage downstream (nats-server, the gateway, the client) about as much as its tokens."""
        return min(len(self.running) / self.chunk_rate, subjects.MAX_CHUNK_INTERVAL) if self.chunk_rate else 0.0

    async def emit(self, req: Request, now: float, interval: float = 0.0) -> None:
        """Publishes the request's tokens not sent yet: the first at once, the last with the final chunk,
        the others once `interval` has passed since the stream's last chunk. A remote prefill is handed
        off once its first chunk is out."""
        run = self.running.get(req.request_id)
        if run is None:
            return
        new = req.token_ids[req.num_prompt_tokens + run.sent:]
        if new and not run.first_token:
            run.first_token = now
        if not req.finished and (not new or (run.seq and now - run.published < interval)):
            return                               # nothing new, or held for the stream's next chunk
        self.generation_tokens += len(new)
        if req.finished:
            await self.end(run, req, new, now)
        else:
            chunk = TokenChunk(req.request_id, run.seq, run.sent, new, req.num_prompt_tokens, run.tail,
                               max(req.num_cached_tokens, 0) if run.seq == 0 else 0, logprobs(req, run.sent))
            run.seq, run.sent, run.published = run.seq + 1, run.sent + len(new), now
            if not self.drops or str(chunk.seq) not in self.drops:     # the test hook, off: one falsy check
                await self.nc.publish(run.subject, encode(chunk))
            if run.item.prefill:
                self.hand_off(run, req)

    async def announce_suspect(self) -> None:
        """Before a request with a strike runs alone, the heartbeat says so: if this worker dies now,
        the router blames that request only, not the innocent ones it held. tb_suspects says so too,
        for this worker's next life (its heartbeat is gone WORKER_TTL later)."""
        suspect = self.engine.scheduler.suspect()
        rid = suspect.request_id if suspect is not None else ""
        if rid != self.suspect:
            self.suspect = rid
            try:
                await self.heartbeat()
                await asyncio.wait_for(self.suspects.put(self.id, rid.encode()) if rid else
                                       self.suspects.delete(self.id), 2 * subjects.HEARTBEAT_SECONDS)
            except subjects.BUS_ERRORS as e:
                self.log.warning("suspect not announced", suspect=rid or None, error=str(e) or type(e).__name__)

    async def end(self, run: Running, req: Request, new: list[int], now: float) -> None:
        rid, r = req.request_id, run.item.request
        if req.finish_reason == "error":
            await self.failed_request(run, req)
            return
        del self.running[rid]
        usage = {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": req.num_output_tokens,
                 "cached_tokens": run.cached_tokens if run.cached_tokens >= 0 else max(req.num_cached_tokens, 0)}
        timing = {"queue_ms": max(0.0, run.received - r.created) * 1e3 if r.created else None,
                  "intake_ms": max(0.0, run.received - run.stored) * 1e3 if run.stored else None,
                  "ttft_ms": (run.first_token - run.received) * 1e3 if run.first_token else None,
                  "e2e_ms": (now - run.received) * 1e3}
        timing = {k: round(v, 3) for k, v in timing.items() if v is not None}
        final = FinalChunk(rid, run.seq, run.sent, new, req.finish_reason, req.stop_reason, usage, timing, self.id,
                           run.tail, logprobs(req, run.sent))
        if "final" not in self.drops:
            await self.nc.publish(run.subject, encode(final))
        record = Completion(rid, r.tenant, self.id, r.sampling, r.prompt_token_ids, req.output_token_ids,
                            req.finish_reason, req.stop_reason, usage, timing, r.created)
        outcome = Outcome(rid, r.tenant, self.id, req.finish_reason, list(req.output_token_ids), req.stop_reason,
                          usage, timing, r.prompt_token_ids[-PROMPT_CONTEXT:], ts=time.time())
        self.spawn(self.record(record, outcome, run.msg, metered(r, record, time.time())))
        self.finished += 1
        self.log.info("request finished", request_id=rid, tenant=r.tenant, finish_reason=req.finish_reason,
                      resumed=req.num_resumed_tokens, generated=req.num_output_tokens - req.num_resumed_tokens,
                      **usage, **timing)

    async def record(self, record: Completion, outcome: Outcome, msg, usage: Usage | None = None) -> None:
        """Creates the request's Outcome (the first end of a request id wins), stores the completion record
        if this end won, then acks the work item (not acked: JetStream redelivers, and already_ended()
        finds the Outcome). The publishes are retried under the request id through a broker restart.
        The usage record follows USAGE_BACKUP_SECONDS later: the gateway's, stored first under the same
        message id, wins; the worker's counts only where the gateway died with the request."""
        rid = record.id
        try:
            if await self.create_outcome(outcome):
                await subjects.publish(self.js, subjects.done(record.tenant), encode(record), subjects.msg_id(rid),
                                       self.log)
                if usage is not None:
                    self.spawn(self.meter_later(usage))
            else:
                self.log.warning("request ended before: completion not recorded again", request_id=rid)
            await msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, subjects.NotStored) as e:
            self.log.error("completion not stored", request_id=rid, error=str(e) or type(e).__name__)

    async def meter_later(self, usage: Usage) -> None:
        await asyncio.sleep(USAGE_BACKUP_SECONDS)
        try:
            await subjects.publish(self.js, subjects.usage(usage.tenant), encode(usage), subjects.msg_id(usage.id),
                                   self.log)
        except (nats.errors.Error, asyncio.TimeoutError, subjects.NotStored) as e:
            self.log.error("usage record not stored", request_id=usage.id, error=str(e) or type(e).__name__)

    async def create_outcome(self, outcome: Outcome) -> bool:
        """True if this end of the request is the first (created now, or by an earlier attempt of this
        call whose ack was lost: same worker, same tokens)."""
        deadline = time.monotonic() + subjects.PUBLISH_DEADLINE
        while True:
            try:
                await self.outcomes.create(outcome.id, encode(outcome))
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                first = decode((await self.outcomes.get(outcome.id)).value, Outcome)
                return first.worker == outcome.worker and first.output_token_ids == outcome.output_token_ids
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise
                self.log.warning("outcome not stored; retrying", request_id=outcome.id,
                                 error=str(e) or type(e).__name__)
                if isinstance(e, nats.js.errors.NoStreamResponseError):
                    self.outcomes = await subjects.outcomes(self.js)
                await asyncio.sleep(subjects.PUBLISH_RETRY)

    async def already_ended(self, item: WorkItem, msg) -> bool:
        """A work item whose request has an Outcome (a redelivery after its ack was lost, however late):
        not run again; its final chunk goes out again from the Outcome, for a gateway still waiting."""
        rid = item.request.id
        try:
            entry = await self.outcomes.get(rid)
        except nats.js.errors.KeyNotFoundError:
            return False
        except (nats.errors.Error, asyncio.TimeoutError) as e:   # run it: record() still writes one Outcome
            self.log.warning("outcome not read", request_id=rid, error=str(e) or type(e).__name__)
            return False
        o = decode(entry.value, Outcome)
        await self.nc.publish(subjects.out(rid), encode(ending(o)))
        await msg.ack()
        self.log.warning("redelivered request had ended: not run again", request_id=rid, tenant=item.request.tenant,
                         attempt=item.attempt, finish_reason=o.finish_reason, ended_on=o.worker)
        return True

    async def on_resend(self, msg) -> None:
        """A gateway missed chunks of a request running here: its output tokens from the asked offset, up
        to those published so far (later ones come as chunks). Not running here: no answer."""
        try:
            ask = decode(msg.data, Resend)
        except WireError as e:
            self.log.error("bad resend dropped", error=str(e))
            return
        run = self.running.get(ask.id)
        if run is None or not msg.reply:
            return
        async with self.engine_lock:
            req = self.engine.requests.get(ask.id)
            out = req.output_token_ids[:run.sent] if req is not None else []
        r = run.item.request
        chunk = TokenChunk(ask.id, -1, ask.offset, out[ask.offset:], len(r.prompt_token_ids),
                           r.prompt_token_ids[-PROMPT_CONTEXT:])
        await self.nc.publish(msg.reply, encode(chunk))
        self.log.info("tokens resent", request_id=ask.id, offset=ask.offset, tokens=len(chunk.token_ids))

    # -- disaggregated serving ------------------------------------------------------------------

    def hand_off(self, run: Running, req: Request) -> None:
        """A remote prefill is done (its first token published): the prompt's blocks are offered under a
        lease, the request leaves the engine, and it goes back to the router (TB_ROUTE) with what a decode
        worker needs to continue it. Its work item is acked once the handoff is stored."""
        bs = self.engine.config.block_size
        lease, hashes = self.transport.offer(req.request_id, req.block_hashes[:req.num_prompt_tokens // bs])
        r = run.item.request
        prefilled = Prefilled(self.id, lease, hashes, bs, req.output_token_ids, req.seed,
                              max(req.num_cached_tokens, 0), run.seq, run.received, run.first_token)
        self.engine.abort(req.request_id)        # its blocks are freed; the offered ones stay pinned
        del self.running[req.request_id]
        self.spawn(self.publish_handoff(run, dataclasses.replace(r, prefilled=prefilled)))
        self.log.info("request handed off", request_id=r.id, tenant=r.tenant, blocks=len(hashes),
                      prompt_tokens=req.num_prompt_tokens, output_tokens=req.num_output_tokens)

    async def publish_handoff(self, run: Running, handed: TokenizedRequest) -> None:
        """Stores the handoff (retried through a broker restart), then acks the prefill's work item. Not
        stored: the lease goes and the item stays unacked, so it comes again and is prefilled again."""
        rid = handed.id
        try:
            await subjects.publish(self.js, subjects.route(handed.tenant), encode(handed),
                                   subjects.msg_id(rid, f"{rid}.pd"), self.log)
            await run.msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, subjects.NotStored) as e:
            await self.transport.released(rid)
            self.log.error("handoff not stored; the prefill will run again", request_id=rid,
                           error=str(e) or type(e).__name__)

    async def pull(self, item: WorkItem, msg) -> bool:
        """A handed-off request's KV: what this worker's prefix cache lacks of the blocks the prefill
        worker offered comes over the bus. A pull that fails leaves the rest to be recomputed here, or
        (--kv-load-failure-policy fail) ends the request with an error naming the transfer: False."""
        r, p = item.request, item.request.prefilled
        self.pulling[r.id] = msg
        try:
            pulled = await self.transport.fetch(r.id, p, hash_blocks(r.prompt_token_ids, self.engine.config.block_size,
                                                                     r.cache_salt))
        finally:
            self.pulling.pop(r.id, None)
        fields = {"request_id": r.id, "prefill_worker": p.worker, "offered": len(p.block_hashes),
                  "cached": pulled.cached, "pulled": pulled.blocks, "bytes": pulled.bytes,
                  "ms": round(pulled.seconds * 1e3, 3)}
        if not pulled.error:
            self.log.info("kv pulled", **fields)
            return True
        if self.kv_load_failure_policy == "fail":
            async with self.engine_lock:
                self.engine.kv.unpin(r.id)
            self.log.error("kv pull failed; the request fails (--kv-load-failure-policy fail)", error=pulled.error,
                           **fields)
            await self.give_up(item, msg, "kv_transfer_failed", f"the KV of the prompt could not be pulled from "
                               f"prefill worker {p.worker}: {pulled.error} (--kv-load-failure-policy fail)")
            return False
        self.transport.stats.recomputes += 1
        self.log.warning("kv pull failed; recomputing what is missing", error=pulled.error, **fields)
        return True

    # -- failures -------------------------------------------------------------------------------

    async def failed_request(self, run: Running, req: Request) -> None:
        """The engine failed this request alone: it is dead-lettered at once (error chunk, outcome,
        dead letter) and its work item acked, so no worker runs it again."""
        del self.running[req.request_id]
        self.log.error("request failed", request_id=req.request_id, tenant=run.item.request.tenant,
                       error=req.error, output_tokens=req.num_output_tokens)
        await self.dead_letter(run.item, run.msg, "engine_error", req.error, run.strikes + 1, req.output_token_ids)

    async def dead_letter(self, item: WorkItem, msg, code: str, reason: str, strikes: int,
                          output: list[int] = ()) -> None:
        """Ends a request with an error for good, with a DeadLetter in TB_DEAD naming the reason."""
        letter = DeadLetter(item.request, reason, strikes, self.id, time.time())
        await self.give_up(item, msg, code, reason, output, letter)

    async def give_up(self, item: WorkItem, msg, code: str, reason: str, output: list[int] = (),
                      letter: DeadLetter | None = None) -> None:
        """Ends a request with an error: ErrorChunk on tb.out, an Outcome "error" in tb_outcomes, the
        dead letter if any, then the work item is acked."""
        r = item.request
        await self.nc.publish(subjects.out(r.id), encode(ErrorChunk(r.id, code, reason)))
        self.spawn(self.bury(r, msg, code, reason, list(output), letter))

    async def bury(self, r: TokenizedRequest, msg, code: str, reason: str, output: list[int],
                   letter: DeadLetter | None) -> None:
        """Stores the end (the first end of a request is the one kept) and the dead letter, each retried
        through a broker restart, then acks; not stored: not acked, so it comes again and ends again."""
        outcome = Outcome(r.id, r.tenant, self.id, "error", output, error_code=code, error_message=reason,
                          ts=time.time())
        try:
            await self.create_outcome(outcome)
            if letter is not None:
                await subjects.publish(self.js, subjects.dead(r.tenant), encode(letter),
                                       subjects.msg_id(r.id, f"{r.id}.dead"), self.log)
            await msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, subjects.NotStored) as e:
            self.log.error("request end not stored", request_id=r.id, code=code, error=str(e) or type(e).__name__)
            return
        self.log.warning("request dead-lettered" if letter else "request given up", request_id=r.id,
                         tenant=r.tenant, code=code, strikes=letter.strikes if letter else None, reason=reason)

    def fail(self, error: Exception) -> None:
        """A failure no request can be blamed for (a dead tensor-parallel rank): the worker stops; what it
        held is logged here and re-routed by the router, each taken item with a strike."""
        self.failed = True
        self.log.error("engine failed; stopping", error=str(error) if isinstance(error, WorkerFailure) else repr(error))
        for rid, run in self.running.items():
            self.log.error("request held at failure", request_id=rid, tenant=run.item.request.tenant,
                           attempt=run.item.attempt, strikes=run.strikes, sent=run.sent)
        self.stop.set()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- KV events (the router's prefix index) -------------------------------------------------

    async def publish_kv(self) -> None:
        stored, removed = self.engine.kv.take_changes()
        self.kv_seq += 1
        await self.nc.publish(subjects.kv_events(self.id), encode(KvEvent(self.id, self.kv_seq, stored, removed)))

    async def on_snapshot(self, msg) -> None:
        """Every hash held now, labelled with the last event's seq: changes not yet published are in the
        snapshot and come again in the next event, which applies twice without harm."""
        async with self.engine_lock:
            hashes = list(self.engine.kv.cached)
        part = subjects.KV_SNAPSHOT_PART
        parts = max(1, -(-len(hashes) // part))
        for i in range(parts):
            snap = KvSnapshot(self.id, self.kv_seq, i, parts, hashes[i * part:(i + 1) * part])
            await self.nc.publish(msg.reply, encode(snap))

    # -- intake (runs between steps) ------------------------------------------------------------

    async def fetch_loop(self) -> None:
        limit = 4 * self.engine.config.max_num_seqs   # beyond this, work waits in the stream
        await subjects.consume(self.nc, subjects.WORK_STREAM, subjects.worker_consumer(self.id), self.taking,
                               self.log, FETCH_BATCH, room=lambda: limit - len(self.running) - self.admitting)

    async def taking(self, msg) -> None:
        """Takes a work item in a task of its own. Its checks wait on the bus (its Outcome, a moved
        request's progress), and replies come between engine steps: taken one after another, each item
        of a burst would wait a whole step for the one before it (measured: 64 requests took 100 steps
        to enter the engine); taken at once, a burst enters together, in the order it came."""
        self.admitting += 1
        self.checking.add(id(msg))
        self.spawn(self.take(msg))

    async def take(self, msg) -> None:
        try:
            await self.admit(msg)
        except Exception:                        # a bug in one item's handling must not stop the intake
            self.log.exception("work item handling failed", subject=msg.subject)
        finally:
            self.admitting -= 1
            self.taken.pop(id(msg), None)
            self.done_checking(msg)

    def done_checking(self, msg) -> None:
        """The item runs, is refused, or waits for its KV: the step loop need not wait for it."""
        self.checking.discard(id(msg))
        if not self.checking:
            self.checked.set()

    async def admit(self, msg) -> None:
        if (item := received(msg, WorkItem, self.log, "work item")) is None:
            await msg.term()
            return
        if await self.already_ended(item, msg) or self.holds(item, msg):
            return
        r = item.request
        if subjects.past_deadline(r.created, time.time()):
            await self.give_up(item, msg, "timeout", f"the request reached a worker after its REQUEST_DEADLINE="
                               f"{subjects.REQUEST_DEADLINE:g} s; it is not run")
            return
        delivered = num_delivered(msg)
        strikes = item.strikes + self.redelivery_strikes(r.id, delivered)
        if strikes >= subjects.MAX_STRIKES:
            await self.dead_letter(item, msg, "dead_lettered", f"the request crashed or failed {strikes} workers "
                                   f"(MAX_STRIKES={subjects.MAX_STRIKES}); it is not run again", strikes)
            return
        p = r.prefilled
        if p is None:                            # counted as waiting from here (build_beat)
            self.taken[id(msg)] = len(r.prompt_token_ids), prompt_hashes(r, self.engine.config.block_size)
        output = await self.progress(r.id) if item.attempt > 0 or delivered > 1 else []
        if p is not None:
            if len(output) < len(p.output_token_ids):    # what the prefill worker sent, unless its client has more
                output = list(p.output_token_ids)
            self.done_checking(msg)              # a pull takes many steps; the loop does not wait for it
            if r.id in self.pulling or not await self.pull(item, msg):
                return
        async with self.engine_lock:             # after the step under way: the item joins the next one
            _, hashes = self.taken.pop(id(msg), (0, ()))     # in the engine (or refused) before a heartbeat counts it
            if self.holds(item, msg):            # taken meanwhile, from another delivery of the same burst
                self.engine.kv.unpin(r.id)
                return
            try:
                output = self.add(r, output, strikes, hashes)
            except ValueError as e:
                self.engine.kv.unpin(r.id)
                refused = e
            else:
                refused = None
                run = Running(item, msg, time.time(), sent=len(output), subject=subjects.out(r.id), strikes=strikes,
                              stored=stored_at(msg) if delivered == 1 and p is None else 0.0)
                if p is not None:                # its timing and prefix hit are the prefill worker's
                    run.received, run.first_token, run.seq, run.cached_tokens = p.received, p.first_token, \
                        max(p.chunks, 1), p.cached_tokens
                self.running[r.id] = run
        if refused is not None:
            self.log.info("request rejected", request_id=r.id, tenant=r.tenant, error=str(refused))
            await self.nc.publish(subjects.out(r.id), encode(ErrorChunk(r.id, "invalid_request", str(refused))))
            await msg.term()
            return
        self.prompt_tokens += len(r.prompt_token_ids)
        self.log.info("request started", request_id=r.id, tenant=r.tenant, weight=r.weight, priority=r.priority,
                      attempt=item.attempt, strikes=strikes, prompt_tokens=len(r.prompt_token_ids), resumed=len(output))
        if self.cancelled.pop(r.id, None) is not None:
            await self.abort(r.id)
        self.wake.set()

    def holds(self, item: WorkItem, msg) -> bool:
        """Whether the item's request runs here already (redelivered while it runs): then the newest
        delivery's handle is the one acked."""
        run = self.running.get(item.request.id)
        if run is not None:
            run.msg = msg
        return run is not None

    def redelivery_strikes(self, rid: str, delivered: int) -> int:
        """A redelivered item: this worker took it before and died, once per redelivery; when its
        previous life's heartbeat named a request running alone, only that one is to blame."""
        if delivered <= 1 or (self.blamed and self.blamed != rid):
            return 0
        return delivered - 1

    def add(self, r: TokenizedRequest, output: list[int], strikes: int, hashes: list[int] = ()) -> list[int]:
        """Into the engine, continuing after `output` (a moved request); a request with a strike runs
        alone until its first token. Output it cannot continue from (e.g. already at max_tokens): the
        request starts over from its prompt, and the gateway drops what its client has. Returns the
        output it continues after. `hashes`: its prompt's block hashes, if known."""
        seed = r.prefilled.seed if r.prefilled is not None else None
        share = {"priority": r.priority, "tenant": r.tenant, "weight": r.weight, "block_hashes": hashes}
        try:
            self.engine.add_request(r.id, r.prompt_token_ids, r.sampling, r.cache_salt, output, strikes > 0, seed,
                                    **share)
            return output
        except ValueError as e:
            if not output:
                raise
            self.log.warning("progress not resumable; starting from the prompt", request_id=r.id, error=str(e))
        self.engine.add_request(r.id, r.prompt_token_ids, r.sampling, r.cache_salt, (), strikes > 0, seed, **share)
        return []

    async def progress(self, rid: str) -> list[int]:
        """The output tokens the client of a moved request has, as the gateway says; [] without an answer."""
        try:
            reply = await self.nc.request(subjects.progress(rid), b"", timeout=PROGRESS_TIMEOUT)
            got = decode(reply.data, Progress)
        except (nats.errors.Error, asyncio.TimeoutError, WireError) as e:
            self.log.info("no progress; starting from the prompt", request_id=rid, error=str(e) or type(e).__name__)
            return []
        return list(got.token_ids) if got.id == rid else []

    async def on_cancel(self, msg) -> None:
        if (cancel := received(msg, Cancel, self.log, "cancel")) is None:
            return
        if cancel.id in self.running:
            await self.abort(cancel.id)
            return
        now = time.time()
        self.cancelled[cancel.id] = now
        if len(self.cancelled) > 10_000:
            self.cancelled = {k: t for k, t in self.cancelled.items() if now - t < CANCEL_MEMORY}

    async def abort(self, rid: str) -> None:
        """Ends the request now and frees its KV; it ends like any other (final chunk, record, ack)."""
        async with self.engine_lock:
            req = self.engine.abort(rid)
        if req is not None:                      # out of the engine: no step touches it any more
            await self.emit(req, time.time())

    # -- liveness -------------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)
            async with self.engine_lock:         # after the step under way: a hung one stops the beats
                try:
                    self.engine.check_alive()    # a dead tensor-parallel rank: no heartbeat, leave
                except WorkerFailure as e:
                    self.fail(e)
                    return
                self.transport.expire(time.monotonic())
                self.build_beat()
            try:
                await self.put_beat()
            except nats.js.errors.NoStreamResponseError:     # the bucket is gone (a wiped store): make it again
                self.log.warning("registry bucket missing; creating it")
                with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                    self.registry = await subjects.registry(self.js)
            except subjects.BUS_ERRORS as e:
                self.log.warning("heartbeat failed", error=str(e) or type(e).__name__)

    async def heartbeat(self) -> None:
        """Writes this worker's heartbeat (no step may be under way: the engine lock is held, or no step
        runs yet)."""
        self.build_beat()
        await self.put_beat()

    async def put_beat(self) -> None:
        """Writes the last heartbeat built; one not acknowledged within two heartbeat periods (a cluster
        electing the bucket's leader) is given up for the next, which carries a fresh time."""
        await asyncio.wait_for(self.registry.put(self.id, encode(self.beat)), 2 * subjects.HEARTBEAT_SECONDS)

    def build_beat(self) -> None:
        """The heartbeat from the engine's counts now, the requests on their way into it counted as waiting
        (`taken_blocks`), kept for the side thread's stand-in beats."""
        s = self.engine.stats()
        spec = speculation_of(s)
        if spec is not None:
            self.watch_k(spec)
        self.beat, self.beat_at = Heartbeat(
            self.id, time.time(), self.model_name, self.engine.config.block_size, self.engine.config.max_num_seqs,
            s["running"], s["waiting"] + len(self.taken), s["kv_blocks_total"], s["kv_blocks_free"],
            s["prefix_cache_queries"], s["prefix_cache_hits"], self.finished, s["preemptions"], self.prompt_tokens,
            self.generation_tokens, self.engine.scheduler.queued_blocks() + self.taken_blocks(), self.suspect, spec,
            self.role, self.transport.snapshot() if self.role != "both" else None,
            self.engine.config.scheduling_policy, self.revision), \
            time.monotonic()

    def taken_blocks(self) -> int:
        """The KV blocks the requests on their way into the engine will add, less their cached prefix: what
        the scheduler counts for a waiting request. A heartbeat built between the router's pick and the
        request's entry into the engine (it waits for the step under way) counts it so; without it the
        router, which forgets what it routed at each fresh heartbeat, saw the worker without the request
        for a whole step and sent it the next ones too (measured: docs/capacity.md, "The router's view")."""
        return sum(self.engine.kv.new_blocks(hashes, n) for n, hashes in self.taken.values())

    async def stand_in_beats(self) -> None:
        """(side thread) While a step holds the engine for longer than a heartbeat period (a long prefill
        on a CPU), the last heartbeat goes out again with a fresh time: a long step is not a departure.
        Not once the loop has been silent MAX_STEP_SECONDS: a hung engine lapses, and its work moves."""
        registry = await subjects.registry(self.side.nc.jetstream())
        while True:
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)
            hb, age = self.beat, time.monotonic() - self.beat_at
            if hb is None or not subjects.HEARTBEAT_SECONDS <= age < MAX_STEP_SECONDS:
                continue
            try:
                await asyncio.wait_for(registry.put(self.id, encode(dataclasses.replace(hb, ts=time.time()))),
                                       2 * subjects.HEARTBEAT_SECONDS)
            except nats.js.errors.NoStreamResponseError:
                with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                    registry = await subjects.registry(self.side.nc.jetstream())
            except subjects.BUS_ERRORS as e:
                self.log.warning("heartbeat failed (side thread)", error=str(e) or type(e).__name__)

    def watch_k(self, spec: Speculation) -> None:
        """Logs the engine's k when it differs from the one of the last look. A look after a step where
        no request could draft is skipped: the engine chose nothing there."""
        if spec.rows and spec.k != self.spec_k:
            self.log.info("speculation changed", k=spec.k, previous_k=self.spec_k, spec_rows=spec.rows,
                          spec_acceptance_estimate=spec.acceptance_estimate)
            self.spec_k = spec.k

    async def progress_loop(self) -> None:
        """In-progress acks keep JetStream from redelivering work that is still running."""
        while True:
            await asyncio.sleep(subjects.IN_PROGRESS_SECONDS)
            held = [(rid, run.msg) for rid, run in self.running.items()] + list(self.pulling.items())
            for rid, msg in held:
                try:
                    await msg.in_progress()
                except subjects.BUS_ERRORS as e:
                    self.log.warning("in-progress ack failed", request_id=rid, error=str(e))


async def last_suspect(nc, worker: str) -> str:
    """The request this worker's previous life (same id) last said ran alone (tb_suspects), taken off
    the bucket: what this life runs alone it says itself."""
    try:
        suspects = await subjects.suspects(nc.jetstream())
        rid = ((await suspects.get(worker)).value or b"").decode()
        await suspects.delete(worker)
        return rid
    except (nats.errors.Error, asyncio.TimeoutError, UnicodeDecodeError):
        return ""


def prompt_hashes(r: TokenizedRequest, block_size: int) -> list[int]:
    """The block hashes of the request's prompt; none for token ids that are not int64 (the engine refuses
    the request when it is added)."""
    try:
        return hash_blocks(r.prompt_token_ids, block_size, r.cache_salt)
    except (TypeError, OverflowError):
        return []


def speculation_of(stats: dict) -> Speculation | None:
    """The heartbeat's Speculation from the engine's spec_* stats; None when it does not speculate."""
    if "spec_method" not in stats:
        return None
    return Speculation(**{k.removeprefix("spec_"): v for k, v in stats.items() if k.startswith("spec_")})


def metadata(msg):
    """The JetStream metadata of a work item; None for a message that is not JetStream's (e.g. in a test)."""
    try:
        return msg.metadata
    except Exception:
        return None


def stored_at(msg) -> float:
    """When JetStream stored this work item (time.time()); 0.0 when not known."""
    m = metadata(msg)
    return m.timestamp.timestamp() if m is not None else 0.0


def num_delivered(msg) -> int:
    """How many times JetStream delivered this work item (1 the first time)."""
    m = metadata(msg)
    return max(1, m.num_delivered) if m is not None else 1


def metered(r: TokenizedRequest, done: Completion, now: float) -> Usage | None:
    """The usage record of a request as the worker saw it; None for one that names no API (offline use)."""
    m, u = r.meter, done.usage
    if m is None or not m.api:
        return None
    timing = {"queue_ms": done.timing["queue_ms"]} if "queue_ms" in done.timing else {}
    return Usage(r.id, r.tenant, m.key_id, m.model, m.api, done.finish_reason, u.get("prompt_tokens", 0),
                 u.get("cached_tokens", 0), u.get("completion_tokens", 0), timing, r.created, now, r.revision)


def logprobs(req: Request, start: int) -> Logprobs | None:
    """The logprobs of output tokens from `start` on, for a request that asked for them."""
    if req.params.logprobs is None:
        return None
    lps = req.logprobs[start - req.num_resumed_tokens:]    # tokens it resumed after came without theirs
    return Logprobs([t.logprob for t in lps], [[i for i, _ in t.top] for t in lps],
                    [[v for _, v in t.top] for t in lps])


# -- the process ----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.service", description="A tokenbus worker.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--model", required=True, help="an HF checkpoint directory, a GGUF file or a model name "
                   "(smollm2-135m-instruct, pulled on first use; tiny or small, built)")
    p.add_argument("--id", default=f"w-{os.getpid()}", help="worker id (a subject token)")
    p.add_argument("--served-model-name", help="the name of the model it serves, which requests name (default: the "
                   "--model directory's or file's name)")
    p.add_argument("--dtype", help="float32, bfloat16, ... (default: float32 on CPU, the checkpoint's on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs: requests run in arrival order (the default); priority: by each request's priority, "
                        "lower first, then arrival, a waiting request preempting running ones of a lower priority; "
                        "fair: by priority, then each tenant's share of generated tokens by its key's weight "
                        "(a virtual token counter per tenant)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--kv-cache-memory", type=int, help="bytes for the KV pool, when --num-kv-blocks is not given "
                   "(default: 1 GiB on CPU, 90%% of the free GPU memory on CUDA)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="ranks of this replica: this process and tp-1 followers it starts")
    p.add_argument("--test-hook-fault-token", type=int, help=argparse.SUPPRESS)     # TEST HOOK: see inject_fault
    p.add_argument("--test-hook-fault-action", choices=("raise", "exit"), default="raise", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help="torch threads for the engine (default: torch's, one per core); "
                   "the tokens do not depend on it")
    p.add_argument("--chunk-rate", type=subjects.chunk_rate, default=subjects.CHUNK_RATE,
                   help=f"token chunks per second this worker publishes at most, all streams together: with more "
                        f"streams, each chunk carries several steps' tokens, at most {subjects.MAX_CHUNK_INTERVAL:g} s "
                        f"apart; 0: one chunk per stream per step (default {subjects.CHUNK_RATE:g})")
    p.add_argument("--speculative", type=speculative.argument, metavar="SPEC",
                   help="speculative decoding: ngram[:K] (prompt lookup) or draft:DIR[:K] (a smaller checkpoint "
                        "with the same tokenizer), K draft tokens per request at most (default 4); the tokens are "
                        "the same as without it (default: off)")
    p.add_argument("--role", choices=subjects.ROLES, default="both",
                   help="both: prefill and decode every request it takes (default); prefill: compute long prompts "
                        "and their first token, then hand each request to a decode worker, which pulls the KV; "
                        "decode: continue handed-off requests, and prefill short prompts itself")
    p.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"), default="recompute",
                   help="a decode worker whose KV pull fails (a timeout, a gone prefill worker): recompute what it "
                        "lacks (default), or fail the request with an error naming the transfer")
    p.add_argument("--no-speculative-adaptive", action="store_true",
                   help="with --speculative: always K draft tokens, not the K each step's cost and the measured "
                        "acceptance favour")
    return p


def engine_config(args) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        kv_cache_memory=args.kv_cache_memory,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        tensor_parallel_size=args.tp, speculative=speculative_config(args),
                        scheduling_policy=args.scheduling_policy)


def speculative_config(args) -> dict | None:
    """EngineConfig.speculative from --speculative and --no-speculative-adaptive."""
    if args.speculative is None:
        return None
    return {**dataclasses.asdict(speculative.SpeculativeConfig.parse(args.speculative)),
            "adaptive": not args.no_speculative_adaptive}


async def serve(args) -> None:
    model = catalogue.resolve(args.model)
    log = configure("worker").bind(worker=args.id)
    nc = await subjects.connect(args.nats_url, f"worker-{args.id}", log, role="worker")
    blamed = await last_suspect(nc, args.id)
    if args.threads:
        torch.set_num_threads(args.threads)
    stepper = Stepper()                          # the engine is built, warmed up and stepped on its thread
    engine = await stepper.build(LLMEngine, model, engine_config(args))
    try:
        await stepper.call(warm_up, engine)
        if args.test_hook_fault_token is not None:
            engine.inject_fault(args.test_hook_fault_token, args.test_hook_fault_action)
            log.warning("TEST HOOK: fault injected", token=args.test_hook_fault_token,
                        action=args.test_hook_fault_action)
        name = args.served_model_name or os.path.basename(os.path.normpath(model))
        service = WorkerService(nc, engine, args.id, name, log, args.chunk_rate, args.role,
                                args.kv_load_failure_policy, args.nats_url, revision_of(model), stepper)
        service.blamed = blamed
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop.set)
        await service.run()
    finally:
        engine.close()
        stepper.close()                          # after: the followers of a tensor-parallel engine die with its thread
    if service.failed:
        sys.exit(1)


def warm_up(engine: LLMEngine) -> None:
    """One short request through the engine before the worker registers, so the first real request
    does not pay for lazy initialisation (allocator, kernels, thread pools). It does not speculate:
    its drafts would count in the worker's speculation metrics."""
    engine.add_request("warm-up", [0] * 8, SamplingParams(max_tokens=2, ignore_eos=True, speculative=False))
    while engine.has_unfinished():
        engine.step()
    engine.kv.reset_prefix_cache()
    engine.kv.prefix_queries = engine.kv.prefix_hits = 0


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.no_speculative_adaptive and args.speculative is None:
        p.error("--no-speculative-adaptive fixes the K of --speculative: give --speculative too")
    if args.role != "both" and args.tp > 1:
        p.error(f"--role {args.role} with --tp {args.tp}: the KV transfer of disaggregated serving moves one "
                f"rank's pool; tensor-parallel workers serve with --role both")
    subjects.run(serve(args))


if __name__ == "__main__":
    main()

"""Work items into the engine: fetched from the worker's consumer, checked, and added between steps.

Runs on the event loop. Each work item is taken in a task of its own (`taking`): its checks wait on
the bus while a step runs on the step thread, and it enters the engine under the engine lock, so it
joins the next step. The checks, in order (`admit`): it decodes; it has not ended already
(records.py) and does not run here already; it is not past its deadline; its strikes (workers it
failed or crashed) are fewer than MAX_STRIKES, else it is dead-lettered; then the output its client
has (a moved request) and its prefill worker's KV (a handed-off one). A request its checks end is
given up or dead-lettered by records.py. Also here: cancels, and the in-progress acks that keep
JetStream from redelivering what runs.

Given the shared State (state.py), whose `running` table it adds entering requests to and whose
`prompt_tokens` it counts; records.py (has the request ended already; give up, dead-letter);
streaming.py (what a moved request's client has; a cancelled request's end); the KV transport (a
handed-off request's pull); the step loop's `wake`. It owns the items on their way in (`taken`,
which the heartbeat counts, `checking`, `pulling`), the cancels that came first, and `blamed`."""
import asyncio
import contextlib
import time

import bus
from bus import tracing
from schemas import subjects
from schemas.hashing import hash_blocks
from schemas.messages import Cancel, ErrorChunk, TokenizedRequest, WorkItem, encode, received
from workers.kv_transfer import NatsKvTransport
from workers.service.records import Records
from workers.service.state import Running, State
from workers.service.streaming import Streaming

CANCEL_MEMORY = 120.0          # seconds a cancel for a request not seen yet is remembered
FETCH_BATCH = 64
INTAKE_TURNS = 4               # event-loop turns between steps: a message takes a few to reach its handler
INTAKE_WAIT = 0.1              # × the step's time (at most MAX_INTAKE_WAIT) the loop waits for items' checks
MAX_INTAKE_WAIT = 0.1          # seconds


class Intake:
    """The worker's intake: work items in, their checks and strikes, cancels, in-progress acks."""

    def __init__(self, state: State, records: Records, streaming: Streaming, transport: NatsKvTransport,
                 wake: asyncio.Event, kv_load_failure_policy: str = "recompute", blamed: str = ""):
        self.nc, self.id, self.log, self.spawn = state.nc, state.id, state.log, state.spawn
        self.engine, self.engine_lock, self.running = state.engine, state.engine_lock, state.running
        self.counts, self.records, self.streaming, self.transport = state.counts, records, streaming, transport
        self.wake = wake                             # the step loop's: set when work arrives for an idle engine
        self.kv_load_failure_policy = kv_load_failure_policy
        self.blamed = blamed                         # the request this worker's previous life ran alone, if any
        self.cancelled: dict[str, float] = {}        # cancels that came before their request
        self.admitting = 0                           # work items being taken (their checks on the bus)
        self.taken: dict[int, tuple[int, list[int]]] = {}   # by id() of the message: the requests on their
        #                   way into the engine, (prompt tokens, their block hashes), which a heartbeat counts
        self.checking: set[int] = set()              # id() of the work items whose checks are under way
        self.checked = asyncio.Event()               # set when none is
        self.pulling: dict[str, object] = {}         # request id -> its work item's message, while its KV comes

    async def fetch_loop(self) -> None:
        """Pulls this worker's work queue: one consumer, or one in each partition of a partitioned bus."""
        limit = 4 * self.engine.config.max_num_seqs   # beyond this, work waits in the stream
        await asyncio.gather(*(bus.consume(self.nc, subjects.stream(subjects.WORK_STREAM, p),
                                           bus.worker_consumer(self.id, p), self.taking, self.log, FETCH_BATCH,
                                           room=lambda: limit - len(self.running) - self.admitting)
                               for p in subjects.parts()))

    async def taking(self, msg) -> None:
        """Takes a work item in a task of its own. Its checks wait on the bus (its end record, a moved
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
        """A work item into the engine, unless one of its checks ends it first."""
        item = await self.decoded(msg)
        if item is None or await self.records.already_ended(item, msg) or self.holds(item, msg):
            return
        delivered = num_delivered(msg)
        strikes = item.strikes + self.redelivery_strikes(item.request.id, delivered)
        if await self.too_late(item, msg) or await self.struck_out(item, msg, strikes):
            return
        self.count_taken(item, msg)
        tracing.remember(item.request.id, tracing.context_of(msg.headers))    # its log lines: its trace id
        output = await self.resumed_output(item, delivered)
        if item.request.prefilled is not None and not await self.pulled(item, msg):
            return
        run = await self.enter(item, msg, output, strikes, delivered)
        if run is not None:
            run.trace = tracing.context_of(msg.headers)
            await self.started(item, run)

    async def decoded(self, msg) -> WorkItem | None:
        """The work item; None for one that does not decode, terminated (it never will)."""
        if (item := received(msg, WorkItem, self.log, "work item")) is None:
            await msg.term()
        return item

    async def too_late(self, item: WorkItem, msg) -> bool:
        """A request past its REQUEST_DEADLINE is given up, not run."""
        if not subjects.past_deadline(item.request.created, time.time()):
            return False
        await self.records.give_up(item, msg, "timeout", f"the request reached a worker after its "
                                   f"REQUEST_DEADLINE={subjects.REQUEST_DEADLINE:g} s; it is not run")
        return True

    async def struck_out(self, item: WorkItem, msg, strikes: int) -> bool:
        """A request that crashed or failed MAX_STRIKES workers is dead-lettered, not run again."""
        if strikes < subjects.MAX_STRIKES:
            return False
        await self.records.dead_letter(item, msg, "dead_lettered", f"the request crashed or failed {strikes} "
                                       f"workers (MAX_STRIKES={subjects.MAX_STRIKES}); it is not run again", strikes)
        return True

    def count_taken(self, item: WorkItem, msg) -> None:
        """A request prefilled here is counted as waiting from now on (build_beat)."""
        r = item.request
        if r.prefilled is None:
            self.taken[id(msg)] = len(r.prompt_token_ids), prompt_hashes(r, self.engine.config.block_size)

    async def resumed_output(self, item: WorkItem, delivered: int) -> list[int]:
        """The output the request continues after: what a moved or redelivered request's client has, or
        what its prefill worker sent, whichever is longer."""
        r = item.request
        output = await self.streaming.progress(r.id) if item.attempt > 0 or delivered > 1 else []
        if r.prefilled is not None and len(output) < len(r.prefilled.output_token_ids):
            output = list(r.prefilled.output_token_ids)
        return output

    async def pulled(self, item: WorkItem, msg) -> bool:
        """A handed-off request's KV is here, or the rest is to be recomputed. False: another delivery
        is pulling it, or the pull failed the request."""
        self.done_checking(msg)                  # a pull takes many steps; the loop does not wait for it
        if item.request.id in self.pulling:
            return False
        with tracing.span("kv_transfer", tracing.context_of(msg.headers), {
                "tokenbus.request_id": item.request.id, "tokenbus.worker": self.id,
                "tokenbus.prefill_worker": item.request.prefilled.worker, "tokenbus.attempt": item.attempt}):
            return await self.pull(item, msg)

    async def enter(self, item: WorkItem, msg, output: list[int], strikes: int, delivered: int) -> Running | None:
        """Into the engine after the step under way (the item joins the next one), and running here. None:
        another delivery of the same burst took it meanwhile, or the engine refused it (the client is told)."""
        r = item.request
        async with self.engine_lock:
            _, hashes = self.taken.pop(id(msg), (0, ()))     # in the engine (or refused) before a heartbeat counts it
            if self.holds(item, msg):
                self.engine.kv.unpin(r.id)
                return None
            try:
                output = self.add(r, output, strikes, hashes)
            except ValueError as e:
                self.engine.kv.unpin(r.id)
                refused = str(e)
            else:
                self.running[r.id] = run = running(item, msg, output, strikes, delivered)
                return run
        await self.refuse(item, msg, refused)
        return None

    async def refuse(self, item: WorkItem, msg, error: str) -> None:
        """A request the engine would not take (too long, bad parameters): the client is told, and the work
        item terminated."""
        r = item.request
        self.log.info("request rejected", request_id=r.id, tenant=r.tenant, error=error)
        await self.nc.publish(subjects.out(r.id), encode(ErrorChunk(r.id, "invalid_request", error)))
        await msg.term()

    async def started(self, item: WorkItem, run: Running) -> None:
        """Counted, logged, cancelled at once if its cancel came first, and the engine woken."""
        r = item.request
        self.counts.prompt_tokens += len(r.prompt_token_ids)
        self.log.info("request started", request_id=r.id, tenant=r.tenant, weight=r.weight, priority=r.priority,
                      attempt=item.attempt, strikes=run.strikes, prompt_tokens=len(r.prompt_token_ids),
                      resumed=run.sent)
        if run.trace is not None:                # its wait, from its work item's store to the engine
            tracing.start("queue", run.trace, {"tokenbus.request_id": r.id, "tokenbus.worker": self.id,
                                               "tokenbus.attempt": item.attempt, "tokenbus.strikes": run.strikes},
                          start_time=tracing.ns(stored_at(run.msg) or run.entered)).end(tracing.ns(run.entered))
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
        share = {"priority": r.priority, "tenant": r.tenant, "weight": r.weight, "block_hashes": hashes,
                 "group": r.group}
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
        if (span := tracing.current()).is_recording():
            span.set_attributes({"tokenbus.kv.offered_blocks": len(p.block_hashes), "tokenbus.kv.cached_blocks":
                                 pulled.cached, "tokenbus.kv.pulled_blocks": pulled.blocks, "tokenbus.kv.bytes":
                                 pulled.bytes})
            if pulled.error:
                tracing.error(span, "kv_transfer_failed")
        if not pulled.error:
            self.log.info("kv pulled", **fields)
            return True
        return await self.pull_failed(item, msg, pulled.error, fields)

    async def pull_failed(self, item: WorkItem, msg, error: str, fields: dict) -> bool:
        """As --kv-load-failure-policy says: what is missing is recomputed (True), or the request fails (False)."""
        if self.kv_load_failure_policy != "fail":
            self.transport.stats.recomputes += 1
            self.log.warning("kv pull failed; recomputing what is missing", error=error, **fields)
            return True
        r = item.request
        async with self.engine_lock:
            self.engine.kv.unpin(r.id)
        self.log.error("kv pull failed; the request fails (--kv-load-failure-policy fail)", error=error, **fields)
        await self.records.give_up(item, msg, "kv_transfer_failed", f"the KV of the prompt could not be pulled "
                                   f"from prefill worker {r.prefilled.worker}: {error} (--kv-load-failure-policy fail)")
        return False

    async def between_steps(self, step_seconds: float) -> None:
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

    async def progress_loop(self) -> None:
        """In-progress acks keep JetStream from redelivering work that is still running."""
        while True:
            await asyncio.sleep(subjects.IN_PROGRESS_SECONDS)
            held = [(rid, run.msg) for rid, run in self.running.items()] + list(self.pulling.items())
            for rid, msg in held:
                try:
                    await msg.in_progress()
                except bus.BUS_ERRORS as e:
                    self.log.warning("in-progress ack failed", request_id=rid, error=str(e))

    # -- cancels --------------------------------------------------------------------------------

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
            await self.streaming.emit(req, time.time())


def running(item: WorkItem, msg, output: list[int], strikes: int, delivered: int) -> Running:
    """What the service knows of a request entering the engine; a handed-off one's timing and prefix hit
    are the prefill worker's."""
    r, p = item.request, item.request.prefilled
    now = time.time()
    run = Running(item, msg, now, sent=len(output), subject=subjects.out(r.id), strikes=strikes,
                  stored=stored_at(msg) if delivered == 1 and p is None else 0.0, entered=now)
    if p is not None:
        run.received, run.first_token, run.seq, run.cached_tokens = p.received, p.first_token, max(p.chunks, 1), \
            p.cached_tokens
    return run


def prompt_hashes(r: TokenizedRequest, block_size: int) -> list[int]:
    """The block hashes of the request's prompt; none for token ids that are not int64 (the engine refuses
    the request when it is added)."""
    try:
        return hash_blocks(r.prompt_token_ids, block_size, r.cache_salt)
    except (TypeError, OverflowError):
        return []


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

"""The router: pulls new requests from TB_REQUESTS (and prefilled ones handed back from TB_ROUTE), picks
a worker, publishes the work item to tb.work.<worker> (TB_WORK), then acks. A request comes with its
prompt's tokens (the gateway asked a tokenizer before storing it); one without them (a replay of an old
log, a tokenizer that did not answer the gateway in time) is tokenized here by asking tb.prepare, and one
a tokenizer refuses goes back to its tb.out subject as an error. Workers come from the heartbeat
registry (KV bucket tb_workers); one whose heartbeat is older than WORKER_TTL is gone, whether or not
the bucket has expired its entry yet. The policy (policy.py) reads a prefix index built from the
workers' KV events on tb.kv.<worker> (index.py); a worker that is new, or whose events skipped a
number, is asked for a snapshot on tb.kv.snapshot.<worker>.

Every decision is logged with its predicted prefix hit; the completions log (tb.done.>, read as a
core subscription) brings the actual hit (usage.cached_tokens) of each request this replica
routed. The counters are published as a RouterStats record on tb.router.stats.<router> every
second. Replicas share the durable consumers; each builds its own index from the same events."""
import argparse
import asyncio
import contextlib
import os
import random
import time
import uuid
from collections import OrderedDict

import msgpack
import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.kv import KV_DEL, KV_PURGE

import bus
from bus import lifecycle, tracing
from bus.lifecycle import Life, first
from bus.log import configure
from schemas import subjects
from schemas.messages import (
    Completion,
    ErrorChunk,
    GenerateRequest,
    Heartbeat,
    KvEvent,
    KvSnapshot,
    RouterStats,
    TokenizedRequest,
    Tokens,
    WorkItem,
    decode,
    encode,
    received,
)
from schemas.wire import WireError
from services.router.index import INDEX_CAP, KvIndex
from services.router.policy import LOAD_SLACK, POLICIES, Choice, Options, Registry

NO_WORKER_POLL = 0.1
MAX_PENDING = 100_000        # decisions awaiting their completion; past this the oldest is forgotten
STATS_LOG_SECONDS = 10.0
REROUTE_INACTIVE = 30.0      # seconds after which the server deletes a re-route consumer left behind
REROUTE_RETRY = 1.0          # seconds before a re-route that failed (a slow or busy server) is tried again

LOG = configure("router")


class RouterService:
    def __init__(self, nc, options: Options | None = None, router_id: str | None = None, index_cap: int = INDEX_CAP,
                 part: int | None = None, life: Life | None = None):
        self.nc, self.js = nc, nc.jetstream()
        self.parts = subjects.parts() if part is None else [part]    # the bus partitions it routes
        self.options = options or Options()
        self.id = subjects.token("router", router_id or f"r-{os.getpid()}")
        self.registry = Registry(self.options, KvIndex(index_cap))
        self.index = self.registry.index
        self.log = LOG.bind(router=self.id)
        self.life = life or Life("router", self.id, self.log)    # SIGTERM and tokenbus drain: bus/lifecycle.py
        self.tasks: set[asyncio.Task] = set()
        self.syncing: set[str] = set()              # workers whose snapshot is awaited
        self.pending: OrderedDict[str, tuple[Choice, int]] = OrderedDict()   # request id -> (decision, prompt)
        self.stats = RouterStats(self.id, 0.0, self.options.policy, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self.reconnects, self.up_since = nc.stats["reconnects"], 0.0    # the first connection needs no grace
        self.registry_leader: str | None = None     # the registry stream's leader at the last look (a cluster)
        self.watched = 0                            # the registry stream's last sequence the watch delivered
        self.stored = 0                             # its last sequence stored, at the last look before this one
        self.rerouting: set[tuple] = set()          # (departed worker, partition) whose work is being moved

    async def run(self) -> None:
        """Routes until asked to stop or drain. Draining, it pulls no more (the other replicas take what
        comes), routes what its pulls still bring, and lets its re-routes of departed workers' work finish
        within the drain timeout."""
        await bus.ensure_streams(self.js)
        await self.nc.subscribe(subjects.KV_EVENTS_ALL, cb=self.on_kv)
        await self.nc.subscribe(subjects.RESULTS_SUBJECTS, cb=self.on_completion)
        await self.life.listen(self.nc)
        watching = bus.watch(self.nc, self.seen, self.log)      # starts over after a reconnect
        loops = [asyncio.create_task(f) for f in (watching, self.lapse_loop(), self.stats_loop())]
        self.log.info("router ready", **self.options_log())
        self.life.ready = True
        stop = self.life.asked
        try:
            consuming = asyncio.gather(*(c for p in self.parts for c in (
                bus.consume(self.nc, subjects.stream(subjects.REQUESTS_STREAM, p), bus.router(p), self.handle_new,
                            self.log, stop=stop),
                bus.consume(self.nc, subjects.stream(subjects.ROUTE_STREAM, p), bus.handoffs(p), self.handle,
                            self.log, stop=stop))))
            await first(consuming, self.life.stopping.wait())
            if self.tasks and not self.life.stopping.is_set():
                await asyncio.wait(list(self.tasks), timeout=max(0.0, self.life.deadline - time.monotonic()))
        finally:
            for t in loops:
                t.cancel()
        await self.life.left()

    def options_log(self) -> dict:
        o = self.options
        return {"policy": o.policy, "alpha": o.alpha, "kv_watermark": o.kv_watermark,
                "queue_watermark": o.queue_watermark, "load_cap": o.load_cap, "index_cap": self.index.cap,
                "max_local_prefill": o.max_local_prefill, "max_prefill_queue": o.max_prefill_queue}

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- the registry -----------------------------------------------------------------------------

    async def watch(self, watcher) -> None:
        async for entry in watcher:
            self.seen(entry)

    def seen(self, entry) -> None:
        """One registry entry: a worker's heartbeat, or its leaving; None marks the end of the initial values."""
        if entry is None:
            return
        self.watched = max(self.watched, entry.revision or 0)
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            self.leave(entry.key, "deregistered")
            return
        try:
            hb = decode(entry.value, Heartbeat)
        except WireError as e:
            self.log.error("bad heartbeat dropped", key=entry.key, error=str(e))
            return
        if hb.worker not in self.registry.workers:
            if bus.lapsed(hb, time.time()):    # a departed worker's last one, read again by a new watch
                return
            self.log.info("worker joined", worker=hb.worker, model=hb.model, max_num_seqs=hb.max_num_seqs)
        self.registry.update(hb)
        if self.index.needs_snapshot(hb.worker):
            self.spawn(self.sync(hb.worker))

    async def lapse_loop(self) -> None:
        while True:
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)
            now = time.time()
            if any(bus.lapsed(w.hb, now) for w in self.registry.workers.values()):
                await self.check_registry(now)
            self.drop_lapsed(now)

    async def check_registry(self, now: float) -> None:
        """Before a lapse counts, the registry bucket's stream is asked (its leader answers): no answer (a
        cluster without its leader: no heartbeat could be stored), a new leader since the last look, or
        heartbeats stored that the watch has not delivered (its consumer died with a node) mean no
        worker is to blame; lapses then count WORKER_TTL later at the earliest, as after a reconnect.
        Behind means a heartbeat stored by the previous look is still not delivered: one stored a moment
        ago may not have reached the watch yet, and a live worker stores one every HEARTBEAT_SECONDS, as
        often as this is asked, so counting those could put every departure off for good."""
        try:
            info = await self.nc.jetstream(timeout=1.0).stream_info(subjects.REGISTRY_STREAM)
        except bus.BUS_ERRORS:
            self.up_since = now
            return
        leader = info.cluster.leader if info.cluster else None
        if self.registry_leader is None:            # the first look: no leader to compare with yet
            self.registry_leader = leader
        behind, self.stored = self.stored > self.watched, info.state.last_seq
        if leader != self.registry_leader or behind:
            self.log.info("heartbeat lapses not counted for WORKER_TTL: the registry changed leader or is ahead "
                          "of the watch", leader=leader, last_seq=info.state.last_seq, watched=self.watched)
            self.registry_leader, self.up_since = leader, now

    def drop_lapsed(self, now: float) -> None:
        if not self.settled(now):
            return
        for w in list(self.registry.workers.values()):
            if bus.lapsed(w.hb, now):
                self.leave(w.hb.worker, "heartbeat lapsed")

    def settled(self, now: float) -> bool:
        """Whether a lapsed heartbeat means a departed worker: not while the connection is down, nor until
        it has been up WORKER_TTL since its last reconnect (no worker could write one while the broker
        was down, and the watch needs a moment to see the new ones)."""
        reconnects = self.nc.stats["reconnects"]
        if reconnects != self.reconnects:
            self.log.info("heartbeat lapses not counted for WORKER_TTL after a reconnect", reconnects=reconnects,
                          worker_ttl=subjects.WORKER_TTL)
        if reconnects != self.reconnects or not self.nc.is_connected:
            self.reconnects, self.up_since = reconnects, now
        return now - self.up_since >= subjects.WORKER_TTL

    def leave(self, worker: str, why: str) -> None:
        if worker in self.registry.workers:
            hb = self.registry.workers[worker].hb
            suspect = None if hb.draining else hb.isolated   # drained: no crash; a request it ran alone: the crash
            self.registry.remove(worker)                     # is that one's
            self.log.warning("worker left", worker=worker, why=why, drained=hb.draining)
            self.spawn(self.reroute(worker, suspect))

    # -- the prefix index -------------------------------------------------------------------------

    async def on_kv(self, msg) -> None:
        if (ev := received(msg, KvEvent, self.log, "kv event")) is None:
            return
        gaps = self.index.gaps
        if self.index.apply(ev):
            if self.index.gaps > gaps:
                self.stats.gaps += 1
                self.log.warning("kv event gap", worker=ev.worker, seq=ev.seq)
            self.spawn(self.sync(ev.worker))

    async def sync(self, worker: str) -> None:
        """Asks the worker for a snapshot and loads it, again while the held events do not follow on."""
        if worker in self.syncing or worker not in self.index.workers:
            return
        self.syncing.add(worker)
        try:
            again = True
            while again and worker in self.index.workers:
                self.index.expect_snapshot(worker)
                self.stats.snapshots += 1
                snap = await self.snapshot(worker)
                if snap is None:
                    self.index.snapshot_failed(worker)
                    self.log.warning("kv snapshot not answered", worker=worker)
                    return
                seq, hashes, tiers = snap
                again = self.index.load_snapshot(worker, seq, hashes, tiers)
                self.log.info("kv snapshot loaded", worker=worker, seq=seq, blocks=len(hashes))
        finally:
            self.syncing.discard(worker)

    async def snapshot(self, worker: str) -> tuple[int, list[int], list[int]] | None:
        """(seq, hashes, their tiers) from the worker's KvSnapshot parts; None if they do not all come in time."""
        inbox, queue = self.nc.new_inbox(), asyncio.Queue()
        sub = await self.nc.subscribe(inbox, cb=queue.put)
        parts: dict[int, KvSnapshot] = {}
        try:
            await self.nc.publish(subjects.kv_snapshot(worker), b"", reply=inbox)
            async with asyncio.timeout(subjects.KV_SNAPSHOT_TIMEOUT):
                while True:
                    snap = decode((await queue.get()).data, KvSnapshot)
                    parts[snap.part] = snap
                    if len(parts) == snap.parts:
                        break
        except (TimeoutError, WireError, nats.errors.Error):
            return None
        finally:
            await sub.unsubscribe()
        seqs = {p.seq for p in parts.values()}
        if len(seqs) != 1:
            return None
        tiers = [t for i in sorted(parts) for t in parts[i].tiers or [0] * len(parts[i].hashes)]
        return seqs.pop(), [h for i in sorted(parts) for h in parts[i].hashes], tiers

    # -- predicted vs actual ----------------------------------------------------------------------

    async def on_completion(self, msg) -> None:
        if (done := received(msg, Completion, self.log, "completion")) is None:
            return
        mine = self.pending.pop(done.id, None)
        if mine is None:                          # routed by another replica (or forgotten)
            return
        choice, prompt = mine
        self.registry.finished(choice)
        predicted, actual = choice.hit_tokens, done.usage.get("cached_tokens", 0)
        s = self.stats
        s.completed += 1
        s.prompt_tokens += prompt
        s.predicted_hit_tokens += predicted
        s.actual_hit_tokens += actual
        s.exact += predicted == actual

    async def stats_loop(self) -> None:
        logged = 0.0
        while True:
            await asyncio.sleep(subjects.ROUTER_STATS_SECONDS)
            s = self.stats
            s.ts, s.index_blocks = time.time(), self.index.sizes()
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(subjects.router_stats(self.id), encode(s))
            if s.ts - logged >= STATS_LOG_SECONDS:
                logged = s.ts
                self.log.info("router stats", **{k: getattr(s, k) for k in s.__slots__ if k not in ("router", "ts")})

    # -- routing ----------------------------------------------------------------------------------

    async def reroute(self, worker: str, suspect: str | None = "") -> None:
        """reroute_part() in each partition it routes."""
        await asyncio.gather(*(self.reroute_part(worker, suspect, p) for p in self.parts))

    async def reroute_part(self, worker: str, suspect: str | None, part: int | None) -> None:
        """Moves what a departed worker still held (queued for it, or taken and never acked) to live
        workers. Its consumer is deleted first, so it gets nothing more. Each item it had taken gets a
        strike (the strikes follow the request id, across re-routes) — only the suspect, when its last
        heartbeat said one request ran alone; items only queued for it get none, and a drained worker's
        (suspect None: its last heartbeat said it was draining) none at all. A moved request
        continues on its new worker from the tokens its client has (the worker asks the gateway).
        One re-route per worker at a time; one that fails (a server slow to answer) is tried again every
        REROUTE_RETRY until it is done, the worker is back, the connection is closed or REQUEST_DEADLINE
        has passed (past it, every item it could move would be given up)."""
        if (worker, part) in self.rerouting:        # a second departure of the same life: one move is enough
            return
        self.rerouting.add((worker, part))
        taken, deadline = None, time.monotonic() + subjects.REQUEST_DEADLINE
        try:
            while True:
                try:
                    if taken is None:               # once: a retry finds the consumer deleted
                        taken = await self.delivered(worker, part)
                    await self.move_all(worker, suspect, taken, part)
                    return
                except asyncio.CancelledError:
                    self.log.warning("re-route interrupted", worker=worker)
                    raise
                except Exception as e:              # e.g. the connection closed at shutdown: a log line
                    error = f"{type(e).__name__}: {e}"
                    if isinstance(e, nats.errors.ConnectionClosedError) or time.monotonic() > deadline:
                        self.log.error("re-route failed", worker=worker, error=error)
                        return
                    self.log.warning("re-route failed; retrying", worker=worker, error=error, retry_in=REROUTE_RETRY)
                await asyncio.sleep(REROUTE_RETRY)
                if self.back(worker):
                    self.log.warning("work not re-routed: the worker is back", worker=worker)
                    return
        finally:
            self.rerouting.discard((worker, part))

    def back(self, worker: str) -> bool:
        return any(w.hb.worker == worker for w in self.registry.live(time.time()))

    async def move_all(self, worker: str, suspect: str | None, taken: int, part: int | None = None) -> None:
        stream = subjects.stream(subjects.WORK_STREAM, part)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_consumer(stream, subjects.worker_durable(worker))
        name = f"reroute-{worker}-{uuid.uuid4().hex[:12]}"
        try:
            await self.js.add_consumer(stream, api.ConsumerConfig(
                name=name, filter_subject=bus.work_filter(worker, part), ack_policy=api.AckPolicy.EXPLICIT,
                inactive_threshold=REROUTE_INACTIVE))
        except nats.js.errors.BadRequestError as e:  # it was alive after all and made its consumer again
            self.log.warning("work not re-routed", worker=worker, error=str(e))
            return
        try:
            moved = await self.drain(stream, worker, name, taken, suspect)
        finally:                                    # at once, so the worker can recreate its consumer
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await self.js.delete_consumer(stream, name)
        if moved:
            self.log.warning("work re-routed", worker=worker, requests=moved, suspect=suspect or None)

    async def delivered(self, worker: str, part: int | None = None) -> int:
        """The last stream sequence the worker's consumer delivered: items up to it were taken. 0 when it
        has no consumer; a server that does not answer raises (the re-route is tried again)."""
        try:
            info = await self.js.consumer_info(subjects.stream(subjects.WORK_STREAM, part),
                                               subjects.worker_durable(worker))
        except nats.js.errors.NotFoundError:
            return 0
        return info.delivered.stream_seq if info.delivered else 0

    async def drain(self, stream: str, worker: str, name: str, taken: int, suspect: str | None) -> int:
        """Moves every item of the re-route consumer. An empty fetch ends it only once the consumer says
        nothing is left to deliver: on a busy server a fetch can time out with the items still there."""
        sub = await self.js.pull_subscribe_bind(stream=stream, name=name)
        moved = 0
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch=64, timeout=0.5)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    if (await self.js.consumer_info(stream, name)).num_pending == 0:
                        return moved
                    continue
                for msg in msgs:
                    n = await self.move(msg, worker, msg.metadata.sequence.stream <= taken, suspect)
                    if n < 0:                   # it came back (its heartbeat had only lapsed): the rest is its own
                        return moved
                    moved += n
        finally:
            await sub.unsubscribe()

    async def move(self, msg, departed: str, taken: bool = False, suspect: str | None = "") -> int:
        """move_item() in a span `migration` of the request's trace (its work item's headers carry it)."""
        if not tracing.ON:
            return await self.move_item(msg, departed, taken, suspect)
        with tracing.span("migration", tracing.context_of(msg.headers), {
                "tokenbus.request_id": (msg.headers or {}).get(subjects.REQUEST_ID, ""),
                "tokenbus.departed_worker": departed, "tokenbus.router": self.id}) as span:
            moved = await self.move_item(msg, departed, taken, suspect)
            span.set_attribute("tokenbus.moved", moved)
            return moved

    async def move_item(self, msg, departed: str, taken: bool = False, suspect: str | None = "") -> int:
        """1 when the item moved to a live worker, 0 when it was dropped or given up (past its deadline),
        -1 when the only pick is the departed worker itself, back already (re-publishing to its subject
        would feed this very loop: the item stays for it, re-published with its strike if it had taken it)."""
        if (item := received(msg, WorkItem, self.log, "work item")) is None:
            await msg.term()
            return 0
        choice = await self.pick(msg, item.request)
        if choice is None:                          # past its deadline
            await self.give_up(msg, item.request)
            return 0
        worker = choice.worker
        strike = taken and suspect is not None and suspect in ("", item.request.id)
        if worker == departed and not strike:
            await msg.nak()
            return -1
        strikes = item.strikes + strike
        tracing.current().set_attributes({"tokenbus.attempt": item.attempt + 1, "tokenbus.strikes": strikes})
        if strike:
            self.log.warning("strike", request_id=item.request.id, worker=departed, strikes=strikes)
        await self.send(WorkItem(item.request, worker, time.time(), item.attempt + 1, strikes, choice.prefill))
        await msg.ack_sync()                        # before the consumer goes: a plain ack can be lost with it
        return -1 if worker == departed else 1

    async def send(self, item: WorkItem) -> None:
        """Publishes the work item, retried under its message id until stored (NotStored past the deadline);
        its headers carry the current span's trace context (route or migration)."""
        headers = tracing.inject(subjects.msg_id(item.request.id, item.msg_id))
        await bus.publish(self.js, subjects.work(item.worker, item.request.id), encode(item), headers, self.log)

    async def handle_new(self, msg) -> None:
        """route_new() in a span `route` of the request's trace (the headers it was stored with carry it)."""
        if not tracing.ON:
            return await self.route_new(msg)
        with tracing.span("route", tracing.context_of(msg.headers), {
                "tokenbus.request_id": (msg.headers or {}).get(subjects.REQUEST_ID, ""),
                "tokenbus.router": self.id}, tracing.SpanKind.CONSUMER):
            await self.route_new(msg)

    async def route_new(self, msg) -> None:
        """A new request from TB_REQUESTS: its tokens (asked of a tokenizer if it came without), then routed."""
        try:
            new = decode(msg.data, GenerateRequest)
        except WireError as e:
            await self.refuse(msg, request_id(msg.data), "invalid_request", str(e))
            return
        ids = new.tokens
        if ids is None:
            got = await self.prepare(msg, new)
            if got is None:
                await self.give_up(msg, new)
                return
            if got.code:
                await self.refuse(msg, new.id, got.code, got.message)
                return
            ids = got.token_ids
        if new.sampling.seed is None:            # a request the gateway did not seed: a re-routed or replayed
            new.sampling.seed = random.getrandbits(63)   # request then yields the same tokens
        await self.route(msg, TokenizedRequest(new.id, new.tenant, new.sampling, ids, new.cache_salt, new.created,
                                               new.meter, priority=new.priority, model=new.model,
                                               revision=new.revision, weight=new.weight, group=new.group))

    async def prepare(self, msg, req: GenerateRequest) -> Tokens | None:
        """A tokenizer's answer on tb.prepare, asked again while none answers (the request stays in
        TB_REQUESTS, kept alive) until REQUEST_DEADLINE after its creation: then None."""
        while not subjects.past_deadline(req.created, time.time()):
            try:
                headers = tracing.inject({subjects.REQUEST_ID: req.id}) if tracing.ON else None
                reply = await self.nc.request(subjects.PREPARE, msg.data, timeout=subjects.PREPARE_SECONDS,
                                              headers=headers)
                return decode(reply.data, Tokens)
            except WireError as e:
                return Tokens([], 0, "internal", f"the tokenizer's answer was not a Tokens message: {e}")
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError):
                await msg.in_progress()
                await asyncio.sleep(NO_WORKER_POLL)
        return None

    async def refuse(self, msg, rid: str | None, code: str, message: str) -> None:
        """A request the pipeline cannot run: its error on tb.out, never delivered again."""
        self.log.error("request refused", request_id=rid, code=code, error=message, subject=msg.subject)
        if rid is not None:
            await self.nc.publish(subjects.out(rid), encode(ErrorChunk(rid, code, message)))
        await msg.term()

    async def handle(self, msg) -> None:
        """A prefilled request handed back from TB_ROUTE, routed to a decode worker (in a span `route` of its
        trace, with tracing on: the prefill worker's headers carry it)."""
        if (req := received(msg, TokenizedRequest, self.log, "tokenized request")) is None:
            await msg.term()
            return
        with tracing.span("route", tracing.context_of(msg.headers), {"tokenbus.request_id": req.id,
                          "tokenbus.router": self.id, "tokenbus.handoff": True}, tracing.SpanKind.CONSUMER):
            await self.route(msg, req)

    async def route(self, msg, req: TokenizedRequest) -> None:
        choice = await self.pick(msg, req)
        if choice is None:
            await self.give_up(msg, req)
            return
        try:
            await self.send(WorkItem(req, choice.worker, time.time(), prefill=choice.prefill))
        except bus.NotStored as e:             # not acked: JetStream redelivers it
            self.log.error("work publish failed", request_id=req.id, worker=choice.worker, error=str(e))
            return
        await msg.ack()

    async def pick(self, msg, req: TokenizedRequest) -> Choice | None:
        """A worker for the request (a prefilled one: a decode-capable worker); with none alive, waits (the
        request stays in its stream, kept alive), until REQUEST_DEADLINE after its creation: None, the
        request is to be given up."""
        waited = 0.0
        while True:
            now = time.time()
            if subjects.past_deadline(req.created, now):
                return None
            self.drop_lapsed(now)
            choice = self.registry.pick(now, req.prompt_token_ids, req.cache_salt, req.prefilled is not None,
                                        model=req.model, revision=req.revision, priority=req.priority,
                                        group=req.group)
            if choice is not None:
                self.decided(req, choice)
                return choice
            await asyncio.sleep(NO_WORKER_POLL)
            waited += NO_WORKER_POLL
            if waited >= subjects.IN_PROGRESS_SECONDS:
                await msg.in_progress()
                waited = 0.0

    async def give_up(self, msg, req: TokenizedRequest | GenerateRequest) -> bool:
        """Ends a request past its deadline: ErrorChunk "timeout" on tb.out, an end record "error" in
        TB_RESULTS (the first end of a request is the one kept), then acked so no worker runs it after its
        client was answered. False when the record could not be stored (not acked: it comes again)."""
        who = "worker took" if isinstance(req, TokenizedRequest) else "tokenizer answered for"
        reason = f"no {who} the request within REQUEST_DEADLINE={subjects.REQUEST_DEADLINE:g} s of its creation"
        await self.nc.publish(subjects.out(req.id), encode(ErrorChunk(req.id, "timeout", reason)))
        record = Completion(req.id, req.tenant, self.id, req.sampling, getattr(req, "prompt_token_ids", None) or [],
                            [], "error", created=req.created, error_code="timeout", error_message=reason,
                            ended=time.time())
        try:
            await bus.store_end(self.js, req.tenant, req.id, bus.partition(msg), encode(record),
                                self.log)
            await msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, bus.NotStored) as e:
            self.log.error("timeout not stored", request_id=req.id, error=str(e) or type(e).__name__)
            return False
        self.log.warning("request given up", request_id=req.id, tenant=req.tenant, reason=reason)
        return True

    def decided(self, req: TokenizedRequest, choice: Choice) -> None:
        """Counts a decision. A handoff's is not the one whose prefix hit the completion reports (the
        prefill worker's): the prefill decision stays the pending one."""
        s, n = self.stats, len(req.prompt_token_ids)
        s.routed += 1
        s.guarded += choice.guarded
        s.routed_to[choice.worker] = s.routed_to.get(choice.worker, 0) + 1
        if req.prefilled is not None:
            s.handoffs += 1
        else:
            self.pending[req.id] = (choice, n)
            if len(self.pending) > MAX_PENDING:
                self.pending.popitem(last=False)
            if choice.why:
                s.prefill[choice.why] = s.prefill.get(choice.why, 0) + 1
        span = tracing.current()
        if span.is_recording():
            span.set_attributes({"tokenbus.worker": choice.worker, "tokenbus.predicted_hit_tokens": choice.hit_tokens,
                                 "gen_ai.usage.input_tokens": n, "tokenbus.policy": self.options.policy,
                                 "tokenbus.prefill": choice.why or "", "gen_ai.request.model": req.model or ""})
        self.log.info("routed", request_id=req.id, tenant=req.tenant, worker=choice.worker, prompt_tokens=n,
                      model=req.model or None, revision=req.revision or None,
                      predicted_hit_tokens=choice.hit_tokens, best_hit_tokens=choice.best_hit_tokens,
                      cost=round(choice.cost, 2), guarded=choice.guarded, prefill=choice.why or None,
                      costs={w: round(c, 2) for w, c in choice.costs.items()})
        choice.costs = {}                           # it waits for its completion: keep it small


def request_id(data: bytes) -> str | None:
    """The id of a message that failed to decode, if it has a usable one (to send the error back)."""
    try:
        return subjects.token("request id", msgpack.unpackb(data).get("id"))
    except Exception:
        return None


def parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m services.router", description="The tokenbus router.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--id", help="router id, a subject token (default r-<pid>)")
    p.add_argument("--policy", choices=POLICIES, default=d.policy)
    p.add_argument("--alpha", type=float, default=d.alpha,
                   help=f"weight of a prompt block to prefill against a block of KV held (default {d.alpha})")
    p.add_argument("--kv-watermark", type=float, default=d.kv_watermark,
                   help=f"a worker with more of its KV blocks in use (or about to be) has no room (default "
                        f"{d.kv_watermark})")
    p.add_argument("--queue-watermark", type=float, default=d.queue_watermark,
                   help=f"a worker with more queued requests per max_num_seqs has no room "
                        f"(default {d.queue_watermark})")
    p.add_argument("--load-cap", type=float, default=d.load_cap,
                   help=f"a worker that took more than this times (the recent requests of the one that took "
                        f"fewest + {LOAD_SLACK:g}) has no room (default {d.load_cap})")
    p.add_argument("--max-local-prefill", type=int, default=d.max_local_prefill,
                   help=f"with prefill workers: a prompt with more uncached tokens than this (on the decode worker "
                        f"that holds most of it) is prefilled on a prefill worker (default {d.max_local_prefill})")
    p.add_argument("--max-prefill-queue", type=int, default=d.max_prefill_queue,
                   help=f"...unless every prefill worker has more requests queued than this: then the decode worker "
                        f"prefills it (default {d.max_prefill_queue})")
    p.add_argument("--index-cap", type=int, default=INDEX_CAP, help=f"hashes kept per worker (default {INDEX_CAP})")
    p.add_argument("--partition", type=int, default=None,
                   help="on a partitioned bus (TB_BUS_PARTITIONS): the one partition it routes (default: every one)")
    lifecycle.add_arguments(p)
    return p


async def serve(args) -> None:
    options = Options(args.policy, args.alpha, args.kv_watermark, args.queue_watermark, args.load_cap,
                      args.max_local_prefill, args.max_prefill_queue)
    parts = subjects.parts()
    if args.partition is not None and args.partition not in parts:
        raise SystemExit(f"--partition {args.partition}: the bus has partitions {parts} ({subjects.PARTITIONS_ENV})")
    name = subjects.token("router", args.id or f"r-{os.getpid()}")
    tracing.setup("router", name, args.otlp_endpoint)
    life = Life("router", name, LOG.bind(router=name), args.drain_timeout)
    life.on_signals()
    await life.serve_probes(args.health_host, args.health_port)
    service = RouterService(await bus.connect(args.nats_url, "router", LOG), options, name, args.index_cap,
                            args.partition, life)
    try:
        await service.run()
    finally:
        await bus.close(service.nc)
        await life.close()


def main(argv=None) -> None:
    bus.run(serve(parser().parse_args(argv)))

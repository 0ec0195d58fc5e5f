"""What the rest of the cluster knows of this worker: its heartbeat in tb_workers (the router's view of
its load), the request it runs alone (tb_suspects, for fault containment), its KV events (the
router's prefix index), and its leaving.

Runs on the event loop, except `stand_in_beats`, which runs on the side thread (workers/sideline.py):
it re-sends the last heartbeat while a long step holds the engine.

Given the shared State (state.py), whose counts it reports; the KV transport (its
leases expire on the heartbeat's turn; a disaggregated worker's beat carries its stats); intake's
`taken` (the requests on their way into the engine, counted as waiting); the step loop's `fail` (a
dead tensor-parallel rank); what the heartbeat names (model, role, revision). It owns the tb_workers
and tb_suspects buckets (`open`), the last heartbeat, the suspect, and the KV events' seq."""
import asyncio
import contextlib
import dataclasses
import time

import nats.errors
import nats.js.errors

import bus
from schemas import subjects
from schemas.messages import Heartbeat, KvEvent, KvSnapshot, Speculation, encode
from workers.distributed import WorkerFailure
from workers.kv_transfer import NatsKvTransport
from workers.service.state import State
from workers.sideline import MAX_STEP_SECONDS, Sideline

LEAVE_WAIT = 2.0               # seconds a stopping worker waits for the ends it is storing


class Registry:
    """The worker's presence: heartbeats, suspects, KV events, leaving."""

    def __init__(self, state: State, transport: NatsKvTransport, taken: dict, fail, model_name: str,
                 role: str = "both", revision: str = ""):
        self.nc, self.js, self.id, self.log = state.nc, state.js, state.id, state.log
        self.engine, self.engine_lock = state.engine, state.engine_lock
        self.counts, self.tasks = state.counts, state.tasks
        self.transport, self.taken, self.fail = transport, taken, fail   # taken: intake's; fail: the step loop's
        self.model_name, self.role, self.revision = model_name, role, revision   # of the model it serves
        self.bucket = self.suspects = None           # tb_workers, tb_suspects, once open()
        self.beat: Heartbeat | None = None           # the last heartbeat built, and when
        self.beat_at = 0.0
        self.suspect = ""                            # the request the last heartbeat said runs alone
        self.spec_k: int | None = None               # k at the last look where some request could draft
        self.kv_seq = 0                              # KV events published
        self.draining = False                        # said in every heartbeat from the drain's start

    async def open(self) -> None:
        self.bucket = await bus.registry(self.js)
        self.suspects = await bus.suspects(self.js)

    async def leave(self, side: Sideline | None) -> None:
        """Lets the ends being stored (outcomes, records, dead letters) finish for up to LEAVE_WAIT
        seconds (what is left stays unacked and is redelivered), deregisters: the router moves at once
        what the worker still held (without strikes when its last heartbeat said it was draining)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=LEAVE_WAIT)
        if side is not None:                     # before the deregistration: it could write a heartbeat after it
            await side.stop()
        try:
            await self.bucket.delete(self.id)
        except Exception as e:                   # the server may be gone already
            self.log.warning("leaving uncleanly", error=str(e))

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
                    self.bucket = await bus.registry(self.js)
            except bus.BUS_ERRORS as e:
                self.log.warning("heartbeat failed", error=str(e) or type(e).__name__)

    async def heartbeat(self) -> None:
        """Writes this worker's heartbeat (no step may be under way: the engine lock is held, or no step
        runs yet)."""
        self.build_beat()
        await self.put_beat()

    async def say_draining(self) -> None:
        """The last heartbeat again at once, saying the worker drains (not after the step under way: what the
        router sends meanwhile would still come here)."""
        if self.beat is not None:
            self.beat = dataclasses.replace(self.beat, ts=time.time(), draining=True)
            try:
                await self.put_beat()
            except bus.BUS_ERRORS as e:             # the next heartbeat says it
                self.log.warning("heartbeat failed", error=str(e) or type(e).__name__)

    async def put_beat(self) -> None:
        """Writes the last heartbeat built; one not acknowledged within two heartbeat periods (a cluster
        electing the bucket's leader) is given up for the next, which carries a fresh time."""
        await asyncio.wait_for(self.bucket.put(self.id, encode(self.beat)), 2 * subjects.HEARTBEAT_SECONDS)

    def build_beat(self) -> None:
        """The heartbeat from the engine's counts now, the requests on their way into it counted as waiting
        (`taken_blocks`), kept for the side thread's stand-in beats."""
        s, c = self.engine.stats(), self.counts
        spec = speculation_of(s)
        if spec is not None:
            self.watch_k(spec)
        self.beat, self.beat_at = Heartbeat(
            self.id, time.time(), self.model_name, self.engine.config.block_size, self.engine.config.max_num_seqs,
            s["running"], s["waiting"] + len(self.taken), s["kv_blocks_total"], s["kv_blocks_free"],
            s["prefix_cache_queries"], s["prefix_cache_hits"], c.finished, s["preemptions"], c.prompt_tokens,
            c.generation_tokens, self.engine.scheduler.queued_blocks() + self.taken_blocks(), self.suspect, spec,
            self.role, self.transport.snapshot() if self.role != "both" else None,
            self.engine.config.scheduling_policy, self.revision, s["forks"], tiers_of(s), self.draining), \
            time.monotonic()

    def taken_blocks(self) -> int:
        """The KV blocks the requests on their way into the engine will add, less their cached prefix: what
        the scheduler counts for a waiting request. A heartbeat built between the router's pick and the
        request's entry into the engine (it waits for the step under way) counts it so; without it the
        router, which forgets what it routed at each fresh heartbeat, saw the worker without the request
        for a whole step and sent it the next ones too (measured: docs/capacity.md, "The router's view")."""
        return sum(self.engine.kv.new_blocks(hashes, n) for n, hashes in self.taken.values())

    async def stand_in_beats(self, side_nc) -> None:
        """(side thread, on its connection `side_nc`) While a step holds the engine for longer than a
        heartbeat period (a long prefill on a CPU), the last heartbeat goes out again with a fresh time: a
        long step is not a departure. Not once the loop has been silent MAX_STEP_SECONDS: a hung engine
        lapses, and its work moves."""
        registry = await bus.registry(side_nc.jetstream())
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
                    registry = await bus.registry(side_nc.jetstream())
            except bus.BUS_ERRORS as e:
                self.log.warning("heartbeat failed (side thread)", error=str(e) or type(e).__name__)

    def watch_k(self, spec: Speculation) -> None:
        """Logs the engine's k when it differs from the one of the last look. A look after a step where
        no request could draft is skipped: the engine chose nothing there."""
        if spec.rows and spec.k != self.spec_k:
            self.log.info("speculation changed", k=spec.k, previous_k=self.spec_k, spec_rows=spec.rows,
                          spec_acceptance_estimate=spec.acceptance_estimate)
            self.spec_k = spec.k

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
            except bus.BUS_ERRORS as e:
                self.log.warning("suspect not announced", suspect=rid or None, error=str(e) or type(e).__name__)

    # -- KV events (the router's prefix index) -------------------------------------------------

    async def publish_kv(self) -> None:
        stored, tiers, removed = self.engine.kv.take_events()
        self.kv_seq += 1
        tiers = tiers if any(tiers) else []              # all in the pool: as a worker without tiers says it
        await self.nc.publish(subjects.kv_events(self.id),
                              encode(KvEvent(self.id, self.kv_seq, stored, removed, tiers)))

    async def on_snapshot(self, msg) -> None:
        """Every hash held now, labelled with the last event's seq: changes not yet published are in the
        snapshot and come again in the next event, which applies twice without harm."""
        async with self.engine_lock:
            hashes, tiers = self.engine.kv.held()
        part = subjects.KV_SNAPSHOT_PART
        parts = max(1, -(-len(hashes) // part))
        for i in range(parts):
            snap = KvSnapshot(self.id, self.kv_seq, i, parts, hashes[i * part:(i + 1) * part],
                              tiers[i * part:(i + 1) * part] if any(tiers) else [])
            await self.nc.publish(msg.reply, encode(snap))


async def last_suspect(nc, worker: str) -> str:
    """The request this worker's previous life (same id) last said ran alone (tb_suspects), taken off
    the bucket: what this life runs alone it says itself."""
    try:
        suspects = await bus.suspects(nc.jetstream())
        rid = ((await suspects.get(worker)).value or b"").decode()
        await suspects.delete(worker)
        return rid
    except (nats.errors.Error, asyncio.TimeoutError, UnicodeDecodeError):
        return ""


def tiers_of(stats: dict) -> dict[str, float]:
    """The heartbeat's kv_tiers from the engine's kv_host_* and kv_disk_* stats; empty without tiers."""
    return {k.removeprefix("kv_"): float(v) for k, v in stats.items() if k.startswith(("kv_host_", "kv_disk_"))}


def speculation_of(stats: dict) -> Speculation | None:
    """The heartbeat's Speculation from the engine's spec_* stats; None when it does not speculate."""
    if "spec_method" not in stats:
        return None
    return Speculation(**{k.removeprefix("spec_"): v for k, v in stats.items() if k.startswith("spec_")})

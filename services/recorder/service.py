"""The recorder: the records that outlive the bus. It pulls the usage records (TB_USAGE) and the end
records (TB_RESULTS) through the durable `recorder` consumers of every partition, writes each batch to
the database (one transaction of upserts keyed by request id) and the end records to the request log's
Parquet archive, and acks the batch only after: a crash before the ack gets the batch again, and the
upsert writes nothing twice. While the database is away a batch is held and tried again; the streams
keep what is not taken (TB_USAGE by interest retention, TB_RESULTS until trimmed), and when they fill,
the gateways refuse new requests (503 "metering backlog full") instead of serving what cannot be billed.

Archived end records older than ENDS_KEEP are trimmed from TB_RESULTS (purged below both the consumer's
ack floor and that age), and archive partitions older than the retention are removed. Any number of
recorders may run: each batch goes to one of them. /metrics: backlog depth and age, records written,
write errors, batch sizes, and each stream's fill."""
import argparse
import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from prometheus_client import Counter, Gauge, Histogram, generate_latest

import bus
from bus import lifecycle, tracing
from bus.lifecycle import Life, first
from bus.log import configure
from schemas import records, subjects
from schemas.messages import Completion, Usage, decode
from schemas.wire import WireError
from services.recorder.archive import Archive
from services.recorder.store import Database, redacted

LOG = configure("recorder")
BATCH = 2000                             # records written in one transaction, at most
USAGE_LINGER = 0.05                      # seconds a usage batch waits to fill once it has a record
RESULTS_LINGER = 2.0                     # an end-record batch (one Parquet file per tenant and hour)
RETRY = 1.0                              # seconds between tries of a batch the database refused
IN_PROGRESS = 20.0                       # a held batch tells JetStream it is still being worked on this often
IN_FLIGHT = 2                            # batches of a stream between taken and acked, at most
WATCH_SECONDS = 5.0                      # backlog and fill measured, TB_RESULTS trimmed, the archive pruned

BACKLOG = Gauge("tokenbus_recorder_backlog_records", "Records stored on the bus and not yet recorded", ["stream"])
BACKLOG_AGE = Gauge("tokenbus_recorder_backlog_age_seconds", "Age of the oldest record not yet recorded",
                    ["stream"])
WRITTEN = Counter("tokenbus_recorder_records_total", "Records written (database rows, archive rows)", ["stream"])
DUPLICATES = Counter("tokenbus_recorder_duplicates_total", "Records delivered again and already recorded",
                     ["stream"])
ERRORS = Counter("tokenbus_recorder_write_errors_total", "Batches the database or archive refused", ["stream"])
BATCHES = Histogram("tokenbus_recorder_batch_records", "Records in a batch", ["stream"],
                    buckets=(1, 10, 50, 100, 500, 1000, 2000))
FILL = Gauge("tokenbus_stream_fill_ratio", "Bytes held over max_bytes (admission refuses at BACKLOG_FULL)",
             ["stream"])
TRIMMED = Counter("tokenbus_recorder_trimmed_total", "Archived end records trimmed from TB_RESULTS")
BAD = Counter("tokenbus_recorder_bad_records_total", "Records that did not decode (acked, not recorded)", ["stream"])


@dataclass
class Batcher:
    """One stream partition's records as they arrive, handed to write() in batches."""
    stream: str
    linger: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: set = field(default_factory=set)     # its batches being written

    def idle(self) -> bool:
        return self.queue.empty() and not self.tasks

    def room(self) -> int:
        return max(0, BATCH - self.queue.qsize())

    async def take(self) -> list:
        """The next batch: what arrived within `linger` of its first record, at most BATCH."""
        msgs = [await self.queue.get()]
        with contextlib.suppress(TimeoutError):                 # a get cut off leaves its record queued
            async with asyncio.timeout(self.linger):
                while len(msgs) < BATCH:
                    msgs.append(self.queue.get_nowait() if not self.queue.empty() else await self.queue.get())
        return msgs


class Recorder:
    def __init__(self, nc, db: Database, archive: Archive, retention: float = subjects.LOG_MAX_AGE,
                 recorder_id: str | None = None, life: Life | None = None):
        self.nc, self.js, self.db, self.archive = nc, nc.jetstream(), db, archive
        self.retention = retention
        self.id = subjects.token("recorder", recorder_id or f"rec-{os.getpid()}")
        self.log = LOG.bind(recorder=self.id)
        self.parts = subjects.parts()
        self.life = life or Life("recorder", self.id, self.log)      # SIGTERM, tokenbus drain: bus/lifecycle.py

    async def run(self) -> None:
        """Records until asked to stop or drain. Draining, it pulls no more (other recorders, or the next one,
        take what comes) and writes and acks what it took, within the drain timeout."""
        await bus.ensure_streams(self.js)
        await asyncio.to_thread(self.db.version)               # connects and migrates, or says why not
        await self.life.listen(self.nc)
        self.log.info("recorder ready", database=redacted(self.db.url), archive=self.archive.url,
                      partitions=len(self.parts))
        self.life.ready = True
        pulls, batchers = [], []
        for p in self.parts:
            for base, linger, write in ((subjects.USAGE_STREAM, USAGE_LINGER, self.write_usage),
                                        (subjects.RESULTS_STREAM, RESULTS_LINGER, self.write_ends)):
                stream, batcher = subjects.stream(base, p), Batcher(base, linger)
                pulls.append(bus.consume(self.nc, stream, bus.recorder(base, p), batcher.queue.put, self.log,
                                         batch=BATCH, room=batcher.room, stop=self.life.asked))
                batchers.append((batcher, write))
        loops = [asyncio.create_task(self.drain(b, w)) for b, w in batchers] + [asyncio.create_task(self.watch())]
        try:
            await first(asyncio.gather(*pulls), self.life.stopping.wait())
            await first(self.settled([b for b, _ in batchers]), self.life.stopping.wait(),
                        asyncio.sleep(max(0.0, self.life.deadline - time.monotonic())))
        finally:
            for t in loops:
                t.cancel()
        await self.life.left()

    @staticmethod
    async def settled(batchers: list[Batcher]) -> None:
        """Until every record taken is written and acked: no batcher holds one (twice, a linger apart: a batch
        being gathered is in neither its queue nor its tasks)."""
        while True:
            if all(b.idle() for b in batchers):
                await asyncio.sleep(RESULTS_LINGER + 0.1)
                if all(b.idle() for b in batchers):
                    return
            await asyncio.sleep(0.05)

    async def drain(self, batcher: Batcher, write) -> None:
        """Forever: a batch decoded, written (tried again until it is), then acked; IN_FLIGHT batches at a time,
        so that the next is decoded while one is in the database."""
        room, tasks = asyncio.Semaphore(IN_FLIGHT), batcher.tasks
        while True:
            msgs = await batcher.take()
            await room.acquire()
            task = asyncio.create_task(self.settle(msgs, batcher.stream, write))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), room.release()))

    async def settle(self, msgs: list, stream: str, write) -> None:
        records = []
        for msg in msgs:
            try:
                records.append(decode(msg.data, Usage if stream == subjects.USAGE_STREAM else Completion))
            except WireError as e:
                BAD.labels(stream).inc()
                self.log.error("bad record acked, not recorded", subject=msg.subject, error=str(e))
        await self.held(msgs, stream, write, records)
        for msg in msgs:
            with contextlib.suppress(nats.errors.Error):      # a lost ack: delivered again, written once
                await msg.ack()
        BATCHES.labels(stream).observe(len(msgs))

    async def held(self, msgs: list, stream: str, write, records: list) -> None:
        """write(records) in a thread until it succeeds, telling JetStream the batch is in progress meanwhile."""
        touched, failures = time.monotonic(), 0
        while True:
            try:
                await asyncio.to_thread(write, records)
                if failures:
                    self.log.info("batch written after failures", stream=stream, records=len(records),
                                  failures=failures)
                return
            except Exception as e:
                failures += 1
                ERRORS.labels(stream).inc()
                if self.db.refused(e):                      # a record the database cannot take: set aside
                    await self.set_aside(stream, write, records, e)
                    return
                if failures == 1 or failures % 30 == 0:
                    self.log.error("batch not written; holding it and trying again", stream=stream,
                                   records=len(records), failures=failures, error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(RETRY)
            if time.monotonic() - touched >= IN_PROGRESS:
                touched = time.monotonic()
                for msg in msgs:
                    with contextlib.suppress(nats.errors.Error):
                        await msg.in_progress()

    async def set_aside(self, stream: str, write, records: list, e: Exception) -> None:
        """Records the database refused: each of a batch written alone (held while the database is away); one
        it refuses alone is acked unrecorded, with an error line, so a bad record never blocks the rest."""
        if len(records) > 1:
            for record in records:
                await self.held([], stream, write, [record])
            return
        BAD.labels(stream).inc()
        self.log.error("record refused by the database: acked, not recorded", stream=stream,
                       request_id=records[0].id, error=f"{type(e).__name__}: {e}")

    def write_usage(self, usage: list[Usage]) -> None:
        new, _ = self.db.write(usage, [])
        WRITTEN.labels(subjects.USAGE_STREAM).inc(new)
        DUPLICATES.labels(subjects.USAGE_STREAM).inc(len(usage) - new)

    def write_ends(self, ends: list[Completion]) -> None:
        """The end records into the archive (the whole record) and the database (a row each)."""
        if ends:
            self.archive.write(ends)
        _, new = self.db.write([], ends)
        WRITTEN.labels(subjects.RESULTS_STREAM).inc(new)
        DUPLICATES.labels(subjects.RESULTS_STREAM).inc(len(ends) - new)

    # -- watching: backlog, fill, trim, prune ------------------------------------------------------

    async def watch(self) -> None:
        pruned = 0.0
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            for base in (subjects.USAGE_STREAM, subjects.RESULTS_STREAM):
                with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                    await self.measure(base)
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                for p in self.parts:
                    await self.trim(p)
            if time.monotonic() - pruned > 3600 or not pruned:
                pruned = time.monotonic()
                try:
                    removed = await asyncio.to_thread(self.archive.prune, self.retention)
                    if removed:
                        self.log.info("archive pruned", files=removed, retention_s=self.retention)
                except Exception as e:
                    self.log.error("archive not pruned", error=f"{type(e).__name__}: {e}")

    async def measure(self, base: str) -> None:
        backlog, age = 0, 0.0
        for p in self.parts:
            stream = subjects.stream(base, p)
            info = await self.js.consumer_info(stream, subjects.RECORDER_DURABLE)
            backlog += info.num_pending + info.num_ack_pending
            if info.num_pending + info.num_ack_pending:
                age = max(age, await self.age(stream, info.ack_floor.stream_seq + 1))
        found = await bus.infos(self.js, base)
        held, room = sum(i.state.bytes for i in found), sum(max(i.config.max_bytes, 0) for i in found)
        BACKLOG.labels(base).set(backlog)
        BACKLOG_AGE.labels(base).set(age)
        FILL.labels(base).set(held / room if room else 0.0)

    async def age(self, stream: str, seq: int) -> float:
        """Seconds since the first record at or after `seq` was stored."""
        try:
            msg = await self.js.get_msg(stream, seq, next=True)
        except nats.js.errors.NotFoundError:
            return 0.0
        return max(0.0, time.time() - msg.time.timestamp()) if msg.time else 0.0

    async def trim(self, part: int | None) -> None:
        """Purges TB_RESULTS (of partition `part`) below the first record that is either not yet archived
        (past the consumer's ack floor) or younger than ENDS_KEEP: found by bisection on stored times."""
        stream = subjects.stream(subjects.RESULTS_STREAM, part)
        floor = (await self.js.consumer_info(stream, subjects.RECORDER_DURABLE)).ack_floor.stream_seq
        first = (await self.js.stream_info(stream)).state.first_seq
        cutoff = time.time() - subjects.ENDS_KEEP
        lo, hi = first, floor + 1                  # find the first seq in [first, floor] stored after cutoff
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                msg = await self.js.get_msg(stream, mid, next=True)
            except nats.js.errors.NotFoundError:
                hi = mid
                continue
            if msg.seq > floor or msg.time.timestamp() >= cutoff:
                hi = mid
            else:
                lo = msg.seq + 1
        if lo > first:
            await self.js.purge_stream(stream, seq=lo)
            TRIMMED.inc(lo - first)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.recorder", description="The tokenbus recorder.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--id", help="recorder id, a subject token (default rec-<pid>)")
    p.add_argument("--database", default=None, help=f"postgresql://… or sqlite:///path (default: "
                   f"${records.DATABASE_ENV}, else records.db in the stack's data dir)")
    p.add_argument("--archive", default=None, help=f"the request log's archive, a directory or an fsspec URL "
                   f"(default: ${records.ARCHIVE_ENV}, else archive/ in the stack's data dir)")
    p.add_argument("--archive-retention", type=float, default=subjects.LOG_MAX_AGE,
                   help=f"seconds the archive keeps a request (default {subjects.LOG_MAX_AGE:g}: 7 days)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve /metrics, /healthz (liveness) and /readyz "
                   "(readiness: 503 while starting or draining) on this port (default: none)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="the address /metrics binds (0.0.0.0 in a container)")
    lifecycle.add_arguments(p, health=False)
    return p


async def serve(args) -> None:
    db = Database.open(args.database or records.default_database())
    archive = Archive(args.archive or records.default_archive())
    name = subjects.token("recorder", args.id or f"rec-{os.getpid()}")
    tracing.setup("recorder", name, args.otlp_endpoint)
    life = Life("recorder", name, LOG.bind(recorder=name), args.drain_timeout, metrics=generate_latest)
    life.on_signals()
    await life.serve_probes(args.metrics_host, args.metrics_port)
    recorder = Recorder(await bus.connect(args.nats_url, "recorder", LOG), db, archive, args.archive_retention,
                        name, life)
    try:
        await recorder.run()
    finally:
        await bus.close(recorder.nc)
        await life.close()
        db.close()


def main(argv=None) -> None:
    bus.run(serve(parser().parse_args(argv)))

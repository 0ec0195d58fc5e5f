"""The recorder: usage and end records from the bus into a real PostgreSQL and into SQLite, upserted by
request id (a record delivered again changes nothing), acked only after the commit (a crash between the
commit and the ack writes nothing twice), in batches; held while the database is away, with the gateways
refusing new requests once the metering backlog is full, and recovering when it returns."""
import asyncio
import contextlib
import dataclasses
import sqlite3
import subprocess
import sys
import time

import psycopg
import pytest

import bus
import bus.streams
from lab.common.postgres import LocalPostgres
from schemas import subjects
from schemas.messages import Completion, SamplingParams, Usage, encode
from services.gateway.app import backed_up
from services.recorder import service
from services.recorder.archive import Archive
from services.recorder.service import Recorder
from services.recorder.store import MIGRATIONS, Database, Window


@pytest.fixture(scope="module")
def postgres():
    with LocalPostgres(fsync=False) as pg:
        yield pg


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'records.db'}"
        return
    pg = request.getfixturevalue("postgres")
    name = f"t{time.monotonic_ns()}"
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield pg.url.rsplit("/", 1)[0] + f"/{name}"


def usage(i: int, tenant: str = "acme", prompt: int = 10, completion: int = 5) -> Usage:
    return Usage(f"r{i}", tenant, "k1", "tiny", "chat", "stop", prompt + i, 2, completion, {"e2e_ms": 1.5},
                 1000.0 + i, 1001.0 + i, "rev1")


def end(i: int, tenant: str = "acme") -> Completion:
    return Completion(f"r{i}", tenant, "w0", SamplingParams(max_tokens=4, seed=i), [1, 2, 3], [4, 5, 6, 7], "length",
                      usage={"prompt_tokens": 3, "completion_tokens": 4}, created=time.time(), ended=time.time())


def test_migrations_make_the_schema_from_an_empty_database_once(db_url):
    db = Database.open(db_url)
    latest = max(int(p.name.split("_")[0]) for p in MIGRATIONS.glob("*.sql"))
    assert db.version() == latest
    assert db.count("usage") == db.count("requests") == 0
    db.close()
    again = Database.open(db_url)                  # a second recorder: nothing applied twice
    assert again.version() == latest
    assert again.run(lambda c: again.fetch(c, "SELECT count(*) FROM schema_migrations", []))[0][0] == latest
    again.close()


def test_upserts_keep_the_row_stored_first_and_sums_are_exact(db_url):
    db = Database.open(db_url)
    assert db.write([usage(i) for i in range(10)], [end(i) for i in range(3)]) == (10, 3)
    assert db.write([usage(i, prompt=999) for i in range(5, 15)], [end(i) for i in range(3)]) == (5, 0)
    assert db.count("usage") == 15 and db.count("requests") == 3
    assert db.usage(Window())[7] == usage(7)          # the first record of r7, not the second's 999 tokens
    [row] = db.sums(Window())
    assert row == {"tenant": "acme", "key_id": "k1", "model": "tiny", "revision": "rev1", "fallback": False,
                   "requests": 15, "prompt_tokens": sum(range(10, 20)) + sum(999 + i for i in range(10, 15)),
                   "cached_tokens": 30, "completion_tokens": 75}
    assert [u.id for u in db.usage(Window("acme", 1001.0 + 3, 1001.0 + 6))] == ["r3", "r4", "r5"]
    assert db.recorded(["r1", "r14", "r99"]) == {"r1", "r14"}
    db.close()


async def publish_usage(js, records: list[Usage]) -> None:
    acks = [js.publish(subjects.usage(u.tenant, u.id), encode(u), headers=subjects.msg_id(u.id)) for u in records]
    for i in range(0, len(acks), 500):
        await asyncio.gather(*acks[i:i + 500])


async def until(check, timeout: float = 30.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(every)
    raise AssertionError(f"not within {timeout} s")


CRASH_AFTER_COMMIT = """
import asyncio, os, sys
import bus
from services.recorder import service
from services.recorder.archive import Archive
from services.recorder.store import Database

class CrashAfterCommit(service.Recorder):
    def write_usage(self, records):
        super().write_usage(records)
        os._exit(137)                             # as a SIGKILL between the commit and the acks

async def main():
    service.BATCH = 300
    sys.modules["bus.streams"].RECORDER_ACK_WAIT = 2.0
    nc = await bus.connect(sys.argv[1], "test-crash")
    await CrashAfterCommit(nc, Database.open(sys.argv[2]), Archive(sys.argv[3])).run()

asyncio.run(main())
"""


@pytest.mark.timeout(120)
def test_a_crash_between_commit_and_ack_writes_nothing_twice_and_batches_are_bounded(nats_url, db_url, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setattr(sys.modules["bus.streams"], "RECORDER_ACK_WAIT", 2.0)   # the crashed batch back in 2 s
    monkeypatch.setattr(service, "BATCH", 300)
    records = [usage(i, tenant=("acme", "globex")[i % 2]) for i in range(1000)]

    async def publish():
        nc = await bus.connect(nats_url, "test-recorder")
        await bus.ensure_streams(nc.jetstream())                 # with the recorder's consumer, acks waited 2 s
        await publish_usage(nc.jetstream(), records)
        await nc.close()

    async def record():
        nc = await bus.connect(nats_url, "test-recorder")
        js = nc.jetstream()
        db = Database.open(db_url)
        task = asyncio.create_task(Recorder(nc, db, Archive(str(tmp_path / "archive"))).run())
        await until(lambda: empty(js))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nc.close()
        return db

    asyncio.run(publish())
    crash = subprocess.run([sys.executable, "-c", CRASH_AFTER_COMMIT, nats_url, db_url, str(tmp_path / "archive")],
                           capture_output=True, text=True, timeout=60)
    assert crash.returncode == 137, crash.stderr[-2000:]
    crashed = Database.open(db_url).count("usage")
    assert 0 < crashed <= 300                                    # one batch committed, none acked
    db = asyncio.run(record())
    assert db.count("usage") == 1000                             # each once: the crashed batch again changed nothing
    sums = {r["tenant"]: r for r in db.sums(Window())}
    for tenant in ("acme", "globex"):
        assert sums[tenant]["requests"] == 500
        assert sums[tenant]["prompt_tokens"] == sum(u.prompt_tokens for u in records if u.tenant == tenant)
    assert service.DUPLICATES.labels(subjects.USAGE_STREAM)._value.get() >= crashed
    batches = service.BATCHES.labels(subjects.USAGE_STREAM)
    assert batches._sum.get() >= 1000 and sum(b.get() for b in batches._buckets) >= 1000 / 300
    assert all(b.get() == 0 for bound, b in zip(batches._upper_bounds, batches._buckets) if bound > 500)
    db.close()


def bucket_counts(histogram) -> list[float]:
    return [b.get() for b in histogram._buckets]


async def stopped(task: asyncio.Task, db: Database, nc) -> None:
    """The recorder task cancelled, its database and connection closed."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    db.close()
    await nc.close()


async def empty(js) -> bool:
    """TB_USAGE holds nothing: every record was recorded and acked (interest retention removed it)."""
    return (await js.stream_info(subjects.USAGE_STREAM)).state.messages == 0


@pytest.mark.timeout(180)
def test_a_database_away_holds_the_batch_fills_the_backlog_refuses_and_recovers(nats_url, tmp_path):
    """PostgreSQL stopped: nothing is acked, TB_USAGE keeps every record, and once it is BACKLOG_FULL of its
    room the gateways' check says "metering backlog full"; PostgreSQL back: every record written once and
    the refusal lifted."""
    async def run(pg: LocalPostgres):
        nc = await bus.connect(nats_url, "test-recorder")
        js = nc.jetstream()
        await bus.ensure_streams(js, storage=200_000)            # TB_USAGE room: 30 kB, about 100 records
        room = (await js.stream_info(subjects.USAGE_STREAM)).config.max_bytes
        db = Database.open(pg.url)
        task = asyncio.create_task(Recorder(nc, db, Archive(str(tmp_path / "archive"))).run())
        await publish_usage(js, [usage(i) for i in range(20)])
        await until(lambda: asyncio.to_thread(lambda: db.count("usage") == 20))
        assert await backed_up(js) == ""
        await asyncio.to_thread(pg.stop, "immediate")
        stored, i = 20, 20
        while not await backed_up(js):
            try:
                await publish_usage(js, [usage(i)])
                stored += 1
            except Exception as e:                       # the stream full: refused, never an old record dropped
                assert "maximum bytes" in str(e).lower(), e
                break
            i += 1
        why = await until(lambda: backed_up(js))
        assert why.startswith("metering backlog full: TB_USAGE holds") and "max_bytes" in why
        assert (await js.stream_info(subjects.USAGE_STREAM)).state.bytes >= subjects.BACKLOG_FULL * room
        await asyncio.to_thread(pg.start)
        await until(lambda: empty(js), timeout=60)
        assert await backed_up(js) == ""
        assert db.count("usage") == stored and db.sums(Window())[0]["requests"] == stored
        assert service.ERRORS.labels(subjects.USAGE_STREAM)._value.get() > 0
        await stopped(task, db, nc)

    with LocalPostgres(fsync=False) as pg:
        asyncio.run(run(pg))


def test_the_embedded_database_is_a_plain_sqlite_file_any_sqlite_reads(tmp_path):
    db = Database.open(str(tmp_path / "records.db"))
    db.write([usage(1)], [end(1)])
    db.close()
    with sqlite3.connect(tmp_path / "records.db") as conn:          # the library's own reader, not ours
        assert conn.execute("SELECT request_id, prompt_tokens, fallback FROM usage").fetchall() == [("r1", 11, 0)]
        assert conn.execute("SELECT request_id, output_tokens FROM requests").fetchall() == [("r1", 4)]


def test_a_database_url_of_another_kind_is_refused_naming_it():
    with pytest.raises(ValueError, match="--database 'mysql://x': expected postgresql://"):
        Database.open("mysql://x")


@pytest.mark.timeout(120)
def test_a_record_postgresql_refuses_is_set_aside_and_the_rest_of_its_batch_written(nats_url, postgres, tmp_path):
    """A NUL in a text field: PostgreSQL refuses the batch, the recorder writes its records one by one and acks
    the one refused alone (an error line), so it never blocks the stream."""
    async def run():
        nc = await bus.connect(nats_url, "test-recorder")
        js = nc.jetstream()
        await bus.ensure_streams(js)
        bad = dataclasses.replace(usage(3), model="tiny\x00")
        await publish_usage(js, [usage(1), usage(2), bad, usage(4)])
        db = Database.open(postgres.url)
        refused = service.BAD.labels(subjects.USAGE_STREAM)._value.get()
        task = asyncio.create_task(Recorder(nc, db, Archive(str(tmp_path / "archive"))).run())
        await until(lambda: empty(js))
        assert sorted(u.id for u in db.usage(Window())) == ["r1", "r2", "r4"]
        assert service.BAD.labels(subjects.USAGE_STREAM)._value.get() == refused + 1
        await stopped(task, db, nc)

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_end_records_are_archived_then_trimmed_from_the_bus_past_ends_keep(nats_url, tmp_path, monkeypatch):
    """End records go to the archive and the requests table, are acked, and once older than ENDS_KEEP are purged
    from TB_RESULTS; the ones not yet that old stay there (a redelivered work item reads them)."""
    monkeypatch.setattr(subjects, "ENDS_KEEP", 3.0)
    monkeypatch.setattr(service, "RESULTS_LINGER", 0.05)

    async def run():
        nc = await bus.connect(nats_url, "test-recorder")
        js = nc.jetstream()
        await bus.ensure_streams(js)
        for i in range(10):
            await js.publish(subjects.done("acme", f"r{i}"), encode(end(i)), headers=subjects.msg_id(f"r{i}"))
        await asyncio.sleep(3.2)                                  # these ten are past ENDS_KEEP
        for i in range(10, 13):
            await js.publish(subjects.done("acme", f"r{i}"), encode(end(i)), headers=subjects.msg_id(f"r{i}"))
        db = Database.open(f"sqlite:///{tmp_path / 'records.db'}")
        archive = Archive(str(tmp_path / "archive"))
        recorder = Recorder(nc, db, archive)
        task = asyncio.create_task(recorder.run())
        await until(lambda: asyncio.to_thread(lambda: db.count("requests") == 13))
        await until(lambda: acked(js, 13))
        await recorder.trim(None)
        state = (await js.stream_info(subjects.RESULTS_STREAM)).state
        assert (state.first_seq, state.messages) == (11, 3)        # r0..r9 purged, r10..r12 kept
        assert sorted(c.id for c in archive.read()) == sorted(f"r{i}" for i in range(13))
        await stopped(task, db, nc)

    asyncio.run(run())


async def acked(js, n: int) -> bool:
    info = await js.consumer_info(subjects.RESULTS_STREAM, subjects.RECORDER_DURABLE)
    return info.ack_floor.stream_seq >= n

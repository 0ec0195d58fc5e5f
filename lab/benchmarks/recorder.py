"""`tokenbus bench-recorder`: how fast the recorder drains usage records from the bus into its database,
against the database's own ceiling for the same rows.

A nats-server and a PostgreSQL of its own (lab/common/postgres.py, fsync on) are started; N usage records
are published to TB_USAGE first (the recorder's consumer holds them: a backlog); then the recorder
(`python -m services.recorder`, as `tokenbus up` runs it) is started and timed until TB_USAGE is empty and
the database holds N rows. The baseline writes the same rows with the same upsert straight into a fresh
database (no bus, no acks, one process): the ratio is the share of the database's ceiling the recorder
keeps. Each process's CPU seconds are read from /proc. SQLite (the local stack's default) is measured the
same way with --database sqlite; --recorders 1 2 runs one recorder, then two on the same consumer.

Throughout, the recorder is the same code `tokenbus up` runs; nothing here is in its path."""
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import orjson

import bus
from lab.common.postgres import LocalPostgres
from ops import procs
from schemas import subjects
from schemas.messages import Usage, encode
from services.recorder.store import Database, Window

PUBLISH_WINDOW = 2000                    # publishes awaited together


def records(n: int, tenants: int = 100) -> list[Usage]:
    now = time.time()
    return [Usage(f"bench{i:09d}", f"tenant{i % tenants}", f"key{i % 7}", "llama-3-70b", "chat", "stop",
                  3000 + i % 50, 1024, 400, {"ttft_ms": 180.0, "e2e_ms": 9000.0, "queue_ms": 3.0}, now, now + 9,
                  "rev1") for i in range(n)]


async def publish(url: str, usage: list[Usage]) -> float:
    nc = await bus.connect(url, "bench-recorder")
    js = nc.jetstream()
    await bus.ensure_streams(js, storage=8 << 30)        # TB_USAGE: 1.2 GiB, room for the backlog
    t0 = time.perf_counter()
    for i in range(0, len(usage), PUBLISH_WINDOW):
        await asyncio.gather(*(js.publish(subjects.usage(u.tenant, u.id), encode(u), headers=subjects.msg_id(u.id))
                               for u in usage[i:i + PUBLISH_WINDOW]))
    took = time.perf_counter() - t0
    await nc.close()
    return took


async def backlog(url: str) -> int:
    nc = await bus.connect(url, "bench-recorder")
    try:
        return (await nc.jetstream().stream_info(subjects.USAGE_STREAM)).state.messages
    finally:
        await nc.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def postgres_cpu(pg: LocalPostgres) -> float:
    """The CPU seconds of every postgres process of the server (its backends included)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if b"postgres" in stat.read_bytes() and str(pg.port).encode() in Path(stat.parent, "cmdline").read_bytes():
                total += cpu_seconds(int(stat.parent.name))
    return total


def drain(url: str, database: str, n: int, work: Path, timeout: float, recorders: int) -> dict:
    """Starts `recorders` recorders on a backlog of n records; the seconds and CPU until TB_USAGE is empty."""
    log = work / "recorder.log"
    t0 = time.perf_counter()
    running = [procs.spawn(procs.python_module("services.recorder", "--nats-url", url, "--database", database,
                                               "--archive", str(work / "archive")), log, {}) for _ in range(recorders)]
    try:
        deadline = time.monotonic() + timeout
        while asyncio.run(backlog(url)) > 0:
            if any(p.poll() is not None for p in running) or time.monotonic() > deadline:
                raise RuntimeError(f"the recorders did not drain {n} records (see {log})")
            time.sleep(0.05)
        took = time.perf_counter() - t0
        cpu = sum(cpu_seconds(p.pid) for p in running)
    finally:
        procs.stop(running)
    db = Database.open(database)
    rows = db.sums(Window())
    db.close()
    stored = sum(r["requests"] for r in rows)
    if stored != n:
        raise RuntimeError(f"the database holds {stored} rows, not {n}")
    return {"seconds": took, "records_per_s": n / took, "recorder_cpu_s": cpu, "recorders": recorders}


def ceiling(database: str, usage: list[Usage], batch: int) -> float:
    """Records/s of the same upserts, in batches, straight into the database."""
    db = Database.open(database)
    db.version()
    t0 = time.perf_counter()
    for i in range(0, len(usage), batch):
        db.write(usage[i:i + batch], [])
    took = time.perf_counter() - t0
    db.close()
    return len(usage) / took


def run(kind: str, n: int, work: Path, timeout: float, recorders: int = 1) -> dict:
    from services.recorder.service import BATCH

    usage = records(n)
    work.mkdir(parents=True)
    nats_port = procs.free_port()
    nats = procs.start_nats(nats_port, work / "nats", work / "nats.log")
    url = f"nats://127.0.0.1:{nats_port}"
    pg = LocalPostgres().start() if kind == "postgresql" else None
    try:
        target = pg.url if pg else f"sqlite:///{work / 'records.db'}"
        published = asyncio.run(publish(url, usage))
        nats_cpu0, pg_cpu0 = cpu_seconds(nats.pid), postgres_cpu(pg) if pg else 0.0
        out = drain(url, target, n, work, timeout, recorders)
        out.update(nats_cpu_s=cpu_seconds(nats.pid) - nats_cpu0,
                   database_cpu_s=(postgres_cpu(pg) - pg_cpu0) if pg else None, publish_s=published)
        if pg:
            import psycopg

            with psycopg.connect(pg.url, autocommit=True) as conn:
                conn.execute("CREATE DATABASE ceiling")
            baseline = pg.url.rsplit("/", 1)[0] + "/ceiling"
        else:
            baseline = f"sqlite:///{work / 'ceiling.db'}"
        out["ceiling_records_per_s"] = ceiling(baseline, usage, BATCH)
        out["ratio"] = out["records_per_s"] / out["ceiling_records_per_s"]
        return {"database": kind, "records": n, **out}
    finally:
        if pg:
            pg.close()
        procs.stop([nats])


def table(rows: list[dict]) -> str:
    head = ["database", "recorders", "records", "recorder rec/s", "ceiling rec/s", "ratio", "recorder CPU ms/1k",
            "nats CPU ms/1k", "database CPU ms/1k"]
    body = [[r["database"], str(r["recorders"]), str(r["records"]), f"{r['records_per_s']:,.0f}",
             f"{r['ceiling_records_per_s']:,.0f}",
             f"{r['ratio']:.2f}", f"{1000 * r['recorder_cpu_s'] / r['records'] * 1000:.0f}",
             f"{1000 * r['nats_cpu_s'] / r['records'] * 1000:.0f}",
             "-" if r["database_cpu_s"] is None else f"{1000 * r['database_cpu_s'] / r['records'] * 1000:.0f}"]
            for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [head, *body])


def main(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="tokenbus-bench-recorder-"))
    try:
        rows = [run(kind, args.records, work / f"{kind}-{n}", args.timeout, n) for kind in args.database
                for n in args.recorders]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    print(table(rows), file=sys.stdout)

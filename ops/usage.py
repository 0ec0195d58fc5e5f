"""`tokenbus usage`: what each tenant used, summed per tenant, key, model and revision (the requests the
fallback upstream answered apart), as a table or JSON, or one tenant's requests of a period as CSV. It
reads the recorder's database and the tail of the metering log (TB_USAGE) not yet recorded there, which it
marks as such."""
import asyncio
import contextlib
import csv
import datetime
import re
import sys
import time

import nats.errors
import orjson
from nats.js import api

import bus
from ops import broker
from ops.args import nats_url
from schemas import records, subjects
from schemas.messages import Usage, decode
from schemas.wire import WireError
from services.recorder.store import Database, Window

SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
BATCH = 1000


def since(text: str) -> float:
    """Unix time of `text`: an age (90s, 30m, 24h, 7d) or an ISO date or date-time (UTC unless it says)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return time.time() - float(m.group(1)) * UNITS[m.group(2)]
    try:
        t = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: expected an age like 30m, 24h, 7d or a date like 2026-11-01") from None
    return (t if t.tzinfo else t.replace(tzinfo=datetime.UTC)).timestamp()


async def read(nats_url: str, tenant: str | None = None, start: float | None = None,
               partitions: int | None = None) -> list[Usage]:
    """The usage records on the bus (those no recorder has taken yet) of `tenant` (all tenants: None) stored
    since `start` (unix time)."""
    nc = await broker.connect(nats_url, "tokenbus-usage", role="usage")
    try:
        js = nc.jetstream()
        await bus.ensure_streams(js, partitions)
        records = []
        for part in subjects.parts(partitions):     # each partition's TB_USAGE on a partitioned bus
            records += await read_stream(js, subjects.stream(subjects.USAGE_STREAM, part),
                                         subjects.tenant_filters(subjects.USAGE_STREAM, tenant, part), start)
        return records
    finally:
        await nc.close()


async def read_stream(js, stream: str, filters: list[str], start: float | None) -> list[Usage]:
    config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0, filter_subjects=filters,
                                deliver_policy=api.DeliverPolicy.BY_START_TIME if start else api.DeliverPolicy.ALL,
                                opt_start_time=datetime.datetime.fromtimestamp(start, datetime.UTC) if start
                                else None)
    sub = await js.pull_subscribe(filters[0], stream=stream, config=config)
    records, pending = [], (await sub.consumer_info()).num_pending
    while pending:
        try:
            msgs = await sub.fetch(BATCH, timeout=5)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            break
        for msg in msgs:
            with contextlib.suppress(WireError):      # a bad record is skipped, not summed
                records.append(decode(msg.data, Usage))
        pending = msgs[-1].metadata.num_pending
    await sub.unsubscribe()
    return records


def summed(records: list[Usage]) -> list[dict]:
    """One row per (tenant, key, model, revision, fallback), with its sums."""
    return merged([{"tenant": u.tenant, "key_id": u.key_id, "model": u.model, "revision": u.revision,
                    "fallback": u.fallback, "requests": 1, "prompt_tokens": u.prompt_tokens,
                    "cached_tokens": u.cached_tokens, "completion_tokens": u.completion_tokens} for u in records])


def merged(parts: list[dict]) -> list[dict]:
    """Rows of the same (tenant, key, model, revision, fallback) summed into one, with total_tokens."""
    rows: dict[tuple, dict] = {}
    for p in parts:
        key = (p["tenant"], p["key_id"], p["model"], p["revision"], p["fallback"])
        row = rows.setdefault(key, {**dict(zip(("tenant", "key_id", "model", "revision", "fallback"), key)),
                                    **dict.fromkeys(SUMS, 0)})
        for k in SUMS[:-1]:
            row[k] += p[k]
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return sorted(rows.values(), key=lambda r: (r["tenant"], r["key_id"], r["model"], r["revision"], r["fallback"]))


def database(url: str) -> Database | None:
    """The recorder's database at `url`; None for an embedded one that was never written (no recorder ran)."""
    db = Database.open(url)
    return None if getattr(db, "path", None) is not None and not db.path.exists() else db


async def report(nats_url: str, url: str, window: Window,
                 partitions: int | None = None) -> tuple[list[dict], list[Usage]]:
    """The database's sums in the window, and the bus's records not yet in the database (the tail)."""
    return await from_database(nats_url, url, window, partitions, Database.sums)


async def requests(nats_url: str, url: str, window: Window, partitions: int | None = None) -> list[Usage]:
    """Every request's usage in the window: the database's rows and the tail's, once each, in the order finished."""
    stored, tail = await from_database(nats_url, url, window, partitions, Database.usage)
    return sorted(stored + tail, key=lambda u: (u.finished, u.id))


async def from_database(nats_url: str, url: str, window: Window, partitions: int | None, query) -> tuple[list, list]:
    """query(database, window)'s answer ([] without a database) and the bus's tail of records not in it."""
    tail = [u for u in await read(nats_url, window.tenant, window.since, partitions)
            if window.until is None or u.finished < window.until]
    db = database(url)
    if db is None:
        return [], tail
    try:
        recorded = await asyncio.to_thread(db.recorded, [u.id for u in tail])
        answer = await asyncio.to_thread(query, db, window)
    finally:
        db.close()
    return answer, [u for u in tail if u.id not in recorded]


CSV_FIELDS = ("request_id", "tenant", "key_id", "model", "revision", "fallback", "api", "finish_reason",
              "prompt_tokens", "cached_tokens", "completion_tokens", "created", "finished")


def write_csv(usage: list[Usage], out) -> None:
    w = csv.writer(out)
    w.writerow(CSV_FIELDS)
    for u in usage:
        w.writerow([u.id, u.tenant, u.key_id, u.model, u.revision, u.fallback, u.api, u.finish_reason,
                    u.prompt_tokens, u.cached_tokens, u.completion_tokens, iso(u.created), iso(u.finished)])


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


def as_json(rows: list[dict], tail: list[dict] | None = None) -> dict:
    """{"rows", "total"} and, of them, what is only on the bus so far ("unrecorded", with the same sums)."""
    out = {"rows": rows, "total": {k: sum(r[k] for r in rows) for k in SUMS}}
    if tail is not None:
        out["unrecorded"] = {k: sum(r[k] for r in tail) for k in SUMS}
    return out


def table(rows: list[dict]) -> str:
    if not rows:
        return "no usage recorded"
    head = ["tenant", "key", "model", "revision", "served", "requests", "prompt", "cached", "completion", "total"]
    body = [[r["tenant"], r["key_id"] or "-", r["model"], r["revision"] or "-",
             "fallback" if r["fallback"] else "cluster", *(str(r[k]) for k in SUMS)] for r in rows]
    total = as_json(rows)["total"]
    body.append(["total", "", "", "", "", *(str(total[k]) for k in SUMS)])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i >= 5 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in [head, *body])


def main(args) -> None:
    start = since(args.since) if args.since else None
    until = since(args.until) if args.until else None
    if args.tenant:
        subjects.token("tenant", args.tenant)
    window, url = Window(args.tenant, start, until), args.database or records.default_database()
    if args.csv:
        if not args.tenant:
            raise ValueError("--csv exports one tenant's requests: give --tenant")
        usage = asyncio.run(requests(args.nats_url, url, window))
        if args.csv == "-":
            write_csv(usage, sys.stdout)
        else:
            with open(args.csv, "w", newline="") as f:
                write_csv(usage, f)
            print(f"exported {len(usage)} requests of {args.tenant} to {args.csv}")
        return
    stored, tail = asyncio.run(report(args.nats_url, url, window))
    unrecorded = summed(tail)
    rows = merged([*stored, *unrecorded])
    if args.json:
        print(orjson.dumps(as_json(rows, unrecorded)).decode())
        return
    print(table(rows))
    if tail:
        n = len(tail)
        print(f"({n} request{'s' * (n != 1)} above not yet in the database: read from the bus's TB_USAGE)")


def register(sub) -> None:
    us = sub.add_parser("usage", help="what each tenant used, summed per key, model and revision, the requests "
                                      "the fallback upstream answered apart; or one tenant's requests as CSV")
    nats_url(us)
    us.add_argument("--database", help=f"the recorder's database, postgresql://… or sqlite:///path (default: "
                    f"${records.DATABASE_ENV}, else records.db in $TOKENBUS_HOME/data)")
    us.add_argument("--tenant", help="only this tenant")
    us.add_argument("--since", help="only requests finished since an age (30m, 24h, 7d) or a date (2026-11-01, UTC)")
    us.add_argument("--until", help="only requests finished before an age or a date")
    us.add_argument("--json", action="store_true", help="print JSON instead of a table")
    us.add_argument("--csv", metavar="FILE", help="write the tenant's requests (--tenant) as CSV to FILE (- : stdout)")
    us.set_defaults(func=main)

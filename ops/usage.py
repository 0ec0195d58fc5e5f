"""`tokenbus usage`: the metering log (TB_USAGE, one record per finished request) summed per tenant, key,
model and revision, the requests the fallback upstream answered apart, as a table or as JSON."""
import asyncio
import contextlib
import datetime
import re
import time

import nats.errors
import orjson
from nats.js import api

import bus
from ops import broker
from ops.args import nats_url
from schemas import subjects
from schemas.messages import Usage, decode
from schemas.wire import WireError

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


async def read(nats_url: str, tenant: str | None = None, start: float | None = None) -> list[Usage]:
    """The usage records of `tenant` (all tenants: None) stored since `start` (unix time)."""
    nc = await broker.connect(nats_url, "tokenbus-usage", role="usage")
    try:
        js = nc.jetstream()
        await bus.ensure_streams(js)
        records = []
        for part in subjects.parts():               # each partition's TB_USAGE on a partitioned bus
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
    rows: dict[tuple, dict] = {}
    for u in records:
        row = rows.setdefault((u.tenant, u.key_id, u.model, u.revision, u.fallback), {
            "tenant": u.tenant, "key_id": u.key_id, "model": u.model, "revision": u.revision, "fallback": u.fallback,
            **dict.fromkeys(SUMS, 0)})
        row["requests"] += 1
        row["prompt_tokens"] += u.prompt_tokens
        row["cached_tokens"] += u.cached_tokens
        row["completion_tokens"] += u.completion_tokens
        row["total_tokens"] += u.prompt_tokens + u.completion_tokens
    return sorted(rows.values(), key=lambda r: (r["tenant"], r["key_id"], r["model"], r["revision"], r["fallback"]))


def as_json(rows: list[dict]) -> dict:
    return {"rows": rows, "total": {k: sum(r[k] for r in rows) for k in SUMS}}


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
    if args.tenant:
        subjects.token("tenant", args.tenant)
    rows = summed(asyncio.run(read(args.nats_url, args.tenant, start)))
    print(orjson.dumps(as_json(rows)).decode() if args.json else table(rows))


def register(sub) -> None:
    us = sub.add_parser("usage", help="the metering log summed per tenant, key, model and revision, the requests "
                                      "the fallback upstream answered apart")
    nats_url(us)
    us.add_argument("--tenant", help="only this tenant")
    us.add_argument("--since", help="only requests since an age (30m, 24h, 7d) or a date (2026-11-01, UTC)")
    us.add_argument("--json", action="store_true", help="print JSON instead of a table")
    us.set_defaults(func=main)

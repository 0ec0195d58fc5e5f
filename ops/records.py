"""The completions log (stream TB_RESULTS, and past the bus's hour the recorder's Parquet archive): every
finished request with its prompt tokens, sampling (the seed the tokenizer drew included), outputs, usage
and timings. Selecting a window of it, and `tokenbus log export FILE` / `tokenbus log import FILE` to move
a window between stacks as JSON lines."""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import nats.js.errors
import orjson
from nats.js import api

import bus
from ops import args as options
from ops import broker
from schemas import subjects
from schemas.messages import Completion, decode, encode, from_obj, to_obj
from schemas.wire import WireError

if TYPE_CHECKING:                         # pyarrow: imported only by the commands that read the archive
    from services.recorder.archive import Archive

REPLAY_PREFIX = "replay-"                # the request ids of replays: never selected themselves
READ_TIMEOUT = 5.0
DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
LAST_SPANS = (3600, 86400, 7 * 86400, None)   # seconds back the archive is read for the last N, until N are found


def parse_time(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """An ISO 8601 time (UTC unless it names a zone) or a duration back from now: 90s, 15m, 2h, 7d."""
    now = now or dt.datetime.now(dt.UTC)
    m = DURATION.fullmatch(text.strip())
    if m:
        return now - dt.timedelta(seconds=float(m[1]) * UNITS[m[2]])
    try:
        t = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since: {text!r} is neither an ISO time (2025-06-01T12:00:00Z) nor a duration "
                         "(90s, 15m, 2h, 7d)") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def selected(rec: Completion, request_id: str | None) -> bool:
    """A record asked for by its id; else a request that ran (not one that ended in an error) and is not
    a replay."""
    if request_id is not None:
        return rec.id == request_id
    return not rec.id.startswith(REPLAY_PREFIX) and rec.finish_reason != "error"


async def select(js, last: int | None = None, since: dt.datetime | None = None,
                 request_id: str | None = None, archive: Archive | None = None) -> list[Completion]:
    """Records of TB_RESULTS in log order: the last N, those stored since a time, the one of a request
    id, or all. Replays (ids starting with replay-) are left out unless asked for by id. On a partitioned
    bus each partition's are read and put in the order the requests were created. With an archive, its
    records of the window (created since the time) join them, each request once (the stream's copy wins),
    in the order the requests were created; the last N are counted after."""
    parts = subjects.parts()
    out = []
    for part in parts:
        stream = subjects.stream(subjects.RESULTS_STREAM, part)
        if last is not None:
            out += await last_records(js, last, stream)
        else:
            out += [rec async for rec in scan(js, since, stream) if selected(rec, request_id)]
    if archive is not None:
        out = merged(out, await asyncio.to_thread(archived, archive, last, since, request_id))
    elif len(parts) > 1:
        out.sort(key=lambda rec: rec.created)
    return out[-last:] if last is not None and last > 0 else out


def archived(archive: Archive, last: int | None, since: dt.datetime | None,
             request_id: str | None) -> list[Completion]:
    """The archive's records of the window, selected as the stream's are; the last N read from the
    latest hour back, further until N are found."""
    if last is None:
        recs = archive.read(since=since.timestamp() if since else None, request_id=request_id)
        return [rec for rec in recs if selected(rec, request_id)]
    if last <= 0:
        return []
    for back in LAST_SPANS:
        recs = [rec for rec in archive.read(since=None if back is None else time.time() - back) if selected(rec, None)]
        if len(recs) >= last or back is None:
            return recs[-last:]
    return []


def merged(live: list[Completion], old: list[Completion]) -> list[Completion]:
    """Each request once, the stream's record of it kept, by created."""
    ids = {rec.id for rec in live}
    return sorted(live + [rec for rec in old if rec.id not in ids], key=lambda rec: rec.created)


def open_archive(url: str | None) -> Archive | None:
    """The archive at a directory or fsspec URL (None: none); a missing one holds no records."""
    if not url:
        return None
    from services.recorder.archive import Archive  # pyarrow takes a quarter second to import
    return Archive(url)


async def last_records(js, n: int, stream: str = subjects.RESULTS_STREAM) -> list[Completion]:
    """Walks the stream back from its last message until n records (replays skipped)."""
    state = (await js.stream_info(stream)).state
    out, seq = [], state.last_seq
    while len(out) < n and seq >= max(state.first_seq, 1):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            rec = record((await js.get_msg(stream, seq)).data)
            if rec is not None and selected(rec, None):
                out.append(rec)
        seq -= 1
    return out[::-1]


async def scan(js, since: dt.datetime | None = None, stream: str = subjects.RESULTS_STREAM):
    """Every record from the start (or from `since`) to the stream's end as it was when called."""
    info = await js.stream_info(stream)
    if info.state.messages == 0:
        return
    if since is not None and await stored_before(js, stream, info.state.last_seq, since):
        return                                   # nothing was stored since
    config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=since) \
        if since else None
    sub = await js.subscribe(info.config.subjects[0], stream=stream, ordered_consumer=True, config=config)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_TIMEOUT)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return                           # nothing since `since`
            rec = record(msg.data)
            if rec is not None:
                yield rec
            if msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= info.state.last_seq:
                return
    finally:
        await sub.unsubscribe()


async def stored_before(js, stream: str, seq: int, since: dt.datetime) -> bool:
    try:
        return (await js.get_msg(stream, seq)).time < since
    except nats.js.errors.NotFoundError:
        return False


def record(data: bytes) -> Completion | None:
    try:
        return decode(data, Completion)
    except WireError:
        return None


# -- export / import ------------------------------------------------------------------------------

def dumps(rec: Completion) -> bytes:
    return orjson.dumps(to_obj(rec)) + b"\n"


def loads(path: Path) -> list[Completion]:
    """The records in a JSON-lines file; ValueError naming the line of a bad one."""
    out = []
    for i, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(from_obj(orjson.loads(line), Completion))
        except (orjson.JSONDecodeError, WireError) as e:
            raise ValueError(f"{path}:{i}: not a completion record: {e}") from None
    return out


async def export(nats_url: str, path: Path, **window) -> int:
    nc = await broker.connect(nats_url, "tokenbus-log", role="log")
    try:
        records = await select(nc.jetstream(), **window)
    finally:
        await nc.close()
    Path(path).write_bytes(b"".join(map(dumps, records)))
    return len(records)


async def import_(nats_url: str, path: Path) -> int:
    """Stores the file's records in TB_RESULTS under their own request ids (a record already stored
    within the duplicate window is not stored twice)."""
    records = loads(path)
    nc = await broker.connect(nats_url, "tokenbus-log", role="log")
    try:
        js = nc.jetstream()
        await bus.ensure_streams(js)
        for rec in records:
            await js.publish(subjects.done(rec.tenant, rec.id), encode(rec), headers=subjects.msg_id(rec.id))
    finally:
        await bus.close(nc)
    return len(records)


def window(args) -> dict:
    """The --last / --since / --request-id / --archive arguments as select()'s keywords."""
    return {"last": args.last, "since": parse_time(args.since) if args.since else None,
            "request_id": args.request_id, "archive": open_archive(getattr(args, "archive", None))}


def main(args) -> None:
    if args.action == "export":
        n = asyncio.run(export(args.nats_url, args.file, **window(args)))
        print(f"exported {n} records to {args.file}")
    else:
        n = asyncio.run(import_(args.nats_url, args.file))
        print(f"imported {n} records from {args.file} into {subjects.RESULTS_STREAM}")


def register(sub) -> None:
    lg = sub.add_parser("log", help="move a window of the completions log between stacks (JSON lines)")
    lsub = lg.add_subparsers(dest="action", required=True)
    e = lsub.add_parser("export", help="write records of TB_RESULTS and the archive to FILE (default: all)")
    e.add_argument("file", help="the JSON-lines file to write")
    options.window(e)
    options.archive(e)
    options.nats_url(e)
    im = lsub.add_parser("import", help="store the records of FILE in TB_RESULTS")
    im.add_argument("file", help="a file written by `tokenbus log export`")
    options.nats_url(im)
    lg.set_defaults(func=main)

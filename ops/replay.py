"""`tokenbus replay`: re-submits logged requests through the live stack and compares each result
with its logged completion.

A record of TB_RESULTS holds the prompt's token ids and the sampling parameters with the seed the
tokenizer drew, so the replay is the same request: it is published to tb.req.new.<tenant> (as the
gateway publishes) under a fresh id `replay-…` and read back from tb.out.<id>. Sampling is a pure
function of (seed, position), so a healthy stack reproduces every token; the first position that
differs points at what changed (engine, kernels, model, dtype). A request that was aborted (client
cancel, or a stop string found by the gateway) is replayed up to the tokens it had."""
import asyncio
import dataclasses
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import orjson

import bus
from ops import broker, records
from ops.args import archive, nats_url, window
from ops.tokenizer import load_tokenizer
from schemas import subjects
from schemas.messages import (
    Cancel,
    Completion,
    ErrorChunk,
    FinalChunk,
    GenerateRequest,
    TokenChunk,
    decode,
    encode,
)
from schemas.wire import WireError

DEFAULT_LAST = 10                        # records replayed when no window is given
TEXT_CONTEXT = 6                         # tokens shown before the first difference in the table


@dataclass(slots=True)
class Replay:
    record: Completion
    id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def expected(self) -> list[int]:
        return self.record.output_token_ids

    async def on_msg(self, msg) -> None:
        try:
            chunk = decode(msg.data, TokenChunk, FinalChunk, ErrorChunk)
        except WireError as e:
            self.end(error=f"bad chunk: {e}")
            return
        if type(chunk) is ErrorChunk:
            self.end(error=f"{chunk.code}: {chunk.message}")
            return
        self.tokens[chunk.offset:chunk.offset + len(chunk.token_ids)] = chunk.token_ids   # duplicates overwrite
        if type(chunk) is FinalChunk:
            self.end(finish_reason=chunk.finish_reason)

    def end(self, finish_reason: str | None = None, error: str | None = None) -> None:
        self.finish_reason, self.error = finish_reason, error
        self.done.set()


def request(rec: Completion, rid: str) -> GenerateRequest:
    """The logged request again: its prompt tokens, its sampling with its seed. An aborted request is
    replayed for the tokens it had (what came after the abort was never decided)."""
    sampling = rec.sampling
    if rec.finish_reason == "abort":
        sampling = dataclasses.replace(sampling, max_tokens=len(rec.output_token_ids))
    return GenerateRequest(rid, rec.tenant, sampling, prompt_token_ids=rec.prompt_token_ids, created=time.time())


def replayable(rec: Completion) -> bool:
    return rec.finish_reason != "abort" or len(rec.output_token_ids) > 0


async def run_one(nc, js, rec: Completion, timeout: float) -> Replay:
    r = Replay(rec, f"{records.REPLAY_PREFIX}{uuid.uuid4().hex}")
    sub = await nc.subscribe(subjects.out(r.id), cb=r.on_msg)
    try:
        await js.publish(subjects.request_new(rec.tenant, r.id), encode(request(rec, r.id)),
                         headers=subjects.msg_id(r.id))
        await asyncio.wait_for(r.done.wait(), timeout)
    except (nats.errors.Error, asyncio.TimeoutError) as e:
        r.end(error=f"no result within {timeout:.0f} s" if isinstance(e, asyncio.TimeoutError) else str(e))
        await nc.publish(subjects.cancel(r.id), encode(Cancel(r.id)))
    finally:
        await sub.unsubscribe()
    return r


async def replay(nats_url: str, recs: list[Completion], timeout: float, concurrency: int) -> list[Replay]:
    nc = await broker.connect(nats_url, "tokenbus-replay", role="replay")
    js, gate = nc.jetstream(), asyncio.Semaphore(concurrency)

    async def one(rec):
        async with gate:
            return await run_one(nc, js, rec, timeout)

    try:
        return await asyncio.gather(*(one(rec) for rec in recs))
    finally:
        await bus.close(nc)


# -- the comparison -----------------------------------------------------------------------------------

def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one is a prefix of the
    other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(replays: list[Replay], skipped: int, tokenizer) -> dict:
    def text(ids):
        return tokenizer.decode(ids) if tokenizer else None

    diffs, identical = [], 0
    for r in replays:
        base = {"request_id": r.record.id, "replay_id": r.id, "tenant": r.record.tenant}
        if r.error is not None:
            diffs.append({**base, "error": r.error, "position": None})
            continue
        pos = first_difference(r.expected, r.tokens)
        if pos is None:
            identical += 1
            continue
        diffs.append({**base, "position": pos, "logged_text": text(r.expected), "replayed_text": text(r.tokens),
                      "logged_tokens": len(r.expected), "replayed_tokens": len(r.tokens),
                      "logged_token": at(r.expected, pos), "replayed_token": at(r.tokens, pos),
                      "logged_context": text(r.expected[max(0, pos - TEXT_CONTEXT):pos + TEXT_CONTEXT]),
                      "replayed_context": text(r.tokens[max(0, pos - TEXT_CONTEXT):pos + TEXT_CONTEXT]),
                      "logged_finish_reason": r.record.finish_reason, "replayed_finish_reason": r.finish_reason})
    return {"replayed": len(replays), "identical": identical, "skipped": skipped, "diffs": diffs}


def at(ids: list[int], i: int) -> int | None:
    return ids[i] if i < len(ids) else None


def table(result: dict, replays: list[Replay]) -> str:
    by_id = {d["request_id"]: d for d in result["diffs"]}
    rows = [("request", "result", "position", "logged", "replayed")]
    for r in replays:
        d = by_id.get(r.record.id)
        if d is None:
            rows.append((r.record.id, "identical", "", f"{len(r.expected)} tokens", ""))
        elif d["position"] is None:
            rows.append((r.record.id, "failed", "", d["error"], ""))
        else:
            rows.append((r.record.id, "differs", str(d["position"]), shown(d, "logged"), shown(d, "replayed")))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in rows]
    failed = sum(d["position"] is None for d in result["diffs"])
    lines.append(f"{result['replayed']} replayed: {result['identical']} identical, "
                 f"{len(result['diffs']) - failed} differing, {failed} failed"
                 + (f"; {result['skipped']} skipped (aborted before any token)" if result["skipped"] else ""))
    return "\n".join(line.rstrip() for line in lines)


def shown(diff: dict, side: str) -> str:
    """The text around the first difference, or the token id there when no tokenizer is at hand."""
    text = diff[f"{side}_context"]
    return repr(text) if text is not None else f"token {diff[f'{side}_token']}"


async def chosen(args) -> list[Completion]:
    if args.file:
        return records.loads(Path(args.file))
    nc = await broker.connect(args.nats_url, "tokenbus-replay", role="replay")
    try:
        return await records.select(nc.jetstream(), **records.window(args))
    finally:
        await nc.close()


def main(args) -> int:
    """Prints the table (or the JSON) and returns the exit status: 0 when every replay was identical."""
    if not (args.last or args.since or args.request_id or args.file):
        args.last = DEFAULT_LAST
    recs = asyncio.run(chosen(args))
    todo = [r for r in recs if replayable(r)]
    replays = asyncio.run(replay(args.nats_url, todo, args.timeout, args.concurrency))
    result = report(replays, len(recs) - len(todo), load_tokenizer(args.model, build=False))
    print(orjson.dumps(result).decode() if args.json else table(result, replays))
    return 0 if not result["diffs"] else 1


def register(sub) -> None:
    r = sub.add_parser("replay", help="re-run logged requests through the live stack and diff the outputs")
    window(r, file=True)
    archive(r)
    r.add_argument("--json", action="store_true", help='print {"replayed": N, "identical": M, "diffs": [...]}')
    r.add_argument("--model", help="checkpoint whose tokenizer shows the texts (default: the tiny model if built)")
    r.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each replayed request")
    r.add_argument("--concurrency", type=int, default=16, help="replayed requests in flight at once")
    nats_url(r)
    r.set_defaults(func=lambda args: sys.exit(main(args)))

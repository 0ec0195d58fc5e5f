"""`tokenbus inspect SUBJECT`: watches a subject (wildcards allowed) or reads a stream from a point,
decodes every payload with schemas/ and prints it: one readable line per message (subject, headers,
size, the decoded fields, token chunks with their text) or one JSON object per line (--json). A
payload that does not decode is printed as such, with the reason and its first bytes."""
import asyncio
import sys

import nats.errors
import orjson
from nats.js import api

from ops import broker
from ops.args import nats_url
from ops.records import parse_time
from ops.tokenizer import load_tokenizer
from schemas.messages import Completion, FinalChunk, GenerateRequest, TokenChunk, decode
from schemas.wire import WireError, to_dict

PREVIEW_BYTES = 48
SHOWN_IDS = 8                            # items shown of a long list in the readable form
SHOWN_CHARS = 80                         # characters shown of a long string
STREAM_IDLE = 2.0                        # seconds without a message that end a stream read (not --follow)


def describe(msg, tokenizer=None, stream: bool = False) -> dict:
    """What one NATS message holds, as a JSON-able dict."""
    out = {"subject": msg.subject, "headers": dict(msg.headers or {}), "size": len(msg.data)}
    if stream:
        out["seq"] = msg.metadata.sequence.stream
        out["time"] = msg.metadata.timestamp.isoformat() if msg.metadata.timestamp else None
    try:
        m = decode(msg.data)
    except WireError as e:
        return {**out, "error": "empty payload" if not msg.data else str(e), "payload": msg.data[:PREVIEW_BYTES].hex()}
    out |= {"type": m.TYPE, "message": to_dict(m)}
    text = text_of(m, tokenizer)
    if text is not None:
        out["text"] = text
    return out


def text_of(m, tokenizer) -> str | None:
    """The text a message carries: a chunk's tokens, a completion's output, a request's prompt."""
    if isinstance(m, TokenChunk | FinalChunk):
        return tokenizer.decode(m.token_ids) if tokenizer else None
    if isinstance(m, Completion):
        return tokenizer.decode(m.output_token_ids) if tokenizer else None
    if isinstance(m, GenerateRequest):
        return m.prompt if m.prompt is not None else None
    return None


def line(d: dict) -> str:
    """The readable form: subject (seq) size [headers] type field=value ... text=..."""
    head = d["subject"] + (f" #{d['seq']}" if "seq" in d else "") + f" {d['size']} B"
    if d["headers"]:
        head += " [" + " ".join(f"{k}={v}" for k, v in d["headers"].items()) + "]"
    if "error" in d:
        return f"{head} UNDECODABLE ({d['error']}) payload={d['payload']}"
    fields = " ".join(f"{k}={short(v)}" for k, v in d["message"].items() if v not in (None, [], {}, ""))
    text = f" text={d['text']!r}" if "text" in d else ""
    return f"{head} {d['type']} {fields}{text}"


def short(v) -> str:
    """A field's value, long strings and lists cut (the JSON form keeps everything)."""
    if isinstance(v, str):
        return repr(v if len(v) <= SHOWN_CHARS else v[:SHOWN_CHARS] + "…")
    if isinstance(v, list | tuple):
        more = f", … ({len(v)})" if len(v) > SHOWN_IDS else ""
        return "[" + ", ".join(map(short, v[:SHOWN_IDS])) + more + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {short(x)}" for k, x in v.items() if x not in (None, [], ())) + "}"
    return str(v)


def start(point: str | None) -> dict:
    """--from as consumer settings: new, last, a stream sequence, an ISO time or a duration back."""
    if point is None:
        return {"deliver_policy": api.DeliverPolicy.ALL}
    if point in ("new", "last"):
        return {"deliver_policy": api.DeliverPolicy(point)}
    if point.isdigit():
        return {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": int(point)}
    return {"deliver_policy": api.DeliverPolicy.BY_START_TIME, "opt_start_time": parse_time(point)}


async def watch(args, emit) -> int:
    """Feeds every message to emit until --count of them; returns how many."""
    nc = await broker.connect(args.nats_url, "tokenbus-inspect", role="inspect")
    queue: asyncio.Queue = asyncio.Queue()
    try:
        if args.stream:
            sub = await nc.jetstream().subscribe(args.subject, stream=args.stream, ordered_consumer=True,
                                                 config=api.ConsumerConfig(**start(args.start)), cb=queue.put)
        else:
            sub = await nc.subscribe(args.subject, cb=queue.put)
        await nc.flush()
        print(f"inspect: {'reading ' + args.stream + ' ' if args.stream else 'watching '}{args.subject} "
              f"on {args.nats_url}", file=sys.stderr, flush=True)
        n = 0
        while args.count is None or n < args.count:
            idle = STREAM_IDLE if args.stream and not args.follow else None
            try:
                msg = await asyncio.wait_for(queue.get(), idle)
            except asyncio.TimeoutError:
                break                            # the stream has nothing more
            emit(msg)
            n += 1
            if args.stream and not args.follow and msg.metadata.num_pending == 0:
                break
        await sub.unsubscribe()
        return n
    finally:
        await nc.close()


def main(args) -> None:
    tokenizer = load_tokenizer(args.model, build=False)

    def emit(msg) -> None:
        d = describe(msg, tokenizer, bool(args.stream))
        print(orjson.dumps(d).decode() if args.json else line(d), flush=True)

    try:
        asyncio.run(watch(args, emit))
    except KeyboardInterrupt:
        pass
    except nats.errors.Error as e:
        raise ValueError(f"inspect: {e}") from None


def register(sub) -> None:
    i = sub.add_parser("inspect", help="watch a subject, or read a stream, with every payload decoded")
    i.add_argument("subject", help="a subject, wildcards allowed (tb.out.*, tb.>, $KV.tb_workers.>)")
    i.add_argument("--count", type=int, metavar="N", help="stop after N messages")
    i.add_argument("--json", action="store_true", help="one JSON object per message")
    i.add_argument("--stream", metavar="NAME", help="read this stream (TB_REQUESTS, TB_RESULTS, ...) instead")
    i.add_argument("--from", dest="start", metavar="POINT",
                   help="with --stream: new, last, a sequence, an ISO time or a duration back (default: the start)")
    i.add_argument("--follow", action="store_true", help="with --stream: keep reading new messages")
    i.add_argument("--model", help="checkpoint whose tokenizer shows chunks as text (default: the tiny model if built)")
    nats_url(i)
    i.set_defaults(func=main)

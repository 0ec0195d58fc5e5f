"""The HTTP API's answers: a completion as one JSON object, or as server-sent events (EventStream), one
`data:` line per chunk, every chunk already queued written in one go; each event's `id:` is its
resume point (request id, request-log sequence, output tokens so far). Logprobs in OpenAI's shapes."""
import asyncio
import base64
import os

import orjson
from starlette.responses import Response
from tokenizers import Tokenizer

from services.gateway import errors, frames, tools
from services.gateway.http_parse import Call
from services.gateway.owners import Exchange, leave
from services.gateway.session import Gateway
from services.gateway.stream import Request
from text.detokenizer import token_bytes

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def json(obj: dict, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")


def usage(r: Request) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.received,
            "total_tokens": r.prompt_tokens + r.received, "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def usage_so_far(r: Request, offset: int) -> dict:
    """continuous_usage_stats: the counts after the first `offset` output tokens."""
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": offset, "total_tokens": r.prompt_tokens + offset}


def whole(call: Call, r: Request, got: list[dict], gw: Gateway) -> dict:
    """The non-streaming answer."""
    return answer(call, [choice(call, r, 0, got)], usage(r))


def choice(call: Call, r: Request, index: int, got: list[dict], head: str = "") -> dict:
    """One choice of a non-streaming answer from its frames (head: the text before them, an echoed prompt)."""
    deltas = [f for f in got if f["type"] == "delta"]
    text = head + "".join(f["text"] for f in deltas)
    out = {"index": index, "finish_reason": got[-1]["finish_reason"], "logprobs": None}
    if call.logprobs:
        out["logprobs"] = logprobs(call, deltas, r.tokenizer)
    if call.api == "chat" and call.tools is not None:
        out["message"], called = tools.message(call.tools, text)
        if called and out["finish_reason"] == "stop":
            out["finish_reason"] = "tool_calls"
    elif call.api == "chat":
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    return out


def answer(call: Call, choices: list[dict], usage_: dict) -> dict:
    return {"id": call.id, "object": "chat.completion" if call.api == "chat" else "text_completion",
            "created": call.created, "model": call.model, "system_fingerprint": call.fingerprint, "choices": choices,
            "usage": usage_}


def chunk(call: Call, choices: list, usage_: dict | None = None) -> bytes:
    """The JSON of one streamed chunk (usage_: the final usage, or the usage so far when continuous)."""
    c = {"id": call.id, "object": "chat.completion.chunk" if call.api == "chat" else "text_completion",
         "created": call.created, "model": call.model, "system_fingerprint": call.fingerprint, "choices": choices}
    if call.include_usage:
        c["usage"] = usage_
    if not (call.obfuscation and choices):
        return orjson.dumps(c)
    c["obfuscation"] = ""
    n = len(orjson.dumps(c))
    c["obfuscation"] = pad(-n % OBFUSCATION_BLOCK or OBFUSCATION_BLOCK)
    return orjson.dumps(c)


OBFUSCATION_BLOCK = 64      # include_obfuscation pads a chunk to a multiple of this many bytes, 1 to 64 more


def pad(n: int) -> str:
    """n random URL-safe characters."""
    return base64.urlsafe_b64encode(os.urandom(n)).decode()[:n]


def event(data: bytes, eid: bytes) -> bytes:
    """One server-sent event; eid (its resume point) b"" while the request is not stored yet."""
    return (b"id: " + eid + b"\n" if eid else b"") + b"data: " + data + b"\n\n"


def point(r: Request, offset: int) -> bytes:
    """The resume point after `offset` output tokens: the id of the events that bring the stream there."""
    return f"{frames.resume_id(r.rid, r.seq)}.{offset}".encode() if r.seq else b""


def delta_choice(call: Call, text: str, lp: dict | None = None, finish: str | None = None, role: bool = False) -> dict:
    if call.api == "chat":
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text or lp else {})
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}


def sse(call: Call, r: Request, f: dict, gw: Gateway, offset: int, ts: tools.ToolStream | None = None) -> list[bytes]:
    """The data of the events of one frame, which brings the output to `offset` tokens (ts: the answer's tool
    calls, found as its text comes)."""
    so_far = usage_so_far(r, offset) if call.continuous_usage else None
    if f["type"] == "delta":
        lp = logprobs(call, [f], r.tokenizer) if call.logprobs else None
        if ts is not None:
            return [chunk(call, [{"index": 0, "delta": d, "logprobs": lp, "finish_reason": None}], so_far)
                    for d in ts.feed(f["text"])]
        return [chunk(call, [delta_choice(call, f["text"], lp)], so_far)]
    if f["type"] == "error":
        return [orjson.dumps(errors.from_pipeline(f["code"], f["message"]).body())]
    out = [] if ts is None else [chunk(call, [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}],
                                       so_far) for d in ts.finish()]
    finish = "tool_calls" if ts is not None and ts.called and f["finish_reason"] == "stop" else f["finish_reason"]
    out.append(chunk(call, [delta_choice(call, "", None, finish)], so_far))
    if call.include_usage:
        out.append(chunk(call, [], usage(r)))
    return [*out, b"[DONE]"]


async def events(ex: Exchange, call: Call, r: Request, first: dict):
    """The stream's bytes: each time, every frame queued so far (a resumed stream has no role chunk)."""
    gw, offset = ex.gw, r.replay
    role = call.api == "chat" and not r.resumed
    so_far = usage_so_far(r, 0) if call.continuous_usage else None
    out = [event(chunk(call, [delta_choice(call, "", role=True)], so_far), point(r, 0))] if role else []
    ts = tools.ToolStream(call.tools) if call.tools is not None else None
    pending = [first]
    while True:
        for f in pending:
            offset += len(f.get("token_ids", ()))
            eid = point(r, offset)
            out += [event(data, eid) for data in sse(call, r, f, gw, offset, ts)]
        yield b"".join(out)
        if pending[-1]["type"] in ("done", "error"):
            return
        out, pending = [], [await ex.frames.get()]
        while not ex.frames.empty():
            pending.append(ex.frames.get_nowait())


class EventStream:
    """An SSE response that ends the request when the client leaves (uvicorn tells only a reader of
    `receive`, and a held request may not send anything for a long time)."""

    def __init__(self, chunks, ex: Exchange):
        self.chunks, self.ex = chunks, ex

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        pump, gone = asyncio.ensure_future(self.pump(send)), asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                self.ex.log.error("stream failed", error=repr(pump.exception()))
        finally:
            dropped = gone.done()                 # the client left: it may resume (Last-Event-ID)
            pump.cancel()
            gone.cancel()
            await leave(self.ex, dropped)

    async def pump(self, send) -> None:
        async for data in self.chunks:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# -- logprobs -------------------------------------------------------------------------------------

def logprobs(call: Call, deltas: list[dict], tokenizer: Tokenizer) -> dict:
    """OpenAI's logprobs object for the tokens of these delta frames, in the request's model's tokenizer."""
    entries = []
    for f in deltas:
        if "logprobs" in f:
            lp, skip = f["logprobs"]
            entries += zip(f["token_ids"], lp.logprob[skip:], lp.top_ids[skip:], lp.top_logprobs[skip:])
    def piece(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    def entry(t: int, v: float) -> dict:
        return {"token": piece(t), "logprob": v, "bytes": list(token_bytes(tokenizer, t))}

    if call.api == "chat":
        return {"content": [{**entry(t, v), "top_logprobs": [entry(i, w) for i, w in zip(ids, vals)]}
                            for t, v, ids, vals in entries]}
    tokens = [piece(t) for t, *_ in entries]
    offsets = [0]
    for s in tokens[:-1]:
        offsets.append(offsets[-1] + len(s))
    return {"tokens": tokens, "token_logprobs": [v for _, v, _, _ in entries],
            "top_logprobs": [{piece(i): w for i, w in zip(ids, vals)} for _, _, ids, vals in entries],
            "text_offset": offsets[:len(tokens)]}

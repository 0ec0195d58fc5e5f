"""The OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}].

A request is checked (key, body size, JSON, fields, admission) before anything is published; the
response starts only when the pipeline's first chunk or error arrives, so an error of the tokenizer
or worker (a prompt over the context) still gets its own status. Streams are server-sent events,
one `data:` line per chunk, every chunk already queued written in one go; each event's `id:` is its
resume point (request id, request-log sequence, output tokens so far), and a POST with that id in
Last-Event-ID resumes the stream from there, on any gateway (the body is not needed). A request the
cluster cannot take may be answered by the fallback upstream instead (fallback.py): its response, in
the same format, is marked `x-tokenbus-fallback: 1`."""
import asyncio
import base64
import os
import re
import time
import uuid
from dataclasses import dataclass

import httpx
import orjson
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from tokenizers import Tokenizer

from schemas.detokenizer import token_bytes
from schemas.messages import GenerateRequest
from schemas.served import SEPARATOR
from schemas.subjects import MAX_BODY_BYTES
from services.gateway import errors, frames
from services.gateway.errors import ApiError
from services.gateway.fallback import Forward
from services.gateway.frames import FrameError
from services.gateway.models import Model, Revision
from services.gateway.session import Exchange, Gateway, Request, leave

EXTENSIONS = {"ignore_eos", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "speculative"}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}     # vLLM's structured-output extensions -> SamplingParams' fields
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# OpenAI's fields that change nothing a completion says: checked for their type, then ignored (docs/api.md)
IGNORED = {"store": (frames.is_bool, "true or false"), "metadata": (lambda v: isinstance(v, dict), "an object"),
           "service_tier": (frames.is_str, "a string"), "parallel_tool_calls": (frames.is_bool, "true or false"),
           "tool_choice": (lambda v: v == "none", '"none" (tools are not implemented)')}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs", "presence_penalty",
          "frequency_penalty", "logit_bias", "user", "stream", "stream_options", "priority", *EXTENSIONS, *IGNORED,
          "response_format", *GUIDED}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
FIELDS = {"chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs"}, "completions": COMMON | {"prompt"}}
ROLES = ("system", "developer", "user", "assistant")
MAX_LOGPROBS = 20
COMPLETIONS_MAX_TOKENS = 16                       # OpenAI's default for /v1/completions
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
FALLBACK_HEADER = ("x-tokenbus-fallback", "1")       # on every response the fallback upstream answered


@dataclass(slots=True)
class Call:
    """A checked HTTP request: what to run and how to answer."""
    api: str                                      # chat | completions
    req: GenerateRequest
    stream: bool
    include_usage: bool                           # a last chunk with the usage
    continuous_usage: bool                        # vLLM's continuous_usage_stats: the usage so far in every chunk
    obfuscation: bool                             # OpenAI's include_obfuscation: chunks padded to hide their size
    logprobs: bool
    id: str                                       # chatcmpl-… or cmpl-…
    created: int
    model: str
    fingerprint: str | None = None                # the served revision (OpenAI's system_fingerprint)


class Disconnected(Exception):
    pass


# -- handlers -------------------------------------------------------------------------------------

async def chat_completions(request: HttpRequest):
    return await complete(request, "chat")


async def completions(request: HttpRequest):
    return await complete(request, "completions")


async def models(request: HttpRequest) -> Response:
    gw: Gateway = request.app.state.gateway
    key, name = None, request.path_params.get("model")
    try:
        key = gw.authorize(request.headers, request.query_params)
        if name is not None:
            model, rev = gw.models.find(name)
    except ApiError as e:
        return refused(gw, key, e)
    created = request.app.state.started
    if name is not None:
        return json(card(model, created, rev if SEPARATOR in name else None))
    return json({"object": "list", "data": [card(m, created) for m in gw.models.by_name.values()]})


def card(model: Model, created: int, pinned: Revision | None = None) -> dict:
    """A model's entry: OpenAI's fields, its revision (the stable one's, or the one pinned) and every revision
    with the share of the name's requests it answers."""
    canaries = sum(r.share for r in model.revisions[1:])
    shares = [{"revision": r.revision, "share": round(r.share or 1 - canaries, 6)} for r in model.revisions]
    rev = pinned or model.revisions[0]
    return {"id": model.name if pinned is None else f"{model.name}{SEPARATOR}{rev.revision}", "object": "model",
            "created": created, "owned_by": "tokenbus", "revision": rev.revision, "revisions": shares}


def refused(gw: Gateway, key, e: ApiError) -> Response:
    """The refusal's response, counted by its code in tokenbus_request_errors_total (tenant "-" before a key
    was accepted)."""
    gw.metrics.error(key.tenant if key is not None else "-", e.code or str(e.status))
    return e.response()


async def complete(request: HttpRequest, api: str):
    gw: Gateway = request.app.state.gateway
    t0, ex, key = time.perf_counter(), Exchange(gw), None
    try:
        key = gw.authorize(request.headers, request.query_params)
        last = request.headers.get("last-event-id")
        if last is None:
            b = await body(request)
            call = parse(api, b, gw)
            try:
                r = await gw.start(ex, "http", call.req, await gw.admit(key, call.req, priority(b)), api, t0,
                                   call.stream)
            except ApiError as e:
                if not gw.falls_back(key, e):
                    raise
                return await forward(request, await gw.fall_back(key, call.req, api, e, t0, priority(b)), call, b)
        else:
            call, r = await resume(request, api, gw, ex, key, last, t0)
        first = await watching(request, ex.frames.get())
        if first["type"] == "error" and r.unstored and gw.falls_back(key, e := errors.from_pipeline(
                first["code"], first["message"])):           # never stored: it may still go elsewhere
            gw.spawn(gw.publish_cancel(r.rid, "abort"))       # in case its acknowledgement was what got lost
            return await forward(request, await gw.fall_back(key, call.req, api, e, t0, priority(b)), call, b)
    except ApiError as e:
        return refused(gw, key, e)
    except Disconnected:
        await abort(ex)
        return Response(status_code=499)
    if first["type"] == "error":
        return errors.from_pipeline(first["code"], first["message"]).response()
    if call.stream:
        return EventStream(events(ex, call, r, first), ex)
    try:
        got = [first] if first["type"] == "done" else [first, *await watching(request, rest(ex))]
    except Disconnected:
        await abort(ex)
        return Response(status_code=499)
    if got[-1]["type"] == "error":
        return errors.from_pipeline(got[-1]["code"], got[-1]["message"]).response()
    return json(whole(call, r, got, gw))


async def body(request: HttpRequest, optional: bool = False) -> dict:
    """The JSON object in the body ({} for none if optional); 413 past MAX_BODY_BYTES (read no further), 400
    if not a JSON object."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise too_large(int(size))
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > MAX_BODY_BYTES:
            raise too_large(len(data))
    if optional and not data.strip():
        return {}
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, got {frames.kind(obj)}", "invalid_json")
    return obj


async def resume(request: HttpRequest, api: str, gw: Gateway, ex: Exchange, key, last: str,
                 t0: float) -> tuple[Call, Request]:
    """The stream a Last-Event-ID names, resumed after that event. Only stream_options is read from the
    body, if there is one (a client retrying its call sends it again)."""
    try:
        rid, seq, offset = frames.event_point(last)
    except FrameError as e:
        raise bad(str(e), "Last-Event-ID") from None
    opts = stream_options(await body(request, optional=True), True)
    req = await gw.find(key, rid, seq, offset, api)
    r = await gw.resume(ex, "http", key, req, seq, offset, t0)
    prefix = "chatcmpl-" if api == "chat" else "cmpl-"
    return Call(api, req, True, *opts, req.sampling.logprobs is not None, prefix + rid, int(req.created),
                r.model, r.revision or None), r


def priority(b: dict) -> int | None:
    """The body's priority (vLLM's extension: lower runs first); None: the key's."""
    try:
        return frames.priority(b)
    except FrameError as e:
        raise bad(str(e), "priority") from None


def too_large(n: int) -> ApiError:
    return ApiError(413, f"the request body has {n} bytes or more; MAX_BODY_BYTES={MAX_BODY_BYTES}", "body_too_large")


async def watching(request: HttpRequest, coro):
    """coro's result, or Disconnected if the client leaves first."""
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(disconnect(request))
    await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():
        work.cancel()
        raise Disconnected
    return work.result()


async def disconnect(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def rest(ex: Exchange) -> list[dict]:
    got = []
    while not got or got[-1]["type"] not in ("done", "error"):
        got.append(await ex.frames.get())
    return got


async def abort(ex: Exchange) -> None:
    for r in list(ex.inflight.values()):
        await r.abort()


# -- the fallback ---------------------------------------------------------------------------------

async def forward(request: HttpRequest, f: Forward, call: Call, b: dict) -> Response:
    """The request answered by the fallback upstream: its JSON, or its stream (Relay)."""
    up = f.upstream
    try:
        resp = await watching(request, up.send(f, call.api, up.body(b, f.model, call.req.sampling.max_tokens,
                                                                    call.stream)))
        if call.stream:
            return Relay(f, resp, call)
        try:
            data = await watching(request, resp.aread())
            obj = orjson.loads(data)
        except (httpx.HTTPError, orjson.JSONDecodeError) as e:
            f.failed()
            raise f.unavailable(f"its answer was cut or not JSON: {type(e).__name__}: {e}") from None
        finally:
            await resp.aclose()
    except Disconnected:
        f.end("aborted")
        raise
    except ApiError:
        f.end()
        raise
    f.take(obj)
    f.end()
    return Response(data, 200, dict([FALLBACK_HEADER]), media_type="application/json")


class Relay:
    """The upstream's event stream as the client's, event by event: its usage chunk (asked for, to meter it)
    only if the client asked too; an error event if the stream breaks or outlasts the request timeout. The
    client leaving closes the upstream's stream."""

    def __init__(self, f: Forward, resp: httpx.Response, call: Call):
        self.f, self.resp, self.call, self.done = f, resp, call, False

    async def __call__(self, scope, receive, send) -> None:
        marked = tuple(map(str.encode, FALLBACK_HEADER))
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, marked]})
        pump, gone = asyncio.ensure_future(self.pump(send)), asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                self.f.gw.log.error("fallback stream failed", request_id=self.f.rid, error=repr(pump.exception()))
        finally:
            pump.cancel()
            gone.cancel()
            await self.resp.aclose()
            self.f.end("aborted" if gone.done() and not pump.done() else None)

    async def pump(self, send) -> None:
        f = self.f
        left = f.gw.request_timeout - (time.perf_counter() - f.t0)
        try:
            async with asyncio.timeout(left):
                async for line in self.resp.aiter_lines():
                    data = self.event(line)
                    if data:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
            why = None if self.done else "the stream ended before [DONE]"
        except (httpx.HTTPError, TimeoutError) as e:
            why = f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError) else (
                f"the request did not finish within --request-timeout={f.gw.request_timeout:g} s")
        if why is not None:
            f.failed()
            err = ApiError(502, f"the fallback upstream's stream broke: {why}", "fallback_failed")
            await send({"type": "http.response.body", "body": event(orjson.dumps(err.body()), b""), "more_body": True})
        f.end()                                   # settled and metered before the client sees the end
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def event(self, line: str) -> bytes | None:
        """What the client gets of one line of the upstream's stream (None: nothing)."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return event(b"[DONE]", b"")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        if "error" in obj:
            self.f.failed()
            return event(data.encode(), b"")
        self.f.take(obj)
        if self.call.include_usage:
            return event(data.encode(), b"")
        if not obj.get("choices") and obj.get("usage") is not None:
            return None                           # the usage chunk the gateway asked for, not the client
        obj.pop("usage", None)
        return event(orjson.dumps(obj), b"")


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# -- parsing --------------------------------------------------------------------------------------

def parse(api: str, b: dict, gw: Gateway) -> Call:
    b = {k: v for k, v in b.items() if v is not None}           # null means "not given"
    extra = sorted(b.keys() - FIELDS[api])
    if extra:
        raise bad(f"{extra[0][:40]}: unknown or unsupported parameter", extra[0][:40])
    model = b.get("model")
    if not isinstance(model, str):
        raise bad("model: required, a string", "model")
    gw.models.find(model)                                     # 404 for a model or revision not served, first
    for name, (ok, want) in IGNORED.items():
        if name in b and not ok(b[name]):
            raise bad(f"{name}: expected {want}, got {frames.show(b[name])}", name)
    if b.get("n", 1) != 1 or frames.is_bool(b.get("n")):
        raise bad(f"n: only n=1 is supported (got {frames.show(b['n'])})", "n")
    stream = flag(b, "stream")
    opts = stream_options(b, stream)
    fields, top = sampling_fields(api, b, gw)
    prompt = messages(b.get("messages")) if api == "chat" else dict([completion_prompt(b.get("prompt"))])
    try:
        req = frames.request({"id": "http", **fields, **prompt}, uuid.uuid4().hex, "default")
    except FrameError as e:
        raise bad(str(e), param_of(str(e))) from None
    req.sampling.logprobs = top
    gw.choose(req, model)
    prefix = "chatcmpl-" if api == "chat" else "cmpl-"
    return Call(api, req, stream, *opts, top is not None, prefix + req.id, int(req.created), model,
                gw.served(req)[1].revision or None)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


def param_of(message: str) -> str | None:
    m = re.match(r"([a-z_]+)", message)
    return m.group(1) if m else None


def flag(b: dict, name: str) -> bool:
    v = b.get(name, False)
    if not frames.is_bool(v):
        raise bad(f"{name}: expected true or false, got {frames.kind(v)}", name)
    return v


def stream_options(b: dict, stream: bool) -> tuple[bool, bool, bool]:
    """(include_usage, continuous usage, obfuscation). continuous_usage_stats needs include_usage, as vLLM's."""
    opts = b.get("stream_options")
    if opts is None:
        return False, False, False
    if not stream:
        raise bad("stream_options: only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad(f"stream_options: expected an object, got {frames.kind(opts)}", "stream_options")
    extra = sorted(opts.keys() - STREAM_OPTIONS)
    if extra:
        raise bad(f"stream_options.{extra[0][:40]}: unknown option (known: {', '.join(sorted(STREAM_OPTIONS))})",
                  "stream_options")
    try:
        include, continuous, pad = (flag({k: v for k, v in opts.items() if v is not None}, name)
                                    for name in ("include_usage", "continuous_usage_stats", "include_obfuscation"))
    except ApiError as e:
        raise bad(f"stream_options.{e.message}", "stream_options") from None
    return include, include and continuous, pad


def sampling_fields(api: str, b: dict, gw: Gateway) -> tuple[dict, int | None]:
    """The SamplingParams fields of the body (the websocket protocol's names), and the number of top
    logprobs wanted (None: no logprobs)."""
    fields = {k: b[k] for k in frames.SAMPLING if k in b}
    fields |= {field: b[name] for name, field in GUIDED.items() if name in b} | response_format(b)
    default = gw.max_tokens if api == "chat" else COMPLETIONS_MAX_TOKENS
    fields["max_tokens"] = b.get("max_completion_tokens", b.get("max_tokens", default))
    if api == "chat":
        want = flag(b, "logprobs")
        top = b.get("top_logprobs")
        if top is not None and not want:
            raise bad("top_logprobs: needs logprobs: true", "top_logprobs")
        n = top if top is not None else 0
        name = "top_logprobs"
    else:
        n = b.get("logprobs")
        want, name = n is not None, "logprobs"
    if not want:
        return fields, None
    if not frames.is_int(n) or not 0 <= n <= MAX_LOGPROBS:
        raise bad(f"{name}: must be an integer in [0, {MAX_LOGPROBS}] (got {frames.show(n)})", name)
    return fields, n


def response_format(b: dict) -> dict:
    """The SamplingParams field of OpenAI's response_format (json_schema's `strict` is accepted: the schema is
    always enforced)."""
    f = b.get("response_format")
    if f is None:
        return {}
    if not isinstance(f, dict) or f.get("type") not in RESPONSE_FORMATS:
        raise bad(f"response_format.type: must be one of {', '.join(RESPONSE_FORMATS)} (got "
                  f"{frames.show(f.get('type') if isinstance(f, dict) else f)})", "response_format")
    if f["type"] != "json_schema":
        return {"json_object": True} if f["type"] == "json_object" else {}
    spec = f.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("response_format.json_schema: expected an object with a schema object", "response_format")
    if not frames.is_bool(spec.get("strict", False)):
        raise bad(f"response_format.json_schema.strict: expected true or false, got {frames.kind(spec['strict'])}",
                  "response_format")
    return {"json_schema": spec.get("schema", {"type": "object"})}


def messages(v) -> dict:
    """The chat messages with text content; content parts of type text are joined."""
    if not isinstance(v, list) or not v:
        raise bad(f"messages: required, a non-empty array of {{role, content}} objects (got {frames.kind(v)})",
                  "messages")
    out = []
    for i, m in enumerate(v[:frames.MAX_MESSAGES + 1]):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]: expected an object, got {frames.kind(m)}", "messages")
        extra = sorted(m.keys() - {"role", "content", "name"})
        if extra:
            raise bad(f"messages[{i}].{extra[0][:40]}: not supported", "messages")
        if not isinstance(m.get("name", ""), str):
            raise bad(f"messages[{i}].name: expected a string, got {frames.kind(m['name'])}", "messages")
        if m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role: must be one of {', '.join(ROLES)} (got {frames.show(m.get('role'))})",
                      "messages")
        out.append({"role": m["role"], "content": content(m.get("content"), i)})
    return {"messages": out}


def content(c, i: int) -> str:
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad(f"messages[{i}].content: expected a string or an array of text parts, got {frames.kind(c)}",
                  "messages")
    texts = []
    for j, part in enumerate(c):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"messages[{i}].content[{j}]: only {{\"type\": \"text\", \"text\": ...}} parts are supported",
                      "messages")
        texts.append(part["text"])
    return "".join(texts)


def completion_prompt(p) -> tuple[str, object]:
    """("prompt", text) or ("prompt_token_ids", ids): one prompt per request."""
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str):
        return "prompt", p
    if isinstance(p, list) and p and frames.is_ints(p):
        return "prompt_token_ids", p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise bad(f"prompt: one prompt per request (got {len(p)})", "prompt")
    raise bad(f"prompt: required, a string, an array of token ids, or an array of one of those (got {frames.kind(p)})",
              "prompt")


# -- answering ------------------------------------------------------------------------------------

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
    text = "".join(f["text"] for f in got if f["type"] == "delta")
    choice = {"index": 0, "finish_reason": got[-1]["finish_reason"], "logprobs": None}
    if call.logprobs:
        choice["logprobs"] = logprobs(call, [f for f in got if f["type"] == "delta"], r.tokenizer)
    if call.api == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": call.id, "object": "chat.completion" if call.api == "chat" else "text_completion",
            "created": call.created, "model": call.model, "system_fingerprint": call.fingerprint, "choices": [choice],
            "usage": usage(r)}


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


def sse(call: Call, r: Request, f: dict, gw: Gateway, offset: int) -> list[bytes]:
    """The data of the events of one frame, which brings the output to `offset` tokens."""
    so_far = usage_so_far(r, offset) if call.continuous_usage else None
    if f["type"] == "delta":
        lp = logprobs(call, [f], r.tokenizer) if call.logprobs else None
        return [chunk(call, [delta_choice(call, f["text"], lp)], so_far)]
    if f["type"] == "error":
        return [orjson.dumps(errors.from_pipeline(f["code"], f["message"]).body())]
    out = [chunk(call, [delta_choice(call, "", None, f["finish_reason"])], so_far)]
    if call.include_usage:
        out.append(chunk(call, [], usage(r)))
    return [*out, b"[DONE]"]


async def events(ex: Exchange, call: Call, r: Request, first: dict):
    """The stream's bytes: each time, every frame queued so far (a resumed stream has no role chunk)."""
    gw, offset = ex.gw, r.replay
    role = call.api == "chat" and not r.resumed
    so_far = usage_so_far(r, 0) if call.continuous_usage else None
    out = [event(chunk(call, [delta_choice(call, "", role=True)], so_far), point(r, 0))] if role else []
    pending = [first]
    while True:
        for f in pending:
            offset += len(f.get("token_ids", ()))
            eid = point(r, offset)
            out += [event(data, eid) for data in sse(call, r, f, gw, offset)]
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
        pump, gone = asyncio.ensure_future(self.pump(send)), asyncio.ensure_future(self.gone(receive))
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

    async def gone(self, receive) -> None:
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


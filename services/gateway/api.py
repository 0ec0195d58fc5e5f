"""The OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}].

A request is checked (key, body size, JSON, fields, admission) before anything is published; the
response starts only when the pipeline's first chunk or error arrives, so an error of the tokenizer
or worker (a prompt over the context) still gets its own status. This module holds the handlers; the
body is checked in http_parse.py and answered by http_answer.py (JSON or server-sent events). Each
event's `id:` is its resume point, and a POST with that id in Last-Event-ID resumes the stream from
there, on any gateway (the body is not needed). A request the cluster cannot take may be answered by
the fallback upstream instead (fallback.py, relayed by http_relay.py): its response, in the same
format, is marked `x-tokenbus-fallback: 1`."""
import asyncio
import time

import httpx
import orjson
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from schemas.served import SEPARATOR
from schemas.subjects import MAX_BODY_BYTES
from services.gateway import errors, frames, http_many
from services.gateway.errors import ApiError
from services.gateway.fallback import Forward
from services.gateway.frames import FrameError
from services.gateway.http_answer import EventStream, disconnected, events, json, whole
from services.gateway.http_parse import Call, bad, parse, stream_options
from services.gateway.http_relay import FALLBACK_HEADER, Relay
from services.gateway.models import Model, Revision
from services.gateway.owners import Exchange
from services.gateway.session import Gateway
from services.gateway.stream import Request


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
    """A model's entry: OpenAI's fields, its revision (the stable one's, or the one pinned), every revision with
    the share of the name's requests it answers, and the revision's sampling defaults (what a request leaves unset
    runs with)."""
    canaries = sum(r.share for r in model.revisions[1:])
    shares = [{"revision": r.revision, "share": round(r.share or 1 - canaries, 6)} for r in model.revisions]
    rev = pinned or model.revisions[0]
    return {"id": model.name if pinned is None else f"{model.name}{SEPARATOR}{rev.revision}", "object": "model",
            "created": created, "owned_by": "tokenbus", "revision": rev.revision, "revisions": shares,
            "sampling_defaults": rev.sampling}


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
            if len(call.choices) > 1 or call.echo:
                return await several(request, call, gw, key, priority(b), t0)
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
    got = await to_the_end(request, ex, first)
    if isinstance(got, Response):
        return got
    return json(whole(call, r, got, gw))


async def several(request: HttpRequest, call: Call, gw: Gateway, key, prio: int | None, t0: float) -> Response:
    """A request of several choices (http_many.py): it answers once every choice's first frame has come, so an
    error of the pipeline gets its own status; then it streams, or gathers every choice."""
    ex = Exchange(gw)
    try:
        rs = await http_many.start(ex, call, gw, key, prio, t0)
        got: dict[int, list[dict]] = {i: [] for i in range(len(rs))}
        first = []
        while not all(got.values()):
            f = await watching(request, ex.frames.get())
            got[int(f["id"] or 0)].append(f)
            first.append(f)
            if f["type"] == "error":
                await abort(ex)
                return errors.from_pipeline(f["code"], f["message"]).response()
        if call.stream:
            return http_many.stream(ex, call, rs, first)
        got = await watching(request, http_many.gather(ex, len(rs), got))
    except Disconnected:
        await abort(ex)
        return Response(status_code=499)
    return http_many.whole(call, rs, got)


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
    req, headers = await gw.find(key, rid, seq, offset, api)
    r = await gw.resume(ex, "http", key, req, seq, offset, t0, headers)
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
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected(request.receive))
    await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():
        work.cancel()
        raise Disconnected
    return work.result()


async def to_the_end(request: HttpRequest, ex: Exchange, first: dict) -> list[dict] | Response:
    """Every frame of a non-streamed answer from `first`; instead, a 499 if the client leaves (its request
    aborted) or the pipeline's error as its response."""
    try:
        got = [first] if first["type"] == "done" else [first, *await watching(request, rest(ex))]
    except Disconnected:
        await abort(ex)
        return Response(status_code=499)
    if got[-1]["type"] == "error":
        return errors.from_pipeline(got[-1]["code"], got[-1]["message"]).response()
    return got


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


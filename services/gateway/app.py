"""The gateway's ASGI app, served by uvicorn: the websocket chat protocol at /ws, the OpenAI-compatible
HTTP API at /v1/* (its OpenAPI document at /openapi.json), the web chat page at /, /healthz (and /health,
vLLM's name) and /metrics (Prometheus text)."""
import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import nats.errors
import nats.js.errors
import orjson
import uvicorn
from nats.js.kv import KV_DEL, KV_PURGE
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState

import bus
from bus import lifecycle, tracing
from bus.lifecycle import Life
from bus.log import configure
from schemas import generation, served, subjects
from schemas.messages import Heartbeat, decode
from schemas.subjects import MAX_HEADER_BYTES, MAX_HEADERS
from schemas.wire import WireError
from services.gateway import api, http_tokens, keys, openapi, responses
from services.gateway.errors import ApiError
from services.gateway.fallback import COOLDOWN, FAILURES, KEY_ENV, Upstream
from services.gateway.limits import Limits
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.models import Models
from services.gateway.owners import Connection
from services.gateway.session import Gateway
from text import toolcalls

PAGE = Path(__file__).with_name("chat.html")
SHUTDOWN_GRACE = 5.0                     # seconds open streams get to finish when the gateway stops (SIGINT)
DRAIN_POLL = 0.1                         # seconds between a draining gateway's looks at its websockets


def create_app(nats_url: str, model_dir: str | None, api_keys: str | None = None,
               max_tokens: int = subjects.MAX_TOKENS, model_name: str | None = None,
               request_timeout: float = subjects.REQUEST_DEADLINE, resume_grace: float = subjects.RESUME_GRACE,
               models_file: str | None = None, upstream: Upstream | None = None,
               tool_parser: str | None = None, generation_config: str = "auto",
               drain_timeout: float = subjects.DRAIN_TIMEOUT) -> Starlette:
    """The app of one model (model_dir, served as model_name) or of every model of a served models file;
    ValueError (naming the file and the key) for a bad keys, models or generation config file. upstream: the
    fallback, if any. generation_config: where the models' sampling defaults come from (schemas/generation.py)."""
    key_table = keys.load(api_keys) if api_keys else None
    models = Models(served.load(models_file), tool_parser, generation_config) if models_file else \
        Models.one(model_dir, model_name, tool_parser, generation_config)
    model = models.default
    default = models.by_name[model].revisions[0]
    gateway_id = uuid.uuid4().hex[:12]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        log = configure("gateway")
        life = app.state.life = Life("gateway", gateway_id, log, drain_timeout)
        nc = await bus.connect(nats_url, "gateway", log)
        loops, gw = [], None
        try:
            js = nc.jetstream()
            await bus.ensure_streams(js)
            gw = app.state.gateway = Gateway(nc, js, await bus.registry(js), default.tokenizer, log, model,
                                             default.max_model_len, max_tokens, key_table,
                                             request_timeout=request_timeout,
                                             resume_grace=resume_grace, models=models, upstream=upstream,
                                             id=gateway_id, life=life)
            gw.limits = Limits(await bus.limits(js), await bus.gateways(js), gw.id, log, gw.metrics)
            gw.admission.bucket = gw.limits.lease
            await gw.limits.beat()                           # N counted before the first lease is drawn
            if upstream is not None:
                upstream.open(request_timeout)
                gw.metrics.watch(upstream.breaker)
            await nc.subscribe(subjects.ROUTER_STATS_ALL, cb=gw.metrics.on_router_stats)
            await nc.subscribe(subjects.PROGRESS_ALL, cb=gw.on_progress)
            await nc.subscribe(subjects.RESUMED_ALL, cb=gw.on_resumed)
            known = asyncio.Event()
            await life.listen(nc)
            loops = [asyncio.create_task(watch(gw, known)), asyncio.create_task(gw.sweep()),
                     asyncio.create_task(gw.limits.run()), asyncio.create_task(backlog(gw)),
                     asyncio.create_task(draining(app, gw))]
            with contextlib.suppress(TimeoutError):         # admission starts knowing the registered workers
                await asyncio.wait_for(known.wait(), 5)
            app.state.started = int(time.time())
            app.state.openapi = orjson.dumps(openapi.document(list(models.by_name), max_tokens))
            app.state.page = PAGE.read_text()
            log.info("gateway ready", nats=nats_url, model=model_dir, models=models.ids(), api_keys=api_keys,
                     fallback=upstream.url if upstream else None, sampling_defaults=default.sampling)
            if key_table is None:
                log.warning("no API keys: one tenant, no authentication, loopback only")
            life.ready = True
            yield
        finally:
            for task in loops:
                task.cancel()
            if upstream is not None:
                await upstream.close()
            if gw is not None and gw.limits is not None:
                await gw.limits.close()                     # the leases back to the shared buckets
            if gw is not None:
                await life.left(len(gw.requests))
            await bus.close(nc)
            log.info("gateway stopped")

    routes = [Route("/", page), Route("/healthz", healthz), Route("/health", healthz), Route("/livez", livez),
              Route("/readyz", readyz), Route("/metrics", metrics),
              Route("/openapi.json", openapi_json), Route("/v1/models", api.models),
              Route("/v1/models/{model:path}", api.models),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/responses", responses.create, methods=["POST"]),
              Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET", "DELETE"]),
              Route("/tokenize", http_tokens.tokenize, methods=["POST"]),
              Route("/detokenize", http_tokens.detokenize, methods=["POST"]), WebSocketRoute("/ws", chat)]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(HeaderLimit), Middleware(Draining)],
                     exception_handlers={HTTPException: http_error, Exception: server_error})


BACKLOG_SECONDS = 1.0                    # between looks at the record streams' fill


async def backlog(gw: Gateway) -> None:
    """Keeps admission's `backlog` current: why the records that outlive the bus back up, or "" (each
    partition's TB_USAGE and TB_RESULTS looked at every BACKLOG_SECONDS; a look that fails keeps the last)."""
    while True:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            gw.admission.backlog = await backed_up(gw.js)
        await asyncio.sleep(BACKLOG_SECONDS)


async def backed_up(js) -> str:
    """Why new requests are refused: a stream of records that is BACKLOG_FULL of its max_bytes; "" if none is."""
    for base in (subjects.USAGE_STREAM, subjects.RESULTS_STREAM):
        for info in await bus.infos(js, base):
            room, held = info.config.max_bytes, info.state.bytes
            if room and room > 0 and held >= subjects.BACKLOG_FULL * room:
                return (f"metering backlog full: {info.config.name} holds {held / 2**20:.1f} MiB of records the "
                        f"recorder has not taken, {held / room:.0%} of its max_bytes ({room / 2**20:.1f} MiB); its "
                        f"database or archive is away or behind; retry later")
    return ""


async def watch(gw: Gateway, known: asyncio.Event) -> None:
    """Keeps admission's view of the workers current, from the registry (the watch starts over after a
    reconnect); `known` is set once the entries there at the start have been read."""
    cluster = gw.admission.cluster

    def seen(entry) -> None:
        if entry is None:                         # the end of the initial values
            known.set()
            return
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            cluster.remove(entry.key)
            return
        try:
            cluster.update(decode(entry.value, Heartbeat))
        except WireError as e:
            gw.log.error("bad heartbeat dropped", key=entry.key, error=str(e))

    await bus.watch(gw.nc, seen, gw.log)


async def chat(ws: WebSocket) -> None:
    gw: Gateway = ws.app.state.gateway
    try:
        key = gw.authorize(ws.headers, ws.query_params)
    except ApiError as e:
        await ws.send_denial_response(api.refused(gw, None, e))
        return
    await Connection(gw, ws, key).run()


async def page(request) -> Response:
    return HTMLResponse(request.app.state.page)


async def openapi_json(request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")


async def http_error(request, exc: HTTPException) -> Response:
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                    "not_found" if exc.status_code == 404 else None).response()


async def server_error(request, exc: Exception) -> Response:
    request.app.state.gateway.log.error("request failed", path=request.url.path, error=repr(exc))
    e = ApiError(500, f"the gateway failed: {type(exc).__name__}", "internal")
    counted(request.app, e)
    return e.response()


def counted(app: Starlette, e: ApiError) -> None:
    """A refusal made outside a route (no key read), counted by its code under tenant "-"."""
    app.state.gateway.metrics.error("-", e.code or str(e.status))


class HeaderLimit:
    """More than MAX_HEADERS header fields, or more than MAX_HEADER_BYTES in them: 431 naming the limit
    (HTTP, and websocket handshakes). A head that arrives in pieces is held to MAX_HEADER_BYTES by h11."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        headers = scope.get("headers", ())
        size = sum(len(k) + len(v) for k, v in headers) + len(scope.get("raw_path") or b"")
        if len(headers) > MAX_HEADERS:
            e = ApiError(431, f"{len(headers)} header fields is more than MAX_HEADERS={MAX_HEADERS}",
                         "too_many_headers")
        elif size > MAX_HEADER_BYTES:
            e = ApiError(431, f"the request line and headers are more than MAX_HEADER_BYTES={MAX_HEADER_BYTES} "
                              "bytes", "headers_too_large")
        else:
            return await self.app(scope, receive, send)
        counted(scope["app"], e)
        if scope["type"] == "websocket":
            await WebSocket(scope, receive, send).send_denial_response(e.response())
        else:
            await e.response()(scope, receive, send)


PROBES = ("/livez", "/readyz", "/healthz", "/health", "/metrics")    # answered while the gateway drains


class Draining:
    """Counts the HTTP requests in flight (Gateway.http: an SSE stream is one until its last event); while
    the gateway drains, a new request (a websocket handshake too) is refused with 503 and Retry-After,
    naming the drain, so the client goes to another gateway; the probes are still answered."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        state = scope["app"].state if "app" in scope else None
        life = getattr(state, "life", None)
        if scope["type"] not in ("http", "websocket") or life is None or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        if life.asked.is_set():
            e = ApiError(503, "the gateway is draining: send the request to another gateway", "unavailable",
                         retry_after=1)
            counted(scope["app"], e)
            if scope["type"] == "websocket":
                return await WebSocket(scope, receive, send).send_denial_response(e.response())
            return await e.response()(scope, receive, send)
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        state.gateway.http += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.gateway.http -= 1


class Http(H11Protocol):
    """uvicorn's h11 protocol, but a request line and headers over MAX_HEADER_BYTES (h11 refuses them
    unparsed) get a 431 that names the limit; uvicorn would say only "Invalid HTTP request received"."""

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) <= MAX_HEADER_BYTES:
            return super().send_400_response(msg)
        e = ApiError(431, f"the request line and headers are more than MAX_HEADER_BYTES={MAX_HEADER_BYTES} bytes",
                     "headers_too_large")
        counted(self.config.app, e)
        body = orjson.dumps(e.body())
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


class Ws(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O websocket protocol, but the data frames sent in one turn of the event loop go
    out in one socket write: a worker step publishes a chunk for every stream, so a connection
    carrying many streams gets a burst of frames at once, and a write each cost a quarter of the
    gateway's CPU. The frames are the same; the first waits at most one turn. Everything else
    (handshake, close, ping) is uvicorn's, after what is buffered has been written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outbox: list[bytes] = []
        app = self.app

        async def flushing(scope, receive, send):     # what the app sent goes out before uvicorn closes
            try:
                return await app(scope, receive, send)
            finally:
                self.flush()
        self.app = flushing

    async def send(self, message) -> None:
        if message["type"] != "websocket.send" or not self.handshake_complete or self.close_sent \
                or self.initial_response is not None:
            self.flush()
            return await super().send(message)
        await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected()
        try:
            if message.get("bytes") is not None:
                self.conn.send_binary(message["bytes"])
            else:
                self.conn.send_text(message["text"].encode())
        except InvalidState:
            raise ClientDisconnected() from None
        if not self.outbox:
            self.loop.call_soon(self.flush)
        self.outbox.extend(self.conn.data_to_send())

    def flush(self) -> None:
        if self.outbox:
            data = b"".join(self.outbox)
            self.outbox.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def shutdown(self) -> None:
        self.flush()
        super().shutdown()


async def healthz(request) -> Response:
    n = await workers(request.app.state.gateway)
    body = orjson.dumps({"status": "ok" if n else "unavailable", "workers": n})
    return Response(body, status_code=200 if n else 503, media_type="application/json")


async def livez(request) -> Response:
    """Liveness: the gateway answers (draining too); /healthz says whether it can serve (a worker registered)."""
    return Response(b'{"status":"ok"}', media_type="application/json")


async def readyz(request) -> Response:
    """Readiness: 200 while it takes new clients; 503 while it starts or drains."""
    life: Life = request.app.state.life
    state = "ready" if life.serving else "draining" if life.asked.is_set() else "starting"
    return Response(orjson.dumps({"status": state, "name": life.name}), status_code=200 if life.serving else 503,
                    media_type="application/json")


async def draining(app: Starlette, gw: Gateway) -> None:
    """Once asked to drain (SIGTERM, tokenbus drain): new requests are refused (Draining), the probes still
    answered (/readyz 503); each websocket is closed with 1012 (service restart: connect again and resume)
    once the requests on it that cannot be resumed have ended; the HTTP requests in flight (SSE streams)
    finish; then uvicorn stops. What is still open when the drain timeout passes is cut: resumable
    clients resume elsewhere, the others get their error."""
    life: Life = app.state.life
    await life.asked.wait()
    while not life.stopping.is_set() and time.monotonic() < life.deadline:
        for conn in list(gw.connections):
            if all(r.resumable for r in conn.inflight.values()):
                await conn.close_for_drain()
        if not gw.clients:
            break
        await asyncio.sleep(DRAIN_POLL)
    gw.log.info("drain timeout: clients cut" if gw.clients else "clients drained", websockets=len(gw.connections),
                http=gw.http)
    server = getattr(app.state, "server", None)
    if server is not None:
        server.config.timeout_graceful_shutdown = 0.1 if life.draining.is_set() else SHUTDOWN_GRACE
        server.should_exit = True


async def metrics(request) -> Response:
    gw = request.app.state.gateway
    gw.metrics.connections.set(gw.clients)
    return Response(await gw.metrics.render(gw.kv, gw.log, gw.js), media_type=CONTENT_TYPE)


async def workers(gw: Gateway) -> int:
    """Workers with a live heartbeat in the registry (entries expire after WORKER_TTL)."""
    try:
        return len(await gw.kv.keys())
    except nats.js.errors.NoKeysError:
        return 0
    except (nats.errors.Error, asyncio.TimeoutError) as e:
        gw.log.warning("registry read failed", error=str(e) or type(e).__name__)
        return 0


def server_config(app: Starlette, host: str, port: int) -> uvicorn.Config:
    # No permessage-deflate: token deltas are a few dozen bytes, and compressing each costs both ends CPU
    return uvicorn.Config(app, host=host, port=port, http=Http, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          ws=Ws, ws_max_size=subjects.MAX_FRAME_BYTES, ws_per_message_deflate=False,
                          lifespan="on", log_config=None, access_log=False,
                          timeout_graceful_shutdown=SHUTDOWN_GRACE)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description="The tokenbus gateway.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="HF checkpoint directory, for its tokenizer.json")
    which.add_argument("--models", metavar="FILE", help="a served models file (schemas/served.py, written by tokenbus "
                       "up): every model and revision, with its tokenizer and canary share")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", help="JSON file: key (or sha256:<hex>) -> {tenant, tokens_per_minute, "
                                      "max_concurrent_requests}; without it, loopback only")
    p.add_argument("--max-tokens", type=int, default=subjects.MAX_TOKENS, help="the cap on a request's max_tokens")
    p.add_argument("--request-timeout", type=float, default=subjects.REQUEST_DEADLINE,
                   help=f"seconds a request may take from arrival to its last frame; then it ends with a "
                        f"timeout error (default {subjects.REQUEST_DEADLINE:g})")
    p.add_argument("--resume-grace", type=float, default=subjects.RESUME_GRACE,
                   help=f"seconds a resumable stream whose client's connection dropped keeps generating for a resume "
                        f"before it is cancelled; 0 cancels at once (default {subjects.RESUME_GRACE:g})")
    p.add_argument("--served-model-name", help="with --model: the model's name in the HTTP API (default: the "
                   "checkpoint directory's)")
    p.add_argument("--fallback-url", metavar="URL",
                   help="an OpenAI-compatible upstream's base URL (e.g. http://host:8000/v1) that answers requests "
                        "the cluster cannot take: no worker, every worker busy, the bus unreachable (default: none)")
    p.add_argument("--fallback-key-env", metavar="NAME", default=KEY_ENV,
                   help=f"the environment variable holding the upstream's API key, sent as a bearer token; unset: "
                        f"no key (default: {KEY_ENV})")
    p.add_argument("--fallback-model", metavar="NAME",
                   help="the model's name at the upstream (default: the name requests give, the served model's)")
    p.add_argument("--fallback-failures", type=int, default=FAILURES, metavar="K",
                   help=f"consecutive upstream failures (connect errors, timeouts, 5xx) that open the fallback's "
                        f"circuit breaker (default: {FAILURES})")
    p.add_argument("--fallback-cooldown", type=float, default=COOLDOWN, metavar="SECONDS",
                   help=f"seconds an open breaker forwards nothing before one request probes the upstream "
                        f"(default: {COOLDOWN:g})")
    p.add_argument("--tool-call-parser", choices=toolcalls.PARSERS,
                   help="how the models write tool calls (default: chosen from each checkpoint's chat template)")
    p.add_argument("--generation-config", metavar="auto|none|FILE", default="auto", help=generation.HELP)
    lifecycle.add_arguments(p, health=False)
    return p


def fallback(args) -> Upstream | None:
    """The upstream of --fallback-url, its key from the environment (never on the command line)."""
    if args.fallback_url is None:
        return None
    return Upstream(args.fallback_url, os.environ.get(args.fallback_key_env) or None, args.fallback_model,
                    args.fallback_failures, args.fallback_cooldown)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    try:
        keys.check_exposure(args.host, args.api_keys)
        app = create_app(args.nats_url, args.model, args.api_keys, args.max_tokens, args.served_model_name,
                         args.request_timeout, args.resume_grace, args.models,
                         fallback(args), args.tool_call_parser, args.generation_config, args.drain_timeout)
    except (ValueError, OSError) as e:            # a bad keys file, a --model without config.json, a bad --fallback-*
        sys.exit(f"gateway: {e}")
    tracing.setup("gateway", f"gateway-{os.getpid()}", args.otlp_endpoint)
    server = app.state.server = Server(server_config(app, args.host, args.port))
    for sig in (signal.SIGTERM, signal.SIGINT):   # uvicorn re-raises the signal it stopped on: exit 0 instead
        signal.signal(sig, lambda *_: None)
    server.run()


class Server(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM drains (draining()); SIGINT, or a second SIGTERM, stops as
    uvicorn does, streams given SHUTDOWN_GRACE."""

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        life, loop = getattr(self.config.app.state, "life", None), getattr(self, "loop", None)
        if life is not None and loop is not None:
            if sig == signal.SIGTERM and not life.asked.is_set():
                loop.call_soon_threadsafe(life.drain, "SIGTERM")
                return
            loop.call_soon_threadsafe(life.stop, "SIGINT" if sig == signal.SIGINT else "a second SIGTERM")
        super().handle_exit(sig, frame)

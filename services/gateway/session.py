"""What every client of a gateway shares (Gateway): the NATS connection, the registry, the tokenizer,
the keys, admission and the requests in flight. A request starts here: authorized, its model chosen,
admitted (or sent to the fallback upstream), subscribed to tb.out.<request id> before it is published
(stream.py streams it from there to its owner, owners.py).

A stream outlives its connection: a client resumes it on any gateway from the output token it got to
(Gateway.resume), reading the request from the request log (its sequence number is in the resume id)
and the tokens from its end record or the worker. A client whose connection dropped has resume_grace
seconds to do so (its requests are Parked) before they are cancelled. The sweep ends requests past
the request timeout and checks stalled streams and streams with an unfilled gap."""
import asyncio
import contextlib
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from structlog.typing import FilteringBoundLogger
from tokenizers import Tokenizer

import bus
from bus import tracing
from bus.lifecycle import Life
from schemas import generation, subjects
from schemas.messages import (
    Cancel,
    Completion,
    GenerateRequest,
    Meter,
    Progress,
    Resend,
    Resumed,
    TokenChunk,
    Usage,
    decode,
    encode,
)
from schemas.served import SEPARATOR
from schemas.wire import WireError
from services.gateway import admission, keys
from services.gateway.admission import Admission, Ticket
from services.gateway.errors import ApiError
from services.gateway.fallback import Forward, Upstream
from services.gateway.keys import Key
from services.gateway.limits import Limits
from services.gateway.metrics import Metrics
from services.gateway.models import Models, Revision
from services.gateway.stream import UNKNOWN, Request

SWEEP_SECONDS = 1.0                  # how often deadlines, stalls and unfilled gaps are looked at
STALL_FACTOR = 2.5                   # a sweep this many periods late: this process was stopped or starved
RESEND_TIMEOUT = 1.0                 # seconds the worker running a request has to answer a Resend
ORIGINS = {"ws": "the websocket", "chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(slots=True)
class Gateway:
    """What every client shares: the NATS connection, the registry, the tokenizer, the keys and admission."""
    nc: nats.NATS
    js: JetStreamContext
    kv: KeyValue                                  # the worker registry
    tokenizer: Tokenizer
    log: FilteringBoundLogger
    model: str = "model"                          # the served model's name
    max_model_len: int = 1 << 30
    max_tokens: int = subjects.MAX_TOKENS         # the cap on a request's max_tokens
    keys: dict[str, Key] | None = None            # SHA-256 hex → key; None: no keys, one tenant
    admission: Admission = field(default_factory=Admission)
    metrics: Metrics = field(default_factory=Metrics)
    tasks: set = field(default_factory=set)
    request_timeout: float = subjects.REQUEST_DEADLINE   # seconds from arrival to the last frame, at most
    requests: dict[str, Request] = field(default_factory=dict)   # request id -> its stream, for checks
    resume_grace: float = subjects.RESUME_GRACE   # seconds a dropped client's resumable streams wait for it
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])     # this gateway, in Resumed messages
    upstream: Upstream | None = None              # --fallback-url: where what the cluster cannot take goes
    limits: Limits | None = None                  # tenants' rate limits shared with the other gateways
    models: Models | None = None                  # every served model; None: `model`, with `tokenizer`
    life: Life | None = None                      # its probes and drain (bus/lifecycle.py)
    connections: set = field(default_factory=set)  # the websocket connections open (owners.Connection)
    http: int = 0                                 # HTTP requests in flight (app.Draining counts them)

    @property
    def clients(self) -> int:
        """Clients it serves now: open websockets and HTTP requests in flight (tokenbus_gateway_connections)."""
        return len(self.connections) + self.http

    def authorize(self, headers, query) -> Key:
        if self.keys is None:
            return keys.OPEN
        given = keys.presented(headers, query)
        key = self.keys.get(keys.digest(given)) if given else None
        if key is None:
            raise ApiError(401, "missing API key: send Authorization: Bearer <key>" if not given
                           else "invalid API key", "invalid_api_key")
        return key

    def choose(self, req: GenerateRequest, asked: str | None) -> None:
        """Names the model (`asked`: a name or name@revision; None: the default) and the revision that answer
        the request, the canary split decided by its id; ApiError 404 naming what is served. A name with one
        revision is not pinned: any worker serving the name serves it. A canary no worker serves (its first
        worker not up yet in a rollout, or its last one gone) leaves its share to the stable revision; a
        request that pins it still waits for it."""
        if self.models is None:
            return
        model, rev = self.models.find(self.models.default if asked is None else asked, req.id)
        if rev.share and SEPARATOR not in (asked or "") and \
                not self.admission.cluster.serving(model.name, rev.revision, time.time()):
            rev = model.revisions[0]
        req.model = model.name
        req.revision = rev.revision if len(model.revisions) > 1 or SEPARATOR in (asked or "") else ""

    def fill(self, reqs: list[GenerateRequest], given: Collection[str]) -> None:
        """Gives the sampling fields a client left unset (`given`: the names it set) the defaults of the revision
        choose() picked for the requests, before they are logged: the request log holds what each one runs with."""
        rev = self.served(reqs[0])[1]
        if rev is None:                           # a gateway of no models file: SamplingParams' own
            return
        for req in reqs:
            generation.fill(req.sampling, given, rev.sampling)

    def served(self, req: GenerateRequest) -> tuple[str, Revision | None]:
        """The name and revision (None: the gateway's one model) that answer a chosen or logged request."""
        if self.models is None:
            return self.model, None
        model = self.models.by_name.get(req.model) or self.models.by_name[self.models.default]
        return model.name, model.pinned(req.revision) if req.revision else model.revisions[0]

    async def admit(self, key: Key, req: GenerateRequest, priority: int | None = None, place: bool = True) -> Ticket:
        """The request's admission ticket, or ApiError naming the limit. Its priority is the one asked, but
        never more urgent than its key's (the key's when none was asked). A shared limit whose lease here
        does not cover the request draws first (one round trip); then admission decides in memory.
        place=False: the tenant's limits only (a fallback). A request that may fall back is refused at once
        while NATS is reconnecting."""
        began = time.time_ns() if tracing.ON else 0
        ticket = await self.admit_now(key, req, priority, place)
        if began:
            ticket.admitted = began, time.time_ns()
        return ticket

    async def admit_now(self, key: Key, req: GenerateRequest, priority: int | None, place: bool) -> Ticket:
        req.priority = key.priority if priority is None else max(priority, key.priority)
        n = req.sampling.max_tokens
        if n > self.max_tokens:
            raise ApiError(400, f"max_tokens: {n} is more than the gateway's cap max_tokens={self.max_tokens}",
                           "max_tokens_too_large", "max_tokens")
        if place and not self.nc.is_connected and self.upstream is not None and key.fallback:
            raise ApiError(503, "NATS is not reachable: the gateway is reconnecting to the bus", "unavailable",
                           retry_after=1)
        prompt = admission.estimate(req)
        rev = self.served(req)[1]
        context = rev.max_model_len if rev is not None else self.max_model_len
        n = min(n, max(context - prompt, 1))
        if self.limits is not None:
            await self.limits.cover(key, prompt + n)
        return self.admission.admit(key, prompt, n, model=req.model, revision=req.revision, place=place)

    def falls_back(self, key: Key, e: ApiError) -> bool:
        """Whether a request refused with `e` goes to the fallback: a 503 (no capacity, no bus), a key that may."""
        return self.upstream is not None and key.fallback and e.status == 503

    async def fall_back(self, key: Key, req: GenerateRequest, api: str, cause: ApiError, t0: float,
                        priority: int | None = None) -> Forward:
        """The request, refused by the cluster with `cause`, admitted to the fallback: ApiError for the tenant's
        limits, or the cause itself while the breaker is open."""
        ticket = await self.admit(key, req, priority, place=False)
        via = self.upstream.breaker.allow(time.monotonic())
        if via is None:
            self.admission.settle(ticket, 0)
            self.metrics.fallback(key.tenant, "open")
            b = self.upstream.breaker
            raise ApiError(cause.status, f"{cause.message}; the fallback upstream is not tried: its circuit breaker "
                                         f"opened after {b.failures} failures in a row (--fallback-failures), for "
                                         f"{b.cooldown:g} s (--fallback-cooldown)", cause.code, cause.param,
                           cause.retry_after)
        model = self.upstream.model or req.model or self.model       # the name at the upstream
        return Forward(self, key, ticket, req.id, api, cause, via, t0, admission.estimate(req), model)

    async def start(self, owner, cid: str, req: GenerateRequest, ticket: Ticket, api: str, t0: float,
                    resumable: bool = False) -> Request:
        """Subscribes to the request's tokens, then publishes it (in a task); the tenant's salt and weight go in."""
        req.tenant = req.cache_salt = ticket.key.tenant          # the salt is the gateway's, never the client's
        req.weight = ticket.key.weight                           # as is the weight
        model, rev = self.served(req)
        req.meter = Meter(ticket.key.id, api, model)
        r = Request(owner, cid, req.id, req.sampling.stop, t0, ticket, api, req.created, resumable=resumable,
                    model=model, served=rev)
        if tracing.ON:
            r.span = root_span(req, ticket.key.tenant, api, model, t0)
            if ticket.admitted:
                tracing.start("admission", tracing.traced(r.span), {"tokenbus.request_id": req.id,
                              "tokenbus.priority": req.priority}, start_time=ticket.admitted[0]).end(ticket.admitted[1])
        try:
            await self.follow(r)
        except ApiError as e:
            self.admission.settle(ticket, 0)
            tracing.error(r.span, e.code or str(e.status))
            r.span.end()
            raise
        r.task = asyncio.create_task(r.submit(req))
        return r

    async def follow(self, r: Request) -> None:
        """Subscribes the request to its tokens and files it under its owner and this gateway."""
        try:
            r.sub = await self.nc.subscribe(subjects.out(r.rid), cb=r.on_msg)  # before the publish
        except nats.errors.Error as e:
            raise ApiError(503, f"NATS is not reachable: {e}", "unavailable") from None
        r.conn.inflight[r.cid] = self.requests[r.rid] = r

    # -- resuming -------------------------------------------------------------------------------

    async def find(self, key: Key, rid: str, seq: int, offset: int, api: str) -> tuple[GenerateRequest, dict | None]:
        """The request a client asks to resume, from the request log, and the headers it was stored with (its
        trace context); ApiError if it is not there (404), another tenant's (403), made on another API than an
        HTTP resume's (400) or shorter than offset (400)."""
        req, headers = await self.logged(rid, seq)
        if req.tenant != key.tenant:
            raise ApiError(403, f"id: request {rid} is not tenant {key.tenant}'s; only the tenant that made a request "
                                "may resume it", "forbidden", "id")
        origin = req.meter.api if req.meter else ""
        if api != "ws" and origin != api:
            raise ApiError(400, f"Last-Event-ID: request {rid} was made on {ORIGINS.get(origin, origin)}; resume it "
                                "there", "invalid_request", "Last-Event-ID")
        if offset > req.sampling.max_tokens:
            raise ApiError(400, f"offset: {offset} is more than the request's max_tokens={req.sampling.max_tokens}",
                           "invalid_request", "offset")
        return req, headers

    async def logged(self, rid: str, seq: int) -> tuple[GenerateRequest, dict | None]:
        """Request `rid` at sequence number `seq` of the request log (of its partition: each is looked at, on
        a partitioned bus), and its headers; ApiError 404 if it is not there."""
        req = headers = None
        for part in subjects.parts():
            stream = subjects.stream(subjects.REQUESTS_STREAM, part)
            try:
                msg = await self.js.get_msg(stream, seq)
                req, headers = decode(msg.data, GenerateRequest), msg.headers
            except (nats.js.errors.NotFoundError, WireError):
                continue
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                raise ApiError(503, f"{stream} could not be read: {str(e) or type(e).__name__}",
                               "unavailable", retry_after=1) from None
            if req.id == rid:
                break
        if req is None or req.id != rid:
            raise ApiError(404, f"id: no request {rid} at {seq} in the request log (never accepted, or older than "
                                f"its retention)", "not_found", "id")
        return req, headers

    async def resume(self, owner, cid: str, key: Key, req: GenerateRequest, seq: int, offset: int,
                     t0: float, headers: dict | None = None) -> Request:
        """Streams a request found to resume (find()) to a client that has its first `offset` output tokens. Its
        tokens come from its end record if it ended, else from the worker running it (Resend from 0) and its
        chunks; those before offset go through the detokenizer unsent. A stream of it held here or on another
        gateway lets it go (Resumed). No admission charge: it was charged where it started. With tracing on, its
        span `resume` joins the request's trace (the context stored in `headers`, the request log's)."""
        api = req.meter.api if req.meter and req.meter.api else "ws"
        model, rev = self.served(req)
        r = Request(owner, cid, req.id, req.sampling.stop, t0, Ticket(key, 0, settled=True), api, req.created,
                    resumable=True, seq=seq, replay=offset, resumed=True, model=model, served=rev)
        if tracing.ON:
            r.span = tracing.start("resume", tracing.context_of(headers), {
                "tokenbus.request_id": req.id, "tokenbus.tenant": key.tenant, "tokenbus.gateway": self.id,
                "tokenbus.resume_offset": offset, "gen_ai.request.model": model}, tracing.SpanKind.SERVER,
                tracing.perf_ns(t0))
            tracing.remember(req.id, r.span)
        if (old := self.requests.get(req.id)) is not None:
            await old.let_go()
        await self.follow(r)
        self.log.info("request resumed", request_id=req.id, tenant=key.tenant, offset=offset, client_id=cid)
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(subjects.resumed(req.id), encode(Resumed(req.id, self.id)))
        self.spawn(r.recover("resume"))
        return r

    async def on_resumed(self, msg) -> None:
        """tb.resumed.<id>: the request's client resumed it on another gateway; a stream of it here ends."""
        try:
            note = decode(msg.data, Resumed)
        except WireError as e:
            self.log.error("bad resumed note dropped", error=str(e))
            return
        r = self.requests.get(note.id)
        if r is not None and note.gateway != self.id:
            await r.let_go()

    def close(self, r: Request, reason: str | None) -> None:
        """A request ended (reason None: with an error): settle its ticket, meter what it used."""
        self.admission.settle(r.ticket, r.prompt_tokens + r.received)
        if reason is not None and r.metered:
            self.spawn(self.meter(r.usage(reason)))

    async def meter(self, u: Usage) -> None:
        try:
            await bus.publish(self.js, subjects.usage(u.tenant, u.id), encode(u), subjects.msg_id(u.id), self.log)
        except bus.NotStored as e:
            self.log.error("usage record not stored", request_id=u.id, tenant=u.tenant,
                           error=str(e) or type(e).__name__)

    async def publish_cancel(self, rid: str, reason: str) -> None:
        try:
            await self.nc.publish(subjects.cancel(rid), encode(Cancel(rid, reason)))
        except nats.errors.Error as e:
            self.log.error("cancel publish failed", request_id=rid, error=str(e))

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- recovery: deadlines, stalls, gaps ------------------------------------------------------

    async def sweep(self) -> None:
        """Forever, every SWEEP_SECONDS: ends requests past the request timeout, checks stalled streams
        and streams with an unfilled gap."""
        last = time.perf_counter()
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = time.perf_counter()
            if now - last > STALL_FACTOR * SWEEP_SECONDS:       # the loop did not run: trust the registry a bit
                self.admission.cluster.stalled(time.time())
                self.log.warning("gateway stalled", seconds=round(now - last, 1))
            last = now
            for r in list(self.requests.values()):
                if now - r.t0 >= self.request_timeout:
                    self.spawn(r.expire())
                elif r.parked and now - r.parked >= self.resume_grace:
                    self.spawn(r.abort())              # its client did not come back
                elif not r.checking and (r.held or now - r.heard >= subjects.STALL_SECONDS):
                    self.spawn(r.recover("gap" if r.held else "stall"))

    async def ended(self, r: Request) -> Completion | None:
        """The request's end record, if it ended (None also when it cannot be read now). A resumed stream's
        partition is not known here: each is looked at."""
        parts = subjects.parts() if r.part == UNKNOWN else [r.part]
        try:
            for part in parts:
                if (data := await bus.ended(self.js, r.ticket.key.tenant, r.rid, part)) is not None:
                    return decode(data, Completion)
        except (nats.errors.Error, asyncio.TimeoutError, WireError) as e:
            self.log.warning("end record not read", request_id=r.rid, error=str(e) or type(e).__name__)
        return None

    async def resend(self, rid: str, offset: int) -> TokenChunk | None:
        """The output tokens from `offset` on, from the worker running the request; None if none answers."""
        try:
            msg = await self.nc.request(subjects.resend(rid), encode(Resend(rid, offset)), timeout=RESEND_TIMEOUT)
            return decode(msg.data, TokenChunk)
        except (nats.errors.Error, asyncio.TimeoutError, WireError):   # no worker runs it (now)
            return None

    async def on_progress(self, msg) -> None:
        """tb.progress.<id>: the tokens the request's client has received, for a worker taking it over."""
        rid = msg.subject.rsplit(".", 1)[-1]
        r = self.requests.get(rid)
        if r is None or not msg.reply:
            return
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(msg.reply, encode(Progress(rid, list(r.tokens))))


OPERATIONS = {"chat": "chat", "responses": "chat", "completions": "text_completion"}   # gen_ai.operation.name


def root_span(req: GenerateRequest, tenant: str, api: str, model: str, t0: float):
    """The request's span at the gateway, its whole life here (from its arrival at t0, a perf_counter), the root
    of its trace; its admission is a child, timed by the ticket."""
    s = req.sampling
    operation = OPERATIONS.get(api, "chat" if req.messages is not None else "text_completion")     # ws: either
    attributes = {"tokenbus.request_id": req.id, "tokenbus.tenant": tenant, "tokenbus.api": api,
                  "gen_ai.operation.name": operation,
                  "gen_ai.request.model": model, "gen_ai.request.max_tokens": s.max_tokens,
                  "gen_ai.request.temperature": s.temperature}
    span = tracing.start("request", None, attributes, tracing.SpanKind.SERVER, tracing.perf_ns(t0))
    tracing.remember(req.id, span)
    return span


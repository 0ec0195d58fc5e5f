"""Requests in flight: what every client shares (Gateway), one websocket connection (Connection) or
one HTTP request (Exchange) as the owner of its requests, and a request's stream (Request). Each
request subscribes to tb.out.<request id> before it is published; the subscription's callback is the
hot path (decode, drop duplicates, detokenize, send). When a request ends its admission ticket is
settled and, if it ran, its usage record goes to TB_USAGE.

A stream outlives its connection: a client resumes it on any gateway from the output token it got to
(Gateway.resume), reading the request from the request log (its sequence number is in the resume id)
and the tokens from the Outcome or the worker; the tokens it already has go through the detokenizer
unsent, so the text continues exactly. A client whose connection dropped has resume_grace seconds
to do so (its requests are Parked) before they are cancelled.

A stream is never silently incomplete: a chunk past a gap is held back until the gap is filled,
from the request's Outcome (tb_outcomes) once it ended or else by the worker running it (Resend on
tb.resend.<id>); a stream silent for STALL_SECONDS is checked the same way (its final chunk may be
what was lost). Every request ends with a done or an error frame within the gateway's request
timeout (code "timeout"), and the worker gets a cancel."""
import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
import orjson
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from structlog.typing import FilteringBoundLogger
from tokenizers import Tokenizer

from schemas import subjects
from schemas.detokenizer import Detokenizer
from schemas.messages import (
    Cancel,
    ErrorChunk,
    FinalChunk,
    GenerateRequest,
    Meter,
    Outcome,
    Progress,
    Resend,
    Resumed,
    TokenChunk,
    Usage,
    WireError,
    decode,
    encode,
    ending,
)
from schemas.served import SEPARATOR
from services.gateway import admission, frames, keys
from services.gateway.admission import Admission, Ticket
from services.gateway.errors import ApiError
from services.gateway.fallback import Forward, Spilled, Upstream
from services.gateway.frames import FrameError
from services.gateway.keys import Key
from services.gateway.limits import Limits
from services.gateway.metrics import Metrics
from services.gateway.models import Models, Revision

SWEEP_SECONDS = 1.0                  # how often deadlines, stalls and unfilled gaps are looked at
STALL_FACTOR = 2.5                   # a sweep this many periods late: this process was stopped or starved
RESEND_TIMEOUT = 1.0                 # seconds the worker running a request has to answer a Resend
CLEAN_CLOSE = (1000, 1001)           # websocket close codes of a client that left on purpose: no resume
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
    outcomes: KeyValue | None = None              # tb_outcomes: how each request ended
    request_timeout: float = subjects.REQUEST_DEADLINE   # seconds from arrival to the last frame, at most
    requests: dict[str, "Request"] = field(default_factory=dict)   # request id -> its stream, for checks
    resume_grace: float = subjects.RESUME_GRACE   # seconds a dropped client's resumable streams wait for it
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])     # this gateway, in Resumed messages
    upstream: Upstream | None = None              # --fallback-url: where what the cluster cannot take goes
    limits: Limits | None = None                  # tenants' rate limits shared with the other gateways
    models: Models | None = None                  # every served model; None: `model`, with `tokenizer`

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
        revision is not pinned: any worker serving the name serves it."""
        if self.models is None:
            return
        model, rev = self.models.find(self.models.default if asked is None else asked, req.id)
        req.model = model.name
        req.revision = rev.revision if len(model.revisions) > 1 or SEPARATOR in (asked or "") else ""

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
                    resumable: bool = False) -> "Request":
        """Subscribes to the request's tokens, then publishes it (in a task); the tenant's salt and weight go in."""
        req.tenant = req.cache_salt = ticket.key.tenant          # the salt is the gateway's, never the client's
        req.weight = ticket.key.weight                           # as is the weight
        model, rev = self.served(req)
        req.meter = Meter(ticket.key.id, api, model)
        r = Request(owner, cid, req.id, req.sampling.stop, t0, ticket, api, req.created, resumable=resumable,
                    model=model, served=rev)
        try:
            await self.follow(r)
        except ApiError:
            self.admission.settle(ticket, 0)
            raise
        r.task = asyncio.create_task(r.submit(req))
        return r

    async def follow(self, r: "Request") -> None:
        """Subscribes the request to its tokens and files it under its owner and this gateway."""
        try:
            r.sub = await self.nc.subscribe(subjects.out(r.rid), cb=r.on_msg)  # before the publish
        except nats.errors.Error as e:
            raise ApiError(503, f"NATS is not reachable: {e}", "unavailable") from None
        r.conn.inflight[r.cid] = self.requests[r.rid] = r

    # -- resuming -------------------------------------------------------------------------------

    async def find(self, key: Key, rid: str, seq: int, offset: int, api: str) -> GenerateRequest:
        """The request a client asks to resume, from the request log; ApiError if it is not there (404),
        another tenant's (403), made on another API than an HTTP resume's (400) or shorter than offset (400)."""
        req = await self.logged(rid, seq)
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
        return req

    async def logged(self, rid: str, seq: int) -> GenerateRequest:
        """Request `rid` at sequence number `seq` of the request log; ApiError 404 if it is not there."""
        try:
            msg = await self.js.get_msg(subjects.REQUESTS_STREAM, seq)
            req = decode(msg.data, GenerateRequest)
        except (nats.js.errors.NotFoundError, WireError):
            req = None
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            raise ApiError(503, f"{subjects.REQUESTS_STREAM} could not be read: {str(e) or type(e).__name__}",
                           "unavailable", retry_after=1) from None
        if req is None or req.id != rid:
            raise ApiError(404, f"id: no request {rid} at {seq} in the request log (never accepted, or older than "
                                f"its retention)", "not_found", "id")
        return req

    async def resume(self, owner, cid: str, key: Key, req: GenerateRequest, seq: int, offset: int,
                     t0: float) -> "Request":
        """Streams a request found to resume (find()) to a client that has its first `offset` output tokens. Its
        tokens come from its Outcome if it ended, else from the worker running it (Resend from 0) and its
        chunks; those before offset go through the detokenizer unsent. A stream of it held here or on another
        gateway lets it go (Resumed). No admission charge: it was charged where it started."""
        api = req.meter.api if req.meter and req.meter.api else "ws"
        model, rev = self.served(req)
        r = Request(owner, cid, req.id, req.sampling.stop, t0, Ticket(key, 0, settled=True), api, req.created,
                    resumable=True, seq=seq, replay=offset, resumed=True, model=model, served=rev)
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

    def close(self, r: "Request", reason: str | None) -> None:
        """A request ended (reason None: with an error): settle its ticket, meter what it used."""
        self.admission.settle(r.ticket, r.prompt_tokens + r.received)
        if reason is not None and r.metered:
            self.spawn(self.meter(r.usage(reason)))

    async def meter(self, u: Usage) -> None:
        try:
            await subjects.publish(self.js, subjects.usage(u.tenant), encode(u), subjects.msg_id(u.id), self.log)
        except subjects.NotStored as e:
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

    async def outcome(self, rid: str) -> Outcome | None:
        """The request's Outcome, if it ended (None also when the bucket cannot be read now)."""
        if self.outcomes is None:
            return None
        try:
            return decode((await self.outcomes.get(rid)).value, Outcome)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (nats.errors.Error, asyncio.TimeoutError, WireError) as e:
            self.log.warning("outcome not read", request_id=rid, error=str(e) or type(e).__name__)
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


class Connection:
    def __init__(self, gw: Gateway, ws, key: Key = keys.OPEN):
        self.gw, self.ws, self.log, self.key = gw, ws, gw.log, key
        self.inflight: dict[str, Request] = {}  # client id -> request

    async def run(self) -> None:
        await self.ws.accept()
        event = {}
        try:
            while (event := await self.ws.receive())["type"] == "websocket.receive":
                await self.on_frame(event)
        finally:
            await leave(self, event.get("code") not in CLEAN_CLOSE)

    async def on_frame(self, event: dict) -> None:
        t0 = time.perf_counter()
        try:
            frame = frames.parse(event)
            kind, cid = frames.header(frame)
            if kind == "generate":
                await self.generate(frame, cid, t0)
            elif kind == "resume":
                await self.resume(frame, cid, t0)
            else:
                await self.cancel(cid)
        except FrameError as e:
            self.gw.metrics.error(self.key.tenant, e.code)
            await self.send(error(e.id, e.code, str(e), e.retry_after))
        except Exception as e:                    # a bug must not end the connection
            self.log.exception("frame failed")
            await self.send(error(None, "internal", f"the gateway failed on this frame: {type(e).__name__}"))

    async def generate(self, frame: dict, cid: str, t0: float) -> None:
        self.room(cid)
        req = frames.request(frame, uuid.uuid4().hex, self.key.tenant)
        resumable = frames.resumable(frame)
        try:
            self.gw.choose(req, frames.model(frame))
            try:
                await self.gw.start(self, cid, req, await self.gw.admit(self.key, req, frames.priority(frame)), "ws",
                                    t0, resumable)
            except ApiError as e:
                if not self.gw.falls_back(self.key, e):
                    raise
                f = await self.gw.fall_back(self.key, req, "ws", e, t0, frames.priority(frame))
                Spilled(self, cid, f, frame, req).start()
        except ApiError as e:                     # refused by a limit: an error frame with its code
            raise refused(e, cid) from None

    async def resume(self, frame: dict, cid: str, t0: float) -> None:
        self.room(cid)
        rid, seq, offset = frames.resume(frame)
        try:
            req = await self.gw.find(self.key, rid, seq, offset, "ws")
            await self.gw.resume(self, cid, self.key, req, seq, offset, t0)
        except ApiError as e:
            raise refused(e, cid) from None

    def room(self, cid: str) -> None:
        """FrameError unless a request `cid` may start on this connection."""
        if cid in self.inflight:                  # id None: the error is not the in-flight request's
            raise FrameError(f"id: {frames.show(cid)} is already in flight on this connection")
        if len(self.inflight) >= subjects.MAX_INFLIGHT_PER_CONNECTION:
            raise FrameError(f"{len(self.inflight)} requests are in flight on this connection; "
                             f"MAX_INFLIGHT_PER_CONNECTION={subjects.MAX_INFLIGHT_PER_CONNECTION}", cid,
                             "too_many_requests")

    async def cancel(self, cid: str) -> None:
        r = self.inflight.get(cid)
        if r is None:
            raise FrameError(f"id: no request {frames.show(cid)} is in flight on this connection", cid)
        await r.abort()
        await self.send(r.done("abort"))

    async def send(self, frame: dict) -> None:
        try:
            await self.ws.send_text(orjson.dumps(frame).decode())
        except Exception as e:                    # the client left: run() sees it and aborts its requests
            self.log.debug("send failed", error=repr(e))

    async def accepted(self, r: "Request") -> None:
        """The request is stored: a client that asked for it gets the id it can resume it by."""
        if r.resumable:
            await self.send({"type": "accepted", "id": r.cid, "resume_id": frames.resume_id(r.rid, r.seq)})


class Exchange:
    """The owner of one HTTP request's Request: its frames queue up for the response to take."""

    def __init__(self, gw: Gateway):
        self.gw, self.log = gw, gw.log
        self.inflight: dict[str, Request] = {}
        self.frames: asyncio.Queue[dict] = asyncio.Queue()

    async def send(self, frame: dict) -> None:
        self.frames.put_nowait(frame)

    async def accepted(self, r: "Request") -> None:
        pass                                      # SSE events carry the resume point in their ids


class Parked:
    """The owner of requests whose client's connection dropped: their frames go nowhere while they wait
    for a resume (Gateway.resume_grace), then they are cancelled."""

    def __init__(self, gw: Gateway):
        self.gw, self.log = gw, gw.log
        self.inflight: dict[str, Request] = {}

    async def send(self, frame: dict) -> None:
        pass

    async def accepted(self, r: "Request") -> None:
        pass


async def leave(owner: Connection | Exchange, dropped: bool) -> None:
    """The client left: its requests end and their workers are told, except the resumable ones of a dropped
    connection, which are Parked for the gateway's resume_grace."""
    parked = Parked(owner.gw) if dropped and owner.gw.resume_grace > 0 else None
    for r in list(owner.inflight.values()):
        if parked is not None and r.resumable:
            r.park(parked)
        else:
            await r.abort()


def refused(e: ApiError, cid: str) -> FrameError:
    """A refusal (a limit, an unknown or forbidden resume) as the error frame of request cid."""
    frame = e.frame(cid)
    return FrameError(e.message, cid, frame["code"], frame.get("retry_after"))


@dataclass(slots=True, eq=False)
class Request:
    """One generate in flight: its subscription, detokenizer and counters."""
    conn: Connection | Exchange | Parked          # its owner: where its frames go
    cid: str                                      # the client's id
    rid: str                                      # the request id on the wire
    stop: tuple[str, ...]
    t0: float                                     # perf_counter when the request arrived
    ticket: Ticket
    api: str                                      # ws | chat | completions
    created: float = 0.0                          # unix time
    sub: Subscription | None = None
    task: asyncio.Task | None = None
    detok: Detokenizer | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker_timing: dict = field(default_factory=dict)
    worker: str = ""
    ttft: float | None = None
    ended: bool = False
    tokens: list[int] = field(default_factory=list)   # the output tokens its client has received
    held: dict[int, TokenChunk | FinalChunk] = field(default_factory=dict)   # offset -> chunk past a gap
    heard: float = field(default_factory=time.perf_counter)    # when the last chunk came (or a check)
    checking: bool = False                        # a recovery is in flight
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # one chunk at a time, in order
    resumable: bool = False                       # its client can resume it: parked when its connection drops
    seq: int = 0                                  # its sequence number in the request log (0: not stored yet)
    replay: int = 0                               # resumed: the output tokens its client has (sent again unsent)
    resumed: bool = False                         # a stream resumed here, not started here
    parked: float = 0.0                           # perf_counter when its client's connection dropped (0: attached)
    metered: bool = True                          # whether its end writes a usage record here
    unstored: bool = False                        # its publish failed: it never entered the pipeline
    model: str = ""                               # the served model's name
    served: Revision | None = None                # and its revision that answers (None: the gateway's one model)

    @property
    def log(self) -> FilteringBoundLogger:
        return self.conn.log

    @property
    def tokenizer(self) -> Tokenizer:
        return self.served.tokenizer if self.served is not None else self.conn.gw.tokenizer

    @property
    def revision(self) -> str:
        return self.served.revision if self.served is not None else ""

    @property
    def received(self) -> int:
        """Output tokens so far: the offset the next chunk should have."""
        return len(self.tokens)

    async def submit(self, req) -> None:
        """Publishes the request; its chunks wait on the lock until the ack, as a worker can take it and send
        a token before the ack comes back: the accepted frame goes first and SSE event ids carry the seq."""
        gw = self.conn.gw
        async with self.lock:
            try:
                ack = await subjects.publish(gw.js, subjects.request_new(req.tenant), encode(req),
                                             subjects.msg_id(req.id), self.log,
                                             min(subjects.PUBLISH_DEADLINE, gw.request_timeout))
            except subjects.NotStored as e:
                reason, self.unstored = str(e), True
                self.log.error("request publish failed", request_id=self.rid, error=reason)
                await self.end(error(self.cid, "unavailable",
                                     f"{subjects.REQUESTS_STREAM} did not store it: {reason}"))
                return
            self.seq = ack.seq
            self.log.info("request accepted", request_id=self.rid, tenant=req.tenant, client_id=self.cid,
                          seq=ack.seq)
            if not self.ended:
                await self.conn.accepted(self)

    async def on_msg(self, msg) -> None:
        if self.ended:                            # messages already queued when the request ended
            return
        try:
            await self.handle(msg.data)
        except Exception as e:                    # e.g. a token id the tokenizer does not know
            self.log.exception("chunk failed", request_id=self.rid)
            await self.conn.gw.publish_cancel(self.rid, "abort")
            await self.end(error(self.cid, "internal", f"the gateway failed on a chunk: {type(e).__name__}: {e}"))

    async def handle(self, data: bytes) -> None:
        try:
            chunk = decode(data, TokenChunk, FinalChunk, ErrorChunk)
        except WireError as e:
            self.log.error("bad chunk dropped", request_id=self.rid, error=str(e))
            return
        if chunk.id != self.rid:
            self.log.error("chunk of another request dropped", request_id=self.rid, chunk_id=chunk.id)
            return
        await self.take(chunk)

    async def take(self, chunk: TokenChunk | FinalChunk | ErrorChunk) -> None:
        """Delivers a chunk in order: one past a gap is held until the tokens before it came."""
        async with self.lock:
            if self.ended:
                return
            self.heard = time.perf_counter()
            if type(chunk) is ErrorChunk:
                await self.end(error(self.cid, chunk.code, chunk.message))
                return
            if chunk.offset > self.received:
                self.hold(chunk)
                return
            await self.deliver(chunk)
            while self.held and not self.ended and (first := min(self.held)) <= self.received:
                await self.deliver(self.held.pop(first))

    def hold(self, chunk: TokenChunk | FinalChunk) -> None:
        if not self.held:
            self.log.warning("token gap: holding later tokens", request_id=self.rid, seq=chunk.seq,
                             offset=chunk.offset, expected=self.received)
            self.conn.gw.spawn(self.recover("gap"))
        kept = self.held.get(chunk.offset)
        if kept is None or type(chunk) is FinalChunk or len(chunk.token_ids) > len(kept.token_ids):
            self.held[chunk.offset] = chunk

    async def recover(self, cause: str) -> None:
        """Fills a gap or checks a stalled stream: from the Outcome if the request ended, else from the
        worker running it; with neither, the stream waits (the request timeout bounds it)."""
        if self.checking or self.ended:
            return
        self.checking = True
        gw = self.conn.gw
        try:
            outcome = await gw.outcome(self.rid)
            chunk = ending(outcome, self.received) if outcome else await gw.resend(self.rid, self.received)
            source = "outcome" if outcome else "resend" if chunk else "none"
            if source != "none" or cause == "gap":
                self.log.warning("stream checked", request_id=self.rid, cause=cause, source=source,
                                 offset=self.received, tokens=len(getattr(chunk, "token_ids", ())))
            gw.metrics.recovered(cause, source)
            if chunk is not None:
                await self.take(chunk)
            elif cause == "resume" and time.time() - self.created > subjects.OUTCOME_TTL:
                await self.end(error(self.cid, "not_found", f"request {self.rid} ended more than OUTCOME_TTL="
                                                            f"{subjects.OUTCOME_TTL:g} s ago: its tokens are gone"))
            self.heard = time.perf_counter()
        finally:
            self.checking = False

    async def expire(self) -> None:
        """The request timeout passed: an error frame naming it, and a cancel to the worker."""
        if self.ended:
            return
        gw, tenant = self.conn.gw, self.ticket.key.tenant
        gw.metrics.deadline(tenant)
        self.log.warning("request timed out", request_id=self.rid, tenant=tenant, timeout_s=gw.request_timeout,
                         tokens=self.received, held=len(self.held))
        if self.task is not None and not self.task.done():
            self.task.cancel()                    # still retrying its publish
        await gw.publish_cancel(self.rid, "abort")
        await self.end(error(self.cid, "timeout", f"the request did not finish within the gateway's request "
                                                  f"timeout --request-timeout={gw.request_timeout:g} s"))

    async def deliver(self, chunk: TokenChunk | FinalChunk) -> None:
        final = type(chunk) is FinalChunk
        new, skip = self.accept(chunk)
        if self.received - len(new) < self.replay:        # resumed: tokens its client has, through unsent
            n = min(self.replay - (self.received - len(new)), len(new))
            self.detok.push(new[:n])
            self.detok.release(final and n == len(new))   # a client with every token has the whole text
            new, skip = new[n:], skip + n
        if final and self.resumed and chunk.seq < 0:
            self.metered = False                  # it ended before: the worker's usage record counts it
        if final and self.received < self.replay:
            await self.end(error(self.cid, "invalid_request", f"offset: {self.replay} is past the request's "
                                                              f"{self.received} output tokens"))
            return
        stop = self.detok.push(new)                # a resume may have found the stop string in its client's part
        text = self.detok.release(final)
        if new or text:
            delta = {"type": "delta", "id": self.cid, "text": text, "token_ids": new}
            if chunk.logprobs is not None:        # HTTP requests only: the websocket protocol has no logprobs
                delta["logprobs"] = chunk.logprobs, skip
            await self.conn.send(delta)
        if stop is not None:
            if not final:
                await self.conn.gw.publish_cancel(self.rid, "stop")
            await self.end(self.done("stop"))
        elif final:
            self.cached_tokens = chunk.usage.get("cached_tokens", self.cached_tokens)
            self.worker_timing, self.worker = chunk.timing, chunk.worker
            await self.end(self.done(chunk.finish_reason, chunk.usage))

    def accept(self, chunk: TokenChunk | FinalChunk) -> tuple[list[int], int]:
        """The chunk's tokens not received before, and how many of its tokens came before; the first
        chunk starts the detokenizer."""
        if self.detok is None:
            self.detok = Detokenizer(self.tokenizer, chunk.prompt_tail, self.stop)
            counts = chunk.usage if isinstance(chunk, FinalChunk) else {"prompt_tokens": chunk.prompt_tokens,
                                                                         "cached_tokens": chunk.cached_tokens}
            self.prompt_tokens, self.cached_tokens = counts.get("prompt_tokens", 0), counts.get("cached_tokens", 0)
        skip = self.received - chunk.offset
        assert skip >= 0, "a chunk past a gap is held, never accepted"
        new = chunk.token_ids[skip:]
        if new:
            self.tokens += new
            if self.ttft is None:
                self.ttft = time.perf_counter() - self.t0
        return new, skip

    def done(self, reason: str, usage: dict | None = None) -> dict:
        usage = usage or {}
        return {"type": "done", "id": self.cid, "finish_reason": reason,
                "usage": {"prompt_tokens": usage.get("prompt_tokens", self.prompt_tokens),
                          "completion_tokens": self.received},        # what its client got, never more
                "timing": {"ttft_ms": ms(self.ttft), "e2e_ms": ms(time.perf_counter() - self.t0)},
                "model": self.model, "revision": self.revision}

    def usage(self, reason: str) -> Usage:
        timing = {"ttft_ms": ms(self.ttft), "e2e_ms": ms(time.perf_counter() - self.t0),
                  "queue_ms": self.worker_timing.get("queue_ms")}
        return Usage(self.rid, self.ticket.key.tenant, self.ticket.key.id, self.model, self.api, reason,
                     self.prompt_tokens, self.cached_tokens, self.received,
                     {k: v for k, v in timing.items() if v is not None}, self.created, time.time(), self.revision)

    async def end(self, frame: dict) -> None:
        """Sends the request's last frame and drops its subscription. In the callback this is the last
        await: the unsubscribe cancels the callback's task (at its next real suspension, so messages
        already queued still reach on_msg)."""
        if not self.finish(frame.get("finish_reason"), frame):
            return
        await self.conn.send(frame)
        await self.unsubscribe()

    async def abort(self) -> None:
        """Ends the request from outside its callback (client cancel or disconnect) and tells the worker."""
        if not self.finish("abort", self.done("abort")):
            return
        if self.task is not None:
            self.task.cancel()
        await self.unsubscribe()
        await self.conn.gw.publish_cancel(self.rid, "abort")

    def park(self, owner: Parked) -> None:
        """Its client's connection dropped: it streams on into `owner` (nowhere) until its client resumes it
        or the gateway's resume_grace passes."""
        del self.conn.inflight[self.cid]
        self.conn, self.parked = owner, time.perf_counter()
        owner.inflight[self.cid] = self
        self.log.info("client dropped: stream kept for a resume", request_id=self.rid, tokens=self.received,
                      grace_s=owner.gw.resume_grace)

    async def let_go(self) -> None:
        """Its client resumed it on another stream (of this gateway or another): it ends here without a cancel
        or a usage record; a client still reading this connection gets an error frame "resumed"."""
        frame = error(self.cid, "resumed", "the stream of this request was resumed on another connection")
        if self.finish(None, frame):
            await self.conn.send(frame)
            await self.unsubscribe()

    def finish(self, reason: str | None, frame: dict) -> bool:
        """Marks the request ended with its last frame (reason None: by an error), frees its id, settles
        and meters it, counts it in the metrics and logs it; False if it already was (whoever ends it
        sends its last frame)."""
        if self.ended:
            return False
        self.ended = True
        gw = self.conn.gw
        del self.conn.inflight[self.cid]
        if gw.requests.get(self.rid) is self:    # not a stream of it resumed here since
            del gw.requests[self.rid]
        gw.close(self, reason)
        tenant = self.ticket.key.tenant
        self.conn.gw.metrics.observe(tenant, frame, self.worker_timing.get("queue_ms"))
        self.log.info("request ended", request_id=self.rid, tenant=tenant, worker=self.worker,
                      end=frame.get("finish_reason") or frame.get("code"), tokens=self.received)
        return True

    async def unsubscribe(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.sub.unsubscribe()


def error(cid: str | None, code: str, message: str, retry_after: int | None = None) -> dict:
    frame = {"type": "error", "id": cid, "code": code, "message": message}
    if retry_after is not None:
        frame["retry_after"] = retry_after
    return frame


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)

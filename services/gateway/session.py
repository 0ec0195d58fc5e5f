"""One websocket connection: client frames in, its requests' frames out. Each request subscribes to
tb.out.<request id> before it is published; the subscription's callback is the hot path (decode,
drop duplicates, detokenize, send)."""
import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field

import nats.errors
import orjson
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from structlog.typing import FilteringBoundLogger
from tokenizers import Tokenizer

from schemas import subjects
from schemas.detokenizer import Detokenizer
from schemas.messages import Cancel, ErrorChunk, FinalChunk, TokenChunk, WireError, decode, encode
from services.gateway import frames
from services.gateway.frames import FrameError
from services.gateway.metrics import Metrics

TENANT = "default"                       # until API keys map to tenants
PUBLISH_TIMEOUT = 5.0


@dataclass(slots=True)
class Gateway:
    """What every connection shares: the NATS connection, the registry and the tokenizer."""
    nc: nats.NATS
    js: JetStreamContext
    kv: KeyValue                                  # the worker registry
    tokenizer: Tokenizer
    log: FilteringBoundLogger
    metrics: Metrics = field(default_factory=Metrics)


class Connection:
    def __init__(self, gw: Gateway, ws):
        self.gw, self.ws, self.log = gw, ws, gw.log
        self.inflight: dict[str, Request] = {}  # client id -> request

    async def run(self) -> None:
        await self.ws.accept()
        try:
            while (event := await self.ws.receive())["type"] == "websocket.receive":
                await self.on_frame(event)
        finally:
            await self.abort_all()

    async def on_frame(self, event: dict) -> None:
        t0 = time.perf_counter()
        try:
            frame = frames.parse(event)
            kind, cid = frames.header(frame)
            if kind == "generate":
                await self.generate(frame, cid, t0)
            else:
                await self.cancel(cid)
        except FrameError as e:
            self.gw.metrics.error(TENANT, e.code)
            await self.send(error(e.id, e.code, str(e)))
        except Exception as e:                    # a bug must not end the connection
            self.log.exception("frame failed")
            await self.send(error(None, "internal", f"the gateway failed on this frame: {type(e).__name__}"))

    async def generate(self, frame: dict, cid: str, t0: float) -> None:
        if cid in self.inflight:                  # id None: the error is not the in-flight request's
            raise FrameError(f"id: {frames.show(cid)} is already in flight on this connection")
        if len(self.inflight) >= subjects.MAX_INFLIGHT_PER_CONNECTION:
            raise FrameError(f"{len(self.inflight)} requests are in flight on this connection; "
                             f"MAX_INFLIGHT_PER_CONNECTION={subjects.MAX_INFLIGHT_PER_CONNECTION}", cid,
                             "too_many_requests")
        req = frames.request(frame, uuid.uuid4().hex, TENANT)
        r = Request(self, cid, req.id, req.tenant, req.sampling.stop, t0)
        try:
            r.sub = await self.gw.nc.subscribe(subjects.out(req.id), cb=r.on_msg)  # before the publish
        except nats.errors.Error as e:
            raise FrameError(f"NATS is not reachable: {e}", cid, "unavailable") from None
        self.inflight[cid] = r
        r.task = asyncio.create_task(r.submit(req))

    async def cancel(self, cid: str) -> None:
        r = self.inflight.get(cid)
        if r is None:
            raise FrameError(f"id: no request {frames.show(cid)} is in flight on this connection", cid)
        await r.abort()
        await self.send(r.done("abort"))

    async def abort_all(self) -> None:
        for r in list(self.inflight.values()):
            await r.abort()

    async def send(self, frame: dict) -> None:
        try:
            await self.ws.send_text(orjson.dumps(frame).decode())
        except Exception as e:                    # the client left: run() sees it and aborts its requests
            self.log.debug("send failed", error=repr(e))

    async def publish_cancel(self, rid: str, reason: str) -> None:
        try:
            await self.gw.nc.publish(subjects.cancel(rid), encode(Cancel(rid, reason)))
        except nats.errors.Error as e:
            self.log.error("cancel publish failed", request_id=rid, error=str(e))


@dataclass(slots=True, eq=False)
class Request:
    """One generate in flight: its subscription, detokenizer and counters."""
    conn: Connection
    cid: str                                      # the client's id
    rid: str                                      # the request id on the wire
    tenant: str
    stop: tuple[str, ...]
    t0: float                                     # perf_counter when the generate frame arrived
    sub: Subscription | None = None
    task: asyncio.Task | None = None
    detok: Detokenizer | None = None
    received: int = 0                             # output tokens so far: the offset the next chunk should have
    prompt_tokens: int = 0
    ttft: float | None = None
    queue_ms: float | None = None                 # accepted here → taken by a worker, from the final chunk
    worker: str = ""
    ended: bool = False

    @property
    def log(self) -> FilteringBoundLogger:
        return self.conn.log

    async def submit(self, req) -> None:
        try:
            await self.conn.gw.js.publish(subjects.request_new(req.tenant), encode(req),
                                          headers=subjects.msg_id(req.id), timeout=PUBLISH_TIMEOUT)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            reason = str(e) or type(e).__name__
            self.log.error("request publish failed", request_id=self.rid, error=reason)
            await self.end(error(self.cid, "unavailable", f"{subjects.REQUESTS_STREAM} did not store it: {reason}"))
            return
        self.log.info("request accepted", request_id=self.rid, tenant=self.tenant, client_id=self.cid)

    async def on_msg(self, msg) -> None:
        if self.ended:                            # messages already queued when the request ended
            return
        try:
            await self.handle(msg.data)
        except Exception as e:                    # e.g. a token id the tokenizer does not know
            self.log.exception("chunk failed", request_id=self.rid)
            await self.conn.publish_cancel(self.rid, "abort")
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
        if type(chunk) is ErrorChunk:
            await self.end(error(self.cid, chunk.code, chunk.message))
            return
        final = type(chunk) is FinalChunk
        new = self.accept(chunk)
        stop = self.detok.push(new) if new else None
        text = self.detok.release(final)
        if new or text:
            await self.conn.send({"type": "delta", "id": self.cid, "text": text, "token_ids": new})
        if stop is not None:
            if not final:
                await self.conn.publish_cancel(self.rid, "stop")
            await self.end(self.done("stop"))
        elif final:
            self.queue_ms, self.worker = chunk.timing.get("queue_ms"), chunk.worker
            await self.end(self.done(chunk.finish_reason, chunk.usage))

    def accept(self, chunk: TokenChunk | FinalChunk) -> list[int]:
        """The chunk's tokens not received before; the first chunk starts the detokenizer."""
        if self.detok is None:
            self.detok = Detokenizer(self.conn.gw.tokenizer, chunk.prompt_tail, self.stop)
            self.prompt_tokens = getattr(chunk, "prompt_tokens", 0)
        skip = self.received - chunk.offset
        if skip < 0:
            self.log.warning("token gap", request_id=self.rid, seq=chunk.seq, offset=chunk.offset,
                             expected=self.received)
            skip = 0
        new = chunk.token_ids[skip:]
        if new:
            self.received = chunk.offset + len(chunk.token_ids)
            if self.ttft is None:
                self.ttft = time.perf_counter() - self.t0
        return new

    def done(self, reason: str, usage: dict | None = None) -> dict:
        usage = usage or {}
        return {"type": "done", "id": self.cid, "finish_reason": reason,
                "usage": {"prompt_tokens": usage.get("prompt_tokens", self.prompt_tokens),
                          "completion_tokens": usage.get("completion_tokens", self.received)},
                "timing": {"ttft_ms": ms(self.ttft), "e2e_ms": ms(time.perf_counter() - self.t0)}}

    async def end(self, frame: dict) -> None:
        """Sends the request's last frame and drops its subscription. In the callback this is the last
        await: the unsubscribe cancels the callback's task (at its next real suspension, so messages
        already queued still reach on_msg)."""
        if not self.finish(frame):
            return
        await self.conn.send(frame)
        await self.unsubscribe()

    async def abort(self) -> None:
        """Ends the request from outside its callback (client cancel or disconnect) and tells the worker."""
        self.finish(self.done("abort"))
        self.task.cancel()
        await self.unsubscribe()
        await self.conn.publish_cancel(self.rid, "abort")

    def finish(self, frame: dict) -> bool:
        """Marks the request ended with `frame` (counted in the metrics, logged) and frees its id; False if it
        already was (whoever ends it sends its last frame)."""
        if self.ended:
            return False
        self.ended = True
        del self.conn.inflight[self.cid]
        self.conn.gw.metrics.observe(self.tenant, frame, self.queue_ms)
        self.log.info("request ended", request_id=self.rid, tenant=self.tenant, worker=self.worker,
                      end=frame.get("finish_reason") or frame.get("code"), tokens=self.received)
        return True

    async def unsubscribe(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.sub.unsubscribe()


def error(cid: str | None, code: str, message: str) -> dict:
    return {"type": "error", "id": cid, "code": code, "message": message}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)

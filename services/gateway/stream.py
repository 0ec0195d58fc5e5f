"""One request's stream (Request): its subscription to tb.out.<request id>, whose callback is the hot
path (decode, drop duplicates, detokenize, send to its owner), and its end. When a request ends its
admission ticket is settled and, if it ran, its usage record goes to TB_USAGE (Gateway.close).

A stream is never silently incomplete: a chunk past a gap is held back until the gap is filled,
from the request's end record (TB_RESULTS) once it ended or else by the worker running it (Resend on
tb.resend.<id>); a stream silent for STALL_SECONDS is checked the same way (its final chunk may be
what was lost). Every request ends with a done or an error frame within the gateway's request
timeout (code "timeout"), and the worker gets a cancel. A resumed stream passes the tokens its
client already has through the detokenizer unsent, so the text continues exactly."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.subscription import Subscription
from structlog.typing import FilteringBoundLogger
from tokenizers import Tokenizer

import bus
from bus import tracing
from schemas import subjects
from schemas.messages import ErrorChunk, FinalChunk, TokenChunk, Tokens, Usage, decode, encode, ending
from schemas.wire import WireError
from services.gateway.admission import Ticket
from services.gateway.models import Revision
from text.detokenizer import PROMPT_CONTEXT, Detokenizer

if TYPE_CHECKING:
    from services.gateway.owners import Connection, Exchange, Parked

UNKNOWN = -1                                      # a Request's partition before it is known (a resumed stream's)


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
    part: int | None = UNKNOWN                    # the bus partition its records are in (None: not partitioned)
    replay: int = 0                               # resumed: the output tokens its client has (sent again unsent)
    resumed: bool = False                         # a stream resumed here, not started here
    parked: float = 0.0                           # perf_counter when its client's connection dropped (0: attached)
    metered: bool = True                          # whether its end writes a usage record here
    unstored: bool = False                        # its publish failed: it never entered the pipeline
    model: str = ""                               # the served model's name
    served: Revision | None = None                # and its revision that answers (None: the gateway's one model)
    span: object = tracing.INVALID_SPAN           # its span here: `request`, or `resume` (bus/tracing.py)

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
        """Has a tokenizer prepare the request's tokens (one it refuses ends here with its error; none
        answering in PREPARE_SECONDS leaves that to the router), then publishes it; its chunks wait on the
        lock until the ack, as a worker can take it and send a token before the ack comes back: the accepted
        frame goes first and SSE event ids carry the seq."""
        gw = self.conn.gw
        async with self.lock:
            got = await self.prepare(req)
            if got is not None and got.code:
                await self.end(error(self.cid, got.code, got.message))
                return
            req.tokens = got.token_ids if got is not None else None
            try:
                headers = tracing.inject(subjects.msg_id(req.id), tracing.traced(self.span))   # stored with it
                ack = await bus.publish(gw.js, subjects.request_new(req.tenant, req.id), encode(req), headers,
                                        self.log, min(bus.PUBLISH_DEADLINE, gw.request_timeout))
            except bus.NotStored as e:
                reason, self.unstored = str(e), True
                self.log.error("request publish failed", request_id=self.rid, error=reason)
                await self.end(error(self.cid, "unavailable",
                                     f"{subjects.REQUESTS_STREAM} did not store it: {reason}"))
                return
            self.seq, self.part = ack.seq, subjects.part_of(ack.stream)
            self.log.info("request accepted", request_id=self.rid, tenant=req.tenant, client_id=self.cid,
                          seq=ack.seq)
            if not self.ended:
                await self.conn.accepted(self)

    async def prepare(self, req) -> Tokens | None:
        """A tokenizer's answer on tb.prepare; None if none answers in time (the router asks again)."""
        try:
            headers = tracing.inject({subjects.REQUEST_ID: req.id}, tracing.traced(self.span)) if tracing.ON else None
            reply = await self.conn.gw.nc.request(subjects.PREPARE, encode(req), timeout=subjects.PREPARE_SECONDS,
                                                  headers=headers)
            return decode(reply.data, Tokens)
        except (nats.errors.Error, asyncio.TimeoutError, WireError) as e:
            self.log.warning("request not prepared here: the router will ask", request_id=self.rid,
                             error=str(e) or type(e).__name__)
            return None

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
        """Fills a gap or checks a stalled stream: from the end record if the request ended, else from the
        worker running it; with neither, the stream waits (the request timeout bounds it)."""
        if self.checking or self.ended:
            return
        self.checking = True
        gw = self.conn.gw
        try:
            record = await gw.ended(self)
            chunk = ending(record, self.received, PROMPT_CONTEXT) if record else await gw.resend(self.rid,
                                                                                                  self.received)
            source = "outcome" if record else "resend" if chunk else "none"     # its end record, or the worker
            if source != "none" or cause == "gap":
                self.log.warning("stream checked", request_id=self.rid, cause=cause, source=source,
                                 offset=self.received, tokens=len(getattr(chunk, "token_ids", ())))
            gw.metrics.recovered(cause, source)
            if chunk is not None:
                await self.take(chunk)
            elif cause == "resume" and time.time() - self.created > subjects.LOG_MAX_AGE:
                await self.end(error(self.cid, "not_found", f"request {self.rid} ended more than LOG_MAX_AGE="
                                                            f"{subjects.LOG_MAX_AGE:g} s ago: its tokens are gone"))
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
        if self.span.is_recording():
            self.end_span(frame)
        return True

    def end_span(self, frame: dict) -> None:
        """Ends its span with what its client got: the usage, the finish reason or the error's code."""
        s = self.span
        s.set_attributes({"gen_ai.usage.input_tokens": self.prompt_tokens, "gen_ai.usage.output_tokens": self.received,
                          "tokenbus.cached_tokens": self.cached_tokens, "tokenbus.worker": self.worker})
        if self.ttft is not None:
            s.set_attribute("tokenbus.ttft_ms", ms(self.ttft))
        if frame.get("code") == "resumed":         # streamed on by another connection: no error
            s.set_attribute("tokenbus.end", "resumed")
        elif frame.get("type") == "error":
            tracing.error(s, frame.get("code") or "error")
        else:
            s.set_attribute("gen_ai.response.finish_reasons", [frame.get("finish_reason") or ""])
        s.end()

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

"""Token chunks out to the gateway: each step's new tokens on tb.out.<request id>, paced under load, and
the final chunk at the end; what a gateway missed, resent; what a moved request's client has, asked
for; a remote prefill handed off to a decode worker once its first chunk is out.

Runs on the event loop, between engine steps: the step loop calls `emit` for each request a step
updated. `on_resend` is a subscription callback on the same loop; it takes the engine lock.

Given the shared State (state.py), whose `running` table it reads and takes ended requests off, and
whose `generation_tokens` it counts; the KV transport (a handoff's lease); records.py, which stores
each end; the chunk rate and the injected faults. It owns nothing else: a stream's state is its
Running entry."""
import asyncio
import dataclasses

import nats.errors

import bus
from bus import tracing
from schemas import subjects
from schemas.messages import (
    FinalChunk,
    Logprobs,
    Prefilled,
    Progress,
    Resend,
    TokenChunk,
    TokenizedRequest,
    decode,
    encode,
)
from schemas.wire import WireError
from text.detokenizer import PROMPT_CONTEXT
from workers.engine.request import Request
from workers.faults import Faults
from workers.kv_transfer import NatsKvTransport
from workers.service.records import Records
from workers.service.state import Running, State

PROGRESS_TIMEOUT = 0.5         # seconds a worker waits for the gateway to say what a moved request's client has


class Streaming:
    """The worker's streams: chunks, resends, progress, handoffs."""

    def __init__(self, state: State, records: Records, transport: NatsKvTransport, chunk_rate: float,
                 faults: Faults):
        self.nc, self.js, self.id, self.log = state.nc, state.js, state.id, state.log
        self.engine, self.engine_lock, self.running = state.engine, state.engine_lock, state.running
        self.spawn, self.counts = state.spawn, state.counts
        self.records, self.transport, self.faults = records, transport, faults
        self.chunk_rate = chunk_rate             # 0: a chunk per stream per step, however many streams

    def chunk_interval(self) -> float:
        """Seconds between two chunks of a stream, at least: under load (more streams than chunk_rate
        allows at a chunk per step each) a chunk carries the tokens of several steps. Each chunk costs
        every stage downstream (nats-server, the gateway, the client) about as much as its tokens."""
        return min(len(self.running) / self.chunk_rate, subjects.MAX_CHUNK_INTERVAL) if self.chunk_rate else 0.0

    async def emit(self, req: Request, now: float, interval: float = 0.0) -> None:
        """Publishes the request's tokens not sent yet: the first at once, the last with the final chunk,
        the others once `interval` has passed since the stream's last chunk. A remote prefill is handed
        off once its first chunk is out."""
        run = self.running.get(req.request_id)
        if run is None:
            return
        new = req.token_ids[req.num_prompt_tokens + run.sent:]
        if new and not run.first_token:
            run.first_token = now
        if not req.finished and (not new or (run.seq and now - run.published < interval)):
            return                               # nothing new, or held for the stream's next chunk
        self.counts.generation_tokens += len(new)
        if req.finished:
            await self.end(run, req, new, now)
        else:
            chunk = TokenChunk(req.request_id, run.seq, run.sent, new, req.num_prompt_tokens, run.tail,
                               max(req.num_cached_tokens, 0) if run.seq == 0 else 0, logprobs(req, run.sent))
            run.seq, run.sent, run.published = run.seq + 1, run.sent + len(new), now
            if not self.faults.drop_chunks or str(chunk.seq) not in self.faults.drop_chunks:   # off: one check
                await self.nc.publish(run.subject, encode(chunk))
            if run.item.prefill:
                self.hand_off(run, req)

    async def end(self, run: Running, req: Request, new: list[int], now: float) -> None:
        """The final chunk, then the request's records (records.py); one the engine failed is dead-lettered."""
        if req.finish_reason == "error":
            await self.failed(run, req)
            return
        del self.running[req.request_id]
        usage, timing = usage_of(run, req), timing_of(run, now)
        final = FinalChunk(req.request_id, run.seq, run.sent, new, req.finish_reason, req.stop_reason, usage, timing,
                           self.id, run.tail, logprobs(req, run.sent))
        if "final" not in self.faults.drop_chunks:
            await self.nc.publish(run.subject, encode(final))
        self.records.store_end(run, req, usage, timing)
        if run.trace is not None:
            trace_phases(run, req, self.id, now)

    async def failed(self, run: Running, req: Request) -> None:
        """The engine failed this request alone: it is dead-lettered at once (error chunk, outcome,
        dead letter) and its work item acked, so no worker runs it again."""
        del self.running[req.request_id]
        self.log.error("request failed", request_id=req.request_id, tenant=run.item.request.tenant,
                       error=req.error, output_tokens=req.num_output_tokens)
        await self.records.dead_letter(run.item, run.msg, "engine_error", req.error, run.strikes + 1,
                                       req.output_token_ids)

    async def on_resend(self, msg) -> None:
        """A gateway missed chunks of a request running here: its output tokens from the asked offset, up
        to those published so far (later ones come as chunks). Not running here: no answer."""
        try:
            ask = decode(msg.data, Resend)
        except WireError as e:
            self.log.error("bad resend dropped", error=str(e))
            return
        run = self.running.get(ask.id)
        if run is None or not msg.reply:
            return
        async with self.engine_lock:
            req = self.engine.requests.get(ask.id)
            out = req.output_token_ids[:run.sent] if req is not None else []
        r = run.item.request
        chunk = TokenChunk(ask.id, -1, ask.offset, out[ask.offset:], len(r.prompt_token_ids),
                           r.prompt_token_ids[-PROMPT_CONTEXT:])
        await self.nc.publish(msg.reply, encode(chunk))
        self.log.info("tokens resent", request_id=ask.id, offset=ask.offset, tokens=len(chunk.token_ids))

    async def progress(self, rid: str) -> list[int]:
        """The output tokens the client of a moved request has, as the gateway says; [] without an answer."""
        try:
            reply = await self.nc.request(subjects.progress(rid), b"", timeout=PROGRESS_TIMEOUT)
            got = decode(reply.data, Progress)
        except (nats.errors.Error, asyncio.TimeoutError, WireError) as e:
            self.log.info("no progress; starting from the prompt", request_id=rid, error=str(e) or type(e).__name__)
            return []
        return list(got.token_ids) if got.id == rid else []

    # -- disaggregated serving ------------------------------------------------------------------

    def hand_off(self, run: Running, req: Request) -> None:
        """A remote prefill is done (its first token published): the prompt's blocks are offered under a
        lease, the request leaves the engine, and it goes back to the router (TB_ROUTE) with what a decode
        worker needs to continue it. Its work item is acked once the handoff is stored."""
        bs = self.engine.config.block_size
        lease, hashes = self.transport.offer(req.request_id, req.block_hashes[:req.num_prompt_tokens // bs])
        r = run.item.request
        prefilled = Prefilled(self.id, lease, hashes, bs, req.output_token_ids, req.seed,
                              max(req.num_cached_tokens, 0), run.seq, run.received, run.first_token)
        self.engine.abort(req.request_id)        # its blocks are freed; the offered ones stay pinned
        del self.running[req.request_id]
        if run.trace is not None:
            trace_phases(run, req, self.id, run.first_token, handed_off=True)
        self.spawn(self.publish_handoff(run, dataclasses.replace(r, prefilled=prefilled)))
        self.log.info("request handed off", request_id=r.id, tenant=r.tenant, blocks=len(hashes),
                      prompt_tokens=req.num_prompt_tokens, output_tokens=req.num_output_tokens)

    async def publish_handoff(self, run: Running, handed: TokenizedRequest) -> None:
        """Stores the handoff (retried through a broker restart), then acks the prefill's work item. Not
        stored: the lease goes and the item stays unacked, so it comes again and is prefilled again."""
        rid = handed.id
        try:
            await bus.publish(self.js, subjects.route(handed.tenant, rid), encode(handed),
                              tracing.inject(subjects.msg_id(rid, f"{rid}.pd"), run.trace), self.log)
            await run.msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, bus.NotStored) as e:
            await self.transport.released(rid)
            self.log.error("handoff not stored; the prefill will run again", request_id=rid,
                           error=str(e) or type(e).__name__)


def trace_phases(run: Running, req: Request, worker: str, now: float, handed_off: bool = False) -> None:
    """The request's spans on this worker, made as it leaves it (no tracing work per token or step): `prefill`,
    from entering the engine to its first token (none for a request prefilled elsewhere), and `decode`, from
    then to `now` (none for a prefill handed off). attempt > 0: a moved request (a migration)."""
    base = {"tokenbus.request_id": req.request_id, "tokenbus.worker": worker, "tokenbus.attempt": run.item.attempt}
    first = run.first_token or now
    if run.item.request.prefilled is None:
        tracing.start("prefill", run.trace, {**base, "gen_ai.usage.input_tokens": req.num_prompt_tokens,
                                             "tokenbus.cached_tokens": max(req.num_cached_tokens, 0),
                                             "tokenbus.resumed_tokens": req.num_resumed_tokens},
                      start_time=tracing.ns(run.entered)).end(tracing.ns(first))
    if not handed_off:
        tracing.start("decode", run.trace, {**base, "gen_ai.usage.output_tokens": req.num_output_tokens,
                                            "gen_ai.response.finish_reasons": [req.finish_reason or ""]},
                      start_time=tracing.ns(first if run.item.request.prefilled is None else run.entered)
                      ).end(tracing.ns(now))


def usage_of(run: Running, req: Request) -> dict:
    """The final chunk's and the records' usage; a handed-off request's prefix hit is the prefill worker's."""
    return {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": req.num_output_tokens,
            "cached_tokens": run.cached_tokens if run.cached_tokens >= 0 else max(req.num_cached_tokens, 0)}


def timing_of(run: Running, now: float) -> dict:
    """The request's times in ms, those known: queue (since the gateway made it), intake (since it was
    stored), time to first token and end to end (since it got here)."""
    created = run.item.request.created
    timing = {"queue_ms": max(0.0, run.received - created) * 1e3 if created else None,
              "intake_ms": max(0.0, run.received - run.stored) * 1e3 if run.stored else None,
              "ttft_ms": (run.first_token - run.received) * 1e3 if run.first_token else None,
              "e2e_ms": (now - run.received) * 1e3}
    return {k: round(v, 3) for k, v in timing.items() if v is not None}


def logprobs(req: Request, start: int) -> Logprobs | None:
    """The logprobs of output tokens from `start` on, for a request that asked for them."""
    if req.params.logprobs is None:
        return None
    lps = req.logprobs[start - req.num_resumed_tokens:]    # tokens it resumed after came without theirs
    return Logprobs([t.logprob for t in lps], [[i for i, _ in t.top] for t in lps],
                    [[v for _, v in t.top] for t in lps])

"""The worker process: one asyncio loop that alternates engine steps with NATS work.

Each turn of the step loop runs one engine step, publishes every request's new tokens (core NATS
writes are buffered: publishing never waits on the network), then yields once so that fetched
work items, cancels, acks and heartbeats are handled between steps. One thread, on purpose: a
second Python thread for I/O fights the step for the GIL at every torch call (measured: 30% of
throughput on CPU; docs/decisions.md)."""
import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass

import nats
import nats.errors

from schemas import subjects
from schemas.detokenizer import PROMPT_CONTEXT
from schemas.log import configure
from schemas.messages import (
    Cancel,
    Completion,
    ErrorChunk,
    FinalChunk,
    Heartbeat,
    KvEvent,
    KvSnapshot,
    Logprobs,
    TokenChunk,
    WorkItem,
    encode,
    received,
)
from schemas.sampling import SamplingParams
from workers.distributed import WorkerFailure
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.request import Request

CANCEL_MEMORY = 120.0          # seconds a cancel for a request not seen yet is remembered
FETCH_BATCH = 64
INTAKE_TURNS = 4               # event-loop turns between steps: a message takes a few to reach its handler


@dataclass(slots=True)
class Running:
    """What the service knows of a request in the engine."""
    item: WorkItem
    msg: object                     # the JetStream message, acked when the request ends
    received: float                 # time.time() it arrived
    first_token: float = 0.0
    sent: int = 0                   # output tokens published
    seq: int = 0                    # chunks published
    subject: str = ""               # tb.out.<request id>

    @property
    def tail(self) -> list[int]:
        """The detokenizer's context, sent with the first chunk only."""
        return self.item.request.prompt_token_ids[-PROMPT_CONTEXT:] if self.seq == 0 else []


class WorkerService:
    def __init__(self, nc, engine: LLMEngine, worker_id: str, model_name: str, log):
        self.nc, self.js = nc, nc.jetstream()
        self.engine, self.id, self.model_name, self.log = engine, subjects.token("worker", worker_id), model_name, log
        self.running: dict[str, Running] = {}
        self.cancelled: dict[str, float] = {}        # cancels that came before their request
        self.finished = 0
        self.prompt_tokens = self.generation_tokens = 0     # counters for the heartbeat (metrics)
        self.tasks: set[asyncio.Task] = set()
        self.wake = asyncio.Event()                  # set when work arrives for an idle engine
        self.stop = asyncio.Event()
        self.failed = False
        self.kv_seq = 0                              # KV events published

    async def run(self) -> None:
        await subjects.ensure_streams(self.js)
        self.registry = await subjects.registry(self.js)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self.on_cancel)
        self.engine.kv.record_changes()
        await self.nc.subscribe(subjects.kv_snapshot(self.id), cb=self.on_snapshot)
        await self.heartbeat()
        self.log.info("worker ready", model=self.model_name, kv_blocks=self.engine.kv.num_blocks)
        loops = [asyncio.create_task(f()) for f in (self.step_loop, self.fetch_loop, self.heartbeat_loop,
                                                     self.progress_loop)]
        await self.stop.wait()
        for t in loops:
            t.cancel()
        await self.leave()

    async def leave(self) -> None:
        try:
            await self.registry.delete(self.id)
            await subjects.close(self.nc)
        except Exception as e:                   # the server may be gone already
            self.log.warning("leaving uncleanly", error=str(e))

    # -- the step loop --------------------------------------------------------------------------

    async def step_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self.wake.clear()
                await self.wake.wait()
            try:
                updated = self.engine.step()
            except Exception as e:               # a bug in the engine: report it to every request and stop
                self.fail(e)
                return
            now = time.time()
            for req in updated:
                await self.emit(req, now)
            if self.engine.kv.changes:
                await self.publish_kv()
            for _ in range(INTAKE_TURNS):        # fetches, cancels, acks, heartbeats
                await asyncio.sleep(0)

    async def emit(self, req: Request, now: float) -> None:
        run = self.running.get(req.request_id)
        if run is None:
            return
        out = req.output_token_ids
        new = out[run.sent:]
        self.generation_tokens += len(new)
        if new and not run.first_token:
            run.first_token = now
        if req.finished:
            await self.end(run, req, new, now)
        elif new:
            chunk = TokenChunk(req.request_id, run.seq, run.sent, new, req.num_prompt_tokens, run.tail,
                               max(req.num_cached_tokens, 0) if run.seq == 0 else 0, logprobs(req, run.sent))
            run.seq, run.sent = run.seq + 1, len(out)
            await self.nc.publish(run.subject, encode(chunk))

    async def end(self, run: Running, req: Request, new: list[int], now: float) -> None:
        rid, r = req.request_id, run.item.request
        del self.running[rid]
        usage = {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": req.num_output_tokens,
                 "cached_tokens": max(req.num_cached_tokens, 0)}
        timing = {"queue_ms": max(0.0, run.received - r.created) * 1e3 if r.created else None,
                  "ttft_ms": (run.first_token - run.received) * 1e3 if run.first_token else None,
                  "e2e_ms": (now - run.received) * 1e3}
        timing = {k: round(v, 3) for k, v in timing.items() if v is not None}
        final = FinalChunk(rid, run.seq, run.sent, new, req.finish_reason, req.stop_reason, usage, timing, self.id,
                           run.tail, logprobs(req, run.sent))
        await self.nc.publish(run.subject, encode(final))
        record = Completion(rid, r.tenant, self.id, r.sampling, r.prompt_token_ids, req.output_token_ids,
                            req.finish_reason, req.stop_reason, usage, timing, r.created)
        self.spawn(self.record(rid, r.tenant, record, run.msg))
        self.finished += 1
        self.log.info("request finished", request_id=rid, tenant=r.tenant, finish_reason=req.finish_reason,
                      **usage, **timing)

    async def record(self, rid: str, tenant: str, record: Completion, msg) -> None:
        """Stores the completion record, then acks the work item (not acked: JetStream redelivers)."""
        try:
            await self.js.publish(subjects.done(tenant), encode(record), headers=subjects.msg_id(rid))
            await msg.ack()
        except nats.errors.Error as e:
            self.log.error("completion not stored", request_id=rid, error=str(e))

    def fail(self, error: Exception) -> None:
        self.failed = True
        self.log.error("engine failed; stopping", error=str(error) if isinstance(error, WorkerFailure) else repr(error))
        for rid in list(self.running):
            self.spawn(self.nc.publish(subjects.out(rid), encode(ErrorChunk(rid, "worker_failed", repr(error)))))
        self.stop.set()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- KV events (the router's prefix index) -------------------------------------------------

    async def publish_kv(self) -> None:
        stored, removed = self.engine.kv.take_changes()
        self.kv_seq += 1
        await self.nc.publish(subjects.kv_events(self.id), encode(KvEvent(self.id, self.kv_seq, stored, removed)))

    async def on_snapshot(self, msg) -> None:
        """Every hash held now, labelled with the last event's seq: changes not yet published are in the
        snapshot and come again in the next event, which applies twice without harm."""
        hashes, part = list(self.engine.kv.cached), subjects.KV_SNAPSHOT_PART
        parts = max(1, -(-len(hashes) // part))
        for i in range(parts):
            snap = KvSnapshot(self.id, self.kv_seq, i, parts, hashes[i * part:(i + 1) * part])
            await self.nc.publish(msg.reply, encode(snap))

    # -- intake (runs between steps) ------------------------------------------------------------

    async def fetch_loop(self) -> None:
        limit = 4 * self.engine.config.max_num_seqs   # beyond this, work waits in the stream
        await subjects.consume(self.nc, subjects.WORK_STREAM, subjects.worker_consumer(self.id), self.take, self.log,
                               FETCH_BATCH, room=lambda: limit - len(self.running))

    async def take(self, msg) -> None:
        if (item := received(msg, WorkItem, self.log, "work item")) is None:
            await msg.term()
            return
        r = item.request
        if r.id in self.running:                 # redelivered while it runs: keep the newest handle
            self.running[r.id].msg = msg
            return
        try:
            self.engine.add_request(r.id, r.prompt_token_ids, r.sampling, r.cache_salt)
        except ValueError as e:
            self.log.info("request rejected", request_id=r.id, tenant=r.tenant, error=str(e))
            await self.nc.publish(subjects.out(r.id), encode(ErrorChunk(r.id, "invalid_request", str(e))))
            await msg.term()
            return
        self.running[r.id] = Running(item, msg, time.time(), subject=subjects.out(r.id))
        self.prompt_tokens += len(r.prompt_token_ids)
        self.log.info("request started", request_id=r.id, tenant=r.tenant, attempt=item.attempt,
                      prompt_tokens=len(r.prompt_token_ids))
        if self.cancelled.pop(r.id, None) is not None:
            await self.abort(r.id)
        self.wake.set()

    async def on_cancel(self, msg) -> None:
        if (cancel := received(msg, Cancel, self.log, "cancel")) is None:
            return
        if cancel.id in self.running:
            await self.abort(cancel.id)
            return
        now = time.time()
        self.cancelled[cancel.id] = now
        if len(self.cancelled) > 10_000:
            self.cancelled = {k: t for k, t in self.cancelled.items() if now - t < CANCEL_MEMORY}

    async def abort(self, rid: str) -> None:
        """Ends the request now and frees its KV; it ends like any other (final chunk, record, ack)."""
        req = self.engine.abort(rid)
        if req is not None:
            await self.emit(req, time.time())

    # -- liveness -------------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)
            try:
                self.engine.check_alive()        # a dead tensor-parallel rank: no heartbeat, leave
            except WorkerFailure as e:
                self.fail(e)
                return
            try:
                await self.heartbeat()
            except nats.errors.Error as e:
                self.log.warning("heartbeat failed", error=str(e))

    async def heartbeat(self) -> None:
        s = self.engine.stats()
        await self.registry.put(self.id, encode(Heartbeat(
            self.id, time.time(), self.model_name, self.engine.config.block_size, self.engine.config.max_num_seqs,
            s["running"], s["waiting"], s["kv_blocks_total"], s["kv_blocks_free"], s["prefix_cache_queries"],
            s["prefix_cache_hits"], self.finished, s["preemptions"], self.prompt_tokens, self.generation_tokens,
            self.queued_blocks())))

    def queued_blocks(self) -> int:
        return sum(self.engine.kv.num_blocks_for(r.num_tokens) for r in self.engine.scheduler.waiting)

    async def progress_loop(self) -> None:
        """In-progress acks keep JetStream from redelivering work that is still running."""
        while True:
            await asyncio.sleep(subjects.IN_PROGRESS_SECONDS)
            for run in list(self.running.values()):
                try:
                    await run.msg.in_progress()
                except nats.errors.Error as e:
                    self.log.warning("in-progress ack failed", request_id=run.item.request.id, error=str(e))


def logprobs(req: Request, start: int) -> Logprobs | None:
    """The logprobs of output tokens from `start` on, for a request that asked for them."""
    if req.params.logprobs is None:
        return None
    lps = req.logprobs[start:]
    return Logprobs([t.logprob for t in lps], [[i for i, _ in t.top] for t in lps],
                    [[v for _, v in t.top] for t in lps])


# -- the process ----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.service", description="A tokenbus worker.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--id", default=f"w-{os.getpid()}", help="worker id (a subject token)")
    p.add_argument("--dtype", help="float32, bfloat16, ... (default: float32 on CPU, the checkpoint's on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="ranks of this replica: this process and tp-1 followers it starts")
    p.add_argument("--threads", type=int, help="torch threads for the engine (default: torch's, one per core); "
                   "the tokens do not depend on it")
    return p


def engine_config(args) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        tensor_parallel_size=args.tp)


async def serve(args) -> None:
    model = args.model
    log = configure("worker").bind(worker=args.id)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    engine = LLMEngine(model, engine_config(args))
    try:
        warm_up(engine)
        nc = await subjects.connect(args.nats_url, f"worker-{args.id}", log)
        service = WorkerService(nc, engine, args.id, os.path.basename(os.path.normpath(model)), log)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop.set)
        await service.run()
    finally:
        engine.close()
    if service.failed:
        sys.exit(1)


def warm_up(engine: LLMEngine) -> None:
    """One short request through the engine before the worker registers, so the first real request
    does not pay for lazy initialisation (allocator, kernels, thread pools)."""
    engine.add_request("warm-up", [0] * 8, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.kv.reset_prefix_cache()
    engine.kv.prefix_queries = engine.kv.prefix_hits = 0


def main(argv=None) -> None:
    subjects.run(serve(parser().parse_args(argv)))


if __name__ == "__main__":
    main()

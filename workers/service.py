"""The worker process: the engine's step loop in its own thread, NATS on the asyncio loop.

asyncio side: fetches work items from tb.work.<worker>, takes cancels (tb.cancel.*), publishes
chunks, final chunks and completion records, acks, sends in-progress acks and heartbeats.
Engine thread: drains the inbox between steps, steps, hands the step's output to the loop. The
step never waits on the network; the loop never waits on a step."""
import argparse
import asyncio
import collections
import os
import signal
import threading
import time
from dataclasses import dataclass, field

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
    TokenChunk,
    WireError,
    WorkItem,
    decode,
    encode,
)
from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.request import Request

CANCEL_MEMORY = 120.0          # seconds a cancel for a request not seen yet is remembered
FETCH_BATCH = 64


@dataclass(slots=True)
class Running:
    """What the asyncio side knows of a request in the engine."""
    item: WorkItem
    msg: object                     # the JetStream message, acked when the request ends
    received: float                 # time.time() it arrived
    first_token: float = 0.0
    sent: int = 0                   # output tokens published
    seq: int = 0                    # chunks published

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.item.request.prompt_token_ids)


@dataclass(slots=True)
class Output:
    """One request's news from one engine step, made on the engine thread."""
    request_id: str
    token_ids: list[int]            # the whole output so far (the loop slices what is new)
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class EngineThread:
    """Runs the step loop; `submit` and `cancel` are safe from any thread."""
    engine: LLMEngine
    deliver: object                                  # takes list[Output] (None: the engine failed); thread-safe
    inbox: collections.deque = field(default_factory=collections.deque)
    wake: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False
    error: BaseException | None = None

    def submit(self, item: WorkItem) -> None:
        self.inbox.append(("add", item))
        self.wake.set()

    def cancel(self, request_id: str) -> None:
        self.inbox.append(("cancel", request_id))
        self.wake.set()

    def run(self) -> None:
        try:
            while not self.stopped:
                outputs = self.drain()
                if self.engine.has_unfinished():
                    outputs += [self.output(r) for r in self.engine.step()]
                elif not outputs:
                    self.wake.wait(0.05)
                    self.wake.clear()
                if outputs:
                    self.deliver(outputs)
        except BaseException as e:          # a bug in the engine: the service reports it and stops
            self.error = e
            self.deliver(None)

    def drain(self) -> list[Output]:
        outputs = []
        while self.inbox:
            kind, arg = self.inbox.popleft()
            if kind == "add":
                r = arg.request
                try:
                    self.engine.add_request(r.id, r.prompt_token_ids, r.sampling, r.cache_salt)
                except ValueError as e:
                    outputs.append(Output(r.id, [], True, "error", str(e)))
            elif (req := self.engine.abort(arg)) is not None:
                outputs.append(Output(req.request_id, req.output_token_ids, True, "abort"))
        return outputs

    @staticmethod
    def output(req: Request) -> Output:
        return Output(req.request_id, req.output_token_ids, req.finished, req.finish_reason, req.stop_reason,
                      max(req.num_cached_tokens, 0))


class WorkerService:
    def __init__(self, nc, engine: LLMEngine, worker_id: str, model_name: str, log):
        self.nc, self.js = nc, nc.jetstream()
        self.engine, self.id, self.model_name, self.log = engine, subjects.token("worker", worker_id), model_name, log
        self.running: dict[str, Running] = {}
        self.cancelled: dict[str, float] = {}        # cancels that came before their request
        self.finished = 0
        self.tasks: set[asyncio.Task] = set()
        self.stop = asyncio.Event()
        self.thread: EngineThread | None = None
        self.outbox: asyncio.Queue[list[Output] | None] = asyncio.Queue()

    async def run(self) -> None:
        await subjects.ensure_streams(self.js)
        self.registry = await subjects.registry(self.js)
        await self.js.add_consumer(subjects.WORK_STREAM, subjects.worker_consumer(self.id))
        self.pull = await self.js.pull_subscribe_bind(f"worker-{self.id}", stream=subjects.WORK_STREAM)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self.on_cancel)
        loop = asyncio.get_running_loop()
        self.thread = EngineThread(self.engine, lambda out: loop.call_soon_threadsafe(self.outbox.put_nowait, out))
        stepper = threading.Thread(target=self.thread.run, name="engine", daemon=True)
        stepper.start()
        await self.heartbeat()
        self.log.info("worker ready", model=self.model_name, kv_blocks=self.engine.kv.num_blocks)
        loops = [asyncio.create_task(f()) for f in (self.fetch_loop, self.publish_loop, self.heartbeat_loop,
                                                     self.progress_loop)]
        await self.stop.wait()
        for t in loops:
            t.cancel()
        self.thread.stopped = True
        self.thread.wake.set()
        stepper.join(timeout=5)
        await self.leave()

    async def leave(self) -> None:
        try:
            await self.registry.delete(self.id)
            await subjects.close(self.nc)
        except Exception as e:                   # the server may be gone already
            self.log.warning("leaving uncleanly", error=str(e))

    # -- intake ---------------------------------------------------------------------------------

    async def fetch_loop(self) -> None:
        limit = 4 * self.engine.config.max_num_seqs   # beyond this, work waits in the stream (any worker could
        while True:                                   # not take it sooner: it is routed here)
            room = limit - len(self.running)
            if room <= 0:
                await asyncio.sleep(0.01)
                continue
            try:
                msgs = await self.pull.fetch(batch=min(room, FETCH_BATCH), timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error as e:
                self.log.warning("fetch failed", error=str(e))
                await asyncio.sleep(0.1)
                continue
            for msg in msgs:
                await self.take(msg)

    async def take(self, msg) -> None:
        try:
            item = decode(msg.data, WorkItem)
        except WireError as e:
            self.log.error("bad work item dropped", error=str(e), subject=msg.subject)
            await msg.term()
            return
        rid = item.request.id
        if rid in self.running:                  # redelivered while it runs: keep the newest handle
            self.running[rid].msg = msg
            return
        self.running[rid] = Running(item, msg, time.time())
        if self.cancelled.pop(rid, None) is not None:
            self.thread.cancel(rid)
        self.thread.submit(item)

    async def on_cancel(self, msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except WireError as e:
            self.log.error("bad cancel dropped", error=str(e), subject=msg.subject)
            return
        if cancel.id in self.running:
            self.thread.cancel(cancel.id)
        else:
            now = time.time()
            self.cancelled[cancel.id] = now
            if len(self.cancelled) > 10_000:
                self.cancelled = {k: t for k, t in self.cancelled.items() if now - t < CANCEL_MEMORY}

    # -- output ---------------------------------------------------------------------------------

    async def publish_loop(self) -> None:
        """Publishes each step's news in step order: every request's new tokens (core NATS writes are
        buffered, so this rarely waits), final chunks, then completion records and acks in tasks."""
        while True:
            outputs = await self.outbox.get()
            if outputs is None:
                self.fail(self.thread.error)
                return
            now = time.time()
            for out in outputs:
                run = self.running.get(out.request_id)
                if run is None:
                    continue
                new = out.token_ids[run.sent:]
                if new and not run.first_token:
                    run.first_token = now
                if out.finished:
                    await self.end(run, out, new, now)
                elif new:
                    chunk = TokenChunk(out.request_id, run.seq, run.sent, new, run.num_prompt_tokens, self.tail(run))
                    run.seq, run.sent = run.seq + 1, len(out.token_ids)
                    await self.nc.publish(subjects.out(out.request_id), encode(chunk))

    async def end(self, run: Running, out: Output, new: list[int], now: float) -> None:
        rid, r = out.request_id, run.item.request
        del self.running[rid]
        if out.finish_reason == "error":
            await self.nc.publish(subjects.out(rid), encode(ErrorChunk(rid, "rejected", str(out.stop_reason))))
            self.spawn(run.msg.term())
            self.log.info("request rejected", request_id=rid, error=str(out.stop_reason))
            return
        usage = {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": len(out.token_ids),
                 "cached_tokens": out.num_cached_tokens}
        timing = {"queue_ms": max(0.0, run.received - r.created) * 1e3 if r.created else None,
                  "ttft_ms": (run.first_token - run.received) * 1e3 if run.first_token else None,
                  "e2e_ms": (now - run.received) * 1e3}
        timing = {k: round(v, 3) for k, v in timing.items() if v is not None}
        final = FinalChunk(rid, run.seq, run.sent, new, out.finish_reason, out.stop_reason, usage, timing, self.id,
                           self.tail(run))
        await self.nc.publish(subjects.out(rid), encode(final))
        record = Completion(rid, r.tenant, self.id, r.sampling, r.prompt_token_ids, out.token_ids,
                            out.finish_reason, out.stop_reason, usage, timing, r.created)
        self.spawn(self.record(rid, r.tenant, record, run.msg))
        self.finished += 1
        self.log.info("request finished", request_id=rid, tenant=r.tenant, finish_reason=out.finish_reason,
                      **usage, **timing)

    @staticmethod
    def tail(run: Running) -> list[int]:
        return run.item.request.prompt_token_ids[-PROMPT_CONTEXT:] if run.seq == 0 else []

    async def record(self, rid: str, tenant: str, record: Completion, msg) -> None:
        """Stores the completion record, then acks the work item (not acked: JetStream redelivers)."""
        try:
            await self.js.publish(subjects.done(tenant), encode(record), headers=subjects.msg_id(rid))
            await msg.ack()
        except nats.errors.Error as e:
            self.log.error("completion not stored", request_id=rid, error=str(e))

    def fail(self, error: BaseException) -> None:
        self.log.error("engine failed; stopping", error=repr(error))
        for rid in list(self.running):
            self.spawn(self.nc.publish(subjects.out(rid), encode(ErrorChunk(rid, "worker_failed", repr(error)))))
        self.stop.set()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- liveness -------------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)
            try:
                await self.heartbeat()
            except nats.errors.Error as e:
                self.log.warning("heartbeat failed", error=str(e))

    async def heartbeat(self) -> None:
        s = self.engine.stats()
        await self.registry.put(self.id, encode(Heartbeat(
            self.id, time.time(), self.model_name, self.engine.config.block_size, self.engine.config.max_num_seqs,
            s["running"], s["waiting"], s["kv_blocks_total"], s["kv_blocks_free"], s["prefix_cache_queries"],
            s["prefix_cache_hits"], self.finished)))

    async def progress_loop(self) -> None:
        """In-progress acks keep JetStream from redelivering work that is still running."""
        while True:
            await asyncio.sleep(subjects.IN_PROGRESS_SECONDS)
            for run in list(self.running.values()):
                try:
                    await run.msg.in_progress()
                except nats.errors.Error as e:
                    self.log.warning("in-progress ack failed", request_id=run.item.request.id, error=str(e))


# -- the process ----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.service", description="A tokenbus worker.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--id", default=f"w-{os.getpid()}", help="worker id (a subject token)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    return p


def engine_config(args) -> EngineConfig:
    return EngineConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching)


async def serve(args) -> None:
    model = args.model
    engine = LLMEngine(model, engine_config(args))
    warm_up(engine)
    log = configure("worker").bind(worker=args.id)
    nc = await subjects.connect(args.nats_url, f"worker-{args.id}", log)
    service = WorkerService(nc, engine, args.id, os.path.basename(os.path.normpath(model)), log)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop.set)
    await service.run()


def warm_up(engine: LLMEngine) -> None:
    """One short request through the engine before the worker registers, so the first real request
    does not pay for lazy initialisation (allocator, kernels, thread pools)."""
    engine.add_request("warm-up", [0] * 8, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.kv.reset_prefix_cache()
    engine.kv.prefix_queries = engine.kv.prefix_hits = 0


def main(argv=None) -> None:
    asyncio.run(serve(parser().parse_args(argv)))


if __name__ == "__main__":
    main()

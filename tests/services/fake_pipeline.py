"""A gateway on a free port (uvicorn in the test's event loop, or in a thread for synchronous
clients) with the rest of the pipeline played by a scripted fake (Downstream) on a real nats-server,
answering with the tiny model's token ids and registering fake workers' heartbeats."""
import asyncio
import concurrent.futures
import contextlib
import threading
import time

import nats
import uvicorn
from tokenizers import Tokenizer

import bus
from bus.log import configure
from ops.procs import free_port
from schemas import subjects
from schemas.messages import (
    Cancel,
    Completion,
    FinalChunk,
    GenerateRequest,
    Heartbeat,
    Resend,
    TokenChunk,
    decode,
    encode,
)
from services.gateway.app import create_app, server_config

PROMPT_TOKENS = 9


LOG = configure("fake-pipeline")


def heartbeat(worker: str = "fake", running: int = 0, waiting: int = 0, max_num_seqs: int = 256,
              kv_blocks: int = 4096, block_size: int = 16) -> Heartbeat:
    return Heartbeat(worker, time.time(), "tiny", block_size, max_num_seqs, running, waiting, kv_blocks, kv_blocks,
                     0, 0, 0)


def said(req: GenerateRequest) -> str:
    if req.messages is not None:
        return req.messages[-1]["content"]
    return req.prompt if req.prompt is not None else f"{len(req.prompt_token_ids)} tokens"


class Downstream:
    """Tokenizer, router and worker in one: takes GenerateRequests from tb.req.new.>, runs `script` on
    each, records cancels. The default script answers " echo <what was said>" one token per chunk and
    holds (sends nothing) when told "hold"."""

    def __init__(self, nc, tok: Tokenizer, script=None):
        self.nc, self.tok, self.script = nc, tok, script or Downstream.echo
        self.tail = tok.encode("<|im_start|>assistant\n").ids[-4:]
        self.requests: list[GenerateRequest] = []
        self.cancels: list[Cancel] = []
        self.tasks = set()
        self.ws = self.http = ""                           # the gateway's urls
        self.beats: dict[str, Heartbeat] = {}             # the fake workers, refreshed every second
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self, requests: bool = True, workers: int = 1) -> None:
        if requests:   # from the stream, as the tokenizer takes them: a core subscription made right after
            await self.nc.jetstream().subscribe(      # the streams were created can miss them (at-most-once)
                "tb.req.new.>", cb=self.on_request, ordered_consumer=True)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self.on_cancel)
        self.kv = await bus.registry(self.nc.jetstream())
        for i in range(workers):
            await self.register(heartbeat(f"fake{i}"))
        self.spawn(self.beat())
        await self.nc.flush()

    async def register(self, hb: Heartbeat) -> None:
        """Puts hb in the registry now and keeps it fresh until it is replaced or dropped."""
        self.beats[hb.worker] = hb
        await self.kv.put(hb.worker, encode(hb))

    async def drop(self, worker: str) -> None:
        del self.beats[worker]
        await self.kv.delete(worker)

    async def beat(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for hb in list(self.beats.values()):
                hb.ts = time.time()
                await self.kv.put(hb.worker, encode(hb))

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def on_request(self, msg) -> None:
        req = decode(msg.data, GenerateRequest)
        self.requests.append(req)
        self.spawn(self.script(self, req))

    async def on_cancel(self, msg) -> None:
        self.cancels.append(decode(msg.data, Cancel))

    async def publish(self, rid: str, *msgs) -> None:
        for m in msgs:
            await self.nc.publish(subjects.out(rid), m if isinstance(m, bytes) else encode(m))

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def chunk(self, rid: str, offset: int, ids: list[int]) -> TokenChunk:
        return TokenChunk(rid, offset, offset, ids, PROMPT_TOKENS, self.tail if offset == 0 else [])

    def final(self, rid: str, offset: int, ids: list[int], reason: str = "length") -> FinalChunk:
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": offset + len(ids)}
        return FinalChunk(rid, offset, offset, ids, reason, usage=usage, prompt_tail=self.tail if offset == 0 else [])

    async def reply(self, req: GenerateRequest, text: str, reason: str = "length") -> None:
        ids = self.ids(text)
        for i, t in enumerate(ids[:-1]):
            await self.publish(req.id, self.chunk(req.id, i, [t]))
            await asyncio.sleep(0.001)                     # concurrent requests interleave
        await self.publish(req.id, self.final(req.id, len(ids) - 1, ids[-1:], reason))

    async def stream(self, req: GenerateRequest, text: str, pace: float, per: int = 1) -> None:
        """As a worker does: text `per` tokens a chunk every `pace` seconds, Resend answered with the tokens
        published so far, the end record stored before the final chunk."""
        ids, sent = self.ids(text), 0

        async def resend(msg):
            ask = decode(msg.data, Resend)
            chunk = TokenChunk(req.id, -1, ask.offset, ids[ask.offset:sent], PROMPT_TOKENS, self.tail)
            await self.nc.publish(msg.reply, encode(chunk))

        sub = await self.nc.subscribe(subjects.resend(req.id), cb=resend)
        for i in range(0, len(ids) - 1, per):
            part = ids[i:min(i + per, len(ids) - 1)]
            await self.publish(req.id, self.chunk(req.id, i, part))
            sent = i + len(part)
            await asyncio.sleep(pace)
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(ids)}
        record = Completion(req.id, req.tenant, "fake0", req.sampling, self.tail, ids, "length", None, usage)
        await bus.store_end(self.nc.jetstream(), req.tenant, req.id, None, encode(record), LOG)
        await sub.unsubscribe()
        await self.publish(req.id, self.final(req.id, len(ids) - 1, ids[-1:]))

    async def echo(self, req: GenerateRequest) -> None:
        if said(req) != "hold":
            await self.reply(req, f" echo {said(req)}")

    def cancelled(self, reason: str) -> set[str]:
        return {c.id for c in self.cancels if c.reason == reason}


@contextlib.asynccontextmanager
async def gateway(nats_url: str, model: str, tok: Tokenizer, script=None, requests: bool = True, workers: int = 1,
                  **options):
    """A gateway on a free port (uvicorn in this event loop) and the fake downstream with `workers`
    fake heartbeats; `options` go to create_app (api_keys, max_tokens); the model is served as "tiny"."""
    port = free_port()
    options.setdefault("model_name", "tiny")
    server = uvicorn.Server(server_config(create_app(nats_url, model, **options), "127.0.0.1", port))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "the gateway did not start"
        await asyncio.sleep(0.01)
    nc = await nats.connect(nats_url)
    down = Downstream(nc, tok, script)
    await down.start(requests, workers)
    down.ws, down.http = f"ws://127.0.0.1:{port}/ws", f"http://127.0.0.1:{port}"
    down.loop, down.app = asyncio.get_running_loop(), server.config.app
    seen = down.app.state.gateway.admission.cluster.workers
    async with asyncio.timeout(10):               # its registry watch has the fake workers: none is refused 503
        while len(seen) < workers:
            await asyncio.sleep(0.01)
    try:
        yield down
    finally:
        for t in list(down.tasks):
            t.cancel()
        server.should_exit = True
        await serving
        await nc.close()


@contextlib.contextmanager
def served(nats_url: str, model: str, tok: Tokenizer, script=None, **options):
    """`gateway` in an event loop of its own thread, for synchronous clients (openai, selenium,
    schemathesis); down.call(coro) runs a coroutine there."""
    ready, loop = concurrent.futures.Future(), asyncio.new_event_loop()

    async def main():
        try:
            async with gateway(nats_url, model, tok, script, **options) as down:
                stop = asyncio.Event()
                ready.set_result((down, stop))
                await stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            raise

    def run() -> None:
        loop.run_until_complete(main())
        left = asyncio.all_tasks(loop)            # nats-py's own, of closed subscriptions
        for t in left:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    down, stop = ready.result(timeout=30)
    down.call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)
    try:
        yield down
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()

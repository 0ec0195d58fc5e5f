"""A gateway on a free port (uvicorn in the test's event loop) with the rest of the pipeline played
by a scripted fake (Downstream) on a real nats-server, answering with the tiny model's token ids."""
import asyncio
import contextlib

import nats
import uvicorn
from tokenizers import Tokenizer

from ops.procs import free_port
from schemas import subjects
from schemas.messages import Cancel, FinalChunk, GenerateRequest, TokenChunk, decode, encode
from services.gateway.app import create_app, server_config

PROMPT_TOKENS = 9


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

    async def start(self, requests: bool = True) -> None:
        if requests:   # from the stream, as the tokenizer takes them: a core subscription made right after
            await self.nc.jetstream().subscribe(      # the streams were created can miss them (at-most-once)
                "tb.req.new.>", cb=self.on_request, ordered_consumer=True)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self.on_cancel)
        await self.nc.flush()

    async def on_request(self, msg) -> None:
        req = decode(msg.data, GenerateRequest)
        self.requests.append(req)
        task = asyncio.create_task(self.script(self, req))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

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

    async def echo(self, req: GenerateRequest) -> None:
        if said(req) != "hold":
            await self.reply(req, f" echo {said(req)}")

    def cancelled(self, reason: str) -> set[str]:
        return {c.id for c in self.cancels if c.reason == reason}


@contextlib.asynccontextmanager
async def gateway(nats_url: str, model: str, tok: Tokenizer, script=None, requests: bool = True):
    """A gateway on a free port (uvicorn in this event loop) and the fake downstream."""
    port = free_port()
    server = uvicorn.Server(server_config(create_app(nats_url, model), "127.0.0.1", port))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "the gateway did not start"
        await asyncio.sleep(0.01)
    nc = await nats.connect(nats_url)
    down = Downstream(nc, tok, script)
    await down.start(requests)
    down.ws, down.http = f"ws://127.0.0.1:{port}/ws", f"http://127.0.0.1:{port}"
    try:
        yield down
    finally:
        server.should_exit = True
        await serving
        await nc.close()

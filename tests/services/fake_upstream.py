"""A fake OpenAI-compatible upstream for the gateway's fallback: /v1/chat/completions and /v1/completions on
a free 127.0.0.1 port (uvicorn in a thread of its own), streamed and not, answering WORDS. It records every
request (body and authorization) and can be told to fail: `status` (a 5xx or 4xx answer), `hang` (no
answer), `cut` (a stream that stops after its first chunk)."""
import asyncio
import contextlib
import threading
import time

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ops.procs import free_port

WORDS = ["fallback", " says", " hi"]
USAGE = {"prompt_tokens": 7, "completion_tokens": len(WORDS), "total_tokens": 7 + len(WORDS),
         "prompt_tokens_details": {"cached_tokens": 2}}


class FakeUpstream:
    def __init__(self):
        self.requests: list[dict] = []           # each request's body, with its "authorization" header added
        self.status = 200
        self.hang = self.cut = False
        self.url = ""

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                 Route("/v1/completions", self.completions, methods=["POST"])])

    async def chat(self, request):
        return await self.answer(request, "chat")

    async def completions(self, request):
        return await self.answer(request, "completions")

    async def answer(self, request, api: str):
        b = orjson.loads(await request.body())
        self.requests.append({**b, "authorization": request.headers.get("authorization")})
        while self.hang:                         # until told otherwise (or the server stops)
            await asyncio.sleep(0.05)
        if self.status != 200:
            return Response(orjson.dumps({"error": {"message": f"told to fail with {self.status}", "type": "x",
                                                    "param": "temperature", "code": "told_to"}}), self.status,
                            media_type="application/json")
        if b.get("stream"):
            return StreamingResponse(self.events(api, b), media_type="text/event-stream")
        text = "".join(WORDS)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if api == "chat" else {
            "index": 0, "text": text}
        return Response(orjson.dumps({"id": "up-1", "object": "chat.completion" if api == "chat" else
                                      "text_completion", "created": int(time.time()), "model": b["model"],
                                      "choices": [{**choice, "finish_reason": "stop", "logprobs": None}],
                                      "usage": USAGE}), media_type="application/json")

    async def events(self, api: str, b: dict):
        usage = (b.get("stream_options") or {}).get("include_usage")
        obj = "chat.completion.chunk" if api == "chat" else "text_completion"

        def chunk(choices, u=None) -> bytes:
            c = {"id": "up-1", "object": obj, "created": 1, "model": b["model"], "choices": choices}
            if usage:
                c["usage"] = u
            return b"data: " + orjson.dumps(c) + b"\n\n"

        def choice(text, finish=None) -> dict:
            if api == "chat":
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if api == "chat":
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for w in WORDS:
            yield chunk([choice(w)])
            if self.cut:
                return
            await asyncio.sleep(0.01)
        yield chunk([choice("", "stop")])
        if usage:
            yield chunk([], USAGE)
        yield b"data: [DONE]\n\n"


@contextlib.contextmanager
def upstream():
    """A FakeUpstream serving on a free port until the block ends."""
    fake, port = FakeUpstream(), free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake upstream did not start"
        time.sleep(0.01)
    fake.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield fake
    finally:
        server.should_exit = True
        fake.hang = False
        thread.join(30)

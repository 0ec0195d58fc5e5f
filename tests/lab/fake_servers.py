"""Fake gateways for `tokenbus bench` and `tokenbus bench-peers`: the websocket protocol and the OpenAI
streaming API (chat and text completions, prompts as text or token ids, as llama-server's), each
answering every request with max_tokens one-token chunks after `ttft` seconds, `itl` seconds apart (0:
as fast as the socket takes them); a Traffic records what they were sent. Run in a thread (tests) or
as a process, to measure the bench client's own CPU:

    python -m tests.lab.fake_servers --port 18100 [--ttft 0] [--itl 0]
"""
import argparse
import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute

from ops.procs import free_port

MODEL = "fake-model"


@dataclass
class Traffic:
    """What a fake server was sent: each request's frame or body in arrival order, and the most
    requests that were in flight at once (arrived, their last chunk not yet sent)."""
    requests: list[dict] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0

    @contextlib.contextmanager
    def serving(self, request: dict):
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1


# uvicorn runs this on uvloop, whose timers count from the loop's cached clock: a sleep may end up to ~1 ms
# before its delay has passed by the client's clock. Lower bounds on measured gaps allow this much.
TIMER_SLACK_MS = 1.5

def app(ttft: float = 0.0, itl: float = 0.0, fail_every: int = 0, key: str | None = None,
        traffic: Traffic | None = None) -> Starlette:
    """Every fail_every-th request (if set) is refused: an error frame on ws, a 429 over HTTP. With a key,
    requests without `Authorization: Bearer <key>` are refused (403 handshake, 401 over HTTP)."""
    seen = {"n": 0}
    traffic = traffic or Traffic()

    def allowed(headers) -> bool:
        return key is None or headers.get("authorization") == f"Bearer {key}"

    def refused() -> bool:
        seen["n"] += 1
        return bool(fail_every) and seen["n"] % fail_every == 0

    async def ws_generate(ws, frame: dict) -> None:
        n = frame["max_tokens"]
        if refused():
            await ws.send_text(orjson.dumps({"type": "error", "id": frame["id"], "code": "too_many_requests",
                                             "message": "fake refusal"}).decode())
            return
        with traffic.serving(frame):
            await asyncio.sleep(ttft)
            for i in range(n):
                await ws.send_text(orjson.dumps({"type": "delta", "id": frame["id"], "text": f" t{i}",
                                                 "token_ids": [i]}).decode())
                await asyncio.sleep(itl)
        done = {"type": "done", "id": frame["id"], "finish_reason": "length",
                "usage": {"prompt_tokens": prompt_tokens(frame), "completion_tokens": n},
                "timing": {"ttft_ms": ttft * 1e3, "e2e_ms": (ttft + n * itl) * 1e3}}
        await ws.send_text(orjson.dumps(done).decode())

    async def ws_endpoint(ws) -> None:
        if not allowed(ws.headers):
            await ws.close(code=1008)
            return
        await ws.accept()
        tasks = set()
        with contextlib.suppress(Exception):
            while True:
                frame = orjson.loads(await ws.receive_text())
                if frame["type"] == "generate":
                    task = asyncio.create_task(ws_generate(ws, frame))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)

    async def completions(request, chat: bool):
        if not allowed(request.headers):
            return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error",
                                           "code": "invalid_api_key"}}, status_code=401)
        body = orjson.loads(await request.body())
        assert body["model"] == MODEL and body["stream"] is True, body
        assert body["stream_options"] == {"include_usage": True}, body
        if refused():
            return JSONResponse({"error": {"message": "fake refusal", "type": "rate_limit_error",
                                           "code": "rate_limited"}}, status_code=429)
        n = body["max_tokens"]

        def choice(i: int) -> dict:
            last = "length" if i == n - 1 else None
            if not chat:
                return {"index": 0, "text": f" t{i}", "finish_reason": last}
            delta = {"role": "assistant", "content": f" t{i}"} if i == 0 else {"content": f" t{i}"}
            return {"index": 0, "delta": delta, "finish_reason": last}

        async def events():
            with traffic.serving(body):
                await asyncio.sleep(ttft)
                base = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": int(time.time()), "model": body["model"]}
                for i in range(n):
                    yield b"data: " + orjson.dumps({**base, "choices": [choice(i)]}) + b"\n\n"
                    await asyncio.sleep(itl)
            usage = {"prompt_tokens": prompt_tokens(body), "completion_tokens": n,
                     "total_tokens": prompt_tokens(body) + n}
            yield b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat_completions(request):
        return await completions(request, chat=True)

    async def text_completions(request):
        return await completions(request, chat=False)

    async def models(request):
        if not allowed(request.headers):
            return JSONResponse({"error": {"message": "bad key", "code": "invalid_api_key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return Starlette(routes=[WebSocketRoute("/ws", ws_endpoint), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/completions", text_completions, methods=["POST"])])


def prompt_tokens(request: dict) -> int:
    """Token ids counted, text counted in words."""
    prompt = request.get("prompt_token_ids") or request.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    return len(prompt.split()) if prompt else sum(len(m["content"].split()) for m in request["messages"])


def server(port: int, **kw) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app(**kw), host="127.0.0.1", port=port, log_config=None, access_log=False,
                                         ws_per_message_deflate=False, lifespan="off"))


@contextlib.contextmanager
def serving(**kw):
    """A fake gateway in a thread of this process; yields its port."""
    port = free_port()
    s = server(port, **kw)
    thread = threading.Thread(target=s.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not s.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake gateway did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        s.should_exit = True
        thread.join(10)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=18100)
    p.add_argument("--ttft", type=float, default=0.0)
    p.add_argument("--itl", type=float, default=0.0)
    a = p.parse_args()
    server(a.port, ttft=a.ttft, itl=a.itl).run()

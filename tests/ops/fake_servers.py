"""Fake gateways for `tokenbus bench`: the websocket protocol and the OpenAI streaming API, each answering
every request with max_tokens one-token chunks after `ttft` seconds, `itl` seconds apart (0: as fast as
the socket takes them). Run in a thread (tests) or as a process, to measure the bench client's own CPU:

    python -m tests.ops.fake_servers --port 18100 [--ttft 0] [--itl 0]
"""
import argparse
import asyncio
import contextlib
import threading
import time

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute

from ops.procs import free_port

MODEL = "fake-model"


def app(ttft: float = 0.0, itl: float = 0.0, fail_every: int = 0, key: str | None = None) -> Starlette:
    """Every fail_every-th request (if set) is refused: an error frame on ws, a 429 over HTTP. With a key,
    requests without `Authorization: Bearer <key>` are refused (403 handshake, 401 over HTTP)."""
    seen = {"n": 0}

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
        await asyncio.sleep(ttft)
        for i in range(n):
            await ws.send_text(orjson.dumps({"type": "delta", "id": frame["id"], "text": f" t{i}",
                                             "token_ids": [i]}).decode())
            await asyncio.sleep(itl)
        done = {"type": "done", "id": frame["id"], "finish_reason": "length",
                "usage": {"prompt_tokens": prompt_tokens(frame["messages"]), "completion_tokens": n},
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

    async def chat_completions(request):
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

        async def events():
            await asyncio.sleep(ttft)
            base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": body["model"]}
            for i in range(n):
                delta = {"role": "assistant", "content": f" t{i}"} if i == 0 else {"content": f" t{i}"}
                choice = {"index": 0, "delta": delta, "finish_reason": "length" if i == n - 1 else None}
                yield b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
                await asyncio.sleep(itl)
            usage = {"prompt_tokens": prompt_tokens(body["messages"]), "completion_tokens": n,
                     "total_tokens": prompt_tokens(body["messages"]) + n}
            yield b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request):
        if not allowed(request.headers):
            return JSONResponse({"error": {"message": "bad key", "code": "invalid_api_key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return Starlette(routes=[WebSocketRoute("/ws", ws_endpoint), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])])


def prompt_tokens(messages: list[dict]) -> int:
    return sum(len(m["content"].split()) for m in messages)


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

"""The gateway's ASGI app: websocket chat at /ws, /healthz and /metrics (the HTTP API joins this app later),
served by uvicorn."""
import argparse
import asyncio
import contextlib
import signal

import nats.errors
import nats.js.errors
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from tokenizers import Tokenizer

from schemas import subjects
from schemas.log import configure
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.session import Connection, Gateway


def create_app(nats_url: str, model_dir: str) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        log = configure("gateway")
        tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        nc = await subjects.connect(nats_url, "gateway", log)
        try:
            js = nc.jetstream()
            await subjects.ensure_streams(js)
            app.state.gateway = Gateway(nc, js, await subjects.registry(js), tokenizer, log)
            log.info("gateway ready", nats=nats_url, model=model_dir)
            yield
        finally:
            await subjects.close(nc)
            log.info("gateway stopped")

    routes = [Route("/healthz", healthz), Route("/metrics", metrics), WebSocketRoute("/ws", chat)]
    return Starlette(routes=routes, lifespan=lifespan)


async def chat(ws) -> None:
    await Connection(ws.app.state.gateway, ws).run()


async def healthz(request) -> Response:
    n = await workers(request.app.state.gateway)
    body = orjson.dumps({"status": "ok" if n else "unavailable", "workers": n})
    return Response(body, status_code=200 if n else 503, media_type="application/json")


async def metrics(request) -> Response:
    gw = request.app.state.gateway
    return Response(await gw.metrics.render(gw.kv, gw.log), media_type=CONTENT_TYPE)


async def workers(gw: Gateway) -> int:
    """Workers with a live heartbeat in the registry (entries expire after WORKER_TTL)."""
    try:
        return len(await gw.kv.keys())
    except nats.js.errors.NoKeysError:
        return 0
    except (nats.errors.Error, asyncio.TimeoutError) as e:
        gw.log.warning("registry read failed", error=str(e) or type(e).__name__)
        return 0


def server_config(app: Starlette, host: str, port: int) -> uvicorn.Config:
    # No permessage-deflate: token deltas are a few dozen bytes, and compressing each costs both ends CPU
    return uvicorn.Config(app, host=host, port=port, ws="websockets-sansio", ws_max_size=subjects.MAX_FRAME_BYTES,
                          ws_per_message_deflate=False, lifespan="on", log_config=None, access_log=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description="The tokenbus gateway.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--model", required=True, help="HF checkpoint directory, for its tokenizer.json")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    server = uvicorn.Server(server_config(create_app(args.nats_url, args.model), args.host, args.port))
    for sig in (signal.SIGTERM, signal.SIGINT):   # uvicorn re-raises the signal it stopped on: exit 0 instead
        signal.signal(sig, lambda *_: None)
    server.run()

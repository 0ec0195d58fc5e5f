"""The fallback upstream's answer relayed to an HTTP client (forward): its JSON as it is, or its event
stream event by event (Relay), marked `x-tokenbus-fallback: 1`; fallback.py admits, settles and
meters it."""
import asyncio
import time

import httpx
import orjson

from services.gateway.errors import ApiError
from services.gateway.fallback import Forward
from services.gateway.http_answer import SSE_HEADERS, disconnected, event
from services.gateway.http_parse import Call

FALLBACK_HEADER = ("x-tokenbus-fallback", "1")       # on every response the fallback upstream answered


class Relay:
    """The upstream's event stream as the client's, event by event: its usage chunk (asked for, to meter it)
    only if the client asked too; an error event if the stream breaks or outlasts the request timeout. The
    client leaving closes the upstream's stream."""

    def __init__(self, f: Forward, resp: httpx.Response, call: Call):
        self.f, self.resp, self.call, self.done = f, resp, call, False

    async def __call__(self, scope, receive, send) -> None:
        marked = tuple(map(str.encode, FALLBACK_HEADER))
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, marked]})
        pump, gone = asyncio.ensure_future(self.pump(send)), asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                self.f.gw.log.error("fallback stream failed", request_id=self.f.rid, error=repr(pump.exception()))
        finally:
            pump.cancel()
            gone.cancel()
            await self.resp.aclose()
            self.f.end("aborted" if gone.done() and not pump.done() else None)

    async def pump(self, send) -> None:
        f = self.f
        left = f.gw.request_timeout - (time.perf_counter() - f.t0)
        try:
            async with asyncio.timeout(left):
                async for line in self.resp.aiter_lines():
                    data = self.event(line)
                    if data:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
            why = None if self.done else "the stream ended before [DONE]"
        except (httpx.HTTPError, TimeoutError) as e:
            why = f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError) else (
                f"the request did not finish within --request-timeout={f.gw.request_timeout:g} s")
        if why is not None:
            f.failed()
            err = ApiError(502, f"the fallback upstream's stream broke: {why}", "fallback_failed")
            await send({"type": "http.response.body", "body": event(orjson.dumps(err.body()), b""), "more_body": True})
        f.end()                                   # settled and metered before the client sees the end
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def event(self, line: str) -> bytes | None:
        """What the client gets of one line of the upstream's stream (None: nothing)."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return event(b"[DONE]", b"")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        if "error" in obj:
            self.f.failed()
            return event(data.encode(), b"")
        self.f.take(obj)
        if self.call.include_usage:
            return event(data.encode(), b"")
        if not obj.get("choices") and obj.get("usage") is not None:
            return None                           # the usage chunk the gateway asked for, not the client
        obj.pop("usage", None)
        return event(orjson.dumps(obj), b"")


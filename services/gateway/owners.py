"""The owners of requests, where their frames go: a websocket connection (Connection, the /ws
protocol: generate, resume, cancel), one HTTP request (Exchange: a queue the response reads), or
nowhere while a dropped client may come back (Parked). leave() is what happens to an owner's
requests when its client goes: they end, or a dropped connection's resumable ones are Parked for
the gateway's resume_grace."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING

import orjson

from schemas import subjects
from schemas.sampling import CONSTRAINTS
from services.gateway import frames, keys, tools
from services.gateway.errors import ApiError
from services.gateway.fallback import Spilled
from services.gateway.frames import FrameError
from services.gateway.keys import Key
from services.gateway.stream import error
from services.gateway.tools import ToolStream

if TYPE_CHECKING:
    from services.gateway.session import Gateway
    from services.gateway.stream import Request

CLEAN_CLOSE = (1000, 1001)           # websocket close codes of a client that left on purpose: no resume
DRAIN_CLOSE = 1012                   # service restart: the gateway drains; reconnect and resume


class Connection:
    def __init__(self, gw: Gateway, ws, key: Key = keys.OPEN):
        self.gw, self.ws, self.log, self.key = gw, ws, gw.log, key
        self.inflight: dict[str, Request] = {}  # client id (a choice's: "<client id>#<index>") -> request
        self.tools: dict[str, ToolStream] = {}  # client id -> the tool calls found in its answer
        self.choices: dict[str, tuple[str, int]] = {}   # a choice's id -> (its request's client id, its index)
        self.groups: dict[str, list[str]] = {}  # client id of a request of n > 1 -> its choices' ids not ended

    async def run(self) -> None:
        await self.ws.accept()
        self.gw.connections.add(self)
        event = {}
        try:
            while (event := await self.ws.receive())["type"] == "websocket.receive":
                await self.on_frame(event)
        finally:
            self.gw.connections.discard(self)
            await leave(self, event.get("code") not in CLEAN_CLOSE)

    async def close_for_drain(self) -> None:
        """The gateway drains: close code 1012 (service restart) tells the client to connect again, to any
        gateway, and resume its resumable requests by the resume ids it was given; they stream on meanwhile."""
        self.gw.connections.discard(self)
        with contextlib.suppress(Exception):
            await self.ws.close(DRAIN_CLOSE, "the gateway is draining: reconnect and resume")

    async def on_frame(self, event: dict) -> None:
        t0 = time.perf_counter()
        try:
            frame = frames.parse(event)
            kind, cid = frames.header(frame)
            if kind == "generate":
                await self.generate(frame, cid, t0)
            elif kind == "resume":
                await self.resume(frame, cid, t0)
            else:
                await self.cancel(cid)
        except FrameError as e:
            self.gw.metrics.error(self.key.tenant, e.code)
            await self.send(error(e.id, e.code, str(e), e.retry_after))
        except Exception as e:                    # a bug must not end the connection
            self.log.exception("frame failed")
            await self.send(error(None, "internal", f"the gateway failed on this frame: {type(e).__name__}"))

    async def generate(self, frame: dict, cid: str, t0: float) -> None:
        n = frames.n(frame)
        self.room(cid, n)
        if self.gw.life is not None and self.gw.life.asked.is_set():
            raise FrameError("the gateway is draining: connect again (to any gateway) and send the request there",
                             cid, "unavailable", 0)
        spec, constraint = None, {}
        if any(k in frame for k in frames.TOOLING) and "messages" in frame:
            try:
                spec, shown, constraint = tools.parse(frame, "")
            except ApiError as e:
                raise FrameError(e.message, cid) from None
            if constraint and any(frame.get(k) is not None for k in CONSTRAINTS):
                raise FrameError("tool_choice: a required or named tool constrains the output; no other "
                                 "constraint can", cid)
        req = frames.request({**frame, **constraint}, uuid.uuid4().hex, self.key.tenant)
        req.tools = shown if spec is not None else None
        resumable = frames.resumable(frame)
        if resumable and n > 1:
            raise FrameError("resumable: the choices of a request of n > 1 carry no resume points", cid)
        try:
            self.gw.choose(req, frames.model(frame))
            self.gw.fill([req], [k for k, v in frame.items() if v is not None])
            if spec is not None:
                revision = self.gw.served(req)[1]
                spec.parser = revision.tool_parser if revision is not None else "hermes"
            if n > 1:
                return await self.start_choices(cid, frames.choices(req, n), spec, frames.priority(frame), t0)
            try:
                await self.gw.start(self, cid, req, await self.gw.admit(self.key, req, frames.priority(frame)), "ws",
                                    t0, resumable)
                if spec is not None:              # before its first frame: that comes after the publish's await
                    self.tools[cid] = ToolStream(spec)
            except ApiError as e:
                if not self.gw.falls_back(self.key, e):
                    raise
                f = await self.gw.fall_back(self.key, req, "ws", e, t0, frames.priority(frame))
                Spilled(self, cid, f, frame, req).start()
        except ApiError as e:                     # refused by a limit: an error frame with its code
            raise refused(e, cid) from None

    async def start_choices(self, cid: str, reqs: list, spec, priority: int | None, t0: float) -> None:
        """The choices of a request of n > 1, each a request of its own (id "<cid>#<index>"), all started or
        none: their frames reach the client under `cid` with their `index`."""
        self.groups[cid] = ids = [f"{cid}#{i}" for i in range(len(reqs))]
        self.choices.update((c, (cid, i)) for i, c in enumerate(ids))
        started = []
        try:
            for c, req in zip(ids, reqs):
                started.append(await self.gw.start(self, c, req, await self.gw.admit(self.key, req, priority), "ws",
                                                   t0, False))
                if spec is not None:
                    self.tools[c] = ToolStream(spec)
        except BaseException:
            for r in started:
                await r.abort()
            for c in self.groups.pop(cid):
                self.choices.pop(c, None)
                self.tools.pop(c, None)
            raise

    async def resume(self, frame: dict, cid: str, t0: float) -> None:
        self.room(cid)
        rid, seq, offset = frames.resume(frame)
        try:
            req, headers = await self.gw.find(self.key, rid, seq, offset, "ws")
            await self.gw.resume(self, cid, self.key, req, seq, offset, t0, headers)
        except ApiError as e:
            raise refused(e, cid) from None

    def room(self, cid: str, n: int = 1) -> None:
        """FrameError unless a request `cid` (of n choices) may start on this connection."""
        if cid in self.inflight or cid in self.groups:   # id None: the error is not the in-flight request's
            raise FrameError(f"id: {frames.show(cid)} is already in flight on this connection")
        if len(self.inflight) + n > subjects.MAX_INFLIGHT_PER_CONNECTION:
            raise FrameError(f"{len(self.inflight)} requests are in flight on this connection; "
                             f"MAX_INFLIGHT_PER_CONNECTION={subjects.MAX_INFLIGHT_PER_CONNECTION}", cid,
                             "too_many_requests")

    async def cancel(self, cid: str) -> None:
        rs = [self.inflight[c] for c in self.groups.get(cid, (cid,)) if c in self.inflight]
        if not rs:
            raise FrameError(f"id: no request {frames.show(cid)} is in flight on this connection", cid)
        for r in rs:
            await r.abort()
            await self.send(r.done("abort"))

    async def send(self, frame: dict) -> None:
        ts = self.tools.get(frame.get("id")) if self.tools else None
        for f in ([frame] if ts is None else with_tools(ts, frame, self.tools)):
            if self.choices and f.get("id") in self.choices:
                f = self.as_choice(f)
            try:
                await self.ws.send_text(orjson.dumps(f).decode())
            except Exception as e:                # the client left: run() sees it and aborts its requests
                self.log.debug("send failed", error=repr(e))
                return

    def as_choice(self, frame: dict) -> dict:
        """A choice's frame as its client gets it: its request's id and the choice's index."""
        c = frame["id"]
        cid, i = self.choices[c]
        if frame["type"] in ("done", "error"):
            del self.choices[c]
            left = self.groups[cid]
            left.remove(c)
            if not left:
                del self.groups[cid]
        return {**frame, "id": cid, "index": i}

    async def accepted(self, r: "Request") -> None:
        """The request is stored: a client that asked for it gets the id it can resume it by."""
        if r.resumable:
            await self.send({"type": "accepted", "id": r.cid, "resume_id": frames.resume_id(r.rid, r.seq)})


class Exchange:
    """The owner of one HTTP request's Request: its frames queue up for the response to take."""

    def __init__(self, gw: Gateway):
        self.gw, self.log = gw, gw.log
        self.inflight: dict[str, Request] = {}
        self.frames: asyncio.Queue[dict] = asyncio.Queue()

    async def send(self, frame: dict) -> None:
        self.frames.put_nowait(frame)

    async def accepted(self, r: "Request") -> None:
        pass                                      # SSE events carry the resume point in their ids


class Parked:
    """The owner of requests whose client's connection dropped: their frames go nowhere while they wait
    for a resume (Gateway.resume_grace), then they are cancelled."""

    def __init__(self, gw: Gateway):
        self.gw, self.log = gw, gw.log
        self.inflight: dict[str, Request] = {}

    async def send(self, frame: dict) -> None:
        pass

    async def accepted(self, r: "Request") -> None:
        pass


async def leave(owner: Connection | Exchange, dropped: bool) -> None:
    """The client left: its requests end and their workers are told, except the resumable ones of a dropped
    connection, which are Parked for the gateway's resume_grace."""
    parked = Parked(owner.gw) if dropped and owner.gw.resume_grace > 0 else None
    for r in list(owner.inflight.values()):
        if parked is not None and r.resumable:
            r.park(parked)
        else:
            await r.abort()


def with_tools(ts: ToolStream, frame: dict, streams: dict[str, ToolStream]) -> list[dict]:
    """A frame of a request with tools, as its client gets it: a delta's text split into content (`text`) and
    `tool_calls` pieces (OpenAI's delta objects); the answer's last pieces before its done frame, whose
    finish_reason is tool_calls when it called one."""
    if frame["type"] == "delta":
        deltas = ts.feed(frame["text"])
        return [{**frame, "text": "".join(d.get("content") or "" for d in deltas),
                 **({"tool_calls": pieces} if (pieces := [p for d in deltas for p in d.get("tool_calls", ())])
                    else {})}]
    if frame["type"] not in ("done", "error"):
        return [frame]                            # accepted
    streams.pop(frame["id"], None)
    if frame["type"] == "error":
        return [frame]
    deltas = ts.finish()
    out = [] if not deltas else [{"type": "delta", "id": frame["id"], "token_ids": [],
                                  "text": "".join(d.get("content") or "" for d in deltas),
                                  "tool_calls": [p for d in deltas for p in d.get("tool_calls", ())]}]
    called = ts.called and frame.get("finish_reason") == "stop"
    return [*out, {**frame, "finish_reason": "tool_calls"} if called else frame]


def refused(e: ApiError, cid: str) -> FrameError:
    """A refusal (a limit, an unknown or forbidden resume) as the error frame of request cid."""
    frame = e.frame(cid)
    return FrameError(e.message, cid, frame["code"], frame.get("retry_after"))


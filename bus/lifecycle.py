"""A process's life as its orchestrator sees it: starting, serving, draining, gone.

Life holds it for one process: its probes, /healthz (liveness: 200 while the process runs, draining
too) and /readyz (readiness: 200 while it serves, 503 while it starts or drains), on a small HTTP
server of its own (--health-port; the gateway answers both on its own port); and its drain, begun by
SIGTERM or by a tb.drain request naming the process or its role (`tokenbus drain`). A second
SIGTERM, or SIGINT, stops it at once. What draining means is each service's own (stop taking work,
finish what it holds within --drain-timeout, hand over the rest); each says left() as it goes, which
`tokenbus drain --wait` waits for."""
import asyncio
import contextlib
import signal
import time

import nats.errors
import orjson

from bus import tracing
from schemas import subjects

PROBE_READ_SECONDS = 5.0                 # a probe's request line and headers, at most


class Life:
    def __init__(self, role: str, name: str, log, drain_timeout: float = subjects.DRAIN_TIMEOUT, metrics=None):
        self.role, self.name, self.log, self.drain_timeout = role, name, log, drain_timeout
        self.metrics = metrics                   # a callable giving /metrics' Prometheus text, if any
        self.ready = False                       # set by the service once it serves
        self.draining = asyncio.Event()
        self.stopping = asyncio.Event()          # stop now: what is held is handed over at once
        self.asked = asyncio.Event()             # either of the two
        self.began = 0.0                         # time.monotonic() the drain began
        self.nc = None
        self.server: asyncio.Server | None = None

    @property
    def serving(self) -> bool:
        return self.ready and not self.asked.is_set()

    @property
    def deadline(self) -> float:
        """time.monotonic() by which what is still held is handed over."""
        return self.began + self.drain_timeout

    def drain(self, why: str) -> None:
        if self.draining.is_set():
            if why == "SIGTERM":
                self.stop("a second SIGTERM")
            return
        self.log.info("draining", why=why, drain_timeout=self.drain_timeout)
        self.began = time.monotonic()
        self.draining.set()
        self.asked.set()

    def stop(self, why: str) -> None:
        if not self.stopping.is_set():
            self.log.info("stopping now", why=why)
        self.began = self.began or time.monotonic()
        self.stopping.set()
        self.asked.set()

    def on_signals(self) -> None:
        """SIGTERM drains (an orchestrator's stop: Kubernetes, compose, tokenbus up's roll), SIGINT stops."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.drain, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.stop, "SIGINT")

    async def listen(self, nc) -> None:
        """Answers `tokenbus drain` for this process's name and for its role."""
        self.nc = nc
        for name in dict.fromkeys((self.name, self.role)):
            await nc.subscribe(subjects.drain(name), cb=self.on_drain)

    async def on_drain(self, msg) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(orjson.dumps({"name": self.name, "role": self.role,
                                                "drain_timeout": self.drain_timeout}))
        self.drain("tokenbus drain")

    async def left(self, handed_over: int = 0) -> None:
        """Says on tb.drained.<name> that this process is gone, and how many requests it handed over."""
        if self.nc is None or not self.asked.is_set():
            return
        self.log.info("drained" if not self.stopping.is_set() else "stopped", handed_over=handed_over,
                      seconds=round(time.monotonic() - self.began, 3))
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.drained(self.name), orjson.dumps({"name": self.name,
                                                                             "handed_over": handed_over}))
            await self.nc.flush(timeout=1)

    # -- the probes -------------------------------------------------------------------------------

    async def serve_probes(self, host: str, port: int) -> None:
        """/healthz, /readyz (and /metrics, if the process has them) on host:port; port 0 serves none."""
        if port:
            self.server = await asyncio.start_server(self.answer, host, port)

    def answer_for(self, path: str) -> tuple[int, bytes, str]:
        """(status, body, content type) of a probe."""
        if path == "/healthz":
            return 200, orjson.dumps({"status": "ok", "role": self.role, "name": self.name}), "application/json"
        if path == "/readyz":
            state = "ready" if self.serving else "draining" if self.asked.is_set() else "starting"
            return 200 if self.serving else 503, orjson.dumps({"status": state, "name": self.name}), \
                "application/json"
        if path == "/metrics" and self.metrics is not None:
            return 200, self.metrics(), "text/plain; version=0.0.4; charset=utf-8"
        return 404, orjson.dumps({"error": f"no {path}: /healthz, /readyz"}), "application/json"

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(PROBE_READ_SECONDS):
                line = (await reader.readline()).split()
                while (await reader.readline()).strip():
                    pass
            path = line[1].decode("latin-1").split("?")[0] if len(line) > 1 else ""
            status, body, kind = self.answer_for(path)
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (OSError, TimeoutError, ValueError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()


async def first(*aws) -> None:
    """Until the first of these ends; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def add_arguments(p, health: bool = True) -> None:
    """--drain-timeout, --otlp-endpoint (bus/tracing.py), and (health) --health-port and --health-host: every
    service's."""
    tracing.add_argument(p)
    p.add_argument("--drain-timeout", type=float, default=subjects.DRAIN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM or `tokenbus drain`: seconds to finish what it holds before handing the rest "
                        f"over (default {subjects.DRAIN_TIMEOUT:g}); SIGINT stops at once")
    if health:
        p.add_argument("--health-port", type=int, default=0, help="serve /healthz (liveness) and /readyz "
                       "(readiness: 503 while starting or draining) on this port (default: none)")
        p.add_argument("--health-host", default="127.0.0.1", help="the address the probes bind (0.0.0.0 in a "
                       "container)")

"""Connecting to the bus and running a process on it: connect() keeps reconnecting (a restarted
nats-server or a cluster node going away must not end a service) and makes the streams again after a
reconnect; run() puts a service's main coroutine on uvloop; run_until_signal() ends it on SIGTERM or
SIGINT and close() flushes what it published. BUS_ERRORS is what a call on the bus may raise when the
server is gone for a moment."""
import asyncio
import contextlib
import signal
import sys

import nats
import nats.errors
import uvloop

from bus.streams import ensure_streams
from schemas import credentials as creds


async def connect(url: str, name: str, log=None, role: str | None = None,
                  credentials: creds.Credentials | None = None) -> nats.NATS:
    """A connection that keeps reconnecting: a restarted nats-server must not end a service. url is one
    server or a cluster's comma-separated list (any order; one is picked at random, the next on failure).
    After a reconnect every stream and bucket is made again if the server lost it (a wiped store); core
    subscriptions come back by themselves, watchers (watch()) and pull consumers (consume()) see the
    reconnect count and start over. Connection errors are one log line each (nats-py's default prints
    a traceback); a permissions violation is printed even without a log. It connects as `role`
    (default: `name`, schemas/roles.py) with `credentials` (default: the environment's)."""
    async def error(e: Exception) -> None:
        if log is not None:
            log.warning("nats connection error", error=f"{type(e).__name__}: {e}")
        elif "permissions violation" in str(e).lower():
            print(f"{name}: {e}", file=sys.stderr, flush=True)

    async def reconnected() -> None:               # a task of its own: nats-py awaits this inside its reconnect
        task = asyncio.get_running_loop().create_task(check())
        checks.add(task)
        task.add_done_callback(checks.discard)

    async def check() -> None:
        if log is not None:
            log.warning("nats reconnected", reconnects=nc.stats["reconnects"])
        try:
            await ensure_streams(nc.jetstream())
        except (nats.errors.Error, asyncio.TimeoutError) as e:   # the next publish that finds one gone retries
            if log is not None:
                log.warning("streams not checked after reconnect", error=str(e) or type(e).__name__)

    checks: set[asyncio.Task] = set()
    servers = servers_of(url)
    pings = {"ping_interval": CLUSTER_PING, "max_outstanding_pings": CLUSTER_PINGS} if len(servers) > 1 else {}
    nc = await nats.connect(servers, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                            connect_timeout=2, allow_reconnect=True, error_cb=error, reconnected_cb=reconnected,
                            **pings, **(credentials or creds.from_env()).options(role or name))
    return nc


CLUSTER_PING, CLUSTER_PINGS = 1.0, 3     # with a server list: a server that stops answering (cut off) is left in ~4 s


def servers_of(url: str) -> list[str]:
    """The servers of --nats-url: one URL, or several separated by commas; ValueError if none."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"--nats-url {url!r} names no server")
    return servers


BUS_ERRORS = (nats.errors.Error, asyncio.TimeoutError,
              RuntimeError)              # nats-py writing to a transport that closed under it (its server died)


def run(main) -> None:
    """Runs a service's main coroutine on uvloop (libuv): a message's trip through a stage costs a
    few event-loop turns, and uvloop's are several times cheaper than asyncio's."""
    uvloop.run(main)


async def run_until_signal(main, nc) -> None:
    """Runs the coroutine main() until it returns or SIGTERM / SIGINT arrives, then closes nc."""
    task = asyncio.ensure_future(main())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await close(nc)


async def close(nc) -> None:
    """Flushes what was published and closes. Not drain(): a pull fetch in flight would hold it for
    its whole timeout, and anything unacked is redelivered anyway."""
    with contextlib.suppress(Exception):
        await nc.flush(timeout=1)
    await nc.close()

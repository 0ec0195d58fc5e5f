"""A command's connection to nats-server: the services' reconnecting connection (bus.connect),
once a nats-server is known to answer at the URL. bus.connect alone retries forever in silence
when none does, and nats-py can swallow the cancel of that loop (a timeout or Ctrl-C around it would
then wait forever too), so the command first asks the server for its INFO line itself, with plain
asyncio streams, and gives up within CONNECT_TIMEOUT seconds naming the URL."""
import asyncio
import contextlib
import urllib.parse

import nats

import bus

CONNECT_TIMEOUT = 5.0
PROBED = ("nats", "tls")                          # schemes whose servers greet with INFO first (not ws://)


async def connect(url: str, name: str, timeout: float = CONNECT_TIMEOUT, **kw) -> nats.NATS:
    """bus.connect(url, name, **kw), or ValueError naming url when no nats-server answers there
    within timeout."""
    await answers(url, timeout)
    return await bus.connect(url, name, **kw)


async def answers(url: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """ValueError unless one server of url (one, or a cluster's comma-separated list) greets with
    nats-server's INFO line, within timeout for them all; the error names the last one tried."""
    *others, last = servers = bus.servers_of(url)
    for server in others:
        with contextlib.suppress(ValueError):
            return await answer(server, timeout / len(servers))
    await answer(last, timeout / len(servers))


async def answer(url: str, timeout: float) -> None:
    """ValueError unless what listens at url greets with nats-server's INFO line within timeout."""
    where = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    if where.scheme not in PROBED:
        return
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(where.hostname or "127.0.0.1", where.port or 4222)
            try:
                greeting = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError) as e:
        cause = f"{type(e).__name__}: {e}" if str(e) else f"no answer within {timeout:g} s"
        raise ValueError(f"no nats-server answered at {url} ({cause}); is `tokenbus up` running? "
                         f"(--nats-url names another)") from None
    if not greeting.startswith(b"INFO"):
        raise ValueError(f"no nats-server answered at {url}: something else listens there "
                         f"(it said {greeting[:40]!r}); --nats-url names the stack's nats-server")

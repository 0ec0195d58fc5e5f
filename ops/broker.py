"""A command's connection to nats-server: the services' reconnecting connection (subjects.connect),
but one that gives up within CONNECT_TIMEOUT seconds when no nats-server answers, naming the URL
it tried, instead of retrying forever in silence."""
import asyncio

import nats

from schemas import subjects

CONNECT_TIMEOUT = 5.0


class LastError:
    """Stands in for subjects.connect's log: keeps the last connection error to name it."""
    def __init__(self):
        self.error = None

    def warning(self, event: str, error: str = "", **_) -> None:
        self.error = error or event


async def connect(url: str, name: str, timeout: float = CONNECT_TIMEOUT) -> nats.NATS:
    """subjects.connect, or ValueError naming url when nothing there answers as a nats-server in time
    (once connected it reconnects as the services do)."""
    seen = LastError()
    try:
        return await asyncio.wait_for(subjects.connect(url, name, seen), timeout)
    except (asyncio.TimeoutError, OSError, nats.errors.Error) as e:
        cause = seen.error or f"{type(e).__name__}: {e}"
        raise ValueError(f"no nats-server answered at {url} within {timeout:g} s ({cause}); "
                         f"is `tokenbus up` running? (--nats-url names another)") from None

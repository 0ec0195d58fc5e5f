"""Publishing to JetStream so that a message is stored once: publish() retries under the same
Nats-Msg-Id until the stream acknowledges it, through a broker restart, and says NotStored when its
deadline passes or the stream refuses the message (refused() tells the two kinds of failure apart)."""
import asyncio
import contextlib
import time

import nats.errors
import nats.js.errors
from nats.js import api

from bus.streams import ensure_streams

PUBLISH_ATTEMPT = 2.0                    # seconds one JetStream publish waits for its ack
PUBLISH_DEADLINE = 60.0                  # seconds a publish is retried, under the same Nats-Msg-Id
PUBLISH_RETRY = 0.25                     # between attempts


class NotStored(Exception):
    """A JetStream publish that no attempt got acknowledged within its deadline, or that the stream refused
    (err_code: JetStream's code for the refusal; None when no attempt was answered)."""

    def __init__(self, message: str, err_code: int | None = None):
        super().__init__(message)
        self.err_code = err_code


async def publish(js, subject: str, data: bytes, headers: dict[str, str], log,
                  deadline: float = PUBLISH_DEADLINE) -> api.PubAck:
    """Publishes to JetStream until the stream acknowledges it, retrying under the same headers (so the
    same Nats-Msg-Id: the stream stores it once however many attempts arrive) for up to `deadline`
    seconds, through a broker restart; a stream found missing is made again. NotStored names the
    deadline, or says the stream refused it."""
    end, attempts = time.monotonic() + deadline, 0
    while True:
        attempts += 1
        try:
            return await js.publish(subject, data, headers=headers, timeout=PUBLISH_ATTEMPT)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            reason = str(e) or type(e).__name__
            if refused(e):
                raise NotStored(f"{subject}: refused by the stream: {reason}", e.err_code) from None
            if isinstance(e, nats.errors.ConnectionClosedError):     # closed for good: no attempt can succeed
                raise NotStored(f"{subject}: not stored: {reason}") from None
            if time.monotonic() + PUBLISH_RETRY >= end:
                raise NotStored(f"{subject}: not stored after {attempts} attempts within PUBLISH_DEADLINE="
                                f"{deadline:g} s: {reason}") from None
            log.warning("publish not acknowledged; retrying", subject=subject, attempt=attempts,
                        msg_id=headers.get("Nats-Msg-Id"), error=reason)
            if isinstance(e, nats.js.errors.NoStreamResponseError):
                with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                    await ensure_streams(js)
            await asyncio.sleep(PUBLISH_RETRY)


def refused(e: Exception) -> bool:
    """The stream answered and said no (e.g. a message over its size limit): another attempt is no better.
    A server still starting (503) or not answering is worth retrying."""
    retry = (nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError)
    return isinstance(e, nats.js.errors.APIError) and not isinstance(e, retry)

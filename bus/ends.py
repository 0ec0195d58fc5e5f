"""A request's end record in TB_RESULTS (tb.done.<tenant>.<id>), stored once: store_end() publishes it
expecting no record on its subject yet, so the first end of a request id is the one kept and a later
end (a redelivery that ran again, a deadline met twice) learns which end won; ended() reads it back.
The record is the request's completion log entry and its outcome in one durable write."""
import asyncio
import contextlib
import time

import nats.errors
import nats.js.errors

from bus.publish import PUBLISH_DEADLINE, PUBLISH_RETRY, NotStored, publish
from schemas import subjects as s

EXPECT_EMPTY = {"Nats-Expected-Last-Subject-Sequence": "0"}   # stored only if its subject holds nothing yet
WRONG_LAST_SEQUENCE = 10071                                   # JetStream's refusal of that expectation


def partition(msg) -> int | None:
    """The bus partition a JetStream message was stored in (None: not partitioned, or not a stored one)."""
    with contextlib.suppress(AttributeError, ValueError, TypeError):
        return s.part_of(msg.metadata.stream)
    return None


def where(tenant: str, request_id: str, part: int | None) -> tuple[str, str]:
    """(stream, subject) of the request's end record in partition `part` (the subject as stored: with
    the partition token on a partitioned bus)."""
    return s.stream(s.RESULTS_STREAM, part), s.within(s.done(tenant, request_id), part)


async def ended(js, tenant: str, request_id: str, part: int | None) -> bytes | None:
    """The request's end record as stored, or None if it has not ended (errors of the bus propagate)."""
    stream, subject = where(tenant, request_id, part)
    try:
        return (await js.get_last_msg(stream, subject)).data
    except nats.js.errors.NotFoundError:
        return None


async def store_end(js, tenant: str, request_id: str, part: int | None, data: bytes, log,
                    deadline: float = PUBLISH_DEADLINE) -> bytes | None:
    """Stores the end record `data` unless the request has one: None when this one is stored (now, or by
    an earlier attempt under the same message id: same data), else the record stored first. The publish
    and the read of the first are each retried through a leader change; NotStored or the bus's error past
    the deadline."""
    end = time.monotonic() + deadline
    headers = {**s.msg_id(request_id), **EXPECT_EMPTY}
    try:
        ack = await publish(js, s.done(tenant, request_id), data, headers, log, deadline)
    except NotStored as e:
        if e.err_code != WRONG_LAST_SEQUENCE:
            raise
        ack = None
    if ack is not None and not ack.duplicate:
        return None
    while True:                                           # a duplicate, or refused: which end was stored?
        try:
            first = await ended(js, tenant, request_id, part)
            return None if first is None or first == data else first
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            if time.monotonic() + PUBLISH_RETRY >= end:
                raise
            log.warning("end record not read; retrying", request_id=request_id, error=str(e) or type(e).__name__)
            await asyncio.sleep(PUBLISH_RETRY)

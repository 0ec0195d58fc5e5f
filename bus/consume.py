"""Reading a stage's durable pull consumer: consume() keeps pull requests outstanding so a message is
handed over the moment it is stored, and starts over after a reconnect; a consumer that the server lost
or the router deleted is made again (add_consumer(), recreate()), waiting while the server refuses."""
import asyncio
import time

import nats.errors
import orjson
from nats.js import api

WATCH_POLL = 0.5                         # seconds between looks at the reconnect count while a watch is idle
PULL_EXPIRES = 5.0                       # seconds a pull request waits on the server
CONSUMER_RETRY = 0.5


async def consume(nc, stream: str, config: api.ConsumerConfig, handle, log, batch: int = 64, room=None,
                  stop: asyncio.Event | None = None) -> None:
    """Streams a durable pull consumer of `stream` into handle(msg), until `stop` is set (default: forever);
    handle acks. Any number of replicas may run this on the same durable: each message goes to one of them.

    Pull requests for up to `batch` messages stay outstanding on a private inbox and are topped up
    as messages arrive, so a message is handed over the moment it is stored: no round trip per
    fetch and no waiting for a batch to fill (nats-py's fetch(n) waits for n or its timeout).
    room(): how many more messages the caller can take now (default: unbounded). Once `stop` is set no
    pull is made, and what the outstanding ones still bring is handled until they expire (PULL_EXPIRES at
    most): a message the server handed to this replica is never left to wait out its ack wait."""
    await add_consumer(nc.jetstream(), stream, config, log)
    inbox, queue = nc.new_inbox(), asyncio.Queue()
    sub = await nc.subscribe(inbox, cb=queue.put)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{config.durable_name}"
    outstanding, reconnects, asked = 0, nc.stats["reconnects"], 0.0
    stop = stop or asyncio.Event()
    try:
        while True:
            if nc.stats["reconnects"] != reconnects:  # a restarted server forgot the pulls (and maybe the consumer)
                reconnects, outstanding = nc.stats["reconnects"], 0
                await add_consumer(nc.jetstream(), stream, config, log)
            if stop.is_set() and queue.empty() and (outstanding == 0 or time.monotonic() - asked >= PULL_EXPIRES):
                return
            want = min(batch, room() if room else batch) - outstanding
            if want > 0 and outstanding <= batch // 2 and not stop.is_set():
                request = {"batch": want, "expires": int(PULL_EXPIRES * 1e9)}
                await nc.publish(next_subject, orjson.dumps(request), reply=inbox)
                outstanding, asked = outstanding + want, time.monotonic()
            try:
                async with asyncio.timeout(WATCH_POLL if outstanding else 0.01):
                    msgs = [await queue.get()]
            except TimeoutError:                 # nothing yet; pulls expired or lost in a reconnect: ask again
                if time.monotonic() - asked >= PULL_EXPIRES:
                    outstanding = 0
                continue
            while not queue.empty():             # the whole burst in one turn of the event loop
                msgs.append(queue.get_nowait())
            for msg in msgs:
                status = msg.headers and msg.headers.get("Status")
                if status:                       # 408 expired / 409 conflict: these will not come
                    left = msg.headers.get("Nats-Pending-Messages")
                    outstanding = max(0, outstanding - int(left)) if left else 0
                    if gone(msg.headers):
                        await recreate(nc, stream, config, log)
                    continue
                outstanding -= 1
                try:
                    await handle(msg)
                except Exception:                # a bug in one message's handling must not stop the stage
                    log.exception("message handling failed", subject=msg.subject)
    finally:
        await sub.unsubscribe()


def gone(headers) -> bool:
    """A pull answered because the consumer no longer exists (deleted, e.g. by the router when this
    worker's heartbeat lapsed under load): 409 Consumer Deleted, or 503 no responders."""
    return headers["Status"] == "503" or "Deleted" in (headers.get("Description") or "")


RECREATE_WAIT = 0.5                      # between attempts while another consumer holds the subject


async def recreate(nc, stream: str, config: api.ConsumerConfig, log) -> None:
    """Creates the consumer again so a live stage keeps pulling; the router may still be moving the
    work it held (a work-queue subject takes one consumer at a time), so a refusal waits a little."""
    try:
        await nc.jetstream().add_consumer(stream, config)
        log.warning("consumer recreated", stream=stream, consumer=config.durable_name)
    except (nats.errors.Error, asyncio.TimeoutError) as e:
        log.warning("consumer not recreated yet", consumer=config.durable_name, error=str(e) or type(e).__name__)
        await asyncio.sleep(RECREATE_WAIT)


async def add_consumer(js, stream: str, config: api.ConsumerConfig, log) -> None:
    """Creates the durable (or finds it), retrying while the server refuses, e.g. while a router's
    re-routing still holds this worker's subject of the work queue."""
    while True:
        try:
            await js.add_consumer(stream, config)
            return
        except (nats.errors.Error, asyncio.TimeoutError) as e:     # refused, or the server is not back yet
            log.warning("consumer not created; retrying", consumer=config.durable_name,
                        error=str(e) or type(e).__name__)
            await asyncio.sleep(CONSUMER_RETRY)

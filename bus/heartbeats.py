"""The worker registry as its readers see it (the heartbeat bucket): watch() follows it through reconnects
and lost watchers, live_workers() reads it once, and the policy every reader shares decides from a
heartbeat whether a worker has left (lapsed), whether a beat only restates the last one (restated) and
whether a worker has room for batch work (spare)."""
import asyncio
import contextlib
import dataclasses
import time

import nats.errors

from bus.consume import RECREATE_WAIT, WATCH_POLL
from bus.streams import registry
from schemas.messages import Heartbeat, decode
from schemas.subjects import BATCH_KV_FREE, BATCH_WATERMARK, WORKER_TTL
from schemas.wire import WireError


def spare(waiting: int, running: int, max_num_seqs: int, kv_free: int, kv_total: int) -> bool:
    """Room for batch work beyond what a worker's interactive traffic needs now (admission and the router
    each count running and free KV with what they sent since the heartbeat)."""
    return waiting == 0 and running < BATCH_WATERMARK * max_num_seqs and kv_free >= BATCH_KV_FREE * kv_total


def lapsed(hb: Heartbeat, now: float) -> bool:
    """A worker whose last heartbeat is WORKER_TTL old has left, whether or not the bucket has expired it."""
    return now - hb.ts >= WORKER_TTL


def restated(old: Heartbeat | None, new: Heartbeat) -> bool:
    """Whether `new` only says `old` again with a fresh time: the side thread's stand-in beat while a long
    step holds the worker's loop (workers/sideline.py). Its counts are the step's start's, so what was
    routed to the worker since is not in them: a reader keeps its own count of that instead of zeroing it.
    (Zeroed, a worker in a multi-second prefill looked emptier at each stand-in beat and drew the new
    requests, which then waited for its step to end: measured on SmolLM2, 3 workers on 2 cores.)"""
    return old is not None and dataclasses.replace(old, ts=new.ts) == new


async def live_workers(kv) -> list[Heartbeat]:
    """The latest heartbeat of every live worker in the registry bucket, by worker id: one older than
    WORKER_TTL is gone, whether or not the bucket has expired its entry yet."""
    beats = []
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is None:                # the end of the current values
                break
            if entry.value and entry.operation is None:
                with contextlib.suppress(WireError):
                    beats.append(decode(entry.value, Heartbeat))
    finally:
        await watcher.stop()
    now = time.time()
    return sorted((b for b in beats if not lapsed(b, now)), key=lambda b: b.worker)


WATCH_IDLE = WORKER_TTL                  # a watch that had entries and then none this long starts over
WATCH_INACTIVE = 30.0                    # seconds the server keeps a watcher's consumer that nobody listens to


async def watch(nc, handle, log) -> None:
    """handle(entry) for every entry of the registry bucket, forever: its current values, None once they
    are read, then every change. After a reconnect (a restarted broker forgets the watcher's consumer),
    WATCH_IDLE without an entry once it had some (its consumer may have died with a cluster node while
    this connection's server lives), or a failure, the bucket is found or made again and the watch starts
    over from the current values."""
    while True:
        reconnects = nc.stats["reconnects"]
        try:
            watcher = await (await registry(nc.jetstream())).watchall(inactive_threshold=WATCH_INACTIVE)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("registry watch not started; retrying", error=str(e) or type(e).__name__)
            await asyncio.sleep(RECREATE_WAIT)
            continue
        last, had, why = time.monotonic(), False, "a reconnect"
        try:
            while nc.stats["reconnects"] == reconnects:
                try:
                    entry = await watcher.updates(WATCH_POLL)
                except nats.errors.TimeoutError:
                    if had and time.monotonic() - last >= WATCH_IDLE:
                        why = f"{WATCH_IDLE:g} s without an entry"
                        break
                    continue
                handle(entry)
                last, had = time.monotonic(), had or entry is not None
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        log.warning(f"registry watch restarted after {why}")

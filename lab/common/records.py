"""What the cluster recorded of a run, read back from the bus: the completion records in TB_RESULTS
after a stream sequence, and the router's stats."""
import asyncio

from nats.js import api

import bus
from schemas import subjects
from schemas.messages import Completion, RouterStats, decode


async def results_seq(nats_url: str) -> int:
    nc = await bus.connect(nats_url, "bench-routing")
    try:
        return (await nc.jetstream().stream_info(subjects.RESULTS_STREAM)).state.last_seq
    finally:
        await nc.close()


async def records(nats_url: str, after: int, count: int, timeout: float = 30.0) -> list[Completion]:
    """The `count` completion records stored after stream sequence `after`."""
    nc = await bus.connect(nats_url, "bench-routing")
    config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
    try:
        sub = await nc.jetstream().subscribe(subjects.RESULTS_SUBJECTS, ordered_consumer=True, config=config)
        return [decode((await sub.next_msg(timeout=timeout)).data, Completion) for _ in range(count)]
    finally:
        await nc.close()


async def router_stats(nats_url: str, router: str, done, timeout: float = 30.0) -> RouterStats | None:
    """The router's next stats record for which done(stats) holds; at the timeout, the last one seen."""
    nc = await bus.connect(nats_url, "bench-routing")
    stats = None
    try:
        sub = await nc.subscribe(subjects.router_stats(router))
        async with asyncio.timeout(timeout):
            while stats is None or not done(stats):
                stats = decode((await sub.next_msg(timeout=timeout)).data, RouterStats)
    except TimeoutError:
        pass
    finally:
        await nc.close()
    return stats

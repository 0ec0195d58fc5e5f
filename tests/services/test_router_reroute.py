"""Re-routing a departed worker's work on a real nats-server (no model, no router loop): strikes
follow the request id — one for each item the worker had taken, none for items only queued for it,
only the suspect's when its heartbeat named one — and the re-route leaves no consumer behind."""
import asyncio
import time

import nats

import bus
from schemas import subjects
from schemas.messages import Heartbeat, TokenizedRequest, WorkItem, decode, encode
from schemas.sampling import SamplingParams
from services.router import service
from services.router.service import RouterService


def item(rid: str, strikes: int = 0) -> WorkItem:
    return WorkItem(TokenizedRequest(rid, "t", SamplingParams(seed=1), [1, 2, 3]), "gone", time.time(), 0, strikes)


async def setup(nats_url: str, ids: list[str], taken: int, strikes: int = 0):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.ensure_streams(js)
    for rid in ids:
        await js.publish(subjects.work("gone", rid), encode(item(rid, strikes)), headers=subjects.msg_id(rid))
    await js.add_consumer(subjects.WORK_STREAM, bus.worker_consumer("gone"))
    sub = await js.pull_subscribe_bind(stream=subjects.WORK_STREAM, durable="worker-gone")
    if taken:
        await sub.fetch(taken, timeout=2)                 # the worker took these, then died
    router = RouterService(nc, router_id="r0")
    router.registry.update(Heartbeat("live", time.time(), "tiny", 16, 8, 0, 0, 100, 100, 0, 0, 0))
    return nc, js, router


async def moved(js) -> dict[str, WorkItem]:
    sub = await js.pull_subscribe(bus.work_filter("live"), stream=subjects.WORK_STREAM)
    got = {}
    for msg in await sub.fetch(10, timeout=2):
        w = decode(msg.data, WorkItem)
        got[w.request.id] = w
    return got


async def consumers(js) -> list[str]:
    return [c.name for c in await js.consumers_info(subjects.WORK_STREAM)]


def test_taken_items_get_a_strike_queued_ones_none_and_no_consumer_is_left(nats_url):
    async def main():
        nc, js, router = await setup(nats_url, ["a", "b", "c"], taken=2)
        await router.reroute("gone")
        assert await consumers(js) == []                  # its own and the re-route's are both gone
        got = await moved(js)
        assert {rid: (w.strikes, w.attempt, w.worker) for rid, w in got.items()} == {
            "a": (1, 1, "live"), "b": (1, 1, "live"), "c": (0, 1, "live")}
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_strikes_add_up_across_re_routes(nats_url):
    async def main():
        nc, js, router = await setup(nats_url, ["a"], taken=1, strikes=1)
        await router.reroute("gone")
        assert (await moved(js))["a"].strikes == 2
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_when_the_heartbeat_names_a_suspect_only_it_gets_the_strike(nats_url):
    async def main():
        nc, js, router = await setup(nats_url, ["a", "b"], taken=2)
        await router.reroute("gone", suspect="b")
        assert {rid: w.strikes for rid, w in (await moved(js)).items()} == {"a": 0, "b": 1}
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))


class Recorder:
    """Stands in for a structlog logger: remembers (level, event, fields)."""

    def __init__(self):
        self.lines = []

    def __getattr__(self, level):
        return lambda event, **kw: self.lines.append((level, event, kw))


def test_a_failing_re_route_is_one_log_line_not_a_traceback_and_leaves_no_consumer(nats_url):
    async def main():
        nc, js, router = await setup(nats_url, ["a"], taken=1)

        async def broken(*_):
            raise nats.errors.ConnectionClosedError
        router.send, router.log = broken, Recorder()
        await router.reroute("gone")                      # returns: nothing for asyncio to print
        assert await consumers(js) == []
        await nc.close()
        return router.log.lines
    lines = asyncio.run(asyncio.wait_for(main(), 30))
    assert ("error", "re-route failed", {"worker": "gone", "error": "ConnectionClosedError: nats: connection closed"}
            ) in lines


def test_a_worker_back_before_its_work_moved_keeps_it_with_the_strikes(nats_url):
    async def main():
        nc, js, router = await setup(nats_url, ["a", "b"], taken=1)
        router.registry.remove("live")
        router.registry.update(Heartbeat("gone", time.time(), "tiny", 16, 8, 0, 0, 100, 100, 0, 0, 0))
        await router.reroute("gone")
        assert await consumers(js) == []
        sub = await js.pull_subscribe(bus.work_filter("gone"), stream=subjects.WORK_STREAM)
        items = [decode(m.data, WorkItem) for m in await sub.fetch(10, timeout=2)]
        assert sorted((w.request.id, w.strikes) for w in items) == [("a", 1), ("b", 0)]
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_fetches_that_time_out_on_a_busy_server_do_not_end_the_re_route_early(nats_url):
    """An empty fetch is not an empty consumer: the items moved all the same once fetches answer."""
    async def main():
        nc, js, router = await setup(nats_url, ["a", "b", "c"], taken=2)
        bind, timeouts = router.js.pull_subscribe_bind, [2]

        async def slow_bind(**kw):
            sub = await bind(**kw)
            fetch = sub.fetch

            async def slow_fetch(*a, **k):
                if timeouts[0]:
                    timeouts[0] -= 1
                    raise nats.errors.TimeoutError
                return await fetch(*a, **k)
            sub.fetch = slow_fetch
            return sub
        router.js.pull_subscribe_bind = slow_bind
        await router.reroute("gone")
        assert timeouts == [0] and await consumers(js) == []
        assert {rid: w.strikes for rid, w in (await moved(js)).items()} == {"a": 1, "b": 1, "c": 0}
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def fail_once(router) -> list[int]:
    """The router's next send times out, the later ones go through; the list holds the failures left."""
    send, failures = router.send, [1]

    async def flaky(item):
        if failures[0]:
            failures[0] -= 1
            raise asyncio.TimeoutError
        await send(item)
    router.send = flaky
    return failures


def test_a_re_route_that_fails_is_tried_again_and_keeps_the_strikes_of_the_items_taken(nats_url, monkeypatch):
    monkeypatch.setattr(service, "REROUTE_RETRY", 0.05)

    async def main():
        nc, js, router = await setup(nats_url, ["a", "b"], taken=1)
        fail_once(router)
        router.log = Recorder()
        await router.reroute("gone")
        assert await consumers(js) == []
        assert {rid: w.strikes for rid, w in (await moved(js)).items()} == {"a": 1, "b": 0}
        await nc.close()
        return router.log.lines
    lines = asyncio.run(asyncio.wait_for(main(), 30))
    assert [e for _, e, _ in lines if "re-route" in e] == ["re-route failed; retrying", "work re-routed"]


def test_a_second_departure_while_the_first_re_route_waits_to_retry_starts_no_second_re_route(nats_url, monkeypatch):
    """A second re-route would find the worker's consumer gone (the first deleted it), count nothing taken
    and move the item without its strike."""
    monkeypatch.setattr(service, "REROUTE_RETRY", 0.5)

    async def main():
        nc, js, router = await setup(nats_url, ["a"], taken=1)
        failures = fail_once(router)
        first = asyncio.create_task(router.reroute("gone"))
        while failures[0]:                              # the first failed once and waits to try again
            await asyncio.sleep(0.01)
        await router.reroute("gone")
        await first
        assert (await moved(js))["a"].strikes == 1
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))

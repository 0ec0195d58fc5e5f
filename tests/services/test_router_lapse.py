"""The router on a real nats-server: a heartbeat lapse during and just after a broker outage is not a
departed worker (no worker could write one), and a request no worker took within REQUEST_DEADLINE is
answered with a timeout, given its end record and acked, never held forever."""
import asyncio
import time

import nats

import bus
from bus.log import configure
from ops.procs import free_port, start_nats, stop
from schemas import subjects
from schemas.messages import Completion, ErrorChunk, Heartbeat, TokenizedRequest, decode, encode
from schemas.sampling import SamplingParams
from services.router.service import RouterService


def beat(worker: str, ts: float) -> Heartbeat:
    return Heartbeat(worker, ts, "tiny", 16, 8, 0, 0, 100, 100, 0, 0, 0)


def watching_leaves(router: RouterService) -> list[str]:
    left = []

    async def reroute(worker, suspect=""):
        left.append(worker)
    router.reroute = reroute
    return left


async def until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_heartbeat_lapse_counts_only_once_the_connection_is_up_worker_ttl_after_a_reconnect(tmp_path):
    port = free_port()
    procs = [start_nats(port, tmp_path / "nats")]

    async def main():
        nc = await bus.connect(f"nats://127.0.0.1:{port}", "router-test")
        router = RouterService(nc, router_id="r0")
        left = watching_leaves(router)
        procs[0] = (stop(procs) or start_nats(port, tmp_path / "nats"))  # the broker restarts
        await until(lambda: nc.stats["reconnects"] == 1 and nc.is_connected)
        t = time.time()
        router.registry.update(beat("live", t - 10 * subjects.WORKER_TTL))   # none written while it was down
        router.drop_lapsed(t)
        router.drop_lapsed(t + subjects.WORKER_TTL - 0.1)
        assert "live" in router.registry.workers and left == []
        router.drop_lapsed(t + subjects.WORKER_TTL)
        await asyncio.sleep(0)                                          # the re-route task runs
        assert "live" not in router.registry.workers and left == ["live"]
        await nc.close()
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        stop(procs)


def test_a_lapsed_heartbeat_while_the_connection_is_down_is_not_a_departure(tmp_path):
    port = free_port()
    procs = [start_nats(port, tmp_path / "nats")]

    async def main():
        nc = await bus.connect(f"nats://127.0.0.1:{port}", "router-test")
        router = RouterService(nc, router_id="r0")
        left = watching_leaves(router)
        stop(procs)
        await until(lambda: not nc.is_connected)
        t = time.time()
        router.registry.update(beat("live", t - 10 * subjects.WORKER_TTL))
        router.drop_lapsed(t)
        router.drop_lapsed(t + 10 * subjects.WORKER_TTL)
        await asyncio.sleep(0)
        assert "live" in router.registry.workers and left == []
        await nc.close()
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        stop(procs)


def test_on_the_first_connection_a_lapsed_heartbeat_is_a_departure_at_once(nats_url):
    async def main():
        nc = await nats.connect(nats_url)
        router = RouterService(nc, router_id="r0")
        left = watching_leaves(router)
        t = time.time()
        router.registry.update(beat("gone", t - subjects.WORKER_TTL))
        router.drop_lapsed(t)
        await asyncio.sleep(0)
        assert left == ["gone"]
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))


async def routed(js, created: float):
    """The router's delivery of a tokenized request "late", accepted at `created`."""
    req = TokenizedRequest("late", "t", SamplingParams(seed=1), [1, 2, 3], created=created)
    await js.publish(subjects.route("t", "late"), encode(req), headers=subjects.msg_id("late"))
    await js.add_consumer(subjects.ROUTE_STREAM, bus.HANDOFFS)
    (msg,) = await (await js.pull_subscribe_bind(stream=subjects.ROUTE_STREAM, durable="router")).fetch(1)
    return msg


def test_a_request_no_worker_took_within_its_deadline_is_answered_timeout_recorded_and_acked(nats_url, monkeypatch):
    monkeypatch.setattr(subjects, "REQUEST_DEADLINE", 0.5)

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        answers = await nc.subscribe(subjects.out("late"))
        msg = await routed(js, created=time.time())
        router = RouterService(nc, router_id="r0")             # no worker ever registers
        await asyncio.wait_for(router.handle(msg), 5)
        err = decode((await answers.next_msg(2)).data, ErrorChunk)
        assert err.code == "timeout" and "REQUEST_DEADLINE=0.5 s" in err.message
        end = decode(await bus.ended(js, "t", "late", None), Completion)
        assert (end.finish_reason, end.error_code, end.worker) == ("error", "timeout", "r0")
        assert (await js.stream_info(subjects.ROUTE_STREAM)).state.messages == 0     # acked: never routed
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_timed_out_request_keeps_the_record_of_its_first_end(nats_url, monkeypatch):
    monkeypatch.setattr(subjects, "REQUEST_DEADLINE", 0.5)

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        first = Completion("late", "t", "w1", SamplingParams(), [1], [7, 8], "stop")
        await bus.store_end(js, "t", "late", None, encode(first), configure("test"))
        msg = await routed(js, created=time.time() - 1)
        await RouterService(nc, router_id="r0").handle(msg)
        assert decode(await bus.ended(js, "t", "late", None), Completion) == first
        assert (await js.stream_info(subjects.RESULTS_STREAM)).state.messages == 1       # the second end refused
        assert (await js.stream_info(subjects.ROUTE_STREAM)).state.messages == 0
        await nc.close()
    asyncio.run(asyncio.wait_for(main(), 30))

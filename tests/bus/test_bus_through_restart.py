"""The bus through a nats-server SIGKILLed and started again on the same port and store: the streams
and the registry bucket are still there, a pull consumer (consume) and a registry watcher (watch)
resume by themselves, a publish retried through the outage is stored once, and what a wiped store
lost is made again on reconnect."""
import asyncio
import shutil
import time

import pytest

import bus
from bus.log import configure
from ops.procs import free_port, start_nats, stop
from schemas import subjects
from schemas.messages import encode
from tests.services.fake_pipeline import heartbeat

LOG = configure("test")


class Broker:
    """A nats-server on a free port, SIGKILLed and started again on the same port and store (from this
    thread: a nats-server dies with the thread that started it)."""

    def __init__(self, store):
        self.store, self.port = store, free_port()
        self.procs = [start_nats(self.port, store)]
        self.url = f"nats://127.0.0.1:{self.port}"

    def kill(self, wipe: bool = False) -> None:
        self.procs[-1].kill()
        self.procs[-1].wait()
        if wipe:
            shutil.rmtree(self.store / "jetstream")

    def start(self) -> None:
        self.procs.append(start_nats(self.port, self.store))

    async def restart(self, down: float = 0.5, wipe: bool = False) -> None:
        self.kill(wipe)
        await asyncio.sleep(down)                   # the clients notice, and try meanwhile
        self.start()


@pytest.fixture
def broker(tmp_path):
    b = Broker(tmp_path)
    yield b
    stop(b.procs)


@pytest.mark.serial
def test_a_pull_consumer_resumes_after_a_broker_restart_without_losing_or_repeating(broker):
    async def main():
        nc = await bus.connect(broker.url, "test", LOG)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        got = asyncio.Queue()

        async def handle(msg):
            await msg.ack_sync()
            got.put_nowait(msg.data)

        task = asyncio.create_task(bus.consume(nc, subjects.WORK_STREAM, bus.worker_consumer("w0"), handle,
                                                    LOG))
        await bus.publish(js, subjects.work("w0", "r1"), b"1", subjects.msg_id("r1"), LOG)
        assert await asyncio.wait_for(got.get(), 5) == b"1"
        await broker.restart()
        t0 = time.monotonic()
        await bus.publish(js, subjects.work("w0", "r2"), b"2", subjects.msg_id("r2"), LOG)
        assert await asyncio.wait_for(got.get(), 10) == b"2"
        assert time.monotonic() - t0 < 5                # well before a pull's own expiry would notice
        await asyncio.sleep(0.5)
        assert got.empty()                              # "1" was acked before: it does not come again
        task.cancel()
        await nc.close()

    asyncio.run(asyncio.wait_for(main(), 40))


def test_a_publish_retried_through_the_outage_is_stored_once(broker):
    async def main():
        nc = await bus.connect(broker.url, "test", LOG)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        broker.kill()
        pub = asyncio.create_task(bus.publish(js, subjects.request_new("t", "r1"), b"x", subjects.msg_id("r1"), LOG))
        await asyncio.sleep(3.0)                    # attempts fail or wait meanwhile
        assert not pub.done()
        broker.start()
        await asyncio.wait_for(pub, 20)
        await bus.publish(js, subjects.request_new("t", "r1"), b"x", subjects.msg_id("r1"), LOG)   # a retry of it
        assert (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages == 1
        await nc.close()

    asyncio.run(asyncio.wait_for(main(), 40))


@pytest.mark.parametrize("wipe", [False, True], ids=["same-store", "wiped-store"])
def test_the_registry_survives_or_is_made_again_and_a_watcher_sees_it_after_a_restart(broker, wipe):
    async def main():
        nc = await bus.connect(broker.url, "test", LOG)
        await bus.ensure_streams(nc.jetstream())
        seen = []
        watching = asyncio.create_task(bus.watch(nc, lambda e: seen.append(e and e.key), LOG))
        kv = await bus.registry(nc.jetstream())
        await kv.put("w0", encode(heartbeat("w0")))
        while "w0" not in seen:
            await asyncio.sleep(0.05)
        await broker.restart(wipe=wipe)
        if not wipe:
            assert "w0" in await kv.keys()          # on disk, within its TTL
        seen.clear()
        deadline = time.monotonic() + 10
        while True:                                     # a worker's heartbeat re-creates a wiped bucket
            try:
                await kv.put("w1", encode(heartbeat("w1")))
                break
            except Exception:
                assert time.monotonic() < deadline, "the bucket was not made again"
                await asyncio.sleep(0.2)
        while "w1" not in seen:
            assert time.monotonic() < deadline, f"the watcher did not see w1 after the restart: {seen}"
            await asyncio.sleep(0.05)
        streams = {s.config.name for s in await nc.jetstream().streams_info()}
        assert {c.name for c in bus.STREAMS} <= streams
        watching.cancel()
        await nc.close()

    asyncio.run(asyncio.wait_for(main(), 40))

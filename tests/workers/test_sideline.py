"""The worker's side thread keeps its heartbeat fresh while an engine step holds the engine for
longer than WORKER_TTL (a long prefill on a CPU), and stops vouching for a loop silent past
MAX_STEP_SECONDS (a hung engine must lapse)."""
import asyncio
import threading
import time

import nats
import nats.js.errors
import pytest

import bus
from schemas import subjects
from schemas.messages import Heartbeat, TokenizedRequest, WorkItem, decode, encode
from schemas.sampling import SamplingParams
from tests.workers.service_helpers import worker
from workers import sideline
from workers.engine.engine import EngineConfig, LLMEngine

STEP_SECONDS = subjects.WORKER_TTL + 1.5


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64))


def watch(nats_url: str, stop: threading.Event, ages: list[float]) -> None:
    """In a thread of its own: the age of w0's heartbeat in the registry, every 0.1 s; infinite once the
    entry, seen before, is gone. The bucket's TTL is WORKER_TTL, so nats-server removes a heartbeat that
    old at its next expiry pass: a lapse may show as the entry gone, not as an age over WORKER_TTL."""
    async def main():
        nc = await nats.connect(nats_url)
        registry = await bus.registry(nc.jetstream())
        while not stop.is_set():
            try:
                ages.append(time.time() - decode((await registry.get("w0")).value, Heartbeat).ts)
            except nats.js.errors.KeyNotFoundError:
                if ages:
                    ages.append(float("inf"))
            except Exception:                    # a slow reply: the next look
                pass
            await asyncio.sleep(0.1)
        await nc.close()
    asyncio.run(main())


def run_one_slow_step(nats_url: str, engine: LLMEngine, monkeypatch) -> list[float]:
    step = engine.step
    slow = {"left": 1}

    def one_slow_step():
        if slow["left"] and engine.has_unfinished():
            slow["left"] -= 1
            time.sleep(STEP_SECONDS)             # holds the engine, as a long step does
        return step()
    monkeypatch.setattr(engine, "step", one_slow_step)
    stop, ages = threading.Event(), []
    watcher = threading.Thread(target=watch, args=(nats_url, stop, ages))

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        async with worker(nats_url, engine):
            watcher.start()
            await asyncio.sleep(1.0)
            done = asyncio.Event()

            async def seen(msg):
                if b"final" in msg.data:
                    done.set()
            await nc.subscribe(subjects.out("slow"), cb=seen)
            item = WorkItem(TokenizedRequest("slow", "t", SamplingParams(max_tokens=3), [5, 6, 7]), "w0", time.time())
            await js.publish(subjects.work("w0", "slow"), encode(item), headers=subjects.msg_id("slow"))
            await asyncio.wait_for(done.wait(), 30)
            await asyncio.sleep(0.5)
        stop.set()
        await nc.close()
    try:
        asyncio.run(main())
    finally:
        stop.set()
        watcher.join(10)
    return ages


def test_a_step_longer_than_worker_ttl_does_not_let_the_heartbeat_lapse(nats_url, engine, monkeypatch):
    ages = run_one_slow_step(nats_url, engine, monkeypatch)
    assert len(ages) > 10 * STEP_SECONDS * 0.8   # it watched the whole step
    assert max(ages) < subjects.WORKER_TTL - 1.0, max(ages)


def test_a_loop_silent_past_max_step_seconds_is_let_lapse(nats_url, engine, monkeypatch):
    monkeypatch.setattr(sideline, "MAX_STEP_SECONDS", 1.0)
    monkeypatch.setattr("workers.service.registry.MAX_STEP_SECONDS", 1.0)
    ages = run_one_slow_step(nats_url, engine, monkeypatch)
    assert max(ages) > subjects.WORKER_TTL         # the stand-in beats stopped: gone, or older than the TTL

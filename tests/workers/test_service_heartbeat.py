"""The worker's heartbeat counts the requests on their way into the engine: a work item taken while a
step holds the engine waits for it, and a heartbeat built meanwhile says it waits, with its KV blocks
less its cached prefix, as the scheduler counts a waiting request. (Without it, the router, which
forgets what it routed at each fresh heartbeat, saw the worker without those requests for the whole
next step, and sent it more.)"""
import asyncio
import time

import nats
import pytest

import bus
from schemas import subjects
from schemas.messages import TokenizedRequest, WorkItem, encode
from schemas.sampling import SamplingParams
from tests.workers.service_helpers import worker
from workers.engine.engine import EngineConfig, LLMEngine

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, max_num_seqs=16))


async def submit(js, rid: str, prompt: list[int], params: SamplingParams) -> None:
    item = WorkItem(TokenizedRequest(rid, "t", params, prompt), "w0", time.time())
    await js.publish(subjects.work("w0", rid), encode(item), headers=subjects.msg_id(rid))


async def until(check, what: str) -> None:
    try:
        async with asyncio.timeout(30):
            while not check():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within 30 s: {what}") from None


def test_a_heartbeat_counts_the_requests_waiting_for_the_step_under_way_as_waiting(nats_url, engine, monkeypatch):
    shared = list(range(100, 140))                       # 40 tokens: two full blocks cached once it has run
    step = engine.step

    def slow():                                          # the two long requests stay running
        time.sleep(0.05)
        return step()
    monkeypatch.setattr(engine, "step", slow)

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        async with worker(nats_url, engine) as w:
            await submit(js, "first", shared, SamplingParams(max_tokens=2, ignore_eos=True))
            await until(lambda: w.state.counts.finished == 1, "the first request ends")
            async with w.engine_lock:                    # a step under way: the next items wait for it
                await submit(js, "hit", shared[:32] + list(range(500, 520)), LONG)    # 4 blocks, 2 cached
                await submit(js, "cold", list(range(600, 640)), LONG)                 # 3 blocks
                await until(lambda: len(w.intake.taken) == 2, "both items wait for the engine")
                w.registry.build_beat()
                waiting = w.registry.beat
            await until(lambda: len(w.running) == 2, "both items are in the engine")
            async with w.engine_lock:
                w.registry.build_beat()
                inside = w.registry.beat
        await nc.close()
        return waiting, inside
    waiting, inside = asyncio.run(main())
    assert (waiting.running, waiting.waiting, waiting.kv_blocks_queued) == (0, 2, 5)
    assert inside.running + inside.waiting == 2          # counted once: the engine's, no longer as taken

"""The worker service's stream, on a real nats-server with the tiny model, in-process: a burst of work
items enters the engine together, not one per engine step; an item whose checks on the bus outlast the
loop's wait between steps still joins the step after the one under way; under load a chunk carries several steps'
tokens, and the chunks still carry every token once, in order, at the right offsets, the first token
at once; without a chunk rate every step of a stream is a chunk."""
import asyncio
import contextlib
import time

import nats
import pytest

import bus
from schemas import subjects
from schemas.messages import FinalChunk, TokenChunk, TokenizedRequest, WorkItem, decode, encode
from schemas.sampling import SamplingParams
from tests.workers.service_helpers import worker
from workers.engine.engine import EngineConfig, LLMEngine

PARAMS = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
STEP_PAUSE = 0.02                   # seconds added to each engine step: a step slower than the bus's round trip


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, max_num_seqs=16))


def offline(engine: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    """The request's tokens from the engine alone."""
    req = engine.add_request(f"offline-{rid}", prompt, PARAMS)
    while engine.has_unfinished():
        engine.step()
    return req.output_token_ids


@contextlib.contextmanager
def slow_steps(engine: LLMEngine, monkeypatch, pause: float = STEP_PAUSE):
    """Each engine step takes `pause` seconds longer (on the step thread, as a real step's work); yields
    the step count at each add_request."""
    step, add, added = engine.step, engine.add_request, []

    def slow():
        time.sleep(pause)
        return step()

    def counted(*args, **kwargs):
        added.append(engine.num_steps)
        return add(*args, **kwargs)
    monkeypatch.setattr(engine, "step", slow)
    monkeypatch.setattr(engine, "add_request", counted)
    yield added


async def submit(js, rid: str, prompt: list[int], params: SamplingParams = PARAMS) -> None:
    item = WorkItem(TokenizedRequest(rid, "t", params, prompt), "w0", time.time())
    await js.publish(subjects.work("w0", rid), encode(item), headers=subjects.msg_id(rid))


async def chunks(nc, rids: list[str]) -> dict[str, asyncio.Queue]:
    queues = {rid: asyncio.Queue() for rid in rids}
    for rid, q in queues.items():
        await nc.subscribe(subjects.out(rid), cb=q.put)
    return queues


async def until_end(q: asyncio.Queue) -> list[TokenChunk | FinalChunk]:
    got = []
    async with asyncio.timeout(60):
        while not got or type(got[-1]) is TokenChunk:
            got.append(decode((await q.get()).data, TokenChunk, FinalChunk))
    return got


def test_a_burst_of_work_items_enters_the_engine_together_not_a_step_apart(nats_url, engine, monkeypatch):
    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        rids = [f"burst{i}" for i in range(12)]
        queues = await chunks(nc, rids)
        with slow_steps(engine, monkeypatch) as added:
            async with worker(nats_url, engine, 0) as service:
                await submit(js, "first", [3, 4, 5])   # the engine is busy when the burst comes
                await asyncio.sleep(0.1)
                await asyncio.gather(*(submit(js, rid, [7, i + 8, 9]) for i, rid in enumerate(rids)))
                for q in queues.values():
                    assert type((await until_end(q))[-1]) is FinalChunk
                assert service.intake.admitting == 0
        burst = added[1:]
        assert len(burst) == len(rids)
        assert max(burst) - min(burst) <= 2, f"the burst entered over steps {burst}"   # one at a time: 12+ steps
        await nc.close()
    asyncio.run(main())


def test_an_item_whose_checks_outlast_the_wait_between_steps_joins_the_next_step(nats_url, engine, monkeypatch):
    """Its checks (its end record looked up on the bus) take 0.1 s, longer than the loop waits between steps
    of 0.3 s (10% of the step): they must run during the step under way, not after it. Stepping on the
    event loop's thread, they started after that step and the item joined the step after next."""
    pause, check = 0.3, 0.1

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        queues = await chunks(nc, ["long", "late"])
        with slow_steps(engine, monkeypatch, pause) as added:
            async with worker(nats_url, engine, 0) as service:
                ended = service.records.already_ended

                async def slow_check(item, msg):
                    await asyncio.sleep(check)
                    return await ended(item, msg)
                monkeypatch.setattr(service.records, "already_ended", slow_check)
                short = SamplingParams(max_tokens=6, ignore_eos=True)
                await submit(js, "long", [3, 4, 5], short)
                await queues["long"].get()                  # its first token: the engine is stepping
                seen = engine.num_steps
                while engine.num_steps == seen:             # a step has just begun: `pause` s to go
                    await asyncio.sleep(0.005)
                under_way = engine.num_steps + 1
                await submit(js, "late", [6, 7, 8], short)
                for q in queues.values():
                    assert type((await until_end(q))[-1]) is FinalChunk
        assert added[1] == under_way, f"added after step {added[1]}, the step under way was {under_way}"
        await nc.close()
    asyncio.run(main())


@pytest.mark.parametrize("chunk_rate", [1.0, 0.0])
def test_chunks_carry_every_token_once_in_order_the_first_at_once(nats_url, engine, monkeypatch, chunk_rate):
    monkeypatch.setattr(subjects, "MAX_CHUNK_INTERVAL", 0.5)         # 3 streams at 1 chunk/s: 0.5 s apart
    prompts = {f"s{chunk_rate:g}-{i}": [11, 12 + i, 13] for i in range(3)}
    want = {rid: offline(engine, rid, prompt) for rid, prompt in prompts.items()}

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        queues = await chunks(nc, list(prompts))
        with slow_steps(engine, monkeypatch):
            async with worker(nats_url, engine, chunk_rate):
                for rid, prompt in prompts.items():
                    await submit(js, rid, prompt)
                got = {rid: await until_end(q) for rid, q in queues.items()}
        await nc.close()
        return got

    for rid, stream in asyncio.run(main()).items():
        assert [c.seq for c in stream] == list(range(len(stream)))
        offsets = [sum(len(c.token_ids) for c in stream[:i]) for i in range(len(stream))]
        assert [c.offset for c in stream] == offsets                       # each chunk goes on where the last ended
        assert [t for c in stream for t in c.token_ids] == want[rid]       # every token once, in order
        assert len(stream[0].token_ids) == 1 and stream[0].prompt_tail == prompts[rid]   # the first token at once
        assert stream[-1].usage["completion_tokens"] == PARAMS.max_tokens
        if chunk_rate:                                                     # several steps' tokens a chunk
            assert len(stream) < PARAMS.max_tokens // 2
        else:
            assert {len(c.token_ids) for c in stream[:-1]} == {1}          # a chunk per step

"""The worker service on a real nats-server with the tiny model, in-process: a request the engine
fails is answered with engine_error, dead-lettered and acked while the worker keeps serving; an item
with MAX_STRIKES strikes is dead-lettered without running; a moved item continues from the tokens
the gateway says its client has."""
import asyncio
import contextlib
import time

import nats
import pytest

import bus
from bus.log import configure
from schemas import subjects
from schemas.messages import (
    Completion,
    DeadLetter,
    ErrorChunk,
    FinalChunk,
    Meter,
    Progress,
    TokenChunk,
    TokenizedRequest,
    Usage,
    WorkItem,
    decode,
    encode,
)
from schemas.sampling import SamplingParams
from tests.workers.service_helpers import worker
from workers import service as service_module
from workers.engine.engine import EngineConfig, LLMEngine
from workers.service import records

FAULT = 4001
PARAMS = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, max_num_seqs=8))
    engine.inject_fault(FAULT)
    return engine


async def submit(js, rid: str, prompt: list[int], attempt: int = 0, strikes: int = 0) -> None:
    item = WorkItem(TokenizedRequest(rid, "t", PARAMS, prompt), "w0", time.time(), attempt, strikes)
    await js.publish(subjects.work("w0", rid), encode(item), headers=subjects.msg_id(rid, item.msg_id))


async def stream(nc, rid: str) -> asyncio.Queue:
    q = asyncio.Queue()
    await nc.subscribe(subjects.out(rid), cb=q.put)
    return q


async def until_end(q: asyncio.Queue) -> list:
    got = []
    async with asyncio.timeout(30):
        while not got or isinstance(got[-1], TokenChunk):
            got.append(decode((await q.get()).data, TokenChunk, FinalChunk, ErrorChunk))
    return got


async def stored(js, subject: str, cls: type) -> list:
    """Every record of a stream's subject, decoded as cls."""
    sub = await js.subscribe(subject, ordered_consumer=True)
    out = []
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError, nats.errors.TimeoutError):
        while True:
            out.append(decode((await sub.next_msg(timeout=0.5)).data, cls))
    return out


async def dead_letters(js) -> list[DeadLetter]:
    return await stored(js, subjects.DEAD_SUBJECTS, DeadLetter)


async def outcome_of(js, rid: str) -> Completion:
    """The request's end record."""
    return decode(await bus.ended(js, "t", rid, None), Completion)


def test_an_engine_failure_is_dead_lettered_and_acked_and_the_worker_keeps_serving(nats_url, engine):
    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        bad, good = await stream(nc, "bad"), await stream(nc, "good")
        async with worker(nats_url, engine) as service:
            await submit(js, "bad", [5, FAULT, 6])
            await submit(js, "good", [5, 7, 6])
            err, done = (await until_end(bad))[-1], (await until_end(good))[-1]
            assert err.code == "engine_error" and "fault injected on token 4001" in err.message
            assert done.finish_reason == "length" and done.usage["completion_tokens"] == 8
            await asyncio.sleep(0.5)
            assert not service.failed and not service.stop.is_set()
        (dead,) = await dead_letters(js)
        assert dead.request.id == "bad" and dead.strikes == 1 and dead.worker == "w0"
        outcome = await outcome_of(js, "bad")
        assert (outcome.finish_reason, outcome.error_code) == ("error", "engine_error")
        assert (await js.stream_info(subjects.WORK_STREAM)).state.messages == 0    # acked: never again
        await nc.close()
    asyncio.run(main())


def test_an_item_with_max_strikes_is_dead_lettered_without_running(nats_url, engine):
    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        q = await stream(nc, "struck")
        steps = engine.num_steps
        async with worker(nats_url, engine):
            await submit(js, "struck", [5, 6], attempt=2, strikes=subjects.MAX_STRIKES)
            (err,) = await until_end(q)
        assert err.code == "dead_lettered" and f"crashed or failed {subjects.MAX_STRIKES} workers" in err.message
        assert engine.num_steps == steps
        assert [d.request.id for d in await dead_letters(js)] == ["struck"]
        await nc.close()
    asyncio.run(main())


def test_a_moved_item_continues_after_the_tokens_the_gateway_reports(nats_url, engine):
    async def main():
        ref = engine.add_request("ref", [9, 8, 7], PARAMS)
        while engine.has_unfinished():
            engine.step()
        have = ref.output_token_ids[:3]
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)

        async def answer(msg):
            await nc.publish(msg.reply, encode(Progress("moved", have)))
        await nc.subscribe(subjects.progress("moved"), cb=answer)
        q = await stream(nc, "moved")
        async with worker(nats_url, engine):
            await submit(js, "moved", [9, 8, 7], attempt=1)
            got = await until_end(q)
        assert got[0].offset == 3                                  # its chunks go on where the client is
        assert have + [t for c in got for t in c.token_ids] == ref.output_token_ids
        assert got[-1].usage["completion_tokens"] == 8
        await nc.close()
    asyncio.run(main())


def test_a_request_whose_gateway_died_is_still_metered_once_by_its_worker(nats_url, engine, monkeypatch):
    monkeypatch.setattr(records, "USAGE_BACKUP_SECONDS", 0.2)

    async def body():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        async with worker(nats_url, engine):
            for rid, gateway_metered in (("orphan", False), ("metered", True)):
                q = await stream(nc, rid)
                item = WorkItem(TokenizedRequest(rid, "t", PARAMS, [5, 6, 7], meter=Meter("k1", "chat", "tiny")),
                                "w0", time.time())
                if gateway_metered:              # the gateway's own record, stored first
                    gateway_usage = Usage(rid, "t", "k1", "tiny", "chat", "length", 3, 0, 8, {"ttft_ms": 1.0})
                    await js.publish(subjects.usage("t", rid), encode(gateway_usage), headers=subjects.msg_id(rid))
                await js.publish(subjects.work("w0", rid), encode(item), headers=subjects.msg_id(rid))
                assert isinstance((await until_end(q))[-1], FinalChunk)
            await asyncio.sleep(1.0)
            records = {u.id: u for u in await stored(js, subjects.USAGE_SUBJECTS, Usage)}
        assert sorted(records) == ["metered", "orphan"]           # one each: the worker's copy of "metered" deduped
        orphan = records["orphan"]
        assert (orphan.key_id, orphan.api, orphan.model, orphan.prompt_tokens, orphan.completion_tokens) == (
            "k1", "chat", "tiny", 3, 8)
        assert records["metered"].timing == {"ttft_ms": 1.0}       # the gateway's record is the one kept
        await nc.close()
    asyncio.run(body())


def test_an_item_reaching_the_worker_past_its_deadline_is_answered_timeout_recorded_and_acked_unrun(
        nats_url, engine, monkeypatch):
    monkeypatch.setattr(subjects, "REQUEST_DEADLINE", 0.5)

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        q = await stream(nc, "late")
        steps = engine.num_steps
        item = WorkItem(TokenizedRequest("late", "t", PARAMS, [5, 6], created=time.time() - 1), "w0", time.time())
        await js.publish(subjects.work("w0", "late"), encode(item), headers=subjects.msg_id("late", item.msg_id))
        async with worker(nats_url, engine):
            (err,) = await until_end(q)
            await asyncio.sleep(0.5)                                   # the end is stored, the item acked
        assert err.code == "timeout" and "REQUEST_DEADLINE=0.5 s" in err.message
        assert engine.num_steps == steps
        outcome = await outcome_of(js, "late")
        assert (outcome.finish_reason, outcome.error_code) == ("error", "timeout")
        assert (await js.stream_info(subjects.WORK_STREAM)).state.messages == 0
        assert await dead_letters(js) == []                            # a timeout is no dead letter
        await nc.close()
    asyncio.run(main())


def test_a_dead_lettered_request_that_had_ended_keeps_its_first_end_record(nats_url, engine):
    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        first = Completion("struck", "t", "w9", PARAMS, [5, 6], [], "error", error_code="timeout",
                           error_message="late")
        await bus.store_end(js, "t", "struck", None, encode(first), configure("test"))
        item = WorkItem(TokenizedRequest("struck", "t", PARAMS, [5, 6]), "w0", time.time())
        q = await stream(nc, "struck")
        async with worker(nats_url, engine) as service:
            while not await bus.live_workers(await bus.registry(js)):       # the worker is up
                await asyncio.sleep(0.05)
            msg = _Acked()
            await service.records.dead_letter(item, msg, "dead_lettered", "twice", subjects.MAX_STRIKES)
            (err,) = await until_end(q)
            await asyncio.sleep(0.5)
        assert err.code == "dead_lettered" and msg.acked
        assert await outcome_of(js, "struck") == first
        assert [d.request.id for d in await dead_letters(js)] == ["struck"]
        await nc.close()
    asyncio.run(main())


class _Acked:
    acked = False

    async def ack(self):
        self.acked = True


class _Spy:
    """Stands in for the tb_suspects bucket: records the puts and deletes, then makes them."""

    def __init__(self, kv):
        self.kv, self.calls = kv, []

    async def put(self, key, value):
        self.calls.append(("put", key, value.decode()))
        return await self.kv.put(key, value)

    async def delete(self, key):
        self.calls.append(("delete", key))
        return await self.kv.delete(key)


def test_a_request_run_alone_is_named_in_tb_suspects_until_its_first_token_and_the_next_life_reads_it_once(
        nats_url, engine):
    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        q = await stream(nc, "suspect")
        async with worker(nats_url, engine) as service:
            while service.registry.suspects is None:                         # the worker is up
                await asyncio.sleep(0.05)
            service.registry.suspects = spy = _Spy(service.registry.suspects)
            await submit(js, "suspect", [5, 6], attempt=1, strikes=1)
            assert (await until_end(q))[-1].finish_reason == "length"
        assert spy.calls == [("put", "w0", "suspect"), ("delete", "w0")]
        kv = await bus.suspects(js)
        await kv.put("w0", b"suspect")                  # a life that died running it alone
        assert [await service_module.last_suspect(nc, "w0") for _ in range(2)] == ["suspect", ""]
        await nc.close()
    asyncio.run(main())

"""Prefix-aware routing on the real stack with 3 workers: every turn of a conversation goes to the
worker holding its history and hits it as the router predicted; a worker that leaves drops out of
the router's index."""
import asyncio
import itertools
import random
import time

import pytest

import bus
from schemas import subjects
from schemas.messages import RouterStats, decode
from tests.e2e.conftest import completions, connect, receive, send, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(180)]

TURNS = 3


async def stats(nats_url: str, wait: float = 3.0) -> RouterStats:
    """The router's next stats record."""
    nc = await bus.connect(nats_url, "test-router-stats")
    sub = await nc.subscribe(subjects.ROUTER_STATS_ALL)
    record = decode((await sub.next_msg(timeout=wait)).data, RouterStats)
    await nc.close()
    return record


async def chat(stack, conversations: list[list[list[int]]]) -> None:
    """Each conversation's turns in order (a turn's prompt is the whole history); the conversations run
    side by side once their first turns, taken one after another, are done."""
    async with connect(stack) as ws:
        frames: dict[str, asyncio.Queue] = {}

        async def read():
            while True:
                frame = await receive(ws, 60)
                frames[frame["id"]].put_nowait(frame)

        first_done = [asyncio.Event() for _ in conversations]

        async def one(c: int, turns: list[list[int]]):
            if c:                                  # first turns one after another: each is routed knowing
                await first_done[c - 1].wait()     # where the one before went
            history = []
            for t, user in enumerate(turns):
                history += user
                rid = f"c{c}t{t}"
                frames[rid] = asyncio.Queue()
                await send(ws, {"type": "generate", "id": rid, "prompt_token_ids": history, "max_tokens": 16,
                                "temperature": 0, "ignore_eos": True})
                while (frame := await frames[rid].get())["type"] == "delta":
                    history += frame["token_ids"]
                assert frame["type"] == "done", frame
                first_done[c].set()

        reader = asyncio.create_task(read())
        await asyncio.gather(*(one(c, turns) for c, turns in enumerate(conversations)))
        reader.cancel()


def test_conversations_stick_to_the_worker_holding_their_history_and_a_leaving_worker_drops_from_the_index(
        tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")    # three workers on two cores: spinning OpenMP threads would stall them
    rng = random.Random(0)
    conversations = [[[rng.randrange(16, 4000) for _ in range(192)]]
                     + [[rng.randrange(16, 4000) for _ in range(16)] for _ in range(TURNS - 1)] for _ in range(3)]
    stack = start_stack(tiny_model, tmp_path, workers=3)
    try:
        asyncio.run(chat(stack, conversations))
        records = asyncio.run(completions(stack.nats_url))
        assert len(records) == 3 * TURNS
        for turns in conversations:
            mine = sorted((r for r in records if r.prompt_token_ids[:192] == turns[0]),
                          key=lambda r: len(r.prompt_token_ids))
            assert len(mine) == TURNS and len({r.worker for r in mine}) == 1, [r.worker for r in mine]
            for before, after in itertools.pairwise(mine):         # the whole history before was a hit
                assert after.usage["cached_tokens"] == (len(before.prompt_token_ids) + 15) // 16 * 16
        assert len({r.worker for r in records}) == 3                  # one conversation each: the load is even
        s = asyncio.run(stats(stack.nats_url))
        assert s.completed == s.routed == 3 * TURNS and s.exact == s.completed     # predicted == actual, each
        assert s.predicted_hit_tokens == s.actual_hit_tokens > 0
        assert set(s.index_blocks) == {"w0", "w1", "w2"} and sum(s.index_blocks.values()) > 0

        stack.kill("w2")
        killed = time.monotonic()
        while "w2" in asyncio.run(stats(stack.nats_url)).index_blocks:
            assert time.monotonic() - killed < subjects.WORKER_TTL + 3, "w2 is still in the router's index"
        assert set(asyncio.run(stats(stack.nats_url)).index_blocks) == {"w0", "w1"}
    finally:
        stack.stop()

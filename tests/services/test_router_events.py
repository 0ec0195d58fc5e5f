"""The router service on a real nats-server with fake workers (no model): its index follows their KV
events and snapshots exactly, and two replicas on one durable consumer both route by it."""
import asyncio
import contextlib
import random

import nats

from schemas import subjects
from schemas.messages import Completion, TokenizedRequest, decode, encode
from schemas.sampling import SamplingParams
from services.router.policy import Options
from services.router.service import RouterService
from tests.services.fake_worker import BS, FakeWorker


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def until(check, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def router(nats_url: str, name: str, **options):
    service = RouterService(await nats.connect(nats_url), Options(**options), name)
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await service.nc.close()


def follows(r: RouterService, w: FakeWorker) -> bool:
    """The router's index of w is exactly what w's cache holds, at w's last event."""
    held = r.index.workers.get(w.id)
    return held is not None and held.seq == w.service.registry.kv_seq and set(held.hashes) == set(w.kv.cached)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def test_the_index_follows_stores_evictions_gaps_snapshots_restarts_joins_and_leaves(nats_url):
    async def main():
        rng = random.Random(1)
        nc = await nats.connect(nats_url)
        w0 = FakeWorker(nc, "w0", num_blocks=16)
        await w0.start()
        for i in range(3):                         # cached before any router runs
            w0.compute(f"a{i}", tokens(rng, 3 * BS))
            await w0.publish()
        async with router(nats_url, "r0") as r:
            await until(lambda: follows(r, w0))    # a new worker: one snapshot
            assert r.stats.snapshots == 1 and len(r.index.workers["w0"].hashes) == 9
            first = set(r.index.workers["w0"].hashes)

            for i in range(4):                     # 4 more prompts of 4 blocks in a pool of 16: evictions
                w0.compute(f"b{i}", tokens(rng, 4 * BS + 1))
                await w0.publish()
                await until(lambda: follows(r, w0))
            assert r.stats.snapshots == 1 and r.stats.gaps == 0
            assert first - set(r.index.workers["w0"].hashes)     # evictions left the index

            w0.compute("lost", tokens(rng, 2 * BS))
            await w0.publish(lose=True)            # a lost event: the index is behind until the next one
            w0.compute("next", tokens(rng, 2 * BS))
            await w0.publish()
            await until(lambda: follows(r, w0))
            assert r.stats.gaps == 1 and r.stats.snapshots == 2

            w1 = FakeWorker(nc, "w1")
            w1.compute("c", tokens(rng, 5 * BS))   # already holds something when it joins
            await w1.start()
            await until(lambda: follows(r, w1))
            assert r.stats.snapshots == 3

            await w1.stop()                        # deregisters: dropped from the index
            await until(lambda: "w1" not in r.index.workers)

        async with router(nats_url, "r1") as again:  # a restarted router starts empty and asks
            await until(lambda: follows(again, w0))
            assert again.stats.snapshots == 1 and "w1" not in again.index.workers
        await w0.stop()
        await nc.close()

    run(main())


def test_a_snapshot_of_more_hashes_than_one_message_holds_comes_in_parts(nats_url, monkeypatch):
    monkeypatch.setattr(subjects, "KV_SNAPSHOT_PART", 5)

    async def main():
        nc = await nats.connect(nats_url)
        w0 = FakeWorker(nc, "w0", num_blocks=64)
        w0.compute("a", list(range(100, 100 + 23 * BS)))
        await w0.start()
        async with router(nats_url, "r0") as r:
            await until(lambda: follows(r, w0))
            assert len(r.index.workers["w0"].hashes) == 23
        await w0.stop()
        await nc.close()

    run(main())


def test_two_router_replicas_send_every_turn_of_a_conversation_to_the_worker_holding_its_history(nats_url):
    async def main():
        rng = random.Random(2)
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        system = tokens(rng, 6 * BS)
        workers = [FakeWorker(nc, f"w{i}", num_blocks=256) for i in range(3)]
        for w in workers:
            w.compute("system", system)           # every worker holds the system prompt: no first-turn races
            await w.start(serve=True)
        done: dict[str, Completion] = {}
        arrived = asyncio.Event()

        async def on_done(msg):
            c = decode(msg.data, Completion)
            done[c.id] = c
            arrived.set()

        await nc.subscribe(subjects.RESULTS_SUBJECTS, cb=on_done)

        # The first turns go one after another: a long prompt queued on a worker is prefill to come there,
        # which can outweigh another conversation's history (the cost counts it; test_router.py)
        first = [asyncio.Event() for _ in range(10)]
        first[0].set()

        async def conversation(c: int) -> list[Completion]:
            history, got = list(system), []
            await first[c].wait()
            for turn in range(5):
                history += tokens(rng, rng.randrange(16 * BS, 18 * BS) if turn == 0 else rng.randrange(BS, 4 * BS))
                rid = f"c{c}t{turn}"
                req = TokenizedRequest(rid, "t", SamplingParams(max_tokens=1, seed=0), list(history))
                await js.publish(subjects.route("t", rid), encode(req), headers=subjects.msg_id(rid))
                while rid not in done:
                    arrived.clear()
                    await arrived.wait()
                got.append(done[rid])
                first[c + 1].set()
            return got

        # each replica balances its own recent requests (load_cap); off here: this is about the shared index
        async with router(nats_url, "r0", load_cap=100) as r0, router(nats_url, "r1", load_cap=100) as r1:
            for r in (r0, r1):
                await until(lambda r=r: all(follows(r, w) for w in workers))
            convs = await asyncio.gather(*(conversation(c) for c in range(9)))
            await until(lambda: r0.stats.completed + r1.stats.completed == 45)
        for turns in convs:                    # every turn where the first went, and hit its whole history
            assert len({t.worker for t in turns}) == 1, ([t.worker for t in turns], r0.stats, r1.stats)
            assert all(t.usage["cached_tokens"] >= len(turns[i].prompt_token_ids) - BS
                       for i, t in enumerate(turns[1:]))
        assert r0.stats.routed > 0 and r1.stats.routed > 0                          # both replicas routed
        assert r0.stats.routed + r1.stats.routed == 45
        for r in (r0, r1):
            assert r.stats.exact == r.stats.completed                               # predicted == actual, each
            assert r.stats.predicted_hit_tokens == r.stats.actual_hit_tokens > 0
        for w in workers:
            await w.stop()
        await nc.close()

    run(main())

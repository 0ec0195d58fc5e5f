"""Disaggregated serving in-process on a real nats-server: the router, a prefill worker p0 and a decode
worker d0, each around an engine of the tiny model the test holds. Requests go in at TB_ROUTE (as the
tokenizer sends them) and come out on tb.out.<id>; every output is checked against the offline engine,
token for token, greedy and seeded, and the KV d0 pulled against p0's, byte for byte."""
import asyncio
import contextlib
import time

import nats
import pytest
import torch

import bus
from schemas import subjects
from schemas.messages import ErrorChunk, FinalChunk, TokenChunk, TokenizedRequest, decode, encode
from schemas.sampling import SamplingParams
from services.router.policy import Options
from services.router.service import RouterService
from workers import kv_transfer
from workers.engine.engine import EngineConfig, LLMEngine
from workers.service import WorkerService

BS = 16
MAX_LOCAL = 40                 # uncached prompt tokens d0 prefills itself
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


def prompt(n: int, start: int = 7) -> list[int]:
    return [(start + 31 * i) % 4000 + 10 for i in range(n)]


@pytest.fixture(scope="module")
def expected(tiny_model):
    """The offline engine's output tokens of (prompt, params)."""
    engine = LLMEngine(tiny_model, EngineConfig(block_size=BS, num_kv_blocks=256))
    memo = {}

    def run(tokens: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(tokens), params.seed, params.temperature)
        if key not in memo:
            req = engine.add_request(f"ref{len(memo)}", tokens, params)
            while engine.has_unfinished():
                engine.step()
            memo[key] = req.output_token_ids
        return memo[key]
    return run


class Cluster:
    """The router, p0 and d0 on one bus; generate() sends a tokenized request and gathers its stream."""

    def __init__(self, nats_url: str, tiny_model: str, policy: str = "recompute",
                 roles: tuple[str, str] = ("prefill", "decode"), names: tuple[str, str] = ("p0", "d0")):
        self.url, self.model, self.policy, self.roles, self.names = nats_url, tiny_model, policy, roles, names
        self.engines = {w: LLMEngine(tiny_model, EngineConfig(block_size=BS, num_kv_blocks=128)) for w in names}

    async def __aenter__(self):
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await bus.ensure_streams(self.js)
        self.conns, self.tasks, self.workers = [], [], {}
        for name, role in zip(self.names, self.roles):
            nc = await nats.connect(self.url)
            from bus.log import configure
            service = WorkerService(nc, self.engines[name], name, "tiny", configure("worker").bind(worker=name),
                                    role=role, kv_load_failure_policy=self.policy)
            self.conns.append(nc)
            self.workers[name] = service
            self.tasks.append(asyncio.create_task(service.run()))
        rnc = await nats.connect(self.url)
        self.conns.append(rnc)
        self.router = RouterService(rnc, Options(max_local_prefill=MAX_LOCAL), "r0")
        self.tasks.append(asyncio.create_task(self.router.run()))
        async with asyncio.timeout(20):             # the router sees both workers
            while len(self.router.registry.live(time.time())) < 2:
                await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc):
        self.tasks[2].cancel()                   # the router first: workers leaving would have their work moved
        with contextlib.suppress(BaseException):
            await asyncio.wait(self.tasks[2:], timeout=5)
        for service in self.workers.values():
            service.stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait(self.tasks[:2], timeout=5)
        for nc in [*self.conns, self.nc]:
            with contextlib.suppress(Exception):
                await nc.close()

    async def generate(self, rid: str, tokens: list[int], params: SamplingParams, salt: str | None = None,
                       tenant: str = "t") -> tuple[list[int], FinalChunk | ErrorChunk, list]:
        q = asyncio.Queue()
        sub = await self.nc.subscribe(subjects.out(rid), cb=q.put)
        req = TokenizedRequest(rid, tenant, params, tokens, salt, time.time())
        await self.js.publish(subjects.route(tenant, rid), encode(req), headers=subjects.msg_id(rid))
        out, chunks = {}, []
        async with asyncio.timeout(60):
            while True:
                chunk = decode((await q.get()).data, TokenChunk, FinalChunk, ErrorChunk)
                chunks.append(chunk)
                if type(chunk) is ErrorChunk:
                    break
                for i, t in enumerate(chunk.token_ids):
                    out[chunk.offset + i] = t
                if type(chunk) is FinalChunk:
                    break
        await sub.unsubscribe()
        return [out[i] for i in range(len(out))], chunk, chunks

    def stats(self, name: str):
        return self.workers[name].transport.snapshot()


def same_kv(p: LLMEngine, d: LLMEngine, hashes: list[int]) -> bool:
    """The KV under each hash is the same bytes in both pools (every layer, K and V)."""
    for h in hashes:
        a = p.runner.kv_pool[:, :, p.kv.cached[h].block_id]
        b = d.runner.kv_pool[:, :, d.kv.cached[h].block_id]
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return False
    return True


def hashes_of(engine: LLMEngine, tokens: list[int], salt: str | None = None) -> list[int]:
    from schemas.hashing import hash_blocks
    return hash_blocks(tokens, engine.config.block_size, salt)[:len(tokens) // BS]


def test_one_prefill_and_one_decode_worker_give_the_colocated_and_the_offline_engine_s_tokens(
        nats_url, tiny_model, expected):
    long_a, long_b, short = prompt(150), prompt(97, 3), prompt(30, 11)
    requests = [("long-g", long_a, GREEDY), ("long-s", long_b, SEEDED), ("short-g", short, GREEDY),
                ("short-s", short, SEEDED)]

    async def main(roles, names):
        async with Cluster(nats_url, tiny_model, roles=roles, names=names) as c:
            got = {rid: await c.generate(f"{roles[0]}-{rid}", tokens, params) for rid, tokens, params in requests}
            return got, c.stats(names[0]), c.stats(names[1]), c.router.stats, c.engines

    colocated = asyncio.run(main(("both", "both"), ("w0", "w1")))[0]
    got, p, d, router, engines = asyncio.run(main(("prefill", "decode"), ("p0", "d0")))
    assert {rid: g[0] for rid, g in got.items()} == {rid: g[0] for rid, g in colocated.items()}
    for rid, tokens, params in requests:
        tokens_out, final, chunks = got[rid]
        assert tokens_out == expected(tokens, params), rid
        assert final.finish_reason == "length" and final.usage["prompt_tokens"] == len(tokens)
        remote = rid.startswith("long")
        assert final.worker == "d0"
        assert chunks[0].seq == 0 and chunks[0].prompt_tail == tokens[-len(chunks[0].prompt_tail):]
        if remote:                              # the first token came from p0, with its logprobs when asked
            assert len(chunks[0].token_ids) == 1 and (params.logprobs is None) == (chunks[0].logprobs is None)
            assert final.timing["ttft_ms"] > 0 and final.usage["cached_tokens"] == 0
    assert p.handoffs == 2 and d.transfers == 2 and d.failures == 0
    assert d.pulled_blocks == 150 // BS + 97 // BS and d.cached_blocks == 0
    assert d.pulled_bytes == d.pulled_blocks * engines["d0"].runner.block_bytes()
    assert p.served_blocks == d.pulled_blocks and p.served_bytes == d.pulled_bytes and p.leases == 0
    assert router.prefill == {"remote:long": 2, "local:short": 2} and router.handoffs == 2
    assert same_kv(engines["p0"], engines["d0"], hashes_of(engines["p0"], long_a) + hashes_of(engines["p0"], long_b))


def test_only_the_blocks_the_decode_worker_lacks_travel_and_tenants_salts_hold_across_the_transfer(
        nats_url, tiny_model, expected):
    head = prompt(38, 5)                        # prefilled on d0 itself: its 2 full blocks are cached there
    long = head + prompt(90, 9)                 # 128 tokens, 8 blocks: 6 cross

    async def main():
        async with Cluster(nats_url, tiny_model) as c:
            out = [await c.generate("head", head, GREEDY)]
            d0 = c.stats("d0")
            before = (d0.pulled_blocks, d0.cached_blocks)
            out.append(await c.generate("long", long, GREEDY))
            d1 = c.stats("d0")
            after_long = (d1.pulled_blocks - before[0], d1.cached_blocks - before[1])
            out.append(await c.generate("salted", long, GREEDY, salt="tenant-b", tenant="b"))
            d2 = c.stats("d0")
            after_salted = (d2.pulled_blocks - d1.pulled_blocks, d2.cached_blocks - d1.cached_blocks)
            return out, after_long, after_salted, c.engines

    out, after_long, after_salted, engines = asyncio.run(main())
    assert out[0][0] == expected(head, GREEDY) and out[1][0] == expected(long, GREEDY)
    assert out[2][0] == expected(long, GREEDY)  # the salt changes which blocks are shared, never the tokens
    assert after_long == (6, 2)                 # only the 6 blocks d0 lacked came over the bus
    assert after_salted == (8, 0)               # another tenant's blocks: nothing of tenant t's is reused
    d = engines["d0"]
    plain, salted = hashes_of(d, long), hashes_of(d, long, "tenant-b")
    assert not set(plain) & set(salted) and all(h in d.kv.cached for h in plain + salted)
    assert same_kv(engines["p0"], d, plain + salted)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_transfer_that_times_out_is_recomputed_or_fails_the_request_naming_the_transfer(
        nats_url, tiny_model, expected, policy, monkeypatch):
    long = prompt(120, 17)
    monkeypatch.setattr(subjects, "KV_FETCH_TIMEOUT", 0.3)

    async def silent(self, msg):                # p0 takes fetches and never answers
        return None
    monkeypatch.setattr(kv_transfer.NatsKvTransport, "on_fetch", silent)

    async def main():
        async with Cluster(nats_url, tiny_model, policy) as c:
            got = await c.generate("slow", long, SEEDED)
            return got, c.stats("d0"), c.engines["d0"].kv

    (tokens, final, _), d, kv = asyncio.run(main())
    assert d.transfers == 1 and d.failures == 1 and d.pulled_blocks == 0
    assert not kv.pins                          # nothing stays pinned for the request
    if policy == "recompute":
        assert d.recomputes == 1 and final.finish_reason == "length"
        assert tokens == expected(long, SEEDED)
    else:
        assert d.recomputes == 0 and type(final) is ErrorChunk and final.code == "kv_transfer_failed"
        assert "p0" in final.message and "--kv-load-failure-policy fail" in final.message


def test_the_transfer_plan_keeps_every_message_under_the_payload_and_splits_a_large_block_by_layers():
    hashes = list(range(10))
    pieces = kv_transfer.plan(hashes, 30, 1000, 95_000)        # a block: 30 kB; 3 fit
    assert [p.hashes for p in pieces] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert all(p.layers == range(30) for p in pieces)
    pieces = kv_transfer.plan([1, 2], 80, 5000, 120_000)       # a block: 400 kB; 24 layers a message
    assert [(p.hashes, p.layers.start, p.layers.stop) for p in pieces] == [
        ([1], 0, 24), ([1], 24, 48), ([1], 48, 72), ([1], 72, 80),
        ([2], 0, 24), ([2], 24, 48), ([2], 48, 72), ([2], 72, 80)]
    assert all(len(p.hashes) * len(p.layers) * 5000 <= 120_000 for p in pieces)

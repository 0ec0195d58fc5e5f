"""The router and a prefix cache in tiers: the index keeps the tier each worker's events name, and the
prefix cost prefers a worker that holds a prefix higher up (pool over host memory over disk over none);
fed by an engine with tiers, its predictions are the engine's hits, lower tiers included."""
import random

from schemas.hashing import hash_blocks
from schemas.messages import Heartbeat, KvEvent
from schemas.sampling import SamplingParams
from services.router.index import KvIndex
from services.router.policy import Options, Registry
from workers.engine.engine import EngineConfig, LLMEngine

BS = 16
NOW = 100.0
PROMPT = list(range(1000, 1000 + 8 * BS)) + [7] * BS


def synced(reg_or_index, *workers: str) -> KvIndex:
    index = reg_or_index if isinstance(reg_or_index, KvIndex) else reg_or_index.index
    for w in workers:
        index.add(w)
        index.expect_snapshot(w)
        assert not index.load_snapshot(w, 0, [])
    return index


def test_the_index_keeps_each_hash_at_the_tier_its_last_event_or_snapshot_names():
    index = synced(KvIndex(), "w0")
    assert not index.apply(KvEvent("w0", 1, [1, 2, 3], []))                  # a worker without tiers: the pool
    assert not index.apply(KvEvent("w0", 2, [2, 3], [], [1, 2]))              # 2 to host memory, 3 to disk
    assert index.tiers("w0", [1, 2, 3, 4]) == [0, 1, 2] and index.overlap("w0", [1, 2, 3]) == 3
    assert not index.apply(KvEvent("w0", 3, [3], [2], [0]))                   # 3 copied back up, 2 gone
    assert index.tiers("w0", [1, 3]) == [0, 0] and index.tiers("w0", [2, 1]) == []
    index.expect_snapshot("w0")
    assert not index.load_snapshot("w0", 3, [5, 6], [0, 2])
    assert index.tiers("w0", [5, 6]) == [0, 2]


def registry() -> Registry:
    reg = Registry(Options())
    for w in ("w0", "w1"):
        reg.update(Heartbeat(w, NOW, "tiny", BS, 8, 0, 0, 100, 100, 0, 0, 0))
    synced(reg, "w0", "w1")
    return reg


def store(reg: Registry, worker: str, tier: int | None) -> None:
    if tier is not None:
        hashes = hash_blocks(PROMPT, BS)
        assert not reg.index.apply(KvEvent(worker, 1, hashes, [], [tier] * len(hashes)))


def test_the_prefix_cost_prefers_the_worker_holding_the_prefix_higher_up():
    for upper, lower in ((0, 1), (1, 2), (2, None), (0, None)):
        for first, second in ((upper, lower), (lower, upper)):       # either name, either order
            reg = registry()
            store(reg, "w0", first)
            store(reg, "w1", second)
            choice = reg.pick(NOW, PROMPT)
            assert choice.worker == ("w0" if first == upper else "w1"), (upper, lower)
            assert choice.hit_tokens == len(PROMPT) - BS


def test_router_predicted_hits_equal_the_engine_hits_with_tiers(tiny_model, tmp_path):
    """A pool too small for the conversations: their history spills to host memory and disk, comes back,
    and the router, fed the engine's events, predicts each turn's hit exactly."""
    engine = LLMEngine(tiny_model, EngineConfig(block_size=BS, num_kv_blocks=24, max_num_seqs=4,
                                                kv_host_memory=6 * 2 ** 20, kv_disk_dir=str(tmp_path),
                                                kv_disk_size=1 << 30))
    engine.kv.record_changes()
    reg = Registry()
    reg.update(Heartbeat("w0", NOW, "tiny", BS, 4, 0, 0, 24, 24, 0, 0, 0))
    index, seq = synced(reg, "w0"), 0
    rng = random.Random(0)
    histories = {c: [rng.randrange(10, 4000) for _ in range(40)] for c in range(6)}
    predicted, actual = [], []
    for turn in range(3):
        for c, history in histories.items():
            history += [rng.randrange(10, 4000) for _ in range(rng.randrange(5, 40))]
            predicted.append(reg.pick(NOW, history).hit_tokens)
            req = engine.add_request(f"c{c}t{turn}", history, SamplingParams(max_tokens=4, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
                stored, tiers, removed = engine.kv.take_events()
                seq += 1
                assert not index.apply(KvEvent("w0", seq, stored, removed, tiers))
            actual.append(req.num_cached_tokens)
            history += req.output_token_ids
            hashes, tiers = engine.kv.held()
            assert dict(index.workers["w0"].hashes) == dict(zip(hashes, tiers))
    assert predicted == actual
    stats = engine.stats()
    assert stats["kv_host_hits"] + stats["kv_disk_hits"] > 0 and set(dict(index.workers["w0"].hashes).values()) > {0}

"""The router's prefix index: events in order, gaps, snapshots, the cap; and its predictions equal
the engine's own prefix hits, evictions included."""
import random

from schemas.messages import Heartbeat, KvEvent
from schemas.sampling import SamplingParams
from services.router.index import KvIndex
from services.router.policy import Registry
from workers.engine.engine import EngineConfig, LLMEngine


def synced(*workers: str, cap: int = 100) -> KvIndex:
    index = KvIndex(cap)
    for w in workers:
        index.add(w)
        index.expect_snapshot(w)
        assert not index.load_snapshot(w, 0, [])
    return index


def held(index: KvIndex, worker: str) -> list[int]:
    return list(index.workers[worker].hashes)


def test_events_in_order_follow_stores_and_removals():
    index = synced("w0")
    assert not index.apply(KvEvent("w0", 1, [1, 2, 3], []))
    assert not index.apply(KvEvent("w0", 2, [4], [2]))
    assert held(index, "w0") == [1, 3, 4] and index.workers["w0"].seq == 2
    assert index.overlap("w0", [1, 3, 4, 5]) == 3 and index.overlap("w0", [2, 1]) == 0


def test_a_new_worker_needs_a_snapshot_and_its_events_wait_for_it():
    index = KvIndex()
    index.add("w0")
    assert index.needs_snapshot("w0")
    assert index.apply(KvEvent("w0", 5, [1], []))           # cannot be placed: ask for a snapshot
    index.expect_snapshot("w0")
    assert not index.needs_snapshot("w0")
    for ev in (KvEvent("w0", 7, [9], [1]), KvEvent("w0", 6, [8], []), KvEvent("w0", 5, [1], [])):
        assert not index.apply(ev)                            # held, in any order
    assert not index.load_snapshot("w0", 5, [1, 2])           # 5 is in the snapshot; 6 and 7 apply on top
    assert held(index, "w0") == [2, 8, 9] and index.workers["w0"].seq == 7
    assert index.gaps == 0


def test_a_gap_asks_for_a_snapshot_and_the_snapshot_replaces_everything():
    index = synced("w0")
    index.apply(KvEvent("w0", 1, [1, 2], []))
    assert index.apply(KvEvent("w0", 3, [3], [1]))           # 2 was lost
    assert index.gaps == 1 and index.needs_snapshot("w0")
    index.expect_snapshot("w0")
    assert not index.load_snapshot("w0", 3, [2, 3, 4])
    assert held(index, "w0") == [2, 3, 4]
    assert not index.apply(KvEvent("w0", 4, [], [3]))
    assert held(index, "w0") == [2, 4]


def test_held_events_that_skip_a_number_ask_for_another_snapshot():
    index = synced("w0")
    index.expect_snapshot("w0")
    index.apply(KvEvent("w0", 9, [5], []))
    assert index.load_snapshot("w0", 7, [1])                  # 8 is missing
    assert index.needs_snapshot("w0")


def test_a_restarted_worker_counting_from_one_again_is_a_gap():
    index = synced("w0")
    for seq in (1, 2, 3):
        index.apply(KvEvent("w0", seq, [seq], []))
    assert index.apply(KvEvent("w0", 1, [7], []))


def test_a_failed_snapshot_leaves_the_worker_needing_one():
    index = synced("w0")
    index.expect_snapshot("w0")
    index.snapshot_failed("w0")
    assert index.needs_snapshot("w0")


def test_events_of_workers_not_in_the_registry_are_ignored_and_a_dropped_worker_is_forgotten():
    index = synced("w0")
    assert not index.apply(KvEvent("ghost", 1, [1], []))
    assert "ghost" not in index.workers
    index.apply(KvEvent("w0", 1, [1], []))
    index.drop("w0")
    assert index.sizes() == {} and index.overlap("w0", [1]) == 0


def test_the_index_is_capped_per_worker_forgetting_the_oldest_store():
    index = synced("w0", cap=3)
    index.apply(KvEvent("w0", 1, [1, 2, 3], []))
    index.apply(KvEvent("w0", 2, [1], []))                    # stored again: the newest now
    index.apply(KvEvent("w0", 3, [4], []))
    assert held(index, "w0") == [3, 1, 4]
    index.expect_snapshot("w0")
    index.load_snapshot("w0", 3, [10, 11, 12, 13, 14])
    assert held(index, "w0") == [12, 13, 14]


# -- the router predicts exactly the engine's hits -----------------------------------------------

def test_router_predicted_hits_equal_the_engine_hits_through_evictions_and_salts(tiny_model):
    """One engine with a small pool (evictions happen), its KV changes fed to the router's index after
    every step; before each request the router predicts its hit, and the engine then reports it."""
    bs = 16
    engine = LLMEngine(tiny_model, EngineConfig(block_size=bs, num_kv_blocks=32, max_num_seqs=4))
    engine.kv.record_changes()
    reg = Registry()
    reg.update(Heartbeat("w0", 100.0, "tiny", bs, 4, 0, 0, 32, 32, 0, 0, 0))
    index, seq = reg.index, 0
    index.expect_snapshot("w0")
    index.load_snapshot("w0", 0, [])
    rng = random.Random(0)
    system = [rng.randrange(10, 4000) for _ in range(40)]
    histories = {c: list(system) for c in range(6)}
    salts = {c: "tenant-b" if c == 5 else None for c in histories}
    predicted, actual = [], []
    for turn in range(4):
        for c, history in histories.items():
            history += [rng.randrange(10, 4000) for _ in range(rng.randrange(5, 40))]
            predicted.append(reg.pick(100.0, history, salts[c]).hit_tokens)
            req = engine.add_request(f"c{c}t{turn}", history, SamplingParams(max_tokens=4, ignore_eos=True),
                                     salts[c])
            while engine.has_unfinished():
                engine.step()
                stored, removed = engine.kv.take_changes()
                seq += 1
                assert not index.apply(KvEvent("w0", seq, stored, removed))
            actual.append(req.num_cached_tokens)
            history += req.output_token_ids
            assert set(index.workers["w0"].hashes) == set(engine.kv.cached)
    assert predicted == actual
    shrunk = [i for i in range(6, len(actual)) if actual[i] < actual[i - 6]]   # only evictions shrink a hit
    assert len(shrunk) >= 3 and max(actual) >= 5 * bs

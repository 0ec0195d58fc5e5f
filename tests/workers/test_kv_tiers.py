"""The prefix cache's tiers below the pool: the KV manager's bookkeeping of saves and restores with
hand-built requests, then the engine on a tiny model: a prefix evicted from the pool comes back from
host memory or disk with the same bytes and the same tokens as a run that never evicted it; a
corrupted block file is detected and recomputed; the disk tier is bounded; a new engine on the same
directory finds its blocks, and another layout never does."""
import os
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.hashing import hash_blocks
from schemas.sampling import SamplingParams
from tests.workers.engine_helpers import BLOCK, check_invariants, make_request
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.kv_cache import KVCacheManager
from workers.engine.kv_tiers import DiskTier, HostTier


def compute(kv: KVCacheManager, req) -> None:
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * BLOCK, hits)
    req.num_computed_tokens = req.num_tokens


# -- the KV manager's bookkeeping ------------------------------------------------------------------

def test_an_evicted_cached_block_is_recorded_as_a_save_and_hit_below_as_a_restore():
    below = set()
    kv = KVCacheManager(3, BLOCK, lower=below)
    a = make_request("a", range(9))                     # blocks 0, 1 full (hashed), 2 partial
    compute(kv, a)
    kv.free_request(a)
    b = make_request("b", range(100, 112))              # takes the 3 free blocks: evicts a's two hashes
    compute(kv, b)
    saves, restores = kv.take_transfers()
    assert sorted(saves) == sorted([(a.block_hashes[0], 0), (a.block_hashes[1], 1)]) and restores == []
    below.update(h for h, _ in saves)                   # what the engine does with them
    kv.free_request(b)
    again = make_request("c", range(9))
    hits = kv.get_computed_blocks(again)
    assert [(blk.block_id, blk.hash) for blk in hits] == [(-1, a.block_hashes[0]), (-1, a.block_hashes[1])]
    assert kv.new_blocks(again.block_hashes, again.num_tokens) == 3      # a restore needs a pool block
    assert kv.allocate_slots(again, 1, hits)
    saves, restores = kv.take_transfers()
    ids = kv.block_ids("c")
    assert restores == [(a.block_hashes[0], ids[0]), (a.block_hashes[1], ids[1])]
    assert {h for h, _ in saves} == set(b.block_hashes) and kv.cached[a.block_hashes[1]].block_id == ids[1]
    check_invariants(kv)


def test_a_block_evicted_in_the_step_it_was_saved_is_still_a_hit_below():
    kv = KVCacheManager(2, BLOCK, lower=set())
    a = make_request("a", range(5))
    compute(kv, a)
    kv.free_request(a)
    compute(kv, make_request("b", range(100, 105)))     # evicts a's block: a save not yet copied
    assert [blk.hash for blk in kv.get_computed_blocks(make_request("c", range(5)))] == [a.block_hashes[0]]


def test_a_restore_evicted_before_its_step_is_dropped_and_not_saved():
    below = {7}
    kv = KVCacheManager(2, BLOCK, lower=below)
    block = kv.restore(7)
    kv.free.appendleft(block)                           # as a request preempted in the same schedule
    block.ref_cnt = 0
    kv.pop_free()
    assert kv.take_transfers() == ([], [])


def test_a_reservation_evicts_without_saving():
    kv = KVCacheManager(2, BLOCK, lower=set())
    a = make_request("a", range(5))
    compute(kv, a)
    kv.free_request(a)
    kv.reserve("pull", 2)                               # its KV is written off the step, at any time
    assert kv.take_transfers() == ([], [])


def test_the_host_tier_drops_its_least_recently_used_for_room():
    host = HostTier(100)
    assert host.put(1, "a", 40) == [] and host.put(2, "b", 40) == []
    host.get(1)
    assert host.put(3, "c", 40) == [(2, "b")] and host.used == 80
    assert host.put(4, "d", 200) == [(4, "d")]


def test_the_disk_tier_is_bounded_lru_and_survives_reopening(tmp_path):
    kv = torch.arange(256, dtype=torch.float32)
    disk = DiskTier(str(tmp_path), 1 << 30, "layout")
    disk.put(1, kv)
    size = disk.used
    disk = DiskTier(str(tmp_path), 2 * size, "layout")
    assert 1 in disk and torch.equal(disk.get(1), kv)
    disk.put(2, kv + 1)
    disk.get(1)
    disk.put(3, kv + 2)                                 # 2 is the least recently used
    assert sorted(disk.files) == [1, 3] and disk.used == 2 * size
    assert sorted(os.listdir(disk.dir)) == [os.path.basename(disk.path(h)) for h in (1, 3)]
    assert list(DiskTier(str(tmp_path), 2 * size, "layout").files) == [1, 3]
    assert len(DiskTier(str(tmp_path), 2 * size, "another")) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14)), min_size=1, max_size=30),
       st.integers(0, 6), st.integers(3, 8))
def test_every_named_pool_block_holds_its_hashs_kv_through_saves_and_restores(prompts, lower_cap, num_blocks):
    """A pool with a bounded tier below it, moved as the engine moves bytes (saves, then restores, then the
    forward): after every step each hash the pool names is in the block that names it. A restore the tier
    lost meanwhile is forgotten and its request goes back, as the engine does."""
    store = OrderedDict()                                 # the tier below: hash -> the KV (here: the hash)
    kv = KVCacheManager(num_blocks, BLOCK, lower=store)
    content = [None] * num_blocks                          # what each pool block holds
    for i, (family, length) in enumerate(prompts):
        req = make_request(f"r{i}", [family] * 4 + list(range(100 * family, 100 * family + length)))
        hits = kv.get_computed_blocks(req)
        if not kv.allocate_slots(req, req.num_tokens - len(hits) * BLOCK, hits):
            continue
        saves, restores = kv.take_transfers()
        for h, b in saves:
            assert content[b] == h, "a save reads a block that no longer holds its hash"
            store[h] = h
            store.move_to_end(h)
            while len(store) > lower_cap:
                store.popitem(last=False)
        bad = [b for h, b in restores if h not in store]
        for h, b in restores:
            content[b] = store.get(h)
        if bad:                                           # the engine's requeue
            kv.forget(bad)
            req.num_computed_tokens = len(hits) * BLOCK
            kv.uncache_uncomputed(req)
            kv.free_request(req)
        else:
            new = kv.req_blocks[req.request_id][len(hits):]   # the forward writes the blocks past the hits
            for block, h in zip(new, req.block_hashes[len(hits):] + [None] * len(new)):
                content[block.block_id] = h
            req.num_computed_tokens = req.num_tokens
            kv.free_request(req)
        check_invariants(kv)
        assert all(content[b.block_id] == h for h, b in kv.cached.items())


# -- the engine --------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
A = list(range(100, 165))                               # 4 full blocks of 16 and one token
FILLERS = [list(range(200 + 70 * i, 265 + 70 * i)) for i in range(3)]


def engine(model_dir, **config) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(device="cpu", **config))


def run(eng: LLMEngine, prompt: list[int]) -> list[int]:
    req = eng.add_request(f"r{eng.num_steps}-{len(eng.requests)}", prompt, GREEDY)
    while eng.has_unfinished():
        eng.step()
    return req.output_token_ids


def kv_of(eng: LLMEngine, hashes: list[int]) -> list[torch.Tensor]:
    return [eng.runner.read_blocks([eng.kv.cached[h].block_id], range(eng.model_cfg.num_layers)) for h in hashes]


@pytest.fixture(scope="module")
def never_evicted(model_dir):
    eng = engine(model_dir, num_kv_blocks=64)
    tokens = run(eng, A)
    hashes = hash_blocks(A, 16)
    return tokens, hashes, kv_of(eng, hashes)


def evict_a(eng: LLMEngine) -> None:
    """Runs A, then enough other prompts through a pool of 6 blocks that none of A's stays in it."""
    run(eng, A)
    for p in FILLERS:
        run(eng, p)


def test_a_prefix_evicted_to_host_memory_comes_back_with_the_same_bytes_and_tokens(model_dir, never_evicted):
    tokens, hashes, kv = never_evicted
    eng = engine(model_dir, num_kv_blocks=6, kv_host_memory=1 << 20)
    evict_a(eng)
    assert not any(h in eng.kv.cached for h in hashes) and all(h in eng.tiers.host for h in hashes)
    hits_before = eng.stats()["prefix_cache_hits"]
    assert run(eng, A) == tokens
    stats = eng.stats()
    assert stats["kv_host_hits"] == 4 and stats["prefix_cache_hits"] - hits_before == 64
    assert all(torch.equal(x, y) for x, y in zip(kv_of(eng, hashes), kv))
    assert stats["kv_blocks_total"] == 6


def test_without_tiers_the_evicted_prefix_is_recomputed(model_dir, never_evicted):
    eng = engine(model_dir, num_kv_blocks=6)
    evict_a(eng)
    before = eng.stats()["prefix_cache_hits"]
    assert run(eng, A) == never_evicted[0] and eng.stats()["prefix_cache_hits"] == before
    assert "kv_host_hits" not in eng.stats()


def test_evict_to_host_then_disk_then_hit_brings_back_the_same_bytes_and_tokens(model_dir, never_evicted, tmp_path):
    tokens, hashes, kv = never_evicted
    eng = engine(model_dir, num_kv_blocks=6, kv_host_memory=2 * eng_block_bytes(model_dir),
                 kv_disk_dir=str(tmp_path), kv_disk_size=1 << 30)
    evict_a(eng)
    assert all(h in eng.tiers.disk and h not in eng.tiers.host for h in hashes)
    assert run(eng, A) == tokens
    stats = eng.stats()
    assert stats["kv_disk_hits"] == 4 and stats["kv_disk_corrupt"] == 0
    assert all(torch.equal(x, y) for x, y in zip(kv_of(eng, hashes), kv))


def eng_block_bytes(model_dir) -> int:
    return engine(model_dir, num_kv_blocks=1).runner.block_bytes()


def test_a_corrupted_disk_block_is_detected_and_recomputed(model_dir, never_evicted, tmp_path):
    tokens, hashes, kv = never_evicted
    eng = engine(model_dir, num_kv_blocks=6, kv_host_memory=0, kv_disk_dir=str(tmp_path), kv_disk_size=1 << 30)
    evict_a(eng)
    path = eng.tiers.disk.path(hashes[1])
    with open(path, "r+b") as f:               # one payload byte flipped
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte ^ 0xFF]))
    assert run(eng, A) == tokens
    stats = eng.stats()
    assert stats["kv_disk_corrupt"] == 1 and stats["kv_disk_hits"] >= 1 and not os.path.exists(path)
    assert all(torch.equal(x, y) for x, y in zip(kv_of(eng, hashes), kv))   # recomputed from block 1 on
    check_invariants(eng.kv)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_the_disk_tier_holds_at_most_its_size(model_dir, tmp_path):
    eng = engine(model_dir, num_kv_blocks=6, kv_disk_dir=str(tmp_path), kv_disk_size=3 * 9000,
                 dtype="float32")                              # the size holds three float32 blocks
    evict_a(eng)
    files = os.listdir(eng.tiers.disk.dir)
    assert 0 < len(files) <= 3 and sum(os.path.getsize(os.path.join(eng.tiers.disk.dir, f)) for f in files) <= 27000
    assert eng.stats()["kv_disk_bytes"] <= 27000


def test_a_new_engine_on_the_same_directory_finds_its_blocks(model_dir, never_evicted, tmp_path):
    tokens, hashes, kv = never_evicted
    first = engine(model_dir, num_kv_blocks=6, kv_disk_dir=str(tmp_path), kv_disk_size=1 << 30)
    evict_a(first)
    first.close()
    restarted = engine(model_dir, num_kv_blocks=6, kv_disk_dir=str(tmp_path), kv_disk_size=1 << 30)
    assert run(restarted, A) == tokens
    assert restarted.stats()["kv_disk_hits"] == 4
    assert all(torch.equal(x, y) for x, y in zip(kv_of(restarted, hashes), kv))
    other = engine(model_dir, num_kv_blocks=6, kv_disk_dir=str(tmp_path), kv_disk_size=1 << 30, block_size=8)
    assert len(other.tiers.disk) == 0 and other.tiers.disk.dir != restarted.tiers.disk.dir


def test_closing_an_engine_writes_its_pool_down_so_a_restart_finds_what_was_never_evicted(model_dir, never_evicted,
                                                                                          tmp_path):
    tokens, hashes, kv = never_evicted
    first = engine(model_dir, num_kv_blocks=64, kv_host_memory=1 << 20, kv_disk_dir=str(tmp_path),
                   kv_disk_size=1 << 30)
    run(first, A)
    assert len(first.tiers.disk) == 0                   # nothing evicted: nothing written yet
    first.close()
    restarted = engine(model_dir, num_kv_blocks=64, kv_disk_dir=str(tmp_path), kv_disk_size=1 << 30)
    assert run(restarted, A) == tokens and restarted.stats()["kv_disk_hits"] == 4
    assert all(torch.equal(x, y) for x, y in zip(kv_of(restarted, hashes), kv))


def test_the_offline_api_takes_the_tiers_and_keeps_its_stats_keys(tiny_model, tmp_path):
    from workers import LLM

    prompts = [list(range(100, 165)), *FILLERS, list(range(100, 165))]   # the last one: A again, after eviction
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(tiny_model, num_kv_blocks=6, max_num_seqs=1) as plain:
        before = plain.stats()
        want = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(tiny_model, num_kv_blocks=6, max_num_seqs=1, kv_host_memory=1 << 24, kv_disk_dir=str(tmp_path),
             kv_disk_size=1 << 30) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == want and outs[-1].num_cached_tokens == 64
    assert set(before) < set(stats) and stats["kv_blocks_total"] == 6
    assert stats["prefix_cache_hits"] == 64 == stats["kv_host_hits"] * 16
    assert {"kv_host_bytes", "kv_disk_hits", "kv_disk_bytes", "kv_disk_corrupt"} <= set(stats)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_quantized_pools_blocks_come_back_from_disk_with_their_scales(model_dir, tmp_path, kv_cache_dtype):
    ref = engine(model_dir, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    tokens, hashes = run(ref, A), hash_blocks(A, 16)
    eng = engine(model_dir, num_kv_blocks=6, kv_cache_dtype=kv_cache_dtype, kv_host_memory=0,
                 kv_disk_dir=str(tmp_path), kv_disk_size=1 << 30)
    evict_a(eng)
    assert run(eng, A) == tokens and eng.stats()["kv_disk_hits"] == 4
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(kv_of(eng, hashes), kv_of(ref, hashes)))

"""KV cache manager with hand-built requests: exact block ids, prefix hits, LRU eviction order,
tail-first freeing, salts."""
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.sampling import SamplingParams
from tests.workers.engine_helpers import BLOCK, check_invariants, make_request
from workers.engine.kv_cache import KVCacheManager
from workers.engine.request import Request


def compute(kv: KVCacheManager, req, hits=()):
    """Allocates and 'computes' every token of req, as one prefill step would."""
    n_hit = len(hits) * BLOCK
    assert kv.allocate_slots(req, req.num_tokens - n_hit, list(hits))
    req.num_computed_tokens = req.num_tokens


def test_allocation_takes_free_blocks_in_order():
    kv = KVCacheManager(8, BLOCK)
    a, b = make_request("a", range(10)), make_request("b", range(100, 105))
    compute(kv, a)
    compute(kv, b)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.block_ids("b") == [3, 4]
    assert kv.num_free_blocks == 3


def test_allocation_fails_without_changing_anything_when_blocks_run_out():
    kv = KVCacheManager(2, BLOCK)
    req = make_request("a", range(9))
    assert not kv.allocate_slots(req, 9)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_hit_reuses_full_blocks_but_never_the_last_prompt_token():
    kv = KVCacheManager(8, BLOCK)
    a = make_request("a", range(12))
    compute(kv, a)
    kv.free_request(a)
    same = make_request("b", range(12))   # 3 full blocks, but the last token must be recomputed
    assert [blk.block_id for blk in kv.get_computed_blocks(same)] == [0, 1]
    longer = make_request("c", list(range(12)) + [99])
    assert [blk.block_id for blk in kv.get_computed_blocks(longer)] == [0, 1, 2]
    other = make_request("d", [0, 1, 2, 3, 4, 5, 6, 0, 8])
    assert [blk.block_id for blk in kv.get_computed_blocks(other)] == [0]


def test_hit_on_a_free_block_takes_it_off_the_free_list_and_shares_it():
    kv = KVCacheManager(6, BLOCK)
    a = make_request("a", range(9))
    compute(kv, a)
    b = make_request("b", list(range(8)) + [50, 51])
    hits = kv.get_computed_blocks(b)
    compute(kv, b, hits)
    assert kv.block_ids("b")[:2] == [0, 1] and kv.block_ids("b")[2] == 3
    assert [blk.ref_cnt for blk in kv.blocks[:2]] == [2, 2]
    kv.free_request(a)
    kv.free_request(b)
    check_invariants(kv)
    c = make_request("c", list(range(8)) + [60])
    hits = kv.get_computed_blocks(c)
    before = kv.num_free_blocks
    compute(kv, c, hits)
    assert kv.num_free_blocks == before - 3   # 2 hits leave the free list, 1 new block
    check_invariants(kv)


def test_partial_and_uncomputed_blocks_are_not_cached():
    kv = KVCacheManager(8, BLOCK)
    a = make_request("a", range(10))
    assert kv.allocate_slots(a, 6)   # a prefill chunk: tokens 0..5 computed this step
    a.num_computed_tokens = 6
    assert len(kv.cached) == 1       # only block 0 is full of computed tokens
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 10
    assert len(kv.cached) == 2       # block 2 holds 2 tokens: never cached


def test_freed_blocks_are_evicted_tail_first_in_lru_order():
    kv = KVCacheManager(6, BLOCK)
    a = make_request("a", range(12))
    compute(kv, a)
    b = make_request("b", range(100, 108))
    compute(kv, b)
    kv.free_request(a)   # free list: 5 | 2 1 0
    kv.free_request(b)   # free list: 5 | 2 1 0 | 4 3
    assert [blk.block_id for blk in kv.free] == [5, 2, 1, 0, 4, 3]
    c = make_request("c", range(200, 208))   # needs 2 blocks: takes 5, then evicts a's tail, block 2
    compute(kv, c)
    assert kv.block_ids("c") == [5, 2]
    again = make_request("a2", list(range(12)) + [1])
    assert [blk.block_id for blk in kv.get_computed_blocks(again)] == [0, 1]   # a's head survived
    check_invariants(kv)


def test_salt_isolates_tenants_both_ways():
    kv = KVCacheManager(16, BLOCK)
    for salt in ("tenant-1", None):
        a = make_request(f"a-{salt}", range(9), salt=salt)
        compute(kv, a)
        kv.free_request(a)
    assert len(kv.get_computed_blocks(make_request("x", range(9), salt="tenant-1"))) == 2
    assert len(kv.get_computed_blocks(make_request("y", range(9), salt=None))) == 2
    assert kv.get_computed_blocks(make_request("z", range(9), salt="tenant-2")) == []
    hits_1 = kv.get_computed_blocks(make_request("x", range(9), salt="tenant-1"))
    hits_none = kv.get_computed_blocks(make_request("y", range(9), salt=None))
    assert {b.block_id for b in hits_1}.isdisjoint(b.block_id for b in hits_none)


def test_identical_blocks_computed_twice_are_cached_once():
    kv = KVCacheManager(8, BLOCK)
    a, b = make_request("a", range(8)), make_request("b", range(8))
    compute(kv, a)
    compute(kv, b)   # no hit asked for: b computes its own copy
    assert len(kv.cached) == 2
    kv.free_request(a)
    kv.free_request(b)
    check_invariants(kv)


def test_reset_prefix_cache_forgets_every_cached_block():
    kv = KVCacheManager(8, BLOCK)
    a = make_request("a", range(12))
    compute(kv, a)
    kv.free_request(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(13))) == [] and kv.cached == {}
    check_invariants(kv)


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=False)
    a = make_request("a", range(12))
    compute(kv, a)
    kv.free_request(a)
    assert kv.get_computed_blocks(make_request("b", range(13))) == [] and kv.cached == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("afx"), st.integers(0, 5), st.integers(1, 30)), max_size=60))
def test_random_allocate_free_sequences_never_leak_or_double_free(ops):
    kv = KVCacheManager(12, BLOCK)
    live = {}
    for i, (op, prefix, length) in enumerate(ops):
        if op == "a":   # a request sharing one of six prefixes, with hits where there are some
            req = make_request(f"r{i}", [prefix] * 6 + list(range(length)))
            hits = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - len(hits) * BLOCK, hits):
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        elif op == "f" and live:
            kv.free_request(live.pop(sorted(live)[prefix % len(live)]))
        elif op == "x" and live:   # grow a live request by some tokens
            req = live[sorted(live)[prefix % len(live)]]
            for t in range(length % 7):
                req.append(t)
            if kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens):
                req.num_computed_tokens = req.num_tokens
        check_invariants(kv)
    for req in live.values():
        kv.free_request(req)
    check_invariants(kv)
    assert kv.num_free_blocks == 12


def test_changes_are_recorded_only_when_asked_and_name_each_hash_by_its_last_change():
    kv = KVCacheManager(4, BLOCK)
    a = make_request("a", range(9))
    compute(kv, a)
    assert kv.changes is None
    kv.free_request(a)
    kv.record_changes()
    b = make_request("b", range(100, 113))                # needs 4 blocks: evicts a's 2 hashed blocks
    compute(kv, b)
    stored, evicted = kv.take_changes()
    assert sorted(stored) == sorted(b.block_hashes[:3]) and sorted(evicted) == sorted(a.block_hashes[:2])
    assert kv.take_changes() == ([], [])
    kv.free_request(b)
    c = make_request("c", range(9))                       # evicts b's blocks, stores a's hashes again
    compute(kv, c)
    kv.free_request(c)
    kv.reset_prefix_cache()
    stored, evicted = kv.take_changes()                   # stored then evicted in one take: evicted
    assert stored == [] and set(evicted) == set(c.block_hashes[:2]) | set(b.block_hashes[:3])


# -- pins (disaggregated serving) --------------------------------------------------------------------

def test_pinned_blocks_are_neither_evicted_nor_reused_until_unpinned():
    kv = KVCacheManager(4, 2)
    a = Request("a", [1, 2, 3, 4, 5], 5, SamplingParams(), 0, 2)
    assert kv.allocate_slots(a, 5)
    kv.free_request(a)                           # 3 blocks free again, the 2 full ones cached
    held = kv.pin("lease:a", a.block_hashes[:2] + [12345])
    assert held == a.block_hashes[:2] and kv.num_free_blocks == 2
    taken = kv.reserve("b", 5)                   # only the unpinned free blocks
    assert len(taken) == 2 and all(h in kv.cached for h in held)
    assert kv.register(taken[0], 777) and not kv.register(taken[1], 777) and kv.cached[777] is taken[0]
    kv.unpin("b")
    assert kv.num_free_blocks == 2 and next(iter(kv.free)) is taken[1]   # unnamed: reused first
    kv.unpin("lease:a")
    assert kv.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in kv.blocks)
    assert kv.pins == {}

"""The Triton kernels equal their PyTorch references (kernels.reference), run on CPU by Triton's
interpreter or natively on a CUDA device (tests/kernels/device.py):
random shuffled block tables, mixed query lengths, lengths off the block size, GQA,
several head dims, block ids past 32k, and the split-KV path."""
import random

import pytest
import torch

pytest.importorskip("triton")

import kernels.reference as ref
import kernels.triton as tri
from tests.kernels.device import DEVICE, on_device


def batch(q_lens, seq_lens, hq, hkv, d, block_size, num_blocks, seed=0, dtype=torch.float32, high_blocks=False):
    """Random q, a paged cache and shuffled block tables for sequences with these query and KV lengths."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in seq_lens]
    pool = list(range(num_blocks - sum(need), num_blocks)) if high_blocks else list(range(num_blocks))
    rng.shuffle(pool)
    width = max(need)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([pool.pop() for _ in range(n)])
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


def check(args, scale=0.125, atol=2e-5, rtol=1e-4, **plan):
    q, k, v, cu, lens, tables = args
    want = ref.unified_attention(q.float(), k.float(), v.float(), cu, lens, tables, scale)
    p = tri.plan_attention(cu, lens, tables, k.shape[1], q.shape[1], k.shape[2])
    for name, value in plan.items():
        setattr(p, name, value)
    got = on_device(tri.unified_attention, q, k, v, cu, lens, tables, scale, p.to(DEVICE))
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_mixed_batch_of_decodes_chunks_and_prefills_matches_the_reference_for_every_gqa_ratio(hq, hkv):
    # decode (1), a chunk on top of cached KV, a whole prefill, lengths off the block size
    check(batch([1, 5, 19, 1], [37, 21, 19, 8], hq, hkv, 32, block_size=8, num_blocks=40, seed=hq + hkv))


@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_head_dims_including_a_non_power_of_two(d):
    check(batch([3, 1, 17], [10, 30, 17], 2, 1, d, block_size=16, num_blocks=12, seed=d))


def test_block_size_smaller_and_larger_than_the_kv_step():
    check(batch([2, 40], [50, 40], 2, 2, 32, block_size=4, num_blocks=40, seed=3))
    check(batch([2, 40], [70, 40], 2, 2, 32, block_size=64, num_blocks=4, seed=4))


def test_block_ids_beyond_32k_use_64_bit_addresses():
    check(batch([1, 6], [9, 14], 2, 1, 32, block_size=2, num_blocks=40_000, seed=5, high_blocks=True))


def test_split_kv_decodes_match_the_reference():
    args = batch([1, 1, 1], [100, 37, 64], 4, 2, 32, block_size=8, num_blocks=40, seed=6)
    check(args, num_splits=3)
    check(args, num_splits=7)      # slices of 32 positions: the last ones empty for every sequence


def test_the_plan_splits_only_long_decodes_with_few_programs():
    cu, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([8192, 100], dtype=torch.int32)
    tables = torch.zeros(2, 512, dtype=torch.int32)
    # 2 sequences x 1 KV head: as many splits of at least SPLIT_MIN_SIZE positions as the context has
    assert tri.plan_attention(cu, lens, tables, 16, num_heads=8, num_kv_heads=1).num_splits == 8192 // 512
    # 2 x 64 KV heads: enough splits for SPLIT_TARGET programs
    assert tri.plan_attention(cu, lens, tables, 16, num_heads=64, num_kv_heads=64).num_splits == 2
    assert tri.plan_attention(cu, lens, tables, 16, num_heads=256, num_kv_heads=128).num_splits == 1
    assert tri.plan_attention(cu, torch.tensor([500, 100], dtype=torch.int32), tables, 16).num_splits == 1
    prefill = torch.tensor([0, 1, 9], dtype=torch.int32)
    assert tri.plan_attention(prefill, lens, tables, 16).num_splits == 1
    assert tri.plan_attention(cu, lens, tables, 16).to(torch.device("cpu")).num_splits == 16


@pytest.mark.parametrize("hq, hkv", [(9, 3), (7, 1), (16, 1), (32, 1)])
def test_query_heads_grouped_over_their_kv_head_in_one_tile_match_the_reference(hq, hkv):
    # groups of 3 and 7 fill 15 and 14 of a tile's 16 rows; 16 fill it with one token; 32 need 32 rows
    check(batch([1, 7, 20, 1], [33, 7, 45, 90], hq, hkv, 32, block_size=8, num_blocks=60, seed=hq))
    check(batch([1, 1], [70, 33], hq, hkv, 32, block_size=8, num_blocks=60, seed=hq + 1), num_splits=3)


def test_a_plan_cut_for_another_group_is_refused():
    q, k, v, cu, lens, tables = batch([1, 3], [9, 5], 4, 2, 32, block_size=8, num_blocks=8)
    plan = tri.plan_attention(cu, lens, tables, 8, num_heads=4, num_kv_heads=1)
    with pytest.raises(ValueError, match="4 query heads per KV head; this call has 2"):
        tri.unified_attention(q, k, v, cu, lens, tables, 0.125, plan)


def test_half_precision_inputs():
    check(batch([1, 9], [20, 9], 2, 1, 64, block_size=8, num_blocks=8, seed=7, dtype=torch.float16),
          atol=2e-3, rtol=2e-3)


def test_store_kv_writes_each_token_to_its_slot_and_skips_padding():
    g = torch.Generator().manual_seed(8)
    k_cache, v_cache = torch.randn(40_000, 2, 2, 32, generator=g), torch.randn(40_000, 2, 2, 32, generator=g)
    key, value = torch.randn(5, 2, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    slots = torch.tensor([3, -1, 79_999, 10, -1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, want_k, want_v, slots)
    caches = k_cache.to(DEVICE), v_cache.to(DEVICE)
    on_device(tri.store_kv, key, value, *caches, slots)
    assert torch.equal(caches[0].cpu(), want_k) and torch.equal(caches[1].cpu(), want_v)

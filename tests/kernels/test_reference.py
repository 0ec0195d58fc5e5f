"""kernels.reference against a naive dense attention written from the definition, on random
paged inputs: non-contiguous block tables, decodes and prefill chunks mixed in one batch, GQA."""
import math
import random

import pytest
import torch

from kernels.reference import plan_attention, store_kv, unified_attention


def naive_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """Query i of sequence b sits at position seq_lens[b] - q_len + i and attends to positions <= it."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for b in range(len(seq_lens)):
        start, end, length = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        for i, row in enumerate(range(start, end)):
            pos = length - (end - start) + i
            for h in range(q.shape[1]):
                keys = torch.stack([k_cache[block_tables[b, p // block_size], p % block_size, h // group]
                                    for p in range(pos + 1)])
                values = torch.stack([v_cache[block_tables[b, p // block_size], p % block_size, h // group]
                                      for p in range(pos + 1)])
                weights = torch.softmax(keys.double() @ q[row, h].double() * scale, dim=0)
                out[row, h] = (weights[:, None] * values.double()).sum(0).float()
    return out


def random_batch(seed: int, q_lens: list[int], kv_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 block_size: int = 4, num_blocks: int = 64):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    width = max(math.ceil(n / block_size) for n in kv_lens)
    ids = rng.sample(range(num_blocks), num_blocks)   # non-contiguous, shuffled blocks
    tables, used = [], 0
    for n in kv_lens:
        count = math.ceil(n / block_size)
        tables.append(ids[used:used + count] + [0] * (width - count))
        used += count
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, head_dim)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_unified_attention_equals_naive_dense_attention(heads, kv_heads, seed):
    # decodes (1), short chunks after cached tokens, a whole prefill, lengths off the block size
    q_lens, kv_lens = [1, 3, 1, 9, 1, 5, 1], [7, 10, 1, 9, 13, 21, 4]
    args = random_batch(seed, q_lens, kv_lens, heads, kv_heads, head_dim=16)
    got = unified_attention(*args, scale=0.25)
    torch.testing.assert_close(got, naive_attention(*args, scale=0.25), rtol=1e-4, atol=1e-4)


def test_many_decodes_of_different_lengths_span_several_groups():
    q_lens = [1] * 40
    kv_lens = [random.Random(i).randint(1, 30) for i in range(40)]
    args = random_batch(7, q_lens, kv_lens, 4, 2, 8, num_blocks=512)
    plan = plan_attention(*args[3:], block_size=4)
    assert len(plan.groups) > 1 and not plan.prefills
    torch.testing.assert_close(unified_attention(*args, scale=0.3, plan=plan), naive_attention(*args, scale=0.3),
                               rtol=1e-4, atol=1e-4)


def test_store_kv_writes_each_token_to_its_slot_and_skips_padding():
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv(key, value, k_cache, v_cache, torch.tensor([13, -1, 2]))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[0, 2], value[2])
    assert torch.count_nonzero(k_cache) == 2 * 2 * 8

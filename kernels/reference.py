"""PyTorch reference kernels: the contract (shapes, semantics) the Triton kernels must meet,
and the CPU backend of the engine.

Paged KV layout: `k_cache`, `v_cache` are [num_blocks, block_size, Hkv, D]. A batch of B
sequences is flattened: `q` is [T, Hq, D] with sequence b's queries in rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]; `seq_lens[b]` counts its KV including the new tokens, so its
query i sits at position seq_lens[b] - q_len_b + i and attends causally to every position up to
its own. `block_tables[b, j]` is the block holding positions j*block_size .. (j+1)*block_size-1.
"""
import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes token t's K/V [T, Hkv, D] to slot slot_mapping[t] (block * block_size + offset);
    slot -1 is a padding token and is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of each row's sequence: [B, length, Hkv, D] (whole blocks are
    copied, then trimmed: far faster than gathering slot by slot)."""
    batch, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.view(cache.shape[0], -1).index_select(0, block_tables[:, :num_blocks].reshape(-1))
    return blocks.view(batch, num_blocks * block_size, *cache.shape[2:])[:, :length]


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of every query over its sequence's paged KV: [T, Hq, D].

    Single-token queries (decodes) run as one padded batch; longer ones (prefill chunks) one
    sequence at a time, which keeps the CPU cost proportional to the real work."""
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(lens))]
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor([cu[b] for b in decodes], device=q.device)
        out[rows] = decode_attention(q[rows], k_cache, v_cache, seq_lens[decodes],
                                     block_tables[decodes], max(lens[b] for b in decodes), scale)
    for b, n in enumerate(q_lens):
        if n > 1:
            tables = block_tables[b:b + 1]
            k = gather_kv(k_cache, tables, lens[b])[0]
            v = gather_kv(v_cache, tables, lens[b])[0]
            out[cu[b]:cu[b + 1]] = prefill_attention(q[cu[b]:cu[b + 1]], k, v, scale)
    return out


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, max_len: int, scale: float):
    k = gather_kv(k_cache, block_tables, max_len).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, max_len).transpose(1, 2)
    mask = torch.arange(max_len, device=q.device) < seq_lens.unsqueeze(1)  # [B, L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of k, v [L, Hkv, D]."""
    n, length = q.shape[0], k.shape[0]
    mask = None
    if n != length:  # queries start at position L - n: the causal diagonal is offset
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)

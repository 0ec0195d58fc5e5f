"""PyTorch reference kernels: the contract (shapes, semantics) the Triton kernels must meet,
and the CPU backend of the engine.

Paged KV layout: `k_cache`, `v_cache` are [num_blocks, block_size, Hkv, D]. A batch of B
sequences is flattened: `q` is [T, Hq, D] with sequence b's queries in rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]; `seq_lens[b]` counts its KV including the new tokens, so its
query i sits at position seq_lens[b] - q_len_b + i and attends causally to every position up to
its own. `block_tables[b, j]` is the block holding positions j*block_size .. (j+1)*block_size-1.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DECODE_GROUP = 16  # decodes per padded batch: 8-16 are fastest on CPU, 64 at once 2-4x slower (workers.microbench)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes token t's K/V [T, Hkv, D] to slot slot_mapping[t] (block * block_size + offset);
    slot -1 is a padding token and is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """Whole blocks copied, then trimmed to `length` positions (far faster than slot by slot)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks)
    return rows.view(num_seqs, -1, *cache.shape[2:])[:, :length]


@dataclass(slots=True)
class Part:
    """A piece of the batch attended in one call: one prefill sequence, or a group of decodes."""
    rows: slice                  # its queries: rows of q (a prefill) or of the sorted decodes (a group)
    blocks: torch.Tensor         # its block ids, sequence after sequence, each padded to the same count
    num_seqs: int
    length: int                  # KV positions per sequence (the longest, for a group)
    mask: torch.Tensor | None    # True where a query may attend; None: plain causal

    def to(self, device: torch.device) -> "Part":
        mask = None if self.mask is None else self.mask.to(device, non_blocking=True)
        return Part(self.rows, self.blocks.to(device, non_blocking=True), self.num_seqs, self.length, mask)


@dataclass(slots=True)
class Plan:
    decode_rows: torch.Tensor    # rows of q that are single-token queries, sorted by KV length
    groups: list[Part]           # the decodes in padded groups of similar length
    prefills: list[Part]         # every longer query, one sequence at a time

    def to(self, device: torch.device) -> "Plan":
        return Plan(self.decode_rows.to(device, non_blocking=True), [p.to(device) for p in self.groups],
                    [p.to(device) for p in self.prefills])


def plan_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int) -> Plan:
    """Splits a batch once per step, for all layers. Decodes run in padded groups of similar
    length, small enough that a group's gathered KV stays in cache; prefill chunks run one sequence
    at a time. This keeps the CPU cost close to the real work."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(lens))]
    decodes = sorted((b for b, n in enumerate(q_lens) if n == 1), key=lens.__getitem__)
    groups = [decode_group(decodes, i, seq_lens, block_tables, lens, block_size)
              for i in range(0, len(decodes), DECODE_GROUP)]
    prefills = []
    for b, n in enumerate(q_lens):
        if n > 1:
            mask = None
            if n != lens[b]:  # queries start at position L - n: the causal diagonal is offset
                mask = torch.ones(n, lens[b], dtype=torch.bool).tril(lens[b] - n)
            blocks = block_tables[b, :-(-lens[b] // block_size)]
            prefills.append(Part(slice(cu[b], cu[b + 1]), blocks, 1, lens[b], mask))
    return Plan(torch.tensor([cu[b] for b in decodes], dtype=torch.long), groups, prefills)


def decode_group(decodes: list[int], start: int, seq_lens, block_tables, lens: list[int], block_size: int) -> Part:
    group = decodes[start:start + DECODE_GROUP]
    length = lens[group[-1]]
    seqs = torch.tensor(group)
    blocks = block_tables[seqs, :-(-length // block_size)].reshape(-1)
    mask = torch.arange(length) < seq_lens[seqs].unsqueeze(1)
    return Part(slice(start, start + len(group)), blocks, len(group), length, mask[:, None, None, :])


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, plan: Plan | None = None) -> torch.Tensor:
    """Causal attention of every query over its sequence's paged KV: [T, Hq, D]. `plan` is
    plan_attention's result for these arguments, when the caller made it once for all layers."""
    if plan is None:
        plan = plan_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    out = torch.empty_like(q)
    if plan.groups:
        q_dec = q.index_select(0, plan.decode_rows).unsqueeze(2)  # [n, Hq, 1, D]
        out_dec = torch.empty_like(q_dec)
        for part in plan.groups:
            k, v = gather_kv_pair(k_cache, v_cache, part)
            out_dec[part.rows] = F.scaled_dot_product_attention(q_dec[part.rows], k, v, attn_mask=part.mask,
                                                                scale=scale, enable_gqa=True)
        out.index_copy_(0, plan.decode_rows, out_dec.squeeze(2))
    for part in plan.prefills:  # one sequence, n queries: 4-D for CPU's flash kernel
        k, v = gather_kv_pair(k_cache, v_cache, part)
        o = F.scaled_dot_product_attention(q[part.rows].transpose(0, 1).unsqueeze(0), k, v, attn_mask=part.mask,
                                           is_causal=part.mask is None, scale=scale, enable_gqa=True)
        out[part.rows] = o[0].transpose(0, 1)
    return out


def gather_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, part: Part) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's K and V as [S, Hkv, L, D]."""
    k = gather_blocks(k_cache, part.blocks, part.num_seqs, part.length)
    v = gather_blocks(v_cache, part.blocks, part.num_seqs, part.length)
    return k.transpose(1, 2), v.transpose(1, 2)


# -- fused elementwise ops: the same math as workers/layers (norm, rotary, activation) -------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm in float32 (HF Llama's formula); with `residual`, first x + residual, which is also
    returned as the next residual: (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by (cos, sin) [T, 1, D/2] in the half-split ("neox") layout; the
    scaling (linear, Llama 3) lives in the tables."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

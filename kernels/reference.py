"""PyTorch reference kernels: the contract (shapes, semantics) the Triton kernels must meet,
and the CPU backend of the engine.

Paged KV layout: `k_cache`, `v_cache` are [num_blocks, block_size, Hkv, D]. A batch of B
sequences is flattened: `q` is [T, Hq, D] with sequence b's queries in rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]; `seq_lens[b]` counts its KV including the new tokens, so its
query i sits at position seq_lens[b] - q_len_b + i and attends causally to every position up to
its own. `block_tables[b, j]` is the block holding positions j*block_size .. (j+1)*block_size-1.

A quantized pool (int8 or float8_e4m3fn, see quantize_kv) has rows of D + 2 elements: a token's D
quantized values under one KV head, then that row's scale as the two bytes of a bfloat16. Every
kernel takes either kind of pool through the same signatures: store_kv quantizes what it writes,
unified_attention dequantizes what it reads (dequantize_kv's values, exactly).
"""
from dataclasses import dataclass

import torch

DECODE_GROUP = 16  # decodes per padded batch: 8-16 are fastest on CPU, 64 at once 2-4x slower (lab.benchmarks)
SPLIT = 128        # KV positions per split: scores, maxima and sums run over whole splits, in order
QUERY_TILE = 256   # prefill queries per part: bounds a part's scores to QUERY_TILE x its KV length
EXP_FLOOR = -80.0  # exp under about -87 is denormal or zero, and 10-100x slower on CPU

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # kv_cache_dtype -> a quantized pool's element
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}              # the largest magnitude each holds
SCALE_SIZE = 2      # a quantized row's scale: a bfloat16, in the row's last two (1-byte) elements
MIN_SCALE = 2.0 ** -126


def quantized(cache: torch.Tensor) -> bool:
    """Whether a pool (or a K/V cache view of it) holds quantized rows."""
    return cache.dtype in QMAX


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] as quantized rows [..., D + 2] of `dtype` (int8 or float8_e4m3fn): each row of D is
    scaled by its own scale, amax / QMAX rounded up to a bfloat16 (so no value clips), then rounded
    (int8: to nearest even; fp8: torch's e4m3 rounding); the scale's two bytes end the row. A row's
    bytes depend on that row alone: which tokens share its block, or were written before it, or in
    the same step, changes nothing."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / QMAX[dtype]).clamp_min(MIN_SCALE)
    s16 = scale.to(torch.bfloat16)
    s16 = torch.where(s16.float() < scale, (s16.view(torch.int16) + 1).view(torch.bfloat16), s16)  # round up
    y = (xf / s16.float()).clamp(-QMAX[dtype], QMAX[dtype])
    q = y.round().to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return torch.cat((q.view(torch.uint8), s16.view(torch.uint8)), -1).view(dtype)


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """Quantized rows [..., D + 2] as float32 [..., D]: value x scale, exact in float32 (at most 8 + 8
    significant bits), so every kernel that multiplies the same two floats gets these bits."""
    scale = rows[..., -SCALE_SIZE:].contiguous().view(torch.uint8).view(torch.bfloat16).float()
    return rows[..., :-SCALE_SIZE].float() * scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte pool viewed as uint8 (torch lacks index_copy_ and friends for float8); others as they are."""
    return t.view(torch.uint8) if quantized(t) else t


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes token t's K/V [T, Hkv, D] to slot slot_mapping[t] (block * block_size + offset);
    slot -1 is a padding token and is skipped. Into a quantized pool, quantized (quantize_kv)."""
    if quantized(k_cache):
        key, value = quantize_kv(key, k_cache.dtype), quantize_kv(value, v_cache.dtype)
    store_rows(key, value, k_cache, v_cache, slot_mapping)


def store_rows(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
    """store_kv of rows already in the pool's dtype (a quantized pool's: with their scales)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key, value, k_cache, v_cache = as_bytes(key), as_bytes(value), as_bytes(k_cache), as_bytes(v_cache)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """Whole blocks copied, then trimmed to `length` positions (far faster than slot by slot); a
    quantized pool's dequantized, in float32."""
    rows = as_bytes(cache).view(cache.shape[0], -1).index_select(0, blocks).view(cache.dtype)
    rows = rows.view(num_seqs, -1, *cache.shape[2:])[:, :length]
    return dequantize_kv(rows) if quantized(cache) else rows


@dataclass(slots=True)
class Part:
    """A piece of the batch attended in one call: a group of decodes, or a tile of one sequence's
    prefill queries. Its sequences' KV is cut into num_splits splits of SPLIT positions."""
    rows: slice                  # its queries: rows of q (a prefill tile) or of the sorted decodes (a group)
    blocks: torch.Tensor         # block ids, sequence after sequence, each covering num_splits * SPLIT positions
    num_seqs: int
    num_splits: int
    open_splits: int             # leading splits that every query sees whole
    hidden: torch.Tensor         # [1, S, later splits, SPLIT, 1, n]: -inf where key position > query position, else 0
    seen: torch.Tensor           # the same shape: 0 where the key is hidden, else 1

    def to(self, device: torch.device) -> "Part":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Part(self.rows, move(self.blocks), self.num_seqs, self.num_splits, self.open_splits, move(self.hidden),
                    move(self.seen))


@dataclass(slots=True)
class Plan:
    decode_rows: torch.Tensor    # rows of q that are single-token queries, sorted by KV length
    groups: list[Part]           # the decodes in groups of similar length
    prefills: list[Part]         # every longer query, in tiles of one sequence

    def to(self, device: torch.device) -> "Plan":
        return Plan(self.decode_rows.to(device, non_blocking=True), [p.to(device) for p in self.groups],
                    [p.to(device) for p in self.prefills])


def plan_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int, num_heads: int = 1, num_kv_heads: int = 1) -> Plan:
    """Splits a batch once per step, for all layers. Decodes run in groups of similar length, small enough
    that a group's gathered KV stays in cache; prefill chunks run one tile of one sequence at a time.
    The head counts are the Triton plan's, unused here."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(lens))]
    decodes = sorted((b for b, n in enumerate(q_lens) if n == 1), key=lens.__getitem__)
    groups = []
    for i in range(0, len(decodes), DECODE_GROUP):
        seqs = decodes[i:i + DECODE_GROUP]
        positions = torch.tensor([[lens[b] - 1] for b in seqs])
        groups.append(make_part(slice(i, i + len(seqs)), seqs, positions, block_tables, lens, block_size))
    prefills = []
    for b, n in enumerate(q_lens):
        for first in range(0, n if n > 1 else 0, QUERY_TILE):
            count = min(QUERY_TILE, n - first)
            start = lens[b] - n + first  # the tile's first query position
            rows = slice(cu[b] + first, cu[b] + first + count)
            prefills.append(make_part(rows, [b], torch.arange(start, start + count)[None], block_tables, lens,
                                      block_size))
    return Plan(torch.tensor([cu[b] for b in decodes], dtype=torch.long), groups, prefills)


def make_part(rows: slice, seqs: list[int], positions: torch.Tensor, block_tables: torch.Tensor, lens: list[int],
              block_size: int) -> Part:
    """positions [S, n]: each query's position. Block slots past a sequence's own blocks repeat its
    first block: finite values that the mask hides."""
    num_splits = -(-(int(positions.max()) + 1) // SPLIT)
    count = -(-num_splits * SPLIT // block_size)
    cols = torch.arange(count)
    own = torch.tensor([-(-lens[b] // block_size) for b in seqs])[:, None]
    table = block_tables[seqs].long()
    blocks = torch.where(cols < own, table[:, cols.clamp(max=table.shape[1] - 1)], table[:, :1])
    open_splits = (int(positions.min()) + 1) // SPLIT
    keys = torch.arange(open_splits * SPLIT, num_splits * SPLIT).view(1, -1, SPLIT, 1)
    seen = (keys <= positions[:, None, None, :]).float()[None, :, :, :, None, :]
    return Part(rows, blocks.reshape(-1), len(seqs), num_splits, open_splits, seen.log(), seen)


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, plan: Plan | None = None) -> torch.Tensor:
    """Causal attention of every query over its sequence's paged KV: [T, Hq, D]. `plan` is
    plan_attention's result for these arguments, when the caller made it once for all layers.

    Batch-invariant: a query's result is the same bits whatever else is in the step, whether it is
    a decode or one of a prefill chunk's queries, at any thread count (see attend)."""
    if plan is None:
        plan = plan_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    out = torch.empty_like(q)
    if plan.groups:
        q_dec = q.index_select(0, plan.decode_rows)
        out_dec = torch.empty_like(q_dec)
        for part in plan.groups:
            out_dec[part.rows] = attend(q_dec[part.rows].unsqueeze(1), k_cache, v_cache, part, scale).squeeze(1)
        out.index_copy_(0, plan.decode_rows, out_dec)
    for part in plan.prefills:
        out[part.rows] = attend(q[part.rows].unsqueeze(0), k_cache, v_cache, part, scale)[0]
    return out


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: Part, scale: float) -> torch.Tensor:
    """q [S, n, Hq, D] -> [S, n, Hq, D]. Every matmul is [SPLIT, D] x [D, N], [D, SPLIT] x
    [SPLIT, N] or [2, SPLIT] x [SPLIT, N]: its rows and depth are fixed, only N (the part's queries
    times the heads sharing a KV head) varies, and BLAS gives a column the same bits for any N >= 2
    (N = 1 is padded), any batch count and any thread count. The softmax takes one maximum over
    all splits (exact in any order) and sums the splits one after another, so a split past a
    query's position (all masked: exactly zero) changes nothing. In float32 whatever q's dtype."""
    num_seqs, n, num_heads, d = q.shape   # d: the head dim (a quantized pool's rows are longer)
    kv_heads, splits, hidden, seen = k_cache.shape[2], part.num_splits, part.hidden, part.seen
    group = num_heads // kv_heads
    lone = n * group == 1
    if lone:  # a lone column takes BLAS's matrix-vector path: another summation order
        q, n = torch.cat((q, q), dim=1), 2
        hidden, seen = hidden.expand(-1, -1, -1, -1, -1, 2), seen.expand(-1, -1, -1, -1, -1, 2)
    rows, width = num_seqs * splits, n * group  # one [SPLIT, D] block of keys per row
    k = gather_blocks(k_cache, part.blocks, num_seqs, splits * SPLIT).reshape(rows, SPLIT, kv_heads, d).float()
    v = gather_blocks(v_cache, part.blocks, num_seqs, splits * SPLIT).reshape(rows, SPLIT, kv_heads, d).float()
    cols = (q.float() * scale).view(num_seqs, n, kv_heads, group, d).permute(2, 0, 4, 3, 1)  # [Hkv, S, D, group, n]
    cols = cols.reshape(kv_heads, num_seqs, 1, d, width)
    scores = k.new_empty(kv_heads, num_seqs, splits, SPLIT, width)
    for h in range(kv_heads):
        torch.bmm(k[:, :, h], cols[h].expand(-1, splits, -1, -1).reshape(rows, d, width),
                  out=scores[h].view(rows, SPLIT, width))
    edge = scores[:, :, part.open_splits:].view(kv_heads, num_seqs, -1, SPLIT, group, n)
    edge.add_(hidden)  # (masked_fill is not vectorized)
    scores.sub_(scores.amax(dim=(2, 3), keepdim=True)).clamp_min_(EXP_FLOOR).exp_()
    edge.mul_(seen)    # hidden keys: exactly 0
    acc = k.new_empty(kv_heads, num_seqs, splits, d, width)
    sums = k.new_empty(kv_heads, num_seqs, splits, 2, width)  # the weights' sums (twice: one row is a vector)
    ones = k.new_ones(2, SPLIT).expand(rows, 2, SPLIT)
    for h in range(kv_heads):  # contiguous outputs: into a strided one, bmm loops matrix by matrix
        weights = scores[h].view(rows, SPLIT, width)
        torch.bmm(v[:, :, h].transpose(1, 2), weights, out=acc[h].view(rows, d, width))
        torch.bmm(ones, weights, out=sums[h].view(rows, 2, width))
    total, norm = acc[:, :, 0], sums[:, :, 0, :1]
    for j in range(1, splits):
        total, norm = total + acc[:, :, j], norm + sums[:, :, j, :1]
    out = (total / norm).view(kv_heads, num_seqs, d, group, n)
    out = out.permute(1, 4, 0, 3, 2).reshape(num_seqs, n, num_heads, d).to(q.dtype)
    return out[:, :1] if lone else out


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
    """silu(gate) * up for x = [gate | up] along the last dimension (spelled with exp: see
    workers.layers.activation)."""
    gate, up = x.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up

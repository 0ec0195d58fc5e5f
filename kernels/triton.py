"""Triton kernels with the signatures of kernels.reference: the engine's CUDA backend.

unified_attention: one launch for a whole varlen batch (prefill, chunked prefill, decode). Program
(tile, KV head) computes the query heads that share that KV head (GQA's group) for a few query
tokens of one sequence at once: its BLOCK_M rows are (token, head of the group) pairs, so each KV
position it loads serves the whole group. plan_attention cuts the queries into those tiles once
per step, on the host. Each program runs flash attention's online softmax over its sequence's KV,
BLOCK_N positions at a time, each position's address looked up in the block table, and stops at
the tile's last causal position. Split-KV (flash decoding): when every query is a decode and there
are few (sequence, KV head) programs for a long context, each program takes one slice of the KV
range and a second kernel merges the slices' (max, sum, accumulator).

A quantized pool (int8 or fp8 rows with their bfloat16 scale, kernels.reference.quantize_kv): store_kv
quantizes with the reference's torch code, then copies the rows; the attention reads the pool as int8,
dequantizes each row in registers (fp8 decoded from its bits) and goes on as for a float32 or 16-bit
pool of the query's dtype.

Measured on an H200 (docs/gpu.md) before the grouping, with one program per query head: decode
attention moved 11-12% of peak bandwidth for 8 query heads over 1 KV head and 20-24% for 4 over
1, i.e. the KV read once per query head at near peak. Grouped, the KV is read once per KV head.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.reference import as_bytes, quantize_kv, quantized

BLOCK_M = 16                 # query rows per tile, (token, head) pairs; more when a group is larger
BLOCK_N = 32                 # KV positions per inner step
SPLIT_MIN_CONTEXT = 2048     # split-KV only for decodes at least this long...
SPLIT_TARGET = 256           # ...when (sequences x KV heads) is below this many programs (2 per SM of an H100)
SPLIT_MIN_SIZE = 512         # KV positions per split at least


@triton.jit
def _store_kv(key, value, k_cache, v_cache, slots, stride_kt, stride_vt, stride_ks, stride_vs,
              ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key + t.to(tl.int64) * stride_kt + offs, mask=mask)
        v = tl.load(value + t.to(tl.int64) * stride_vt + offs, mask=mask)
        tl.store(k_cache + slot * stride_ks + offs, k, mask=mask)
        tl.store(v_cache + slot * stride_vs + offs, v, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes token t's K/V [T, Hkv, D] to slot slot_mapping[t]; slot -1 (padding) is skipped."""
    if key.shape[0] == 0:
        return
    if quantized(k_cache):   # rows of D + 2 bytes, the scale included; copied as bytes
        key, value = as_bytes(quantize_kv(key, k_cache.dtype)), as_bytes(quantize_kv(value, v_cache.dtype))
        k_cache, v_cache = as_bytes(k_cache), as_bytes(v_cache)
    key, value = key.reshape(key.shape[0], -1), value.reshape(value.shape[0], -1)
    row = key.shape[1]
    kc, vc = k_cache.view(-1, row), v_cache.view(-1, row)
    _store_kv[(key.shape[0],)](key, value, kc, vc, slot_mapping, key.stride(0), value.stride(0), kc.stride(0),
                              vc.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))


def tile_rows(group: int) -> tuple[int, int]:
    """(rows of a tile, query tokens in it) for `group` query heads per KV head."""
    rows = max(BLOCK_M, triton.next_power_of_2(group))
    return rows, rows // group


@dataclass(slots=True)
class Plan:
    tile_seq: torch.Tensor       # int32 [tiles]: the sequence of each query tile
    tile_start: torch.Tensor     # int32 [tiles]: its first query token within the sequence
    num_splits: int              # 1, or the KV splits of an all-decode batch
    max_seq_len: int
    group: int                   # query heads per KV head that the tiles are cut for

    def to(self, device: torch.device) -> "Plan":
        return Plan(self.tile_seq.to(device, non_blocking=True), self.tile_start.to(device, non_blocking=True),
                    self.num_splits, self.max_seq_len, self.group)


def plan_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int, num_heads: int = 1, num_kv_heads: int = 1) -> Plan:
    """The query tiles of the batch and whether to split the KV: once per step, for all layers."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    group = num_heads // num_kv_heads
    tokens = tile_rows(group)[1]
    seqs, starts = [], []
    for b in range(len(lens)):
        for start in range(0, cu[b + 1] - cu[b], tokens):
            seqs.append(b)
            starts.append(start)
    longest = max(lens, default=0)
    all_decode = all(cu[b + 1] - cu[b] == 1 for b in range(len(lens)))
    splits = 1
    programs = len(lens) * num_kv_heads
    if all_decode and longest >= SPLIT_MIN_CONTEXT and programs < SPLIT_TARGET:
        splits = min(triton.cdiv(longest, SPLIT_MIN_SIZE), triton.cdiv(SPLIT_TARGET, programs))
    return Plan(torch.tensor(seqs, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), splits, longest,
                group)


@triton.jit
def _dequantize(rows, x, n_ok, HEAD_DIM: tl.constexpr, KV: tl.constexpr):
    """x: a tile of quantized values loaded as int8 (KV 1: int8, 2: fp8 e4m3's bits); `rows` points at
    each row's start, whose bfloat16 scale follows its HEAD_DIM values. float32, exactly the reference's."""
    lo = tl.load(rows + HEAD_DIM, mask=n_ok, other=0).to(tl.int32) & 0xFF
    hi = tl.load(rows + HEAD_DIM + 1, mask=n_ok, other=0).to(tl.int32) & 0xFF
    scale = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
    if KV == 1:
        value = x.to(tl.float32)
    else:
        u = x.to(tl.int32) & 0xFF
        e, m = (u >> 3) & 15, u & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)   # subnormals: m * 2^-9
        value = tl.where((u & 0x80) != 0, -value, value)
    return value * scale[:, None]


@triton.jit
def _attention(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, tile_seq, tile_start,
               part_max, part_sum, scale,
               stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               stride_ot, stride_oh, stride_bt, split_size,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
               IEEE: tl.constexpr, KV: tl.constexpr):
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = tl.load(tile_seq + tile)
    q_first = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_first
    seq_len = tl.load(seq_lens + b)
    r = tl.arange(0, BLOCK_M)
    token = tl.load(tile_start + tile) + r // GROUP                  # each row's query token within the sequence
    head = kv_head * GROUP + r % GROUP                               # and its query head
    row_ok = (r < BLOCK_Q * GROUP) & (token < q_len)
    pos = seq_len - q_len + token                                    # each row's position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_first + token).to(tl.int64)
    qv = tl.load(q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(seq_len, tl.max(tl.where(row_ok, pos, 0)) + 1)  # the tile's last causal position + 1
    begin = 0
    if SPLIT:
        begin = split * split_size
        end = tl.minimum(end, begin + split_size)
    table = block_tables + b.to(tl.int64) * stride_bt
    for n0 in range(begin, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = (n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_rows = k_cache + block * stride_kb + offset * stride_ks + kv_head * stride_kh
        v_rows = v_cache + block * stride_vb + offset * stride_vs + kv_head * stride_vh
        k = tl.load(k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV != 0:   # a quantized pool: float32 values, in the query's dtype for the dots
            k = _dequantize(k_rows, k, n_ok, HEAD_DIM, KV).to(qv.dtype)
            v = _dequantize(v_rows, v, n_ok, HEAD_DIM, KV).to(qv.dtype)
        if IEEE:  # noqa: SIM108 -- float32 operands: exact products (a GPU's float32 dot is tf32 by default)
            logits = tl.dot(qv, tl.trans(k), input_precision="ieee") * scale
        else:       # 16-bit operands on the tensor cores, accumulated in float32
            logits = tl.dot(qv, tl.trans(k)) * scale
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # rows that have seen nothing yet
        p = tl.exp(logits - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s = s * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:       # the probabilities rounded to V's type, as flash attention and HF's SDPA do
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    out_ptrs = out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:   # decodes: a row per query head; its slice's partial result waits for the merge
        part = (b * (tl.num_programs(1) * GROUP) + head) * tl.num_programs(2) + split
        tl.store(part_max + part, m, mask=row_ok)
        tl.store(part_sum + part, s, mask=row_ok)
        tl.store(out_ptrs + split * BLOCK_D, acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        o = acc / tl.where(s == 0, 1.0, s)[:, None]
        tl.store(out_ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge(part_acc, part_max, part_sum, out, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr,
           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b, head = tl.program_id(0), tl.program_id(1)
    first = (b * tl.num_programs(1) + head) * NUM_SPLITS
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    m = tl.load(part_max + first + sp, mask=sp_ok, other=float("-inf"))
    s = tl.load(part_sum + first + sp, mask=sp_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc + (first + sp)[:, None] * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(s * w, 0)
    tl.store(out + b.to(tl.int64) * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, plan: Plan | None = None) -> torch.Tensor:
    """Causal attention of every query over its sequence's paged KV: [T, Hq, D] (see kernels.reference)."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    group = num_heads // num_kv_heads
    kv = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(k_cache.dtype, 0)   # a quantized pool: int8 or fp8
    if kv:
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
    if plan is None:
        plan = plan_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1], num_heads, num_kv_heads)
    if plan.group != group:
        raise ValueError(f"the attention plan's tiles are cut for {plan.group} query heads per KV head; "
                         f"this call has {group} ({num_heads} over {num_kv_heads})")
    out = torch.empty_like(q)
    tiles = plan.tile_seq.numel()
    if tiles == 0:
        return out
    block_d = triton.next_power_of_2(max(head_dim, 16))
    block_m, block_q = tile_rows(group)
    split = plan.num_splits > 1
    num_seqs = seq_lens.numel()
    split_size = triton.cdiv(triton.cdiv(plan.max_seq_len, plan.num_splits), BLOCK_N) * BLOCK_N
    if split:   # partial results: max and sum per (sequence, head, split), the accumulator in fp32
        parts = num_seqs * num_heads * plan.num_splits
        part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(parts, block_d, dtype=torch.float32, device=q.device)
        target, stride_t, stride_h = part_acc, num_heads * plan.num_splits * block_d, plan.num_splits * block_d
    else:
        part_max = part_sum = out
        target, stride_t, stride_h = out, out.stride(0), out.stride(1)
    _attention[(tiles, num_kv_heads, plan.num_splits)](
        q, k_cache, v_cache, target, cu_seqlens_q, seq_lens, block_tables, plan.tile_seq, plan.tile_start,
        part_max, part_sum, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_t, stride_h, block_tables.stride(0),
        split_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=BLOCK_N, SPLIT=split, IEEE=q.dtype == torch.float32,
        KV=kv)
    if split:
        _merge[(num_seqs, num_heads)](part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
                                      NUM_SPLITS=plan.num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                      BLOCK_S=triton.next_power_of_2(plan.num_splits))
    return out


# -- fused elementwise ops: one program per token row ----------------------------------------------

@triton.jit
def _rms_norm(x, residual, weight, out, new_residual, eps, stride_x, stride_r, stride_o, stride_n,
              N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        v = v + tl.load(residual + row * stride_r + cols, mask=ok, other=0.0)
        tl.store(new_residual + row * stride_n + cols, v, mask=ok)
    vf = v.to(tl.float32)
    normed = (vf / tl.sqrt(tl.sum(vf * vf, 0) / N + eps)).to(v.dtype)     # rounded before the weight, as HF
    w = tl.load(weight + cols, mask=ok, other=0.0)
    tl.store(out + row * stride_o + cols, (w * normed).to(out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """kernels.reference.rms_norm in one pass: (normed, x + residual) with a residual, else normed."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(x2.shape) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, r2, weight, out, new, eps, x2.stride(0), r2.stride(0), out.stride(0),
                                  new.stride(0), N=x2.shape[1], BLOCK=triton.next_power_of_2(x2.shape[1]),
                                  HAS_RESIDUAL=residual is not None)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if residual is None else (out, new.view(x.shape))


@triton.jit
def _rotary(x, cos, sin, out, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
            HALF: tl.constexpr, BLOCK: tl.constexpr):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    src = x + t * stride_xt + h * stride_xh
    x1 = tl.load(src + i, mask=ok, other=0.0)
    x2 = tl.load(src + HALF + i, mask=ok, other=0.0)
    c = tl.load(cos + t * stride_ct + i, mask=ok, other=0.0)
    s = tl.load(sin + t * stride_ct + i, mask=ok, other=0.0)
    dst = out + t * stride_ot + h * stride_oh
    tl.store(dst + i, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + i, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.reference.rotary: x [T, H, D] by (cos, sin) [T, 1, D/2], half-split layout."""
    half = x.shape[-1] // 2
    cos, sin = cos.reshape(x.shape[0], half).contiguous(), sin.reshape(x.shape[0], half).contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if x.shape[0]:
        _rotary[(x.shape[0], x.shape[1])](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
                                          out.stride(1), HALF=half, BLOCK=triton.next_power_of_2(half))
    return out


@triton.jit
def _silu_and_mul(x, out, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + N + cols, mask=ok, other=0.0)
    silu = (gate / (1 + tl.exp(-gate))).to(up.dtype)       # rounded as torch's F.silu is, then the product
    tl.store(out + row * stride_o + cols, (silu * up).to(out.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.silu_and_mul: silu(gate) * up for x = [gate | up] [T, 2I] -> [T, I]."""
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    if x2.shape[0]:
        _silu_and_mul[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), N=n, BLOCK=block)
    return out.view(*x.shape[:-1], n)

"""The attention layer: writes the step's new K/V into the paged cache, then attends over it.

Every layer writes all of a step's K/V before any of its queries attend, so a request may hit
prefix blocks that another request of the same step is computing.
"""
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn


@dataclass(slots=True)
class AttentionMetadata:
    """One flattened varlen batch, as the kernels take it (see kernels.reference)."""
    slot_mapping: torch.Tensor   # int64 [T]
    cu_seqlens_q: torch.Tensor   # int32 [B+1]
    seq_lens: torch.Tensor       # int32 [B]
    block_tables: torch.Tensor   # int32 [B, max_blocks]
    plan: object = None          # the kernels' per-step plan, made once for all layers

    def to(self, device: torch.device) -> "AttentionMetadata":
        if device.type == "cpu":
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        plan = self.plan.to(device) if self.plan is not None else None
        return AttentionMetadata(move(self.slot_mapping), move(self.cu_seqlens_q), move(self.seq_lens),
                                 move(self.block_tables), plan)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kernels: ModuleType | None = None  # kernels.reference or the Triton module, set by the runner
        self.k_cache = self.v_cache = torch.empty(0)  # views of the runner's pool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        self.kernels.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.kernels.unified_attention(q, self.k_cache, self.v_cache, meta.cu_seqlens_q,
                                              meta.seq_lens, meta.block_tables, self.scale, meta.plan)

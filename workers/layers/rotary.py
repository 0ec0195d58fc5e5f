"""Rotary position embedding (the half-split "neox" layout of HF Llama), with its scalings."""
import math

import torch
from torch import nn

from kernels import cpu_ops


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, short ones
    kept, the band between smoothly interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, theta)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; a step looks them up once and every layer rotates with
    them, in the activations' dtype, as HF does: full width, the sine's first half negated, so that
    a rotation is two products and a sum (see rotate)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [T, 1, head_dim], for the tokens at `positions`."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by RotaryEmbedding's tables [T, 1, D], half-split layout: HF's
    x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) being x's halves swapped (a roll)
    times the signed sine. The same bits as HF's in any dtype (a negation is exact). In bfloat16 on the
    CPU, rotated in place (kernels/cpu_ops.py, the same rounding steps) when each head's row is contiguous."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2] and cpu_ops.takes(x, x.shape[-1] // 2):
        return cpu_ops.rope(x, cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

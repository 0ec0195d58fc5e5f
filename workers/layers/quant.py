"""Weight-only quantization of the linear layers, made at load from any checkpoint: int8 with one
float32 scale per output channel (symmetric, round to nearest). On CPU the int8 weights are what
memory holds and what the matmul reads (kernels.int8_linear); elsewhere they are widened per call."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import int8_linear

QUANTIZATIONS = ("none", "int8", "w4a16")   # w4a16: a compressed-tensors checkpoint's (not read yet), never made here


@dataclass(slots=True)
class Int8Weight:
    q: torch.Tensor                          # int8 [N, K]
    scale: torch.Tensor                      # float32 [N]: W ≈ q * scale[:, None]
    packed: int8_linear.Packed | None = None  # the CPU kernel's layout, once packed (q is then a view of it)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    w = weight.detach().float()
    scale = (torch.maximum(w.amax(dim=1), -w.amin(dim=1)) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    steps = (w / scale[:, None]).round_().clamp_(-127, 127)   # one temporary: the load is memory-bound
    return Int8Weight(steps.to(torch.int8), scale)


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.packed is not None:
        return int8_linear.linear(x, weight.packed, bias)
    y = F.linear(x, weight.q.to(x.dtype)) * weight.scale.to(x.dtype)
    return y if bias is None else y + bias


def quantize_model(model: nn.Module, method: str) -> None:
    """Replaces every linear weight (the LM head's too) by its int8 form, after loading. A tied LM
    head keeps the float weight the embedding reads, beside its int8 copy."""
    assert method == "int8", method
    shared = model.lm_head if model.cfg.tie_word_embeddings else None
    for m in model.modules():
        if hasattr(m, "packed_weight"):
            m.packed_weight = quantize_int8(m.weight)
            if m is not shared:
                m.weight = nn.Parameter(m.packed_weight.q, requires_grad=False)


def pack_for_cpu(model: nn.Module) -> bool:
    """Lays every int8 weight out for the CPU kernel, once; False, changing nothing, where it cannot run."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "packed_weight", None), Int8Weight)]
    if not layers or not int8_linear.available():
        return False
    for m in layers:
        w = m.packed_weight
        w.packed = int8_linear.pack(w.q, w.scale)
        w.q = int8_linear.unpack(w.packed)
        if m.weight.dtype == torch.int8:
            m.weight = nn.Parameter(w.q, requires_grad=False)
    return True

"""Weight-only quantized linear layers.

- int8 made at load from any checkpoint (`--quantization int8`): one float32 scale per output
  channel, symmetric, round to nearest;
- a checkpoint's own codes, kept as they were read (never widened to float in memory):
  4-bit codes with a scale (and, asymmetric, a 4-bit zero) per group of inputs, from a
  compressed-tensors W4A16 checkpoint (workers.models.compressed) or a GGUF's Q4_0 tensors; int8
  with a scale per group of 32 inputs from a GGUF's Q8_0 tensors (workers.models.gguf).

On CPU the codes are what the matmul reads: int8 in kernels.int8_linear; 4-bit, with float32 inputs,
in kernels.int8_linear too (exactly a float32 matmul of the dequantized weight), with bfloat16 inputs
in PyTorch's int4 kernel (`_weight_int4pack_mm_for_cpu`, 2x faster at one row, its operands
rounded to bfloat16); elsewhere the weight is widened per call. Every one of them sums an output in
an order fixed whatever the batch: batch-invariant."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import int8_linear

# none: the checkpoint's weights; int8: made at load; w4a16: a compressed-tensors checkpoint's (never made here);
# gguf: a GGUF file's Q8_0 and Q4_0 linear weights kept quantized (other types dequantized as without it)
QUANTIZATIONS = ("none", "int8", "w4a16", "gguf")


@dataclass(frozen=True, slots=True)
class Layout:
    """How a checkpoint quantized one linear weight: `bits` 4 or 8, a scale per `group_size` inputs,
    and for 4-bit asymmetric codes a zero per group (symmetric: 8)."""
    bits: int
    group_size: int
    symmetric: bool = True


@dataclass(slots=True)
class Int8Weight:
    q: torch.Tensor                          # int8 [N, K]
    scale: torch.Tensor                      # float32 [N] (W ≈ q * scale[:, None]) or [N, K/g]: a scale per group
    packed: int8_linear.Packed | None = None  # the CPU kernel's layout, once packed (q is then a view of it)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * per_input(self.scale, self.q.shape[1])


def per_input(scale: torch.Tensor, k: int) -> torch.Tensor:
    """A scale per output [N] or per group [N, K/g] as one per weight (broadcastable to [N, K])."""
    if scale.dim() == 1:
        return scale.float()[:, None]
    return scale.float().repeat_interleave(k // scale.shape[1], dim=1)


@dataclass(slots=True)
class Int4Packed:
    """PyTorch's CPU int4 layout of a weight and its [K/g, N, 2] (scale, zero) pairs, in bfloat16:
    its kernel reads W = (code - 8) * scale + zero."""
    weight: torch.Tensor
    scales_and_zeros: torch.Tensor


@dataclass(slots=True)
class Int4Weight:
    codes: torch.Tensor          # uint8 [N, K/2]: input 2j's 4-bit code (0..15) in the low nibble, 2j+1's in the high
    scale: torch.Tensor          # float32 [N, K/g]
    zero: torch.Tensor | None    # uint8 [N, K/g] codes 0..15; None: 8 (symmetric). W = (code - zero) * scale
    group_size: int
    packed: Int4Packed | None = None   # PyTorch's CPU layout (bfloat16 inputs), once packed
    native: int8_linear.Packed | None = None   # kernels.int8_linear's (float32 inputs): codes is then a view of it

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]: (code - zero) * scale, one rounding, as compressed-tensors and
        gguf-py compute it."""
        k = self.codes.shape[1] * 2
        zero = 8.0 if self.zero is None else per_input(self.zero, k)
        return (unpack_nibbles(self.codes).float() - zero) * per_input(self.scale, k)


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] two codes a byte -> uint8 [N, K], low nibble first."""
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes 0..15 -> [N, K/2], the first of each pair in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    w = weight.detach().float()
    scale = (torch.maximum(w.amax(dim=1), -w.amin(dim=1)) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    steps = (w / scale[:, None]).round_().clamp_(-127, 127)   # one temporary: the load is memory-bound
    return Int8Weight(steps.to(torch.int8), scale)


def linear(x: torch.Tensor, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Int4Weight):
        return int4_linear(x, weight, bias)
    if weight.packed is not None:
        return int8_linear.linear(x, weight.packed, bias)
    if weight.scale.dim() == 2:
        return F.linear(x, weight.dequantize().to(x.dtype), bias)
    y = F.linear(x, weight.q.to(x.dtype)) * weight.scale.to(x.dtype)
    return y if bias is None else y + bias


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 inputs: kernels.int8_linear (PyTorch's float32 int4 kernel is scalar code, 40x slower at one
    row, 100x at 64). bfloat16 inputs: PyTorch's int4 kernel, which sums each output over the inputs in
    order in float32 whatever the row count or threads (batch-invariant, tests/workers/test_w4a16.py) and
    rounds its output to bfloat16. Where neither is packed: the weight dequantized for the call."""
    if weight.native is not None and (x.dtype == torch.float32 or weight.packed is None):
        return int8_linear.linear(x, weight.native, bias)
    if weight.packed is None:
        return F.linear(x, weight.dequantize().to(x.dtype), bias)
    p = weight.packed
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), p.weight, weight.group_size,
                                                   p.scales_and_zeros).to(x.dtype)
    return y if bias is None else y + bias


INT4_GROUP_SIZES = (32, 64, 128, 256)   # what _weight_int4pack_mm_for_cpu takes


def pack_int4(weight: Int4Weight) -> Int4Packed | None:
    """PyTorch's CPU layout; None where its kernel cannot take the weight (outputs not a multiple of 16,
    or a group size it lacks). The zero becomes the kernel's additive term: (code - zero) * scale =
    (code - 8) * scale + (8 - zero) * scale, rounded to bfloat16 with the scale."""
    n, k = weight.codes.shape[0], weight.codes.shape[1] * 2
    if n % 16 or weight.group_size not in INT4_GROUP_SIZES or not hasattr(torch.ops.aten,
                                                                           "_weight_int4pack_mm_for_cpu"):
        return None
    codes = unpack_nibbles(weight.codes).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale = weight.scale.float()
    zero = torch.zeros_like(scale) if weight.zero is None else (8 - weight.zero.float()) * scale
    pairs = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    assert pairs.shape == (k // weight.group_size, n, 2)
    return Int4Packed(packed, pairs)


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


# -- a checkpoint's codes, loaded into the layers -------------------------------------------------

def hold_quantized(module: nn.Module, layout: Layout, loader_of) -> None:
    """Replaces a linear layer's float weight [N, K] by parameters for a checkpoint's codes, before
    loading: weight_packed (uint8 [N, K/2], two 4-bit codes a byte, or int8 [N, K]), weight_scale
    (float32 [N, K/g]) and, asymmetric, weight_zero_point (uint8 [N, K/g]). `loader_of(unit)` is the
    weight loader of a parameter holding one column per `unit` inputs."""
    n, k = module.weight.shape
    g, per_byte = layout.group_size, 8 // layout.bits
    loaders = {unit: loader_of(unit) for unit in (per_byte, g)}   # raises where a rank's share cuts a group
    if k % g:
        raise ValueError(f"quantization: a layer's {k} inputs are not whole groups of {g}")
    device = module.weight.device
    module.register_parameter("weight", None)
    params = {"weight_packed": torch.zeros(n, k // 2, dtype=torch.uint8, device=device) if layout.bits == 4
              else torch.zeros(n, k, dtype=torch.int8, device=device),
              "weight_scale": torch.zeros(n, k // g, dtype=torch.float32, device=device)}
    if not layout.symmetric:
        params["weight_zero_point"] = torch.full((n, k // g), 8, dtype=torch.uint8, device=device)
    for name, data in params.items():
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = loaders[per_byte if name == "weight_packed" else g]
        module.register_parameter(name, param)
    module.layout = layout


def finish_quantized(model: nn.Module) -> None:
    """After loading: each layer's weight object over the codes it was loaded with."""
    for m in model.modules():
        layout = getattr(m, "layout", None)
        if layout is None:
            continue
        if layout.bits == 4:
            zero = getattr(m, "weight_zero_point", None)
            m.packed_weight = Int4Weight(m.weight_packed.data, m.weight_scale.data,
                                         None if zero is None else zero.data, layout.group_size)
        else:
            m.packed_weight = Int8Weight(m.weight_packed.data, m.weight_scale.data)


def pack_for_cpu(model: nn.Module) -> bool:
    """Lays every quantized weight out for its CPU kernels, once; False, changing nothing, where none can
    run. 4-bit weights are held twice, in kernels.int8_linear's layout (their codes) and PyTorch's: a byte
    per weight on CPU, as int8."""
    native = int8_linear.available()
    int4 = [m for m in model.modules() if isinstance(getattr(m, "packed_weight", None), Int4Weight)]
    for m in int4:
        pack_int4_for_cpu(m, native)
    layers = [m for m in model.modules()
              if isinstance(getattr(m, "packed_weight", None), Int8Weight) and kernel_takes(m.packed_weight)]
    if not layers or not native:
        return any(m.packed_weight.packed is not None or m.packed_weight.native is not None for m in int4)
    for m in layers:
        w = m.packed_weight
        w.packed = int8_linear.pack(w.q, w.scale)
        w.q = int8_linear.unpack(w.packed)
        if m.weight is not None and m.weight.dtype == torch.int8:
            m.weight = nn.Parameter(w.q, requires_grad=False)
        elif getattr(m, "weight_packed", None) is not None:
            m.weight_packed = nn.Parameter(w.q, requires_grad=False)
    return True


def kernel_takes(w: Int8Weight) -> bool:
    """kernels.int8_linear takes any per-output weight, a grouped one in groups of a multiple of 16 inputs."""
    k = w.q.shape[1]
    return w.scale.dim() == 1 or int8_linear.takes(k, k // w.scale.shape[1])


def pack_int4_for_cpu(m: nn.Module, native: bool) -> None:
    """A 4-bit layer in PyTorch's layout where its kernel takes it, and in kernels.int8_linear's where that runs."""
    w = m.packed_weight
    w.packed = pack_int4(w)
    if native and int8_linear.takes(w.codes.shape[1] * 2, w.group_size):
        w.native = int8_linear.pack_int4(w.codes, w.scale, w.zero)
        w.codes = int8_linear.unpack(w.native)
        m.weight_packed = nn.Parameter(w.codes, requires_grad=False)   # the parameter counts the memory held

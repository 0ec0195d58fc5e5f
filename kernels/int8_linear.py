"""Linear layers with int8 weights, one float32 scale per output, or int8 or 4-bit weights with a scale
(and a 4-bit zero) per group of inputs (kernels/int8_linear.cpp, AVX-512): a decode step reads half (a
quarter) of bfloat16's weight bytes. Each output is summed in one fixed order whatever the batch, so
the layer is batch-invariant. Built on first use, like kernels.cpu's attention.
"""
import ctypes
import subprocess
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from kernels import cpu

SOURCE = Path(__file__).with_name("int8_linear.cpp")


class Linear(ctypes.Structure):
    """The kernel's arguments (struct Linear in int8_linear.cpp)."""
    _fields_ = [("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("m", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("kind", ctypes.c_int64), ("group", ctypes.c_int64), ("zero", ctypes.c_void_p)]


PER_CHANNEL, INT8_GROUPS, INT4_GROUPS = 0, 1, 2   # enum Kind in int8_linear.cpp


@dataclass(slots=True)
class Packed:
    """A weight [N, K], N padded to 16 and K to 16 with zeros, and its scales: int8 with a scale per
    output, or (grouped, `group` inputs a scale) int8 or 4-bit codes two a byte with zero codes."""
    q: torch.Tensor              # int8 [N padded, K padded], or uint8 [N padded, K / 2] (INT4_GROUPS)
    scale: torch.Tensor          # float32 [N padded], or [N padded, K / group]
    n: int                       # the layer's outputs
    k: int                       # its inputs
    kind: int = PER_CHANNEL
    group: int = 0
    zero: torch.Tensor | None = None   # INT4_GROUPS: uint8 [N padded, K / group]; None: 8 (symmetric)


def pack(q: torch.Tensor, scale: torch.Tensor) -> Packed:
    """int8 q [N, K] with a scale per output [N], or per output and group of inputs [N, K/g] (g a
    multiple of 16)."""
    n, k = q.shape
    if scale.dim() == 1:
        return Packed(F.pad(q, (0, -k % 16, 0, -n % 16)).contiguous(),
                      F.pad(scale.float(), (0, -n % 16)).contiguous(), n, k)
    group = grouped(k, scale)
    return Packed(F.pad(q, (0, 0, 0, -n % 16)).contiguous(), F.pad(scale.float(), (0, 0, 0, -n % 16)).contiguous(),
                  n, k, INT8_GROUPS, group)


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> Packed:
    """4-bit codes uint8 [N, K/2] (input 2j in the low nibble), a scale per output and group [N, K/g]
    (g a multiple of 16), zero codes [N, K/g] or None (8): W = (code - zero) * scale."""
    n, k = codes.shape[0], codes.shape[1] * 2
    group = grouped(k, scale)
    pad = (0, 0, 0, -n % 16)
    return Packed(F.pad(codes, pad).contiguous(), F.pad(scale.float(), pad).contiguous(), n, k, INT4_GROUPS, group,
                  None if zero is None else F.pad(zero, pad, value=8).contiguous())


def grouped(k: int, scale: torch.Tensor) -> int:
    group = k // scale.shape[1]
    if group * scale.shape[1] != k or not takes(k, group):
        raise ValueError(f"int8_linear: {scale.shape[1]} scales per output over {k} inputs; the kernel takes groups "
                         "of a multiple of 16 inputs")
    return group


def takes(k: int, group: int) -> bool:
    """Whether the kernel takes a grouped weight of k inputs in groups of `group`."""
    return group % 16 == 0 and k % group == 0


def unpack(packed: Packed) -> torch.Tensor:
    """The weight [N, K] (int8), or its codes [N, K/2] (4-bit)."""
    return packed.q[:packed.n, :packed.k // 2 if packed.kind == INT4_GROUPS else packed.k]


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, computed in float32 (bfloat16 inputs widened, the outputs
    rounded once): the scale applied to each output's sum (per output) or to each weight as it is widened
    (grouped), then the bias."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"int8_linear takes bfloat16 or float32 inputs, not {x.dtype}")
    xf = x.float()
    if packed.k % 16:   # per-channel only: a grouped weight's inputs are whole groups of 16s
        xf = F.pad(xf, (0, -packed.k % 16))
    xf = xf.contiguous()
    n = packed.q.shape[0]
    if bias is not None:
        bias = F.pad(bias.float(), (0, n - packed.n)).contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    args = Linear(xf.data_ptr(), packed.q.data_ptr(), packed.scale.data_ptr(),
                  None if bias is None else bias.data_ptr(), y.data_ptr(), xf.shape[0], n, xf.shape[1],
                  packed.kind, packed.group, None if packed.zero is None else packed.zero.data_ptr())
    library().int8_linear(ctypes.byref(args), torch.get_num_threads())
    return y[:, :packed.n].to(x.dtype)


_library: ctypes.CDLL | None = None


def available() -> bool:
    """Whether the CPU has AVX-512 and the kernel builds; the reason is logged when it cannot."""
    if "avx512f" not in cpu.cpu_flags():
        return False
    try:
        library()
        return True
    except (OSError, subprocess.CalledProcessError) as e:
        structlog.get_logger().warning("int8 linear kernel unavailable, using torch's", reason=str(e).strip()[-500:])
        return False


def library() -> ctypes.CDLL:
    global _library
    if _library is None:
        lib = ctypes.CDLL(str(cpu.build(source=SOURCE)))
        lib.int8_linear.argtypes = [ctypes.POINTER(Linear), ctypes.c_int32]
        lib.int8_linear.restype = None
        _library = lib
    return _library

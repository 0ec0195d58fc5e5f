"""Linear layers with int8 weights, one float32 scale per output (kernels/int8_linear.cpp, AVX-512):
a decode step reads half of bfloat16's weight bytes. Each output is summed in one fixed order
whatever the batch, so the layer is batch-invariant. Built on first use, like kernels.cpu's attention.
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
                ("m", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


@dataclass(slots=True)
class Packed:
    """An int8 weight [N, K], N padded to 16 and K to 16 with zeros, and its scales."""
    q: torch.Tensor              # int8 [N padded, K padded]
    scale: torch.Tensor          # float32 [N padded]
    n: int                       # the layer's outputs
    k: int                       # its inputs


def pack(q: torch.Tensor, scale: torch.Tensor) -> Packed:
    n, k = q.shape
    return Packed(F.pad(q, (0, -k % 16, 0, -n % 16)).contiguous(), F.pad(scale.float(), (0, -n % 16)).contiguous(),
                  n, k)


def unpack(packed: Packed) -> torch.Tensor:
    """The int8 weight [N, K]."""
    return packed.q[:packed.n, :packed.k]


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, computed in float32 (bfloat16 inputs widened, the outputs
    rounded once): the scale applied to each output's sum, then the bias."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"int8_linear takes bfloat16 or float32 inputs, not {x.dtype}")
    xf = x.float()
    if packed.k % 16:
        xf = F.pad(xf, (0, -packed.k % 16))
    xf = xf.contiguous()
    n = packed.q.shape[0]
    if bias is not None:
        bias = F.pad(bias.float(), (0, n - packed.n)).contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    args = Linear(xf.data_ptr(), packed.q.data_ptr(), packed.scale.data_ptr(),
                  None if bias is None else bias.data_ptr(), y.data_ptr(), xf.shape[0], n, xf.shape[1])
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

"""The small operations of a bfloat16 decoder layer on the CPU, natively (kernels/cpu_ops.cpp): the
residual add with RMSNorm, the rotary embedding in place, and the SwiGLU gate, each one pass over its
rows where torch runs several operations (a bfloat16 RMSNorm alone is eight), with the rounding steps
of the torch code it replaces (workers/layers): the residual sum and the rotation are its bits; RMSNorm's
sum of squares and the gate's exponential are computed in another order than torch's, so a value may
round to the neighbouring bfloat16 (tests/kernels/test_cpu_ops.py). A row is computed by one thread in
one order, so its bits depend neither on the other rows nor on the thread count.

Built on first use like kernels.cpu's attention; where it cannot be (no compiler, no AVX-512 BF16),
or where TOKENBUS_CPU_LAYERS is `torch` (the reference path, for comparisons), `available()` is False
and the layers keep torch's operations.
"""
import ctypes
import os
import subprocess
from pathlib import Path

import structlog
import torch

from kernels import cpu

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = {"add_rms_norm_bf16": [P, P, P, P, P, I64, I64, F32, I32],
              "silu_mul_bf16": [P, P, I64, I64, I32],
              "rope_bf16": [P, P, P, I64, I64, I64, I64, I32],
              "argmax_bf16": [P, P, I64, I64, I32],
              "argmax_f32": [P, P, I64, I64, I32]}


def takes(x: torch.Tensor, width: int) -> bool:
    """Whether the kernels take x: bfloat16 on the CPU, rows of `width` a multiple of 16 (the vectors')
    elements, and the library here."""
    return x.dtype == torch.bfloat16 and not x.is_cuda and width % 16 == 0 and available()


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(s) · weight, s): s = x + residual (rounded to bfloat16), or x alone (s None then)."""
    x = x.contiguous()
    d = x.shape[-1]
    rows = x.numel() // d
    y = torch.empty_like(x)
    s = None
    if residual is not None:
        residual = residual.contiguous()
        s = torch.empty_like(x)
    library().add_rms_norm_bf16(x.data_ptr(), None if s is None else residual.data_ptr(), weight.data_ptr(),
                                y.data_ptr(), None if s is None else s.data_ptr(), rows, d, eps,
                                torch.get_num_threads())
    return y, s


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2n] = [gate | up] -> silu(gate) · up [..., n]."""
    x = x.contiguous()
    n = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    library().silu_mul_bf16(x.data_ptr(), y.data_ptr(), x.numel() // (2 * n), n, torch.get_num_threads())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (each head's row contiguous, heads D apart) rotated in place by the tables [T, 1, D]
    of workers.layers.rotary.RotaryEmbedding; returns x."""
    cos, sin = cos.contiguous(), sin.contiguous()
    library().rope_bf16(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
                        x.stride(0), torch.get_num_threads())
    return x


SWITCH = "TOKENBUS_CPU_LAYERS"   # `torch`: torch's operations and oneDNN's linears (kernels/bf16_linear.py)
def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] bfloat16 or float32 -> int64 [rows]: each row's first maximum (x.max(dim=-1).indices's rule,
    NaN the largest)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    entry = library().argmax_bf16 if x.dtype == torch.bfloat16 else library().argmax_f32
    entry(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


_library: ctypes.CDLL | None = None
_failed = False


def available() -> bool:
    """Whether the library builds and loads here (AVX-512 BF16 and a compiler); the reason is logged
    once when not."""
    global _failed
    if os.environ.get(SWITCH) == "torch":
        return False
    if _library is not None:
        return True
    if _failed:
        return False
    try:
        library()
        return True
    except (OSError, subprocess.CalledProcessError) as e:
        _failed = True
        structlog.get_logger().warning("native bfloat16 layer ops unavailable, using torch's",
                                       reason=str(e).strip()[-500:])
        return False


def library() -> ctypes.CDLL:
    global _library
    if _library is None:
        if "avx512_bf16" not in cpu.cpu_flags().split():
            raise OSError("the CPU has no AVX-512 BF16")
        lib = ctypes.CDLL(str(cpu.build(source=SOURCE)))
        for name, args in SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
        _library = lib
    return _library

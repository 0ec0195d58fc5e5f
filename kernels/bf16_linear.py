"""bfloat16 linear layers on the CPU's own bfloat16 instructions: Intel AMX (kernels/amx_linear.cpp)
where the CPU has amx_bf16, else AVX-512 BF16 (kernels/avx512_bf16_linear.cpp) where it has
avx512_bf16. Both take the weight in one packed layout (pack).

oneDNN's own kernels are fast but pick their blocking, and with several threads whether to split a
sum across threads, from the row count and the thread count, so a row's bits depend on both
(tests/workers/test_batch_invariance.py); held at a fixed row count they are invariant but compute
every padded row (a decode step of one request pays for 32). These kernels sum every output over
the inputs in one fixed order, whatever the rows and threads, and compute only the rows there are
(AMX: rounded up to 16). Built on first use, like kernels.cpu's attention; not used where
TOKENBUS_CPU_LAYERS is `torch` (kernels/cpu_ops.py: the reference path, oneDNN in fixed calls).
"""
import ctypes
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from kernels import cpu, cpu_ops

SOURCES = {"amx": Path(__file__).with_name("amx_linear.cpp"),
           "avx512_bf16": Path(__file__).with_name("avx512_bf16_linear.cpp")}
ROWS = {"amx": 16, "avx512_bf16": 1}   # each kernel's rows are padded to a multiple of this


class Linear(ctypes.Structure):
    """The kernels' arguments (struct Linear in both sources)."""
    _fields_ = [("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("m", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("f32", ctypes.c_int64)]


@dataclass(slots=True)
class Packed:
    """A weight [N, K] in the tiles' layout, N padded to 16 and K to 32 with zeros."""
    tiles: torch.Tensor          # bfloat16 [N / 16, K / 32, 16, 16, 2]
    n: int                       # the layer's outputs
    k: int                       # its inputs


def pack(weight: torch.Tensor) -> Packed:
    """Block (n, k) holds W[16n + c, 32k + 2r + i] at [r, c, i]: 16 pairs of inputs by 16 outputs. Read
    along a block of 16 outputs, input pair p's 16 x 2 values are 64 contiguous bytes, pairs in order:
    AMX's tile of B and one AVX-512 register of vdpbf16ps alike."""
    n, k = weight.shape
    w = F.pad(weight.detach().to(torch.bfloat16), (0, -k % 32, 0, -n % 16))
    tiles = w.view(w.shape[0] // 16, 16, w.shape[1] // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return Packed(tiles, n, k)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] bfloat16 -> [M, N] bfloat16, the bias added in float32 before the rounding, or (dtype
    float32) the float32 sums unrounded; rows padded (zeros) as the kernel needs and trimmed after."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"bf16_linear takes bfloat16 inputs, not {x.dtype}")
    name, lib = library()
    m, rows = x.shape[0], ROWS[name]
    if m % rows or packed.k % 32:
        x = F.pad(x, (0, -packed.k % 32, 0, -m % rows))
    x = x.contiguous()
    n = packed.tiles.shape[0] * 16
    if bias is not None:
        bias = F.pad(bias.float(), (0, n - packed.n))
    y = torch.empty(x.shape[0], n, dtype=dtype)
    args = Linear(x.data_ptr(), packed.tiles.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                  x.shape[0], n, x.shape[1], dtype == torch.float32)
    lib(ctypes.byref(args), torch.get_num_threads())
    return y[:m, :packed.n]


_library: tuple[str, ctypes._CFuncPtr] | None = None


def available() -> bool:
    """Whether the CPU has AMX or AVX-512 BF16 and the kernel for it builds and may be used; the
    reason is logged when it cannot."""
    if kernel() is None or os.environ.get(cpu_ops.SWITCH) == "torch":
        return False
    try:
        library()
        return True
    except (OSError, subprocess.CalledProcessError) as e:
        structlog.get_logger().warning("bfloat16 linear kernel unavailable, using oneDNN", kernel=kernel(),
                                       reason=str(e).strip()[-500:])
        return False


def kernel() -> str | None:
    """amx, avx512_bf16, or None: the instructions this CPU offers for a bfloat16 matmul."""
    capabilities = getattr(torch.cpu, "get_capabilities", dict)()
    flags = cpu.cpu_flags().split()
    if capabilities.get("amx_bf16") or "amx_bf16" in flags:
        return "amx"
    if capabilities.get("avx512_bf16") or "avx512_bf16" in flags:
        return "avx512_bf16"
    return None


def library() -> tuple[str, ctypes._CFuncPtr]:
    """The kernel's name and its entry point, built and loaded on first use."""
    global _library
    if _library is None:
        name = kernel()
        if name is None:
            raise OSError("the CPU has neither AMX nor AVX-512 BF16")
        lib = ctypes.CDLL(str(cpu.build(source=SOURCES[name])))
        entry = lib.amx_linear if name == "amx" else lib.bf16_linear
        entry.argtypes = [ctypes.POINTER(Linear), ctypes.c_int32]
        entry.restype = None
        if name == "amx" and lib.amx_init() != 0:
            raise OSError("the kernel may not use AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM refused)")
        _library = name, entry
    return _library

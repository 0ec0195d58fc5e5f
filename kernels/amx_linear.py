"""bfloat16 linear layers on Intel AMX (kernels/amx_linear.cpp), for CPUs with amx_bf16.

oneDNN's own AMX kernels are fast but pick their blocking, and with several threads whether to
split a sum across threads, from the row count and the thread count, so a row's bits depend on
both (tests/workers/test_batch_invariance.py). This kernel sums every output over the inputs in
one fixed order, whatever the rows and threads. Built on first use, like kernels.cpu's attention.
"""
import ctypes
import subprocess
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from kernels import cpu

SOURCE = Path(__file__).with_name("amx_linear.cpp")


class Linear(ctypes.Structure):
    """The kernel's arguments (struct Linear in amx_linear.cpp)."""
    _fields_ = [("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("m", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


@dataclass(slots=True)
class Packed:
    """A weight [N, K] in the tiles' layout, N padded to 16 and K to 32 with zeros."""
    tiles: torch.Tensor          # bfloat16 [N / 16, K / 32, 16, 16, 2]
    n: int                       # the layer's outputs
    k: int                       # its inputs


def pack(weight: torch.Tensor) -> Packed:
    """Block (n, k) holds W[16n + c, 32k + 2r + i] at [r, c, i]: 16 pairs of inputs by 16 outputs."""
    n, k = weight.shape
    w = F.pad(weight.detach().to(torch.bfloat16), (0, -k % 32, 0, -n % 16))
    tiles = w.view(w.shape[0] // 16, 16, w.shape[1] // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return Packed(tiles, n, k)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 -> [M, N] bfloat16, the bias added in float32 before the rounding; rows
    padded to 16 (zeros) and trimmed after."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"amx_linear takes bfloat16 inputs, not {x.dtype}")
    m = x.shape[0]
    if m % 16 or packed.k % 32:
        x = F.pad(x, (0, -packed.k % 32, 0, -m % 16))
    x = x.contiguous()
    n = packed.tiles.shape[0] * 16
    if bias is not None:
        bias = F.pad(bias.float(), (0, n - packed.n))
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    args = Linear(x.data_ptr(), packed.tiles.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                  x.shape[0], n, x.shape[1])
    library().amx_linear(ctypes.byref(args), torch.get_num_threads())
    return y[:m, :packed.n]


_library: ctypes.CDLL | None = None


def available() -> bool:
    """Whether the CPU has AMX for bfloat16 and the kernel builds and may use it; the reason is
    logged when it cannot."""
    if not amx_bf16():
        return False
    try:
        library()
        return True
    except (OSError, subprocess.CalledProcessError) as e:
        structlog.get_logger().warning("AMX linear unavailable, using oneDNN", reason=str(e).strip()[-500:])
        return False


def amx_bf16() -> bool:
    capabilities = getattr(torch.cpu, "get_capabilities", dict)()
    return bool(capabilities.get("amx_bf16")) if capabilities else "amx_bf16" in cpu.cpu_flags()


def library() -> ctypes.CDLL:
    global _library
    if _library is None:
        lib = ctypes.CDLL(str(cpu.build(source=SOURCE)))
        lib.amx_linear.argtypes = [ctypes.POINTER(Linear), ctypes.c_int32]
        lib.amx_linear.restype = None
        if lib.amx_init() != 0:
            raise OSError("the kernel may not use AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM refused)")
        _library = lib
    return _library

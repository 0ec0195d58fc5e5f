"""Paged attention for the CPU: a native kernel (kernels/cpu_attention.cpp) that reads the KV pool
in place, where the reference copies every sequence's blocks out of it each step. Same signatures
and semantics as kernels.reference (which it is tested against), float32 or bfloat16 queries and
pool, or a quantized pool (int8 or fp8 rows with their scale, see kernels.reference.quantize_kv)
under either query dtype, dequantized row by row as the kernel reads it; accumulating in float32;
and the same promise: a query's output is the same bits whatever else is in the batch, decode or
prefill, at any thread count.

The library is compiled with the system's C++ compiler on first use (about 3 s) and cached under
$TOKENBUS_HOME/kernels, keyed by the source, the flags, the compiler and the CPU; it runs on
torch's OpenMP threads (torch.get_num_threads()). Without a compiler, `available()` is False and
the engine keeps the reference (see workers.engine.runner.attention_kernels).
"""
import ctypes
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

import kernels.reference as reference

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
QUERY_TILE = 16    # prefill queries per work item
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16)
KV_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}  # a quantized pool's element -> struct Layer's kv

LAYER = struct.Struct("<9q4qd2q")  # struct Layer in cpu_attention.cpp: one layer's call
STEP = struct.Struct("<7q")       # struct Step: the step's batch, the same for every layer
STORE = struct.Struct("<16q")     # struct Store: store_kv's arguments


@dataclass(slots=True)
class Plan:
    """One step's batch as the kernel reads it, made once for all layers."""
    cu_seqlens_q: torch.Tensor   # int32, contiguous
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    items: torch.Tensor          # int32 [N, 3]: sequence, first query, query count; costliest first
    step: bytes = b""            # STEP: pointers to the above, and the (query, key) pairs at most

    def to(self, device: torch.device) -> "Plan":
        return self


def plan_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int, num_heads: int = 1, num_kv_heads: int = 1) -> Plan:
    """Work items: every sequence's queries in tiles of QUERY_TILE, the longest KV first, so that the
    threads taking them in turn end together. The head counts are the Triton plan's, unused here."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    items = []
    for b, end in enumerate(lens):
        first_pos = end - (cu[b + 1] - cu[b])
        for first in range(0, cu[b + 1] - cu[b], QUERY_TILE):
            count = min(QUERY_TILE, cu[b + 1] - cu[b] - first)
            items.append((-(first_pos + first + count) * count, b, first, count))
    items.sort()
    table = torch.tensor([item[1:] for item in items], dtype=torch.int32).reshape(-1, 3)
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    plan = Plan(i32(cu_seqlens_q), i32(seq_lens), i32(block_tables), table)
    plan.step = STEP.pack(plan.cu_seqlens_q.data_ptr(), plan.seq_lens.data_ptr(), plan.block_tables.data_ptr(),
                          plan.block_tables.stride(0), table.data_ptr(), len(table), -sum(i[0] for i in items))
    return plan


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, plan: Plan | None = None) -> torch.Tensor:
    """kernels.reference.unified_attention, natively: [T, Hq, D] in q's dtype. What the kernel does
    not take (other dtypes, q's unlike the pool's, head_dim over 256) goes to the reference."""
    if not supports(q, k_cache, v_cache):
        return reference.unified_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)
    if plan is None:
        plan = plan_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    out = torch.empty(q.shape, dtype=q.dtype)
    layer = LAYER.pack(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                       *k_cache.stride()[:3], out.data_ptr(), q.shape[1], k_cache.shape[2], q.shape[2],
                       k_cache.shape[1], scale, q.dtype == torch.bfloat16, KV_FORMATS.get(k_cache.dtype, 0))
    if library().paged_attention(layer, plan.step, torch.get_num_threads()) != 0:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads over {k_cache.shape[2]} KV heads of "
                         f"{q.shape[2]} is not a shape it takes")
    return out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kernels.reference.store_kv: token t's K/V [T, Hkv, D] into slot slot_mapping[t]; -1 skipped. Into
    a quantized pool, the rows are quantized first (the reference's torch code), then copied as bytes."""
    if reference.quantized(k_cache) and key.shape[0]:
        key, value = reference.quantize_kv(key, k_cache.dtype), reference.quantize_kv(value, v_cache.dtype)
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype and key.stride(2) == value.stride(2) == 1
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and not key.is_cuda):
        store = reference.store_rows if key.dtype == k_cache.dtype else reference.store_kv  # quantized already
        return store(key, value, k_cache, v_cache, slot_mapping)
    size = key.element_size()
    library().store_kv(STORE.pack(key.data_ptr(), value.data_ptr(), key.stride(0) * size, key.stride(1) * size,
                                  value.stride(0) * size, value.stride(1) * size, k_cache.data_ptr(),
                                  v_cache.data_ptr(), *(n * size for n in k_cache.stride()[:3]),
                                  slot_mapping.data_ptr(), key.shape[0], key.shape[1], key.shape[2] * size,
                                  k_cache.shape[1]))


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.dtype in DTYPES and k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, *KV_FORMATS)
            and q.shape[2] <= MAX_HEAD_DIM
            and q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
            and not q.is_cuda)


# -- the library: built once per machine, loaded once per process -----------------------------------

_library: ctypes.CDLL | None = None


def available() -> bool:
    """Whether the native kernel can run here (building it on first call); False with the reason
    logged when no compiler is found or the build fails."""
    try:
        library()
        return True
    except (OSError, subprocess.CalledProcessError) as e:  # no compiler, a failed build, an unloadable library
        structlog.get_logger().warning("native CPU attention unavailable, using the reference",
                                       reason=str(e).strip()[-500:])
        return False


def library() -> ctypes.CDLL:
    global _library
    if _library is None:
        lib = ctypes.CDLL(str(build()))
        lib.paged_attention.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32]
        lib.paged_attention.restype = ctypes.c_int
        lib.store_kv.argtypes = [ctypes.c_char_p]
        lib.store_kv.restype = None
        _library = lib
    return _library


def build(flags: list[str] = FLAGS, source: Path = SOURCE) -> Path:
    """The cached library of `source`, compiled first if needed: into a temporary file renamed into
    place, so that processes starting together each find either no file or a whole one."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++ or c++) on PATH, nor CXX set")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([source.read_text(), *flags, compiler, version, cpu_flags()]).encode())
    home = Path(os.environ.get("TOKENBUS_HOME") or Path.home() / ".cache" / "tokenbus")  # kernels import no workers
    final = home / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=final.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, final)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return final


def cpu_flags() -> str:
    """What -march=native compiles for: a library built on one CPU is not loaded on another."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()

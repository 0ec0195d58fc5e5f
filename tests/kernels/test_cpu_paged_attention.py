"""kernels.cpu, the native paged attention, against kernels.reference on random paged inputs (decodes
and prefill chunks mixed, GQA, scattered blocks, lengths off the block size, float32 and bfloat16);
its batch invariance (a query's bits alone, beside any other queries, as a decode or in a prefill
chunk, at 1, 2 or 3 threads); its build (cached, concurrent, portable) and the fallback without a
compiler."""
import ctypes
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import structlog.testing
import torch

import kernels.cpu as cpu
import kernels.reference as reference
from tests.workers.engine_helpers import threads
from workers.engine.runner import attention_kernels

# decodes, short chunks after cached tokens, a whole prefill, chunks crossing query tiles and KV
# tiles, lengths off the block size
Q_LENS = [1, 37, 1, 100, 1, 5, 1, 20]
KV_LENS = [7, 60, 1, 100, 300, 21, 33, 260]


class Pool:
    """Sequences' KV laid out as the engine has it: one layer's views of a [2, layers, blocks,
    block_size, Hkv, D] pool, every sequence's blocks shuffled over it; and a query for each of
    their positions, so that any batch of their queries can be formed."""
    def __init__(self, seed: int, lens: list[int], heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                 block_size: int = 16, dtype: torch.dtype = torch.float32):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        counts = [math.ceil(n / block_size) for n in lens]
        num_blocks = sum(counts) + 5
        pool = torch.randn(2, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        self.k, self.v = pool[0, 1], pool[1, 1]
        ids = rng.sample(range(num_blocks), num_blocks)
        tables, used = [], 0
        for count in counts:
            tables.append(ids[used:used + count] + [0] * (max(counts) - count))
            used += count
        self.tables = torch.tensor(tables, dtype=torch.int32)
        self.queries = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in lens]
        self.kv_heads = kv_heads

    def batch(self, parts: list[tuple[int, int, int]]):
        """Kernel arguments for the queries of (sequence, first position, count) of each part; q is
        a view beside the keys, as the model's projection gives it."""
        q_lens = [count for _, _, count in parts]
        rows = torch.cat([self.queries[s][first:first + count] for s, first, count in parts])
        qk = torch.zeros(len(rows), rows.shape[1] + self.kv_heads, rows.shape[2], dtype=rows.dtype)
        qk[:, :rows.shape[1]] = rows
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([first + count for _, first, count in parts], dtype=torch.int32)
        return qk[:, :rows.shape[1]], self.k, self.v, cu, lens, self.tables[[s for s, _, _ in parts]]


def paged_batch(seed: int, q_lens: list[int], kv_lens: list[int], *shape, dtype: torch.dtype = torch.float32):
    """Each sequence's last q_lens[b] queries of kv_lens[b] positions, in one batch."""
    pool = Pool(seed, kv_lens, *shape, dtype=dtype)
    return pool.batch([(b, n - q, q) for b, (q, n) in enumerate(zip(q_lens, kv_lens))])


def attention(args, scale: float = 0.125) -> torch.Tensor:
    return cpu.unified_attention(*args, scale=scale)


# -- equal to the reference --------------------------------------------------------------------------

SHAPES = [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 40, 5), (6, 2, 80, 7), (2, 1, 8, 16)]  # Hq, Hkv, D, block size


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("seed", range(2))
def test_float32_attention_equals_the_reference(heads, kv_heads, head_dim, block_size, seed):
    args = paged_batch(seed, Q_LENS, KV_LENS, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    torch.testing.assert_close(attention(args, scale), reference.unified_attention(*args, scale=scale),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_bfloat16_attention_is_within_one_rounding_of_the_reference(heads, kv_heads, head_dim, block_size):
    # both accumulate in float32 and round once to bfloat16 (8 significant bits): at most one step apart
    args = paged_batch(3, Q_LENS, KV_LENS, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16)
    got, want = attention(args), reference.unified_attention(*args, scale=0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-5)
    assert (got != want).float().mean() < 0.05


def test_many_decodes_and_a_long_prefill_in_one_batch_equal_the_reference():
    rng = random.Random(4)
    q_lens, kv_lens = [1] * 40 + [512], [rng.randint(200, 500) for _ in range(40)] + [700]
    args = paged_batch(4, q_lens, kv_lens)
    torch.testing.assert_close(attention(args), reference.unified_attention(*args, scale=0.125),
                               rtol=1e-5, atol=1e-5)


def test_query_heads_that_do_not_divide_among_the_kv_heads_are_an_error_naming_both():
    args = paged_batch(0, [1, 3], [5, 9], 5, 2, 16)
    with pytest.raises(ValueError, match="5 query heads over 2 KV heads"):
        attention(args)


# -- batch invariance ------------------------------------------------------------------------------

LENS = [300, *random.Random(0).choices(range(1, 400), k=10), 80, 310]  # the target first


def around(target: tuple[int, int, int], seed: int) -> tuple[list[tuple[int, int, int]], int]:
    """A batch of decodes and prefill chunks of the other sequences with the target part at a random
    place; returns (parts, the target's first row)."""
    rng = random.Random(seed)
    parts = [(s, n - 1, 1) for s, n in enumerate(LENS[:-2]) if s] + [(11, 30, 50), (12, 293, 17)]
    rng.shuffle(parts)
    at = rng.randint(0, len(parts))
    return parts[:at] + [target] + parts[at:], sum(count for _, _, count in parts[:at])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_bits_are_the_same_alone_in_any_batch_and_at_1_2_or_3_threads(dtype):
    pool = Pool(0, LENS, dtype=dtype)
    parts, first = around((0, 210, 90), 0)   # the target's positions 210-299 as one chunk
    with threads(2):
        batch = attention(pool.batch(parts))[first:first + 90]
    for n in (1, 3):
        with threads(n):
            assert torch.equal(attention(pool.batch(parts))[first:first + 90], batch), n
    parts, first = around((0, 210, 90), 1)   # other neighbours, another place
    assert torch.equal(attention(pool.batch(parts))[first:first + 90], batch)
    for i in (0, 1, 15, 16, 45, 46, 47, 70, 89):  # each query as the only decode of a batch (a query
        # tile ends after 15, a KV tile at position 255 = 210 + 45)
        for n in (1, 2):
            with threads(n):
                assert torch.equal(attention(pool.batch([(0, 210 + i, 1)]))[0], batch[i]), (i, n)


def test_a_querys_bits_do_not_depend_on_how_its_prefill_is_chunked():
    pool = Pool(2, LENS)
    whole = attention(pool.batch([(0, 0, 300)]))
    for cut in (1, 17, 60, 255):  # two chunks, in two calls, each among other sequences
        parts, first = around((0, 0, cut), cut)
        head = attention(pool.batch(parts))[first:first + cut]
        parts, first = around((0, cut, 300 - cut), cut + 1)
        tail = attention(pool.batch(parts))[first:first + 300 - cut]
        assert torch.equal(torch.cat([head, tail]), whole), cut


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_the_reference_writes_from_strided_rows_and_skips_padding(dtype):
    pools = [torch.zeros(2, 3, 40, 16, 3, 64, dtype=dtype) for _ in range(2)]
    qkv = torch.randn(50, 15, 64).to(dtype)   # keys and values are views beside the queries, as the model's
    slots = torch.randperm(640)[:50]
    slots[[3, 17]] = -1
    for pool, store in zip(pools, (reference.store_kv, cpu.store_kv)):
        store(qkv[:, 9:12], qkv[:, 12:15], pool[0, 1], pool[1, 1], slots)
    assert torch.equal(pools[1], pools[0])
    assert torch.count_nonzero(pools[1][:, 1]) == 2 * 48 * 3 * 64


# -- the build and the engine's choice ---------------------------------------------------------------

def test_a_build_without_avx512_equals_the_reference_and_is_batch_invariant(monkeypatch):
    # the portable path (GCC's vector types lowered to AVX2 or SSE) that CPUs without AVX-512 run
    build = cpu.build
    monkeypatch.setattr(cpu, "_library", None)
    monkeypatch.setattr(cpu, "build", lambda flags=cpu.FLAGS: build(flags + ["-mno-avx512f"]))
    args = paged_batch(5, Q_LENS, KV_LENS)
    got = attention(args)
    torch.testing.assert_close(got, reference.unified_attention(*args, scale=0.125), rtol=1e-5, atol=1e-5)
    with threads(1):
        assert torch.equal(attention(args), got)


def test_without_a_compiler_the_engine_falls_back_to_the_reference_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "_library", None)
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with structlog.testing.capture_logs() as logs:  # whatever stream an earlier test configured structlog with
        assert attention_kernels(torch.device("cpu")) is reference
    assert [e["event"] for e in logs] == ["native CPU attention unavailable, using the reference"]


def test_the_engine_takes_the_native_kernel_on_cpu_unless_told_to_take_the_reference(monkeypatch):
    assert attention_kernels(torch.device("cpu")) is cpu
    monkeypatch.setenv("TOKENBUS_CPU_ATTENTION", "reference")
    assert attention_kernels(torch.device("cpu")) is reference


@pytest.mark.slow
def test_two_processes_building_at_once_both_load_one_whole_library(tmp_path):
    code = "import kernels.cpu as c; c.library(); print(c.build())"
    env = {**os.environ, "TOKENBUS_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    paths = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert paths[0] == paths[1]
    assert [f.name for f in (tmp_path / "kernels").iterdir()] == [Path(paths[0]).name]  # no temp file left
    ctypes.CDLL(paths[0])

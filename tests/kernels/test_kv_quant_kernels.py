"""The quantized KV cache's kernels (kernels.reference.quantize_kv and the kernels that take an int8 or
fp8 pool): round trips within each format's bound, a row's bytes its own, store_kv writing the same
bytes in every backend, and paged attention over a quantized pool equal to the reference's over the
dequantized values: the native CPU kernel (batch-invariant too) and Triton (interpreted on CPU)."""
import pytest
import torch

import kernels.cpu as cpu
import kernels.reference as ref
from tests.kernels.device import DEVICE, on_device
from tests.kernels.test_cpu_paged_attention import LENS, Pool, around, paged_batch
from tests.workers.engine_helpers import threads

FORMATS = [torch.int8, torch.float8_e4m3fn]
Q_LENS, KV_LENS = [1, 37, 1, 20, 5], [7, 60, 100, 40, 21]


def rows(seed: int, shape=(50, 3, 64)) -> torch.Tensor:
    """K/V-like rows: most values small, a few outliers, magnitudes varying by 10^4 from row to row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-2, 2, shape[0]).view(-1, *[1] * (len(shape) - 1))
    x[::7, ..., 3] *= 20
    return x


@pytest.mark.parametrize("dtype", FORMATS)
def test_a_round_trip_is_within_the_formats_bound_and_never_clips(dtype):
    x = rows(0)
    q = ref.quantize_kv(x, dtype)
    assert q.dtype == dtype and q.shape == (50, 3, 66)
    y = ref.dequantize_kv(q)
    scale = ref.dequantize_kv(torch.cat([torch.ones(*x.shape[:2], 1).to(dtype), q[..., -2:]], -1))  # the scale
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all(scale * ref.QMAX[dtype] >= amax) and torch.all(scale * ref.QMAX[dtype] <= amax * (1 + 2 ** -7))
    err = (y - x).abs()
    if dtype == torch.int8:   # half a step of the scale: at most amax / 254, and a little for the scale's rounding
        assert torch.all(err <= scale / 2)
        assert float((err / amax).max()) < 0.004
    else:   # e4m3: 3 mantissa bits, so half an ulp is 2^-4 of the value; subnormals 2^-10 of the scale
        assert torch.all(err <= torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10))


@pytest.mark.parametrize("dtype", FORMATS)
def test_a_rows_bytes_depend_on_that_row_alone_and_a_zero_row_stays_zero(dtype):
    x = rows(1).bfloat16()
    batch = ref.quantize_kv(x, dtype).view(torch.uint8)
    for t in (0, 13, 49):
        assert torch.equal(ref.quantize_kv(x[t:t + 1], dtype).view(torch.uint8)[0], batch[t])
    zero = ref.quantize_kv(torch.zeros(2, 64), dtype)
    assert torch.equal(ref.dequantize_kv(zero), torch.zeros(2, 64))


@pytest.mark.parametrize("dtype", FORMATS)
def test_store_kv_writes_the_same_bytes_in_every_backend_and_skips_padding(dtype):
    qkv = rows(2, (40, 15, 64))
    slots = torch.randperm(40 * 16)[:40]
    slots[[3, 17]] = -1
    stores = [ref.store_kv, cpu.store_kv]
    try:
        import kernels.triton as tri
        stores.append(tri.store_kv)   # on DEVICE: interpreted on the CPU, natively on a GPU
    except ImportError:
        pass
    pools = []
    for store in stores:
        to = DEVICE if store not in (ref.store_kv, cpu.store_kv) else torch.device("cpu")
        pool = torch.zeros(2, 2, 40, 16, 3, 66, dtype=dtype, device=to)
        store(qkv[:, 9:12].to(to), qkv[:, 12:15].to(to), pool[0, 1], pool[1, 1], slots.to(to))
        pools.append(pool.cpu().view(torch.uint8))
    for pool in pools[1:]:
        assert torch.equal(pool, pools[0])
    kept = slots >= 0
    written = pools[0].view(dtype)[0, 1].view(-1, 3, 66)[slots[kept]]
    assert torch.equal(written.view(torch.uint8), ref.quantize_kv(qkv[kept, 9:12], dtype).view(torch.uint8))
    assert torch.count_nonzero(pools[0][:, 0]) == 0


def quantized_batch(seed: int, dtype: torch.dtype, q_dtype=torch.float32, heads=9, kv_heads=3, head_dim=64,
                    block_size=16):
    """paged_batch's arguments with the pool quantized to `dtype`, and the same with the dequantized
    float32 pool (what the reference attends to)."""
    q, k, v, cu, lens, tables = paged_batch(seed, Q_LENS, KV_LENS, heads, kv_heads, head_dim, block_size)
    kq, vq = ref.quantize_kv(k, dtype), ref.quantize_kv(v, dtype)
    return (q.to(q_dtype), kq, vq, cu, lens, tables), (q.to(q_dtype).float(), ref.dequantize_kv(kq),
                                                       ref.dequantize_kv(vq), cu, lens, tables)


@pytest.mark.parametrize("dtype", FORMATS)
def test_the_reference_over_a_quantized_pool_is_the_reference_over_its_dequantized_values(dtype):
    quant, plain = quantized_batch(0, dtype)
    assert torch.equal(ref.unified_attention(*quant, scale=0.125), ref.unified_attention(*plain, scale=0.125))


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 1, 40, 5), (8, 8, 128, 16)])
def test_the_cpu_kernel_over_a_quantized_pool_equals_the_reference_on_the_dequantized_values(
        dtype, heads, kv_heads, head_dim, block_size):
    quant, plain = quantized_batch(1, dtype, torch.float32, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    torch.testing.assert_close(cpu.unified_attention(*quant, scale=scale),
                               ref.unified_attention(*plain, scale=scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", FORMATS)
def test_the_cpu_kernel_takes_bfloat16_queries_over_a_quantized_pool(dtype):
    quant, plain = quantized_batch(2, dtype, torch.bfloat16)
    got = cpu.unified_attention(*quant, scale=0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.unified_attention(*plain, scale=0.125), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype", FORMATS)
def test_the_cpu_kernel_over_a_quantized_pool_is_batch_invariant(dtype):
    pool = Pool(0, LENS)
    pool.k, pool.v = ref.quantize_kv(pool.k, dtype), ref.quantize_kv(pool.v, dtype)
    parts, first = around((0, 210, 90), 0)
    with threads(2):
        batch = cpu.unified_attention(*pool.batch(parts), scale=0.125)[first:first + 90]
    parts, first = around((0, 210, 90), 1)
    with threads(1):
        assert torch.equal(cpu.unified_attention(*pool.batch(parts), scale=0.125)[first:first + 90], batch)
    for i in (0, 45, 89):
        assert torch.equal(cpu.unified_attention(*pool.batch([(0, 210 + i, 1)]), scale=0.125)[0], batch[i]), i


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("hq, hkv, d, block_size", [(4, 2, 32, 8), (2, 1, 40, 16)])
def test_the_triton_kernel_over_a_quantized_pool_equals_the_reference_on_the_dequantized_values(
        dtype, hq, hkv, d, block_size):
    tri = pytest.importorskip("kernels.triton")
    g = torch.Generator().manual_seed(hq + d)
    q_lens, seq_lens = [1, 5, 19, 1], [37, 21, 19, 8]
    need = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(sum(need) + 3, generator=g)
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[used:used + n]
        used += n
    k = ref.quantize_kv(rows(hq, (len(ids), block_size, hkv, d)) / 10, dtype)
    v = ref.quantize_kv(torch.randn(len(ids), block_size, hkv, d, generator=g), dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = ref.unified_attention(q, ref.dequantize_kv(k), ref.dequantize_kv(v), cu, lens, tables, 0.125)
    plan = tri.plan_attention(cu, lens, tables, block_size, hq, hkv)
    got = on_device(tri.unified_attention, q, k, v, cu, lens, tables, 0.125, plan.to(DEVICE))
    torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_the_engines_greedy_tokens_over_a_quantized_pool_are_the_same_on_triton_and_the_reference(tiny_model, kv):
    pytest.importorskip("kernels.triton")
    import kernels.triton as tri
    from lab.benchmarks.kernels import use_kernels
    from schemas.sampling import SamplingParams
    from workers.engine.engine import EngineConfig, LLMEngine

    def greedy(backend) -> list[list[int]]:
        engine = LLMEngine(tiny_model, EngineConfig(device=DEVICE.type, dtype="float32", block_size=8,
                                                    num_kv_blocks=32, max_num_batched_tokens=16, kv_cache_dtype=kv))
        use_kernels(engine, backend)
        reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
                for i, p in enumerate([list(range(5, 22)), [30, 31, 32]])]
        while engine.has_unfinished():   # chunked prefill, then mixed prefill and decode steps
            engine.step()
        return [r.output_token_ids for r in reqs]

    assert greedy(tri) == greedy(ref)

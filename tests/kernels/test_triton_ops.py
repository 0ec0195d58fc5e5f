"""The fused Triton ops equal their references (under the interpreter on CPU, natively on CUDA), and
the references equal the model's own layers (so either backend computes the same model)."""
import pytest
import torch

pytest.importorskip("triton")

import kernels.reference as ref
import kernels.triton as tri
from tests.kernels.device import on_device
from workers.layers.activation import silu_and_mul as layer_silu_and_mul
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rotate

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("hidden", [64, 96, 320])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference_and_the_layer(hidden, with_residual):
    x, residual, weight = randn(7, hidden), randn(7, hidden, seed=1), randn(hidden, seed=2)
    layer = RMSNorm(hidden, 1e-5)
    layer.weight.data.copy_(weight)
    args = (x, weight, 1e-5, residual) if with_residual else (x, weight, 1e-5)
    want = ref.rms_norm(*args)
    got = on_device(tri.rms_norm, *args)
    by_layer = layer(x, residual) if with_residual else layer(x)
    for w, g, lay in zip(*(v if with_residual else (v,) for v in (want, got, by_layer))):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(w, lay)


def test_rms_norm_in_half_precision():
    x, residual, weight = randn(5, 96, dtype=torch.float16), randn(5, 96, dtype=torch.float16, seed=1), randn(96)
    want, got = ref.rms_norm(x, weight, 1e-6, residual), on_device(tri.rms_norm, x, weight, 1e-6, residual)
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("heads, d", [(4, 32), (2, 64), (1, 128)])
def test_rotary_matches_the_reference_and_the_layer_at_scattered_positions(scaling, heads, d):
    tables = RotaryEmbedding(d, 512, 500000.0, scaling)
    positions = torch.tensor([0, 3, 511, 64, 65, 200])
    full = tables(positions, torch.float32)
    cos, sin = full[0][..., :d // 2], full[1][..., d // 2:]  # the kernels' half tables
    x = randn(len(positions), heads, d, seed=d)
    want = ref.rotary(x, cos, sin)
    torch.testing.assert_close(on_device(tri.rotary, x, cos, sin), want)
    torch.testing.assert_close(want, rotate(x, *full))


@pytest.mark.parametrize("inter", [64, 96, 1500])
def test_silu_and_mul_matches_the_reference_and_the_layer(inter):
    x = randn(5, 2 * inter)
    want = ref.silu_and_mul(x)
    torch.testing.assert_close(on_device(tri.silu_and_mul, x), want)
    torch.testing.assert_close(want, layer_silu_and_mul(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, main() runs the whole benchmark")
def test_the_kernel_benchmark_says_it_needs_cuda_and_exits_cleanly_without(capsys):
    from lab.benchmarks.kernels import main, peak

    main([])
    assert "no CUDA device" in capsys.readouterr().out
    assert peak("NVIDIA H100 80GB HBM3") == 3350 and peak("NVIDIA H200") == 4800 and peak("unknown") is None

"""The bfloat16 linear of the CPU's own instructions (AMX, else AVX-512 BF16) equals float32 arithmetic
on the same bfloat16 numbers up to the output's rounding, with and without a bias, at shapes that need
padding (outputs not a multiple of 16, inputs not of 32, rows not of 16); its batch invariance is
tested with the others in tests/workers/test_batch_invariance.py."""
import pytest
import torch

from kernels import bf16_linear

pytestmark = pytest.mark.skipif(not bf16_linear.available(), reason="the CPU has neither AMX nor AVX-512 BF16")


@pytest.mark.parametrize("rows, inputs, outputs", [(1, 576, 960), (64, 1536, 576), (150, 256, 704),
                                                   (33, 100, 37), (17, 64, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_bf16_linear_equals_float32_arithmetic_up_to_the_bf16_rounding_of_its_output(rows, inputs, outputs,
                                                                                      with_bias):
    gen = torch.Generator().manual_seed(rows + inputs)
    weight = (torch.randn(outputs, inputs, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, inputs, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16() if with_bias else None
    got = bf16_linear.linear(x, bf16_linear.pack(weight), bias)
    want = x.float() @ weight.float().t() + (bias.float() if with_bias else 0)
    assert got.shape == (rows, outputs) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-5)   # bf16: 8 significant bits


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_float32_outputs_are_the_sums_unrounded_and_round_to_the_bf16_outputs(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(49152 // 16, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    packed = bf16_linear.pack(weight)
    got = bf16_linear.linear(x, packed, dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ weight.float().t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.bfloat16(), bf16_linear.linear(x, packed))

"""The native bfloat16 layer ops (kernels/cpu_ops.py) against the torch code they replace in
workers/layers: the residual sum and the rotation bit for bit; RMSNorm and the SwiGLU gate, whose sums
and exponentials are computed in another order, within one bfloat16 rounding and nearly always the
same bits; and a row's bits alone are its bits in any batch and at any thread count."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from tests.workers.test_batch_invariance import threads
from workers.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no AVX-512 BF16 (or no compiler) here")


def near(got: torch.Tensor, want: torch.Tensor) -> None:
    """At most one bfloat16 step apart (float32 values a few ulps apart rounding either side of a tie),
    and such elements rare."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    assert (got != want).float().mean() < 0.01


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@pytest.mark.parametrize("rows, width", [(1, 576), (37, 576), (300, 2048), (5, 64)])
def test_add_rms_norm_is_torchs_add_then_rms_norm(rows, width):
    x, residual, weight = randn(rows, width, seed=1, scale=3), randn(rows, width, seed=2), randn(width, seed=3)
    y, s = cpu_ops.add_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(s, x + residual)
    near(y, F.rms_norm(x + residual, (width,), weight, 1e-5))
    alone, none = cpu_ops.add_rms_norm(x, weight, 1e-6)
    assert none is None
    near(alone, F.rms_norm(x, (width,), weight, 1e-6))
    heads = x.view(rows, -1, 16)[:, ::2]                    # a strided 3-d view, as q_norm's per-head rows
    near(cpu_ops.add_rms_norm(heads, weight[:16], 1e-5)[0], F.rms_norm(heads, (16,), weight[:16], 1e-5))


@pytest.mark.parametrize("rows, width", [(1, 1536), (64, 1536), (300, 256)])
def test_silu_mul_is_the_layers_torch_steps(rows, width):
    x = randn(rows, 2 * width, seed=rows, scale=4)
    gate, up = x.float().chunk(2, dim=-1)
    want = (gate / (1 + torch.exp(-gate))).bfloat16() * up.bfloat16()
    near(cpu_ops.silu_mul(x), want)


def test_rope_in_place_is_the_layers_rotation_bit_for_bit_on_a_strided_view():
    rope = RotaryEmbedding(64, 4096, 100000.0, None)
    positions = torch.randint(0, 4000, (41,), generator=torch.Generator().manual_seed(0))
    cos, sin = rope(positions, torch.bfloat16)
    qkv = randn(41, 15 * 64, seed=4)
    qk = qkv[:, :12 * 64].view(-1, 12, 64)                  # q and k heads of a qkv projection's rows
    want = qk * cos + qk.roll(32, dims=-1) * sin
    v = qkv[:, 12 * 64:].clone()
    assert cpu_ops.rope(qk, cos, sin) is qk and torch.equal(qk, want)
    assert torch.equal(qkv[:, 12 * 64:], v)                 # the rest of the row untouched


def test_a_rows_bits_are_the_same_alone_in_any_batch_and_at_1_2_or_3_threads():
    x, residual, weight = randn(257, 576, seed=5, scale=3), randn(257, 576, seed=6), randn(576, seed=7)
    gate_up = randn(257, 3072, seed=8, scale=4)             # 257 x 1536: past the size that takes threads
    with threads(2):
        norm, _ = cpu_ops.add_rms_norm(x, weight, 1e-5, residual)
        silu = cpu_ops.silu_mul(gate_up)
        alone = [cpu_ops.add_rms_norm(x[i:i + 1], weight, 1e-5, residual[i:i + 1])[0] for i in range(0, 257, 16)]
        silu_alone = [cpu_ops.silu_mul(gate_up[i:i + 1]) for i in range(0, 257, 16)]
    assert torch.equal(torch.cat(alone), norm[::16]) and torch.equal(torch.cat(silu_alone), silu[::16])
    for count in (1, 3):
        with threads(count):
            assert torch.equal(cpu_ops.add_rms_norm(x, weight, 1e-5, residual)[0], norm)
            assert torch.equal(cpu_ops.silu_mul(gate_up), silu)


def test_argmax_is_torchs_first_maximum_with_ties_infinities_and_nans():
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        n = int(torch.randint(1, 300, (1,), generator=gen))
        x = torch.randint(-3, 3, (5, n), generator=gen).bfloat16()          # many ties
        assert torch.equal(cpu_ops.argmax(x), x.max(dim=-1).indices), (seed, n)
        assert torch.equal(cpu_ops.argmax(x.float()), x.max(dim=-1).indices), (seed, n)
    x = torch.full((4, 48), float("-inf")).bfloat16()                       # a grammar's mask: all but a few
    x[1, 47], x[2, 20], x[2, 30], x[3, 9], x[3, 33] = 0, float("nan"), float("nan"), float("inf"), float("inf")
    assert cpu_ops.argmax(x).tolist() == cpu_ops.argmax(x.float()).tolist() == x.max(dim=-1).indices.tolist() \
        == [0, 47, 20, 9]
    logits = randn(64, 49152, seed=9, scale=5)
    assert torch.equal(cpu_ops.argmax(logits), logits.max(dim=-1).indices)
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(10)) * 5      # float32: the lm_head's
    assert torch.equal(cpu_ops.argmax(logits), logits.max(dim=-1).indices)

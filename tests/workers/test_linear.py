"""The CPU linear path: oneDNN-prepacked weights, active on every projection, matching F.linear and
giving each row the same result whatever other rows share the batch."""
import torch
import torch.nn.functional as F

from tests.workers.checkpoints import make_checkpoint
from workers.distributed import SINGLE
from workers.engine.engine import EngineConfig, LLMEngine
from workers.layers.linear import ColumnParallelLinear, prepack_for_cpu


def test_every_projection_and_the_lm_head_are_prepacked_on_cpu(tmp_path):
    engine = LLMEngine(str(make_checkpoint(tmp_path, "qwen3")), EngineConfig(num_kv_blocks=8, device="cpu"))
    layers = [m for m in engine.runner.model.modules() if hasattr(m, "packed_weight")]
    assert len(layers) == 2 * 2 + 2 * 2 + 1   # qkv, o, gate_up, down per layer, and the LM head
    assert all(m.packed_weight is not None for m in layers)


def test_a_prepacked_linear_matches_f_linear_and_is_batch_invariant():
    torch.manual_seed(0)
    layer = ColumnParallelLinear.split(256, 1408, True, SINGLE)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(64, 256)
    plain = F.linear(x, layer.weight, layer.bias)
    assert prepack_for_cpu(layer)
    packed = layer(x)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-4)
    for n in (1, 5, 17, 63):
        assert torch.equal(layer(x[:n]), packed[:n])

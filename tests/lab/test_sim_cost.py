"""The simulator's step costs: the GPU roofline on a tiny config worked by hand (a decode reads its
bytes, a long prefill computes its FLOPs), and the CPU cost fitted to the real engine on this machine,
judged on steps it was not fitted to, cached and read back."""
import json
from pathlib import Path

import pytest
import torch

from lab.capacity import cost as sim_cost
from lab.capacity.cost import FittedCost, RooflineCost, StepShape
from ops import plan
from workers.engine.engine import pick_dtype
from workers.models.config import ModelConfig

TINY = ModelConfig.from_hf(plan.hf(vocab=100, hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1,
                                   context=64, tie=True))
TOY = plan.Gpu("toy", memory=1e6, bandwidth=1e6, flops=1e7)
UNIT = plan.Efficiency(mfu=1.0, mbu=1.0, memory_utilization=1.0)


def roofline() -> RooflineCost:
    return RooflineCost(plan.Plan(TINY, TOY, 1, plan.Workload(), UNIT))


def test_a_decode_step_reads_the_weights_and_every_request_s_kv():
    shape = StepShape()
    for _ in range(4):
        shape.add(1, 10, 1)                      # one new token each, 10 tokens of context after the step
    assert (shape.tokens, shape.rows, shape.sampled, shape.attention, shape.kv_read) == (4, 4, 4, 40, 40)
    # bytes: weights 2 × 1992, KV 32 bytes a token (K and V, 2 layers, 1 head of 4, 2 bytes) for 40 read + 4 written
    # FLOPs: 2 × 1152 × 4 tokens + 4 × 2 layers × 2 heads × 4 × 40 pairs + 2 × 8 × 100 × 4 samples = 18176: 1.8 ms
    assert roofline().seconds(shape) == pytest.approx((3984 + 32 * 44) / 1e6)       # 5.4 ms: bandwidth-bound


def test_a_long_prefill_computes_its_flops():
    shape = StepShape()
    shape.add(60, 60, 1)                         # a 60-token prompt: each token sees itself and those before
    assert shape.attention == 60 * 30.5
    flops = 2 * 1152 * 60 + 64 * 1830 + 2 * 8 * 100
    assert roofline().seconds(shape) == pytest.approx(flops / 1e7)                  # 25.7 ms > 7.8 ms of bytes


def test_the_fit_recovers_a_linear_cost_and_ignores_a_step_a_neighbour_slowed():
    truth = FittedCost("truth", 1e-3, {"tokens": 2e-5, "rows": 1e-5, "sampled": 0.0, "attention": 1e-8,
                                       "kv_read": 3e-7}, {})
    shapes = []
    for tokens, rows, context in [(1, 1, 50), (8, 8, 400), (64, 64, 3000), (512, 1, 512), (2048, 4, 4096),
                                  (300, 10, 1200), (16, 16, 160), (1024, 2, 1100)] * 4:
        s = StepShape(tokens, rows, min(rows, 3), tokens * context / rows, context * rows)
        shapes.append((s, truth.seconds(s) * (3.0 if len(shapes) == 3 else 1.0)))   # one step a neighbour slowed
    cost = sim_cost.fit("fit", shapes)
    assert cost.const == pytest.approx(1e-3, rel=1e-3) and cost.coef["tokens"] == pytest.approx(2e-5, rel=1e-3)
    assert min(cost.coef.values()) >= 0 and cost.quality["median_rel_error"] < 1e-3


def test_the_fit_gives_steps_of_few_tokens_seconds_of_their_own():
    """A CPU's matrix kernels change with the rows they multiply: here 1- and 2-token steps take 20 and 15 ms
    more than the sums say and 4- to 6-token ones 7 ms less (as SmolLM2's decode did on one machine)."""
    own = [0.02, 0.015, 0.0, -0.007, -0.007, -0.007]
    truth = FittedCost("truth", 0.035, {"tokens": 2e-3, "rows": 0.0, "sampled": 0.0, "attention": 1.5e-6,
                                        "kv_read": 3e-6}, {}, own + [0.0] * 10)
    shapes = [StepShape(rows, rows, rows, rows * context, rows * context)
              for rows in (1, 2, 3, 4, 5, 6, 8, 12, 16, 48) for context in (32, 256, 1024)]
    shapes += [StepShape(tokens, 1, 1, tokens * (tokens + 1) / 2, tokens) for tokens in (8, 32, 128, 512, 2048)]
    cost = sim_cost.fit("fit", [(s, truth.seconds(s)) for s in shapes * 4])
    assert cost.small_s[:6] == pytest.approx(own, abs=1e-4) and cost.const == pytest.approx(0.035, rel=1e-3)
    assert cost.small_s[6] == pytest.approx(-0.0035, abs=1e-4)      # 7 tokens, not measured: halfway from 6 to 8
    assert all(cost.seconds(s) == pytest.approx(truth.seconds(s), rel=1e-3) for s in shapes)
    assert cost.quality["median_rel_error"] < 1e-3


@pytest.mark.serial                   # it times engine steps
def test_the_cpu_fit_predicts_held_out_engine_steps_and_round_trips_its_cache(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path))
    cost = sim_cost.load_or_fit(tiny_model, threads=1)
    q = cost.quality
    assert q["held_out_steps"] >= 100 and q["median_rel_error"] < 0.25, q     # generous: a shared, noisy CPU
    decode = StepShape(8, 8, 8, 8 * 300, 8 * 300)
    assert cost.seconds(StepShape(1024, 1, 1, 1024 * 512.5, 1024)) > cost.seconds(decode) > cost.const > 0
    [path] = (tmp_path / "sim").iterdir()
    dtype = str(pick_dtype(None, "float32", torch.device("cpu"))).removeprefix("torch.")   # the engine's default
    assert path.name == f"{Path(tiny_model).name}-{dtype}-1t-v{sim_cost.SCENARIOS}.json"   # new scenarios: a new fit
    assert json.loads(path.read_text())["quality"] == q
    assert sim_cost.load_or_fit(tiny_model, threads=1) == cost                  # read, not measured again

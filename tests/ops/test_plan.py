"""`tokenbus plan`'s arithmetic: on the seed's product (70B on 8×H100) against the design's own estimates,
and on a tiny config worked by hand."""
import json

import pytest

from ops import plan
from ops.cli import main
from workers.models.config import ModelConfig

SEED = plan.Plan(ModelConfig.from_hf(plan.MODELS["llama-3-70b"]), plan.GPUS["h100-sxm"], 8, plan.Workload(),
                 plan.Efficiency())


def test_the_seed_plan_lands_on_the_design_s_estimates():
    assert SEED.kv_bytes_per_token() / 1e6 == pytest.approx(0.3, rel=0.1)       # ≈0.3 MB: 0.328
    assert SEED.kv_per_node() / 1e9 == pytest.approx(400, rel=0.1)              # ≈400 GB: 435
    assert SEED.concurrency(full=True) == SEED.kv_per_node() / (SEED.kv_bytes_per_token() * 3400)
    assert SEED.concurrency(full=True) == pytest.approx(300, rel=0.35)          # ≈300: 390, why in docs/capacity.md
    assert parameters_b() == pytest.approx(70.55, abs=0.01)                     # Llama-3-70B's 70.55 B
    assert SEED.w.peak_rps == pytest.approx(5208, abs=1)                        # the design's ~5k requests/s


def parameters_b() -> float:
    return plan.parameters(SEED.cfg) / 1e9


def test_a_node_s_rate_keeps_every_slo_and_the_fleet_follows_from_it():
    r = SEED.report()
    node = r["node"]
    assert node["step_s"] <= 0.04 + 1e-9 and node["ttft_s"] <= 0.7 and node["batch"] <= SEED.concurrency(full=True)
    assert not SEED.fits(SEED.steady(node["rate"] * 1.01))        # the highest such rate
    assert r["nodes_at_peak"] == -(-SEED.w.peak_rps // (node["rate"] * 0.8))
    hours = r["gpu_hours_per_day"]["provisioned_for_peak"]
    tokens = SEED.w.mean_rps * 86400 * 3400
    assert r["usd_per_million_tokens"]["2"]["provisioned_for_peak"] == pytest.approx(hours * 2 / (tokens / 1e6))
    reused = plan.Plan(SEED.cfg, SEED.gpu, 8, plan.Workload(prefix_reuse=0.5), SEED.eff).report()
    assert reused["nodes_at_peak"] < r["nodes_at_peak"]          # a cached prefix is prefill not done


def test_a_tiny_config_by_hand():
    cfg = ModelConfig.from_hf(plan.hf(vocab=100, hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1,
                                      context=64, tie=True))
    gpu = plan.Gpu("toy", memory=1e6, bandwidth=1e6, flops=1e9)
    p = plan.Plan(cfg, gpu, 1, plan.Workload(dau=86400, turns=1, input_tokens=10, output_tokens=4, peak_factor=2),
                  plan.Efficiency(mfu=1.0, mbu=1.0, memory_utilization=1.0, target_utilization=1.0))
    # head_dim 4; per layer q 8, k 4, v 4, o 8×8, mlp 3×8×16: 8·(8+4+4) + 8·8 + 384 = 576; 2 layers: 1152
    assert cfg.matmul_params() == 1152
    assert plan.parameters(cfg) == 1152 + 100 * 8 + 5 * 8          # tied embedding, 2 norms a layer and the last
    assert p.weight_bytes() == 2 * 1992
    assert p.kv_bytes_per_token() == 2 * 2 * 1 * 4 * 2              # K and V, 2 layers, 1 head of 4, 2 bytes
    assert p.kv_per_node() == 1e6 - 3984
    assert p.concurrency() == pytest.approx((1e6 - 3984) / (32 * 12))   # 10 in + 4 / 2 out
    assert p.decode_seconds(0) == pytest.approx(3984 / 1e6)          # the weights' bytes at 1 MB/s
    assert p.w.mean_rps == 1 and p.w.peak_rps == 2


def test_the_command_prints_each_step_and_json(capsys):
    main(["plan"])
    out = capsys.readouterr().out
    for step in (" 1. weights per GPU", " 2. KV per token", " 3. KV per node", " 4. concurrent requests",
                 " 5. roofline", " 6. one node", " 7. nodes at the peak", "$ per 1M tokens at $2/GPU-hour"):
        assert step in out
    main(["plan", "--model", "llama-3-8b", "--gpu", "l4", "--tp", "1", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["tp"] == 1 and r["gpu"]["name"] == "L4" and r["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2


def test_this_cpu_is_measured_and_planned_like_a_gpu(capsys):
    main(["plan", "--model", "smollm2-135m", "--gpu", "cpu", "--tp", "1", "--dau", "1000", "--input-tokens", "300",
          "--output-tokens", "100", "--ttft-slo-ms", "5000", "--tpot-slo-ms", "500", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["gpu"]["name"].startswith("this CPU") and r["gpu"]["flops"] > 1e9 and r["gpu"]["bandwidth"] > 1e8
    assert r["bytes_per_parameter"] == 4 and r["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4     # float32
    assert r["node"]["rate"] > 0 and r["nodes_at_peak"] >= 1


def test_a_config_json_a_preset_in_any_case_and_every_gpu_preset_plan(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(plan.MODELS["llama-3-8b"]))
    assert plan.model_config(str(path))[1] == plan.model_config("llama-3-8b")[1]
    assert plan.model_config("SmolLM2-135M") == plan.model_config("smollm2-135m")
    for gpu, memory, bandwidth in (("h200", 141e9, 4.8e12), ("a100", 80e9, 2.039e12)):
        main(["plan", "--model", str(path), "--gpu", gpu, "--tp", "1", "--json"])
        r = json.loads(capsys.readouterr().out)
        assert r["gpu"]["memory"] == memory and r["gpu"]["bandwidth"] == bandwidth
        assert r["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 and r["nodes_at_peak"] >= 1


def test_the_gpu_choices_of_plan_and_sim_are_the_presets_and_this_cpu():
    """ops.args.deployment names the presets without importing ops.plan (torch): they must agree."""
    import argparse

    from ops.args import deployment

    p = argparse.ArgumentParser()
    deployment(p, "")
    gpu = next(a for a in p._actions if a.dest == "gpu")
    model = next(a for a in p._actions if a.dest == "model")
    assert gpu.choices == [*plan.GPUS, "cpu"]
    assert all(name in model.help for name in plan.MODELS)


def test_the_pipeline_s_cores_and_nats_servers_follow_from_a_bench_bus_calibration(tmp_path, capsys):
    """Step 8 by hand: the seed's peak (10M users × 15 turns / 86,400 s × 3 = 5,208.3 requests/s, 400 tokens each)
    on a calibration of whole numbers; the tokenizer's cost scaled by the prompt (3,000 over 1,500 tokens)."""
    cal = {"measured": "2026-12-03", "machine": "2 cores", "bus": "cluster", "fsync": "always", "nodes": 3,
           "input_len": 1500, "output_lens": [100, 400], "tokens_separated": True,
           "roles": {"gateway": {"ms_per_request": 2.0, "ms_per_1k_tokens": 10.0},
                     "tokenizer": {"ms_per_request": 3.0, "ms_per_1k_tokens": 0.0},
                     "router": {"ms_per_request": 1.0, "ms_per_1k_tokens": 0.0},
                     "worker_service": {"ms_per_request": 1.0, "ms_per_1k_tokens": 5.0},
                     "broker": {"ms_per_request": 4.0, "ms_per_1k_tokens": 1.0}},
           "durable": {"stored_per_request": 3.0, "publishes_per_request": 3.0, "bytes_per_request": 1000.0}}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    main(["plan", "--bus-calibration", str(path), "--server-cores", "8", "--json"])
    r = json.loads(capsys.readouterr().out)
    b, rps = r["bus"], 10e6 * 15 / 86400 * 3
    assert b["cores"]["gateway"] == pytest.approx((rps * 2.0 + rps * 0.4 * 10.0) / 1e3)       # 10.4 + 20.8 = 31.25
    assert b["cores"]["tokenizer"] == pytest.approx(rps * 3.0 / 1e3 * 2)                       # twice the prompt
    assert b["cores"]["broker"] == pytest.approx(rps * (4.0 + 0.4 * 1.0) / 1e3)                # 22.9 cores
    assert b["cores_at_target"]["broker"] == pytest.approx(b["cores"]["broker"] / 0.8)        # 28.6: 4 servers of 8
    assert b["nats_servers"] == 6 and b["bus_partitions"] == 2            # whole clusters of 3, a partition each
    assert b["durable_writes_per_s"] == pytest.approx(3 * rps)
    assert b["worker_service_cores_per_node"] == pytest.approx(b["cores"]["worker_service"] / r["nodes_at_peak"])
    main(["plan"])                                          # the repository's own calibration, printed
    out = capsys.readouterr().out
    assert " 8. the pipeline" in out and "nats-servers" in out and "tokenizer" in out and "--bus-partitions" in out

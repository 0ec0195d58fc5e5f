"""`tokenbus quantize` for real: llm-compressor's AWQ, in its own venv, on SmolLM2 and the shipped text (a
short calibration, to stay in seconds), writes a compressed-tensors W4A16 checkpoint that the engine detects,
serves quantized and scores near the model it came from."""
import json
import subprocess
import sys

import pytest

from workers.engine.engine import EngineConfig, LLMEngine
from workers.layers.quant import Int4Weight


@pytest.mark.slow
def test_tokenbus_quantize_makes_an_awq_checkpoint_of_smollm2_that_the_engine_serves_quantized(
        smollm2, tmp_path, capsys):
    out = tmp_path / "awq"
    done = subprocess.run([sys.executable, "-m", "ops.cli", "quantize", "--model", smollm2, "--out", str(out),
                           "--samples", "2", "--seq-len", "128", "--n-grid", "3"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = q["config_groups"]["group_0"]["weights"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "pack-quantized")
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 64, False)
    assert json.loads((out / "tokenbus_quantize.json").read_text())["method"] == "awq"

    engine = LLMEngine(str(out), EngineConfig(device="cpu", num_kv_blocks=64))
    layers = [m for m in engine.runner.model.modules() if hasattr(m, "packed_weight")]
    assert sum(isinstance(m.packed_weight, Int4Weight) for m in layers) == 30 * 4   # qkv, o, gate_up, down

    from ops.cli import main
    main(["eval", "ppl", "--model", str(out), "--reference", smollm2, "--max-tokens", "512", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["quantization"] == "w4a16" and r["predicted"] == 511     # served as the checkpoint is
    assert r["hf"] is None                      # transformers' own loader is not the reference for this format
    assert r["ppl_ratio"] < 1.3 and r["top1_agreement"] > 0.7, r    # two calibration windows: a loose bound

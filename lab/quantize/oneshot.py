"""llm-compressor's oneshot on a local model, run inside llm-compressor's venv (lab.quantize.awq makes it):
imports nothing of tokenbus, so that venv's transformers and compressed-tensors are the ones used.

    python oneshot.py MODEL_DIR OUT_DIR --method awq --group-size 64 --samples 32 --seq-len 512 --text FILE

Calibration samples are consecutive windows of the text's tokens. The checkpoint is saved compressed
(compressed-tensors pack-quantized), with the tokenizer and generation config beside it."""
import argparse
import json
import time
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.awq import AWQModifier
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from transformers import AutoModelForCausalLM, AutoTokenizer


def scheme(group_size: int, symmetric: bool) -> dict:
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def recipe(method: str, group_size: int, symmetric: bool, n_grid: int) -> list:
    groups = scheme(group_size, symmetric)
    if method == "awq":   # AWQ scales channels; the quantization modifier then rounds (llm-compressor >= 0.14)
        return [AWQModifier(ignore=["lm_head"], duo_scaling=True, n_grid=n_grid),
                QuantizationModifier(ignore=["lm_head"], config_groups=groups)]
    if method == "gptq":
        return [GPTQModifier(ignore=["lm_head"], config_groups=groups)]
    return [QuantizationModifier(ignore=["lm_head"], config_groups=groups)]   # rtn: round to nearest, no data


def calibration(tokenizer, text: str, samples: int, seq_len: int) -> Dataset:
    ids = tokenizer(text)["input_ids"]
    windows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:samples]
    if len(windows) < samples:
        raise SystemExit(f"--samples {samples} x --seq-len {seq_len}: the text holds only {len(windows)} windows")
    return Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seq_len for _ in windows]})


def cpu_only() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations for faster copies to an accelerator, which
    raises where there is none; on a CPU-only machine pinning buys nothing, so it is skipped."""
    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--method", choices=["awq", "gptq", "rtn"], default="awq")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--symmetric", action="store_true")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--n-grid", type=int, default=20)
    p.add_argument("--text", required=True)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cpu_only()
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    data = calibration(tokenizer, Path(a.text).read_text(), a.samples, a.seq_len)
    oneshot(model=model, dataset=data, recipe=recipe(a.method, a.group_size, a.symmetric, a.n_grid),
            max_seq_length=a.seq_len, num_calibration_samples=len(data))
    model.save_pretrained(a.out, save_compressed=True)
    tokenizer.save_pretrained(a.out)
    seconds = round(time.monotonic() - start, 1)
    (Path(a.out) / "tokenbus_quantize.json").write_text(json.dumps(
        {"source": str(a.model), "method": a.method, "scheme": "W4A16", "group_size": a.group_size,
         "symmetric": a.symmetric, "n_grid": a.n_grid, "samples": len(data), "seq_len": a.seq_len,
         "seconds": seconds}, indent=1))
    print(json.dumps({"out": a.out, "seconds": seconds}))


if __name__ == "__main__":
    main()

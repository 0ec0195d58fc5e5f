"""Weights quantized at load (EngineConfig.quantization) on a real model: batch-1 TPOT and the weights'
bytes in each dtype and weight format, side by side in one run. Engines are built once and their
rounds interleaved; a decode step is timed in the process's CPU time on one thread (robust to other
work sharing the machine) beside its wall time; the median step of each counts.

    python -m lab.benchmarks.quant_weights [--model smollm2-135m-instruct] [--rounds 5] [--json]
"""
import argparse
import json
import statistics
import time

import torch

from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.models import catalogue

SETUPS = {"bfloat16": {"dtype": "bfloat16"}, "bfloat16, int8 weights": {"dtype": "bfloat16", "quantization": "int8"},
          "float32": {"dtype": "float32"}, "float32, int8 weights": {"dtype": "float32", "quantization": "int8"}}


def decode_steps(engine: LLMEngine, rid: str, prompt_len: int, tokens: int) -> list[tuple[float, float]]:
    """(CPU seconds, wall seconds) of each decode step of one request alone."""
    engine.add_request(rid, list(range(200, 200 + prompt_len)),
                       SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
    engine.step()   # the prefill
    steps = []
    while engine.has_unfinished():
        cpu, wall = time.process_time(), time.perf_counter()
        engine.step()
        steps.append((time.process_time() - cpu, time.perf_counter() - wall))
    return steps


def measure(model: str, rounds: int, prompt_len: int, tokens: int) -> dict:
    engines = {name: LLMEngine(model, EngineConfig(device="cpu", num_kv_blocks=64, **options))
               for name, options in SETUPS.items()}
    steps = {name: [] for name in SETUPS}
    for r in range(rounds):
        for name, engine in engines.items():
            steps[name] += decode_steps(engine, f"r{r}", prompt_len, tokens)
    return {name: {"tpot_cpu_ms": 1e3 * statistics.median(c for c, _ in steps[name]),
                   "tpot_wall_ms": 1e3 * statistics.median(w for _, w in steps[name]),
                   "weight_bytes": engines[name].runner.parameter_bytes()} for name in SETUPS}


def table(r: dict) -> str:
    lines = [f"{'':26}{'TPOT cpu ms':>12}{'wall ms':>10}{'weights MB':>12}{'TPOT / bf16':>13}"]
    base = r["bfloat16"]["tpot_cpu_ms"]
    for name, m in r.items():
        lines.append(f"{name:26}{m['tpot_cpu_ms']:>12.2f}{m['tpot_wall_ms']:>10.2f}{m['weight_bytes'] / 1e6:>12.0f}"
                     f"{m['tpot_cpu_ms'] / base:>12.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.quant_weights", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a checkpoint directory, GGUF file or model name")
    p.add_argument("--rounds", type=int, default=5, help="requests per engine, interleaved")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32, help="decode steps per request")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(str(catalogue.resolve(args.model)), args.rounds, args.prompt_len, args.tokens)
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    main()

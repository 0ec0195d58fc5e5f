"""The memory hierarchy's two benchmarks on a real model, every KV dtype and weight format side by side in
one run (issue 43's part 5; the tiers have lab.benchmarks.tiers):

- **roofline**: a decode step at batch 1 and 64 (each sequence at `--context` tokens) beside its floor,
  the larger of its bytes (the weights as the kernels read them, and every sequence's KV) over this
  machine's measured copy bandwidth and its FLOPs over the measured matmul peak (ops.plan.measured_cpu).
  The share of the floor reached is `floor / measured` (1 = at the roofline).
- **preempting**: output tok/s of `--concurrency` requests at once under a fixed `--kv-cache-memory` that
  is too small for the full-precision cache (it preempts and recomputes) but not for a quantized one;
  bf16 weights, each KV dtype (the weights' format does not change what the pool holds).

    python -m lab.benchmarks.memory [--model smollm2-135m-instruct] [--awq DIR] [--json]
    python -m lab.benchmarks.memory --only preempting --concurrency 64 256 --kv-cache-memory 320MiB

All setups run in bfloat16 (the int8 kernel widens to float32 in registers); --awq adds a W4A16 checkpoint
of the same model (`tokenbus quantize --out DIR`)."""
import argparse
import json
import statistics
import time

import torch

from ops.args import size
from ops.plan import measured_cpu
from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.layers.quant import Int4Weight
from workers.models import catalogue

KV_DTYPES = ("auto", "int8", "fp8")
ROOMY = 2 << 30      # the roofline's pool: no preemption


def setups(model: str, awq: str | None) -> dict[str, tuple[str, dict]]:
    """name -> (checkpoint, EngineConfig options)."""
    out = {}
    for kv in KV_DTYPES:
        label = "bf16 KV" if kv == "auto" else f"{kv} KV"
        out[f"bf16 weights, {label}"] = (model, {"kv_cache_dtype": kv})
        out[f"int8 weights, {label}"] = (model, {"kv_cache_dtype": kv, "quantization": "int8"})
        if awq:
            out[f"w4a16 weights, {label}"] = (awq, {"kv_cache_dtype": kv})
    return out


def storage_bytes(obj, seen: set) -> int:
    """The bytes of the tensors `obj` holds (itself, or a dataclass's fields), each storage once."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr() if obj.layout == torch.strided else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes() if obj.layout == torch.strided else obj.numel() * obj.element_size()
    fields = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "__slots__", ())
    return sum(storage_bytes(getattr(obj, f, None), seen) for f in fields)


def weight_bytes_read(engine: LLMEngine) -> int:
    """What one decode step reads of the linear weights: each layer's packed form where it has one (the
    kernel's layout, scales included), else its weight. A 4-bit weight is held in two layouts; bfloat16
    steps read PyTorch's."""
    total = 0
    for m in engine.runner.model.modules():
        if not hasattr(m, "packed_weight"):
            continue
        packed = m.packed_weight
        if isinstance(packed, Int4Weight) and packed.packed is not None:
            packed = packed.packed
        total += storage_bytes(packed if packed is not None else m.weight, set())
    return total


def kv_bytes_per_token(engine: LLMEngine) -> int:
    pool = engine.runner.kv_pool        # [2, layers, blocks, block_size, Hkv, row]
    return 2 * pool.shape[1] * pool.shape[4] * pool.shape[5] * pool.element_size()


def step_flops(engine: LLMEngine, batch: int, context: int) -> float:
    c = engine.runner.model.cfg
    return batch * (2 * c.matmul_params() + 4 * c.num_layers * c.num_heads * c.head_dim * context
                    + 2 * c.hidden_size * c.vocab_size)


def prompt(engine: LLMEngine, i: int, length: int) -> list[int]:
    """The i-th of distinct prompts (no prefix shared), token ids spread over the vocabulary."""
    vocab = engine.runner.model.cfg.vocab_size
    return [(i * 7919 + t * 31) % (vocab - 100) + 100 for t in range(length)]


def decode_step_seconds(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """The median wall time of `steps` decode steps of `batch` sequences at about `context` tokens."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", prompt(engine, i, context), params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[:steps])


def roofline(setups_: dict, batches: list[int], context: int, steps: int) -> dict:
    machine = {dtype: measured_cpu(dtype) for dtype in ("float32", "bfloat16")}
    bandwidth = machine["float32"].bandwidth
    rows = {}
    for name, (model, options) in setups_.items():
        engine = LLMEngine(model, EngineConfig(device="cpu", dtype="bfloat16", max_num_seqs=max(batches),
                                               kv_cache_memory=ROOMY, **options))
        weights, per_token = weight_bytes_read(engine), kv_bytes_per_token(engine)
        peak = machine["float32" if options.get("quantization") == "int8" else "bfloat16"].flops
        for batch in batches:
            seconds = decode_step_seconds(engine, batch, context, steps)
            read = weights + batch * context * per_token
            floor = max(read / bandwidth, step_flops(engine, batch, context) / peak)
            rows[f"{name} @ {batch}"] = {"batch": batch, "step_ms": 1e3 * seconds, "weight_bytes": weights,
                                         "kv_bytes": batch * context * per_token, "byte_ms": 1e3 * read / bandwidth,
                                         "flop_ms": 1e3 * step_flops(engine, batch, context) / peak,
                                         "of_roofline": floor / seconds}
        del engine
    return {"bandwidth_gbs": bandwidth / 1e9, "peak_gflops": {k: v.flops / 1e9 for k, v in machine.items()},
            "context": context, "rows": rows}


def preempting(setups_: dict, concurrencies: list[int], memory: int, prompt_len: int, output: int) -> dict:
    rows = {}
    for name, (model, options) in setups_.items():
        for n in concurrencies:
            engine = LLMEngine(model, EngineConfig(device="cpu", dtype="bfloat16", max_num_seqs=n,
                                                   kv_cache_memory=memory, **options))
            params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
            for i in range(n):
                engine.add_request(f"p{i}", prompt(engine, i, prompt_len), params)
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            seconds, tokens = time.perf_counter() - start, n * output
            stats = engine.stats()
            rows[f"{name} @ {n}"] = {"setup": name, "concurrency": n, "tok_s": tokens / seconds, "seconds": seconds,
                                     "kv_blocks": stats["kv_blocks_total"], "preemptions": stats["preemptions"]}
            del engine
    return {"kv_cache_memory": memory, "prompt": prompt_len, "output": output, "rows": rows}


def roofline_table(r: dict) -> str:
    lines = [f"bandwidth {r['bandwidth_gbs']:.1f} GB/s (copy), peak {r['peak_gflops']['bfloat16']:.0f} GFLOP/s "
             f"bf16, {r['peak_gflops']['float32']:.0f} fp32; context {r['context']}",
             f"{'':34}{'step ms':>9}{'bytes ms':>10}{'FLOPs ms':>10}{'of roofline':>13}"]
    for name, m in r["rows"].items():
        lines.append(f"{name:34}{m['step_ms']:>9.2f}{m['byte_ms']:>10.2f}{m['flop_ms']:>10.2f}"
                     f"{100 * m['of_roofline']:>12.0f}%")
    return "\n".join(lines)


def preempting_table(r: dict) -> str:
    lines = [f"--kv-cache-memory {r['kv_cache_memory'] / 2 ** 20:.0f} MiB, {r['prompt']} + {r['output']} tokens each",
             f"{'':34}{'tok/s':>8}{'blocks':>8}{'preempted':>11}{'x bf16 KV':>11}"]
    for name, m in r["rows"].items():
        base = r["rows"][f"{m['setup'].split(', ')[0]}, bf16 KV @ {m['concurrency']}"]["tok_s"]
        lines.append(f"{name:34}{m['tok_s']:>8.0f}{m['kv_blocks']:>8}{m['preemptions']:>11}"
                     f"{m['tok_s'] / base:>10.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a checkpoint directory, GGUF file or model name")
    p.add_argument("--awq", metavar="DIR", help="also a W4A16 checkpoint of the model (tokenbus quantize)")
    p.add_argument("--only", choices=["roofline", "preempting"], help="one of the two (default: both)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="roofline: sequences per step")
    p.add_argument("--context", type=int, default=512, help="roofline: tokens of each sequence")
    p.add_argument("--steps", type=int, default=8, help="roofline: decode steps timed (the median counts)")
    p.add_argument("--weights", nargs="+", choices=["bf16", "int8", "w4a16"], help="only these weight formats")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256], help="preempting: requests at once")
    p.add_argument("--kv-cache-memory", type=size, default=size("320MiB"),
                   help="preempting: the pool's bytes (default 320MiB: bf16 preempts at 64 x 384 tokens)")
    p.add_argument("--prompt-len", type=int, default=256, help="preempting: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="preempting: output tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = p.parse_args(argv)
    chosen = setups(str(catalogue.resolve(args.model)), args.awq)
    if args.weights:
        chosen = {k: v for k, v in chosen.items() if k.split(" ")[0] in args.weights}
    result = {}
    if args.only in (None, "roofline"):
        result["roofline"] = roofline(chosen, args.batches, args.context, args.steps)
        if not args.json:
            print(roofline_table(result["roofline"]), flush=True)
    if args.only in (None, "preempting"):
        kv_only = {k: v for k, v in chosen.items() if k.startswith("bf16 weights")}
        result["preempting"] = preempting(kv_only, args.concurrency, args.kv_cache_memory, args.prompt_len,
                                          args.output_len)
        if not args.json:
            print(preempting_table(result["preempting"]))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The quantized KV cache on a real model: the blocks a KV budget buys in each kv_cache_dtype, the
error of each format's dequantized K and V (relative RMS over the KV of one prefill of the shipped essay)
with the scale granularity the engine uses (one per token and KV head) beside one scale per block and KV
head, the coarser choice it rejected (docs/engine.md, "The quantized KV cache"), and the native CPU
attention's time over each kind of pool: a decode of 32 sequences of 1,024 positions in the model's
heads, on one thread, its CPU time (the fastest of 7: robust to other work sharing the machine).

    python -m lab.benchmarks.kv_quant [--model smollm2-135m-instruct] [--tokens 512] [--json]
"""
import argparse
import json
from pathlib import Path

import torch

from kernels.reference import QMAX, dequantize_kv, quantize_kv
from schemas.sampling import SamplingParams
from workers.engine.engine import KV_CACHE_DTYPES, EngineConfig, LLMEngine
from workers.models import catalogue

BUDGET = 1 << 30
TEXT = Path(catalogue.__file__).parent / "data" / "ppl.txt"   # the essay `tokenbus eval ppl` reads


def per_block(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [layers, blocks, block_size, Hkv, D] through one scale per (block, KV head), back in float32."""
    xb = x.permute(0, 1, 3, 2, 4)
    scale = xb.abs().amax((-2, -1), keepdim=True).clamp_min(2.0 ** -126) / QMAX[dtype]
    y = (xb / scale).clamp(-QMAX[dtype], QMAX[dtype])
    y = y.round() if dtype == torch.int8 else y.to(dtype).float()
    return (y * scale).permute(0, 1, 3, 2, 4)


def error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / x.norm())


def attention_ms(heads: int, kv_heads: int, head_dim: int, seqs: int = 32, length: int = 1024) -> dict:
    """CPU milliseconds of one decode step's attention per pool dtype (kernels.cpu, one thread)."""
    import time

    import kernels.cpu as cpu

    gen = torch.Generator().manual_seed(0)
    blocks = seqs * length // 16
    k, v = (torch.randn(blocks, 16, kv_heads, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(seqs, heads, head_dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen).view(seqs, -1).int()
    cu, lens = torch.arange(seqs + 1, dtype=torch.int32), torch.full((seqs,), length, dtype=torch.int32)
    pools = {"float32": (q, k, v), "bfloat16": (q.bfloat16(), k.bfloat16(), v.bfloat16()),
             **{name: (q, quantize_kv(k, dtype), quantize_kv(v, dtype))
                for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn))}}
    plan = cpu.plan_attention(cu, lens, tables, 16)
    best = dict.fromkeys(pools, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(7):                     # alternating, so the machine's changing load hits all alike
            for name, (qq, kc, vc) in pools.items():
                start = time.thread_time()
                cpu.unified_attention(qq, kc, vc, cu, lens, tables, 0.125, plan)
                best[name] = min(best[name], time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return {name: t * 1e3 for name, t in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.kv_quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens of the essay prefilled (default 512)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from transformers import AutoTokenizer

    model = catalogue.resolve(args.model)
    ids = AutoTokenizer.from_pretrained(model)(TEXT.read_text())["input_ids"][:args.tokens]
    blocks = {}
    for dtype in ("float32", "bfloat16"):
        for kv in KV_CACHE_DTYPES:
            config = EngineConfig(device="cpu", dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=1)
            runner = LLMEngine(model, config).runner
            blocks[f"{dtype}/{kv}"] = BUDGET // runner.block_bytes()
    engine = LLMEngine(model, EngineConfig(device="cpu", num_kv_blocks=len(ids) // 16 + 2))
    engine.add_request("kv", ids, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    pool = engine.runner.kv_pool[:, :, [b.block_id for b in engine.kv.cached.values()]]
    errors = {}
    for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        for i, side in enumerate("KV"):
            x = pool[i]
            errors[f"{name}/{side}"] = {"per_token": error(x, dequantize_kv(quantize_kv(x, dtype))),
                                        "per_block": error(x, per_block(x, dtype))}
    attn = engine.runner.model.attention_layers()[0]
    result = {"model": model, "tokens": len(ids), "budget_bytes": BUDGET, "blocks": blocks, "errors": errors,
              "attention_ms": attention_ms(attn.num_heads, attn.num_kv_heads, attn.head_dim)}
    if args.json:
        print(json.dumps(result))
        return
    print(f"KV blocks of 16 tokens in 1 GiB ({model}):")
    for key, n in blocks.items():
        base = blocks[key.split("/")[0] + "/auto"]
        print(f"  {key:18}{n:>8}{n / base:>7.2f}x")
    print(f"relative RMS error of the dequantized KV of a {len(ids)}-token prefill:")
    print(f"  {'':10}{'per token+head':>16}{'per block+head':>16}")
    for key, e in errors.items():
        print(f"  {key:10}{e['per_token']:>15.2%}{e['per_block']:>16.2%}")
    print("native CPU attention, a decode of 32 sequences x 1,024 positions, one thread (CPU ms):")
    for key, ms in result["attention_ms"].items():
        print(f"  {key:10}{ms:>8.2f}")


if __name__ == "__main__":
    main()

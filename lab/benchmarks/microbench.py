"""`python -m lab.benchmarks.microbench`: the CPU microbenchmarks behind docs/engine-performance.md.

Each line times one choice the engine made against its alternatives, taking turns between them
(this machine's neighbours come and go) and reporting each one's best round, in milliseconds:
decode-attention group size, 3-D vs 4-D prefill attention, prepacked oneDNN vs sgemm linear
layers, and the sampler's top-candidates path vs a full sort. `python -m lab.benchmarks.microbench peak`
measures only the CPU's ceiling: a large matmul's FLOP/s in float32 and bfloat16.
"""
import random
import sys

import torch
import torch.nn.functional as F

import kernels.reference as ref
import workers.engine.sampler as sampler_module
from lab.common.results import best_ms
from ops.plan import PEAK_SIZE, peak_flops
from schemas.sampling import SamplingParams
from workers.distributed import SINGLE
from workers.engine.request import Request
from workers.layers.linear import ColumnParallelLinear, prepack_for_cpu


def decode_groups() -> list[str]:
    """64 decodes of 100-380 tokens on shuffled blocks (the tiny model's 2 KV heads of 64)."""
    rng = random.Random(0)
    lens = [rng.randint(100, 380) for _ in range(64)]
    perm = torch.randperm(16384, generator=torch.Generator().manual_seed(0))
    tables = torch.zeros(64, 24, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        count = -(-n // 16)
        tables[b, :count] = perm[used:used + count]
        used += count
    k_cache, v_cache = torch.randn(16384, 16, 2, 64), torch.randn(16384, 16, 2, 64)
    args = (torch.randn(64, 4, 64), k_cache, v_cache, torch.arange(65, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), tables)
    plans = {}
    for group in (4, 8, 16, 32, 64):
        ref.DECODE_GROUP = group
        plans[group] = ref.plan_attention(*args[3:], block_size=16)
    ref.DECODE_GROUP = 16
    times = best_ms({g: (lambda p=p: ref.unified_attention(*args, scale=0.125, plan=p)) for g, p in plans.items()})
    return [f"decode attention, 64 sequences, groups of {g:2}: {ms:6.2f} ms" for g, ms in times.items()]


def prefill_layout() -> list[str]:
    q, k = torch.randn(4, 200, 64), torch.randn(2, 200, 64)
    t = best_ms({"3d": lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True),
                 "4d": lambda: F.scaled_dot_product_attention(q[None], k[None], k[None], is_causal=True,
                                                              enable_gqa=True)})
    return [f"prefill attention, 200 tokens: 3-D inputs (math path) {t['3d']:6.2f} ms, 4-D (flash) {t['4d']:6.2f} ms"]


def linear_layers() -> list[str]:
    lines = []
    for out_features, in_features in ((512, 256), (1408, 256), (256, 704)):
        plain, packed = (ColumnParallelLinear.split(in_features, out_features, False, SINGLE) for _ in range(2))
        plain.weight.data.normal_()
        packed.weight.data.copy_(plain.weight)
        prepack_for_cpu(packed)
        for rows in (17, 64, 2048):
            x = torch.randn(rows, in_features)
            t = best_ms({"sgemm": lambda a=plain, x=x: a(x), "onednn": lambda b=packed, x=x: b(x)})
            lines.append(f"linear {in_features}->{out_features}, {rows:4} rows: sgemm {t['sgemm']:6.3f} ms, "
                         f"oneDNN prepacked {t['onednn']:6.3f} ms")
    return lines


def top_p_sampling() -> list[str]:
    requests = [Request(f"r{i}", list(range(300)), 200, SamplingParams(temperature=0.8, top_p=0.9), i, 16)
                for i in range(64)]
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * 3
    sample = sampler_module.Sampler()

    def with_candidates(n: int):
        def run():
            sampler_module.CANDIDATES = n  # 4096: every row takes the full sort
            try:
                sample(logits, requests)
            finally:
                sampler_module.CANDIDATES = 256
        return run

    t = best_ms({"top": with_candidates(256), "sort": with_candidates(4096)})
    return [f"sampler, 64 rows x 4096, T=0.8 top_p=0.9: top-256 candidates {t['top']:6.2f} ms, "
            f"full sort {t['sort']:6.2f} ms"]


def peak() -> list[str]:
    return [f"peak, one [{PEAK_SIZE}, {PEAK_SIZE}] x [{PEAK_SIZE}, {PEAK_SIZE}] matmul: {name} "
            f"{peak_flops(dtype) / 1e12:.2f} TFLOP/s" for name, dtype in (("float32", torch.float32),
                                                                          ("bfloat16", torch.bfloat16))]


def main() -> None:
    torch.manual_seed(0)
    if sys.argv[1:] == ["peak"]:
        print("\n".join(peak()))
        return
    print(f"CPU microbenchmarks, {torch.get_num_threads()} threads, best of 7 rounds of 10 calls, in turns")
    for section in (decode_groups, prefill_layout, linear_layers, top_p_sampling, peak):
        print("\n".join(section()))


if __name__ == "__main__":
    main()

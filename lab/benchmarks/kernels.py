"""`python -m lab.benchmarks.kernels [--json] [--cpu]`: the Triton kernels against their references on a CUDA device.

Per kernel and shape: time (triton.testing.do_bench, median) and achieved memory bandwidth (bytes
the kernel must move / time) against the card's peak; decode attention at context 1k-32k and batch
1-256 for a Llama-70B shard at TP 8 (Hq 8, Hkv 1, D 128) and an 8B model (Hq 32, Hkv 8, D 128);
and the engine's decode tokens/s with the Triton kernels vs the reference. Goal on H100: decode
attention at long context above 70% of peak HBM bandwidth. Without CUDA it says so and exits 0.
With --shard: one decoder layer of a Llama-70B TP-8 shard through the engine (the step time of a
10-layer model minus a 2-layer one, over 8) for a 2048-token prefill and for decode at batch 1, 64
and 256 at a context of ~3200, against the roofline floor that `tokenbus plan` scales by its
efficiency factors.

With --cpu: the native CPU attention (kernels.cpu) against the reference on this machine, with
SmolLM2-135M's heads (9 query heads over 3 KV heads of 64), in float32 and bfloat16: 64 decodes of
200-500 positions, a 512-token prefill, both in one batch, and one decode; each side's best of 7
rounds, taken in turns (this machine's neighbours come and go), and the native kernel's KV read
rate (bytes of K and V it must read / time). With --cpu --engine MODEL: the engine on MODEL with
each attention in turns (one engine, its kernels swapped): 64 requests at once (prompts 128-512,
outputs 128) and one request at a time (512-token prompts, 128 outputs); output tokens/s, the
mean decode step (one at a time: the time per output token) and the attention's share of it.
"""
import argparse
import json
import tempfile
import time

import torch

PEAK_GB_S = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100": 1555, "L40S": 864}
SHAPES = {"70B/TP8": (8, 1, 128), "8B": (32, 8, 128)}
BLOCK_SIZE = 16
REFERENCE_TOKENS = 64 * 4096   # cached tokens of a batch up to which the reference is timed beside


def peak(name: str) -> float | None:
    return next((gb for key, gb in PEAK_GB_S.items() if key in name), None)


def decode_case(batch: int, context: int, hq: int, hkv: int, d: int, dtype=torch.bfloat16):
    """Decode queries over `context` cached tokens each, in shuffled blocks of a pool just large enough."""
    blocks = -(-context // BLOCK_SIZE)
    pool = torch.randperm(batch * blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    k = torch.randn(batch * blocks, BLOCK_SIZE, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, k, v, cu, lens, pool.view(batch, blocks)


def bench_attention(name: str, hq: int, hkv: int, d: int, batch: int, context: int, gpu_peak: float | None) -> dict:
    import triton.testing

    import kernels.reference as ref
    import kernels.triton as tri

    q, k, v, cu, lens, tables = decode_case(batch, context, hq, hkv, d)
    scale = d ** -0.5
    plan = tri.plan_attention(cu.cpu(), lens.cpu(), tables.cpu(), BLOCK_SIZE, hq, hkv).to(q.device)
    t_ms = triton.testing.do_bench(lambda: tri.unified_attention(q, k, v, cu, lens, tables, scale, plan))
    r_ms = None
    if batch * context <= REFERENCE_TOKENS:   # the reference gathers every sequence's KV in float32
        ref_plan = ref.plan_attention(cu.cpu(), lens.cpu(), tables.cpu(), BLOCK_SIZE).to(q.device)
        r_ms = triton.testing.do_bench(lambda: ref.unified_attention(q, k, v, cu, lens, tables, scale, ref_plan))
    moved = 2 * batch * context * hkv * d * k.element_size() + 2 * q.numel() * q.element_size()
    gb_s = moved / t_ms / 1e6
    return {"kernel": "decode attention", "shape": f"{name} batch {batch} ctx {context}",
            "splits": plan.num_splits, "triton_ms": t_ms, "reference_ms": r_ms,
            "speedup": r_ms / t_ms if r_ms else None, "gb_per_s": gb_s,
            "peak_share": gb_s / gpu_peak if gpu_peak else None}


def bench_store_kv(tokens: int, hkv: int, d: int, gpu_peak: float | None) -> dict:
    import triton.testing

    import kernels.reference as ref
    import kernels.triton as tri

    k_cache = torch.zeros(tokens // BLOCK_SIZE * 2, BLOCK_SIZE, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key, value = (torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device="cuda")[:tokens]
    t_ms = triton.testing.do_bench(lambda: tri.store_kv(key, value, k_cache, v_cache, slots))
    r_ms = triton.testing.do_bench(lambda: ref.store_kv(key, value, k_cache, v_cache, slots))
    gb_s = 4 * key.numel() * key.element_size() / t_ms / 1e6
    return {"kernel": "store_kv", "shape": f"{tokens} tokens Hkv {hkv} D {d}", "splits": None, "triton_ms": t_ms,
            "reference_ms": r_ms, "speedup": r_ms / t_ms, "gb_per_s": gb_s,
            "peak_share": gb_s / gpu_peak if gpu_peak else None}


def bench_ops(gpu_peak: float | None) -> list[dict]:
    return [row for t in (1, 64, 2048) for row in bench_ops_at(t, gpu_peak)]


def bench_ops_at(t: int, gpu_peak: float | None) -> list[dict]:
    """The fused ops at t tokens of a Llama-70B shard (hidden 8192, intermediate 28672 / 8, 8 heads of 128)."""
    import triton.testing

    import kernels.reference as ref
    import kernels.triton as tri

    x, res = (torch.randn(t, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(t, 2 * 3584, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.randn(t, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cases = [("rms_norm+residual", f"T {t} H 8192", lambda: tri.rms_norm(x, w, 1e-5, res),
              lambda: ref.rms_norm(x, w, 1e-5, res), 4 * x.numel() * 2),
             ("silu_and_mul", f"T {t} I 3584", lambda: tri.silu_and_mul(gate), lambda: ref.silu_and_mul(gate),
              gate.numel() * 2 * 3 // 2),
             ("rotary", f"T {t} H 8 D 128", lambda: tri.rotary(q, cos, sin), lambda: ref.rotary(q, cos, sin),
              2 * q.numel() * 2)]
    rows = []
    for kernel, shape, fast, slow, moved in cases:
        t_ms, r_ms = triton.testing.do_bench(fast), triton.testing.do_bench(slow)
        gb_s = moved / t_ms / 1e6
        rows.append({"kernel": kernel, "shape": shape, "splits": None, "triton_ms": t_ms, "reference_ms": r_ms,
                     "speedup": r_ms / t_ms, "gb_per_s": gb_s, "peak_share": gb_s / gpu_peak if gpu_peak else None})
    return rows


def engine_decode(size: str = "small", num_requests: int = 64, output: int = 128) -> dict:
    """Decode tokens/s of the engine on CUDA with the Triton kernels and with the reference."""
    import kernels.reference
    import kernels.triton
    from schemas.sampling import SamplingParams
    from workers.engine.engine import EngineConfig, LLMEngine
    from workers.models.builder import build_tiny_model

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(tmp, size))
        blocks = num_requests * -(-(32 + output) // 16)
        for name, backend in (("triton", kernels.triton), ("reference", kernels.reference)):
            engine = LLMEngine(model, EngineConfig(device="cuda", max_num_seqs=num_requests, num_kv_blocks=blocks))
            use_kernels(engine, backend)
            for i in range(num_requests):
                params = SamplingParams(max_tokens=output, ignore_eos=True)
                engine.add_request(f"{name}{i}", list(range(16, 48)), params)
            engine.step()                                   # the prefill
            torch.cuda.synchronize()
            start, steps = time.perf_counter(), 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
            result[f"{name}_decode_tokens_per_s"] = num_requests * steps / (time.perf_counter() - start)
            del engine
    result["speedup"] = result["triton_decode_tokens_per_s"] / result["reference_decode_tokens_per_s"]
    return result


SHARD = {"hidden": 8192, "intermediate": 28672 // 8, "heads": 64 // 8, "kv_heads": 8 // 8, "head_dim": 128}


def shard_config(layers: int, dims: dict) -> dict:
    """The HF config.json of such a shard model."""
    from ops.plan import hf

    return hf(4096, dims["hidden"], dims["intermediate"], layers, dims["heads"], dims["kv_heads"], 8192, False) | \
        {"head_dim": dims["head_dim"]}


def shard_checkpoint(root: str, layers: int, dims: dict, device: str) -> str:
    """A random Llama of `layers` decoder layers with one TP rank's share of each weight (Llama-3-70B
    at TP 8 by default: 8 query heads, 1 KV head, intermediate 3584) and a small vocabulary."""
    import transformers

    config = transformers.LlamaConfig(**shard_config(layers, dims))
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    path = f"{root}/layers{layers}"
    model.save_pretrained(path)
    return path


def shard_steps(path: str, device: str, batch: int, context: int, prefill: int) -> dict:
    """The engine's mean decode step at `batch` sequences of `context` tokens, and one prefill step of
    `prefill` tokens (alone), in seconds: the whole step and its forward."""
    import random

    from schemas.sampling import SamplingParams
    from workers.engine.engine import EngineConfig, LLMEngine

    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(16, 4096) for _ in range(n)]  # noqa: E731
    steps = 8
    blocks = batch * -(-(context + steps + 1) // BLOCK_SIZE) + -(-prefill // BLOCK_SIZE) + 8
    engine = LLMEngine(path, EngineConfig(device=device, dtype="bfloat16", max_num_seqs=batch, num_kv_blocks=blocks,
                                          max_num_batched_tokens=max(prefill, 2048), block_size=BLOCK_SIZE))

    def run(requests: list) -> None:
        while engine.has_unfinished():
            engine.step()
        failed = [r for r in requests if r.finish_reason == "error"]
        if failed:      # the engine fails a request that breaks a step, and goes on: say why
            raise RuntimeError(f"{len(failed)} of {len(requests)} requests failed: {failed[0].error}")

    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    run([engine.add_request("warm", prompt(prefill), warm)])      # compiles the kernels' variants
    engine.trace = []
    run([engine.add_request("prefill", prompt(prefill), SamplingParams(max_tokens=1, ignore_eos=True))])
    first = engine.trace[0]
    # the first requests decode while the last are still prefilled: each runs long enough that all
    # decode together for `steps` steps
    budget = engine.config.max_num_batched_tokens
    params = SamplingParams(max_tokens=-(-batch * context // budget) + steps + 2, ignore_eos=True)
    engine.trace = []
    run([engine.add_request(f"d{i}", prompt(context), params) for i in range(batch)])
    decode = [t for t in engine.trace if t.num_tokens == t.num_requests == batch]
    if not decode:
        shapes = sorted({(t.num_requests, t.num_tokens) for t in engine.trace})
        raise RuntimeError(f"no step decoded all {batch} requests at once; (requests, tokens) of the steps: {shapes}")
    mean = lambda key: sum(getattr(t, key) for t in decode) / len(decode)  # noqa: E731
    return {"prefill_s": first.seconds, "prefill_forward_s": first.forward_seconds,
            "decode_s": mean("seconds"), "decode_forward_s": mean("forward_seconds"), "decode_steps": len(decode),
            "decode_context": mean("kv_read") / batch}


def shard_layers(device: str = "cuda", dims: dict = SHARD, depths: tuple = (2, 10), batches=(1, 64, 256),
                 context: int = 3200, prefill: int = 2048, bandwidth: float = 4.8e12, flops: float = 989e12) -> dict:
    """One decoder layer of a TP shard on this device, through the engine: the step time of a model
    of depths[1] layers minus one of depths[0], over the difference (the embedding, LM head,
    sampling and the step's fixed costs cancel), for decode at each batch and `context` tokens and
    for a `prefill`-token prefill; against the layer's floor at `bandwidth` and `flops` (ops.plan's
    roofline with efficiency 1: tokenbus plan assumes mbu 0.7 and mfu 0.5). The shard's all-reduces
    are not in it (one GPU)."""
    import tempfile

    from workers.models.config import ModelConfig

    hq, hkv, d = dims["heads"], dims["kv_heads"], dims["head_dim"]
    params = ModelConfig.from_hf(shard_config(1, dims)).matmul_params()
    kv_per_token = 2 * hkv * d * 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [shard_checkpoint(tmp, n, dims, device) for n in depths]
        runs = {b: [shard_steps(p, device, b, context, prefill) for p in paths] for b in batches}
    span = depths[1] - depths[0]
    per_layer = lambda b, key: (runs[b][1][key] - runs[b][0][key]) / span  # noqa: E731
    prefill_flops = 2 * params * prefill + 4 * hq * d * prefill * prefill / 2
    prefill_s = per_layer(batches[0], "prefill_s")
    rows.append({"step": f"prefill {prefill} tokens", "layer_ms": prefill_s * 1e3,
                 "forward_ms": per_layer(batches[0], "prefill_forward_s") * 1e3,
                 "floor_ms": prefill_flops / flops * 1e3, "bound": "compute",
                 "efficiency": prefill_flops / flops / prefill_s})
    for b in batches:
        ctx = runs[b][1]["decode_context"]       # the mean over the measured steps
        moved = params * 2 + b * ctx * kv_per_token
        work = (2 * params + 4 * hq * d * ctx) * b
        floor = max(moved / bandwidth, work / flops)
        seconds = per_layer(b, "decode_s")
        rows.append({"step": f"decode batch {b}, context {ctx:.0f}", "layer_ms": seconds * 1e3,
                     "forward_ms": per_layer(b, "decode_forward_s") * 1e3, "floor_ms": floor * 1e3,
                     "bound": "memory" if moved / bandwidth >= work / flops else "compute",
                     "efficiency": floor / seconds})
    return {"dims": dims, "depths": depths, "params_per_layer": params, "bandwidth": bandwidth, "flops": flops,
            "rows": rows, "runs": {str(b): r for b, r in runs.items()}}


def shard_table(report: dict) -> str:
    d = report["dims"]
    lines = [f"one decoder layer of a TP shard (hidden {d['hidden']}, {d['heads']} query / {d['kv_heads']} KV heads "
             f"of {d['head_dim']}, intermediate {d['intermediate']}; {report['params_per_layer'] / 1e6:.0f}M "
             f"parameters), from {report['depths'][1]}- minus {report['depths'][0]}-layer engine steps; floor at "
             f"{report['bandwidth'] / 1e12:.1f} TB/s and {report['flops'] / 1e12:.0f} TFLOP/s",
             f"{'step':32}{'layer ms':>10}{'forward ms':>12}{'floor ms':>10}{'bound':>9}{'of floor':>10}"]
    for r in report["rows"]:
        lines.append(f"{r['step']:32}{r['layer_ms']:>10.3f}{r['forward_ms']:>12.3f}{r['floor_ms']:>10.3f}"
                     f"{r['bound']:>9}{r['efficiency']:>10.0%}")
    return "\n".join(lines)


def run() -> dict:
    name = torch.cuda.get_device_name()
    gpu_peak = peak(name)
    rows = []
    for shape, (hq, hkv, d) in SHAPES.items():
        for context in (1024, 4096, 16384, 32768):
            for batch in (1, 16, 64, 256):
                need = 2 * batch * context * hkv * d * 2
                if need > 0.5 * torch.cuda.mem_get_info()[0]:
                    continue
                rows.append(bench_attention(shape, hq, hkv, d, batch, context, gpu_peak))
    rows.append(bench_store_kv(2048, 8, 128, gpu_peak))
    rows += bench_ops(gpu_peak)
    return {"device": name, "peak_gb_per_s": gpu_peak, "kernels": rows, "engine": engine_decode(),
            "goal": "decode attention at long context > 70% of peak HBM bandwidth"}


def table(report: dict) -> str:
    lines = [f"{report['device']} (peak {report['peak_gb_per_s'] or '?'} GB/s); goal: {report['goal']}",
             f"{'kernel':20}{'shape':32}{'splits':>7}{'triton ms':>11}{'ref ms':>10}{'speedup':>9}{'GB/s':>9}"
             f"{'of peak':>9}"]
    for r in report["kernels"]:
        share = f"{r['peak_share']:.0%}" if r["peak_share"] is not None else "-"
        ref_ms, speedup = (f"{r['reference_ms']:.4f}", f"{r['speedup']:.1f}x") if r["reference_ms"] else ("-", "-")
        lines.append(f"{r['kernel']:20}{r['shape']:32}{r['splits'] or '':>7}{r['triton_ms']:>11.4f}"
                     f"{ref_ms:>10}{speedup:>9}{r['gb_per_s']:>9.0f}{share:>9}")
    e = report["engine"]
    lines.append(f"engine decode tokens/s: triton {e['triton_decode_tokens_per_s']:.0f}, reference "
                 f"{e['reference_decode_tokens_per_s']:.0f} ({e['speedup']:.2f}x)")
    return "\n".join(lines)


def paged_case(q_lens: list[int], kv_lens: list[int], dtype: torch.dtype, hq: int = 9, hkv: int = 3,
               d: int = 64) -> tuple:
    """CPU kernel arguments: each sequence's last q_lens[b] queries over kv_lens[b] positions, its
    blocks shuffled over a pool just large enough."""
    counts = [-(-n // BLOCK_SIZE) for n in kv_lens]
    pool = torch.randn(2, sum(counts), BLOCK_SIZE, hkv, d).to(dtype)
    ids = torch.randperm(sum(counts)).to(torch.int32)
    tables = torch.zeros(len(kv_lens), max(counts), dtype=torch.int32)
    for b, used in enumerate(torch.tensor([0, *counts]).cumsum(0)[:-1].tolist()):
        tables[b, :counts[b]] = ids[used:used + counts[b]]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d).to(dtype)
    return q, pool[0], pool[1], cu, torch.tensor(kv_lens, dtype=torch.int32), tables


def cpu_attention() -> dict:
    import random

    import kernels.cpu as native
    import kernels.reference as ref
    from lab.common.results import best_ms

    rng = random.Random(0)
    decodes = [rng.randint(200, 500) for _ in range(64)]
    cases = {"64 decodes, 200-500 positions": ([1] * 64, decodes),
             "a 512-token prefill": ([512], [512]),
             "64 decodes and a 512-token prefill": ([1] * 64 + [512], decodes + [512]),
             "one decode, 500 positions": ([1], [500])}
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (q_lens, kv_lens) in cases.items():
            args = paged_case(q_lens, kv_lens, dtype)
            ref_plan, plan = ref.plan_attention(*args[3:], BLOCK_SIZE), native.plan_attention(*args[3:], BLOCK_SIZE)
            t = best_ms({"reference": lambda a=args, p=ref_plan: ref.unified_attention(*a, 0.125, p),
                         "native": lambda a=args, p=plan: native.unified_attention(*a, 0.125, p)}, rounds=7, number=3)
            kv_bytes = 2 * sum(kv_lens) * args[1].shape[2] * args[1].shape[3] * args[1].element_size()
            rows.append({"case": name, "dtype": str(dtype).removeprefix("torch."), "reference_ms": t["reference"],
                         "native_ms": t["native"], "speedup": t["reference"] / t["native"],
                         "kv_gb_per_s": kv_bytes / t["native"] / 1e6})
    return {"threads": torch.get_num_threads(), "cases": rows}


def cpu_engine(model: str, dtype: str | None, rounds: int) -> dict:
    import kernels.cpu as native
    import kernels.reference as ref
    from lab.common.engine import timed_engine_run, workload
    from workers.engine.engine import EngineConfig, LLMEngine
    from workers.models.catalogue import resolve
    from workers.models.config import ModelConfig

    model_dir = resolve(model)
    vocab = ModelConfig.load(model_dir).vocab_size
    shape = lambda n, lo, hi, seed: argparse.Namespace(num_requests=n, input_len=(lo, hi),  # noqa: E731
                                                       output_len=(128, 128), seed=seed)
    loads = {"64 at once": (workload(shape(64, 128, 512, 0), vocab), 64),
             "one at a time": (workload(shape(3, 512, 512, 1), vocab), 1)}
    rows = []
    for name, (requests, seqs) in loads.items():
        size = EngineConfig().block_size   # the pool holds every request whole, as bench-peers sizes it
        blocks = seqs * -(-max(len(p) + n for p, n in requests) // size)
        engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=seqs, dtype=dtype, num_kv_blocks=blocks))
        best = {}
        for _ in range(rounds):
            for side, kernels in (("reference", ref), ("native", native)):
                use_kernels(engine, timed(kernels))
                timed.seconds = 0.0
                seconds, trace = timed_engine_run(engine, requests)
                decode = [s.seconds for s in trace if s.num_tokens == s.num_requests]
                run = {"seconds": seconds, "decode_step_ms": sum(decode) / len(decode) * 1e3,
                       "attention_share": timed.seconds / seconds}
                if side not in best or seconds < best[side]["seconds"]:
                    best[side] = run
        tokens = sum(n for _, n in requests)
        rows.append({"workload": name, "dtype": str(engine.dtype).removeprefix("torch."),
                     **{f"{side}_{key}": value for side, run in best.items() for key, value in run.items()},
                     **{f"{side}_tokens_per_s": tokens / run["seconds"] for side, run in best.items()}})
    return {"model": model_dir, "threads": torch.get_num_threads(), "rounds": rounds, "engine": rows}


def use_kernels(engine, kernels) -> None:
    engine.runner.kernels = kernels
    for attn in engine.runner.model.attention_layers():
        attn.kernels = kernels


def timed(kernels):
    """`kernels` with its attention's time added up in timed.seconds."""
    def unified_attention(*args, **kwargs):
        start = time.perf_counter()
        try:
            return kernels.unified_attention(*args, **kwargs)
        finally:
            timed.seconds += time.perf_counter() - start
    return argparse.Namespace(plan_attention=kernels.plan_attention, store_kv=kernels.store_kv,
                              unified_attention=unified_attention)


timed.seconds = 0.0


def cpu_engine_table(report: dict) -> str:
    lines = [f"the engine on {report['model']}, {report['threads']} threads, best of {report['rounds']} in turns",
             f"{'workload':16}{'dtype':>10}{'':>12}{'tok/s':>8}{'decode step ms':>16}{'attention':>11}"]
    for r in report["engine"]:
        for side in ("reference", "native"):
            lines.append(f"{r['workload'] if side == 'reference' else '':16}{r['dtype']:>10}{side:>12}"
                         f"{r[side + '_tokens_per_s']:>8.1f}{r[side + '_decode_step_ms']:>16.1f}"
                         f"{r[side + '_attention_share']:>10.0%}")
    return "\n".join(lines)


def cpu_table(report: dict) -> str:
    lines = [f"CPU attention, SmolLM2 heads (9 over 3 KV heads of 64), {report['threads']} threads, best of 7 "
             "in turns", f"{'case':38}{'dtype':>10}{'ref ms':>10}{'native ms':>11}{'speedup':>9}{'KV GB/s':>9}"]
    for r in report["cases"]:
        lines.append(f"{r['case']:38}{r['dtype']:>10}{r['reference_ms']:>10.3f}{r['native_ms']:>11.3f}"
                     f"{r['speedup']:>8.1f}x{r['kv_gb_per_s']:>9.1f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--cpu", action="store_true", help="the native CPU attention against the reference, on this CPU")
    p.add_argument("--engine", metavar="MODEL", help="with --cpu: the engine on MODEL with each attention")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="with --engine: the engine's dtype")
    p.add_argument("--rounds", type=int, default=2, help="with --engine: runs of each side, in turns")
    p.add_argument("--shard", action="store_true", help="a Llama-70B TP-8 shard's decoder layer on this GPU "
                   "against tokenbus plan's roofline")
    args = p.parse_args(argv)
    if args.cpu and args.engine:
        report = cpu_engine(args.engine, args.dtype, args.rounds)
        print(json.dumps(report, indent=2) if args.json else cpu_engine_table(report))
        return
    if args.cpu:
        report = cpu_attention()
        print(json.dumps(report, indent=2) if args.json else cpu_table(report))
        return
    if not torch.cuda.is_available():
        print("lab.benchmarks.kernels: no CUDA device here; the Triton kernels are checked on CPU by the tests "
              "(TRITON_INTERPRET=1) and measured on a GPU machine with this command.")
        return
    if args.shard:
        report = shard_layers()
        print(json.dumps(report, indent=2) if args.json else shard_table(report))
        return
    report = run()
    print(json.dumps(report, indent=2) if args.json else table(report))


if __name__ == "__main__":
    main()

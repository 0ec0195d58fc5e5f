"""`tokenbus bench-engine`: the engine and HF `generate` side by side on one workload.

The workload: N requests of random tokens, prompt and output lengths drawn uniformly, EOS
ignored, greedy; the two sides take turns, --repeat runs each, and each reports its fastest
(noise from the machine's neighbours only ever slows a run). The engine gets
every request at once (continuous batching); HF gets static batches of --hf-batch-size in arrival
order, left-padded, each run for its longest output, as a user of HF would. Throughput counts the
output tokens asked for, the same for both.
"""
import json
import time

import torch

from lab.common.engine import hf_generate, run_engine, timed_engine_run, workload
from ops.plan import PEAK_SIZE, peak_flops
from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine


def engine_summary(engine: LLMEngine, runs: list[tuple[float, list]], output_tokens: int, flops: int) -> dict:
    seconds, trace = min(runs, key=lambda r: r[0])
    big = [s for s in trace if s.num_requests >= 32]
    decode = [s for s in trace if s.num_tokens == s.num_requests]
    outside = 1 - sum(s.forward_seconds for s in big) / sum(s.seconds for s in big) if big else None
    return {
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "model_flops_per_s": flops / seconds,  # the workload's FLOPs (ModelConfig.request_flops) per second
        "steps": len(trace),
        "overhead_share_batch_ge_32": outside,
        "mean_batch_size": sum(s.num_requests for s in trace) / len(trace),
        "kv_waste_slots_per_request": sum(s.kv_waste_slots for s in decode)
        / max(1, sum(s.num_requests for s in decode)),
        "block_size": engine.config.block_size,
    }


def profile_decode(model_dir: str, requests, config: EngineConfig, steps: int = 10) -> str:
    """torch.profiler's table of `steps` engine steps at full decode batch (after every prefill)."""
    from torch.profiler import ProfilerActivity, profile

    engine = LLMEngine(model_dir, config)
    for i, (prompt, _) in enumerate(requests):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    title = f"per-op CPU time over {steps} decode steps of {len(engine.scheduler.running)} requests"
    return title + "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def timed_hf_run(model, requests, batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        hf_generate(model, requests[i:i + batch_size])
    return time.perf_counter() - start


def main(args) -> None:
    from workers.models.catalogue import resolve
    from workers.models.config import ModelConfig

    model_dir = resolve(args.model or "tiny")
    model_cfg = ModelConfig.load(model_dir)
    requests = workload(args, model_cfg.vocab_size)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, dtype=args.dtype, device=args.device,
                          kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    engine = LLMEngine(model_dir, config)
    run_engine(engine, requests[:4])  # warm-up
    hf = None
    if not args.skip_hf:
        from workers.models.reference import hf_model

        device = engine.runner.device   # on a GPU, HF in the engine's dtype there; on the CPU in float32
        hf = hf_model(model_dir, engine.dtype if device.type == "cuda" else torch.float32).to(device)
        hf_generate(hf, requests[:4])
    engine_runs, hf_runs = [], []
    for _ in range(args.repeat):  # alternating, so the machine's changing load hits both sides alike
        engine_runs.append(timed_engine_run(engine, requests))
        if hf is not None:
            hf_runs.append(timed_hf_run(hf, requests, args.hf_batch_size))
    output_tokens = sum(n for _, n in requests)
    flops = sum(model_cfg.request_flops(len(p), n) for p, n in requests)
    result = {"model": model_dir, "device": str(engine.runner.device), "num_requests": len(requests),
              "threads": torch.get_num_threads(),
              "repeat": args.repeat, "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
              "engine": engine_summary(engine, engine_runs, output_tokens, flops)}
    if args.peak:
        result["peak_flops_per_s"] = {name: peak_flops(getattr(torch, name)) for name in ("float32", "bfloat16")}
        result["share_of_peak"] = result["engine"]["model_flops_per_s"] / result["peak_flops_per_s"][
            result["engine"]["dtype"]]
    if hf is not None:
        tokens_per_s = output_tokens / min(hf_runs)
        result["hf_generate"] = {"seconds": min(hf_runs), "output_tokens_per_s": tokens_per_s}
        result["ratio"] = result["engine"]["output_tokens_per_s"] / tokens_per_s
    print(json.dumps(result) if args.json else table(result, args))
    if args.profile:
        print(profile_decode(model_dir, requests, config))


def kv_label(r: dict) -> str:
    return ("" if r["kv_cache_dtype"] == "auto" else f", KV {r['kv_cache_dtype']}") + \
        ("" if r.get("quantization", "none") == "none" else f", weights {r['quantization']}")


def table(r: dict, args) -> str:
    e = r["engine"]
    lines = [f"workload: {r['num_requests']} requests, prompts {args.input_len[0]}-{args.input_len[1]}, "
             f"outputs {args.output_len[0]}-{args.output_len[1]} tokens, greedy, EOS ignored; {r['threads']} threads; "
             f"best of {r['repeat']} runs",
             f"{'':28}{'seconds':>10}{'output tok/s':>14}",
             f"{'tokenbus engine (' + e['dtype'] + kv_label(r) + ')':28}{e['seconds']:>10.2f}"
             f"{e['output_tokens_per_s']:>14.0f}"]
    if "hf_generate" in r:
        h = r["hf_generate"]
        lines += [f"{f'HF generate (batches of {args.hf_batch_size})':28}{h['seconds']:>10.2f}"
                  f"{h['output_tokens_per_s']:>14.0f}", f"ratio engine / HF: {r['ratio']:.2f}x"]
    share = e["overhead_share_batch_ge_32"]
    lines += [f"engine steps: {e['steps']}, mean batch {e['mean_batch_size']:.1f} requests",
              "step time outside the model forward at batch >= 32: "
              + ("n/a (no such step)" if share is None else f"{share:.1%}"),
              f"KV waste: {e['kv_waste_slots_per_request']:.1f} allocated-but-unused slots per running request "
              f"(block size {e['block_size']})",
              f"model FLOP/s: {e['model_flops_per_s'] / 1e9:.0f} GFLOP/s"]
    if "peak_flops_per_s" in r:
        peak = r["peak_flops_per_s"]
        lines += [f"the CPU's peak (one {PEAK_SIZE}-square matmul): float32 {peak['float32'] / 1e12:.2f} TFLOP/s, "
                  f"bfloat16 {peak['bfloat16'] / 1e12:.2f} TFLOP/s; the engine reaches {r['share_of_peak']:.1%} of "
                  f"its dtype's"]
    return "\n".join(lines)

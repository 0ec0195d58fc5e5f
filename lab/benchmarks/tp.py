"""`tokenbus bench-tp`: where a tensor-parallel step's time goes, for each --tp size in one run.

The workload: N requests of random tokens (the same for every size), greedy, EOS ignored, all
added at once. Each engine step is timed whole on rank 0, and rank 0's collectives are timed
inside it (on CUDA with a synchronize before and after each, so the time is the collective's own):
the two all-reduces per layer, the LM head's gather and the step-input broadcast to the
followers. Compute is the rest of the step. A collective's time on rank 0 includes waiting for a slower
rank to arrive; every rank logs its collectives, and the minimum over ranks of each collective is
its transfer time alone (the rank that arrived last did not wait), reported beside it.

On CPU the ranks share the machine's cores (each takes cores / tp threads), so TP=2 cannot be
faster than TP=1 here; what the CPU run shows is the cost of the collectives and the step
broadcast. On a multi-GPU node run e.g. `tokenbus bench-tp --tp 1 8 --model DIR`: the goal there
is all-reduce under 15% of the decode step.
"""
import json
import time

from lab.common.engine import workload
from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine


def measure(model_dir: str, tp: int, requests, args) -> dict:
    engine = LLMEngine(model_dir, EngineConfig(tensor_parallel_size=tp, max_num_seqs=args.num_requests,
                                               num_kv_blocks=args.num_kv_blocks))
    try:
        group = engine.runner.tp
        for i, (prompt, n) in enumerate(requests):
            engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        group.time_collectives(True)
        steps = []   # (phase, seconds, the step's first and past-last entries in the collective log)
        while engine.has_unfinished():
            sched, first, start = engine.scheduler, len(group.comm_log), time.perf_counter()
            decode = not sched.waiting and all(r.num_computed_tokens >= r.num_tokens - 1 for r in sched.running)
            engine.step()
            steps.append(("decode" if decode else "prefill", time.perf_counter() - start, first, len(group.comm_log)))
        logs = group.comm_logs()
        group.time_collectives(False)
    finally:
        engine.close()
    transfer = [min(times) for times in zip(*logs)]
    return {phase: summary([(t, sum(logs[0][a:b]), sum(transfer[a:b])) for p, t, a, b in steps if p == phase])
            for phase in ("prefill", "decode")}


def summary(times: list[tuple[float, float, float]]) -> dict:
    n = len(times)
    step, comm, transfer = (sum(column) / n for column in zip(*times))
    return {"steps": n, "step_ms": step * 1e3, "compute_ms": (step - comm) * 1e3, "comm_ms": comm * 1e3,
            "transfer_ms": transfer * 1e3, "comm_share": comm / step, "transfer_share": transfer / step}


def table(results: dict) -> str:
    lines = [f"{'tp':>3} {'phase':<8} {'steps':>6} {'step ms':>9} {'compute ms':>11} {'comm ms':>9} {'comm %':>7} "
             f"{'transfer ms':>12} {'transfer %':>11}"]
    for tp, phases in results.items():
        for phase, s in phases.items():
            lines.append(f"{tp:>3} {phase:<8} {s['steps']:>6} {s['step_ms']:>9.2f} {s['compute_ms']:>11.2f} "
                         f"{s['comm_ms']:>9.2f} {100 * s['comm_share']:>6.1f}% {s['transfer_ms']:>12.2f} "
                         f"{100 * s['transfer_share']:>10.1f}%")
    return "\n".join(lines)


def main(args) -> None:
    from workers.models.catalogue import resolve
    from workers.models.config import ModelConfig

    model_dir = resolve(args.model or args.size)
    requests = workload(args, ModelConfig.load(model_dir).vocab_size)
    results = {tp: measure(model_dir, tp, requests, args) for tp in args.tp}
    if args.json:
        print(json.dumps({"model": model_dir, "results": results}, indent=2))
    else:
        print(f"model {model_dir}, {args.num_requests} requests, input {args.input_len}, output {args.output_len}")
        print(table(results))

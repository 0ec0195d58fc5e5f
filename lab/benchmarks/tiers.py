"""The prefix cache's tiers on a multi-turn chat workload whose working set exceeds the KV pool: prefix hit
rate and TTFT with the pool alone, with a host-memory tier, with host memory and disk, and with a pool that
never evicts; then the first turns after a restart (a new engine) with and without the disk tier.

Conversations take turns round-robin, one request at a time on the offline engine (greedy, EOS ignored):
each turn's prompt is the whole history plus a new user message. TTFT is the time from add_request to the
step that gives the first token.

    python -m lab.benchmarks.tiers [--model smollm2-135m-instruct] [--json]
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time

from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.models import catalogue


def conversations(args, vocab: int) -> list[list[list[int]]]:
    """Each conversation's user messages, the first after a system prompt shared by all."""
    rng = random.Random(args.seed)
    system = [rng.randrange(16, vocab) for _ in range(args.system_len)]
    msg = lambda: [rng.randrange(16, vocab) for _ in range(rng.randint(*args.user_len))]  # noqa: E731
    return [[system + msg()] + [msg() for _ in range(args.turns - 1)] for _ in range(args.conversations)]


def turn(engine: LLMEngine, rid: str, prompt: list[int], reply: int) -> tuple[float, list[int]]:
    """(TTFT, output tokens) of one request run alone."""
    start = time.perf_counter()
    req = engine.add_request(rid, prompt, SamplingParams(max_tokens=reply, temperature=0, ignore_eos=True))
    ttft = None
    while engine.has_unfinished():
        engine.step()
        if ttft is None and req.num_output_tokens:
            ttft = time.perf_counter() - start
    return ttft, req.output_token_ids


def run(model: str, args, convs, turns: range, histories=None, **config) -> dict:
    engine = LLMEngine(model, EngineConfig(device="cpu", **config))
    histories = histories if histories is not None else [[] for _ in convs]
    ttfts = []
    before = engine.stats()
    start = time.perf_counter()
    for t in turns:
        for c, msgs in enumerate(convs):
            histories[c] += msgs[t]
            ttft, out = turn(engine, f"c{c}t{t}", histories[c], args.reply_len)
            histories[c] += out
            ttfts.append(ttft)
    s = engine.stats()
    queries, hits = s["prefix_cache_queries"] - before["prefix_cache_queries"], \
        s["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"pool_blocks": s["kv_blocks_total"], "hit_rate": hits / max(queries, 1),
            "ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_p90_ms": sorted(ttfts)[int(0.9 * len(ttfts))] * 1e3,
            "seconds": time.perf_counter() - start,
            **{k: v for k, v in s.items() if k.startswith(("kv_host_", "kv_disk_"))}}


def paired(model: str, args, convs, configs: dict) -> dict:
    """The runs of `configs` interleaved request by request, so that a machine shared with other work slows
    them alike: each request runs on every engine before the next."""
    engines = {name: LLMEngine(model, EngineConfig(device="cpu", **c)) for name, c in configs.items()}
    histories = {name: [[] for _ in convs] for name in configs}
    ttfts = {name: [] for name in configs}
    for t in range(args.turns):
        for c, msgs in enumerate(convs):
            for name, engine in engines.items():
                history = histories[name][c]
                history += msgs[t]
                ttft, out = turn(engine, f"c{c}t{t}", history, args.reply_len)
                history += out
                ttfts[name].append(ttft)
    out = {}
    for name, engine in engines.items():
        s, times = engine.stats(), ttfts[name]
        out[name] = {"pool_blocks": s["kv_blocks_total"],
                     "hit_rate": s["prefix_cache_hits"] / max(s["prefix_cache_queries"], 1),
                     "ttft_p50_ms": statistics.median(times) * 1e3,
                     "ttft_p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
                     **{k: v for k, v in s.items() if k.startswith(("kv_host_", "kv_disk_"))}}
        print(f"{name}: {out[name]}", file=sys.stderr)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=64)
    p.add_argument("--user-len", type=int, nargs=2, default=(64, 96))
    p.add_argument("--reply-len", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=64)
    p.add_argument("--host-memory", type=int, default=128 << 20, help="bytes of the host tier (with disk: an eighth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paired", action="store_true", help="interleave the runs request by request (a shared machine)")
    p.add_argument("--no-restart", action="store_true", help="skip the restart runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model = catalogue.resolve(args.model)
    vocab = LLMEngine(model, EngineConfig(device="cpu", num_kv_blocks=1)).model_cfg.vocab_size
    convs = conversations(args, vocab)
    every = range(args.turns)
    results = {}
    with tempfile.TemporaryDirectory() as disk:
        runs = {"unbounded pool": {"num_kv_blocks": 8 * args.pool_blocks},
                "pool alone": {"num_kv_blocks": args.pool_blocks},
                "pool + host": {"num_kv_blocks": args.pool_blocks, "kv_host_memory": args.host_memory},
                "pool + host + disk": {"num_kv_blocks": args.pool_blocks, "kv_host_memory": args.host_memory // 8,
                                       "kv_disk_dir": disk, "kv_disk_size": 1 << 30}}
        if args.paired:
            results.update(paired(model, args, convs, runs))
        for name, config in () if args.paired else runs.items():
            results[name] = run(model, args, convs, every, **config)
            print(f"{name}: {results[name]}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as disk:     # a restart: turns but the last, then a new engine for the last
        tiered = {**runs["pool + host + disk"], "kv_disk_dir": disk}
        histories = [[] for _ in convs]
        if not args.no_restart:
            run(model, args, convs, range(args.turns - 1), histories, **tiered)
        last = range(args.turns - 1, args.turns)
        for name, config in () if args.no_restart else (("restart, no disk", runs["pool alone"]),
                                                        ("restart, disk", tiered)):
            results[name] = run(model, args, convs, last, [list(h) for h in histories], **config)
            print(f"{name}: {results[name]}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{args.conversations} conversations × {args.turns} turns, pool {args.pool_blocks} blocks, {args.model}")
    print(f"{'run':<20} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p90':>10} {'host hits':>10} {'disk hits':>10}")
    for name, r in results.items():
        print(f"{name:<20} {r['hit_rate']:>9.1%} {r['ttft_p50_ms']:>8.1f}ms {r['ttft_p90_ms']:>8.1f}ms "
              f"{r.get('kv_host_hits', '-'):>10} {r.get('kv_disk_hits', '-'):>10}")


if __name__ == "__main__":
    main()

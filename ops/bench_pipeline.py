"""`tokenbus bench-pipeline`: the same workload through the whole pipeline (websocket → gateway →
JetStream → tokenizer → router → worker → core NATS → gateway → websocket, every stage its own
process) and through the offline engine in this process, side by side in one run.

Two measurements, the sides taking turns for --repeat rounds, each side's best round counting
(noise from the machine's neighbours only ever slows a run); each round draws fresh prompts (the
same for both sides) so no prefix cache carries over:
- throughput: N requests of random tokens at once, EOS ignored; output tokens per second;
- TTFT at low load: requests one at a time; the engine's TTFT is add_request → the step that
  yields the first token, the pipeline's is the client's send → the first delta frame. The
  difference of the medians is what the pipeline adds.
"""
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import orjson
import websockets

from ops.model_builder import default_model_dir
from ops.procs import free_port
from ops.up import Stack
from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine


def workload(seed: int, n: int, input_len, output_len, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(16, vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(n)]


# -- the engine side ------------------------------------------------------------------------------

def engine_throughput(engine: LLMEngine, requests) -> float:
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(n for _, n in requests) / (time.perf_counter() - start)


def engine_ttfts(engine: LLMEngine, requests) -> list[float]:
    ttfts = []
    for i, (prompt, n) in enumerate(requests):
        start = time.perf_counter()
        engine.add_request(f"l{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        first = None
        while engine.has_unfinished():
            if engine.step() and first is None:
                first = time.perf_counter()
        ttfts.append((first - start) * 1e3)
    return ttfts


# -- the pipeline side ----------------------------------------------------------------------------

def frame(i: int, prompt: list[int], n: int) -> str:
    return orjson.dumps({"type": "generate", "id": str(i), "prompt_token_ids": prompt, "max_tokens": n,
                         "temperature": 0, "ignore_eos": True}).decode()


async def pipeline_throughput(url: str, requests) -> float:
    async with websockets.connect(url, max_size=None) as ws:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(requests):
            await ws.send(frame(i, prompt, n))
        tokens, pending = 0, len(requests)
        while pending:
            msg = orjson.loads(await ws.recv())
            if msg["type"] == "error":
                raise RuntimeError(f"pipeline error: {msg}")
            if msg["type"] == "done":
                tokens += msg["usage"]["completion_tokens"]
                pending -= 1
        return tokens / (time.perf_counter() - start)


async def pipeline_ttfts(url: str, requests) -> list[float]:
    ttfts = []
    async with websockets.connect(url, max_size=None) as ws:
        for i, (prompt, n) in enumerate(requests):
            start, first = time.perf_counter(), None
            await ws.send(frame(i, prompt, n))
            while True:
                msg = orjson.loads(await ws.recv())
                if msg["type"] == "delta" and first is None:
                    first = time.perf_counter()
                if msg["type"] in ("done", "error"):
                    break
            ttfts.append((first - start) * 1e3)
    return ttfts


# -- the run --------------------------------------------------------------------------------------

def main(args) -> dict:
    model = args.model or str(default_model_dir())
    engine_args = ["--max-num-seqs", str(args.max_num_seqs)]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=args.max_num_seqs))
    vocab = engine.model_cfg.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(model, free_port(), Path(tmp), nats_port=free_port(), workers=1, worker_args=engine_args)
        try:
            stack.start()
            stack.wait_ready()
            results = rounds(args, engine, stack.url, vocab)
        finally:
            stack.stop()
    report = summary(args, results)
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if args.json else table(report))
    return report


def rounds(args, engine: LLMEngine, url: str, vocab: int) -> dict[str, list]:
    results = {"engine_tps": [], "pipeline_tps": [], "engine_ttft": [], "pipeline_ttft": []}
    warm = workload(args.seed - 1, 4, (16, 32), (4, 8), vocab)
    engine_throughput(engine, warm)
    asyncio.run(pipeline_throughput(url, warm))
    for r in range(args.repeat):
        batch = workload(args.seed + r, args.num_requests, args.input_len, args.output_len, vocab)
        single = workload(args.seed + 1000 + r, args.ttft_requests, args.input_len, (args.ttft_output_len,) * 2, vocab)
        results["engine_tps"].append(engine_throughput(engine, batch))
        results["pipeline_tps"].append(asyncio.run(pipeline_throughput(url, batch)))
        results["engine_ttft"].append(statistics.median(engine_ttfts(engine, single)))
        results["pipeline_ttft"].append(statistics.median(asyncio.run(pipeline_ttfts(url, single))))
    return results


def summary(args, results: dict[str, list]) -> dict:
    e_tps, p_tps = max(results["engine_tps"]), max(results["pipeline_tps"])
    e_ttft, p_ttft = min(results["engine_ttft"]), min(results["pipeline_ttft"])
    return {
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
                     "ttft_requests": args.ttft_requests, "max_num_seqs": args.max_num_seqs, "repeat": args.repeat},
        "engine_output_tokens_per_s": round(e_tps, 1),
        "pipeline_output_tokens_per_s": round(p_tps, 1),
        "throughput_ratio": round(p_tps / e_tps, 3),
        "engine_ttft_ms_median": round(e_ttft, 2),
        "pipeline_ttft_ms_median": round(p_ttft, 2),
        "ttft_added_ms_median": round(p_ttft - e_ttft, 2),
        "rounds": {k: [round(v, 2) for v in vs] for k, vs in results.items()},
    }


def table(r: dict) -> str:
    w = r["workload"]
    return "\n".join([
        f"workload: {w['num_requests']} requests at once, prompts {w['input_len'][0]}-{w['input_len'][1]} tokens, "
        f"outputs {w['output_len'][0]}-{w['output_len'][1]}; TTFT over {w['ttft_requests']} requests one at a time; "
        f"best of {w['repeat']} rounds",
        f"{'':24}{'engine':>12}{'pipeline':>12}{'ratio / added':>16}",
        f"{'output tokens/s':24}{r['engine_output_tokens_per_s']:>12.1f}{r['pipeline_output_tokens_per_s']:>12.1f}"
        f"{r['throughput_ratio']:>15.1%}",
        f"{'TTFT median (ms)':24}{r['engine_ttft_ms_median']:>12.2f}{r['pipeline_ttft_ms_median']:>12.2f}"
        f"{r['ttft_added_ms_median']:>+15.2f}",
    ])

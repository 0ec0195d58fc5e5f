"""`tokenbus bench-pipeline`: the same workload through the whole pipeline (websocket → gateway →
JetStream → tokenizer → router → worker → core NATS → gateway → websocket, every stage its own
process) and through the offline engine in this process (`LLM.generate`, as vLLM's offline
throughput benchmark uses its `LLM`: token ids in, tokens and text out), side by side in one run.

Two measurements, the sides taking turns for --repeat rounds, each side's best round counting
(noise from the machine's neighbours only ever slows a run); each round draws fresh prompts (the
same for both sides) so no prefix cache carries over:
- throughput: N requests of random tokens at once, EOS ignored; output tokens per second;
- TTFT at low load: requests one at a time, each prompt once on the engine and at once through
  the pipeline; the engine's TTFT is add_request → the step that yields the first token, the
  pipeline's is the client's send → the first delta frame. What the pipeline adds is the median
  of the per-request differences (the median over rounds of each round's median).
"""
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import orjson
import websockets

from ops.procs import free_port
from ops.up import Stack
from schemas.sampling import SamplingParams
from workers import LLM
from workers.engine.engine import LLMEngine
from workers.models.catalogue import resolve


def workload(seed: int, n: int, input_len, output_len, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(16, vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(n)]


# -- the engine side ------------------------------------------------------------------------------

def engine_throughput(llm: LLM, requests) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate([prompt for prompt, _ in requests], params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def engine_ttft(engine: LLMEngine, rid: str, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        if engine.step() and first is None:
            first = time.perf_counter()
    return (first - start) * 1e3


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


async def paired_ttfts(url: str, engine: LLMEngine, requests) -> list[tuple[float, float]]:
    """(engine, pipeline) TTFT of each request, the two taken back to back so that both see the same
    moment of the machine's noise."""
    pairs = []
    async with websockets.connect(url, max_size=None) as ws:
        for i, (prompt, n) in enumerate(requests):
            on_engine = engine_ttft(engine, f"l{i}", prompt, n)
            start, first = time.perf_counter(), None
            await ws.send(frame(i, prompt, n))
            while True:
                msg = orjson.loads(await ws.recv())
                if msg["type"] == "delta" and first is None:
                    first = time.perf_counter()
                if msg["type"] in ("done", "error"):
                    break
            pairs.append((on_engine, (first - start) * 1e3))
    return pairs


# -- the run --------------------------------------------------------------------------------------

def main(args) -> dict:
    model = resolve(args.model or "tiny")
    engine_args = ["--max-num-seqs", str(args.max_num_seqs)]
    llm = LLM(model, max_num_seqs=args.max_num_seqs)
    vocab = llm.engine.model_cfg.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(model, free_port(), Path(tmp), nats_port=free_port(), workers=1, worker_args=engine_args)
        try:
            stack.start()
            stack.wait_ready()
            results = rounds(args, llm, stack.url, vocab)
        finally:
            stack.stop()
    report = summary(args, results)
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if args.json else table(report))
    return report


def rounds(args, llm: LLM, url: str, vocab: int) -> dict[str, list]:
    results = {"engine_tps": [], "pipeline_tps": [], "engine_ttft": [], "pipeline_ttft": [], "ttft_added": []}
    warm = workload(args.seed - 1, 4, (16, 32), (4, 8), vocab)
    engine_throughput(llm, warm)
    asyncio.run(pipeline_throughput(url, warm))
    for r in range(args.repeat):
        batch = workload(args.seed + r, args.num_requests, args.input_len, args.output_len, vocab)
        single = workload(args.seed + 1000 + r, args.ttft_requests, args.input_len, (args.ttft_output_len,) * 2, vocab)
        results["engine_tps"].append(engine_throughput(llm, batch))
        results["pipeline_tps"].append(asyncio.run(pipeline_throughput(url, batch)))
        pairs = asyncio.run(paired_ttfts(url, llm.engine, single))
        results["engine_ttft"].append(statistics.median(e for e, _ in pairs))
        results["pipeline_ttft"].append(statistics.median(p for _, p in pairs))
        results["ttft_added"].append(statistics.median(p - e for e, p in pairs))
    return results


def summary(args, results: dict[str, list]) -> dict:
    e_tps, p_tps = max(results["engine_tps"]), max(results["pipeline_tps"])
    e_ttft, p_ttft = min(results["engine_ttft"]), min(results["pipeline_ttft"])
    added = statistics.median(results["ttft_added"])
    return {
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
                     "ttft_requests": args.ttft_requests, "max_num_seqs": args.max_num_seqs, "repeat": args.repeat},
        "engine_output_tokens_per_s": round(e_tps, 1),
        "pipeline_output_tokens_per_s": round(p_tps, 1),
        "throughput_ratio": round(p_tps / e_tps, 3),
        "engine_ttft_ms_median": round(e_ttft, 2),
        "pipeline_ttft_ms_median": round(p_ttft, 2),
        "ttft_added_ms_median": round(added, 2),
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

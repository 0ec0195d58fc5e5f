"""`tokenbus bench-peers`: the tokenbus engine against the engines a user could pick instead, on one
workload, from one client, in one run.

Engines (--engines), each in turn, alone on the machine:
- engine, engine-bf16: the tokenbus engine offline, stepped as LLM.generate steps it (a detokenizer
  per request), in float32 / bfloat16;
- pipeline-ws, pipeline-openai: the whole stack of `tokenbus up` (one worker), over the websocket
  protocol and over the OpenAI API (/v1/completions);
- hf-generate, hf-generate-bf16: HF transformers' `generate` (float32, bfloat16) in static batches of
  the concurrency (left-padded, each batch run for its longest output, as lab/benchmarks/engine.py
  runs it); hf-cb: HF's continuous batching
  (`init_continuous_batching`, requests added and collected as they end);
- llama-f32, llama-f16, llama-bf16: llama.cpp's `llama-server` (lab/peers/llamacpp.py: built once from
  the llama-cpp-python sdist) serving our checkpoint written as GGUF in that type, with --parallel
  equal to the concurrency and each slot's context the workload's longest request; llama-q4_1: the
  same server on the catalogue's own Q4_1 file, as a user would run it (another precision);
- openvino, openvino-int8: OpenVINO GenAI's ContinuousBatchingPipeline (lab/peers/openvino_peer.py) on
  our checkpoint exported by optimum-intel with fp32 / int8 weights, in a process of its own stepped as
  the engine is; it computes in the precision OpenVINO picks for the CPU (bf16 where the CPU has bf16
  instructions), which its row says, read from the compiled model.

Workloads (--workloads), the same token ids for every engine: token-id prompts where the engine
takes them (/v1/completions' and the websocket's token-id prompts, the engine's and HF's ids),
greedy, EOS ignored, every request run to its output length:
- concurrent: --num-requests random prompts, --concurrency in flight;
- single: one request at a time, --single-input-len prompts: TTFT and TPOT unloaded;
- chat: --conversations of --turns turns behind one shared system prompt, --chat-concurrency
  conversations at a time; a turn's prompt is the history (the reply in it a fixed stand-in, so that
  every engine gets the same prompts), sent when the conversation's previous turn ended.
A client keeps `concurrency` conversations in flight (a closed loop), over HTTP or websocket for the
servers and in the engine's own loop for the engines in a process (OpenVINO's too); HF generate's
static batches start together. Each round (--repeat) draws fresh prompts, the same for every engine,
so that no prefix cache carries over; an engine's best round counts (noise from the machine's
neighbours only ever slows a run).

Per engine: output tokens/s (output tokens / the seconds from the first request sent to the last
token), TTFT and TPOT p50/p99 (TPOT = (end − first token) / (output tokens − 1)), peak RSS, the
ratio to llama.cpp at the same precision, and the share of the CPU's matmul peak that its FLOPs
reach (the ceiling). Peak RSS is the kernel's high-water mark (VmHWM) summed over the engine's
processes: the spawned process that ran an in-process engine (its imports, weights and runs), the
OpenVINO process, the llama-server process, every process of the stack (nats-server, tokenizer, router,
worker, gateway); each engine gets fresh processes for each workload.
"""
import asyncio
import collections
import math
import random
import resource
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from lab.common.clients import HttpClient, WsClient
from lab.common.results import Result, fmt, ratio, show
from lab.common.turns import BLOCK_SIZE, OPTIONS, EngineLoop, Turn, Workload, closed_loop, figures, warmup
from lab.peers import llamacpp, openvino_peer
from workers.models import catalogue


@dataclass(frozen=True, slots=True)
class Engine:
    precision: str         # fp32, bf16, f16, q4_1, int8 (weights)
    about: str


ENGINES = {
    "engine": Engine("fp32", "tokenbus engine, offline"),
    "engine-bf16": Engine("bf16", "tokenbus engine, offline, bf16"),
    "pipeline-ws": Engine("fp32", "tokenbus pipeline, websocket"),        # its row: the worker's default dtype
    "pipeline-openai": Engine("fp32", "tokenbus pipeline, OpenAI API"),
    "hf-generate": Engine("fp32", "HF generate, static batches"),
    "hf-generate-bf16": Engine("bf16", "HF generate, static batches, bf16"),
    "hf-cb": Engine("fp32", "HF continuous batching"),
    "llama-f32": Engine("fp32", "llama.cpp server, F32 GGUF"),
    "llama-f16": Engine("f16", "llama.cpp server, F16 GGUF"),
    "llama-bf16": Engine("bf16", "llama.cpp server, BF16 GGUF"),
    "llama-q4_1": Engine("q4_1", "llama.cpp server, original Q4_1"),
    "openvino": Engine("bf16", "OpenVINO GenAI CB, fp32 weights"),     # its row: the precision it computed in
    "openvino-int8": Engine("int8", "OpenVINO GenAI CB, int8 weights"),
}
PEAK_OF = {"fp32": "fp32", "bf16": "bf16", "f16": "bf16",   # the matmul peak an engine's precision can reach
           "int8": "bf16"}      # int8 weights: OpenVINO infers in bf16 (its int8 matmuls: the row's note)


# -- workloads ------------------------------------------------------------------------------------

def build(name: str, args, vocab: int, seed: int) -> Workload:
    rng = random.Random(f"{name}:{seed}")

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]     # no special tokens

    if name == "concurrent":
        return Workload(name, [[Turn(ids(rng.randint(*args.input_len)), args.output_len)]
                               for _ in range(args.num_requests)], args.concurrency)
    if name == "single":
        return Workload(name, [[Turn(ids(args.single_input_len), args.single_output_len)]
                               for _ in range(args.single_requests)], 1)
    system, conversations = ids(args.system_len), []
    for _ in range(args.conversations):
        history, turns = system, []
        for _ in range(args.turns):
            prompt = history + ids(rng.randint(*args.user_len))
            turns.append(Turn(prompt, args.reply_len))
            history = prompt + ids(args.reply_len)              # the reply's stand-in
        conversations.append(turns)
    return Workload(name, conversations, args.chat_concurrency)


def describe(w: Workload) -> str:
    prompts = [len(t.prompt) for t in w.turns]
    outputs = sorted({t.max_tokens for t in w.turns})
    shape = f"{len(w.conversations)} conversations of {len(w.conversations[0])} turns" if w.name == "chat" \
        else f"{len(prompts)} requests"
    return (f"{w.name}: {shape}, {w.concurrency} at a time, prompts {min(prompts)}-{max(prompts)} token ids, "
            f"outputs {'/'.join(map(str, outputs))}; greedy, EOS ignored")


# -- the two drivers: a client over the network, a loop around an engine in this process ------------

async def drive(workload: Workload, send) -> tuple[list[Result], float]:
    """Runs the workload through `send` (a Turn -> its Result, awaited): `concurrency` clients, each
    taking the next conversation and sending its turns in order, a turn when the one before it ended.
    The results and the seconds from the first send to the last end."""
    queue = collections.deque(workload.conversations)
    results: list[Result] = []

    async def client() -> None:
        while queue:
            for turn in queue.popleft():
                results.append(await send(turn))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(workload.concurrency, len(queue)))))
    return results, time.perf_counter() - start


# -- the figures ----------------------------------------------------------------------------------

def best(runs: list[dict]) -> dict:
    """The fastest round (and which it was), with every round's throughput beside it."""
    i = max(range(len(runs)), key=lambda k: runs[k]["output_tokens_per_s"])
    return {**runs[i], "round": i, "rounds_output_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}


def model_flops(cfg, workload: Workload) -> float:
    """The workload's forward FLOPs, no prefix cache (ModelConfig.request_flops of every turn)."""
    return float(sum(cfg.request_flops(len(t.prompt), t.max_tokens) for t in workload.turns))


def peak_gflops(dtype: str = "float32", n: int = 2048) -> float:
    """The CPU's matmul peak as measured here, in GFLOP/s: ops.plan.peak_flops, an n×n
    product in one prepacked oneDNN call in `dtype` (float32, bfloat16), on torch's threads."""
    import torch

    from ops.plan import peak_flops

    return peak_flops(getattr(torch, dtype), size=n) / 1e9


# -- engines in a process of their own ------------------------------------------------------------

class HfContinuous:
    """HF's continuous batching: requests added to its manager, their results collected as they end
    (each with its tokens' timestamps)."""

    def __init__(self, model: str, workload: Workload):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        from workers.models.reference import hf_model

        page = 256
        config = ContinuousBatchingConfig(
            page_size=page, num_blocks=workload.concurrency * math.ceil(workload.context / page) + 1,
            max_requests_per_batch=workload.concurrency, max_batch_tokens=2048)
        greedy = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=workload.context)
        self.manager = hf_model(model).init_continuous_batching(greedy, config)
        self.manager.start()
        self.live: dict[str, tuple[int, Result]] = {}

    def submit(self, key: int, turn: Turn) -> None:
        self.live[str(key)] = (key, Result(time.perf_counter(), prompt_tokens=len(turn.prompt)))
        self.manager.add_request(turn.prompt, str(key), max_new_tokens=turn.max_tokens, record_timestamps=True,
                                 eos_token_id=-1)

    def poll(self) -> list[tuple[int, Result]]:
        out = self.manager.get_result(timeout=1)
        if out is None:
            if not self.manager.is_running():
                raise RuntimeError("HF's continuous batching thread stopped")
            return []
        if not out.is_finished():
            return []
        key, r = self.live.pop(out.request_id)
        r.end, r.chunks, r.output_tokens = time.perf_counter(), list(out.timestamps or ()), len(out.generated_tokens)
        r.error = out.error and "hf_error"
        return [(key, r)]

    def close(self) -> None:
        self.manager.stop(block=True, timeout=10)


class HfStatic:
    """HF generate in static batches of the concurrency: a batch's requests start together; each
    request's tokens are timed as generate streams the batch's steps."""

    def __init__(self, model: str, workload: Workload, dtype: str = "float32"):
        import torch

        from workers.models.reference import hf_model

        self.model = hf_model(model, getattr(torch, dtype))

    def run(self, workload: Workload) -> tuple[list[Result], float]:
        convs, c, results = workload.conversations, workload.concurrency, []
        start = time.perf_counter()
        for g in range(0, len(convs), c):
            group = convs[g:g + c]
            for i in range(max(map(len, group))):             # a group's i-th turns, one batch
                results += self.batch([conv[i] for conv in group if i < len(conv)])
        return results, time.perf_counter() - start

    def batch(self, turns: list[Turn]) -> list[Result]:
        from lab.common.engine import hf_generate

        clock, sent = Clock(), time.perf_counter()
        hf_generate(self.model, [(t.prompt, t.max_tokens) for t in turns], clock)
        return [Result(sent, chunks=clock.times[1:t.max_tokens + 1], end=clock.times[t.max_tokens],
                       prompt_tokens=len(t.prompt), output_tokens=t.max_tokens) for t in turns]

    def close(self) -> None:
        pass


class Clock:
    """A streamer for HF generate (its put/end): put() gets the prompt, then each step's tokens; the
    times they came."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def local(name: str, model: str, rounds: list[Workload], threads: int) -> dict:
    """Runs in a spawned process: the engine `name` on the warm-up, then on each round."""
    import torch

    torch.set_num_threads(threads)
    first = rounds[0]
    shape = Workload(first.name, [[t] for w in rounds for t in w.turns], first.concurrency)  # sized for every round
    if name in ("engine", "engine-bf16"):
        engine = EngineLoop(model, shape, "bfloat16" if name == "engine-bf16" else "float32")
    elif name == "hf-cb":
        engine = HfContinuous(model, shape)
    else:
        engine = HfStatic(model, shape, "bfloat16" if name == "hf-generate-bf16" else "float32")
    run = engine.run if isinstance(engine, HfStatic) else lambda w: closed_loop(w, engine)
    try:
        run(warmup(first, vocab_size(model)))
        runs = [figures(w, *run(w)) for w in rounds]
    finally:
        engine.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"runs": runs, "peak_rss_bytes": rss, "rss_of": "the process that ran it (spawned for this workload)"}


def in_process(name: str, model: str, rounds: list[Workload], threads: int) -> dict:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(local, name, model, rounds, threads).result()


# -- engines behind a server ----------------------------------------------------------------------

def served(rounds: list[Workload], connect, vocab: int) -> list[dict]:
    """The warm-up, then each round, each through a fresh client."""
    asyncio.run(through(connect, warmup(rounds[0], vocab)))
    return [figures(w, *asyncio.run(through(connect, w))) for w in rounds]


async def through(connect, w: Workload) -> tuple[list[Result], float]:
    """drive() with a client from `connect()` (an opened client, and the function that sends a Turn
    with it), closed after."""
    client, send = await connect()
    try:
        return await drive(w, send)
    finally:
        await client.close()


def openai(url: str):
    """A connect() for /v1/completions with token-id prompts."""
    async def connect():
        client = HttpClient(url, None, None, OPTIONS, endpoint="/completions")
        await client.open()
        return client, lambda t: client.send({"prompt": t.prompt, "max_tokens": t.max_tokens})
    return connect


def websocket(url: str, concurrency: int):
    async def connect():
        client = WsClient(url, min(concurrency, 16), None, OPTIONS)
        await client.open()
        return client, lambda t: client.send({"prompt_token_ids": t.prompt, "max_tokens": t.max_tokens})
    return connect


def pipeline(name: str, model: str, rounds: list[Workload], threads: int, vocab: int, data_dir: Path) -> dict:
    from ops.procs import free_port
    from ops.up import Stack

    w = rounds[0]
    context = max(r.context for r in rounds)
    worker = ["--max-num-seqs", str(w.concurrency), "--block-size", str(BLOCK_SIZE), "--threads", str(threads),
              "--num-kv-blocks", str(w.concurrency * math.ceil(context / BLOCK_SIZE))]
    stack = Stack(model, free_port(), data_dir / f"{name}-{w.name}", nats_port=free_port(), workers=1,
                  worker_args=worker)
    try:
        stack.start()
        stack.wait_ready()
        connect = websocket(stack.url, w.concurrency) if name == "pipeline-ws" else openai(stack.http)
        runs = served(rounds, connect, vocab)
        rss = sum(tree_peak_rss(p.pid) for p in stack.children.values())
    finally:
        stack.stop()
    return {"runs": runs, "peak_rss_bytes": rss, "rss_of": "every process of the stack, summed",
            "precision": default_precision()}


def default_precision() -> str:
    """The precision a worker runs in by default here: bf16 on a CPU with bf16 instructions, else fp32."""
    import torch

    from workers.engine.engine import pick_dtype

    return "bf16" if pick_dtype(None, "float32", torch.device("cpu")) == torch.bfloat16 else "fp32"


class Llama:
    """llama-server, built (or its build's failure) once per run."""

    def __init__(self, binary: str | None, log_dir: Path):
        self.binary, self.error, self.log_dir = Path(binary) if binary else None, None, log_dir

    def server(self) -> Path:
        if self.binary is None and self.error is None:
            try:
                self.binary = llamacpp.ensure_server(log=lambda line: print(f"bench-peers: {line}", flush=True))
            except (llamacpp.PeerError, OSError) as e:
                self.error = f"cannot build llama-server: {e}"
        if self.error:
            raise llamacpp.PeerError(self.error)
        return self.binary

    def run(self, name: str, model_name: str, model: str, rounds: list[Workload], threads: int, vocab: int) -> dict:
        """Its figures with llama-server's defaults; if those crash it at load, with --no-repack (no
        AMX or repacked weights: the Q4_1 file crashed the AMX path on a Sapphire Rapids CPU)."""
        try:
            return self.serve(name, model_name, model, rounds, threads, vocab)
        except llamacpp.Crashed as e:
            first = str(e).splitlines()[0].rstrip(":")
            result = self.serve(name, model_name, model, rounds, threads, vocab, ("--no-repack",))
            return {**result, "note": f"its defaults crashed it at load ({first}): run with --no-repack"}

    def serve(self, name: str, model_name: str, model: str, rounds: list[Workload], threads: int, vocab: int,
              extra: tuple[str, ...] = ()) -> dict:
        kind = name.removeprefix("llama-")
        if model_name not in catalogue.CATALOGUE:
            raise llamacpp.PeerError(f"llama.cpp serves a catalogue model here (its GGUF's tokenizer metadata is "
                                     f"copied), not {model_name}")
        binary = self.server()
        weights = llamacpp.original(model_name) if kind == "q4_1" else llamacpp.converted(model_name, model, kind)
        w = rounds[0]
        slot = max(r.context for r in rounds) + 8                # llama.cpp counts a few more than prompt + output
        log = self.log_dir / f"{name}-{w.name}.log"
        with llamacpp.serve(binary, weights, w.concurrency, slot, threads, log, extra) as (proc, url):
            runs = served(rounds, openai(url), vocab)
            rss = tree_peak_rss(proc.pid)
        return {"runs": runs, "peak_rss_bytes": rss, "rss_of": "the llama-server process", "gguf": str(weights),
                "flags": {"parallel": w.concurrency, "ctx": w.concurrency * slot, "threads": threads,
                          "extra": list(extra)}}


def tree_peak_rss(pid: int) -> int:
    """Bytes: the peak resident set (VmHWM) of pid and of each of its descendants, summed."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += sum(tree_peak_rss(int(c)) for c in (task / "children").read_text().split())
    except OSError:                                       # it exited meanwhile
        pass
    return total


# -- the run --------------------------------------------------------------------------------------

def vocab_size(model: str) -> int:
    from workers.models.config import ModelConfig

    return ModelConfig.load(model).vocab_size


def measure(name: str, args, model: str, rounds: list[Workload], llama: Llama, data_dir: Path, vocab: int) -> dict:
    """One engine on one workload's rounds: its figures, or the reason it could not run."""
    threads = args.threads
    try:
        if name.startswith("llama-"):
            result = llama.run(name, args.model, model, rounds, threads, vocab)
        elif name.startswith("pipeline-"):
            result = pipeline(name, model, rounds, threads, vocab, data_dir)
        elif name.startswith("openvino"):
            result = openvino_peer.measure(name, args.model, model, rounds, threads, vocab, data_dir,
                                           log=lambda line: print(f"bench-peers: {line}", flush=True))
        else:
            result = in_process(name, model, rounds, threads)
    except llamacpp.PeerError as e:
        return {"error": str(e)}
    except Exception as e:                                  # a peer that cannot run is reported, the rest go on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    return {**best(result.pop("runs")), **result}


def compare(rows: dict[str, dict], flops: list[float], peaks: dict[str, float]) -> None:
    """Adds each row's precision (its engine's, unless the row measured its own), its ratio to llama.cpp
    at that precision and its share of the matmul peak (its best round's FLOPs, of `flops` by round, per
    second)."""
    bases = {ENGINES[n].precision: r for n, r in rows.items() if n.startswith("llama-") and "error" not in r}
    for name, r in rows.items():
        if "error" in r:
            continue
        precision = r.setdefault("precision", ENGINES[name].precision)
        base = bases.get(precision)
        r["vs_llama_cpp"] = None if base is None else {
            "output_tokens_per_s": ratio(r["output_tokens_per_s"], base["output_tokens_per_s"]),
            **{f"{k}_p50": ratio(r[k]["p50"], base[k]["p50"]) for k in ("ttft_ms", "tpot_ms")}}
        peak = peaks.get(PEAK_OF.get(precision, ""))
        r["share_of_peak"] = round(flops[r["round"]] / r["seconds"] / (peak * 1e9), 4) if peak else None


def main(args) -> dict:
    from workers.models.config import ModelConfig

    model = catalogue.resolve(args.model)
    cfg = ModelConfig.load(model)
    peaks = {"fp32": args.peak_gflops or peak_gflops("float32"),
             "bf16": args.peak_gflops_bf16 or peak_gflops("bfloat16")}
    report = {"model": model, "threads": args.threads, "repeat": args.repeat, "engines": args.engines,
              "peak_gflops": {k: round(v, 1) for k, v in peaks.items()},
              "peak_measured": {"fp32": not args.peak_gflops, "bf16": not args.peak_gflops_bf16},
              "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.data_dir or tmp)
        llama = Llama(args.llama_server, llamacpp.peers_dir() / "logs")
        for wname in args.workloads:
            rounds = [build(wname, args, cfg.vocab_size, args.seed + r) for r in range(args.repeat)]
            print(f"bench-peers: {describe(rounds[0])}", flush=True)
            rows = {}
            for name in args.engines:
                rows[name] = measure(name, args, model, rounds, llama, data_dir, cfg.vocab_size)
                print(f"bench-peers:   {name}: {line(rows[name])}", flush=True)
            flops = [model_flops(cfg, w) for w in rounds]
            compare(rows, flops, peaks)
            report["workloads"][wname] = {"about": describe(rounds[0]), "flops": flops[0],
                                          "output_tokens": sum(t.max_tokens for t in rounds[0].turns),
                                          "engines": rows}
    report["llama_cpp_build"] = llamacpp.build_info()
    report["ceiling"] = ceiling(cfg, report)
    show(report, args, table, plot)
    return report


def ceiling(cfg, report: dict) -> dict:
    """The model's FLOPs per token and the output tokens/s the measured peaks would allow at most."""
    weights = cfg.matmul_params()
    per_output = {w: r["flops"] / r["output_tokens"] for w, r in report["workloads"].items()}
    return {"non_embedding_weights": weights, "dense_flops_per_token": 2 * weights,
            "lm_head_flops_per_sampled_token": 2 * cfg.hidden_size * cfg.vocab_size,
            "flops_per_output_token": {w: round(f) for w, f in per_output.items()},
            "max_output_tokens_per_s": {w: {p: round(g * 1e9 / f, 1) for p, g in report["peak_gflops"].items()}
                                        for w, f in per_output.items()}}


def line(r: dict) -> str:
    if "error" in r:
        return f"unavailable: {r['error'].splitlines()[0]}"
    return (f"{r['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {fmt(r['ttft_ms']['p50'])} ms, "
            f"TPOT p50 {fmt(r['tpot_ms']['p50'])} ms{shortfall(r)}")


def shortfall(r: dict) -> str:
    """What did not run: tokens missing and failed requests by error code; empty when nothing."""
    if r["output_tokens"] == r["output_tokens_asked"] and not r["failed"]:
        return ""
    errors = "".join(f", {code}: {n}" for code, n in r["errors"].items())
    return f"  ({r['output_tokens']} of {r['output_tokens_asked']} tokens; {r['failed']} failed{errors})"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def table(report: dict) -> str:
    c = report["ceiling"]
    peaks = report["peak_gflops"]
    measured = ", ".join(f"{p} {g:.0f}" + ("" if report["peak_measured"][p] else " (given)") for p, g in peaks.items())
    lines = [f"bench-peers: {report['model']}, {report['threads']} threads, best of {report['repeat']} rounds",
             f"matmul peak (GFLOP/s): {measured}; the model: {c['dense_flops_per_token'] / 1e6:.0f} MFLOP per token "
             f"(2 × {c['non_embedding_weights'] / 1e6:.1f} M non-embedding weights), lm_head "
             f"{c['lm_head_flops_per_sampled_token'] / 1e6:.1f} MFLOP per sampled token, plus attention"]
    build = report.get("llama_cpp_build")
    if build:
        lines.append(f"llama-server: {build['sdist']}, built in {build['seconds']:.0f} s with {build['jobs']} jobs "
                     f"({' '.join(build['flags'])})")
    head = (f"{'':34}{'prec':>6}{'tok/s':>9}{'vs llama':>9}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}"
            f"{'peak RSS':>10}{'% peak':>8}")
    for wname, w in report["workloads"].items():
        per = c["flops_per_output_token"][wname]
        most = c["max_output_tokens_per_s"][wname]
        lines += ["", w["about"],
                  f"ceiling: {per / 1e6:.0f} MFLOP per output token → at most "
                  + ", ".join(f"{v:.0f} tok/s at the {p} peak" for p, v in most.items()), head]
        for name, r in w["engines"].items():
            label = f"{name} ({ENGINES[name].about})"[:33]
            if "error" in r:
                lines.append(f"{label:34}unavailable: {r['error'].splitlines()[0]}")
                continue
            vs = r["vs_llama_cpp"]
            lines.append(f"{label:34}{r['precision']:>6}{r['output_tokens_per_s']:>9.1f}"
                         f"{fmt(vs and vs['output_tokens_per_s'], '.2f') + ('x' if vs else ''):>9}"
                         f"{fmt(r['ttft_ms']['p50']):>10}{fmt(r['ttft_ms']['p99']):>9}"
                         f"{fmt(r['tpot_ms']['p50'], '.2f'):>10}{fmt(r['tpot_ms']['p99'], '.2f'):>8}"
                         f"{r['peak_rss_bytes'] / 2**20:>8.0f}Mi"
                         f"{percent(r['share_of_peak']):>8}{shortfall(r)}")
            if "note" in r:
                lines.append(f"{'':34}({r['note']})")
    lines += ["", "tok/s: output tokens per second; TTFT, TPOT in ms; vs llama: tok/s over llama.cpp's at the same "
              "precision; peak RSS: VmHWM summed over the engine's processes; % peak: the workload's FLOPs per second "
              "over the matmul peak at the engine's precision (fp32; bf16 for bf16, f16 and int8 weights)"]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Output tokens/s and TPOT p50 per engine, a row of bars per workload (PNG or SVG by the name)."""
    from matplotlib.figure import Figure

    workloads = report["workloads"]
    fig = Figure(figsize=(13, 3.2 * len(workloads)))
    axes = fig.subplots(len(workloads), 2, squeeze=False)
    for (tput, tpot), (wname, w) in zip(axes, workloads.items()):
        rows = {n: r for n, r in w["engines"].items() if "error" not in r}
        names = list(rows)
        colours = ["tab:blue" if n.startswith(("engine", "pipeline")) else "tab:orange" if n.startswith("llama")
                   else "tab:gray" for n in names]
        tput.barh(names, [rows[n]["output_tokens_per_s"] for n in names], color=colours)
        tput.set(title=f"{wname}: output tokens/s", xlabel="tokens/s")
        tput.invert_yaxis()
        tpot.barh(names, [rows[n]["tpot_ms"]["p50"] or 0 for n in names], color=colours)
        tpot.set(title=f"{wname}: TPOT p50", xlabel="ms")
        tpot.invert_yaxis()
        for ax in (tput, tpot):
            ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)

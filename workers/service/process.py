"""The worker process: its flags, the engine built on the step thread, the service wired around it.

`python -m workers.service --model M ...` runs `main` (workers/service/__main__.py). Runs on the main
thread: argparse, then the event loop (`serve`); the engine is built and warmed up on the step thread."""
import argparse
import dataclasses
import gc
import os
import sys

import torch

import bus
from bus import lifecycle, tracing
from bus.lifecycle import Life
from bus.log import configure
from schemas import subjects
from schemas.messages import SCHEDULING_POLICIES
from schemas.revision import revision as revision_of
from schemas.sampling import SamplingParams
from workers import faults
from workers.engine import speculative
from workers.engine.engine import ENGINES, KV_CACHE_DTYPES, EngineConfig, LLMEngine
from workers.engine.roofline import GPUS
from workers.layers.quant import QUANTIZATIONS
from workers.models import catalogue
from workers.service.registry import last_suspect
from workers.service.worker import WorkerService
from workers.stepper import Stepper


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.service", description="A tokenbus worker.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--model", required=True, help="an HF checkpoint directory, a GGUF file or a model name "
                   "(smollm2-135m-instruct, pulled on first use; tiny or small, built)")
    p.add_argument("--id", default=f"w-{os.getpid()}", help="worker id (a subject token)")
    p.add_argument("--served-model-name", help="the name of the model it serves, which requests name (default: the "
                   "--model directory's or file's name)")
    p.add_argument("--dtype", help="float32, bfloat16, ... (default: bfloat16 on a CPU with AMX or AVX-512 BF16, "
                                     "else float32; the checkpoint's on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs: requests run in arrival order (the default); priority: by each request's priority, "
                        "lower first, then arrival, a waiting request preempting running ones of a lower priority; "
                        "fair: by priority, then each tenant's share of generated tokens by its key's weight "
                        "(a virtual token counter per tenant)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--kv-cache-memory", type=int, help="bytes for the KV pool, when --num-kv-blocks is not given "
                   "(default: 1 GiB on CPU, 90%% of the free GPU memory on CUDA)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV pool's dtype: auto (the model's, the default), int8 or fp8 (e4m3), each row with "
                        "its own scale: about half the bytes of bfloat16 per token, a quarter of float32's")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="the linear weights: none (the checkpoint's, the default); int8, quantized at load with a "
                        "scale per output channel; w4a16 is read from a checkpoint (a compressed-tensors W4A16 one "
                        "is served as its 4-bit codes with none too); gguf keeps a GGUF file's Q8_0 and Q4_0 linear "
                        "weights quantized, other types dequantized as with none")
    p.add_argument("--kv-host-memory", type=int, metavar="BYTES",
                   help="a host-memory tier of the prefix cache below the KV pool: blocks evicted from the pool are "
                        "copied here and copied back on a hit, not recomputed (default: none)")
    p.add_argument("--kv-disk-dir", metavar="DIR", help="a disk tier below the host tier (with --kv-disk-size): block "
                   "files, checksummed, that a restarted worker finds again (default: none)")
    p.add_argument("--kv-disk-size", type=int, metavar="BYTES", help="the disk tier's block files at most, in bytes")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="ranks of this replica: this process and tp-1 followers it starts; with --engine mock, the "
                        "simulated tensor-parallel size (N GPUs' memory, FLOPs and bandwidth; no ranks are started)")
    p.add_argument("--engine", choices=ENGINES, default="model",
                   help="model: run the model (the default); mock: no model, the real scheduler and KV cache, each "
                        "step held for the roofline's time on --tp × --mock-gpu, tokens a hash of the request's "
                        "seed and position (docs/engine.md#the-mock-engine)")
    p.add_argument("--mock-gpu", choices=list(GPUS), default="h100-sxm",
                   help="with --engine mock: the GPU preset whose roofline times the steps (default h100-sxm)")
    p.add_argument("--threads", type=int, help="torch threads for the engine (default: torch's, one per core); "
                   "the tokens do not depend on it")
    p.add_argument("--chunk-rate", type=subjects.chunk_rate, default=subjects.CHUNK_RATE,
                   help=f"token chunks per second this worker publishes at most, all streams together: with more "
                        f"streams, each chunk carries several steps' tokens, at most {subjects.MAX_CHUNK_INTERVAL:g} s "
                        f"apart; 0: one chunk per stream per step (default {subjects.CHUNK_RATE:g})")
    p.add_argument("--speculative", type=speculative.argument, metavar="SPEC",
                   help="speculative decoding: ngram[:K] (prompt lookup) or draft:DIR[:K] (a smaller checkpoint "
                        "with the same tokenizer), K draft tokens per request at most (default 4); the tokens are "
                        "the same as without it (default: off)")
    p.add_argument("--role", choices=subjects.ROLES, default="both",
                   help="both: prefill and decode every request it takes (default); prefill: compute long prompts "
                        "and their first token, then hand each request to a decode worker, which pulls the KV; "
                        "decode: continue handed-off requests, and prefill short prompts itself")
    p.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"), default="recompute",
                   help="a decode worker whose KV pull fails (a timeout, a gone prefill worker): recompute what it "
                        "lacks (default), or fail the request with an error naming the transfer")
    p.add_argument("--no-speculative-adaptive", action="store_true",
                   help="with --speculative: always K draft tokens, not the K each step's cost and the measured "
                        "acceptance favour")
    lifecycle.add_arguments(p)
    p.add_argument("--step-trace", metavar="PATH", help="an operator's diagnostic, off unless given: appends a JSON "
                   "line per engine step to PATH (its shape and seconds; `tokenbus sim-check --steps` compares them "
                   "with the simulator's)")
    faults.add_flag(p)
    return p


def engine_config(args) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        kv_cache_memory=args.kv_cache_memory,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        tensor_parallel_size=1 if args.engine == "mock" else args.tp,     # mock: simulated, mock_tp
                        speculative=speculative_config(args),
                        scheduling_policy=args.scheduling_policy, kv_cache_dtype=args.kv_cache_dtype,
                        kv_host_memory=args.kv_host_memory, kv_disk_dir=args.kv_disk_dir,
                        kv_disk_size=args.kv_disk_size, quantization=args.quantization,
                        engine=args.engine, mock_gpu=args.mock_gpu, mock_tp=args.tp)


def speculative_config(args) -> dict | None:
    """EngineConfig.speculative from --speculative and --no-speculative-adaptive."""
    if args.speculative is None:
        return None
    return {**dataclasses.asdict(speculative.SpeculativeConfig.parse(args.speculative)),
            "adaptive": not args.no_speculative_adaptive}


async def serve(args) -> None:
    log = configure("worker").bind(worker=args.id)
    tracing.setup("worker", args.id, args.otlp_endpoint)
    life = Life("worker", args.id, log, args.drain_timeout)
    life.on_signals()
    await life.serve_probes(args.health_host, args.health_port)   # alive while the model loads; ready after
    model = catalogue.resolve(args.model)
    nc = await bus.connect(args.nats_url, f"worker-{args.id}", log, role="worker")
    await life.listen(nc)
    blamed = await last_suspect(nc, args.id)
    if args.threads:
        torch.set_num_threads(args.threads)
    stepper = Stepper()                          # the engine is built, warmed up and stepped on its thread
    engine = await stepper.build(LLMEngine, model, engine_config(args))
    try:
        await stepper.call(warm_up, engine)
        gc.freeze()   # the engine's objects, there for the process's life: full collections stop walking them
        injected = faults.Faults.of(args.inject_fault)      # none unless asked for (tests, chaos)
        injected.inject(engine)
        name = args.served_model_name or os.path.basename(os.path.normpath(model))
        service = WorkerService(nc, engine, args.id, name, log, args.chunk_rate, args.role,
                                args.kv_load_failure_policy, args.nats_url, revision_of(model), stepper,
                                injected, args.step_trace, blamed, life)
        await service.run()
    finally:
        engine.close()
        stepper.close()                          # after: the followers of a tensor-parallel engine die with its thread
        await life.close()
    if service.failed:
        sys.exit(1)


def warm_up(engine: LLMEngine) -> None:
    """One short request through the engine before the worker registers, so the first real request
    does not pay for lazy initialisation (allocator, kernels, thread pools). It does not speculate:
    its drafts would count in the worker's speculation metrics."""
    engine.add_request("warm-up", [0] * 8, SamplingParams(max_tokens=2, ignore_eos=True, speculative=False))
    while engine.has_unfinished():
        engine.step()
    engine.kv.reset_prefix_cache()
    engine.kv.prefix_queries = engine.kv.prefix_hits = 0


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.no_speculative_adaptive and args.speculative is None:
        p.error("--no-speculative-adaptive fixes the K of --speculative: give --speculative too")
    if args.role != "both" and args.tp > 1:
        p.error(f"--role {args.role} with --tp {args.tp}: the KV transfer of disaggregated serving moves one "
                f"rank's pool; tensor-parallel workers serve with --role both")
    bus.run(serve(args))

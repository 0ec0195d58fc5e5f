"""The parsers of the commands whose modules import torch (slow): generate, eval, plan and up. Each
module is imported when its command runs."""
import sys

from ops.args import GPU_PRESETS, MODEL, count, delegate, deployment, size
from ops.models import DEFAULT_MODEL
from schemas import generation, subjects
from schemas.messages import SCHEDULING_POLICIES
from schemas.subjects import CHUNK_RATE, MAX_TOKENS, chunk_rate
from services.router.policy import POLICIES, Options
from text.toolcalls import PARSERS

ROUTER = Options()                         # the router's defaults, named in up's help
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # workers.engine.engine's (which imports torch)
KV_CACHE_DTYPE_HELP = ("the KV cache's dtype: auto (the model's, the default), int8 or fp8 (e4m3), each token's "
                       "row under each KV head with its own scale: about half the bytes of bfloat16, a quarter of "
                       "float32's")
QUANTIZATIONS = ("none", "int8", "w4a16", "gguf")   # workers.layers.quant's (which imports torch)
QUANTIZATION_HELP = ("the linear weights: none (the checkpoint's, the default); int8, quantized at load with a scale "
                     "per output channel and multiplied in int8; w4a16 is read from a checkpoint (a compressed-tensors "
                     "W4A16 one is served as its 4-bit codes with none too; asking w4a16 of another is refused); "
                     "gguf keeps a GGUF file's Q8_0 and Q4_0 linear weights quantized, other types dequantized as "
                     "with none (docs/models.md)")


def generate(sub) -> None:
    g = sub.add_parser("generate", help="offline generation with the engine (no pipeline)")
    g.add_argument("prompts", nargs="+", help="prompts, generated as one batch")
    g.add_argument("--model", help=f"{MODEL} (default: {DEFAULT_MODEL}, pulled on first use)")
    g.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (the default), which takes none of the model's sampling defaults")
    g.add_argument("--top-p", type=float, help="nucleus sampling: the likeliest tokens up to this mass (default: the "
                   "model's, else 1)")
    g.add_argument("--seed", type=int, help="the sampling seed (default: one drawn per request)")
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--generation-config", metavar="auto|none|FILE", default="auto", help=generation.HELP)
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)
    g.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help=QUANTIZATION_HELP)
    g.set_defaults(func=run_generate)


def run_generate(args) -> None:
    from ops.models import resolve
    from workers import LLM

    llm = LLM(resolve(args.model, sys.stderr), generation_config=args.generation_config,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
             "ignore_eos": args.ignore_eos}
    params = llm.sampling_params(**{k: v for k, v in given.items() if v is not None})
    outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params) if args.chat \
        else llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs):
        print(f"--- {prompt!r} -> {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
        print(out.text)
    print(f"--- stats: {llm.stats()}")


def evaluate(sub) -> None:
    ev = sub.add_parser("eval", help="measure a model: perplexity of a text beside HF transformers', the KL divergence "
                                     "from the unquantized model, long-context recall")
    evsub = ev.add_subparsers(dest="metric", required=True)
    pp = evsub.add_parser("ppl", help="teacher-forced per-token log-likelihood and perplexity of a text, the "
                                      "engine's and HF transformers' on the same tokens and dtype, and the KL "
                                      "divergence and top-1 agreement of the engine's token distributions with "
                                      "the unquantized float32 model's (on the CPU)")
    eval_numerics(pp)
    pp.add_argument("--text", metavar="FILE", help="a UTF-8 text file (default: an English essay of 2,272 "
                                                   "SmolLM2 tokens shipped with tokenbus)")
    pp.add_argument("--max-tokens", type=int, metavar="N", help="only the text's first N tokens (default: all)")
    pp.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    pp.set_defaults(func=delegate("workers.eval", "ppl"))
    lc = evsub.add_parser("longctx", help="long-context recall: a fact early in a long prompt, asked for at its end, "
                                          "answered greedily by the engine and by the unquantized float32 model "
                                          "(on the CPU)")
    eval_numerics(lc)
    lc.add_argument("--lengths", default="1k,4k,full", metavar="N,...",
                    help="prompt lengths in tokens: 512, 4k (4096) or full (the model's context less the answer); "
                         "one beyond the context is taken as full (default: 1k,4k,full)")
    lc.add_argument("--answer-tokens", type=int, default=16, metavar="N",
                    help="greedy answer tokens at most (default: 16)")
    lc.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    lc.set_defaults(func=delegate("workers.eval", "longctx"))


def eval_numerics(p) -> None:
    """eval's options: the model and the numerics it is measured in, against the unquantized float32 model."""
    p.add_argument("--model", help=f"{MODEL} (default: {DEFAULT_MODEL}, pulled on first use)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the engine's weights' and activations' dtype, and in eval ppl HF transformers' "
                        "(default: float32)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"], default="auto",
                   help="the engine's KV cache: auto (the model's dtype) or quantized (default: auto)")
    p.add_argument("--quantization", default="none", metavar="none|int8|gguf|...",
                   help="the engine's weights: none (as loaded: a W4A16 checkpoint's 4-bit codes), or a quantization "
                        "the engine takes: int8 (made at load), gguf (a GGUF file's Q8_0/Q4_0 weights kept) "
                        "(default: none)")
    p.add_argument("--reference", metavar="MODEL", help="the unquantized model compared with, run in float32 with "
                   "the KV cache in float32 and no quantization (default: --model itself)")


def plan(sub) -> None:
    pn = sub.add_parser("plan", help="capacity arithmetic of a deployment: weights and KV per GPU, concurrency, "
                                     "roofline step times, one node's rate within the SLOs, nodes at the peak, "
                                     "GPU-hours and $ per 1M tokens")
    deployment(pn, "a GPU preset, or cpu: this machine, its matmul peak and copy bandwidth measured now "
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
    pn.add_argument("--bus-calibration", metavar="FILE",
                    help="what the pipeline costs, as `tokenbus bench-bus --calibration FILE` wrote it (default: the "
                         "one measured for the repository, ops/bus-calibration.json)")
    pn.add_argument("--server-cores", type=int, default=16,
                    help="cores of each machine that runs a nats-server (default 16)")
    pn.add_argument("--json", action="store_true", help="the figures as JSON")
    pn.set_defaults(func=delegate("ops.plan"))


def up(sub) -> None:
    u = sub.add_parser("up", help="the local stack: nats-server, tokenizer, router, workers, gateway")
    up_nats(u)
    up_fleet(u)
    up_access(u)
    up_gateway(u)
    up_engine(u)
    u.set_defaults(func=delegate("ops.up"))


def up_nats(u) -> None:
    """up's options: the nats-server the stack starts or uses."""
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
    u.add_argument("--bus-partitions", type=subjects.partition_count, default=None, metavar="N",
                   help="split the request, work and record streams into N partitions by nats-server's partition() "
                        "mapping of the request id, with a router per partition (default: TB_BUS_PARTITIONS, or 1); "
                        "see docs/cluster.md")


def up_fleet(u) -> None:
    """up's options: the workers of each model and the router's split of prefill work."""
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
    u.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each worker (ranks per replica); with "
                   "--engine mock, the simulated size: no ranks are started")
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


def up_access(u) -> None:
    """up's options: where the stack keeps its data, who may reach it, and how the services reach the bus."""
    u.add_argument("--data-dir", help="JetStream storage, logs, the embedded database and the archive (default: "
                                      "$TOKENBUS_HOME/data)")
    u.add_argument("--database", metavar="URL", help="the recorder's database: postgresql://… (default: SQLite, "
                   "records.db in the data dir)")
    u.add_argument("--archive", metavar="URL", help="the request log's archive: a directory or an fsspec URL "
                   "(default: archive/ in the data dir)")
    u.add_argument("--bus-storage", type=size, metavar="SIZE", help="what the bus's streams may hold in all, e.g. "
                   "8GiB (default: half the data dir's free space, shared by the local cluster's nodes; 6GiB "
                   "with --nats-url); see docs/records.md")
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
    u.add_argument("--otlp-endpoint", metavar="URL", help="every service exports its traces by OTLP over HTTP to this "
                   "collector, e.g. Jaeger's http://127.0.0.1:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT, which the "
                   "services inherit; without either, no tracing); docs/tracing.md")


def up_gateway(u) -> None:
    """up's options: the gateway's API and its fallback upstream."""
    u.add_argument("--served-model-name", help="the model's name in the HTTP API, with one --model (default: the "
                   "--model directory's)")
    u.add_argument("--max-tokens", type=int,
                   help=f"the gateway's cap on a request's max_tokens (default: {MAX_TOKENS})")
    u.add_argument("--tool-call-parser", choices=PARSERS,
                   help="how the models write tool calls (default: chosen from each checkpoint's chat template)")
    u.add_argument("--generation-config", metavar="auto|none|FILE", help=generation.HELP)
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


def up_engine(u) -> None:
    """up's options: every worker's engine."""
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
    u.add_argument("--engine", choices=("model", "mock"),
                   help="every worker's engine: model (the default) or mock: no model, the real scheduler and KV "
                        "cache, each step held for the roofline's time on --tp × --mock-gpu, tokens a hash of "
                        "the request's seed and position (docs/engine.md#the-mock-engine)")
    u.add_argument("--mock-gpu", choices=GPU_PRESETS,
                   help="with --engine mock: the GPU preset whose roofline times each worker's steps "
                        "(default h100-sxm)")
    u.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="every worker's weights and activations (default: bfloat16 on a CPU with AMX or AVX-512 "
                        "BF16, else float32; the checkpoint's 16-bit type on CUDA)")
    u.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="every worker's " + KV_CACHE_DTYPE_HELP)
    u.add_argument("--quantization", choices=QUANTIZATIONS, help="every worker's " + QUANTIZATION_HELP)
    u.add_argument("--kv-host-memory", type=size, metavar="BYTES",
                   help="each worker's host-memory tier of the prefix cache, e.g. 8GiB: blocks evicted from the KV "
                        "pool are kept there and copied back on a hit instead of recomputed (default: none)")
    u.add_argument("--kv-disk-dir", metavar="DIR",
                   help="a disk tier below it, each worker's in DIR/<worker id> (with --kv-disk-size): checksummed "
                        "block files that the next `up` finds again (default: none)")
    u.add_argument("--kv-disk-size", type=size, metavar="BYTES", help="each worker's disk tier at most, e.g. 100GiB")
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


def speculative(text: str) -> str:
    """A --speculative value, checked as the worker checks it (the check is imported only when the flag
    is given: it imports torch)."""
    from workers.engine.speculative import argument

    return argument(text)

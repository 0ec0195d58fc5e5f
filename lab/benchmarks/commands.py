"""The benchmarks' commands (`tokenbus bench`, `tokenbus bench-engine`, ...), registered through the
entry-point group tokenbus.commands: their parsers only, each benchmark imported when it runs (torch is
slow to import)."""
import os

from lab.common.options import BENCH_MODEL
from ops.args import GPU_PRESETS, MODEL, PLAN_MODELS, delegate
from ops.models import DEFAULT_MODEL
from schemas.subjects import chunk_rate
from services.router.policy import POLICIES


def bench(sub) -> None:
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
    bn.add_argument("--factors", type=float, nargs="+", metavar="F",
                    help="the load test: Poisson arrivals at each F × the peak for --duration seconds, open loop; "
                         "prints what was served and refused, how fast refusals came, the served latency")
    bn.add_argument("--peak", type=float, metavar="RPS", help="with --factors: the stated peak, requests/s "
                    "(default: measured first at saturation, --concurrency 32 for --num-requests)")
    bn.add_argument("--duration", type=float, default=30.0, help="with --factors: seconds at each factor")
    bn.set_defaults(func=delegate("lab.benchmarks.load"))


def bench_engine(sub) -> None:
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
    b.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"], default="auto",
                   help="the engine's KV cache: auto (the model's dtype), or int8 or fp8 with a scale per row")
    b.add_argument("--quantization", choices=["none", "int8", "w4a16", "gguf"], default="none",
                   help="the engine's linear weights: none (the checkpoint's), int8 (quantized at load), w4a16 (read "
                        "from a compressed-tensors checkpoint) or gguf (a GGUF file's Q8_0/Q4_0 weights kept)")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    b.set_defaults(func=delegate("lab.benchmarks.engine"))


def bench_tp(sub) -> None:
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


def bench_pipeline(sub) -> None:
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


def bench_recorder(sub) -> None:
    br = sub.add_parser("bench-recorder", help="the recorder draining a backlog of usage records into its database, "
                                               "against the database's own ceiling for the same rows")
    br.add_argument("--records", type=int, default=200_000, help="usage records in the backlog (default 200000)")
    br.add_argument("--database", nargs="+", choices=["postgresql", "sqlite"], default=["postgresql", "sqlite"],
                    help="which databases, each in turn (default: both)")
    br.add_argument("--recorders", type=int, nargs="+", default=[1], help="recorder processes on the consumer, "
                    "each count in turn (default 1)")
    br.add_argument("--timeout", type=float, default=600.0, help="seconds the recorder may take (default 600)")
    br.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    br.set_defaults(func=delegate("lab.benchmarks.recorder"))


def bench_bus(sub) -> None:
    bb = sub.add_parser("bench-bus", help="the pipeline and its bus at GPU token rates: mock workers, open-loop "
                                          "Poisson arrivals, what each service and nats-server costs per request "
                                          "and token")
    bb.add_argument("--model", default=DEFAULT_MODEL, help="the tokenizer and files of the model (default: "
                    f"{DEFAULT_MODEL}); its config is reshaped to --shape (the mock loads no weights)")
    bb.add_argument("--shape", choices=PLAN_MODELS, default="llama-3-70b",
                    help="the layers the mock engine times its steps for (default: llama-3-70b, the seed's)")
    bb.add_argument("--mock-gpu", choices=GPU_PRESETS, default="h100-sxm", help="the mock's GPU (default h100-sxm)")
    bb.add_argument("--tp", type=int, default=8, help="the mock's simulated tensor-parallel size (default 8)")
    bb.add_argument("--workers", type=int, default=2, help="mock workers (default 2)")
    bb.add_argument("--max-num-seqs", type=int, default=256, help="requests in a worker's batch at most (default 256)")
    bb.add_argument("--bus", nargs="+", choices=["single", "cluster"], default=["single"],
                    help="single: one nats-server; cluster: 3 nodes with R3 streams (default: single)")
    bb.add_argument("--fsync", nargs="+", choices=["default", "always"], default=["default"],
                    help="default: NATS's (every 2 minutes); always: before every acknowledgement (default: default)")
    bb.add_argument("--protocol", nargs="+", choices=["ws", "sse"], default=["ws", "sse"],
                    help="ws: the websocket protocol; sse: streamed text completions (default: both)")
    bb.add_argument("--rate", type=float, nargs="+", default=[2.0, 4.0, 8.0, 16.0],
                    help="Poisson arrivals per second, one run each in turn: a step sweep (default 2 4 8 16)")
    bb.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run (default 20)")
    bb.add_argument("--input-len", type=int, default=3000, help="prompt tokens (default 3000, the seed's)")
    bb.add_argument("--output-len", type=int, nargs="+", default=[400],
                    help="output tokens, exactly; several: each in turn at every rate (default 400, the seed's)")
    bb.add_argument("--calibration", metavar="FILE", help="write the per-request and per-token CPU of each role and "
                    "the durable writes, fitted over the last bus's runs, for `tokenbus plan --bus-calibration`")
    bb.add_argument("--idle", type=float, default=5.0,
                    help="seconds each process's idle CPU is measured before the runs, to net it out (default 5)")
    bb.add_argument("--connections", type=int, default=16, help="ws: websockets the requests share (default 16)")
    bb.add_argument("--timeout", type=float, default=600.0, help="seconds a run's requests may take to end")
    bb.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    bb.add_argument("--json", metavar="FILE", help="write the results as JSON")
    bb.add_argument("--plot", metavar="FILE.png", help="sustained rate and added TTFT against the offered rate")
    bb.set_defaults(func=delegate("lab.benchmarks.bus_load", exits=True))


def bench_spec(sub) -> None:
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


def bench_structured(sub) -> None:
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


def bench_disagg(sub) -> None:
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


def bench_routing(sub) -> None:
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


def bench_gateway(sub) -> None:
    bg = sub.add_parser("bench-gateway", help="the gateway's overhead: refused, accepted, streamed")
    bg.add_argument("--model", help=f"{MODEL}, for its tokenizer (default: tiny)")
    bg.add_argument("--requests", type=int, default=2000, help="requests per latency and throughput measurement")
    bg.add_argument("--concurrency", type=int, default=32, help="connections for the requests/s measurements")
    bg.add_argument("--streams", type=int, default=64, help="concurrent streams for the tokens/s measurement")
    bg.add_argument("--tokens", type=int, default=1000, help="tokens per stream")
    bg.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    bg.set_defaults(func=delegate("lab.benchmarks.gateway"))

"""`tokenbus bench-peers`, registered through the entry-point group tokenbus.commands: its parser only,
the benchmark imported when it runs (it imports torch)."""
import os

from ops.args import MODEL, delegate
from ops.models import DEFAULT_MODEL

# lab.peers.bench.ENGINES, named here: it imports torch
ENGINES = ("engine", "engine-bf16", "pipeline-ws", "pipeline-openai", "hf-generate", "hf-generate-bf16", "hf-cb",
           "llama-f32", "llama-f16", "llama-bf16", "llama-q4_1", "openvino", "openvino-int8")


def bench_peers(sub) -> None:
    bpe = sub.add_parser("bench-peers", help="the engine vs llama.cpp's server, HF and OpenVINO on the same "
                                             "workloads, one client, each engine in turn")
    bpe.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL}; llama.cpp needs a catalogue model")
    bpe.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), metavar="NAME",
                     help=f"which engines, in this order: {', '.join(ENGINES)} (default: all)")
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

"""The `tokenbus` command line."""
import argparse
import sys

from services.router.policy import POLICIES


def cmd_model(args) -> None:
    from ops.model_builder import build_tiny_model

    print(build_tiny_model(args.dir, args.size))


def cmd_generate(args) -> None:
    from workers import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params) if args.chat \
        else llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs):
        print(f"--- {prompt!r} -> {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
        print(out.text)
    print(f"--- stats: {llm.stats()}")


def cmd_bench_engine(args) -> None:
    from workers.bench import main

    main(args)


def cmd_bench_pipeline(args) -> None:
    from ops.bench_pipeline import main

    main(args)


def cmd_bench_routing(args) -> None:
    from ops.bench_routing import main

    main(args)


def cmd_up(args) -> None:
    from ops.up import main

    main(args)


def cmd_chat(args) -> None:
    from ops.chat import run

    sys.exit(run(args.url, max_tokens=args.max_tokens, temperature=args.temperature, system=args.system))


def cmd_status(args) -> None:
    from ops.status import main

    main(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenbus", description="LLM serving over NATS JetStream.")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("model", help="build models offline")
    msub = m.add_subparsers(dest="kind", required=True)
    tiny = msub.add_parser("tiny", help="write a random-weight Llama checkpoint with its own tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--size", choices=["tiny", "small"], default="tiny")
    tiny.set_defaults(func=cmd_model)

    g = sub.add_parser("generate", help="offline generation with the engine (no pipeline)")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--model", help="HF checkpoint directory (default: the tiny model)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench-engine", help="the engine vs HF generate on the same workload")
    b.add_argument("--model", help="HF checkpoint directory (default: the tiny model)")
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    b.add_argument("--output-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    b.add_argument("--hf-batch-size", type=int, default=16)
    b.add_argument("--max-num-seqs", type=int, default=64)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--repeat", type=int, default=3, help="runs per side; the fastest counts")
    b.add_argument("--profile", action="store_true", help="also print where a decode step's time goes")
    b.add_argument("--skip-hf", action="store_true", help="run only the engine")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    b.set_defaults(func=cmd_bench_engine)

    bp = sub.add_parser("bench-pipeline", help="the whole pipeline vs the offline engine on the same workload")
    bp.add_argument("--model", help="HF checkpoint directory (default: the tiny model)")
    bp.add_argument("--num-requests", type=int, default=64)
    bp.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    bp.add_argument("--output-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    bp.add_argument("--ttft-requests", type=int, default=20, help="requests sent one at a time for TTFT")
    bp.add_argument("--ttft-output-len", type=int, default=4)
    bp.add_argument("--max-num-seqs", type=int, default=64)
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--repeat", type=int, default=5, help="rounds per side; the best counts")
    bp.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bp.set_defaults(func=cmd_bench_pipeline)

    br = sub.add_parser("bench-routing", help="the routing policies on 3 workers: prefix hit rate, TTFT, load")
    br.add_argument("--model", help="HF checkpoint directory (default: the tiny model)")
    br.add_argument("--policies", nargs="+", choices=POLICIES, default=["round-robin", "least-loaded", "prefix"])
    br.add_argument("--conversations", type=int, default=15)
    br.add_argument("--turns", type=int, default=8)
    br.add_argument("--system-prompts", type=int, default=4)
    br.add_argument("--system-len", type=int, default=96, help="tokens in each system prompt")
    br.add_argument("--user-len", type=int, nargs=2, default=[128, 192], metavar=("MIN", "MAX"))
    br.add_argument("--reply-len", type=int, default=32, help="tokens the model replies each turn")
    br.add_argument("--think-ms", type=float, default=1000.0,
                    help="a user's pause before each turn, uniform up to this: turns of conversations interleave")
    br.add_argument("--kv-blocks", type=int, default=544, help="KV blocks of 16 tokens per worker")
    br.add_argument("--max-num-seqs", type=int, default=16)
    br.add_argument("--max-num-batched-tokens", type=int, default=512, help="per worker step (short steps keep "
                    "heartbeats on time on a busy CPU)")
    br.add_argument("--alpha", type=float, default=4.0, help="the prefix policy's weight of a prefill block")
    br.add_argument("--shared-requests", type=int, default=96, help="requests sharing one system prompt (0: skip)")
    br.add_argument("--shared-system-len", type=int, default=256)
    br.add_argument("--shared-reply-len", type=int, default=16)
    br.add_argument("--shared-clients", type=int, default=12)
    br.add_argument("--seed", type=int, default=0)
    br.add_argument("--data-dir", help="keep the stack's logs and JetStream here (default: a temporary directory)")
    br.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    br.set_defaults(func=cmd_bench_routing)

    u = sub.add_parser("up", help="the local stack: nats-server, tokenizer, router, workers, gateway")
    u.add_argument("--port", type=int, default=8000, help="the gateway's port (websocket at /ws)")
    u.add_argument("--nats-port", type=int, default=4222, help="the embedded nats-server's port")
    u.add_argument("--nats-url", help="use this running nats-server (with JetStream) instead of starting one")
    u.add_argument("--workers", type=int, default=1)
    u.add_argument("--router", choices=POLICIES, default="prefix",
                   help="routing policy: prefix (cache- and load-aware, the default), least-loaded, round-robin")
    u.add_argument("--model", help="HF checkpoint directory (default: the tiny model)")
    u.add_argument("--data-dir", help="JetStream storage and logs (default: $TOKENBUS_HOME/data)")
    u.set_defaults(func=cmd_up)

    c = sub.add_parser("chat", help="a terminal chat client over the websocket protocol")
    c.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--system", help="a system message that starts every conversation")
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("status", help="the worker registry: load, KV usage, prefix-cache hits")
    s.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_status)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"tokenbus: {e}")


if __name__ == "__main__":
    main()

"""A tensor-parallel follower: rank r > 0 of one model replica. Rank 0 (the engine) starts it.

It holds its shard of the weights and of the KV pool, runs every step rank 0 sends and nothing
else: no scheduler, no sampler, no NATS. It dies with its parent (the kernel sees to that) and
ignores Ctrl-C, which the terminal sends to the whole process group: rank 0 decides when it stops.
"""
import argparse
import json
import signal
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.follower", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's TCPStore on 127.0.0.1")
    p.add_argument("--parent", type=int, required=True, help="rank 0's pid")
    p.add_argument("--device-type", choices=["cpu", "cuda"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    from workers.distributed import HOST, STARTUP_TIMEOUT, die_with_parent, join, leave
    die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch.distributed as dist

    from workers.engine.engine import EngineConfig, build_runner
    from workers.models.config import ModelConfig

    store = dist.TCPStore(HOST, args.port, args.size, is_master=False, timeout=STARTUP_TIMEOUT)
    store.set(f"ready/{args.rank}", "1")
    tp = join(args.rank, args.size, store, args.device_type)
    try:
        runner = build_runner(args.model, ModelConfig.load(args.model), EngineConfig(**json.loads(args.config)), tp)
        runner.follow()
    except RuntimeError as e:          # rank 0 went away mid-collective: nothing left to serve
        print(f"tensor-parallel rank {args.rank}: {e}", file=sys.stderr)
        sys.exit(1)
    leave()


if __name__ == "__main__":
    main()

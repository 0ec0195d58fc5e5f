"""`python -m ops.health ROLE`: the health checks of compose.yaml's containers; exit 0 when healthy.

gateway: it answers /healthz (200, or 503 while no worker is registered: it serves either way);
tokenizer: a replica answers a tb.tokenize probe; router: its durable consumer of the request log has
pull requests waiting (a replica is pulling);
worker: its id has a live heartbeat in the registry."""
import argparse
import asyncio
import sys
import urllib.error
import urllib.request

import nats.errors

import bus
from ops.status import heartbeats
from schemas import subjects
from schemas.messages import GenerateRequest, encode
from schemas.sampling import SamplingParams

PROBE_SECONDS = 2.0


async def answering(nc) -> bool:
    """Whether a tokenizer replica answers tb.tokenize (any answer: the probe's tokens or its refusal)."""
    probe = GenerateRequest("health", "default", SamplingParams(max_tokens=1), prompt_token_ids=[0])
    try:
        await nc.request(subjects.TOKENIZE, encode(probe), timeout=PROBE_SECONDS)
        return True
    except (nats.errors.Error, asyncio.TimeoutError):
        return False


async def routing(js, partitions: int | None = None) -> bool:
    """Whether a router replica pulls the request log (its durable has pull requests waiting), in every
    partition of a partitioned bus (of `partitions`; default TB_BUS_PARTITIONS)."""
    for part in subjects.parts(partitions):
        info = await js.consumer_info(subjects.stream(subjects.REQUESTS_STREAM, part), bus.ROUTER.durable_name)
        if info.num_waiting == 0:
            return False
    return True


def gateway(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError as e:
        return e.code == 503
    except OSError:
        return False


async def pulling(nats_url: str, role: str) -> bool:
    nc = await bus.connect(nats_url, "tokenbus-health", role="admin")
    try:
        return await (answering(nc) if role == "tokenizer" else routing(nc.jetstream()))
    finally:
        await nc.close()


async def registered(nats_url: str, worker: str) -> bool:
    nc = await bus.connect(nats_url, "tokenbus-health", role="admin")
    try:
        return any(b.worker == worker for b in await heartbeats(nc.jetstream()))
    finally:
        await nc.close()


def healthy(args) -> bool:
    if args.role == "gateway":
        return gateway(args.url)
    if args.role == "worker":
        return asyncio.run(asyncio.wait_for(registered(args.nats_url, args.id), 5))
    return asyncio.run(asyncio.wait_for(pulling(args.nats_url, args.role), 5))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ops.health", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["gateway", "tokenizer", "router", "worker"])
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--url", default="http://127.0.0.1:8000/healthz", help="gateway: its /healthz")
    p.add_argument("--id", help="worker: its id")
    args = p.parse_args(argv)
    try:
        ok = healthy(args)
    except Exception as e:                       # NATS down, consumer missing, timeout: unhealthy
        print(f"unhealthy: {type(e).__name__}: {e}", file=sys.stderr)
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

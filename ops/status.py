"""`tokenbus status`: the worker registry (KV bucket tb_workers) as a table or as JSON."""
import asyncio
import dataclasses

import orjson

from ops import broker
from schemas import subjects
from schemas.messages import Heartbeat, Speculation

FIELDS = ("id", "running", "waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_queries",
          "prefix_cache_hits", "requests_finished")


async def read_registry(nats_url: str) -> list[Heartbeat]:
    nc = await broker.connect(nats_url, "tokenbus-status", role="status")
    try:
        return await heartbeats(nc.jetstream())
    finally:
        await nc.close()


async def heartbeats(js) -> list[Heartbeat]:
    """The live workers' latest heartbeats, by worker id."""
    return await subjects.live_workers(await subjects.registry(js))


def as_json(beats: list[Heartbeat]) -> dict:
    return {"workers": [{"id": b.worker, **{f: getattr(b, f) for f in FIELDS[1:]},
                         "speculation": dataclasses.asdict(b.speculation) if b.speculation else None} for b in beats]}


def table(beats: list[Heartbeat]) -> str:
    head = ["worker", "running", "waiting", "kv used", "kv blocks", "prefix hit", "finished", "speculation"]
    rows = [[b.worker, str(b.running), str(b.waiting),
             f"{1 - b.kv_blocks_free / max(b.kv_blocks_total, 1):.1%}", f"{b.kv_blocks_free}/{b.kv_blocks_total} free",
             f"{b.prefix_cache_hits / b.prefix_cache_queries:.1%}" if b.prefix_cache_queries else "-",
             str(b.requests_finished), speculation(b.speculation)] for b in beats]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return "\n".join(lines) if rows else "no workers registered"


def speculation(s: Speculation | None) -> str:
    """off, or the method, the current k of at most k_max, and the share of draft tokens accepted so far."""
    if s is None:
        return "off"
    accepted = f"{s.acceptance_rate:.1%} accepted" if s.draft_tokens else "nothing drafted yet"
    return f"{s.method} k={s.k}/{s.k_max}{'' if s.adaptive else ' fixed'}, {accepted}"


def main(args) -> None:
    beats = asyncio.run(read_registry(args.nats_url))
    print(orjson.dumps(as_json(beats)).decode() if args.json else table(beats))

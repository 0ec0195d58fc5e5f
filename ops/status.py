"""`tokenbus status`: the worker registry (KV bucket tb_workers) as a table or as JSON: each worker's
role, model and revision (name@revision), load, KV use, prefix hits, speculation, KV transfers, the
prefix cache's tiers below the pool (host memory, disk); then the bus's streams: what each may hold, what
it holds and how long it keeps a record (docs/records.md)."""
import asyncio
import dataclasses

import orjson

import bus
from ops import broker
from ops.args import nats_url
from ops.retention import KEEPS, gib
from schemas import subjects
from schemas.messages import Heartbeat, KvTransfer, Speculation

FIELDS = ("id", "running", "waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_queries",
          "prefix_cache_hits", "requests_finished")


async def read_registry(nats_url: str) -> list[Heartbeat]:
    return (await read_status(nats_url))[0]


async def read_status(nats_url: str) -> tuple[list[Heartbeat], list[dict]]:
    """The live workers' heartbeats and the streams' retention (streams())."""
    nc = await broker.connect(nats_url, "tokenbus-status", role="status")
    try:
        js = nc.jetstream()
        return await heartbeats(js), await streams(js)
    finally:
        await nc.close()


async def streams(js) -> list[dict]:
    """Each stream of the bus (summed over its partitions): max_bytes, bytes and messages held, and what it keeps."""
    out = []
    for name in subjects.STREAM_NAMES:
        found = await bus.infos(js, name)
        room = sum(max(i.config.max_bytes or 0, 0) for i in found)
        held, messages = sum(i.state.bytes for i in found), sum(i.state.messages for i in found)
        out.append({"name": name, "max_bytes": room, "bytes": held, "messages": messages, "keeps": KEEPS[name]})
    return out


def streams_table(rows: list[dict]) -> str:
    head = ["stream", "max", "held", "fill", "messages", "keeps"]
    body = [[r["name"], gib(r["max_bytes"]), gib(r["bytes"]),
             f"{r['bytes'] / r['max_bytes']:.1%}" if r["max_bytes"] else "-", str(r["messages"]), r["keeps"]]
            for r in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body])


async def heartbeats(js) -> list[Heartbeat]:
    """The live workers' latest heartbeats, by worker id."""
    return await bus.live_workers(await bus.registry(js))


def as_json(beats: list[Heartbeat]) -> dict:
    return {"workers": [{"id": b.worker, "role": b.role, "model": b.model, "revision": b.revision,
                         "scheduling_policy": b.scheduling_policy,
                         **{f: getattr(b, f) for f in FIELDS[1:]},
                         "speculation": dataclasses.asdict(b.speculation) if b.speculation else None,
                         "kv_transfer": dataclasses.asdict(b.kv_transfer) if b.kv_transfer else None,
                         "kv_tiers": b.kv_tiers}
                        for b in beats]}


def table(beats: list[Heartbeat]) -> str:
    """One row per worker; the kv transfer column only when some worker is disaggregated, the kv tiers one
    only when some worker has tiers."""
    disaggregated = any(b.kv_transfer is not None for b in beats)
    tiered = any(b.kv_tiers for b in beats)
    head = ["worker", "role", "model", "policy", "running", "waiting", "kv used", "kv blocks", "prefix hit", "finished",
            "speculation", *(["kv transfer"] if disaggregated else []), *(["kv tiers"] if tiered else [])]
    rows = [[b.worker, b.role, f"{b.model}@{b.revision}" if b.revision else b.model, b.scheduling_policy,
             str(b.running), str(b.waiting),
             f"{1 - b.kv_blocks_free / max(b.kv_blocks_total, 1):.1%}", f"{b.kv_blocks_free}/{b.kv_blocks_total} free",
             f"{b.prefix_cache_hits / b.prefix_cache_queries:.1%}" if b.prefix_cache_queries else "-",
             str(b.requests_finished), speculation(b.speculation),
             *([kv_transfer(b.role, b.kv_transfer)] if disaggregated else []),
             *([kv_tiers(b.kv_tiers)] if tiered else [])] for b in beats]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return "\n".join(lines) if rows else "no workers registered"


def speculation(s: Speculation | None) -> str:
    """off, or the method, the current k of at most k_max, and the share of draft tokens accepted so far."""
    if s is None:
        return "off"
    accepted = f"{s.acceptance_rate:.1%} accepted" if s.draft_tokens else "nothing drafted yet"
    return f"{s.method} k={s.k}/{s.k_max}{'' if s.adaptive else ' fixed'}, {accepted}"


def kv_transfer(role: str, t: KvTransfer | None) -> str:
    """What a prefill worker handed off and served, or what a decode worker pulled, how fast, how often it failed."""
    if t is None:
        return "-"
    if role == "prefill":
        return f"handed off {t.handoffs}, served {t.served_blocks} blk, {t.leases} leases"
    if not t.transfers:
        return "nothing pulled yet"
    recomputed = f", {t.recomputes} recomputed" if t.recomputes else ""
    return (f"pulled {t.pulled_blocks} blk / {size(t.pulled_bytes)}, p99 {t.transfer_ms_p99:.0f} ms, "
            f"{t.failures} failed{recomputed}")


def size(n: int) -> str:
    """Bytes in the largest unit they fill, a decimal below 10 of it: 512 B, 12 kB, 40 MB, 3.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{n} B"


def main(args) -> None:
    beats, held = asyncio.run(read_status(args.nats_url))
    if args.json:
        print(orjson.dumps({**as_json(beats), "streams": held}).decode())
    else:
        print(f"{table(beats)}\n\n{streams_table(held)}")


def kv_tiers(t: dict[str, float]) -> str:
    """Each tier below the pool: its blocks and bytes, the hits copied up from it and the time its copies took."""
    parts = [f"{tier} {t[f'{tier}_blocks']:.0f} blk / {size(int(t[f'{tier}_bytes']))}, {t[f'{tier}_hits']:.0f} hits, "
             f"{t[f'{tier}_seconds'] * 1e3:.0f} ms" for tier in ("host", "disk") if f"{tier}_hits" in t]
    return "; ".join(parts) or "-"


def register(sub) -> None:
    s = sub.add_parser("status", help="the worker registry: load, KV usage, prefix-cache hits; the streams' retention")
    nats_url(s)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=main)

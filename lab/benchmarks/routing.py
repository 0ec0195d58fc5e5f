"""`tokenbus bench-routing`: the routing policies side by side on one stack of 3 workers.

Workloads, sent through the gateway's websocket as token ids (greedy, EOS ignored, so every run
has the same shape):
- multi-turn chat: conversations of several turns, each starting with one of a few long system
  prompts; each turn's prompt is the whole history (system, user turns, the replies the model gave),
  sent when the previous turn is done; all conversations at once.
- one hot system prompt: every request is that prompt plus a short user message, from a few
  clients in a closed loop (prefix policy only: does it still spread the load?).

Each policy gets a fresh router (its own id, so its stats are told apart) and fresh random tokens,
so nothing cached in an earlier run can hit: the workers' pools start from the same state, full of
blocks no request will ask for. The workers' KV pools are small on purpose: a round-robin cluster
holds every conversation on every worker and evicts, a prefix-routed one holds a third of them each.

Hit rate = prefix-cache hit tokens / prompt tokens, from the completion records in TB_RESULTS.
The reference "one worker holds everything" replays each run's own requests (prompts and outputs
from those records) against a prefix cache that never evicts, by the engine's hit rule: only first
uses miss. TTFT is the client's: send to first token.
"""
import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import websockets

from lab.common.records import records, results_seq, router_stats
from ops import procs
from ops.procs import free_port
from ops.up import Stack
from schemas.hashing import hash_blocks
from schemas.messages import Completion
from workers.models.catalogue import resolve
from workers.models.config import ModelConfig

WORKERS = 3
BLOCK_SIZE = 16
REQUEST_TIMEOUT = 120.0      # seconds; a request slower than this means the stack is broken


@dataclass(slots=True)
class Chat:
    system: list[int]
    users: list[list[int]]          # one user message per turn


def chats(seed: int, args, vocab: int) -> list[Chat]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(16, vocab) for _ in range(n)]  # noqa: E731
    systems = [tokens(args.system_len) for _ in range(args.system_prompts)]
    return [Chat(systems[c % len(systems)], [tokens(rng.randint(*args.user_len)) for _ in range(args.turns)])
            for c in range(args.conversations)]


def shared(seed: int, args, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(16, vocab) for _ in range(args.shared_system_len)]
    return [system + [rng.randrange(16, vocab) for _ in range(rng.randint(*args.user_len))]
            for _ in range(args.shared_requests)]


# -- the client -----------------------------------------------------------------------------------

class Client:
    """Many requests on one websocket: frames go to the queue of their id."""

    def __init__(self, ws):
        self.ws, self.queues, self.n = ws, {}, 0

    async def read(self) -> None:
        async for raw in self.ws:
            frame = orjson.loads(raw)
            self.queues[frame["id"]].put_nowait(frame)

    async def generate(self, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        """(TTFT in ms, output token ids)."""
        self.n += 1
        rid, queue = str(self.n), asyncio.Queue()
        self.queues[rid] = queue
        start, first, out = time.perf_counter(), None, []
        await self.ws.send(orjson.dumps({"type": "generate", "id": rid, "prompt_token_ids": prompt,
                                         "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).decode())
        while True:
            try:
                frame = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT)
            except TimeoutError:
                raise RuntimeError(f"no frame for {REQUEST_TIMEOUT:.0f} s: the stack is stuck") from None
            if frame["type"] == "error":
                raise RuntimeError(f"request failed: {frame}")
            if frame["type"] == "delta":
                first = first or time.perf_counter()
                out += frame["token_ids"]
            if frame["type"] == "done":
                del self.queues[rid]
                return (first - start) * 1e3, out


@contextlib.asynccontextmanager
async def client(url: str):
    async with websockets.connect(url, max_size=None) as ws:
        c = Client(ws)
        reader = asyncio.create_task(c.read())
        try:
            yield c
        finally:
            reader.cancel()


async def chat_run(url: str, convs: list[Chat], reply_len: int, think_ms: float, seed: int) -> list[float]:
    rng = random.Random(seed)

    async def one(c: Client, chat: Chat) -> list[float]:
        history, ttfts = list(chat.system), []
        for user in chat.users:
            await asyncio.sleep(rng.uniform(0, think_ms) / 1e3)   # the user types: turns of conversations interleave
            history += user
            ttft, out = await c.generate(history, reply_len)
            history += out
            ttfts.append(ttft)
        return ttfts

    async with client(url) as c:
        return [t for ts in await asyncio.gather(*(one(c, chat) for chat in convs)) for t in ts]


async def shared_run(url: str, prompts: list[list[int]], reply_len: int, clients: int) -> list[float]:
    todo, ttfts = iter(prompts), []

    async def loop(c: Client) -> None:
        for prompt in todo:
            ttfts.append((await c.generate(prompt, reply_len))[0])

    async with client(url) as c:
        await asyncio.gather(*(loop(c) for _ in range(clients)))
    return ttfts


# -- what the cluster says ------------------------------------------------------------------------

def use_router(stack: Stack, policy: str, args) -> str:
    """Replaces the stack's router by a fresh one with this policy; its id once it is up."""
    name = f"bench-{policy}-{int(time.time() * 1000) % 100000}"
    procs.stop([stack.children.pop("router")])
    stack.router_args = ["--policy", policy, "--id", name, "--alpha", str(args.alpha)]
    stack.spawn("router", "services.router", "--nats-url", stack.nats_url, *stack.router_args)
    if asyncio.run(router_stats(stack.nats_url, name, lambda s: len(s.index_blocks) == WORKERS)) is None:
        raise RuntimeError(f"router {name} did not come up; logs in {stack.data_dir / 'logs'}")
    return name


def same_worker(recs: list[Completion], key_len: int) -> float:
    """Of the turns after a conversation's first, the fraction served where its previous turn was
    (a conversation is known by its first key_len prompt tokens: its system prompt and first message)."""
    last, same, turns = {}, 0, 0
    for r in sorted(recs, key=lambda r: r.created):
        key = tuple(r.prompt_token_ids[:key_len])
        if key in last:
            same, turns = same + (last[key] == r.worker), turns + 1
        last[key] = r.worker
    return round(same / max(turns, 1), 3)


def measure(stack: Stack, router: str, run, count: int, key_len: int = 0) -> dict:
    after = asyncio.run(results_seq(stack.nats_url))
    start = time.perf_counter()
    ttfts = asyncio.run(run())
    seconds = time.perf_counter() - start
    recs = asyncio.run(records(stack.nats_url, after, count))
    one = ceiling(recs)
    stats = asyncio.run(router_stats(stack.nats_url, router, lambda s: s.completed >= count, timeout=10.0))
    if stats is None:
        raise RuntimeError(f"router {router} published no stats; logs in {stack.data_dir / 'logs'}")
    per_worker = {f"w{i}": sum(r.worker == f"w{i}" for r in recs) for i in range(WORKERS)}
    prompt = sum(r.usage["prompt_tokens"] for r in recs)
    hits = sum(r.usage["cached_tokens"] for r in recs)
    return {"requests": len(recs), "seconds": round(seconds, 2), "prompt_tokens": prompt, "hit_tokens": hits,
            "hit_rate": round(hits / prompt, 4), "ttft_ms_p50": round(statistics.median(ttfts), 1),
            "ttft_ms_p99": round(percentile(ttfts, 0.99), 1), "requests_per_worker": per_worker,
            "load_ratio": round(max(per_worker.values()) / max(min(per_worker.values()), 1), 2),
            "predicted_hit_tokens": stats.predicted_hit_tokens, "actual_hit_tokens": stats.actual_hit_tokens,
            "exact_predictions": round(stats.exact / max(stats.completed, 1), 4), "guarded": stats.guarded,
            "one_worker_hit_rate": one["hit_rate"],
            "same_worker_turns": same_worker(recs, key_len) if key_len else None}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- one worker that holds everything ------------------------------------------------------------

def ceiling(recs: list[Completion]) -> dict:
    """What one worker whose pool never evicts hits on these same requests, taken in the order the
    gateway accepted them: the engine's rule (the longest cached prefix in whole blocks, the last
    prompt token always computed; the router's prediction, tested equal to the engine's hits), with
    every block a request computed (its prompt and output but the last token) kept forever. The
    gateway sets no cache salt yet, so none is used."""
    cached, prompt, hits = set(), 0, 0
    for r in sorted(recs, key=lambda r: r.created):
        n = len(r.prompt_token_ids)
        hit = 0
        for h in hash_blocks(r.prompt_token_ids[:n - 1], BLOCK_SIZE):
            if h not in cached:
                break
            hit += BLOCK_SIZE
        prompt, hits = prompt + n, hits + hit
        cached.update(hash_blocks((r.prompt_token_ids + r.output_token_ids)[:-1], BLOCK_SIZE))
    return {"prompt_tokens": prompt, "hit_tokens": hits, "hit_rate": round(hits / prompt, 4)}


# -- the run --------------------------------------------------------------------------------------

def main(args) -> dict:
    model = resolve(args.model or "tiny")
    vocab = ModelConfig.load(model).vocab_size
    worker_args = ["--num-kv-blocks", str(args.kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", str(BLOCK_SIZE)]
    report = {"workload": workload(args), "policies": {}}
    # each worker one share of the cores: three processes of spinning OpenMP threads on fewer cores stall
    # each other for seconds (heartbeats lapse); set before the workers start, inherited by them only
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.data_dir) if args.data_dir else Path(tmp)
        stack = Stack(model, free_port(), data_dir, nats_port=free_port(), workers=WORKERS, worker_args=worker_args)
        try:
            stack.start()
            stack.wait_ready()
            for k, policy in enumerate(args.policies):
                router = use_router(stack, policy, args)
                convs = chats(args.seed + 1 + k, args, vocab)
                n = len(convs) * args.turns
                run = lambda convs=convs: chat_run(stack.url, convs, args.reply_len, args.think_ms, args.seed)  # noqa: E731
                report["policies"][policy] = measure(stack, router, run, n, args.system_len + args.user_len[0])
            if args.shared_requests:
                router = use_router(stack, "prefix", args)
                prompts = shared(args.seed + 100, args, vocab)
                report["shared_prompt"] = measure(
                    stack, router, lambda: shared_run(stack.url, prompts, args.shared_reply_len, args.shared_clients),
                    len(prompts))
        finally:
            stack.stop()
    report["goals"] = goals(report)
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if args.json else table(report))
    return report


def workload(args) -> dict:
    return {"conversations": args.conversations, "turns": args.turns, "system_prompts": args.system_prompts,
            "system_len": args.system_len, "user_len": args.user_len, "reply_len": args.reply_len,
            "think_ms": args.think_ms,
            "workers": WORKERS, "kv_blocks_per_worker": args.kv_blocks, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "alpha": args.alpha, "shared_requests": args.shared_requests, "shared_system_len": args.shared_system_len,
            "shared_clients": args.shared_clients}


def goals(r: dict) -> dict:
    p = r["policies"]
    out = {}
    if "prefix" in p and "round-robin" in p:
        out["prefix_vs_round_robin"] = round(p["prefix"]["hit_rate"] / max(p["round-robin"]["hit_rate"], 1e-9), 2)
    if "prefix" in p:
        out["prefix_vs_one_worker"] = round(p["prefix"]["hit_rate"] / p["prefix"]["one_worker_hit_rate"], 3)
        out["prefix_load_ratio"] = p["prefix"]["load_ratio"]
    if "shared_prompt" in r:
        out["shared_prompt_load_ratio"] = r["shared_prompt"]["load_ratio"]
    return out


def table(r: dict) -> str:
    w = r["workload"]
    lines = [f"multi-turn chat: {w['conversations']} conversations × {w['turns']} turns, {w['system_prompts']} "
             f"system prompts of {w['system_len']} tokens, user turns {w['user_len'][0]}-{w['user_len'][1]}, "
             f"replies {w['reply_len']}; {w['workers']} workers × {w['kv_blocks_per_worker']} KV blocks",
             f"{'policy':14}{'hit rate':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'req/worker':>16}{'max/min':>9}"
             f"{'same worker':>13}{'predicted/actual hits':>24}{'s':>7}"]
    rows = [(name, m) for name, m in r["policies"].items()]
    if "shared_prompt" in r:
        rows.append(("prefix, 1 hot", r["shared_prompt"]))
    for name, m in rows:
        per = "/".join(str(v) for v in m["requests_per_worker"].values())
        same = f"{m['same_worker_turns']:.0%}" if m["same_worker_turns"] is not None else "-"
        lines.append(f"{name:14}{m['hit_rate']:>10.1%}{m['ttft_ms_p50']:>10.1f}{m['ttft_ms_p99']:>10.1f}{per:>16}"
                     f"{m['load_ratio']:>9.2f}{same:>13}{m['predicted_hit_tokens']:>12}/{m['actual_hit_tokens']:<11}"
                     f"{m['seconds']:>7.1f}")
    ceilings = ", ".join(f"{m['one_worker_hit_rate']:.1%}" for m in r["policies"].values())
    lines.append(f"{'one worker':14}{ceilings:>10}   (the same requests on one worker that holds everything)")
    lines.append("same worker: turns served where the conversation's previous turn was (random: 33%)")
    if "shared_prompt" in r:
        lines.append(f"'prefix, 1 hot': {w['shared_requests']} requests sharing one {w['shared_system_len']}-token "
                     f"system prompt, {w['shared_clients']} clients in a closed loop")
    g = r["goals"]
    lines.append("goals: " + ", ".join(f"{k} {v}" for k, v in g.items()))
    return "\n".join(lines)

"""`tokenbus bench-disagg`: colocated workers against disaggregated prefill/decode, on the same number
of workers and the same mixed workload, in one run.

Configurations, each on a fresh stack (its own nats-server, router, gateway, temp dir):
- colocated: 2 workers of role both; disagg: 1 prefill + 1 decode worker, the router started with
  --max-local-prefill between the chat prompts' length and the long prompts';
- with --large also colocated-3 (3 workers) against disagg-1p2d (1 prefill + 2 decode).
Every worker runs --threads (default 1) torch threads: on a 2-core machine two workers use the two
cores in either configuration (the other services share them too). Every worker's step holds
--max-num-batched-tokens (default 2048, the worker's own default) tokens at most, so a long prompt is
prefilled in chunks of that: a colocated worker's chat streams wait for each chunk's step.

The workload, the same token ids for every configuration (random ids from --seed), greedy, EOS
ignored: --chat-streams chat streams in a closed loop (each sends its next short prompt when the
last one ends) while --long-requests long prompts arrive every 1 / --long-rate seconds; the streams
stop when every long prompt has ended. A warm-up before the clock sends each worker a long prompt
and two chat prompts of other tokens (the first long step of a process is slower).

Figures per configuration: chat TPOT p50/p99 (per request: (e2e − TTFT) / (tokens − 1)), the gaps
between a chat stream's chunks (ITL; a chunk may carry several tokens), long-prompt TTFT p50/p99,
output tokens/s of all requests over the run; the router's prefill decisions (remote or local, and
why) and, for a disaggregated one, the decode workers' KV pulls over NATS as their heartbeats count
them (pulled bytes / transfer seconds, measured while the workload runs) beside a plain TCP copy of
the same bytes on 127.0.0.1 in 1 MB messages, after the stack has stopped. MB is 10^6 bytes.
The goal: disaggregation's chat TPOT p99 at least 2× lower than colocated's, its throughput within
10%. The command exits 1 when a configuration cannot run.
"""
import asyncio
import dataclasses
import random
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lab.common.clients import WsClient
from lab.common.records import router_stats
from lab.common.results import Result, finish, fmt, ratio, stats
from lab.common.turns import OPTIONS
from ops.procs import free_port
from ops.status import read_registry
from ops.up import Stack
from schemas import subjects
from schemas.messages import Heartbeat, RouterStats

GOAL_TPOT = 2.0            # colocated's chat TPOT p99 over disaggregation's, at least
GOAL_THROUGHPUT = 0.9      # disaggregation's output tokens/s over colocated's, at least
REQUEST_TIMEOUT = 300.0    # seconds; a request slower than this means the stack is broken
SOCKET_MESSAGE = 1 << 20   # bytes per send of the loopback copy
LONG_LEN = 2048            # the long prompts' default length, if the model's context allows
CONNECTIONS = 16           # websockets the requests are spread over at most


@dataclass(frozen=True, slots=True)
class Roles:
    """A configuration's workers: colocated (w0..), prefill (p0..) and decode (d0..), as Stack starts them."""
    both: int = 0
    prefill: int = 0
    decode: int = 0


CONFIGS = {"colocated": Roles(both=2), "disagg": Roles(prefill=1, decode=1)}
LARGE = {"colocated-3": Roles(both=3), "disagg-1p2d": Roles(prefill=1, decode=2)}
PAIRS = (("disagg", "colocated"), ("disagg-1p2d", "colocated-3"))


@dataclass(slots=True)
class Workload:
    chat_streams: int
    chat_input_len: tuple[int, int]
    chat_output: int
    long_prompts: list[list[int]]
    long_output: int
    long_interval: float           # seconds between long arrivals
    seed: int
    vocab: int

    def chats(self, stream: str = "chat") -> Iterator[list[int]]:
        """The chat prompts, in order: the same endless sequence for every configuration."""
        rng = random.Random(f"{self.seed}-{stream}")
        while True:
            yield [rng.randrange(16, self.vocab) for _ in range(rng.randint(*self.chat_input_len))]

    def describe(self) -> str:
        lo, hi = self.chat_input_len
        return (f"{self.chat_streams} chat streams in a closed loop (prompts {lo}-{hi} tokens, {self.chat_output} "
                f"output tokens) while {len(self.long_prompts)} long prompts of {len(self.long_prompts[0])} tokens "
                f"({self.long_output} output tokens) arrive every {self.long_interval:g} s; greedy, EOS ignored")


def workload(args, vocab: int, context: int) -> Workload:
    """The run's workload from the command's options; ValueError naming the option a prompt cannot fit."""
    long_len = args.long_len or min(LONG_LEN, context - args.long_output - 1)
    if long_len + args.long_output >= context:
        raise ValueError(f"--long-len {long_len} + --long-output {args.long_output} must stay under the model's "
                         f"context, {context} tokens")
    if args.chat_input_len[1] >= long_len:
        raise ValueError(f"--chat-input-len up to {args.chat_input_len[1]} must be shorter than the long prompts, "
                         f"{long_len} tokens")
    rng = random.Random(f"{args.seed}-long")      # a string: random.Random(-1) is random.Random(1)
    longs = [[rng.randrange(16, vocab) for _ in range(long_len)] for _ in range(args.long_requests)]
    return Workload(args.chat_streams, tuple(args.chat_input_len), args.chat_output, longs, args.long_output,
                    1 / args.long_rate, args.seed, vocab)


# -- the client -----------------------------------------------------------------------------------

async def ask(client: WsClient, prompt: list[int], max_tokens: int) -> Result:
    r = await asyncio.wait_for(client.send({"prompt_token_ids": prompt, "max_tokens": max_tokens}), REQUEST_TIMEOUT)
    if r.error is not None:
        raise RuntimeError(f"a request of {len(prompt)} prompt tokens failed: {r.error}")
    return r


async def drive(url: str, w: Workload) -> tuple[list[Result], list[Result], float]:
    """The chat streams and the long arrivals until every long prompt ended: (chat results, long
    results, seconds from the first send to the last end)."""
    client = WsClient(url, min(w.chat_streams + len(w.long_prompts), CONNECTIONS), None, OPTIONS)
    await client.open()
    chats, longs, prompts, done = [], [], w.chats(), asyncio.Event()

    async def stream() -> None:
        while not done.is_set():
            chats.append(await ask(client, next(prompts), w.chat_output))

    async def long(i: int, prompt: list[int]) -> None:
        await asyncio.sleep(i * w.long_interval)
        longs.append(await ask(client, prompt, w.long_output))

    async def arrivals() -> None:
        await asyncio.gather(*(long(i, p) for i, p in enumerate(w.long_prompts)))
        done.set()

    start = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:          # a failed request cancels the others
            for _ in range(w.chat_streams):
                tg.create_task(stream())
            tg.create_task(arrivals())
        seconds = time.perf_counter() - start
    except ExceptionGroup as e:
        raise e.exceptions[0] from None
    finally:
        await client.close()
    return chats, longs, seconds


async def warm(url: str, w: Workload, workers: int) -> None:
    """A long prompt and two chat prompts per worker, all at once, of tokens the run never sends."""
    rng, chats = random.Random(f"{w.seed}-warm-long"), w.chats("warm-chat")
    longs = [[rng.randrange(16, w.vocab) for _ in w.long_prompts[0]] for _ in range(workers)]
    client = WsClient(url, min(3 * workers, CONNECTIONS), None, OPTIONS)
    await client.open()
    try:
        await asyncio.gather(*(ask(client, p, 2) for p in longs),
                             *(ask(client, next(chats), 4) for _ in range(2 * workers)))
    finally:
        await client.close()


# -- what the stack says --------------------------------------------------------------------------

def snapshot(stack: Stack, router: str) -> tuple[dict[str, Heartbeat], RouterStats]:
    """Every worker's heartbeat and the router's next stats record, a heartbeat after whatever just ended."""
    time.sleep(3 * subjects.HEARTBEAT_SECONDS)
    beats = {b.worker: b for b in asyncio.run(read_registry(stack.nats_url))}
    record = asyncio.run(router_stats(stack.nats_url, router, lambda s: True, timeout=5.0))
    if record is None:
        raise TimeoutError(f"router {router} published no stats within 5 s")
    return beats, record


def kv_pulls(before: dict[str, Heartbeat], after: dict[str, Heartbeat]) -> dict | None:
    """The decode workers' KV pulls during the run (None without decode workers); per-transfer p50/p99
    are the heartbeats' (over each worker's recent transfers), the highest of the decode workers'."""
    decoders = [w for w, b in after.items() if b.role == "decode" and b.kv_transfer is not None]
    if not decoders:
        return None
    diff = lambda field: sum(getattr(after[w].kv_transfer, field) - getattr(before[w].kv_transfer, field)  # noqa: E731
                             for w in decoders)
    handoffs = sum(b.kv_transfer.handoffs - before[w].kv_transfer.handoffs for w, b in after.items()
                   if b.role == "prefill" and b.kv_transfer is not None)
    out = {f: diff(f) for f in ("transfers", "pulled_blocks", "pulled_bytes", "cached_blocks", "failures",
                                "recomputes", "transfer_seconds")}
    out["transfer_seconds"] = round(out["transfer_seconds"], 4)
    out["handoffs"] = handoffs
    out["transfer_ms_p50"] = max(after[w].kv_transfer.transfer_ms_p50 for w in decoders)
    out["transfer_ms_p99"] = max(after[w].kv_transfer.transfer_ms_p99 for w in decoders)
    out["nats_mb_per_s"] = round(out["pulled_bytes"] / out["transfer_seconds"] / 1e6, 1) \
        if out["transfer_seconds"] else None
    return out


def socket_copy(nbytes: int) -> float:
    """Seconds to send nbytes over a loopback TCP connection in SOCKET_MESSAGE sends, until a thread
    has received them all."""
    server = socket.create_server(("127.0.0.1", 0))
    got = threading.Thread(target=drain, args=(server, nbytes))
    got.start()
    message = memoryview(bytes(SOCKET_MESSAGE))
    start = time.perf_counter()
    with socket.create_connection(server.getsockname()) as c:
        for sent in range(0, nbytes, SOCKET_MESSAGE):
            c.sendall(message[:min(SOCKET_MESSAGE, nbytes - sent)])
        got.join()
    seconds = time.perf_counter() - start
    server.close()
    return seconds


def drain(server: socket.socket, nbytes: int) -> None:
    conn, _ = server.accept()
    buf = bytearray(SOCKET_MESSAGE)
    with conn:
        while nbytes > 0:
            n = conn.recv_into(buf, min(len(buf), nbytes))
            if not n:
                raise RuntimeError(f"the loopback copy ended {nbytes} bytes short")
            nbytes -= n


# -- one configuration ----------------------------------------------------------------------------

def start(model: str, roles: Roles, args, data_dir: Path) -> tuple[Stack, str]:
    """A started stack of these workers, and its router's id."""
    router = f"bench-disagg-{int(time.time() * 1000) % 100000}"
    stack = Stack(model, free_port(), data_dir, nats_port=free_port(), workers=roles.both,
                  prefill_workers=roles.prefill, decode_workers=roles.decode,
                  worker_args=["--threads", str(args.threads), "--max-num-batched-tokens",
                               str(args.max_num_batched_tokens)],
                  worker_env={"OMP_NUM_THREADS": str(args.threads)},
                  router_args=["--id", router, "--max-local-prefill", str(args.max_local_prefill)])
    stack.start()
    return stack, router


def measure(model: str, roles: Roles, w: Workload, args, data_dir: Path) -> dict:
    stack, router = start(model, roles, args, data_dir)
    try:
        stack.wait_ready()
        asyncio.run(warm(stack.url, w, len(stack.worker_roles)))
        beats, stats_before = snapshot(stack, router)
        chats, longs, seconds = asyncio.run(drive(stack.url, w))
        after, stats_after = snapshot(stack, router)
    finally:
        stack.stop()
    row = figures(chats, longs, seconds)
    row["workers"] = dict(stack.worker_roles)
    row["finished_per_worker"] = {k: b.requests_finished - beats[k].requests_finished for k, b in after.items()}
    row["router_prefill"] = {k: v - stats_before.prefill.get(k, 0) for k, v in stats_after.prefill.items()
                             if v - stats_before.prefill.get(k, 0)}
    row["kv_transfer"] = kv_pulls(beats, after)
    if row["kv_transfer"] and row["kv_transfer"]["pulled_bytes"]:
        kv = row["kv_transfer"]
        kv["socket_seconds"] = round(socket_copy(kv["pulled_bytes"]), 4)
        kv["socket_mb_per_s"] = round(kv["pulled_bytes"] / kv["socket_seconds"] / 1e6, 1)
        kv["socket_vs_nats"] = ratio(kv["socket_mb_per_s"], kv["nats_mb_per_s"])
    return row


def figures(chats: list[Result], longs: list[Result], seconds: float) -> dict:
    out = sum(r.output_tokens for r in chats + longs)
    return {"seconds": round(seconds, 3), "chat_requests": len(chats), "long_requests": len(longs),
            "output_tokens": out, "output_tokens_per_s": round(out / seconds, 2),
            "chat_tpot_ms": stats([r.tpot * 1e3 for r in chats if r.tpot is not None]),
            "chat_itl_ms": stats([(b - a) * 1e3 for r in chats for a, b in zip(r.chunks, r.chunks[1:])]),
            "chat_ttft_ms": stats([r.ttft * 1e3 for r in chats]),
            "long_ttft_ms": stats([r.ttft * 1e3 for r in longs]),
            "long_tpot_ms": stats([r.tpot * 1e3 for r in longs if r.tpot is not None])}


# -- the run --------------------------------------------------------------------------------------

def compare(rows: dict[str, dict]) -> list[dict]:
    """Each disaggregated configuration against the colocated one of as many workers: its chat TPOT
    p99 ratio (colocated's over its own), its throughput ratio (its own over colocated's), the goal."""
    out = []
    for disagg, colocated in PAIRS:
        d, c = rows.get(disagg, {}), rows.get(colocated, {})
        if not d or not c or "error" in d or "error" in c:
            continue
        tpot = ratio(c["chat_tpot_ms"]["p99"], d["chat_tpot_ms"]["p99"])
        tps = ratio(d["output_tokens_per_s"], c["output_tokens_per_s"])
        out.append({"disagg": disagg, "colocated": colocated, "chat_tpot_p99_lower": tpot,
                    "chat_tpot_p50_lower": ratio(c["chat_tpot_ms"]["p50"], d["chat_tpot_ms"]["p50"]),
                    "long_ttft_p99_ratio": ratio(d["long_ttft_ms"]["p99"], c["long_ttft_ms"]["p99"]),
                    "throughput_ratio": tps,
                    "met": tpot is not None and tps is not None and tpot >= GOAL_TPOT and tps >= GOAL_THROUGHPUT})
    return out


def run(args) -> dict:
    from workers.models import catalogue
    from workers.models.config import ModelConfig

    model = catalogue.resolve(args.model)
    cfg = ModelConfig.load(model)
    w = workload(args, cfg.vocab_size, cfg.max_model_len)
    if args.max_local_prefill is None:
        args.max_local_prefill = (args.chat_input_len[1] + len(w.long_prompts[0])) // 2
    configs = {**CONFIGS, **(LARGE if args.large else {})}
    report = {"model": model, "threads": args.threads, "max_num_batched_tokens": args.max_num_batched_tokens,
              "workload": w.describe(), "seed": args.seed,
              "long_len": len(w.long_prompts[0]), "max_local_prefill": args.max_local_prefill,
              "configs": {name: dataclasses.asdict(r) for name, r in configs.items()}, "results": {}}
    print(f"bench-disagg: {w.describe()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, roles in configs.items():
            data_dir = Path(args.data_dir or tmp) / name
            try:
                report["results"][name] = measure(model, roles, w, args, data_dir)
            except Exception as e:                     # reported; the other configurations go on
                traceback.print_exc()
                report["results"][name] = {"error": f"{type(e).__name__}: {e}; logs in {data_dir / 'logs'}"}
            print(f"bench-disagg:   {name}: {line(report['results'][name])}", flush=True)
    report["goals"] = compare(report["results"])
    return report


def main(args) -> int:
    report = run(args)
    bad = [f"{name} did not run: {r['error'].splitlines()[0]}" for name, r in report["results"].items() if "error" in r]
    return finish("bench-disagg", report, args, table, plot, bad)


# -- the table ------------------------------------------------------------------------------------

def line(r: dict) -> str:
    if "error" in r:
        return f"unavailable: {r['error'].splitlines()[0]}"
    return (f"chat TPOT p99 {fmt(r['chat_tpot_ms']['p99'])} ms, long TTFT p99 {fmt(r['long_ttft_ms']['p99'])} ms, "
            f"{r['output_tokens_per_s']:.1f} output tok/s")


def times(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def prefill(r: dict) -> str:
    """The router's prefill decisions in the run: remote and local counts."""
    counts = r["router_prefill"]
    remote = sum(v for k, v in counts.items() if k.startswith("remote"))
    local = sum(v for k, v in counts.items() if k.startswith("local"))
    return f"{remote}/{local}" if counts else "-"


def table(report: dict) -> str:
    lines = [f"bench-disagg: {report['model']}, {report['threads']} torch thread(s) and steps of at most "
             f"{report['max_num_batched_tokens']} tokens per worker; long prompts above {report['max_local_prefill']} "
             f"uncached tokens go to a prefill worker",
             report["workload"],
             f"{'':13}{'workers':>12}{'chat TPOT p50':>14}{'p99':>8}{'ITL p99':>9}{'long TTFT p50':>15}{'p99':>9}"
             f"{'tok/s':>8}{'chats':>7}{'remote/local':>14}"]
    for name, r in report["results"].items():
        if "error" in r:
            lines.append(f"{name:13}unavailable: {r['error'].splitlines()[0]}")
            continue
        lines.append(f"{name:13}{' '.join(r['workers']):>12}{fmt(r['chat_tpot_ms']['p50']):>14}"
                     f"{fmt(r['chat_tpot_ms']['p99']):>8}{fmt(r['chat_itl_ms']['p99']):>9}"
                     f"{fmt(r['long_ttft_ms']['p50']):>15}{fmt(r['long_ttft_ms']['p99']):>9}"
                     f"{r['output_tokens_per_s']:>8.1f}{r['chat_requests']:>7}{prefill(r):>14}")
    for name, r in report["results"].items():
        kv = r.get("kv_transfer")
        if kv and kv.get("socket_mb_per_s"):
            lines.append(f"{name}: KV pulled over NATS: {kv['transfers']} transfers, {kv['pulled_bytes'] / 1e6:.1f} MB "
                         f"in {kv['transfer_seconds']:.3f} s = {fmt(kv['nats_mb_per_s'])} MB/s (per transfer p50 "
                         f"{fmt(kv['transfer_ms_p50'])} ms, p99 {fmt(kv['transfer_ms_p99'])} ms); a loopback TCP copy "
                         f"of the same bytes: {kv['socket_mb_per_s']:.1f} MB/s ({times(kv['socket_vs_nats'])} NATS's)")
        elif kv is not None:
            lines.append(f"{name}: no KV pulled over NATS in the run ({kv['transfers']} transfers)")
    for g in report["goals"]:
        lines.append(f"goal, {g['disagg']} vs {g['colocated']}: chat TPOT p99 {times(g['chat_tpot_p99_lower'])} lower "
                     f"(≥ {GOAL_TPOT:g}x), throughput {times(g['throughput_ratio'])} (≥ {GOAL_THROUGHPUT:g}x), long "
                     f"TTFT p99 {times(g['long_ttft_p99_ratio'])}: {'met' if g['met'] else 'NOT met'}")
    lines.append("TPOT, TTFT, ITL in ms; TPOT per request: (e2e − TTFT) / (tokens − 1); ITL: gaps between a chat "
                 "stream's chunks; tok/s: output tokens of every request over the run; chats: chat requests done; "
                 "remote/local: the router's prefill decisions (a prefill worker or the decode worker itself)")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Chat TPOT p50/p99, long TTFT p50/p99 and output tokens/s per configuration (PNG or SVG by the name)."""
    from matplotlib.figure import Figure

    rows = {n: r for n, r in report["results"].items() if "error" not in r}
    fig = Figure(figsize=(13, 3.2))
    panels = (("chat TPOT (ms)", "chat_tpot_ms"), ("long TTFT (ms)", "long_ttft_ms"), ("output tokens/s", None))
    for ax, (title, key) in zip(fig.subplots(1, 3), panels):
        if key is None:
            ax.barh(list(rows), [r["output_tokens_per_s"] for r in rows.values()], color="tab:blue")
        else:
            y = range(len(rows))
            ax.barh([i - 0.2 for i in y], [r[key]["p50"] or 0 for r in rows.values()], 0.4, label="p50")
            ax.barh([i + 0.2 for i in y], [r[key]["p99"] or 0 for r in rows.values()], 0.4, label="p99")
            ax.set_yticks(list(y), list(rows))
            ax.legend()
        ax.set(title=title)
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)

"""`tokenbus bench`: a load generator against a running gateway, over the websocket protocol (ws://…/ws)
or the OpenAI HTTP API (http://…/v1/chat/completions, streamed as server-sent events).

Arrivals: a fixed number of conversations in flight (--concurrency) or Poisson arrivals at
--request-rate per second (capped by --concurrency when both are given). Workloads are
conversations of one or more turns, built before the clock starts from real text of the
tokenizer's corpus cut to token lengths:
- random: one turn, input and output lengths drawn around --input-len / --output-len;
- shared-prefix: one turn behind one of --num-prefixes long system prompts of --prefix-len tokens;
- chat: --turns turns per conversation, each turn sending the whole history; the seed workload
  (3k input, 400 output tokens a turn on average) scaled by --scale;
- --dataset FILE: JSON lines of {"prompt": …} or {"messages": […]}, optional "max_tokens".
Per request: TTFT (send → first token), TPOT ((e2e − TTFT) / (output tokens − 1)), the gaps
between streamed chunks (ITL) and e2e; then percentiles, throughput, goodput under the SLOs,
errors by code, and the client's own CPU per token (so one can see it is not the bottleneck)."""
import argparse
import asyncio
import collections
import itertools
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
from tqdm import tqdm

from lab.common.clients import HttpClient, WsClient
from lab.common.corpus import Corpus, length
from lab.common.results import Result, show, stats
from ops.tokenizer import load_tokenizer

SEED_INPUT, SEED_OUTPUT = 3000, 400      # the production turn: 3k tokens in, 400 out
MAX_INFLIGHT_PER_CONNECTION = 256        # the gateway's limit per websocket
@dataclass(slots=True)
class Conversation:
    head: list[dict]                     # messages before the first turn (a system prompt)
    users: list[str]                     # one user message per turn
    max_tokens: list[int]


# -- workloads ------------------------------------------------------------------------------------------

def workload(args, corpus: Corpus) -> list[Conversation]:
    rng = random.Random(args.seed)
    if args.dataset:
        return dataset(Path(args.dataset), args.num_requests, args.output_len)
    n, out = args.num_requests, args.output_len
    if args.workload == "chat":
        return chats(rng, corpus, n, args.turns, args.scale)

    def draw(mean: int) -> int:
        return length(rng, mean, args.range_ratio, args.length_dist)

    if args.workload == "shared-prefix":
        prefixes = [[{"role": "system", "content": corpus.text(rng, args.prefix_len)}]
                    for _ in range(args.num_prefixes)]
        return [Conversation(rng.choice(prefixes), [corpus.text(rng, draw(args.input_len))], [draw(out)])
                for _ in range(n)]
    return [Conversation([], [corpus.text(rng, draw(args.input_len))], [draw(out)]) for _ in range(n)]


def chats(rng: random.Random, corpus: Corpus, n: int, turns: int, scale: float) -> list[Conversation]:
    """Conversations of `turns` turns (n turns in all). Each turn sends the history, so turn i's input is
    i user messages and i−1 replies; the user message length makes the mean input the seed's 3k × scale."""
    out = max(1, round(SEED_OUTPUT * scale))
    user = max(1, round((2 * SEED_INPUT * scale - out * (turns - 1)) / (turns + 1)))
    convs = []
    while n > 0:
        k = min(turns, n)
        convs.append(Conversation([], [corpus.text(rng, user) for _ in range(k)], [out] * k))
        n -= k
    return convs


def dataset(path: Path, n: int, default_max: int) -> list[Conversation]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"--dataset {path}: no requests in it")
    convs = []
    for i, row in zip(range(n), itertools.cycle(rows)):
        msgs = row.get("messages") or [{"role": "user", "content": row.get("prompt")}]
        if not isinstance(msgs[-1].get("content"), str):
            raise ValueError(f"--dataset {path}: line {i % len(rows) + 1} needs a prompt or messages")
        max_tokens = row.get("max_tokens") or row.get("output_len") or default_max
        convs.append(Conversation(msgs[:-1], [msgs[-1]["content"]], [max_tokens]))
    return convs


# -- the clients ----------------------------------------------------------------------------------------

def client(args):
    options = {"temperature": args.temperature}
    if args.ignore_eos:
        options["ignore_eos"] = True
    if protocol(args) == "ws":
        return WsClient(args.url, args.connections or min(args.concurrency or 16, 16), args.api_key, options)
    return HttpClient(args.url, args.served_model, args.api_key, options)


def protocol(args) -> str:
    return args.protocol or ("ws" if args.url.startswith(("ws://", "wss://")) else "openai")   # http(s)://


# -- the run --------------------------------------------------------------------------------------------

async def drive(args, convs: list[Conversation], conn, progress) -> tuple[list[Result], float]:
    """Runs every conversation, at fixed concurrency or Poisson arrivals; the results and the duration."""
    results: list[Result] = []
    gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None

    async def converse(conv: Conversation) -> None:
        history = list(conv.head)
        for user, n in zip(conv.users, conv.max_tokens):
            history.append({"role": "user", "content": user})
            try:
                r = await asyncio.wait_for(conn.request(history, n), args.timeout)
            except asyncio.TimeoutError:
                r = Result(time.perf_counter() - args.timeout, end=time.perf_counter(), error="timeout")
            results.append(r)
            progress.update(1)
            history.append({"role": "assistant", "content": "".join(r.parts) if r.error is None else ""})

    async def gated(conv: Conversation) -> None:
        if gate is None:
            return await converse(conv)
        async with gate:
            await converse(conv)

    rng = random.Random(args.seed + 1)
    start = time.perf_counter()
    if args.request_rate:
        tasks, at = [], 0.0
        for conv in convs:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(gated(conv)))
            at += rng.expovariate(args.request_rate)
        await asyncio.gather(*tasks)
    else:
        queue = collections.deque(convs)

        async def worker():
            while queue:
                await converse(queue.popleft())

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results, time.perf_counter() - start


def summarize(args, results: list[Result], duration: float, cpu: float) -> dict:
    ok = [r for r in results if r.error is None and r.chunks]
    failed = [r for r in results if r.error is not None]
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    itl = [(b - a) * 1e3 for r in ok for a, b in itertools.pairwise(r.chunks)]
    out_tokens, in_tokens = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    chunks = sum(len(r.chunks) for r in results)
    report = {
        "protocol": protocol(args), "url": args.url,
        "workload": workload_desc(args),
        "duration_s": round(duration, 3),
        "requests": {"completed": len(ok), "failed": len(failed), "total": len(results)},
        "errors": dict(collections.Counter(r.error for r in failed)),
        "request_throughput": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(out_tokens / duration, 2),
        "input_tokens_per_s": round(in_tokens / duration, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / duration, 2),
        "output_tokens": out_tokens, "input_tokens": in_tokens,
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl), "e2e_ms": stats(e2e(ok)),
        "client": {"cpu_s": round(cpu, 3), "cpu_us_per_token": round(cpu / max(out_tokens, 1) * 1e6, 2),
                   "cpu_us_per_chunk": round(cpu / max(chunks, 1) * 1e6, 2),
                   "cpu_share_of_one_core": round(cpu / duration, 4)},
        "goodput": None,                          # without an SLO (--slo-ttft-ms, --slo-tpot-ms) there is none
    }
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        good = [r for r in ok if meets(r, args.slo_ttft_ms, args.slo_tpot_ms)]
        report["goodput"] = {"requests_per_s": round(len(good) / duration, 3), "good": len(good),
                             "fraction": round(len(good) / max(len(results), 1), 4),
                             "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    return report


def e2e(ok: list[Result]) -> list[float]:
    return [r.e2e * 1e3 for r in ok]


def meets(r: Result, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    if ttft_ms is not None and r.ttft * 1e3 > ttft_ms:
        return False
    return tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= tpot_ms


def workload_desc(args) -> dict:
    arrival = {"request_rate": args.request_rate, "max_concurrency": args.concurrency} if args.request_rate \
        else {"concurrency": args.concurrency}
    kind = f"dataset:{args.dataset}" if args.dataset else args.workload
    return {"kind": kind, "num_requests": args.num_requests, **arrival}


def table(r: dict) -> str:
    w = r["workload"]
    arrival = f"Poisson {w['request_rate']}/s" if w.get("request_rate") else f"concurrency {w['concurrency']}"
    req = r["requests"]
    lines = [f"tokenbus bench: {w['kind']}, {w['num_requests']} requests, {arrival}, {r['protocol']} {r['url']}",
             f"{'duration':28}{r['duration_s']:.2f} s",
             f"{'requests completed / failed':28}{req['completed']} / {req['failed']}"
             + (f"  ({', '.join(f'{k}: {v}' for k, v in r['errors'].items())})" if r["errors"] else ""),
             f"{'request throughput':28}{r['request_throughput']:.2f} req/s",
             f"{'output tokens/s':28}{r['output_tokens_per_s']:.1f}",
             f"{'total tokens/s':28}{r['total_tokens_per_s']:.1f}"]
    if r["goodput"]:
        g = r["goodput"]
        lines.append(f"{'goodput':28}{g['requests_per_s']:.2f} req/s ({g['fraction']:.1%} within TTFT ≤ "
                     f"{g['slo_ttft_ms']} ms, TPOT ≤ {g['slo_tpot_ms']} ms)")
    lines.append(f"{'':28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        lines.append(f"{key[:-3].upper() + ' (ms)':28}" + "".join(f"{'-' if s[k] is None else format(s[k], '.2f'):>10}"
                                            for k in ("mean", "p50", "p90", "p99")))
    c = r["client"]
    lines.append(f"{'client CPU':28}{c['cpu_us_per_token']:.1f} µs/token, {c['cpu_share_of_one_core']:.1%} of one core")
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    """Latency CDFs and output throughput over time, as a PNG."""
    figure(results).savefig(path, dpi=100)


def figure(results: list[Result]):
    """The two plots, each with its legend (a Figure without pyplot: no GUI backend, nothing to close)."""
    from matplotlib.figure import Figure

    ok = [r for r in results if r.error is None and r.chunks]
    t0 = min((r.start for r in results), default=0.0)
    fig = Figure(figsize=(13, 4.8))
    cdf, tput = fig.subplots(1, 2)
    series = {"TTFT": [r.ttft * 1e3 for r in ok], "TPOT": [r.tpot * 1e3 for r in ok if r.tpot is not None],
              "ITL": [(b - a) * 1e3 for r in ok for a, b in itertools.pairwise(r.chunks)], "E2E": e2e(ok)}
    for name, values in series.items():
        if values:
            xs = np.sort(values)
            cdf.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    cdf.set(xscale="log", xlabel="ms", ylabel="fraction of requests (ITL: of gaps)", title="latency CDFs")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()
    times = [(t - t0, r.output_tokens / len(r.chunks)) for r in ok for t in r.chunks]
    span = max((t for t, _ in times), default=1.0)
    width = max(span / 60, 0.25)
    bins = np.arange(0, span + width, width)
    counts, _ = np.histogram([t for t, _ in times], bins=bins, weights=[w for _, w in times])
    tokens = tput.plot(bins[:-1], counts / width, drawstyle="steps-post", label="output tokens/s")
    done, _ = np.histogram([r.end - t0 for r in ok], bins=bins)
    twin = tput.twinx()
    requests = twin.plot(bins[:-1], done / width, drawstyle="steps-post", color="tab:orange",
                         label="requests completed/s")
    tput.set(xlabel="s since start", ylabel="output tokens/s", title="throughput over time")
    twin.set_ylabel("requests completed/s")
    tput.grid(True, alpha=0.3)
    tput.legend(handles=tokens + requests, loc="upper left")   # one legend for the lines of both y axes
    fig.tight_layout()
    return fig


async def bench(args, convs: list[Conversation]) -> tuple[list[Result], float, float]:
    conn = client(args)
    await conn.open()
    total = sum(len(c.users) for c in convs)
    progress = tqdm(total=total, unit="req", file=sys.stderr, disable=True if args.no_progress else None,
                    dynamic_ncols=True)
    cpu = time.process_time()
    try:
        results, duration = await drive(args, convs, conn, progress)
    finally:
        cpu = time.process_time() - cpu
        progress.close()
        await conn.close()
    return results, duration, cpu


REFUSED = ("unavailable", "overloaded", "rate_limit_exceeded", "concurrency_limit_exceeded", "too_many_requests",
           "http_429", "http_503")                 # refused at admission, with Retry-After: not served, not lost


def main(args) -> dict:
    if args.factors:
        return overload(args)
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = 8
    convs = workload(args, Corpus(load_tokenizer(args.model)))
    results, duration, cpu = asyncio.run(bench(args, convs))
    report = summarize(args, results, duration, cpu)
    show(report, args, table, plot, results)
    return report


def overload(args) -> dict:
    """The load test: Poisson arrivals at each of --factors × the peak for --duration seconds, open loop (no
    cap on concurrency: what the stack cannot take it must refuse). The peak is --peak requests/s, or the
    request throughput measured first at saturation (closed loop, --concurrency, default 32, for
    --num-requests). Per factor: what was offered, served and refused (by code), how fast a refusal came,
    and the latency of what was served."""
    corpus = Corpus(load_tokenizer(args.model))
    peak, measured = args.peak, None
    if peak is None:
        saturate = argparse.Namespace(**{**vars(args), "request_rate": None, "concurrency": args.concurrency or 32})
        results, duration, cpu = asyncio.run(bench(saturate, workload(saturate, corpus)))
        measured = summarize(saturate, results, duration, cpu)
        peak = measured["request_throughput"]
    rows = []
    for factor in args.factors:
        rate = factor * peak
        run = argparse.Namespace(**{**vars(args), "request_rate": rate, "concurrency": None,
                                    "num_requests": max(1, round(rate * args.duration))})
        results, duration, cpu = asyncio.run(bench(run, workload(run, corpus)))
        rows.append(overloaded(factor, rate, summarize(run, results, duration, cpu), results))
    report = {"workload": workload_desc(args), "peak_requests_per_s": round(peak, 3),
              "peak": "stated" if args.peak is not None else "measured at saturation",
              "duration_s": args.duration, "saturation": measured, "factors": rows}
    print(overload_table(report))
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report


def overloaded(factor: float, rate: float, summary: dict, results: list[Result]) -> dict:
    refused = [r for r in results if r.error in REFUSED]
    other = collections.Counter(r.error for r in results if r.error is not None and r.error not in REFUSED)
    return {"factor": factor, "offered_per_s": round(rate, 3), "sent": len(results),
            "served": summary["requests"]["completed"], "refused": len(refused),
            "refused_codes": dict(collections.Counter(r.error for r in refused)), "failed": dict(other),
            "refusal_ms": stats([r.e2e * 1e3 for r in refused]), "served_per_s": summary["request_throughput"],
            "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"], "goodput": summary["goodput"]}


def overload_table(report: dict) -> str:
    def pct(s: dict | None, k: str) -> str:
        return f"{s[k]:.0f}" if s and s.get(k) is not None else "-"

    head = ["factor", "offered/s", "sent", "served", "served/s", "refused", "refusal p50/p99 ms", "TTFT p50/p99 ms",
            "TPOT p50/p99 ms", "failed"]
    rows = [head] + [[f"{r['factor']:g}x", f"{r['offered_per_s']:.2f}", str(r["sent"]), str(r["served"]),
                      f"{r['served_per_s']:.2f}", str(r["refused"]),
                      f"{pct(r['refusal_ms'], 'p50')}/{pct(r['refusal_ms'], 'p99')}",
                      f"{pct(r['ttft_ms'], 'p50')}/{pct(r['ttft_ms'], 'p99')}",
                      f"{pct(r['tpot_ms'], 'p50')}/{pct(r['tpot_ms'], 'p99')}",
                      ", ".join(f"{k}: {v}" for k, v in r["failed"].items()) or "0"] for r in report["factors"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join([f"peak {report['peak_requests_per_s']} requests/s ({report['peak']}), "
                      f"{report['duration_s']:g} s at each factor", lines[0], "-" * len(lines[0]), *lines[1:]])

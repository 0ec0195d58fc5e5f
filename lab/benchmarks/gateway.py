"""`tokenbus bench-gateway`: what one gateway process costs and can carry, against a fast fake worker
(`python -m lab.benchmarks.gateway`, this module's other half: it takes requests from TB_REQUESTS as the
tokenizer would and answers each at once, one token per chunk, interleaving the streams like engine
steps). nats-server, the fake worker and the gateway are processes; the clients are raw HTTP/1.1 in
this one, so a client costs little next to the gateway.

- refused (429): requests of a tenant whose token bucket is empty; latency one at a time on a
  kept-alive connection, and requests/s over --concurrency connections;
- accepted: non-streaming chat completions of 1 token; latency one at a time, and the same round
  trip without the gateway (publish to TB_REQUESTS, wait for the answer on tb.out: what the gateway
  itself does), whose difference is the gateway's added latency; requests/s over --concurrency;
- streamed: --streams concurrent SSE streams of --tokens tokens each, and the same over websockets;
  tokens/s at the clients, and tokens per second of the gateway process's CPU time (what one
  gateway process can carry with a core to itself: on a small machine the clients, nats-server and
  the fake worker share the CPU with it, so the wall-clock rate understates it).
"""
import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import msgpack
import nats
import orjson
import uvloop
import websockets

import bus
from ops.procs import cpu_seconds, free_port, python_module, spawn, start_nats, stop
from schemas import subjects
from schemas.messages import GenerateRequest, Heartbeat, decode, encode
from schemas.sampling import SamplingParams
from workers.models.catalogue import resolve

KEYS = {"bench": {"tenant": "bench"}, "limited": {"tenant": "limited", "tokens_per_minute": 1000}}
HOLD = "hold"                                   # a prompt the fake worker never answers
PROMPT_TOKENS = 8
TAIL = [1, 2, 3, 4]


# -- the fake worker (python -m lab.benchmarks.gateway) --------------------------------------------------

class FakeWorker:
    """Answers every request with max_tokens tokens, one per chunk; each round publishes one chunk of
    every unfinished request (an engine step), then lets the event loop run."""

    def __init__(self, nc, token_ids: list[int]):
        self.nc, self.ids = nc, token_ids
        self.active: dict[str, list] = {}        # request id -> [subject, next offset, max_tokens]
        self.wake = asyncio.Event()

    async def on_request(self, msg) -> None:
        req = decode(msg.data, GenerateRequest)
        if req.prompt != HOLD and not (req.messages and req.messages[-1]["content"] == HOLD):
            self.active[req.id] = [subjects.out(req.id), 0, req.sampling.max_tokens]
            self.wake.set()

    def chunk(self, rid: str, offset: int, last: bool) -> bytes:
        token = [self.ids[offset % len(self.ids)]]
        if not last:
            return msgpack.packb({"t": "chunk", "v": 1, "id": rid, "seq": offset, "offset": offset,
                                  "token_ids": token, "prompt_tokens": PROMPT_TOKENS,
                                  "prompt_tail": TAIL if offset == 0 else []})
        return msgpack.packb({"t": "final", "v": 1, "id": rid, "seq": offset, "offset": offset, "token_ids": token,
                              "finish_reason": "length", "usage": {"prompt_tokens": PROMPT_TOKENS,
                                                                   "completion_tokens": offset + 1, "cached_tokens": 0},
                              "prompt_tail": TAIL if offset == 0 else []})

    async def steps(self) -> None:
        while True:
            if not self.active:
                self.wake.clear()
                await self.wake.wait()
            for rid, state in list(self.active.items()):
                subject, offset, n = state
                last = offset + 1 >= n
                await self.nc.publish(subject, self.chunk(rid, offset, last))
                state[1] = offset + 1
                if last:
                    del self.active[rid]
            await asyncio.sleep(0)

    async def beat(self, kv) -> None:
        while True:
            hb = Heartbeat("bench", time.time(), "bench", 16, 1 << 20, 0, 0, 1 << 20, 1 << 20, 0, 0, 0)
            await kv.put(hb.worker, encode(hb))
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)


async def worker(nats_url: str, model: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    nc = await bus.connect(nats_url, "bench-worker", role="worker")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    fake = FakeWorker(nc, tok.encode(" the paged cache serves every token fast").ids)
    await js.subscribe("tb.req.new.>", cb=fake.on_request, ordered_consumer=True)
    await asyncio.gather(fake.steps(), fake.beat(await bus.registry(js)))


# -- raw HTTP/1.1 clients -------------------------------------------------------------------------

def post(path: str, body: dict, key: str, close: bool = False) -> bytes:
    data = orjson.dumps(body)
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nauthorization: Bearer {key}\r\n"
            f"content-length: {len(data)}\r\n{'connection: close' + chr(13) + chr(10) if close else ''}\r\n"
            ).encode() + data


async def exchange(reader, writer, request: bytes) -> int:
    """Sends one request on a kept-alive connection and reads its whole (content-length) answer; the status."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    size = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    await reader.readexactly(size)
    return int(head[9:12])


async def latencies(port: int, request: bytes, n: int, want: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    for _ in range(n):
        start = time.perf_counter()
        status = await exchange(reader, writer, request)
        out.append((time.perf_counter() - start) * 1e3)
        assert status == want, f"expected {want}, got {status}"
    writer.close()
    return out


async def rate(port: int, request: bytes, n: int, concurrency: int, want: int) -> float:
    """Requests per second, n requests over `concurrency` kept-alive connections."""
    async def client(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(k):
            status = await exchange(reader, writer, request)
            assert status == want, f"expected {want}, got {status}"
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(n // concurrency) for _ in range(concurrency)))
    return concurrency * (n // concurrency) / (time.perf_counter() - start)


async def sse_stream(port: int, request: bytes) -> int:
    """Reads one SSE stream (connection: close) to its end; the number of data events."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    body = bytearray()                           # counted whole: a read may end inside "data: "
    while part := await reader.read(1 << 16):
        body += part
    writer.close()
    return body.count(b"data: ")


async def ws_streams(url: str, streams: int, tokens: int) -> int:
    """`streams` generate frames on one websocket, read to their done frames; the tokens received."""
    got = 0
    async with websockets.connect(url + "?api_key=bench", max_size=None) as ws:
        for i in range(streams):
            await ws.send(orjson.dumps({"type": "generate", "id": str(i), "prompt": "go", "max_tokens": tokens,
                                        "ignore_eos": True}).decode())
        left = streams
        while left:
            frame = orjson.loads(await ws.recv())
            if frame["type"] == "delta":
                got += len(frame["token_ids"])
            elif frame["type"] == "done":
                left -= 1
            else:
                raise RuntimeError(f"stream error: {frame}")
    return got


async def streamed(port: int, pid: int, streams: int, tokens: int, via: str) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    cpu, start = cpu_seconds(pid), time.perf_counter()
    if via == "sse":
        events = await asyncio.gather(*(sse_stream(port, post("/v1/chat/completions", body, "bench", close=True))
                                        for _ in range(streams)))
        got = sum(events) - 3 * streams              # less the role, finish and [DONE] events
    else:
        got = await ws_streams(f"ws://127.0.0.1:{port}/ws", streams, tokens)
    wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    assert got == streams * tokens, f"{via}: {got} tokens of {streams * tokens}"
    return {"tokens": got, "seconds": round(wall, 3), "tokens_per_s": round(got / wall),
            "gateway_cpu_s": round(cpu, 3), "tokens_per_gateway_cpu_s": round(got / cpu) if cpu else None}


async def direct(nats_url: str, n: int) -> list[float]:
    """The accepted request's round trip without the gateway: subscribe tb.out, publish to TB_REQUESTS, wait."""
    nc = await nats.connect(nats_url)
    js, out = nc.jetstream(), []
    for _ in range(n):
        rid = uuid.uuid4().hex
        start, done = time.perf_counter(), asyncio.get_running_loop().create_future()

        async def answered(msg, done=done) -> None:
            if not done.done():
                done.set_result(msg)

        sub = await nc.subscribe(subjects.out(rid), cb=answered)
        req = GenerateRequest(rid, "bench", SamplingParams(max_tokens=1), messages=[{"role": "user", "content": "hi"}],
                              cache_salt="bench", created=time.time())
        await js.publish(subjects.request_new("bench", rid), encode(req), headers=subjects.msg_id(rid))
        await done
        await sub.unsubscribe()
        out.append((time.perf_counter() - start) * 1e3)
    await nc.close()
    return out


# -- the run --------------------------------------------------------------------------------------

def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"p50_ms": round(statistics.median(ms), 3), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 3)}


async def measure(args, port: int, nats_url: str, pid: int) -> dict:
    chat = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    refused = post("/v1/chat/completions", {**chat, "max_tokens": 900}, "limited")
    accepted = post("/v1/chat/completions", chat, "bench")
    _, hold = await asyncio.open_connection("127.0.0.1", port)   # empties the limited tenant's bucket
    hold.write(post("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": HOLD}],
                                             "max_tokens": 900}, "limited"))
    await asyncio.sleep(0.5)
    n, c = args.requests, args.concurrency
    await latencies(port, accepted, 50, 200)                    # warm up both paths
    await latencies(port, refused, 50, 429)
    r = {"refused_429": {**summary(await latencies(port, refused, n, 429)),
                         "requests_per_s": round(await rate(port, refused, n, c, 429))},
         "accepted": {**summary(await latencies(port, accepted, n, 200)),
                      "requests_per_s": round(await rate(port, accepted, n, c, 200))}}
    base = summary(await direct(nats_url, n))
    r["accepted"]["without_gateway_p50_ms"] = base["p50_ms"]
    r["accepted"]["added_p50_ms"] = round(r["accepted"]["p50_ms"] - base["p50_ms"], 3)
    r["streamed_sse"] = await streamed(port, pid, args.streams, args.tokens, "sse")
    r["streamed_ws"] = await streamed(port, pid, args.streams, args.tokens, "ws")
    hold.close()
    return r


def main(args) -> dict:
    model = resolve(args.model or "tiny")
    with tempfile.TemporaryDirectory() as tmp:
        nats_port, port = free_port(), free_port()
        nats_url = f"nats://127.0.0.1:{nats_port}"
        children = [start_nats(nats_port, Path(tmp))]
        try:
            keys = Path(tmp, "keys.json")
            keys.write_text(json.dumps(KEYS))
            children.append(spawn(python_module("lab.benchmarks.gateway", "--nats-url", nats_url, "--model", model),
                                  Path(tmp, "worker.log")))
            gateway = spawn(python_module("services.gateway", "--nats-url", nats_url, "--model", model, "--port",
                                          str(port), "--api-keys", str(keys), "--served-model-name", "bench"),
                            Path(tmp, "gateway.log"))
            children.append(gateway)
            ready(port, children)
            results = uvloop.run(measure(args, port, nats_url, gateway.pid))
        finally:
            stop(list(reversed(children)))
    report = {"workload": {"requests": args.requests, "concurrency": args.concurrency, "streams": args.streams,
                           "tokens": args.tokens, "cpus": os.cpu_count()}, **results}
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def ready(port: int, children, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in children:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[2] if len(p.args) > 2 else p.args[0]} exited with code {p.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the gateway did not become healthy")


def table(r: dict) -> str:
    w, ref, acc = r["workload"], r["refused_429"], r["accepted"]
    lines = [f"gateway overhead on {w['cpus']} CPUs: {w['requests']} requests per measurement, {w['concurrency']} "
             f"connections for requests/s; {w['streams']} streams × {w['tokens']} tokens",
             f"{'':34}{'p50 ms':>10}{'p99 ms':>10}{'requests/s':>12}",
             f"{'refused (429, token bucket)':34}{ref['p50_ms']:>10.3f}{ref['p99_ms']:>10.3f}"
             f"{ref['requests_per_s']:>12}",
             f"{'accepted (1 token, not streamed)':34}{acc['p50_ms']:>10.3f}{acc['p99_ms']:>10.3f}"
             f"{acc['requests_per_s']:>12}",
             f"{'  the same without the gateway':34}{acc['without_gateway_p50_ms']:>10.3f}",
             f"{'  added by the gateway':34}{acc['added_p50_ms']:>+10.3f}",
             f"{'':34}{'tokens/s':>10}{'per gateway CPU-s':>20}"]
    for name, key in (("streamed, SSE", "streamed_sse"), ("streamed, websocket", "streamed_ws")):
        s = r[key]
        lines.append(f"{name:34}{s['tokens_per_s']:>10}{s['tokens_per_gateway_cpu_s'] or '-':>20}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.gateway", description="The benchmark's fake worker.")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--model", required=True, help="HF checkpoint directory, for its tokenizer")
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    bus.run(worker(a.nats_url, a.model))

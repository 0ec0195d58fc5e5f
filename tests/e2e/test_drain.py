"""Drain: SIGTERM (or `tokenbus drain`) to a worker, a gateway, the router or the tokenizer under load.
The process stops taking new work, finishes what it holds within its --drain-timeout, hands the rest
over at once and exits 0; /readyz is 503 from the drain's start while /healthz stays 200; no request
is lost, cut or answered with other tokens than the offline engine's."""
import argparse
import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
import websockets

from ops import drain
from ops.procs import free_port
from ops.status import read_registry
from ops.up import Stack
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, completions, connect, receive, send, started
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(240)]

LONG = {"max_tokens": 600, "temperature": 0.8, "ignore_eos": True}   # streams that outlast the probes
RESUMED = 3000                 # a request that outlasts a drain's others: still streaming when its websocket closes


def probe(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def worker_stack(model: str, data_dir, drain_timeout: float) -> tuple[Stack, int]:
    """Two workers; w1 answers its probes on the port returned."""
    port = free_port()
    stack = started(Stack(model, free_port(), data_dir, nats_port=free_port(), workers=1,
                          worker_args=[*WORKER_ARGS, "--drain-timeout", str(drain_timeout)]))
    try:
        stack.spawn("w1", "workers.service", "--nats-url", stack.nats_url, "--model", model, "--id", "w1",
                    *stack.worker_args, "--health-port", str(port), role="worker")
        stack.workers = 2
        stack.wait_ready()
    except BaseException:
        stack.stop()
        raise
    return stack, port


def offline(model: str, prompts: dict[str, tuple[str, int]]) -> dict[str, list[int]]:
    llm = LLM(model)
    return {cid: llm.generate([p], SamplingParams(seed=seed, **LONG))[0].token_ids
            for cid, (p, seed) in prompts.items()}


async def load_with(stack: Stack, begin, end, n: int = 4) -> tuple[dict, dict]:
    """n requests on two workers; once every one generates, begin() (in a thread), then n more sent while
    end() runs (in a thread); every request's frames, and the prompts and seeds."""
    prompts = {f"a{i}": (f"before the drain {i}", i) for i in range(n)} | \
        {f"b{i}": (f"during the drain {i}", 100 + i) for i in range(n)}
    async with connect(stack) as ws:
        got = {f"a{i}": [] for i in range(n)}
        for i in range(n):
            p, seed = prompts[f"a{i}"]
            await send(ws, {"type": "generate", "id": f"a{i}", "prompt": p, "seed": seed, **LONG})
        while not all(got.values()):
            frame = await receive(ws)
            got[frame["id"]] += frame["token_ids"]
        await asyncio.to_thread(begin)
        ending = asyncio.create_task(asyncio.to_thread(end))
        for i in range(n):
            p, seed = prompts[f"b{i}"]
            await send(ws, {"type": "generate", "id": f"b{i}", "prompt": p, "seed": seed, **LONG})
        rest = await collect(ws, set(prompts), timeout=180)
        await ending
    for cid, toks in got.items():
        rest[cid]["token_ids"] = toks + rest[cid]["token_ids"]
    return rest, prompts


def draining(stack: Stack, worker: str) -> None:
    """Until the registry says the worker drains."""
    deadline = time.monotonic() + 10
    while not any(b.worker == worker and b.draining for b in asyncio.run(read_registry(stack.nats_url))):
        assert time.monotonic() < deadline, f"{worker} did not say it drains"
        time.sleep(0.02)


def check_identical(model: str, got: dict, prompts: dict) -> None:
    want = offline(model, prompts)
    for cid, g in got.items():
        assert g["end"]["type"] == "done", (cid, g["end"])
        assert g["token_ids"] == want[cid], cid


def test_a_draining_worker_finishes_what_it_holds_takes_nothing_new_and_exits(tiny_model, tmp_path):
    stack, port = worker_stack(tiny_model, tmp_path, drain_timeout=120)
    try:
        w1 = stack.children["w1"]
        seen = {}

        def sigterm():
            w1.send_signal(signal.SIGTERM)
            draining(stack, "w1")
            seen["readyz"], seen["healthz"] = probe(port, "/readyz"), probe(port, "/healthz")

        def end():
            seen["exit"] = w1.wait(120)

        got, prompts = asyncio.run(load_with(stack, sigterm, end))
        assert seen == {"readyz": 503, "healthz": 200, "exit": 0}
        check_identical(tiny_model, got, prompts)
        records = [r for r in asyncio.run(completions(stack.nats_url)) if r.worker]
        by_worker = {r.worker for r in records}
        assert by_worker == {"w0", "w1"}                   # w1 finished what it held
        assert not any(r.worker == "w1" and r.sampling.seed >= 100 for r in records)   # and took nothing new
        assert "strike" not in stack.log("router").read_text()
        assert [b.worker for b in asyncio.run(read_registry(stack.nats_url))] == ["w0"]
    finally:
        stack.stop()


def test_a_worker_past_its_drain_timeout_hands_its_requests_over_at_once(tiny_model, tmp_path):
    stack, _ = worker_stack(tiny_model, tmp_path, drain_timeout=0.5)
    try:
        w1 = stack.children["w1"]
        seen = {}

        def begin():
            seen["began"] = time.monotonic()
            seen["drain"] = drain.main(drain_args(stack, "w1"))      # --wait: back once w1 has gone
            seen["exit"], seen["gone"] = w1.wait(30), time.monotonic()

        got, prompts = asyncio.run(load_with(stack, begin, lambda: None))
        assert seen["drain"] == 0 and seen["exit"] == 0
        check_identical(tiny_model, got, prompts)
        moved = [json.loads(line) for line in stack.log("router").read_text().splitlines()
                 if '"work re-routed"' in line]
        assert moved and all(m["worker"] == "w1" for m in moved)
        assert "strike" not in stack.log("router").read_text()
        assert seen["gone"] - seen["began"] < 10           # not an ack wait, nor the long answers' time
    finally:
        stack.stop()


def drain_args(stack: Stack, name: str) -> argparse.Namespace:
    return argparse.Namespace(nats_url=stack.nats_url, name=name, wait=True, timeout=60.0)


def test_a_draining_gateway_lets_its_streams_finish_closes_websockets_with_1012_and_refuses_new_work(
        tiny_model, tmp_path):
    """Two gateways; on the first, a resumable and a plain websocket request and an SSE stream, then SIGTERM:
    /readyz 503, /livez 200, new requests 503; the plain request and the SSE stream finish there; the
    websocket then closes with 1012 and the resumable request is resumed on the other gateway, whole."""
    stack = started(Stack(tiny_model, free_port(), tmp_path, nats_port=free_port(), workers=1, gateways=2,
                          worker_args=WORKER_ARGS, gateway_args=["--drain-timeout", "60"]))
    gateway, port = stack.children["gateway"], stack.port
    try:
        prompts = {"r": ("resumed elsewhere", 1), "n": ("finished here", 2)}
        seen = {}

        def sse() -> dict:
            body = {"model": os.path.basename(stack.model), "prompt": "streamed over SSE", "seed": 3, "stream": True,
                    "stream_options": {"include_usage": True}, **LONG}
            req = urllib.request.Request(f"{stack.http}/v1/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
            events = []
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        events.append(json.loads(line[6:]))
            return {"finish": [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]],
                    "usage": events[-1]["usage"]}

        async def client():
            streaming = asyncio.create_task(asyncio.to_thread(sse))
            async with connect(stack) as ws:
                for cid, (p, seed) in prompts.items():
                    await send(ws, {"type": "generate", "id": cid, "prompt": p, "seed": seed, **LONG,
                                    "max_tokens": RESUMED if cid == "r" else LONG["max_tokens"],
                                    "resumable": cid == "r"})
                resume_id, got = (await receive(ws))["resume_id"], {"r": [], "n": []}
                while not all(got.values()):
                    frame = await receive(ws)
                    got[frame["id"]] += frame["token_ids"]
                gateway.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                seen["readyz"], seen["livez"] = probe(port, "/readyz"), probe(port, "/livez")
                seen["refused"] = probe(port, "/v1/models")
                ended = {}
                try:
                    while True:
                        frame = await receive(ws, 60)
                        if frame["type"] == "delta":
                            got[frame["id"]] += frame["token_ids"]
                        else:
                            ended[frame["id"]] = frame
                except websockets.ConnectionClosed as e:
                    seen["close"] = e.rcvd.code
            assert ended["n"]["type"] == "done" and "r" not in ended
            async with websockets.connect(stack.urls[1]) as ws:
                await send(ws, {"type": "resume", "id": resume_id, "offset": len(got["r"])})
                rest = await collect(ws, {resume_id}, timeout=120)
            got["r"] += rest[resume_id]["token_ids"]
            return got, rest[resume_id]["end"], await streaming

        got, end, streamed = asyncio.run(client())
        assert gateway.wait(30) == 0
        assert seen == {"readyz": 503, "livez": 200, "refused": 503, "close": 1012}
        assert end["type"] == "done"
        llm = LLM(tiny_model)
        assert got == {cid: llm.generate([p], SamplingParams(seed=seed, **{
            **LONG, "max_tokens": RESUMED if cid == "r" else LONG["max_tokens"]}))[0].token_ids
            for cid, (p, seed) in prompts.items()}
        assert streamed == {"finish": ["length"], "usage": streamed["usage"]}
        assert streamed["usage"]["completion_tokens"] == LONG["max_tokens"]
    finally:
        stack.stop()


@pytest.mark.parametrize("role", ["router", "tokenizer"])
def test_a_draining_router_or_tokenizer_hands_its_work_to_the_other_replica_and_exits(tiny_model, tmp_path, role):
    """A second replica beside the first; SIGTERM to the first under load: it exits 0, every request is
    answered with the offline engine's tokens (the second replica took what came after)."""
    stack = started(Stack(tiny_model, free_port(), tmp_path, nats_port=free_port(), workers=2,
                          worker_args=WORKER_ARGS))
    try:
        first = stack.children[role]
        args = list(first.args[first.args.index("-m") + 2:])
        stack.spawn(f"{role}2", f"services.{role}", *args, "--id", f"{role}-2")
        time.sleep(2)                                      # the second replica pulls, or answers, too
        seen = {}

        def sigterm():
            first.send_signal(signal.SIGTERM)

        def end():
            seen["exit"] = first.wait(60)

        got, prompts = asyncio.run(load_with(stack, sigterm, end))
        assert seen["exit"] == 0
        check_identical(tiny_model, got, prompts)
        assert '"drained"' in stack.log(role).read_text()
    finally:
        stack.stop()

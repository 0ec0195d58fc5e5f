"""nats-server SIGKILLed under load and started again 3 s later on the same port and store: nothing
accepted is lost, nothing runs twice, and nobody restarts anything. Every accepted request, those in
flight and those sent while the broker was down, completes with the offline engine's tokens; TB_RESULTS
holds one completion record per request id; /healthz recovers; new requests are served."""
import asyncio
import concurrent.futures
import threading
import time
import urllib.request

import pytest

from ops.procs import free_port
from ops.up import Stack
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, completions, connect, receive, send
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(300)]

GREEDY = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
BEFORE, DURING = 12, 4                       # requests in flight at the kill, and sent while the broker is down
DOWN = 3.0


def healthz(stack: Stack) -> int:
    try:
        with urllib.request.urlopen(stack.http + "/healthz", timeout=2) as r:
            return r.status
    except Exception:
        return 0


def test_a_broker_killed_under_load_loses_no_accepted_request_and_runs_none_twice(tiny_model, tmp_path):
    stack = Stack(tiny_model, free_port(), tmp_path, nats_port=free_port(), workers=1, worker_args=WORKER_ARGS)
    try:
        stack.start()
        stack.wait_ready()

        generating = threading.Event()

        async def load():
            async with connect(stack) as ws:
                for i in range(BEFORE):
                    await send(ws, {"type": "generate", "id": f"b{i}", "prompt": f"before the restart {i}", **GREEDY})
                got = {f"b{i}": [] for i in range(BEFORE)}
                first = await receive(ws)
                got[first["id"]] += first["token_ids"]
                generating.set()                           # the main thread kills the broker now
                await asyncio.sleep(0.5)
                for i in range(DURING):
                    await send(ws, {"type": "generate", "id": f"d{i}", "prompt": f"during the outage {i}", **GREEDY})
                rest = await collect(ws, set(got) | {f"d{i}" for i in range(DURING)}, timeout=180)
                for i, toks in got.items():
                    rest[i]["token_ids"] = toks + rest[i]["token_ids"]
                return rest

        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the client runs on; nats-server is this
            client = pool.submit(asyncio.run, load())              # thread's child (it dies with its thread)
            assert generating.wait(60), "no token came before the restart"
            stack.restart_nats(DOWN)
            got = client.result(timeout=200)
        prompts = {cid: (f"before the restart {cid[1:]}" if cid[0] == "b" else f"during the outage {cid[1:]}")
                   for cid in got}
        outs = LLM(tiny_model).generate(list(prompts.values()), SamplingParams(**GREEDY))   # one batch: greedy
        for (cid, g), want in zip(got.items(), outs, strict=True):                         # is batch-invariant
            assert g["end"]["type"] == "done", (cid, g["end"])
            assert g["token_ids"] == want.token_ids, cid
        records = asyncio.run(completions(stack.nats_url))
        ids = [r.id for r in records]
        assert len(ids) == len(set(ids)) == BEFORE + DURING           # one record per request id

        deadline = time.monotonic() + 30
        while healthz(stack) != 200:
            assert time.monotonic() < deadline, "/healthz did not recover"
            time.sleep(0.25)

        async def after():
            async with connect(stack) as ws:
                for i in range(3):
                    await send(ws, {"type": "generate", "id": f"a{i}", "prompt": f"after {i}", "max_tokens": 5,
                                    "ignore_eos": True})
                return await collect(ws, {f"a{i}" for i in range(3)}, timeout=60)
        assert all(g["end"]["type"] == "done" and len(g["token_ids"]) == 5 for g in asyncio.run(after()).values())
        stack.check_alive()                                           # nothing was restarted by hand
    finally:
        stack.stop()

"""A worker killed with SIGKILL leaves the registry, the requests it held are re-routed and finish
as if nothing happened, and the stack keeps serving with the others."""
import asyncio
import time

import pytest

from ops.status import read_registry
from schemas import subjects
from schemas.sampling import SamplingParams
from tests.e2e.conftest import collect, completions, connect, receive, send, start_stack
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(180)]

LONG = {"max_tokens": 400, "temperature": 0.8, "ignore_eos": True}


def test_a_killed_worker_leaves_the_registry_its_requests_move_and_the_others_serve(tiny_model, tmp_path):
    stack = start_stack(tiny_model, tmp_path)
    try:
        async def kill_mid_stream():
            async with connect(stack) as ws:
                for i in range(2):                # round-robin: one on each worker
                    await send(ws, {"type": "generate", "id": f"long{i}", "prompt": f"long {i}", "seed": i, **LONG})
                before = {"long0": [], "long1": []}
                while not all(before.values()):   # both are generating
                    frame = await receive(ws)
                    before[frame["id"]] += frame["token_ids"]
                stack.kill("w1")
                got = await collect(ws, {"long0", "long1"}, timeout=120)
                return {i: {**g, "token_ids": before[i] + g["token_ids"]} for i, g in got.items()}

        got = asyncio.run(kill_mid_stream())
        killed = time.monotonic()
        llm = LLM(tiny_model)
        for i in range(2):
            want = llm.generate([f"long {i}"], SamplingParams(seed=i, **LONG))[0]
            assert got[f"long{i}"]["end"]["type"] == "done"
            assert got[f"long{i}"]["token_ids"] == want.token_ids      # one seamless stream, nothing twice
        moved = [r for r in asyncio.run(completions(stack.nats_url)) if r.prompt_token_ids in
                 (llm.encode("long 0"), llm.encode("long 1"))]
        assert {r.worker for r in moved} == {"w0"}

        while [b.worker for b in asyncio.run(read_registry(stack.nats_url))] != ["w0"]:
            assert time.monotonic() - killed < subjects.WORKER_TTL + 2, "w1 is still registered"
            time.sleep(0.1)

        async def serve():
            async with connect(stack) as ws:
                for i in range(4):
                    await send(ws, {"type": "generate", "id": f"r{i}", "prompt": f"request {i}", "max_tokens": 5,
                                    "ignore_eos": True})
                return await collect(ws, {f"r{i}" for i in range(4)})

        assert all(g["end"]["type"] == "done" and len(g["token_ids"]) == 5 for g in asyncio.run(serve()).values())
        assert {r.worker for r in asyncio.run(completions(stack.nats_url))} == {"w0"}
    finally:
        stack.stop()

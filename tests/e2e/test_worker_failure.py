"""A worker killed with SIGKILL leaves the registry and the stack keeps serving with the others."""
import asyncio
import time

import pytest

from ops.status import read_registry
from schemas import subjects
from tests.e2e.conftest import collect, completions, connect, send, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_killed_worker_leaves_the_registry_and_the_others_serve(tiny_model, tmp_path):
    stack = start_stack(tiny_model, tmp_path)
    try:
        stack.kill("w1")
        killed = time.monotonic()
        while [b.worker for b in asyncio.run(read_registry(stack.nats_url))] != ["w0"]:
            assert time.monotonic() - killed < subjects.WORKER_TTL + 2, "w1 is still registered"
            time.sleep(0.1)

        async def run():
            async with connect(stack) as ws:
                for i in range(4):
                    await send(ws, {"type": "generate", "id": f"r{i}", "prompt": f"request {i}", "max_tokens": 5})
                return await collect(ws, {f"r{i}" for i in range(4)})

        got = asyncio.run(run())
        assert all(g["end"]["type"] == "done" and len(g["token_ids"]) == 5 for g in got.values())
        assert {r.worker for r in asyncio.run(completions(stack.nats_url))} == {"w0"}
    finally:
        stack.stop()

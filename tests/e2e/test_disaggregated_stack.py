"""A disaggregated stack as processes: a prefill worker p0 and a decode worker d0 behind the router. The
prefill worker is killed with SIGKILL in the middle of a transfer (an injected fault kills it after it answered
one of the transfer's fetches): the decode worker recomputes what it lacks and the request completes with
the offline engine's tokens; the stack then serves long prompts on d0 alone."""
import asyncio
import time

import orjson
import pytest

from ops.procs import free_port
from ops.status import read_registry
from ops.up import Stack
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, connect, send
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PARAMS = {"max_tokens": 24, "temperature": 0.8, "seed": 11, "ignore_eos": True}
LONG = " ".join(f"word{i} of the long prompt," for i in range(90))    # several hundred tokens: two fetches


def registered(stack: Stack, names: set[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while {b.worker for b in asyncio.run(read_registry(stack.nats_url))} != names:
        stack.check_alive()
        assert time.monotonic() < deadline, f"workers {names} did not register"
        time.sleep(0.2)


def test_the_prefill_worker_killed_mid_transfer_costs_a_recompute_not_the_request(tiny_model, tmp_path):
    stack = Stack(tiny_model, free_port(), tmp_path, nats_port=free_port(), workers=0,
                  router_args=["--max-local-prefill", "64"])
    try:
        stack.start()
        common = ["--nats-url", stack.nats_url, "--model", tiny_model, *WORKER_ARGS]
        stack.spawn("p0", "workers.service", *common, "--id", "p0", "--role", "prefill",
                    "--inject-fault", "kv-die-after=1", role="worker")
        stack.spawn("d0", "workers.service", *common, "--id", "d0", "--role", "decode", role="worker")
        stack.wait_ready()
        registered(stack, {"p0", "d0"})
        llm = LLM(tiny_model)
        assert len(llm.encode(LONG)) > 16 * 16       # more blocks than one KvBlocks message holds

        async def ask(rid: str):
            async with connect(stack) as ws:
                await send(ws, {"type": "generate", "id": rid, "prompt": LONG, **PARAMS})
                return (await collect(ws, {rid}, timeout=120))[rid]

        got = asyncio.run(ask("long"))
        want = llm.generate([LONG], SamplingParams(**PARAMS))[0].token_ids
        assert got["end"]["type"] == "done" and got["token_ids"] == want
        assert stack.children["p0"].wait(10) == -9            # it died by the hook, mid-transfer
        failed = [orjson.loads(line) for line in stack.log("d0").read_text().splitlines()
                  if "kv pull failed; recomputing what is missing" in line]
        assert len(failed) == 1 and failed[0]["prefill_worker"] == "p0"
        assert 0 < failed[0]["pulled"] < failed[0]["offered"]    # some blocks came before it died, not all

        stack.children.pop("p0")
        registered(stack, {"d0"})
        again = asyncio.run(ask("after"))                     # no prefill worker: d0 prefills it itself
        assert again["end"]["type"] == "done" and again["token_ids"] == want
    finally:
        stack.stop()

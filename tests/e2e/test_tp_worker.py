"""A tensor-parallel worker as a process: it serves the pipeline's requests with the tokens of a
single-rank engine, a follower that dies takes the worker down with a clear error (and out of the
registry), and however the worker ends, no follower outlives it."""
import asyncio
import os
import signal
import subprocess
import time

import pytest

from ops.procs import python_module, spawn
from ops.status import read_registry
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, connect, send, start_stack
from tests.workers.test_tensor_parallel import alive, children, gone
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def start_worker(nats_url: str, model: str, log) -> tuple[subprocess.Popen, int]:
    """A worker with --tp 2, registered; returns it and its follower's pid."""
    worker = spawn(python_module("workers.service", "--nats-url", nats_url, "--model", model, "--id", "tp",
                                 "--tp", "2", *WORKER_ARGS), log)
    deadline = time.monotonic() + 60
    while not asyncio.run(read_registry(nats_url)):
        assert worker.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the worker did not register"
        time.sleep(0.2)
    follower, = children(worker.pid)
    return worker, follower


def test_the_pipeline_on_a_tensor_parallel_worker_gives_the_single_rank_tokens(tiny_model, tmp_path):
    stack = start_stack(tiny_model, tmp_path, workers=1, extra_worker_args=["--tp", "2"])
    try:
        async def ask():
            async with connect(stack) as ws:
                await send(ws, {"type": "generate", "id": "g", "prompt": "Tensor parallel", "max_tokens": 16,
                                "temperature": 0})
                await send(ws, {"type": "generate", "id": "s", "prompt": "and sampled", "max_tokens": 16,
                                "temperature": 0.8, "seed": 4})
                return await collect(ws, {"g", "s"})

        got = asyncio.run(ask())
        llm = LLM(tiny_model)
        greedy = SamplingParams(max_tokens=16, temperature=0)
        assert got["g"]["token_ids"] == llm.generate("Tensor parallel", greedy)[0].token_ids
        assert got["s"]["token_ids"] == llm.generate("and sampled", SamplingParams(
            max_tokens=16, temperature=0.8, seed=4))[0].token_ids
        follower, = children(stack.children["w0"].pid)
    finally:
        stack.stop()
    assert gone([follower])


def test_a_dead_follower_stops_the_worker_with_an_error_and_it_leaves_the_registry(tiny_model, nats_url, tmp_path):
    log = tmp_path / "worker.log"
    worker, follower = start_worker(nats_url, tiny_model, log)
    os.kill(follower, signal.SIGKILL)
    assert worker.wait(10) == 1
    assert f"tensor-parallel rank 1 (pid {follower}) was killed by SIGKILL" in log.read_text()
    assert asyncio.run(read_registry(nats_url)) == []          # it deregistered on its way out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_worker_stops_its_follower_and_exits_cleanly(tiny_model, nats_url, tmp_path, sig):
    worker, follower = start_worker(nats_url, tiny_model, tmp_path / "worker.log")
    worker.send_signal(sig)
    assert worker.wait(10) == 0
    assert gone([follower])


def test_a_killed_worker_takes_its_follower_with_it(tiny_model, nats_url, tmp_path):
    worker, follower = start_worker(nats_url, tiny_model, tmp_path / "worker.log")
    assert alive(follower)
    worker.kill()
    worker.wait()
    assert gone([follower], within=5.0)

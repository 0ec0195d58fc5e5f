"""The real stack for end-to-end tests: nats-server and every service as its own process, on free
127.0.0.1 ports, stopped after the module."""
import asyncio
import contextlib

import orjson
import pytest
import websockets

from ops.procs import free_port
from ops.up import Stack
from schemas import subjects
from schemas.messages import Completion, decode

WORKER_ARGS = ["--max-num-seqs", "16", "--num-kv-blocks", "512"]


def start_stack(model: str, data_dir, workers: int = 2) -> Stack:
    stack = Stack(model, free_port(), data_dir, nats_port=free_port(), workers=workers, worker_args=WORKER_ARGS)
    try:
        stack.start()
        stack.wait_ready()
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = start_stack(tiny_model, tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()


async def send(ws, frame: dict) -> None:
    await ws.send(orjson.dumps(frame).decode())


async def receive(ws, timeout: float = 30.0) -> dict:
    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout))


async def collect(ws, ids: set[str], timeout: float = 60.0) -> dict[str, dict]:
    """Reads frames until every id in ids has its done or error frame: id → text, token_ids, end frame."""
    out = {i: {"text": "", "token_ids": [], "deltas": 0} for i in ids}
    pending = set(ids)
    async with asyncio.timeout(timeout):
        while pending:
            frame = await receive(ws, timeout)
            got = out[frame["id"]]
            if frame["type"] == "delta":
                got["text"] += frame["text"]
                got["token_ids"] += frame["token_ids"]
                got["deltas"] += 1
            else:
                got["end"] = frame
                pending.discard(frame["id"])
    return out


@contextlib.asynccontextmanager
async def connect(stack: Stack):
    async with websockets.connect(stack.url, max_size=None) as ws:
        yield ws


async def completions(nats_url: str, wait: float = 1.0) -> list[Completion]:
    """Every record in TB_RESULTS."""
    nc = await subjects.connect(nats_url, "test-results")
    js = nc.jetstream()
    sub = await js.subscribe(subjects.RESULTS_SUBJECTS, ordered_consumer=True)
    records = []
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
        while True:
            records.append(decode((await sub.next_msg(timeout=wait)).data, Completion))
    await nc.close()
    return records

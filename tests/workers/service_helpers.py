"""The worker service in-process, around an engine the test holds, on a real nats-server."""
import asyncio
import contextlib

import nats

from bus.log import configure
from schemas import subjects
from workers.engine.engine import LLMEngine
from workers.service import WorkerService


@contextlib.asynccontextmanager
async def worker(nats_url: str, engine: LLMEngine, chunk_rate: float = subjects.CHUNK_RATE, log=None):
    """Worker "w0" running until the block ends (logging to `log` if given)."""
    nc = await nats.connect(nats_url)
    service = WorkerService(nc, engine, "w0", "tiny", log or configure("worker").bind(worker="w0"), chunk_rate)
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        service.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)

"""A worker without a model, for router tests on a real nats-server. Its KV cache is a real
KVCacheManager; a work item's prompt is 'computed' at once (prefix hits taken, every full block
stored) and its blocks freed, then its completion record goes to TB_RESULTS. KV events and
snapshots go through the real worker's code (its Registry's publish_kv / on_snapshot,
workers/service/registry.py)."""
import asyncio
import contextlib
import time
from types import SimpleNamespace

import bus
from bus.log import configure
from schemas import subjects
from schemas.messages import Completion, Heartbeat, WorkItem, decode, encode
from schemas.sampling import SamplingParams
from workers.engine.kv_cache import KVCacheManager
from workers.engine.request import Request
from workers.service import WorkerService

BS = 4


class FakeWorker:
    def __init__(self, nc, worker: str, num_blocks: int = 32, max_num_seqs: int = 8):
        self.nc, self.js, self.id, self.max_num_seqs = nc, nc.jetstream(), worker, max_num_seqs
        self.kv = KVCacheManager(num_blocks, BS)
        self.kv.record_changes()
        self.service = WorkerService(nc, SimpleNamespace(kv=self.kv), worker, "fake", configure("fake-worker"))
        self.served: list[WorkItem] = []
        self.tasks: list[asyncio.Task] = []
        self.sub = None

    async def start(self, serve: bool = False) -> None:
        await bus.ensure_streams(self.js)
        self.registry = await bus.registry(self.js)
        self.sub = await self.nc.subscribe(subjects.kv_snapshot(self.id), cb=self.service.registry.on_snapshot)
        await self.heartbeat()
        self.tasks.append(asyncio.create_task(self.heartbeat_loop()))
        if serve:
            self.tasks.append(asyncio.create_task(bus.consume(
                self.nc, subjects.WORK_STREAM, bus.worker_consumer(self.id), self.take, self.service.log)))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await self.sub.unsubscribe()
        await self.registry.delete(self.id)

    async def heartbeat(self) -> None:
        await self.registry.put(self.id, encode(Heartbeat(
            self.id, time.time(), "fake", BS, self.max_num_seqs, 0, 0, self.kv.num_blocks, self.kv.num_free_blocks,
            0, 0, len(self.served))))

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)
            with contextlib.suppress(Exception):
                await self.heartbeat()

    def compute(self, rid: str, tokens: list[int], salt: str | None = None) -> int:
        """Runs the prompt through the KV cache as one prefill step would; its prefix-cache hit in tokens."""
        req = Request(rid, list(tokens), len(tokens), SamplingParams(), 0, BS, salt)
        hits = self.kv.get_computed_blocks(req)
        assert self.kv.allocate_slots(req, len(tokens) - len(hits) * BS, hits), "the fake worker's pool is too small"
        req.num_computed_tokens = len(tokens)
        self.kv.free_request(req)
        return len(hits) * BS

    async def publish(self, lose: bool = False) -> None:
        """One KV event with what changed since the last; `lose` drops it on the floor (a gap)."""
        if lose:
            self.kv.take_changes()
            self.service.registry.kv_seq += 1
        else:
            await self.service.registry.publish_kv()

    async def take(self, msg) -> None:
        item = decode(msg.data, WorkItem)
        r = item.request
        cached = self.compute(r.id, r.prompt_token_ids, r.cache_salt)
        await self.publish()
        self.served.append(item)
        usage = {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": 0, "cached_tokens": cached}
        record = Completion(r.id, r.tenant, self.id, r.sampling, r.prompt_token_ids, [], "length", usage=usage)
        await self.js.publish(subjects.done(r.tenant, r.id), encode(record), headers=subjects.msg_id(r.id))
        await msg.ack()

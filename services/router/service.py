"""The router: pulls tokenized requests from TB_ROUTE, picks a worker, publishes the work item to
tb.work.<worker> (TB_WORK), then acks. Workers come from the heartbeat registry (KV bucket
tb_workers); one whose heartbeat is older than WORKER_TTL is gone, whether or not the bucket has
expired its entry yet. Policy: least loaded, round-robin among equals (prefix-aware routing is
its own issue)."""
import argparse
import asyncio
import contextlib
import time

import nats.errors
import nats.js.errors
from nats.js.kv import KV_DEL, KV_PURGE

from schemas import subjects
from schemas.log import configure
from schemas.messages import Heartbeat, TokenizedRequest, WireError, WorkItem, decode, encode

NO_WORKER_POLL = 0.1


LOG = configure("router")


class Registry:
    """The live workers, from heartbeats, plus what was routed to each since its last heartbeat."""

    def __init__(self):
        self.workers: dict[str, Heartbeat] = {}
        self.routed: dict[str, int] = {}
        self.last = ""

    def update(self, hb: Heartbeat) -> None:
        self.workers[hb.worker] = hb
        self.routed[hb.worker] = 0

    def remove(self, worker: str) -> None:
        self.workers.pop(worker, None)
        self.routed.pop(worker, None)

    def live(self, now: float) -> list[Heartbeat]:
        return [hb for hb in self.workers.values() if now - hb.ts < subjects.WORKER_TTL]

    def load(self, hb: Heartbeat) -> float:
        return (hb.running + hb.waiting + self.routed[hb.worker]) / max(hb.max_num_seqs, 1)

    def pick(self, now: float) -> str | None:
        live = sorted(self.live(now), key=lambda hb: hb.worker)
        if not live:
            return None
        least = min(self.load(hb) for hb in live)
        ties = [hb.worker for hb in live if self.load(hb) == least]
        worker = next((w for w in ties if w > self.last), ties[0])   # round-robin: the next after the last pick
        self.routed[worker] += 1
        self.last = worker
        return worker


class RouterService:
    def __init__(self, nc):
        self.nc, self.js = nc, nc.jetstream()
        self.registry = Registry()
        self.log = LOG
        self.tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        await subjects.ensure_streams(self.js)
        bucket = await subjects.registry(self.js)
        watcher = await bucket.watchall()
        loops = [asyncio.create_task(self.watch(watcher)), asyncio.create_task(self.lapse_loop())]
        self.log.info("router ready")
        try:
            await subjects.consume(self.nc, subjects.ROUTE_STREAM, subjects.ROUTER, self.handle, self.log)
        finally:
            for t in loops:
                t.cancel()

    async def watch(self, watcher) -> None:
        async for entry in watcher:
            if entry is None:                       # the end of the initial values
                continue
            if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                self.leave(entry.key, "deregistered")
                continue
            try:
                hb = decode(entry.value, Heartbeat)
            except WireError as e:
                self.log.error("bad heartbeat dropped", key=entry.key, error=str(e))
                continue
            if hb.worker not in self.registry.workers:
                self.log.info("worker joined", worker=hb.worker, model=hb.model, max_num_seqs=hb.max_num_seqs)
            self.registry.update(hb)

    async def lapse_loop(self) -> None:
        while True:
            await asyncio.sleep(subjects.HEARTBEAT_SECONDS)
            self.drop_lapsed(time.time())

    def drop_lapsed(self, now: float) -> None:
        for hb in list(self.registry.workers.values()):
            if now - hb.ts >= subjects.WORKER_TTL:
                self.leave(hb.worker, "heartbeat lapsed")

    def leave(self, worker: str, why: str) -> None:
        if worker in self.registry.workers:
            self.registry.remove(worker)
            self.log.warning("worker left", worker=worker, why=why)
            task = asyncio.create_task(self.reroute(worker))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def reroute(self, worker: str) -> None:
        """Moves what a departed worker still held (queued for it, or taken and never acked) to live
        workers. Its consumer is deleted first, so it gets nothing more; a request starts over on
        its new worker, which yields the same tokens (sampling is a function of seed and position)
        and the gateway drops the ones its client already has."""
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_consumer(subjects.WORK_STREAM, f"worker-{worker}")
        sub = await self.js.pull_subscribe(subjects.work(worker), stream=subjects.WORK_STREAM)
        moved = 0
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch=64, timeout=0.5)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    break
                for msg in msgs:
                    n = await self.move(msg, worker)
                    if n < 0:                   # it came back (its heartbeat had only lapsed): the rest is its own
                        return
                    moved += n
        finally:
            with contextlib.suppress(nats.errors.Error):  # at once, so the worker can recreate its consumer
                await self.js.delete_consumer(subjects.WORK_STREAM, (await sub.consumer_info()).name)
            await sub.unsubscribe()
        if moved:
            self.log.warning("work re-routed", worker=worker, requests=moved)

    async def move(self, msg, departed: str) -> int:
        """1 when the item moved to a live worker, 0 when it was dropped, -1 when the only pick is the
        departed worker itself (re-publishing to its subject would feed this very loop)."""
        try:
            item = decode(msg.data, WorkItem)
        except WireError as e:
            self.log.error("bad work item dropped", error=str(e), subject=msg.subject)
            await msg.term()
            return 0
        worker = await self.pick(msg)
        if worker == departed:
            await msg.nak()
            return -1
        await self.send(WorkItem(item.request, worker, time.time(), item.attempt + 1))
        await msg.ack()
        return 1

    async def send(self, item: WorkItem) -> None:
        headers = subjects.msg_id(item.request.id, item.msg_id)
        await self.js.publish(subjects.work(item.worker), encode(item), headers=headers)

    async def handle(self, msg) -> None:
        try:
            req = decode(msg.data, TokenizedRequest)
        except WireError as e:
            self.log.error("bad tokenized request dropped", error=str(e), subject=msg.subject)
            await msg.term()
            return
        worker = await self.pick(msg)
        try:
            await self.send(WorkItem(req, worker, time.time()))
        except nats.errors.Error as e:              # not acked: JetStream redelivers it
            self.log.error("work publish failed", request_id=req.id, worker=worker, error=str(e))
            return
        await msg.ack()
        self.log.info("routed", request_id=req.id, tenant=req.tenant, worker=worker)

    async def pick(self, msg) -> str:
        """A worker for the request; with none alive, waits (the request stays in TB_ROUTE, kept alive)."""
        waited = 0.0
        while True:
            now = time.time()
            self.drop_lapsed(now)
            worker = self.registry.pick(now)
            if worker is not None:
                return worker
            await asyncio.sleep(NO_WORKER_POLL)
            waited += NO_WORKER_POLL
            if waited >= subjects.IN_PROGRESS_SECONDS:
                await msg.in_progress()
                waited = 0.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.router", description="The tokenbus router.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    return p


async def serve(args) -> None:
    service = RouterService(await subjects.connect(args.nats_url, "router", LOG))
    await subjects.run_until_signal(service.run, service.nc)


def main(argv=None) -> None:
    subjects.run(serve(parser().parse_args(argv)))

"""The router: pulls tokenized requests from TB_ROUTE, picks a worker, publishes the work item to
tb.work.<worker> (TB_WORK), then acks. Workers come from the heartbeat registry (KV bucket
tb_workers); one whose heartbeat is older than WORKER_TTL is gone, whether or not the bucket has
expired its entry yet. Policy: least loaded, round-robin among equals (prefix-aware routing is
its own issue)."""
import argparse
import asyncio
import time

import nats.errors
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

    async def run(self) -> None:
        await subjects.ensure_streams(self.js)
        bucket = await subjects.registry(self.js)
        watcher = await bucket.watchall()
        watching = asyncio.create_task(self.watch(watcher))
        self.log.info("router ready")
        try:
            await subjects.consume(self.nc, subjects.ROUTE_STREAM, subjects.ROUTER, self.handle, self.log)
        finally:
            watching.cancel()

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

    def leave(self, worker: str, why: str) -> None:
        if worker in self.registry.workers:
            self.registry.remove(worker)
            self.log.warning("worker left", worker=worker, why=why)

    async def handle(self, msg) -> None:
        try:
            req = decode(msg.data, TokenizedRequest)
        except WireError as e:
            self.log.error("bad tokenized request dropped", error=str(e), subject=msg.subject)
            await msg.term()
            return
        worker = await self.pick(msg)
        item = WorkItem(req, worker, time.time())
        try:
            await self.js.publish(subjects.work(worker), encode(item), headers=subjects.msg_id(req.id))
        except nats.errors.Error as e:              # not acked: JetStream redelivers it
            self.log.error("work publish failed", request_id=req.id, worker=worker, error=str(e))
            return
        await msg.ack()
        self.log.debug("routed", request_id=req.id, worker=worker)

    async def pick(self, msg) -> str:
        """A worker for the request; with none alive, waits (the request stays in TB_ROUTE, kept alive)."""
        waited = 0.0
        while True:
            now = time.time()
            for hb in list(self.registry.workers.values()):
                if now - hb.ts >= subjects.WORKER_TTL:
                    self.leave(hb.worker, "heartbeat lapsed")
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
    try:
        await subjects.run_until_signal(service.run)
    finally:
        await subjects.close(service.nc)


def main(argv=None) -> None:
    subjects.run(serve(parser().parse_args(argv)))

"""What block hashes each worker holds, as its KV events tell: the router's prefix index.

Each worker's events carry a sequence number. The index applies them in order; an event it cannot
place (the first one it sees from a worker, one after a gap, or a restarted worker counting from 1
again) means its copy may be wrong, and it asks for a snapshot. Events that arrive while a snapshot
is awaited are held and applied on top of it (those the snapshot already covers are skipped).

Each hash is kept with the tier that holds it (an index of schemas.messages.KV_TIERS: 0 the pool, 1
host memory, 2 disk), as the worker's events name it: a hit in a lower tier is still a hit, but costs a
copy up (the policy weighs it).

Memory is bounded: at most `cap` hashes per worker. Past the cap the hash stored longest ago is
dropped (LRU by store time), so an over-full worker is predicted to miss, never to hit, where the
index forgot. A worker's cache holds at most its kv_blocks_total hashes, so the cap only bites
for pools larger than it, or for a worker whose events are wrong.
"""
from collections import OrderedDict
from dataclasses import dataclass, field

from schemas.messages import KvEvent

INDEX_CAP = 1 << 18          # hashes per worker: a pool of 256k blocks of 16 tokens (4M tokens) fits
MAX_HELD = 10_000            # events held while a snapshot is awaited; more and the snapshot is asked again


@dataclass(slots=True)
class Held:
    """One worker's hashes and where its event sequence stands."""
    hashes: OrderedDict = field(default_factory=OrderedDict)   # hash -> its tier, oldest store first
    seq: int = -1                     # the last event applied; -1: not in sync (a snapshot is needed)
    waiting: list[KvEvent] | None = None   # events held while a snapshot is awaited; None: none awaited


class KvIndex:
    def __init__(self, cap: int = INDEX_CAP):
        self.cap = cap
        self.workers: dict[str, Held] = {}
        self.gaps = 0

    def add(self, worker: str) -> None:
        self.workers.setdefault(worker, Held())

    def drop(self, worker: str) -> None:
        self.workers.pop(worker, None)

    def needs_snapshot(self, worker: str) -> bool:
        w = self.workers.get(worker)
        return w is not None and w.seq < 0 and w.waiting is None

    def apply(self, ev: KvEvent) -> bool:
        """Applies a worker's event; True when the worker's copy is out of sync and a snapshot is needed.
        Events of a worker not added (not in the registry) are ignored."""
        w = self.workers.get(ev.worker)
        if w is None:
            return False
        if w.waiting is not None:
            if len(w.waiting) >= MAX_HELD:
                w.waiting, w.seq = None, -1
                return True
            w.waiting.append(ev)
            return False
        if w.seq < 0 or ev.seq != w.seq + 1:
            if w.seq >= 0:
                self.gaps += 1
            w.seq = -1
            return True
        self.change(w, ev)
        return False

    def change(self, w: Held, ev: KvEvent) -> None:
        for h in ev.removed:
            w.hashes.pop(h, None)
        for h, tier in zip(ev.stored, ev.tiers or [0] * len(ev.stored)):
            w.hashes[h] = tier
            w.hashes.move_to_end(h)
        while len(w.hashes) > self.cap:
            w.hashes.popitem(last=False)
        w.seq = ev.seq

    def expect_snapshot(self, worker: str) -> None:
        """From now on, hold the worker's events until its snapshot is loaded."""
        self.workers[worker].waiting = []

    def load_snapshot(self, worker: str, seq: int, hashes: list[int], tiers: list[int] = ()) -> bool:
        """Replaces the worker's hashes (and their tiers; none: all in the pool) with its snapshot (as of its
        event `seq`) and applies the events held since; True when they do not follow on (another snapshot is
        needed)."""
        w = self.workers.get(worker)
        if w is None:
            return False
        held, w.waiting = w.waiting or [], None
        w.hashes, w.seq = OrderedDict(zip(hashes[-self.cap:], (tiers or [0] * len(hashes))[-self.cap:])), seq
        return any(ev.seq > w.seq and self.apply(ev) for ev in sorted(held, key=lambda e: e.seq))

    def snapshot_failed(self, worker: str) -> None:
        w = self.workers.get(worker)
        if w is not None:
            w.waiting, w.seq = None, -1

    def overlap(self, worker: str, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, the worker holds."""
        w = self.workers.get(worker)
        if w is None:
            return 0
        n = 0
        for h in hashes:
            if h not in w.hashes:
                break
            n += 1
        return n

    def tiers(self, worker: str, hashes: list[int]) -> list[int]:
        """The tier of each of `hashes`, from the first, that the worker holds (as many as overlap counts)."""
        w = self.workers.get(worker)
        out = []
        for h in hashes if w is not None else ():
            tier = w.hashes.get(h)
            if tier is None:
                break
            out.append(tier)
        return out

    def holds(self, worker: str, h: int) -> bool:
        w = self.workers.get(worker)
        return w is not None and h in w.hashes

    def sizes(self) -> dict[str, int]:
        return {worker: len(w.hashes) for worker, w in self.workers.items()}

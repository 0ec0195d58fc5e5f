"""Which worker gets a request: the live workers (heartbeats), what was routed to each since its
heartbeat, and three policies.

- prefix (default): per worker, cost = α · ((prompt tokens not cached there) / block_size + the
  copies up of the cached blocks held below its pool (TIER_COST each) + the prompt blocks it has still
  to prefill) + active blocks + new blocks; the lowest wins. Still to
  prefill: its waiting requests' new blocks (its heartbeat) and those of the requests routed to it
  since whose last full prompt block its KV events have not shown yet. A hard guard first rules
  out every worker above its KV watermark or its queue watermark, or that took more than load_cap ×
  (the recent requests of the live worker that took fewest + LOAD_SLACK), unless all are. Equal
  costs go to the least loaded, then the one that took fewer recent requests, then in turn.
- least-loaded: (running + waiting + routed since the heartbeat) / max_num_seqs, in turn among equals.
- round-robin: each live worker in turn.
The prefix index is consulted under every policy, so each decision has a predicted hit to compare.

A batch request (priority BATCH_PRIORITY or later: a batch key's default) is placed, under every
policy, only among the workers with spare capacity when one has it, as admission counts spare
capacity: nothing waiting, fewer than BATCH_WATERMARK × max_num_seqs running, BATCH_KV_FREE of the KV
blocks free; with none spare, it is placed as any request.

Disaggregated serving (workers of role prefill and decode; role both is colocated): a request
goes to a prefill worker when its uncached prompt — on the decode-capable worker that holds most
of it — is longer than max_local_prefill tokens and some prefill worker has at most
max_prefill_queue requests waiting (NVIDIA Dynamo's conditional disaggregation); otherwise a
decode-capable worker prefills it itself. With no decode-capable worker alive, every request is
prefilled remotely (its handoff waits for one). A handoff (a prefilled request) goes to a
decode-capable worker. The policy picks within the pool decided on.

The choices of one prompt (n > 1, a request `group`) go where the group's first went while that worker
is alive and in the pool, under every policy: there they are forked after one prefill.
"""
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from bus import lapsed, restated, spare
from schemas.hashing import hash_blocks
from schemas.messages import Heartbeat
from schemas.served import serves
from schemas.subjects import BATCH_PRIORITY
from services.router.index import KvIndex

POLICIES = ("prefix", "least-loaded", "round-robin")
RECENT_SECONDS = 10.0            # the time constant of a worker's count of recent requests
MAX_GROUPS = 4096                # request groups (n > 1) whose worker is remembered, the latest
LOAD_SLACK = 2.0                 # added to the fewest recent requests before load_cap multiplies it
TIER_COST = (0.0, 0.1, 0.3)      # a cached block's copy up to the pool from each tier (KV_TIERS: pool, host,
#                                  disk), in blocks prefilled (docs/routing.md)


@dataclass(slots=True)
class Options:
    policy: str = "prefix"
    alpha: float = 4.0              # a block to prefill against a block of KV held (docs/decisions.md)
    kv_watermark: float = 0.9       # (active + new blocks) / kv_blocks_total above this: no room
    queue_watermark: float = 0.5    # queued requests / max_num_seqs above this: no room
    load_cap: float = 1.25          # recent requests above this × (the fewest + LOAD_SLACK): no room
    max_local_prefill: int = 1000   # uncached prompt tokens a decode worker prefills itself; longer: a prefill worker
    max_prefill_queue: int = 2      # requests queued on the least queued prefill worker at most, for a remote prefill

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.alpha < 0 or self.kv_watermark <= 0 or self.queue_watermark < 0 or self.load_cap < 1:
            raise ValueError("alpha and queue_watermark must be at least 0, kv_watermark above 0, load_cap at least 1")
        if self.max_local_prefill < 0 or self.max_prefill_queue < 0:
            raise ValueError("max_local_prefill and max_prefill_queue must be at least 0")


@dataclass(slots=True)
class Worker:
    """A worker's last heartbeat and what was routed to it since."""
    hb: Heartbeat
    prefills: list[tuple[int | None, int]] = field(default_factory=list)   # each request routed to it since,
    #                                 until it finishes: (its last full prompt block's hash, its new blocks)

    @property
    def routed(self) -> int:
        return len(self.prefills)

    @property
    def routed_blocks(self) -> int:
        """The new blocks the requests routed since need."""
        return sum(n for _, n in self.prefills)

    @property
    def active_blocks(self) -> int:
        hb = self.hb
        return hb.kv_blocks_total - hb.kv_blocks_free + hb.kv_blocks_queued + self.routed_blocks

    @property
    def load(self) -> float:
        hb = self.hb
        return (hb.running + hb.waiting + self.routed) / max(hb.max_num_seqs, 1)

    @property
    def queued(self) -> int:
        hb = self.hb
        return hb.waiting + max(0, hb.running + self.routed - hb.max_num_seqs)


@dataclass(slots=True)
class Choice:
    worker: str
    hit_tokens: int                 # the prefix the router predicts cached there
    cost: float = 0.0
    guarded: bool = False           # the guard ruled out a worker
    costs: dict[str, float] = field(default_factory=dict)
    new_blocks: int = 0             # what it adds to the worker's load until its next heartbeat
    state: Worker | None = None     # the worker's state it was counted in
    pending: tuple[int | None, int] | None = None   # its entry in state.prefills
    best_hit_tokens: int = 0        # the longest predicted hit on any live worker
    prefill: bool = False           # a remote prefill: the worker is a prefill worker
    why: str = ""                   # "remote:<why>" / "local:<why>" with prefill workers alive, "handoff", or ""


class Registry:
    def __init__(self, options: Options | None = None, index: KvIndex | None = None):
        self.options = options or Options()
        self.index = index if index is not None else KvIndex()
        self.workers: dict[str, Worker] = {}
        self.recent: dict[str, tuple[float, float]] = {}     # worker -> (decayed count of requests, as of)
        self.last = ""
        self.known: dict[int, list[int]] = {}                # the block hashes pick() was given
        self.hashes: dict[int, list[int]] = {}               # the prompt's, per block size, as hits() found them
        self.groups: OrderedDict[str, str] = OrderedDict()   # request group -> the worker its first choice got

    def update(self, hb: Heartbeat) -> None:
        """A worker's heartbeat; a stand-in beat (the same counts again) keeps what was routed to it since."""
        w = self.workers.get(hb.worker)
        if w is not None and restated(w.hb, hb):
            w.hb = hb
        else:
            self.workers[hb.worker] = Worker(hb)
        self.index.add(hb.worker)

    def remove(self, worker: str) -> None:
        self.workers.pop(worker, None)
        self.recent.pop(worker, None)
        self.index.drop(worker)

    def live(self, now: float) -> list[Worker]:
        return sorted((w for w in self.workers.values() if not lapsed(w.hb, now)), key=lambda w: w.hb.worker)

    def pick(self, now: float, prompt: list[int] = (), salt: str | None = None, handoff: bool = False,
             hashes: dict[int, list[int]] | None = None, model: str = "", revision: str = "",
             priority: int = 0, group: str = "") -> Choice | None:
        """A worker for a request (a handoff: a decode-capable one), or None when none can take it.
        `hashes` may bring the prompt's block hashes per block size, already known (the simulator's).
        Only workers serving `model` (and `revision`), not draining, are candidates; "" means any. A batch `priority`
        takes a worker with spare capacity if there is one. A `group`'s requests follow its first."""
        self.known = hashes or {}
        batch = priority >= BATCH_PRIORITY
        live = [w for w in self.live(now) if serves(w.hb, model, revision) and not w.hb.draining]
        group = "" if handoff else group
        there = [w for w in live if group and w.hb.worker == self.groups.get(group)]
        if there:
            self.groups.move_to_end(group)
            prefill = there[0].hb.role == "prefill"
            disaggregated = any(w.hb.role == "prefill" for w in live)
            choice = self.within(there, now, prompt, salt, f"{'remote' if prefill else 'local'}:group" * disaggregated)
            choice.prefill = prefill
            return choice
        choice = self.place(live, now, prompt, salt, handoff, batch)
        if group and choice is not None:
            self.groups[group] = choice.worker
            if len(self.groups) > MAX_GROUPS:
                self.groups.popitem(last=False)
        return choice

    def place(self, live: list[Worker], now: float, prompt: list[int], salt: str | None, handoff: bool,
              batch: bool) -> Choice | None:
        """pick()'s choice for a request of no group already placed: the pool (prefill or decode-capable), then
        the policy's pick in it."""
        decode = [w for w in live if w.hb.role != "prefill"]
        prefill = [w for w in live if w.hb.role == "prefill"]
        if handoff:
            return self.within(decode, now, prompt, salt, "handoff", batch)
        if not prefill:
            return self.within(live, now, prompt, salt, batch=batch)
        where, why = self.disaggregate(decode, prefill, prompt, salt)
        choice = self.within(prefill if where == "remote" else decode, now, prompt, salt, f"{where}:{why}", batch)
        choice.prefill = where == "remote"
        return choice

    def disaggregate(self, decode: list[Worker], prefill: list[Worker], prompt: list[int], salt: str | None
                     ) -> tuple[str, str]:
        """Where a request is prefilled, "remote" or "local", and why."""
        if not decode:
            return "remote", "no_decode_workers"
        uncached = len(prompt) - max(self.hits(decode, prompt, salt).values())
        if uncached <= self.options.max_local_prefill:
            return "local", "short"
        if min(w.hb.waiting + w.routed for w in prefill) > self.options.max_prefill_queue:
            return "local", "prefill_queue"
        return "remote", "long"

    def within(self, live: list[Worker], now: float, prompt: list[int], salt: str | None, why: str = "",
               batch: bool = False) -> Choice | None:
        """The policy's pick among these workers (batch: among those with spare capacity, if any)."""
        if not live:
            return None
        hits = self.hits(live, prompt, salt)
        pool = [w for w in live if batch and self.spare(w)] or live
        policy = self.options.policy
        if policy == "round-robin":
            choice = Choice(self.next_after([w.hb.worker for w in pool]), 0)
        elif policy == "least-loaded":
            choice = Choice(self.in_turn(pool, lambda w: w.load), 0)
        else:
            choice = self.cheapest(pool, hits, len(prompt), now)
        choice.hit_tokens, choice.state = hits[choice.worker], self.workers[choice.worker]
        choice.best_hit_tokens = max(hits.values())
        blocks = self.hashes[choice.state.hb.block_size]
        choice.new_blocks, choice.pending = self.routed(choice.state, len(prompt), choice.hit_tokens, now,
                                                        blocks[-1] if blocks else None)
        choice.why = why
        return choice

    def hits(self, live: list[Worker], prompt: list[int], salt: str | None) -> dict[str, int]:
        """Predicted prefix-cache hit tokens per worker: its cached blocks among the prompt's, from the
        first, leaving the last prompt token to compute, exactly as the engine counts them."""
        self.hashes = hashes = {}
        hits = {}
        for w in live:
            bs = w.hb.block_size
            if bs not in hashes:
                full = max(len(prompt) - 1, 0) // bs
                known = self.known.get(bs, ())
                hashes[bs] = known[:full] if len(known) >= full else hash_blocks(prompt[:max(len(prompt) - 1, 0)],
                                                                                  bs, salt, known)
            hits[w.hb.worker] = self.index.overlap(w.hb.worker, hashes[bs]) * bs
        return hits

    def cheapest(self, live: list[Worker], hits: dict[str, int], n: int, now: float) -> Choice:
        o = self.options
        costs, room = {}, []
        share = o.load_cap * (min(self.taken(w.hb.worker, now) for w in live) + LOAD_SLACK)
        for w in live:
            bs, hit = w.hb.block_size, hits[w.hb.worker]
            tiers = self.index.tiers(w.hb.worker, self.hashes[bs]) if hit else []
            copies = sum(TIER_COST[t] for t in tiers)
            new = -(-n // bs) - tiers.count(0)        # a block copied up takes a pool block too
            costs[w.hb.worker] = o.alpha * ((n - hit) / bs + copies + self.pending(w)) + w.active_blocks + new
            if not self.over(w, new) and self.taken(w.hb.worker, now) <= share:
                room.append(w)
        candidates = room or live
        best = min(costs[w.hb.worker] for w in candidates)
        ties = [w for w in candidates if costs[w.hb.worker] == best]
        worker = self.in_turn(ties, lambda w: (w.load, round(self.taken(w.hb.worker, now), 6)))
        return Choice(worker, 0, cost=best, guarded=len(candidates) < len(live), costs=costs)

    def pending(self, w: Worker) -> int:
        """Prompt blocks the worker has still to prefill: its waiting requests' (its heartbeat's
        kv_blocks_queued) and those of the requests routed to it since whose last full prompt block it
        has not stored yet. A KV event is the first sign a prefill is done; without it a turn that
        follows its conversation's last reply within a heartbeat would find the last turn's blocks
        counted as prefill still to come on the very worker holding them."""
        holds = self.index.holds
        return w.hb.kv_blocks_queued + sum(n for h, n in w.prefills if h is None or not holds(w.hb.worker, h))

    def spare(self, w: Worker) -> bool:
        """Room beyond what interactive traffic needs now: admission's rule, with what was routed since."""
        hb = w.hb
        return spare(hb.waiting, hb.running + w.routed, hb.max_num_seqs, hb.kv_blocks_total - w.active_blocks,
                     hb.kv_blocks_total)

    def over(self, w: Worker, new_blocks: int) -> bool:
        """Above the KV or the queue watermark: the hard guard against hot spots."""
        hb, o = w.hb, self.options
        return ((w.active_blocks + new_blocks) / max(hb.kv_blocks_total, 1) > o.kv_watermark
                or w.queued / max(hb.max_num_seqs, 1) > o.queue_watermark)

    def in_turn(self, workers: list[Worker], key) -> str:
        """The lowest key, in turn among equals."""
        least = min(key(w) for w in workers)
        return self.next_after([w.hb.worker for w in workers if key(w) == least])

    def next_after(self, names: list[str]) -> str:
        """Round-robin over sorted names: the first after the last pick."""
        name = next((n for n in names if n > self.last), names[0])
        self.last = name
        return name

    def taken(self, worker: str, now: float) -> float:
        """Requests routed to the worker lately, each counting less as it ages (e^(-age/RECENT_SECONDS)).
        Sticky conversations are invisible to the load between their turns; this sees them."""
        count, at = self.recent.get(worker, (0.0, now))
        return count * math.exp((at - now) / RECENT_SECONDS)

    def routed(self, w: Worker, n: int, hit: int, now: float, last: int | None) -> tuple[int, tuple]:
        new = -(-n // w.hb.block_size) - hit // w.hb.block_size
        w.prefills.append(entry := (last, new))
        self.recent[w.hb.worker] = (self.taken(w.hb.worker, now) + 1, now)
        return new, entry

    def finished(self, choice: Choice) -> None:
        """A request ended before its worker's next heartbeat: it no longer loads the worker."""
        w = choice.state
        if w is not None and self.workers.get(w.hb.worker) is w and choice.pending in w.prefills:
            w.prefills.remove(choice.pending)

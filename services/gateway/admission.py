"""Whether a request may enter, decided in the gateway's memory (no I/O, microseconds):
- per tenant, a token bucket of tokens_per_minute charged prompt + max output tokens, refunded what
  the request did not use when it ends (a gateway's own, or its lease of the bucket the gateways share,
  services/gateway/limits.py); and a cap on its concurrent requests in this gateway (429 + Retry-After);
- the records that outlive the bus: while TB_USAGE or TB_RESULTS is BACKLOG_FULL of its room with records
  the recorder has not taken (its database away), every request is refused (503 "metering backlog full"):
  a request served then could not be billed (`backlog`, kept current by the gateway from the streams);
- the cluster, from the worker registry: some worker must be able to take the request soon, its
  queue below QUEUE_WATERMARK and its KV pool large enough (503 + Retry-After), so that an
  overloaded cluster refuses quickly instead of queueing without bound. On a worker with the fair
  scheduling policy a tenant with nothing in flight here is not held to the watermark: one request
  per tenant keeps the queue bounded, another tenant's burst cannot keep it out, and the worker serves
  it first. A batch key's request needs
  spare capacity: a worker with nothing waiting, its running requests below BATCH_WATERMARK of its
  max_num_seqs and at least BATCH_KV_FREE of its KV pool free; interactive traffic keeps the rest.
  Only a worker that decodes (role both or decode) counts: a prefill worker hands every request on
  to one, and a decode worker prefills the prompts no prefill worker has room for, so the decoding
  workers' room is the cluster's.

The gateway does not tokenize: a text prompt is estimated at BYTES_PER_TOKEN and the bucket is
settled with the worker's counts when the request ends."""
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bus import lapsed, restated, spare
from schemas.messages import GenerateRequest, Heartbeat
from schemas.served import serves
from schemas.subjects import (
    BATCH_KV_FREE,
    BATCH_WATERMARK,
    HEARTBEAT_SECONDS,
    QUEUE_WATERMARK,
    WORKER_TTL,
)
from services.gateway.errors import ApiError
from services.gateway.keys import Key

BYTES_PER_TOKEN = 4              # English text under a byte-level BPE; corrected when the request ends
MESSAGE_OVERHEAD = 4             # chat-template tokens around each message
BUSY_RETRY = 2 * HEARTBEAT_SECONDS
BATCH_RETRY = 5.0                # seconds: spare capacity comes back slower than a queue drains
BACKLOG_RETRY = 5.0              # seconds: a database coming back, then the recorder draining its backlog


class TokenBucket:
    """`per_minute` tokens of capacity, refilled continuously; it may go below zero when a request
    used more than it was charged."""

    def __init__(self, per_minute: int, now: float):
        self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.level, self.t = self.capacity, now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now

    def wait(self, n: int, now: float) -> float:
        """Seconds until n tokens are there (0: they are)."""
        self.refill(now)
        return max(0.0, (n - self.level) / self.rate)

    def take(self, n: float, now: float) -> None:
        """Takes n tokens (a refund when n < 0; never above capacity)."""
        self.refill(now)
        self.level = min(self.capacity, self.level - n)


@dataclass(slots=True)
class Tenant:
    bucket: TokenBucket | None
    active: int = 0


@dataclass(slots=True)
class Ticket:
    """An admitted request's charge, settled once when it ends."""
    key: Key
    charged: int
    settled: bool = False
    bucket: object = None                         # what it was charged to, refunded at the end (None: its tenant's)
    placed: str | None = None                     # the worker it was counted on
    admitted: tuple[int, int] = ()                # with tracing on: when admission began and ended (ns since epoch)


def estimate(req: GenerateRequest) -> int:
    """Prompt tokens, estimated without tokenizing (exact for prompt_token_ids)."""
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    if req.prompt is not None:
        return math.ceil(len(req.prompt.encode()) / BYTES_PER_TOKEN)
    size = sum(len(m.get("content", "").encode()) for m in req.messages)
    return math.ceil(size / BYTES_PER_TOKEN) + MESSAGE_OVERHEAD * len(req.messages)


class Cluster:
    """The workers the registry shows, and what this gateway changed since each one's last heartbeat: the
    requests it sent (charged to the decoding worker the router would pick: the least loaded), less those
    of its requests that ended."""

    def __init__(self):
        self.workers: dict[str, Heartbeat] = {}
        self.added: dict[str, int] = {}           # may be below 0: ended requests the last heartbeat counted
        self.grace_until = 0.0                    # unix time: till then a stale heartbeat still counts

    def stalled(self, now: float) -> None:
        """This process did not run for a while (SIGSTOP, a starved CPU): the heartbeats it holds are old
        because it could not read the new ones, not because the workers left; they count for WORKER_TTL."""
        self.grace_until = now + WORKER_TTL

    def update(self, hb: Heartbeat) -> None:
        """A worker's heartbeat; a stand-in beat (the same counts again) keeps what was added since."""
        if not restated(self.workers.get(hb.worker), hb):
            self.added[hb.worker] = 0
        self.workers[hb.worker] = hb

    def ended(self, worker: str) -> None:
        """A request counted on worker ended: sent since the last heartbeat, `added` counted it; sent before,
        the heartbeat did (as running or waiting). Either way it no longer loads the worker. Without this a
        worker whose requests end within a heartbeat looked as loaded as every request it took since, and a
        fast worker was refused work it had room for."""
        if worker in self.added:
            self.added[worker] -= 1

    def remove(self, worker: str) -> None:
        self.workers.pop(worker, None)
        self.added.pop(worker, None)

    def spare(self, hb: Heartbeat) -> bool:
        """Whether a worker has room beyond what its interactive traffic needs now."""
        return spare(hb.waiting, max(hb.running + self.added[hb.worker], 0), hb.max_num_seqs, hb.kv_blocks_free,
                     hb.kv_blocks_total)

    def load(self, hb: Heartbeat) -> float:
        return max(hb.running + hb.waiting + self.added[hb.worker], 0) / max(hb.max_num_seqs, 1)

    def serving(self, model: str, revision: str, now: float) -> bool:
        """Whether a live worker that is not draining serves this model's revision."""
        return any(serves(hb, model, revision) and not hb.draining for hb in self.workers.values()
                   if not lapsed(hb, now) or now < self.grace_until)

    def place(self, tokens: int, now: float, batch: bool = False, model: str = "", revision: str = "",
              idle: bool = False) -> str:
        """The worker that would take a request of `tokens` (prompt + output) soon; ApiError 503 if none.
        A batch request takes only a worker with spare capacity; a request for a model (and a revision) only
        a worker serving it ("": any). `idle`: the tenant has nothing in flight, so a worker with the fair
        policy takes it past the queue watermark."""
        live = [hb for hb in self.workers.values() if not lapsed(hb, now) or now < self.grace_until]
        if not live:
            raise ApiError(503, "no worker is registered; retry shortly", "unavailable", retry_after=BUSY_RETRY)
        live = [hb for hb in live if not hb.draining]
        if not live:
            raise ApiError(503, "every registered worker is draining; retry shortly", "unavailable",
                           retry_after=BUSY_RETRY)
        live = [hb for hb in live if serves(hb, model, revision)]
        if not live:
            asked = f"model {model!r}" + (f" revision {revision!r}" if revision else "")
            raise ApiError(503, f"no worker serving {asked} is registered; retry shortly", "unavailable", "model",
                           BUSY_RETRY)
        live = [hb for hb in live if hb.role != "prefill"]
        if not live:
            raise ApiError(503, "no decode worker is registered (role both or decode): prefill workers cannot finish "
                           "a request alone; retry shortly", "unavailable", retry_after=BUSY_RETRY)
        fit = [hb for hb in live if math.ceil(tokens / hb.block_size) <= hb.kv_blocks_total]
        if not fit:
            largest = max(live, key=lambda hb: hb.kv_blocks_total)
            raise ApiError(400, f"the request may need {tokens} tokens (its prompt, estimated, and max_tokens) in "
                           f"{math.ceil(tokens / largest.block_size)} KV blocks; the largest worker holds "
                           f"{largest.kv_blocks_total} blocks ({largest.kv_blocks_total * largest.block_size} "
                           "tokens): shorten the prompt or lower max_tokens", "context_length_exceeded", "max_tokens")
        if batch:
            fit = [hb for hb in fit if self.spare(hb)]
            if not fit:
                raise ApiError(503, f"no spare capacity for a batch request: every worker has requests waiting, "
                               f"BATCH_WATERMARK={BATCH_WATERMARK} × max_num_seqs running or less than "
                               f"BATCH_KV_FREE={BATCH_KV_FREE} of its KV free; retry later", "overloaded",
                               retry_after=BATCH_RETRY)
        best = min(fit, key=self.load)
        if self.load(best) >= 1 + QUEUE_WATERMARK and not (idle and best.scheduling_policy == "fair"):
            raise ApiError(503, f"every worker is busy: {len(fit)} worker(s), each with more than "
                           f"QUEUE_WATERMARK={QUEUE_WATERMARK} × max_num_seqs requests queued; retry shortly",
                           "overloaded", retry_after=BUSY_RETRY)
        self.added[best.worker] += 1
        return best.worker


def own(key: Key, now: float) -> TokenBucket:
    """A tenant's bucket in this gateway alone."""
    return TokenBucket(key.tokens_per_minute, now)


@dataclass(slots=True)
class Admission:
    cluster: Cluster = field(default_factory=Cluster)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    bucket: Callable = own                        # a limited tenant's bucket: own, or Limits.lease (shared)
    backlog: str = ""                             # why the records back up (app.backlog); "": they do not

    def tenant(self, key: Key, now: float) -> Tenant:
        t = self.tenants.get(key.tenant)
        if t is None:
            bucket = self.bucket(key, now) if key.tokens_per_minute else None
            t = self.tenants[key.tenant] = Tenant(bucket)
        return t

    def admit(self, key: Key, prompt_tokens: int, max_tokens: int, now: float | None = None, model: str = "",
              revision: str = "", place: bool = True) -> Ticket:
        """A ticket for a request of about prompt_tokens + max_tokens, or ApiError 429 / 503 naming the limit
        (place=False: the tenant's limits only, for a request the fallback answers)."""
        if self.backlog:
            raise ApiError(503, self.backlog, "unavailable", retry_after=BACKLOG_RETRY)
        now = time.monotonic() if now is None else now
        t, cost = self.tenant(key, now), prompt_tokens + max_tokens
        cap = key.max_concurrent_requests
        if cap is not None and t.active >= cap:
            raise ApiError(429, f"tenant {key.tenant} has {t.active} requests in flight; max_concurrent_requests="
                           f"{cap}", "concurrency_limit_exceeded", retry_after=1)
        if t.bucket is not None:
            self.check_rate(key, t.bucket, cost, now)
        placed = None
        if place:
            placed = self.cluster.place(cost, time.time(), key.batch, model, revision, idle=not t.active)
        charged = getattr(t.bucket, "fallback", None) or t.bucket    # a shared limit cut off: its fallback
        if charged is not None:
            charged.take(cost, now)
        t.active += 1
        return Ticket(key, cost, bucket=charged, placed=placed)

    def check_rate(self, key: Key, bucket: TokenBucket, cost: int, now: float) -> None:
        if cost > bucket.capacity:              # would never pass: no Retry-After to give
            raise ApiError(400, f"this request may use {cost} tokens (prompt + max_tokens), more than "
                           f"tokens_per_minute={key.tokens_per_minute} of tenant {key.tenant}; lower max_tokens",
                           "request_too_large", "max_tokens")
        wait = bucket.wait(cost, now)
        if wait > 0:
            raise ApiError(429, f"tenant {key.tenant} is over tokens_per_minute={key.tokens_per_minute}: this request "
                           f"may use {cost} tokens (prompt + max_tokens), {max(int(bucket.level), 0)} are left; "
                           f"retry after {math.ceil(wait)} s", "rate_limit_exceeded", retry_after=wait)

    def settle(self, ticket: Ticket, used: int, now: float | None = None) -> None:
        """Refunds what the request did not use (or charges what it used beyond its charge); once."""
        if ticket.settled:
            return
        ticket.settled = True
        now = time.monotonic() if now is None else now
        t = self.tenant(ticket.key, now)
        t.active -= 1
        if ticket.placed is not None:
            self.cluster.ended(ticket.placed)
        bucket = ticket.bucket or t.bucket
        if bucket is not None:
            bucket.take(used - ticket.charged, now)

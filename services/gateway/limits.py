"""Tenants' rate limits shared by every gateway: a tenant's tokens_per_minute holds however many gateways
serve it, not once per gateway.

The tenant's token bucket lives in the KV bucket tb_limits (a TenantBucket per tenant) and changes only by
compare-and-set: an update that names the revision it read, read again when another gateway's came first.
A gateway draws tokens from it in leases and admits from its lease in memory (admission's fast path);
only a request that its lease does not cover waits for a draw, one read and one write. What a request did
not use goes back to its gateway's lease when it ends; a lease is kept at most twice its draw (the rest
goes back at once), and a lease untouched for LEASE_IDLE, or held at shutdown, goes back whole.

A gateway draws at least LEASE_SHARE × tokens_per_minute / (2N) at a time and keeps at most twice that (N:
the live gateways, counted in tb_gateways), so the gateways hold at most LEASE_SHARE × tokens_per_minute
together: tokens drawn before a window that the window may admit on top of capacity + rate × its length.

While tb_limits cannot be reached (an error, or no answer within KV_TIMEOUT), a gateway admits from a
bucket of its own of 1/N of the limit (capacity and rate), starting from the lease it holds, until its
heartbeat in tb_gateways gets through again. Its refill, rate / N a second, is admitted twice at most
(here and from the shared bucket by the others): the bound's second term. docs/api.md has the bound."""
import asyncio
import contextlib
import time

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue
from structlog.typing import FilteringBoundLogger

from schemas.messages import TenantBucket, decode, encode
from schemas.subjects import GATEWAY_TTL
from schemas.wire import WireError
from services.gateway.admission import TokenBucket
from services.gateway.keys import Key
from services.gateway.metrics import Metrics

LEASE_SHARE = 1 / 8              # of tokens_per_minute: what the gateways hold drawn, together, at most
LEASE_IDLE = 5.0                 # seconds a lease may go unused before it goes back
KV_TIMEOUT = 0.5                 # seconds a draw or a heartbeat may take; then tb_limits is unreachable
CAS_TRIES = 8                    # compare-and-set attempts of one draw or give-back before it gives up
LOOK_AGAIN = 1.0                 # seconds a shared level seen too low saves a draw that would fail
TICK = GATEWAY_TTL / 3           # seconds between heartbeats in tb_gateways
KV_ERRORS = (nats.errors.Error, TimeoutError)


def level_at(b: TenantBucket | None, capacity: float, rate: float, now: float) -> float:
    """The shared bucket's tokens at unix time `now`; None (no entry, or one expired) is a full bucket."""
    if b is None:
        return capacity
    return min(capacity, b.level + max(0.0, now - b.ts) * rate)


def stamp(b: TenantBucket | None, now: float) -> float:
    """A change's time never goes back: a gateway whose clock is behind refills nothing until it catches up."""
    return now if b is None else max(now, b.ts)


def draw(b: TenantBucket | None, need: float, want: float, capacity: float, rate: float,
         now: float) -> tuple[TenantBucket | None, float, float]:
    """Takes `want` tokens, or all there are if at least `need`: (the new state, None if unchanged; the
    tokens taken; the tokens left)."""
    level = level_at(b, capacity, rate, now)
    if level < need:
        return None, 0.0, level
    got = min(level, want)
    return TenantBucket(level - got, stamp(b, now)), got, level - got


def give(b: TenantBucket | None, n: float, capacity: float, rate: float,
         now: float) -> tuple[TenantBucket | None, float, float]:
    """Puts n tokens back (never above capacity): (the new state, None if the bucket is full; 0; the level)."""
    level = level_at(b, capacity, rate, now)
    if level >= capacity:
        return None, 0.0, level
    level = min(capacity, level + n)
    return TenantBucket(level, stamp(b, now)), 0.0, level


class Lease:
    """This gateway's part of a tenant's shared limit, which admission uses as it uses a TokenBucket: `held`
    tokens drawn from tb_limits and not spent yet (below zero: requests used more than they were charged,
    repaid from the next draw). While tb_limits is unreachable `fallback`, a TokenBucket of 1/N of the
    limit, admits instead. Times are time.monotonic()."""

    def __init__(self, tenant: str, per_minute: int, now: float, gateways: int = 1, on_surplus=None):
        self.tenant, self.capacity, self.rate = tenant, float(per_minute), per_minute / 60.0
        self.on_surplus = on_surplus              # called with the lease when a refund leaves it a surplus
        self.held, self.touched = 0.0, now
        self.chunk = self.capacity * LEASE_SHARE / (2 * gateways)
        self.seen, self.seen_at = self.capacity, now - LOOK_AGAIN     # the shared level last read (unknown: full)
        self.surplus = 0.0                        # refunds beyond 2 × chunk, going back to tb_limits
        self.fallback: TokenBucket | None = None
        self.lock = asyncio.Lock()                # one round trip of a tenant at a time

    def shared(self, now: float) -> float:
        """The shared bucket's level as last seen, refilled since (others may have drawn it)."""
        return min(self.capacity, self.seen + (now - self.seen_at) * self.rate)

    @property
    def level(self) -> float:
        """What this gateway saw left: its fallback's, or what it holds and what the shared bucket had."""
        return self.fallback.level if self.fallback is not None else self.held + self.seen

    def wait(self, n: int, now: float) -> float:
        """Seconds until n tokens could be admitted here (0: they are held)."""
        if self.fallback is not None:
            return self.fallback.wait(n, now)
        if self.held >= n:
            return 0.0
        return max(1e-3, (n - self.held - self.shared(now)) / self.rate)

    def take(self, n: float, now: float) -> None:
        """Spends n held tokens (a refund when n < 0); a refund beyond 2 × chunk is surplus, to go back."""
        self.touched = now
        self.held -= n
        if self.held > 2 * self.chunk:
            self.surplus += self.held - self.chunk
            self.held = self.chunk
            if self.on_surplus is not None:
                self.on_surplus(self)

    def reclaim(self) -> None:
        """The surplus not given back yet is held again (it was never returned)."""
        self.held, self.surplus = self.held + self.surplus, 0.0

    def drew(self, got: float, left: float, now: float) -> None:
        self.held += got
        self.seen, self.seen_at = left, now

    def degrade(self, gateways: int, now: float) -> None:
        """tb_limits is unreachable: 1/N of the limit from here on, starting from what is held."""
        if self.fallback is None:
            self.fallback = TokenBucket(self.capacity / gateways, now)
            self.fallback.level = min(self.held, self.fallback.capacity)
            self.held = 0.0

    def restore(self) -> None:
        """tb_limits is back: the fallback's debt stays, its tokens go (they were never drawn)."""
        if self.fallback is not None:
            self.held += min(self.fallback.level, 0.0)
            self.fallback = None


class Contended(Exception):
    """CAS_TRIES compare-and-sets in a row lost to other gateways'."""


class Limits:
    """The shared limits of one gateway: its leases (tenant → Lease), draws and give-backs over tb_limits,
    and its heartbeat in tb_gateways, which counts the gateways (N) and finds tb_limits reachable again."""

    def __init__(self, kv: KeyValue, presence: KeyValue, gateway: str, log: FilteringBoundLogger, metrics: Metrics):
        self.kv, self.presence, self.gateway, self.log, self.metrics = kv, presence, gateway, log, metrics
        self.leases: dict[str, Lease] = {}
        self.gateways = 1                         # N, as last counted
        self.down = False                         # tb_limits unreachable: each lease admits from its fallback
        self.tasks: set[asyncio.Task] = set()

    def lease(self, key: Key, now: float) -> Lease:
        """The tenant's lease (admission's bucket for a tenant with tokens_per_minute)."""
        lease = self.leases.get(key.tenant)
        if lease is None:
            lease = self.leases[key.tenant] = Lease(key.tenant, key.tokens_per_minute, now, self.gateways,
                                                    self.settled)
        return lease

    async def cover(self, key: Key, cost: int) -> None:
        """Draws for the tenant's lease if it does not hold `cost` and the shared bucket may have it; at once
        when it does, when the tenant has no limit, or while tb_limits is unreachable (the fallback admits)."""
        if not key.tokens_per_minute:
            return
        now = time.monotonic()
        lease = self.lease(key, now)
        if self.down:
            lease.degrade(self.gateways, now)
            return
        lease.restore()
        if lease.held >= cost:
            return
        async with lease.lock:
            lease.reclaim()
            need, now = cost - lease.held, time.monotonic()
            if need <= 0 or self.down or cost > lease.capacity:
                return
            if lease.shared(now) < need and now - lease.seen_at < LOOK_AGAIN:
                return                            # the draw would fail: admission refuses with a Retry-After
            want = max(need, lease.chunk)
            await self.change(lease, "draw", lambda b, t: draw(b, need, want, lease.capacity, lease.rate, t))

    def settled(self, lease: Lease) -> None:
        """A refund left the lease a surplus: it goes back in a task of its own."""
        if not self.down:
            self.spawn(self.give_back(lease))

    async def give_back(self, lease: Lease, everything: bool = False) -> None:
        async with lease.lock:
            n, lease.surplus = lease.surplus, 0.0
            if everything and lease.held > 0:
                n, lease.held = n + lease.held, 0.0
            if n > 0:                             # lost if it cannot be given: fewer admitted, never more
                await self.change(lease, "give_back", lambda b, t: give(b, n, lease.capacity, lease.rate, t))

    async def change(self, lease: Lease, op: str, step) -> None:
        """One draw or give-back, step(state, unix time) -> (new state, tokens got, tokens left), by
        compare-and-set; tb_limits unreachable: the lease falls back."""
        try:
            async with asyncio.timeout(KV_TIMEOUT):
                got, left = await self.cas(lease.tenant, step)
        except KV_ERRORS as e:
            self.unreachable(e)
            lease.degrade(self.gateways, time.monotonic())
            return
        except Contended:
            self.log.warning("shared limit contended", tenant=lease.tenant, tries=CAS_TRIES)
            return
        self.metrics.lease_round_trips.labels(op).inc()
        lease.drew(got, left, time.monotonic())

    async def cas(self, tenant: str, step) -> tuple[float, float]:
        for _ in range(CAS_TRIES):
            state, revision = await self.read(tenant)
            new, got, left = step(state, time.time())
            if new is None:
                return got, left
            try:
                if revision:
                    await self.kv.update(tenant, encode(new), last=revision)
                else:
                    await self.kv.create(tenant, encode(new))
                return got, left
            except nats.js.errors.KeyWrongLastSequenceError:
                self.metrics.lease_conflicts.inc()
        raise Contended()

    async def read(self, tenant: str) -> tuple[TenantBucket | None, int]:
        """The tenant's shared bucket and its revision (None, 0: no entry)."""
        try:
            entry = await self.kv.get(tenant)
        except nats.js.errors.KeyNotFoundError as e:          # and KeyDeletedError: create() handles both
            return None, 0 if e.entry is None else e.entry.revision
        try:
            return decode(entry.value, TenantBucket), entry.revision
        except WireError as e:                    # overwritten as a full bucket
            self.log.error("bad shared limit replaced", tenant=tenant, error=str(e))
            return None, entry.revision

    def unreachable(self, e: Exception) -> None:
        if not self.down:
            self.log.warning("shared limits unreachable: each gateway admits 1/N of a limit", gateways=self.gateways,
                             error=str(e) or type(e).__name__)
        self.down = True
        self.metrics.limits_fallback.set(1)

    async def run(self) -> None:
        """Forever: the heartbeat, N, and the leases that went idle back."""
        while True:
            await self.beat()
            now = time.monotonic()
            for lease in list(self.leases.values()):
                if not self.down and ((lease.held > 0 and now - lease.touched >= LEASE_IDLE) or lease.surplus > 0):
                    await self.give_back(lease, everything=now - lease.touched >= LEASE_IDLE)
            await asyncio.sleep(TICK)

    async def beat(self) -> None:
        """This gateway's entry in tb_gateways, and the count of them (N); tb_limits reachable again if it
        gets through."""
        try:
            async with asyncio.timeout(KV_TIMEOUT):
                await self.presence.put(self.gateway, b"")
                self.gateways = max(1, (await self.presence.status()).values)
        except KV_ERRORS as e:
            self.unreachable(e)
            return
        self.metrics.limits_gateways.set(self.gateways)
        for lease in self.leases.values():
            lease.chunk = lease.capacity * LEASE_SHARE / (2 * self.gateways)
        if self.down:
            self.log.info("shared limits reachable again", gateways=self.gateways)
            self.down = False
            self.metrics.limits_fallback.set(0)

    async def close(self) -> None:
        """Every lease back (the gateway stops)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2 * KV_TIMEOUT):
                for lease in list(self.leases.values()):
                    if not self.down:
                        await self.give_back(lease, everything=True)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

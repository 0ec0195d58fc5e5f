"""KV blocks between workers, for disaggregated serving (docs/disaggregation.md).

A prefill worker computes a prompt's KV and first token, then `offer`s the prompt's full blocks:
they stay pinned in its pool under a lease named after the request. The decode worker the router
hands the request to `fetch`es only the blocks its own prefix cache lacks — the chained block hash,
tenant salt included, names the same KV on both sides — writes them into blocks of its own pool
and registers them in its prefix cache, then `release`s the lease. The lease also ends by itself
KV_LEASE_SECONDS after the last fetch (a decode worker that died, or never came).

KvTransport is that interface; NatsKvTransport moves the bytes over the bus, portable and with
nothing to set up: request-reply on tb.kvx.<prefill worker>, one KvFetch answered by one KvBlocks
message under the server's max_payload (a group of whole blocks, or a range of one block's
layers when a block is larger), at most KV_FETCH_WINDOW requests in flight per decode worker (the
flow control: its transfers never have more than that many messages on the bus). On a GPU cluster an
RDMA transport (NIXL, UCX) would implement the same three calls: `offer` registers the pinned
blocks' memory and returns its descriptors in the lease, `fetch` reads them straight into the
reserved blocks, `release` deregisters; the worker service and the router do not change.

A KvBlocks message: a 4-byte big-endian header length, a msgpack header (type, version, lease,
hashes, layer range, dtype, shape, or an error), then the raw bytes of a [2, layers, blocks,
block_size, kv_heads, head_dim] tensor in the pool's dtype: a quantized pool's (EngineConfig.kv_cache_dtype
int8 or fp8) has rows of head_dim + 2, each with its scale, and its dtype is named "int8" or
"float8_e4m3fn"; a pool of another dtype is refused by name, never converted.
"""
import asyncio
import contextlib
import dataclasses
import functools
import os
import signal
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import msgpack
import nats.errors
import torch

from schemas import subjects
from schemas.messages import KvFetch, KvTransfer, Prefilled, decode, encode
from schemas.wire import WireError
from workers.engine.engine import LLMEngine
from workers.faults import NO_FAULTS, Faults

TRANSFER_WINDOW = 256          # transfers the p50/p99 are computed over
HEADER = struct.Struct(">I")


class TransferError(Exception):
    """A pull that did not complete: the prefill worker is gone or slow, the lease ended, or its KV
    does not fit this worker's (another model, dtype or block size)."""


@dataclass(slots=True)
class Lease:
    owner: str                 # the pin owner in the prefill worker's KV manager
    blocks: dict[int, int]     # hash -> the block id holding it, pinned
    deadline: float            # time.monotonic()


@dataclass(slots=True)
class Pulled:
    """What a decode worker's pull did."""
    blocks: int = 0            # pulled and registered
    cached: int = 0            # offered blocks it held already
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""            # why it stopped short (the rest is recomputed, or the request fails)


class KvTransport(Protocol):
    def offer(self, request_id: str, hashes: list[int]) -> tuple[str, list[int]]:
        """Pins the cached blocks of `hashes`; (lease, the hashes held) for the decode worker."""

    async def fetch(self, request_id: str, prefilled: Prefilled, hashes: list[int]) -> Pulled:
        """Pulls what this worker lacks of `hashes` (the request's own chain) and registers it."""

    def release(self, lease: str) -> None:
        """Unpins an offer (the prefill side)."""


@dataclass(slots=True)
class Piece:
    """One KvFetch: whole blocks (all layers) or layers [start, end) of one block."""
    hashes: list[int]
    layers: range


def plan(hashes: list[int], num_layers: int, layer_bytes: int, budget: int) -> list[Piece]:
    """The messages a transfer takes, each at most `budget` bytes of KV (one layer of one block at least)."""
    block_bytes = num_layers * layer_bytes
    if block_bytes <= budget:
        per = budget // block_bytes
        return [Piece(hashes[i:i + per], range(num_layers)) for i in range(0, len(hashes), per)]
    per = max(1, budget // layer_bytes)
    return [Piece([h], range(start, min(start + per, num_layers))) for h in hashes
            for start in range(0, num_layers, per)]


def pack(header: dict, data: bytes | memoryview = b"") -> bytes:
    head = msgpack.packb({"t": "kv_blocks", "v": 1, **header})
    return HEADER.pack(len(head)) + head + data


def unpack(payload: bytes) -> tuple[dict, memoryview]:
    try:
        (n,) = HEADER.unpack_from(payload)
        header = msgpack.unpackb(payload[HEADER.size:HEADER.size + n])
    except Exception as e:
        raise TransferError(f"not a KvBlocks message: {type(e).__name__} {e}") from None
    if not isinstance(header, dict) or header.get("t") != "kv_blocks" or header.get("v") != 1:
        raise TransferError("not a KvBlocks message of version 1")
    return header, memoryview(payload)[HEADER.size + n:]


class NatsKvTransport:
    """Both sides of the transfer for one worker: serves its offers, pulls into its pool.

    The KV manager is the step loop's alone: offers, pins, reservations and registrations happen
    there. The bytes move on the worker's side thread (workers/sideline.py), so a fetch is answered,
    and a pull's messages land, while a step runs: fetches are answered from pinned blocks, and a
    pull writes into reserved ones, which no step reads or writes."""

    def __init__(self, nc, worker: str, engine: LLMEngine, log, engine_lock: asyncio.Lock,
                 faults: Faults = NO_FAULTS):
        self.nc, self.worker, self.engine, self.log = nc, worker, engine, log
        self.engine_lock = engine_lock           # the worker's: pins and blocks change between steps only
        self.kv = engine.kv
        self.leases: dict[str, Lease] = {}
        self.stats = KvTransfer()
        self.durations: deque[float] = deque(maxlen=TRANSFER_WINDOW)
        self.die_after = faults.kv_die_after     # the kv-die-after fault (workers/faults.py): 0 when off
        self.side = None                         # a Sideline: where the bytes move (None: on the caller's loop)
        self.main: asyncio.AbstractEventLoop | None = None

    @functools.cached_property
    def fetches(self) -> asyncio.Semaphore:
        """The flow control's window, made on (and bound to) the loop the transfers run on."""
        return asyncio.Semaphore(subjects.KV_FETCH_WINDOW)

    @property
    def bus(self):
        """The connection the bytes move on."""
        return self.side.nc if self.side is not None else self.nc

    @functools.cached_property
    def runner(self):
        return self.engine.runner

    @functools.cached_property
    def budget(self) -> int:
        """Bytes of KV one KvBlocks message carries at most."""
        return max(1, self.bus.max_payload - subjects.KV_PAYLOAD_MARGIN)

    @functools.cached_property
    def num_layers(self) -> int:
        return len(self.runner.model.attention_layers())

    @functools.cached_property
    def shape(self) -> tuple[int, int, int]:
        """One layer's K (or V) of one block: block_size, kv heads, head dim (+ 2 for a quantized row's scale)."""
        attn = self.runner.model.attention_layers()[0]
        return self.engine.config.block_size, attn.num_kv_heads, self.runner.kv_row()

    @functools.cached_property
    def layer_bytes(self) -> int:
        """One layer of one block, K and V."""
        return self.runner.block_bytes() // self.num_layers

    @functools.cached_property
    def dtype(self) -> str:
        """The pool's dtype as a KvBlocks header names it (int8 or float8_e4m3fn for a quantized pool)."""
        return str(self.runner.kv_dtype).removeprefix("torch.")

    async def start(self, side=None) -> None:
        self.side, self.main = side, asyncio.get_running_loop()
        await self.on_side(self.bus.subscribe(subjects.kv_transfer(self.worker), cb=self.on_fetch))

    async def on_side(self, coro):
        return await (self.side.run(coro) if self.side is not None else coro)

    # -- the prefill side -------------------------------------------------------------------------

    def offer(self, request_id: str, hashes: list[int]) -> tuple[str, list[int]]:
        self.release(request_id)                 # a request prefilled again (a redelivery): the newer offer
        owner = f"lease:{request_id}"
        held = self.kv.pin(owner, hashes)
        blocks = {h: self.kv.cached[h].block_id for h in held}
        self.leases[request_id] = Lease(owner, blocks, time.monotonic() + subjects.KV_LEASE_SECONDS)
        self.stats.handoffs += 1
        return request_id, held

    def release(self, lease: str) -> None:
        """Ends a lease; called with no step under way (the step loop's, or under the engine lock)."""
        held = self.leases.pop(lease, None)
        if held is not None:
            self.kv.unpin(held.owner)

    async def released(self, lease: str) -> None:
        async with self.engine_lock:
            self.release(lease)

    def expire(self, now: float) -> None:
        """Ends the leases no fetch renewed within KV_LEASE_SECONDS."""
        for name in [n for n, lease in self.leases.items() if lease.deadline <= now]:
            self.log.warning("kv lease expired", lease=name)
            self.release(name)

    async def on_fetch(self, msg) -> None:
        """(side thread) A fetch answered, or a release passed to the step loop, which owns the pins."""
        try:
            ask = decode(msg.data, KvFetch)
        except WireError as e:
            self.log.error("bad kv fetch dropped", error=str(e))
            return
        if ask.release:
            asyncio.run_coroutine_threadsafe(self.released(ask.lease), self.main)
            return
        if not msg.reply:
            return
        await self.bus.publish(msg.reply, self.answer(ask))
        if self.die_after:                       # an injected fault: one falsy check when off
            await self.count_down()

    async def count_down(self) -> None:
        """The kv-die-after fault: SIGKILL once the fetches it names are answered (a death mid-transfer)."""
        self.die_after -= 1
        if not self.die_after:
            await self.bus.flush()
            self.log.warning("injected fault: dying mid-transfer", fault="kv-die-after")
            os.kill(os.getpid(), signal.SIGKILL)

    def answer(self, ask: KvFetch) -> bytes:
        """The KvBlocks for one fetch, or one naming why not."""
        lease = self.leases.get(ask.lease)
        if lease is None:
            return pack({"error": f"lease {ask.lease} is not held here (released, or expired after "
                                  f"KV_LEASE_SECONDS={subjects.KV_LEASE_SECONDS:g} s)"})
        missing = next((h for h in ask.hashes if h not in lease.blocks), None)
        if missing is not None:
            return pack({"error": f"block {missing} is not in lease {ask.lease}"})
        layers = range(ask.layer_start, ask.layer_end)
        if not (0 <= layers.start < layers.stop <= self.num_layers):
            return pack({"error": f"layers [{layers.start}, {layers.stop}) are outside [0, {self.num_layers})"})
        if len(ask.hashes) * len(layers) * self.layer_bytes > self.budget:
            return pack({"error": f"the fetch asks for more than max_payload allows ({self.budget} bytes of KV)"})
        lease.deadline = time.monotonic() + subjects.KV_LEASE_SECONDS
        kv = self.runner.read_blocks([lease.blocks[h] for h in ask.hashes], layers)
        if self.leases.get(ask.lease) is not lease:   # released while it was read: its blocks may be reused
            return pack({"error": f"lease {ask.lease} ended while its blocks were read"})
        data = memoryview(kv.view(torch.uint8).numpy())
        self.stats.served_blocks += len(ask.hashes) if layers.start == 0 else 0
        self.stats.served_bytes += kv.nbytes
        return pack({"lease": ask.lease, "hashes": ask.hashes, "layers": [layers.start, layers.stop],
                     "dtype": self.dtype, "shape": list(kv.shape)}, data)

    # -- the decode side --------------------------------------------------------------------------

    async def fetch(self, request_id: str, prefilled: Prefilled, hashes: list[int]) -> Pulled:
        """Pulls the blocks of `hashes` (the request's own chained hashes: a block of another tenant or
        prompt never matches) that this worker lacks, from the prefill worker, into blocks reserved for
        the request; each is registered in the prefix cache once all its layers came. The blocks it had
        already are pinned for the request too, so nothing it relies on is evicted before the request is
        admitted (the scheduler unpins them then). Stops at the first failure, keeping what came."""
        start, out = time.perf_counter(), Pulled()
        offered = set(prefilled.block_hashes)
        chain = []
        for h in hashes:                         # the prefix of the request's chain the prefill worker holds
            if h not in offered:
                break
            chain.append(h)
        async with self.engine_lock:
            out.cached = len(self.kv.pin(request_id, [h for h in chain if h in self.kv.cached]))
            want = [h for h in chain if h not in self.kv.cached]
            reserved = dict(zip(want, self.kv.reserve(request_id, len(want))))
        want = want[:len(reserved)]
        if want:
            ids = {h: block.block_id for h, block in reserved.items()}
            pulled = await self.on_side(self.pull(prefilled, want, ids, out))
            async with self.engine_lock:
                for h in pulled:
                    out.blocks += self.kv.register(reserved[h], h)
        out.seconds = time.perf_counter() - start
        self.count(out, bool(want))
        return out

    async def pull(self, prefilled: Prefilled, want: list[int], ids: dict[int, int], out: Pulled) -> list[int]:
        """(side thread) The messages of one transfer, KV_FETCH_WINDOW in flight, then the lease released
        (the prefill worker's expiry is the fallback if that is lost). Returns the hashes whose every
        layer came."""
        layers_left = dict.fromkeys(want, self.num_layers)
        subject = subjects.kv_transfer(prefilled.worker)
        try:
            async with asyncio.TaskGroup() as tg:
                for piece in plan(want, self.num_layers, self.layer_bytes, self.budget):
                    tg.create_task(self.piece(subject, prefilled.lease, piece, ids, layers_left, out))
        except* (TransferError, nats.errors.Error, asyncio.TimeoutError) as group:
            e = group.exceptions[0]
            out.error = str(e) or type(e).__name__
        with contextlib.suppress(nats.errors.Error):
            await self.bus.publish(subject, encode(KvFetch(prefilled.lease, release=True)))
        return [h for h in want if layers_left[h] == 0]

    async def piece(self, subject: str, lease: str, piece: Piece, ids: dict[int, int], layers_left: dict,
                    out: Pulled) -> None:
        async with self.fetches:
            ask = KvFetch(lease, piece.hashes, piece.layers.start, piece.layers.stop)
            reply = await self.bus.request(subject, encode(ask), timeout=subjects.KV_FETCH_TIMEOUT)
        header, data = unpack(reply.data)
        if header.get("error"):
            raise TransferError(f"the prefill worker refused the fetch: {header['error']}")
        want_shape = [2, len(piece.layers), len(piece.hashes), *self.shape]
        if header.get("hashes") != piece.hashes or header.get("layers") != [piece.layers.start, piece.layers.stop]:
            raise TransferError("the prefill worker answered with other blocks than asked")
        if header.get("dtype") != self.dtype or header.get("shape") != want_shape:
            raise TransferError(f"the prefill worker's KV is {header.get('dtype')} {header.get('shape')}, this "
                                f"worker's {self.dtype} {want_shape}: another model, dtype, kv_cache_dtype or "
                                "block size")
        if len(data) != self.layer_bytes * len(piece.layers) * len(piece.hashes):
            raise TransferError(f"a KvBlocks message of {len(data)} bytes, not the shape's")
        kv = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.runner.kv_dtype).view(want_shape)
        self.runner.write_blocks([ids[h] for h in piece.hashes], piece.layers, kv)
        out.bytes += len(data)
        for h in piece.hashes:
            layers_left[h] -= len(piece.layers)

    def count(self, out: Pulled, transferred: bool) -> None:
        s = self.stats
        s.transfers += 1
        s.pulled_blocks += out.blocks
        s.pulled_bytes += out.bytes
        s.cached_blocks += out.cached
        s.failures += bool(out.error)
        if transferred:
            s.transfer_seconds += out.seconds
            self.durations.append(out.seconds * 1e3)

    def snapshot(self) -> KvTransfer:
        """The counts for the heartbeat, with the leases held and the percentiles of the recent transfers' times."""
        ms = sorted(self.durations) or [0.0]
        return dataclasses.replace(self.stats, leases=len(self.leases), transfer_ms_p50=round(ms[len(ms) // 2], 3),
                                   transfer_ms_p99=round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3))

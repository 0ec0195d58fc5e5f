"""The prefix cache below the KV pool: a host-memory tier, then a disk tier, each LRU and bounded.

A cached block evicted from the pool is copied down to host memory; a block the host tier drops for
room goes to disk. A prefix hit in either is copied back up into a pool block instead of being
recomputed. The tiers are inclusive: a block copied up stays where it was (the most recently used
there), so evicting it again costs no copy. The KV manager decides which blocks move
(workers.engine.kv_cache: `lower` is this object, as a container of hashes); the engine moves them
through the runner's read_blocks/write_blocks before the step's forward, and what read_blocks returns
is kept as it is (opaque: a quantized pool's blocks carry their scales), one block per entry.

The disk tier is a directory per KV layout (`identity`: the model's fingerprint, dtype, block size, KV
dtype, ranks), one file per block named by its chained hash, which is stable across processes: a
restarted worker finds its blocks. Each file holds a BLAKE2b checksum of its payload; a block that
fails it is deleted and counted, and its request recomputes it.
"""
import contextlib
import io
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b

import torch

MAGIC = b"TBKV1\n"
DIGEST = 32
SAMPLE = 1 << 20        # bytes of each model file's head and tail in its fingerprint


@dataclass(slots=True)
class TierStats:
    hits: int = 0           # blocks copied up from this tier
    blocks_in: int = 0      # blocks copied into it
    bytes_in: int = 0
    bytes_out: int = 0      # bytes copied up from it
    seconds: float = 0.0    # time spent copying in and out (and, on disk, reading and writing files)
    corrupt: int = 0        # blocks that failed their checksum (disk)


def nbytes(kv) -> int:
    """Bytes of what read_blocks returned: a tensor, or tensors in a tuple, list or dict."""
    if isinstance(kv, torch.Tensor):
        return kv.nbytes
    if isinstance(kv, dict):
        kv = kv.values()
    return sum(nbytes(x) for x in kv)


class HostTier:
    """Blocks' KV in host memory, at most `capacity` bytes, the least recently used dropped first."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self.blocks: OrderedDict[int, tuple[object, int]] = OrderedDict()   # hash -> (kv, bytes), LRU first
        self.stats = TierStats()
        self.changed: set[int] | None = None   # hashes kept or dropped since KVTiers.take_changed; None: off

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def put(self, h: int, kv, size: int) -> list[tuple[int, object]]:
        """Keeps kv under h; returns the (hash, kv) dropped for room (kv itself when it cannot fit)."""
        if size > self.capacity:
            return [(h, kv)]
        if h in self.blocks:
            self.touch(h)
            return []
        self.blocks[h] = (kv, size)
        self.used += size
        self.note(h)
        dropped = []
        while self.used > self.capacity:
            old, (old_kv, old_size) = self.blocks.popitem(last=False)
            self.used -= old_size
            self.note(old)
            dropped.append((old, old_kv))
        return dropped

    def get(self, h: int):
        """The KV kept under h (now the most recently used), or None."""
        entry = self.blocks.get(h)
        if entry is None:
            return None
        self.blocks.move_to_end(h)
        return entry[0]

    def touch(self, h: int) -> None:
        self.blocks.move_to_end(h)

    def note(self, h: int) -> None:
        if self.changed is not None:
            self.changed.add(h)

    def clear(self) -> None:
        for h in self.blocks:
            self.note(h)
        self.blocks.clear()
        self.used = 0


class DiskTier:
    """Blocks' KV as files under `root`/`identity`/, at most `capacity` bytes of files, the least
    recently used deleted first. Their order survives a restart: a hit touches its file's mtime."""

    def __init__(self, root: str, capacity: int, identity: str):
        self.dir, self.capacity, self.used = os.path.join(root, identity), capacity, 0
        os.makedirs(self.dir, exist_ok=True)
        self.files: OrderedDict[int, int] = OrderedDict()     # hash -> file bytes, LRU first
        self.stats = TierStats()
        self.changed: set[int] | None = None                  # hashes stored or deleted since take_changed
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".kv"):
                try:
                    found.append((entry.stat().st_mtime_ns, int(entry.name[:-3], 16), entry.stat().st_size))
                except ValueError:
                    continue
            elif entry.name.endswith(".tmp"):                # a write cut short by a crash
                os.unlink(entry.path)
        for _, h, size in sorted(found):
            self.files[h] = size
            self.used += size
        self.trim()

    def __contains__(self, h: int) -> bool:
        return h in self.files

    def __len__(self) -> int:
        return len(self.files)

    def path(self, h: int) -> str:
        return os.path.join(self.dir, f"{h & (1 << 64) - 1:016x}.kv")

    def put(self, h: int, kv) -> None:
        if h in self.files:
            self.touch(h)
            return
        buf = io.BytesIO()
        torch.save(kv, buf)
        payload = buf.getvalue()
        data = MAGIC + blake2b(payload, digest_size=DIGEST).digest() + payload
        if len(data) > self.capacity:
            return
        tmp = self.path(h) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path(h))                         # a reader never sees half a file
        self.files[h] = len(data)
        self.used += len(data)
        self.note(h)
        self.stats.blocks_in += 1
        self.stats.bytes_in += len(data)
        self.trim()

    def get(self, h: int):
        """The KV under h, or None: not here, or failed its checksum (then deleted and counted)."""
        if h not in self.files:
            return None
        try:
            with open(self.path(h), "rb") as f:
                data = f.read()
        except OSError:
            data = b""
        payload = data[len(MAGIC) + DIGEST:]
        if not data.startswith(MAGIC) or blake2b(payload, digest_size=DIGEST).digest() != \
                data[len(MAGIC):len(MAGIC) + DIGEST]:
            self.stats.corrupt += 1
            self.drop(h)
            return None
        self.touch(h)
        self.stats.bytes_out += len(data)
        return torch.load(io.BytesIO(payload), weights_only=True)

    def touch(self, h: int) -> None:
        self.files.move_to_end(h)
        with contextlib.suppress(OSError):
            os.utime(self.path(h))

    def note(self, h: int) -> None:
        if self.changed is not None:
            self.changed.add(h)

    def drop(self, h: int) -> None:
        self.used -= self.files.pop(h)
        self.note(h)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(h))

    def trim(self) -> None:
        while self.used > self.capacity:
            self.drop(next(iter(self.files)))

    def clear(self) -> None:
        while self.files:
            self.drop(next(iter(self.files)))


class KVTiers:
    """The host and disk tiers of one engine, and the copies between them and the pool."""

    def __init__(self, runner, host_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0,
                 identity: str = ""):
        self.runner, self.layers = runner, range(runner.cfg.num_layers)
        self.host = HostTier(host_bytes)
        self.disk = DiskTier(disk_dir, disk_bytes, identity) if disk_dir else None

    def __contains__(self, h: int) -> bool:
        return h in self.host or (self.disk is not None and h in self.disk)

    def tier_of(self, h: int) -> int | None:
        """The highest tier below the pool that holds h (schemas.messages.KV_TIERS: 1 host, 2 disk), or None."""
        if h in self.host:
            return 1
        return 2 if self.disk is not None and h in self.disk else None

    def record_changes(self) -> None:
        """From now on, note the hashes that enter or leave a tier (the worker's KV events)."""
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.changed = set()

    def take_changed(self) -> set[int]:
        """The hashes that entered or left a tier since the last call (none unless recording)."""
        changed = set()
        for tier in (self.host, self.disk):
            if tier is not None and tier.changed is not None:
                changed |= tier.changed
                tier.changed = set()
        return changed

    def held(self) -> list[tuple[int, int]]:
        """(hash, tier) of every block below the pool, the least recently used of each tier first."""
        out = [(h, 1) for h in self.host.blocks]
        if self.disk is not None:
            out += [(h, 2) for h in self.disk.files if h not in self.host]
        return out

    def save(self, moves: list[tuple[int, int]]) -> None:
        """Copies evicted pool blocks' KV (hash, block id) down: to host memory, and what it drops, to disk.
        A block the host holds already is only touched."""
        for h, block_id in moves:
            if h in self.host:
                self.host.touch(h)
                continue
            start = time.perf_counter()
            kv = self.runner.read_blocks([block_id], self.layers)
            size = nbytes(kv)
            s = self.host.stats
            s.blocks_in, s.bytes_in = s.blocks_in + 1, s.bytes_in + size
            dropped = self.host.put(h, kv, size)
            s.seconds += time.perf_counter() - start
            self.spill(dropped)

    def spill(self, dropped: list[tuple[int, object]]) -> None:
        if self.disk is None:
            return
        start = time.perf_counter()
        for h, kv in dropped:
            self.disk.put(h, kv)
        self.disk.stats.seconds += time.perf_counter() - start

    def flush(self, pool: list[tuple[int, int]]) -> None:
        """Writes every block held above the disk down to it: the host tier's, then the pool's (hash, block id),
        least recently used first, so that what the disk has room for is the most recent."""
        start = time.perf_counter()
        for h, (kv, _) in list(self.host.blocks.items()):
            self.disk.put(h, kv)
        for h, block_id in pool:
            if h not in self.disk:
                self.disk.put(h, self.runner.read_blocks([block_id], self.layers))
            else:
                self.disk.touch(h)
        self.disk.stats.seconds += time.perf_counter() - start

    def restore(self, moves: list[tuple[int, int]]) -> list[int]:
        """Copies (hash, block id) up from the tier that holds each hash. Returns the block ids that could
        not be filled (gone, or failed the disk's checksum)."""
        bad = []
        for h, block_id in moves:
            start = time.perf_counter()
            kv, tier = self.host.get(h), self.host
            if kv is None and self.disk is not None:
                kv, tier = self.disk.get(h), self.disk
                if kv is not None:
                    self.spill(self.host.put(h, kv, nbytes(kv)))   # promoted: the next hit is from memory
            if kv is None:
                bad.append(block_id)
                continue
            self.runner.write_blocks([block_id], self.layers, kv)
            tier.stats.hits += 1
            tier.stats.bytes_out += nbytes(kv) if tier is self.host else 0
            tier.stats.seconds += time.perf_counter() - start
        return bad

    def stats(self) -> dict:
        out = {}
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            s = tier.stats
            out.update({f"kv_{name}_hits": s.hits, f"kv_{name}_blocks": len(tier),
                        f"kv_{name}_bytes": tier.used, f"kv_{name}_bytes_in": s.bytes_in,
                        f"kv_{name}_bytes_out": s.bytes_out, f"kv_{name}_seconds": round(s.seconds, 6)})
        if self.disk is not None:
            out["kv_disk_corrupt"] = self.disk.stats.corrupt
        return out


def fingerprint(model: str) -> str:
    """A model checkpoint's identity, cheap to compute: each file's name, size and first and last MiB (a
    fine-tune of the same shape differs in every weight, so in those bytes too)."""
    h = blake2b(digest_size=16)
    paths = [model] if os.path.isfile(model) else sorted(
        os.path.join(model, n) for n in os.listdir(model)
        if n.endswith((".json", ".safetensors", ".bin", ".gguf", ".model", ".txt")))
    for path in paths:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(SAMPLE))
            if size > 2 * SAMPLE:
                f.seek(size - SAMPLE)
                h.update(f.read(SAMPLE))
    return h.hexdigest()


def identity(model: str, **layout) -> str:
    """The disk tier's directory name: the model's fingerprint and everything that shapes its KV bytes."""
    key = fingerprint(model) + "".join(f"\0{k}={v}" for k, v in sorted(layout.items()))
    return blake2b(key.encode(), digest_size=16).hexdigest()

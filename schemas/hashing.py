"""The one prefix-cache block hash, shared by the engine and the router.

Block i of a token sequence hashes to h_i = H(h_{i-1}, tokens of block i, extra keys). The
tenant's cache salt is an extra key of the first block only, so every later hash inherits it
through the chain and two tenants never share a cached block unless they share a salt.
H is BLAKE2b-64 over a fixed byte layout: stable across processes, machines and Python versions
(Python's own hash() is salted per process and could not be shared with the router).
"""
from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT = 0  # the parent of a sequence's first block


def hash_block(parent: int, tokens: Sequence[int], salt: str | None = None) -> int:
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    if salt is not None:
        h.update(b"\x00salt:" + salt.encode())
    return int.from_bytes(h.digest(), "little")


def hash_blocks(tokens: Sequence[int], block_size: int, salt: str | None = None,
                parents: Sequence[int] = ()) -> list[int]:
    """Hashes of the full blocks of `tokens`; `parents` are hashes already known for its head."""
    hashes = list(parents)
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else ROOT
        hashes.append(hash_block(parent, tokens[start:start + block_size], salt if not hashes else None))
    return hashes

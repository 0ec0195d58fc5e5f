"""Paged KV cache bookkeeping: blocks, block tables and the prefix cache (vLLM V1's algorithm).

Blocks are fixed-size (block_size tokens). A full block of final tokens is registered under its
chained hash, so a later request whose prefix hashes the same reuses it. A freed block keeps its
hash and waits in an LRU free list; it is evicted (its hash forgotten) only when popped for
reuse. Requests free their blocks tail first, so a chain's tail is evicted before its parents.
With record_changes() on, the hashes stored and evicted are kept until take_changes(): the worker
publishes them once per step as a KV event, for the router's index.

Disaggregated serving pins blocks outside any running request, under an owner: a prefill worker
pins the prompt blocks it offers until the decode worker has pulled them (pin), and a decode
worker holds the blocks it pulls into (reserve, then register once their KV is written) and the
ones of the prompt it had already, until the request is admitted (unpin).

Below the pool may lie lower tiers (host memory, disk: workers.engine.kv_tiers), given as `lower`, a
container of the hashes they hold. The manager moves no bytes: it records which blocks to save and
restore, and the engine copies them before the step's forward, the only time KV is written. A cached
block evicted from the pool is a save (its hash and block, read before anything overwrites it); a
prefix lookup that misses the pool but finds the hash below is a hit all the same, and allocation
gives it a pool block to restore into (named at once, so the same step's later lookups hit the pool).
"""
from dataclasses import dataclass

from workers.engine.request import Request


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: int | None = None
    prev: "Block | None" = None  # free-list links
    next: "Block | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop the least recently freed, remove any, append, in O(1)."""

    def __init__(self, blocks: list[Block]):
        self.head, self.tail = Block(-1), Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self.tail.prev
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block
        self.num_free += 1

    def appendleft(self, block: Block) -> None:
        first = self.head.next
        self.head.next, block.prev, block.next, first.prev = block, self.head, first, block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> Block:
        assert self.num_free > 0, "no free KV block"
        block = self.head.next
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, lower=None):
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}           # block hash -> block holding that KV
        self.req_blocks: dict[str, list[Block]] = {}  # request id -> its block table
        self.num_hashed: dict[str, int] = {}          # request id -> how many of its blocks are registered
        self.prefix_queries = self.prefix_hits = 0    # in tokens
        self.changes: dict[int, bool] | None = None   # hash -> stored / evicted since take_changes(); None: off
        self.pins: dict[str, list[Block]] = {}        # owner -> blocks it holds outside any running request
        self.lower = lower                            # hashes held by the tiers below the pool; None: no tiers
        self.saves: dict[int, int] = {}               # block id -> hash: evicted KV to copy down before the forward
        self.saving: set[int] = set()                 # the hashes of `saves`
        self.restores: dict[int, int] = {}            # block id -> hash: KV to copy up before the forward

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free.num_free

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """The longest cached prefix of req, in whole blocks, leaving at least its last token to
        compute (its logits are needed)."""
        return self.cached_prefix(req.block_hashes, req.num_tokens)

    def cached_prefix(self, hashes: list[int], num_tokens: int) -> list[Block]:
        """The longest cached prefix of `num_tokens` tokens whose full blocks hash to `hashes`, as
        get_computed_blocks counts it."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in hashes[:(num_tokens - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                if not self.below(h):
                    break
                block = Block(-1, hash=h)    # a lower tier's: allocate_slots restores it into a pool block
            hits.append(block)
        return hits

    def below(self, h: int) -> bool:
        """Whether a lower tier holds h, or will once this step's saves are copied down."""
        return self.lower is not None and (h in self.saving or h in self.lower)

    def new_blocks(self, hashes: list[int], num_tokens: int) -> int:
        """The blocks a request of `num_tokens` tokens whose full blocks hash to `hashes` will add: all of
        its blocks less its prefix cached in the pool (one in a lower tier needs a pool block)."""
        pooled = sum(b.block_id >= 0 for b in self.cached_prefix(hashes, num_tokens))
        return self.num_blocks_for(num_tokens) - pooled

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, hits: list[Block] = ()) -> bool:
        """Gives req the blocks for `hits` (cached blocks right after its computed tokens, in the pool or
        below it) and for num_new_tokens more tokens. False, changing nothing, when the free blocks do
        not suffice."""
        blocks = self.req_blocks.get(req.request_id, [])
        num_tokens = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        pooled = [b for b in hits if b.block_id >= 0]
        need = -(-num_tokens // self.block_size) - len(blocks) - len(pooled)   # a lower tier's hit takes one
        if need > self.free.num_free - sum(b.ref_cnt == 0 for b in pooled):
            return False
        for block in pooled:                  # off the free list first: a restore's pop never evicts them
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1
        hits = [b if b.block_id >= 0 else self.restore(b.hash) for b in hits]
        blocks = self.req_blocks.setdefault(req.request_id, blocks)
        blocks.extend(hits)
        blocks.extend(self.pop_free() for _ in range(need - len(hits) + len(pooled)))
        self.hash_full_blocks(req, num_tokens)
        return True

    def allocate_draft_slots(self, req: Request, num_tokens: int) -> int:
        """Gives req blocks for up to num_tokens tokens in all (its computed ones, this step's and the
        draft tokens after them), taking only free blocks that hold no cached KV: a draft, which may be
        rejected, never evicts a cached block. Returns how many tokens its blocks now hold."""
        blocks = self.req_blocks[req.request_id]
        need = self.num_blocks_for(num_tokens) - len(blocks)
        while need > 0 and self.free.num_free and self.free.head.next.hash is None:
            blocks.append(self.pop_free())
            need -= 1
        return min(num_tokens, len(blocks) * self.block_size)

    def rollback(self, req: Request) -> None:
        """After rejected draft tokens: the blocks past req's computed tokens (which held only drafts,
        never hashed) go back to the head of the free list, last taken first, so the free list is as
        if they had never been taken."""
        blocks = self.req_blocks.get(req.request_id, [])
        keep = self.num_blocks_for(req.num_computed_tokens)
        while len(blocks) > keep:
            block = blocks.pop()
            assert block.hash is None and block.ref_cnt == 1, f"block {block.block_id} rolled back while shared"
            block.ref_cnt = 0
            self.free.appendleft(block)

    def restore(self, h: int) -> Block:
        """A pool block named h, to be filled from the lower tier that holds h before the step's forward."""
        assert h not in self.cached, f"hash {h} restored while in the pool"
        block = self.pop_free()
        block.hash, self.cached[h] = h, block
        self.restores[block.block_id] = h
        if self.changes is not None:
            self.changes[h] = True
        return block

    def pop_free(self, save: bool = True) -> Block:
        """The least recently freed block, ref 1. Cached KV in it is evicted now (lazily) and, with lower
        tiers and `save`, recorded to be copied down before the step's forward overwrites it."""
        block = self.free.popleft()
        if block.hash is not None:  # lazy eviction: the cached KV is overwritten only now
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
                if self.changes is not None:
                    self.changes[block.hash] = False
                if self.restores.pop(block.block_id, None) is None and save and self.lower is not None \
                        and block.block_id not in self.saves:   # else: never filled, or evicted twice this step
                    self.saves[block.block_id] = block.hash
                    self.saving.add(block.hash)
            block.hash = None
        block.ref_cnt = 1
        return block

    def cached_blocks(self) -> list[tuple[int, int]]:
        """(hash, block id) of every block named in the pool, those evicted next first, those in use last."""
        blocks = [b for b in self.free if b.hash is not None] + [b for b in self.cached.values() if b.ref_cnt]
        return [(b.hash, b.block_id) for b in blocks if self.cached.get(b.hash) is b]

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(saves, restores) recorded since the last call, each (hash, block id): copy the saves down,
        then the restores up, before the step's forward."""
        saves = [(h, b) for b, h in self.saves.items()]
        restores = [(h, b) for b, h in self.restores.items()]
        self.saves, self.saving, self.restores = {}, set(), {}
        return saves, restores

    def forget(self, block_ids: list[int]) -> None:
        """Unnames these blocks (restores whose bytes failed their checksum): no later lookup hits them."""
        for i in block_ids:
            block = self.blocks[i]
            if block.hash is not None and self.cached.get(block.hash) is block:
                del self.cached[block.hash]
                if self.changes is not None:
                    self.changes[block.hash] = False
            block.hash = None

    def hash_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Registers the blocks that will be full of computed final tokens after this step."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks[req.request_id]
        start = self.num_hashed.get(req.request_id, 0)
        end = min(num_tokens // self.block_size, len(req.block_hashes))
        for block, h in zip(blocks[start:end], req.block_hashes[start:end]):
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block
                if self.changes is not None:
                    self.changes[h] = True
        self.num_hashed[req.request_id] = max(start, end)

    def uncache_uncomputed(self, req: Request) -> None:
        """Forgets the hashes registered for req's blocks past its computed tokens: a step that failed
        never wrote their KV, so no later request may hit them."""
        start = req.num_computed_tokens // self.block_size
        for block in self.req_blocks.get(req.request_id, [])[start:self.num_hashed.get(req.request_id, 0)]:
            if block.hash is not None and block.ref_cnt == 1 and self.cached.get(block.hash) is block:
                del self.cached[block.hash]
                if self.changes is not None:
                    self.changes[block.hash] = False
                block.hash = None
                self.restores.pop(block.block_id, None)
        if req.request_id in self.num_hashed:
            self.num_hashed[req.request_id] = min(start, self.num_hashed[req.request_id])

    def free_request(self, req: Request) -> None:
        """Returns req's blocks, tail first, so the LRU evicts chain tails before their parents."""
        self.num_hashed.pop(req.request_id, None)
        for block in reversed(self.req_blocks.pop(req.request_id, [])):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free.append(block)

    def pin(self, owner: str, hashes: list[int]) -> list[int]:
        """Holds the cached blocks of `hashes` until unpin(owner): not evicted, not reused. Returns the
        hashes pinned (those cached), in order."""
        held = []
        blocks = self.pins.setdefault(owner, [])
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                continue
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1
            blocks.append(block)
            held.append(h)
        return held

    def reserve(self, owner: str, n: int) -> list[Block]:
        """Up to n free blocks (the least recently used cached KV is evicted, as for any allocation, but not
        saved to a lower tier: the pull writes them outside any step) for KV that comes from elsewhere,
        held under owner until unpin; fewer when fewer are free."""
        blocks = [self.pop_free(save=False) for _ in range(min(n, self.free.num_free))]
        self.pins.setdefault(owner, []).extend(blocks)
        return blocks

    def register(self, block: Block, h: int) -> bool:
        """Names a reserved block whose KV has been written by its chained hash: a prefix-cache hit from
        now on. False when another block holds that hash already (this one stays unnamed)."""
        if block.hash is not None or h in self.cached:
            return False
        block.hash = h
        self.cached[h] = block
        if self.changes is not None:
            self.changes[h] = True
        return True

    def unpin(self, owner: str) -> None:
        """Lets owner's pinned blocks go, last first: unnamed ones to the head of the free list (reused
        first, they hold nothing), named ones to its tail like any freed block."""
        for block in reversed(self.pins.pop(owner, ())):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} unpinned twice"
            if block.ref_cnt == 0:
                (self.free.append if block.hash is not None else self.free.appendleft)(block)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block of the pool (e.g. between benchmark runs; the lower tiers keep theirs);
        only when no request holds one."""
        assert self.free.num_free == self.num_blocks, "reset_prefix_cache with requests running"
        for block in self.blocks:
            block.hash = None
        self.saves, self.saving, self.restores = {}, set(), {}
        if self.changes is not None:
            self.changes.update(dict.fromkeys(self.cached, False))
        self.cached.clear()

    def record_changes(self) -> None:
        """From now on, remember which hashes are stored and evicted (the worker's KV events)."""
        self.changes = {}
        if self.lower is not None:
            self.lower.record_changes()

    def take_changes(self) -> tuple[list[int], list[int]]:
        """(stored, evicted) hashes since the last call; a hash changed twice counts as its last change.
        With lower tiers, a hash that left the pool for a lower tier counts as stored (see take_events)."""
        stored, _, evicted = self.take_events()
        return stored, evicted

    def take_events(self) -> tuple[list[int], list[int], list[int]]:
        """(stored, their tiers, removed) since the last call: each hash that changed in the pool or a tier
        below it, with the highest tier that holds it now (0 the pool, 1 host memory, 2 disk), or removed
        when none does."""
        changes, self.changes = self.changes, {}
        if self.lower is None:
            stored = [h for h, kept in changes.items() if kept]
            return stored, [0] * len(stored), [h for h, kept in changes.items() if not kept]
        stored, tiers, removed = [], [], []
        for h in changes.keys() | self.lower.take_changed():
            tier = 0 if h in self.cached else self.lower.tier_of(h)
            if tier is None:
                removed.append(h)
            else:
                stored.append(h)
                tiers.append(tier)
        return stored, tiers, removed

    def held(self) -> tuple[list[int], list[int]]:
        """Every hash this worker holds and its tier (as take_events names them): a KV snapshot."""
        below = self.lower.held() if self.lower is not None else []
        below = [(h, t) for h, t in below if h not in self.cached]
        return [*self.cached, *(h for h, _ in below)], [0] * len(self.cached) + [t for _, t in below]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

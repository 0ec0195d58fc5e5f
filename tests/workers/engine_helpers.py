"""Hand-built requests and steps for CPU-only scheduler and KV-manager tests (no model), and torch's
thread count for a while."""
from contextlib import contextmanager

import torch

from schemas.sampling import SamplingParams
from workers.engine.kv_cache import KVCacheManager
from workers.engine.request import Request
from workers.engine.scheduler import Batch, Scheduler, SchedulerConfig

BLOCK = 4


def make_request(rid: str, tokens: list[int], max_tokens: int = 8, salt: str | None = None,
                 block_size: int = BLOCK, priority: int = 0, tenant: str = "", weight: float = 1.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, list(tokens), len(tokens), params, seed=0, block_size=block_size, cache_salt=salt,
                   priority=priority, tenant=tenant, weight=weight)


def make_scheduler(num_blocks: int = 16, budget: int = 64, max_num_seqs: int = 16, prefix: bool = True,
                   max_model_len: int = 1024, policy: str = "fcfs") -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, prefix)
    return Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len, policy=policy), kv)


def step(sched: Scheduler, token: int = 7) -> Batch:
    """schedule() then update() as if the model sampled `token` for every request that samples."""
    batch = sched.schedule()
    n_sampling = sum(batch.samples)
    sched.update(batch, [[token]] * n_sampling, [[None]] * n_sampling)
    return batch


def scheduled(batch: Batch) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)}


def check_invariants(kv: KVCacheManager) -> None:
    """Every block is either free (ref 0, in the free list once) or held by requests (ref = holders);
    the hash index points only at blocks carrying that hash."""
    holders: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free_ids = [b.block_id for b in kv.free]
    assert len(free_ids) == len(set(free_ids)) == kv.num_free_blocks
    for b in kv.blocks:
        assert b.ref_cnt == holders.get(b.block_id, 0), f"block {b.block_id}: ref {b.ref_cnt}"
        assert (b.ref_cnt == 0) == (b.block_id in set(free_ids))
    for h, b in kv.cached.items():
        assert b.hash == h


@contextmanager
def threads(n: int):
    """torch runs on n threads inside, on as many as before after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""The draft-model proposer: a smaller checkpoint with the target's tokenizer, run in the same
engine for k steps per verify step, with its own runner and paged KV pool (rank 0 only under
tensor parallel: the draft is small enough for one device).

Each drafting request has a mirror here: a Request over the same tokens whose KV lives in the
draft's pool. A call first catches every mirror up with its request (the tokens the target
accepted since the last call, or the whole prompt the first time: one varlen step), sampling the
first draft token, then decodes one token per step for the rest. The draft's tokens are drawn by
the target's sampler with the same noise, a function of (seed, output position, token): where the
two models' distributions agree the draft draws the token the target will, so acceptance stays
high for seeded sampling as well as for greedy. A mirror's drafts that the target rejected are
forgotten by rolling its computed tokens back to what it shares with the request.
"""
from workers.engine.kv_cache import KVCacheManager
from workers.engine.request import Request
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Batch
from workers.models.config import ModelConfig


class DraftModelProposer:
    def __init__(self, config, target):
        """`config`: the SpeculativeConfig (its model, draft_num_kv_blocks); `target`: the LLMEngine,
        whose device, dtype and block size the draft takes."""
        from workers.models import catalogue
        model = catalogue.resolve(config.model)
        cfg = ModelConfig.load(model)
        if cfg.vocab_size != target.model_cfg.vocab_size:
            raise ValueError(f"speculative draft model {config.model!r} has a vocabulary of {cfg.vocab_size} tokens, "
                             f"the target {target.model_cfg.vocab_size}: a draft must share the target's tokenizer")
        block_size = target.config.block_size
        self.runner = ModelRunner(model, cfg, target.dtype, target.device, block_size)
        num_blocks = config.draft_num_kv_blocks or target.kv.num_blocks
        self.runner.allocate_kv(num_blocks)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.mirrors: dict[str, Request] = {}

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        mirrors = [self.mirror(r) for r in requests]
        live = {r.request_id for r in requests}
        batch = Batch()
        for m in mirrors:
            n = m.num_tokens - m.num_computed_tokens
            if self.allocate(m, n, live):
                batch.add(m, n)
        for step in range(max(ks, default=0)):
            if batch.requests:
                tables = [self.kv.block_ids(m.request_id) for m in batch.requests]
                tokens, _ = self.runner.run(batch, tables)
                for m, n, row in zip(batch.requests, batch.num_new_tokens, tokens):
                    m.num_computed_tokens += n
                    m.append(row[0])
            want = {r.request_id for r, k in zip(requests, ks) if k > step + 1}
            batch = Batch()
            for m in mirrors:
                if m.request_id in want and m.num_computed_tokens == m.num_tokens - 1 and self.allocate(m, 1, live):
                    batch.add(m, 1)
        return [m.token_ids[r.num_tokens:r.num_tokens + k] for r, m, k in zip(requests, mirrors, ks)]

    def mirror(self, req: Request) -> Request:
        """req's mirror, its computed tokens rolled back to those it shares with req, and its tokens
        set to req's."""
        m = self.mirrors.get(req.request_id)
        if m is None or m.num_prompt_tokens != req.num_prompt_tokens:
            self.forget(req.request_id)
            m = self.mirrors[req.request_id] = Request(req.request_id, list(req.token_ids), req.num_prompt_tokens,
                                                       req.params, req.seed, self.kv.block_size)
            return m
        shared = 0
        for a, b in zip(m.token_ids[:m.num_computed_tokens], req.token_ids):
            if a != b:
                break
            shared += 1
        m.num_computed_tokens = min(shared, req.num_tokens - 1)
        m.token_ids = list(req.token_ids)
        return m

    def allocate(self, m: Request, n: int, live: set[str]) -> bool:
        """Slots for n more tokens of m; when the pool is full, the mirrors of requests not drafting
        now are dropped first. False if even that does not make room (m drafts nothing this time)."""
        if self.kv.allocate_slots(m, n):
            return True
        for rid in [rid for rid in self.mirrors if rid not in live]:
            self.forget(rid)
        return self.kv.allocate_slots(m, n)

    def forget(self, request_id: str) -> None:
        m = self.mirrors.pop(request_id, None)
        if m is not None:
            self.kv.free_request(m)

"""The mock engine's runner (EngineConfig(engine="mock"), `--engine mock`): the whole system at GPU speed without
a GPU. The engine around it is the real one (Scheduler, KVCacheManager: admission, chunked prefill, preemption,
the prefix cache, KV events); only the model is replaced.

- No weights are loaded: the model's config.json gives the shapes.
- The KV pool is block accounting only. Its size is the GPU preset's: `mock_tp` × memory ×
  gpu_memory_utilization − the weights (bf16), over the KV of a block (num_kv_blocks or kv_cache_memory, if
  given, win), at most MAX_BLOCKS.
- Each step is held until the roofline's seconds for its shape on `mock_tp` × `mock_gpu`
  (workers/engine/roofline.py) have passed since the engine's step began, so Python's own time is absorbed,
  not added (a step whose Python took longer than the roofline's time is not held at all).
- The token after absolute position p of a request (p = prompt + output tokens before it) is a hash of (its
  seed, p) mod the vocabulary, never an EOS id (requests end by max_tokens, a stop token id or a stop string).
  A request moved to another worker, or sent again with its output appended to its prompt, continues with the
  same tokens. Logprobs, if asked for, are a function of the same hash.
- Structured output, the prefix cache's tiers, tensor parallel ranks (use mock_tp), weight quantization and a
  draft model are refused (EngineConfig names the option). Disaggregated serving works: the KV it moves is a
  stand-in of one byte per layer, token and K or V.
"""
import time
from dataclasses import dataclass

import torch

from workers.engine.request import TokenLogprobs
from workers.engine.roofline import GPUS, Efficiency, Roofline, RooflineCost
from workers.engine.scheduler import Batch

MAX_BLOCKS = 1 << 18                 # a bigger pool only costs the block manager's memory: 4M tokens of 16
BF16 = 2


def mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2^64)."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def mock_token(seed: int, position: int, vocab: int, banned: frozenset[int] | set[int] = frozenset()) -> int:
    """The mock's token at absolute `position` of a request with `seed`: a hash of both mod vocab, hashed again
    while it is a banned id (EOS, or a stop id min_tokens holds back)."""
    h = mix64(mix64(seed) + (position + 1) * 0x9E3779B97F4A7C15)
    token = h % vocab
    while token in banned:
        h = mix64(h + 1)
        token = h % vocab
    return token


def mock_logprob(seed: int, position: int) -> float:
    """A deterministic logprob in (-3, 0) for the mock's token at `position`."""
    return -((mix64(seed ^ (position * 0xD6E8FEB86659FD93)) >> 11) % 3000 + 1) / 1000


class StandInAttention:
    """What KV transfer reads of an attention layer: one KV head of one element a token."""
    num_kv_heads = 1
    head_dim = 1


class StandInModel:
    def __init__(self, cfg):
        self.cfg = cfg

    def attention_layers(self) -> list[StandInAttention]:
        return [StandInAttention()] * self.cfg.num_layers

    def parameters(self):
        return iter(())


@dataclass(slots=True)
class MockInputs:
    """What LLMEngine.inject_fault's hook reads of a step: its input token ids."""
    input_ids: torch.Tensor


class MockRunner:
    """ModelRunner's interface, with a roofline's clock for a model."""

    def __init__(self, cfg, config):
        self.cfg, self.block_size = cfg, config.block_size
        self.device, self.dtype, self.kv_dtype = torch.device("cpu"), torch.bfloat16, torch.uint8
        self.model = StandInModel(cfg)
        eff = Efficiency(memory_utilization=config.gpu_memory_utilization)
        self.roofline = Roofline(cfg, GPUS[config.mock_gpu], config.mock_tp, eff, BF16)
        self.cost = RooflineCost(self.roofline)
        self.banned = frozenset(t for t in cfg.eos_token_ids if 0 <= t < cfg.vocab_size)
        self.num_blocks = config.num_kv_blocks or self.blocks_in_budget(config)
        self.rank_bytes = [[0, 0]]
        self.forward_seconds = 0.0           # time held for the steps' roofline
        self.roofline_seconds = 0.0          # the roofline's seconds of every step, summed (for tests)
        self.step_start: float | None = None  # set by the engine as each step begins

    def blocks_in_budget(self, config) -> int:
        """The GPU preset's KV (or kv_cache_memory) over a block's KV in bf16 (one byte an element for an int8
        or fp8 pool)."""
        per_token = self.roofline.kv_bytes_per_token() / (BF16 if config.kv_cache_dtype in ("int8", "fp8") else 1)
        budget = config.kv_cache_memory or self.roofline.kv_per_node()
        blocks = int(budget // (per_token * self.block_size))
        if blocks < 1:
            raise ValueError(f"mock_gpu={config.mock_gpu!r} × mock_tp={config.mock_tp} leaves no memory for KV "
                             f"after the weights ({self.roofline.weight_bytes() / 1e9:.1f} GB): raise mock_tp")
        return min(blocks, MAX_BLOCKS)

    # -- what KV transfer and the engine read of a runner -------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes of one block's stand-in KV: one byte a layer, token and K or V."""
        return 2 * self.block_size * self.cfg.num_layers

    def kv_row(self) -> int:
        return 1

    def parameter_bytes(self) -> int:
        return 0

    def read_blocks(self, block_ids: list[int], layers: range) -> torch.Tensor:
        return torch.zeros((2, len(layers), len(block_ids), self.block_size, 1, 1), dtype=self.kv_dtype)

    def write_blocks(self, block_ids: list[int], layers: range, kv: torch.Tensor) -> None:
        want = (2, len(layers), len(block_ids), self.block_size, 1, 1)
        if kv.dtype != self.kv_dtype or tuple(kv.shape) != want:
            raise ValueError(f"KV of {kv.dtype} {list(kv.shape)} does not fit the mock engine's stand-in "
                             f"{self.kv_dtype} {list(want)}: is the other worker a mock too (--engine mock)?")

    # -- the step ------------------------------------------------------------------------------------------

    def run(self, batch: Batch, block_tables: list[list[int]]
            ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Each sampling request's tokens (one, and one after each draft), after the roofline's time for the
        step's shape has passed since the step began."""
        start = self.step_start if self.step_start is not None else time.perf_counter()
        self.step_start = None
        ids: list[int] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            ids += req.token_ids[req.num_computed_tokens:req.num_computed_tokens + n]
        self.execute(MockInputs(torch.tensor(ids, dtype=torch.long)))
        seconds = self.cost.seconds(batch.shape())
        self.roofline_seconds += seconds
        tokens, logprobs = [], []
        vocab = self.cfg.vocab_size
        for req, samples, drafts in zip(batch.requests, batch.samples, batch.drafts):
            if not samples:
                continue
            row, probs = [], []
            for j in range(len(drafts) + 1):
                position = req.num_tokens + j
                banned = self.banned
                if req.num_output_tokens + j < req.params.min_tokens and req.min_ban:
                    banned = banned | set(req.min_ban)
                row.append(mock_token(req.seed, position, vocab, banned))
                probs.append(self.logprobs(req, position, row[-1]))
            tokens.append(row)
            logprobs.append(probs)
        held = time.perf_counter()
        deadline = start + seconds
        if deadline > held:
            time.sleep(deadline - held)
        self.forward_seconds += max(deadline - held, 0.0)
        return tokens, logprobs

    def execute(self, inputs: MockInputs) -> None:
        """The model's forward: nothing (LLMEngine.inject_fault wraps it)."""
        return None

    def logprobs(self, req, position: int, token: int) -> TokenLogprobs | None:
        k = req.params.logprobs
        if k is None:
            return None
        chosen = mock_logprob(req.seed, position)
        top = [(token, chosen)] + [((token + i) % self.cfg.vocab_size, chosen - i) for i in range(1, k)]
        return TokenLogprobs(logprob=chosen, top=top[:k])

"""The GPU roofline: GPU presets, the efficiencies a step reaches, and the seconds a step of any shape takes
on a node of them. Pure arithmetic on a model's config (no torch), shared by `tokenbus plan` (ops/plan.py, which
adds a workload and SLOs), the fleet simulator (lab/capacity/cost.py) and the mock engine
(workers/engine/mock.py), which holds each step for the time given here.

A step takes the longer of its FLOPs at the cards' peak × MFU and its bytes (the weights once, every request's
KV) at their bandwidth × MBU, plus two all-reduces a layer when the node is tensor parallel.
"""
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    memory: float               # bytes
    bandwidth: float            # bytes/s
    flops: float                # dense 16-bit FLOP/s (CPU: measured, in the dtype planned)


GPUS = {                        # the vendors' datasheets: dense bf16 without sparsity
    "h100-sxm": Gpu("H100 SXM", 80 * GB, 3.35e12, 989e12),
    "h200": Gpu("H200", 141 * GB, 4.8e12, 989e12),
    "a100": Gpu("A100 80GB SXM", 80 * GB, 2.039e12, 312e12),
    "l4": Gpu("L4", 24 * GB, 0.3e12, 121e12),
}


@dataclass(slots=True)
class Efficiency:
    mfu: float = 0.5             # share of the peak FLOP/s a step reaches
    mbu: float = 0.7             # share of the bandwidth
    memory_utilization: float = 0.9
    allreduce_us: float = 10.0   # one all-reduce of a step, when TP > 1 (two a layer)
    target_utilization: float = 0.8   # of a node's capacity, at the peak


def parameters(cfg) -> int:
    """Every weight of a ModelConfig: the decoder's matmuls, the embedding, the LM head unless tied, the norms."""
    embed = cfg.vocab_size * cfg.hidden_size
    return cfg.matmul_params() + embed * (1 if cfg.tie_word_embeddings else 2) + (2 * cfg.num_layers + 1) * \
        cfg.hidden_size


class Roofline:
    """One replica of a model (a ModelConfig) on `tp` GPUs: its memory and what a step costs there."""

    def __init__(self, cfg, gpu: Gpu, tp: int = 1, eff: Efficiency | None = None, dtype_bytes: int = 2):
        self.cfg, self.gpu, self.tp, self.eff, self.bytes = cfg, gpu, tp, eff or Efficiency(), dtype_bytes

    def weight_bytes(self) -> float:
        return parameters(self.cfg) * self.bytes

    def kv_bytes_per_token(self) -> float:
        c = self.cfg
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.bytes

    def kv_per_node(self) -> float:
        """Bytes left for KV on the replica's GPUs: their memory × utilization − the weights."""
        return self.tp * self.gpu.memory * self.eff.memory_utilization - self.weight_bytes()

    def allreduces(self) -> float:
        return 2 * self.cfg.num_layers * self.eff.allreduce_us * 1e-6 if self.tp > 1 else 0.0


@dataclass(slots=True)
class StepShape:
    """A step's shape: five sums over the requests it runs (the scheduler's Batch)."""
    tokens: int = 0              # tokens computed
    rows: int = 0                # requests in the step
    sampled: int = 0             # rows that sample (prefill chunks short of the prompt's end do not), × (1 + drafts)
    attention: float = 0.0       # Σ over rows of new tokens × the keys each attends to (its context after the step)
    kv_read: int = 0             # Σ over rows of the context after the step

    def add(self, new_tokens: int, context: int, samples: int) -> None:
        self.tokens += new_tokens
        self.rows += 1
        self.sampled += samples
        self.attention += new_tokens * (context - (new_tokens - 1) / 2)
        self.kv_read += context


class RooflineCost:
    """A GPU node's step from a Roofline (or `tokenbus plan`'s Plan, one): FLOPs and bytes, whichever takes
    longer, plus the all-reduces."""

    def __init__(self, plan: Roofline):
        self.plan = plan
        c = plan.cfg
        self.name = f"roofline {plan.tp} × {plan.gpu.name}"
        self.flops_per_token = 2 * c.matmul_params()
        self.flops_per_pair = 4 * c.num_layers * c.num_heads * c.head_dim
        self.flops_per_sample = 2 * c.hidden_size * c.vocab_size
        self.weights = plan.weight_bytes()
        self.kv_per_token = plan.kv_bytes_per_token()
        self.flop_rate = plan.tp * plan.gpu.flops * plan.eff.mfu
        self.byte_rate = plan.tp * plan.gpu.bandwidth * plan.eff.mbu
        self.fixed = plan.allreduces()

    def seconds(self, s: StepShape) -> float:
        flops = self.flops_per_token * s.tokens + self.flops_per_pair * s.attention + self.flops_per_sample * s.sampled
        bytes_ = self.weights + self.kv_per_token * (s.kv_read + s.tokens)
        return max(flops / self.flop_rate, bytes_ / self.byte_rate) + self.fixed

"""What one engine step costs, for `tokenbus sim`: a function of the step's shape.

A step's shape is five sums over the requests it runs (the scheduler's Batch): the tokens it computes
(prefill chunks, one per decode, 1 + k when verifying k drafts), the requests, those that sample, the
attention work (Σ new tokens × the keys each sees) and the KV it reads (Σ context). Every cost model
here maps a shape to seconds:

- `RooflineCost`: a GPU node from `ops.plan.Plan` — the longer of the step's FLOPs at the card's peak
  × MFU and its bytes (the weights once, every request's KV) at its bandwidth × MBU, plus the
  tensor-parallel all-reduces. The same arithmetic as `tokenbus plan`'s steps, for any batch.
"""
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class StepShape:
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


class StepCost(Protocol):
    name: str

    def seconds(self, shape: StepShape) -> float: ...


class RooflineCost:
    """A GPU node's step from the plan's roofline (ops.plan): FLOPs and bytes, whichever takes longer."""

    def __init__(self, plan):
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

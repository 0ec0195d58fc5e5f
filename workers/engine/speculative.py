"""Speculative decoding in the one token budget, with outputs identical to decoding without it.

Each step, once the scheduler has planned the step's real work, the speculator picks k (the draft
tokens per request: the goodput model of spec_policy, from the batch, the measured acceptance and
the measured cost of steps of each size), asks the proposer for up to k tokens after each sampling
request that has not opted out, and schedules them as extra tokens of the same step with what the
budget and the uncached free blocks leave (Scheduler.add_drafts). The step samples a token after
each draft exactly as it would once the drafts before it were the request's own tokens: the
sampler's randomness is a function of (seed, output position, token id), and a token's logits are
the same bits in a verify step as in a one-token step (tests/workers/test_batch_invariance.py). A
draft is kept iff it equals the token the model samples there, so the output is token for token
the output without speculation, greedy or sampled; the KV of rejected drafts is rolled back.
"""
import argparse
import bisect
import math
import os
import time
from dataclasses import dataclass

from workers.engine.proposers import NgramProposer, Proposer
from workers.engine.request import Request
from workers.engine.scheduler import Batch, Scheduler
from workers.engine.spec_policy import Acceptance, choose_k

METHODS = ("ngram", "draft")
PROBE_EVERY = 32        # steps between probes while speculation is off for low acceptance


@dataclass(slots=True)
class SpeculativeConfig:
    method: str                            # "ngram" (prompt lookup) | "draft" (a smaller checkpoint)
    num_speculative_tokens: int = 4        # k at most
    model: str | None = None               # the draft checkpoint (method "draft"): same tokenizer as the target
    prompt_lookup_min: int = 2             # ngram: the shortest n-gram matched
    prompt_lookup_max: int = 4             # ngram: the longest n-gram matched
    adaptive: bool = True                  # k chosen each step by the goodput model; off: always k
    draft_num_kv_blocks: int | None = None  # the draft model's KV pool (default: as many blocks as the target's)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], not {self.num_speculative_tokens!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs a model: the draft checkpoint's directory or GGUF file")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be at least 1 and at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                return cls.parse(value)
            except ValueError as e:
                raise ValueError(f"speculative {value!r}: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a dict, a string such as 'ngram:4', or None, not {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**value)

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        """'ngram', 'ngram:K', 'draft:DIR' or 'draft:DIR:K' (the command lines' --speculative); the
        ValueError says what is wrong, the caller names the flag or field."""
        method, _, rest = text.partition(":")
        if method == "ngram":
            return cls("ngram", **({"num_speculative_tokens": parse_k(rest)} if rest else {}))
        if method == "draft":
            model, k = rest, None
            head, sep, tail = rest.rpartition(":")
            if sep and tail.isdigit():
                model, k = head, parse_k(tail)
            return cls("draft", model=model or None, **({"num_speculative_tokens": k} if k is not None else {}))
        raise ValueError("expected ngram[:K] or draft:DIR[:K]")


def parse_k(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"K must be a whole number of draft tokens, not {text!r}")
    return int(text)


def argument(text: str) -> str:
    """A --speculative value (the worker's, and what `tokenbus up` passes every worker), refused as
    argparse does naming the flag; a draft checkpoint's directory made absolute, so that a worker
    started from another directory loads the same one."""
    try:
        config = SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if config.method == "draft":
        return f"draft:{os.path.abspath(config.model)}:{config.num_speculative_tokens}"
    return text


class StepCost:
    """The measured seconds of a step by its token count: an exponential moving average per bucket
    (four per octave), read between buckets by linear interpolation; below the smallest measured
    bucket a step costs what that one does (memory-bound), above the largest it costs in proportion
    to its tokens (compute-bound: the pessimistic guess). Nothing measured: every step costs 1."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self.points: dict[int, list[float]] = {}     # bucket -> [mean tokens, mean seconds]
        self.curve: list[list[float]] | None = None  # the points by tokens, sorted once per observation

    def observe(self, tokens: int, seconds: float) -> None:
        bucket = round(4 * math.log2(max(tokens, 1)))
        self.curve = None
        point = self.points.get(bucket)
        if point is None:
            self.points[bucket] = [float(tokens), seconds]
        else:
            point[0] += self.weight * (tokens - point[0])
            point[1] += self.weight * (seconds - point[1])

    def __call__(self, tokens: int) -> float:
        if not self.points:
            return 1.0
        if self.curve is None:
            self.curve = sorted(self.points.values())
        points = self.curve
        i = bisect.bisect_left(points, tokens, key=lambda p: p[0])
        if i == 0:
            return points[0][1]
        if i == len(points):
            last = points[-1]
            return last[1] * tokens / last[0]
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0) if x1 > x0 else y1


class Speculator:
    """Chooses k, drafts, and keeps the counts (see the module doc)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.acceptance = Acceptance()
        self.cost = StepCost()
        self.draft_cost = StepCost()      # a proposer's own seconds per draft token step, by rows
        self.k = config.num_speculative_tokens
        self.rows = 0                     # the inputs of the last choice: requests that could draft
        self.steps_off = 0
        self.drafts = 0                   # requests' verify steps with at least one draft
        self.draft_tokens = 0

    def draft(self, batch: Batch, scheduler: Scheduler) -> None:
        """Adds draft tokens to the step's sampling requests (those that may speculate)."""
        rows = [i for i, (req, samples) in enumerate(zip(batch.requests, batch.samples))
                if samples and req.params.speculative and not req.isolate and room(req, self.max_model_len) > 0
                and req.num_output_tokens >= req.params.min_tokens]     # min_tokens' ban is one row's, not k's
        self.rows = len(rows)
        if not rows:
            return                       # k stays the last choice: nothing to choose for
        self.k = self.choose(batch, len(rows))
        if self.k == 0:
            return
        reqs = [batch.requests[i] for i in rows]
        ks = [min(self.k, room(r, self.max_model_len)) for r in reqs]
        start = time.perf_counter()
        proposals = self.proposer.propose(reqs, ks)
        if any(proposals):
            self.draft_cost.observe(len(rows), (time.perf_counter() - start) / self.k)
        for i, drafts in zip(rows, proposals):
            if drafts:
                scheduler.add_drafts(batch, i, drafts)

    def choose(self, batch: Batch, rows: int) -> int:
        k_max = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k_max
        base = batch.num_tokens
        other = sum(batch.samples) - rows

        def cost(k: int) -> float:
            return self.cost(base + rows * k) + (k * self.draft_cost(rows) if k and self.draft_cost.points else 0.0)

        k = choose_k(rows, self.acceptance.rate, k_max, cost, other=other)
        if k == 0 and choose_k(rows, 1.0, k_max, cost, other=other) > 0:   # off for acceptance alone:
            self.steps_off += 1                                             # probe now and then
            if self.steps_off % PROBE_EVERY == 0:
                return 1
        return k

    def observe(self, batch: Batch, seconds: float) -> None:
        """After a step: its cost by its token count, and what its drafts came to."""
        self.cost.observe(batch.num_tokens, seconds)
        for drafts, accepted in zip(batch.drafts, batch.num_accepted):
            if drafts:
                self.drafts += 1
                self.draft_tokens += len(drafts)
                self.acceptance.update(len(drafts), accepted)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

    def stats(self) -> dict:
        a = self.acceptance
        return {
            "spec_method": self.config.method,
            "spec_k": self.k,
            "spec_k_max": self.config.num_speculative_tokens,
            "spec_adaptive": self.config.adaptive,
            "spec_rows": self.rows,
            "spec_acceptance_estimate": round(a.rate, 4),
            "spec_drafts": self.drafts,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": a.accepted,
            "spec_acceptance_rate": round(a.accepted / a.drafted, 4) if a.drafted else 0.0,
            "spec_mean_acceptance_length": round(a.mean_length, 4),
            "spec_acceptance_per_position": [round(kept / seen, 4) if seen else 0.0 for kept, seen in a.per_position],
        }


def room(req: Request, max_model_len: int) -> int:
    """Draft tokens req can still use: each accepted one and the model's token after them must fit
    under max_tokens and the context."""
    return min(req.params.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens) - 1


def build(config: SpeculativeConfig, target, max_model_len: int) -> Speculator:
    """The speculator for an engine (`target`: its LLMEngine, whose device, dtype and pool the draft
    model's runner follows)."""
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from workers.engine.draft import DraftModelProposer
        proposer = DraftModelProposer(config, target)
    return Speculator(config, proposer, max_model_len)

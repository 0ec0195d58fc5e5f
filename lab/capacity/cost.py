"""What one engine step costs, for `tokenbus sim`: a function of the step's shape.

A step's shape is five sums over the requests it runs (the scheduler's Batch): the tokens it computes
(prefill chunks, one per decode, 1 + k when verifying k drafts), the requests, those that sample, the
attention work (Σ new tokens × the keys each sees) and the KV it reads (Σ context). Every cost model
here maps a shape to seconds:

- `RooflineCost`: a GPU node from `ops.plan.Plan` (a `workers.engine.roofline.Roofline`) — the longer of the
  step's FLOPs at the card's peak × MFU and its bytes (the weights once, every request's KV) at its bandwidth
  × MBU, plus the tensor-parallel all-reduces. The same arithmetic as `tokenbus plan`'s steps, for any batch,
  and the mock engine's (it and `StepShape` live in workers/engine/roofline.py, which the worker may import).
- `FittedCost`: this machine's CPU — a constant plus nonnegative seconds per unit of each field, and
  seconds of their own for steps of few tokens, fitted to the real engine's steps of many shapes (`fit`),
  cached under $TOKENBUS_HOME/sim (`load_or_fit`).
"""
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from workers.engine.roofline import RooflineCost, StepShape

__all__ = ["FEATURES", "FittedCost", "RooflineCost", "StepCost", "StepShape", "fit", "load_or_fit", "measure"]

FEATURES = ("tokens", "rows", "sampled", "attention", "kv_read")
HELD_OUT = 0.25                  # of the measured steps, kept out of the fit to judge it
SPIKE = 1.5                      # a step this many times slower than the first fit says was slowed by a neighbour
SMALL = 16                       # steps of up to this many tokens get seconds of their own (`FittedCost.small_s`)
SCENARIOS = 3                    # the version of `scenarios` and `fit`: a cached fit of another is measured again


class StepCost(Protocol):
    name: str

    def seconds(self, shape: StepShape) -> float: ...


@dataclass(slots=True)
class FittedCost:
    """Seconds = const + Σ coef[f] × shape.f over FEATURES + small_s[tokens − 1] for a step of up to SMALL
    tokens. Every coefficient is ≥ 0 (more work of one kind never makes a step cheaper); small_s, of either
    sign, are the CPU's matrix kernels, which change with the rows they multiply: on one machine (MKL,
    AVX-512, 1 thread) SmolLM2's decode of 1 or 2 requests took 54-59 ms and of 3 to 6 requests 39-48 ms,
    which no sum of the fields can say. `quality`: R², median and p90 relative error on held-out steps."""
    name: str
    const: float
    coef: dict[str, float]
    quality: dict
    small_s: list[float] = field(default_factory=list)

    def seconds(self, s: StepShape) -> float:
        own = self.small_s[s.tokens - 1] if 0 < s.tokens <= len(self.small_s) else 0.0
        return self.const + sum(c * getattr(s, f) for f, c in self.coef.items()) + own

    def to_json(self) -> dict:
        return asdict(self)


def features(shapes: list[StepShape]) -> np.ndarray:
    return np.array([[1.0, *(float(getattr(s, f)) for f in FEATURES)] for s in shapes])


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray, free: int = 0) -> np.ndarray:
    """Least squares of relative error (rows weighted 1/y) with coefficients ≥ 0 but the last `free`: the
    most negative of the others is dropped and the rest solved again until none of them is negative."""
    w = x / y[:, None]
    scale = np.abs(w).max(axis=0)
    scale[scale == 0] = 1.0
    active, bound = list(range(x.shape[1])), x.shape[1] - free
    while True:
        sol = np.linalg.lstsq(w[:, active] / scale[active], np.ones(len(y)), rcond=None)[0] / scale[active]
        signed = [v if i < bound else 0.0 for i, v in zip(active, sol)]
        if min(signed) >= 0:
            coef = np.zeros(x.shape[1])
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(signed)))


def quality(predicted: np.ndarray, actual: np.ndarray) -> dict:
    rel = np.abs(predicted - actual) / actual
    r2 = 1 - ((predicted - actual) ** 2).sum() / ((actual - actual.mean()) ** 2).sum()
    return {"r2": round(float(r2), 4), "median_rel_error": round(float(np.median(rel)), 4),
            "p90_rel_error": round(float(np.percentile(rel, 90)), 4), "held_out_steps": len(actual)}


def fit(name: str, steps: list[tuple[StepShape, float]], seed: int = 0) -> FittedCost:
    """The cost fitted to (shape, seconds) of measured steps, judged on a random HELD_OUT share of them. Each
    size of step up to SMALL tokens with 3 fitted steps at least gets seconds of its own, solved with the
    rest; a size between two such gets theirs linearly, one past the largest towards 0 at SMALL + 1."""
    rng = random.Random(seed)
    held = set(rng.sample(range(len(steps)), round(len(steps) * HELD_OUT)))
    tokens = np.array([s.tokens for s, _ in steps])
    train = np.array([i not in held for i in range(len(steps))])
    sizes = [m for m in range(1, SMALL + 1) if (train & (tokens == m)).sum() >= 3]
    x = np.hstack([features([s for s, _ in steps]), (tokens[:, None] == np.array(sizes)[None, :]).astype(float)])
    y = np.array([t for _, t in steps])
    c = nonnegative_lstsq(x[train], y[train], len(sizes))
    calm = train & (y < SPIKE * (x @ c))        # noise on a shared machine only ever slows a step
    c = nonnegative_lstsq(x[calm], y[calm], len(sizes))
    linear = c[:len(FEATURES) + 1]
    small = [round(float(np.interp(m, [*sizes, SMALL + 1], [*c[len(linear):], 0.0])), 6)
             for m in range(1, SMALL + 1)] if sizes else []
    cost = FittedCost(name, float(linear[0]), {f: float(v) for f, v in zip(FEATURES, linear[1:])}, {}, small)
    cost.quality = {**quality(np.array([cost.seconds(s) for s, _ in steps])[~train], y[~train]),
                    "steps": len(steps), "spikes_dropped": int(train.sum() - calm.sum())}
    return cost


# -- measuring the engine ---------------------------------------------------------------------------------

def scenarios(rng: random.Random, vocab: int, big: bool) -> list[list[tuple[int, list[int], int]]]:
    """Runs of (step to add at, prompt, max_tokens) whose steps cover the shapes a stack meets: prefills
    of one prompt and of several, decode batches of several sizes and contexts, prefills among decodes,
    and prompts whose head is cached (a chat's next turn: a few new tokens that attend to a long
    context; fitted on fresh prompts alone, attention and tokens grow together and the fit cannot
    tell them apart)."""
    tokens = lambda n: [rng.randrange(16, vocab) for _ in range(n)]  # noqa: E731
    runs = [[(0, tokens(n), 2)] for n in (8, 32, 128, 512, 1024, 2048)]
    runs += [[(0, tokens(n), 2) for _ in range(k)] for n, k in ((64, 8), (256, 4), (512, 3))]
    for batch in (1, 4, 16, 48) if big else (1, 4, 16, 64, 128):
        for context in (32, 256, 1024):
            if batch * context <= (12_000 if big else 40_000):
                runs.append([(0, tokens(context + rng.randrange(8)), 12) for _ in range(batch)])
    for head_len, news in ((128, (16, 48, 96, 200)), (512, (16, 64, 160)), (1024 if big else 1536, (32, 96))):
        head = tokens(head_len)
        runs.append([(0, head, 2)] + [(4 + 2 * i, head + tokens(n), 6) for i, n in enumerate(news)])
    for _ in range(3):
        at, run = 0, []
        while at < 150:
            run.append((at, tokens(rng.choice((16, 64, 200, 700))), rng.randint(4, 40)))
            at += rng.randint(0, 6)
        runs.append(run)
    return runs


def measure(model_dir: str, threads: int, dtype: str | None = None, seed: int = 0) -> tuple[str, list]:
    """The engine's dtype and (shape, seconds) of every step of `scenarios` on this CPU with `threads`
    torch threads, after a warm-up run; greedy, EOS ignored, prefix cache cold for each run."""
    import torch

    from schemas.sampling import SamplingParams
    from workers.engine.engine import EngineConfig, LLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = LLMEngine(model_dir, EngineConfig(dtype=dtype, device="cpu", num_kv_blocks=6000,
                                                    max_num_batched_tokens=2048, max_num_seqs=128))
        params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
        big = engine.model_cfg.matmul_params() > 50e6
        runs = scenarios(random.Random(seed), engine.model_cfg.vocab_size, big)
        steps = []
        for k, run in enumerate([runs[0], *runs]):
            engine.kv.reset_prefix_cache()
            engine.trace, pending, step = [], sorted(run, key=lambda r: r[0]), 0
            while pending or engine.has_unfinished():
                while pending and pending[0][0] <= step:
                    _, prompt, n = pending.pop(0)
                    engine.add_request(f"m{k}-{step}-{len(pending)}", prompt, params(n))
                engine.step()
                step += 1
            if k:                                # run 0 warms up
                steps += [(StepShape(t.num_tokens, t.num_requests, t.num_sampled, t.attention, t.kv_read), t.seconds)
                          for t in engine.trace]
        return str(engine.dtype).removeprefix("torch."), steps
    finally:
        torch.set_num_threads(before)


def cache_path(model_dir: str, dtype: str, threads: int) -> Path:
    from workers.models.builder import tokenbus_home

    return tokenbus_home() / "sim" / f"{Path(model_dir).name}-{dtype}-{threads}t-v{SCENARIOS}.json"


def load_or_fit(model: str, threads: int, dtype: str | None = None, refit: bool = False) -> FittedCost:
    """The CPU cost of `model` (a name or checkpoint directory) at `threads` torch threads: the cached fit,
    or a new one measured on this machine and cached (keyed by model, dtype and threads)."""
    import torch

    from workers.engine.engine import pick_dtype
    from workers.models.catalogue import resolve

    model_dir = resolve(model)
    want = dtype or str(pick_dtype(None, "float32", torch.device("cpu"))).removeprefix("torch.")   # the default
    path = cache_path(model_dir, want, threads)
    if path.exists() and not refit:
        return FittedCost(**json.loads(path.read_text()))
    got, steps = measure(model_dir, threads, dtype)
    cost = fit(f"cpu {Path(model_dir).name} {got} {threads}t", steps)
    path = cache_path(model_dir, got, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cost.to_json(), indent=1))
    return cost

"""How to sample each output token and when to stop: validated where a request enters (the gateway)
and again where it runs (the engine), so it is part of the wire format."""
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """How to pick each output token and when to stop. temperature 0 is greedy; top_k 0 (or -1)
    and top_p 1 and min_p 0 disable those filters; `seed` fixes the randomness (without one the
    engine draws a seed when the request is added, so every request's randomness is still a
    pure function of its seed and output position)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to return beside the sampled token
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        if self.top_k == -1:
            self.top_k = 0
        check(self.max_tokens >= 1, "max_tokens", "must be at least 1", self.max_tokens)
        check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        check(self.top_k >= 0, "top_k", "must be >= 1, or 0 / -1 to disable", self.top_k)
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]", self.logprobs)
        check(all(s for s in self.stop), "stop", "must not contain an empty string", self.stop)
        check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def check(ok: bool, field: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{field} {rule} (got {value!r})")

"""How many speculative tokens a step asks for: an explicit goodput model.

With k draft tokens per request and a per-token acceptance rate a (each draft token accepted with
probability a, given the ones before it were), a verify step yields on average
1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens per request: the accepted drafts and the
target's own token after them. It costs a step of B * (1 + k) tokens instead of B (and, for a draft
model, its k forwards). The policy
picks the k in [0, k_max] with the most tokens per second by the measured cost of a step, and
0 (speculation off) unless some k beats no speculation by `margin`. At batch 1 a step is
memory-bound (k more tokens cost little) and speculation pays; at a large batch the step is
compute-bound (k more tokens per request cost nearly k times more) and it does not.
"""
from collections.abc import Callable
from dataclasses import dataclass, field


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a request gains per verify step with k drafts at this per-token acceptance."""
    a = min(max(acceptance, 0.0), 1.0)
    return k + 1.0 if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_k(rows: int, acceptance: float, k_max: int, step_seconds: Callable[[int], float],
             margin: float = 0.05, other: int = 0) -> int:
    """The number of draft tokens per request with the best expected tokens per second for a step
    where `rows` requests may draft and `other` sampling requests do not, `step_seconds(k)` being
    the measured cost of that step with k drafts per drafting request; 0 unless it beats no
    speculation by `margin`."""
    if rows <= 0 or k_max <= 0:
        return 0
    base = (rows + other) / step_seconds(0)
    best, best_rate = 0, base * (1.0 + margin)
    for k in range(1, k_max + 1):
        rate = (other + rows * expected_tokens(acceptance, k)) / step_seconds(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass(slots=True)
class Acceptance:
    """The per-token acceptance rate, an exponential moving average over verified drafts (a prior of
    `initial` until some are seen), and its counters for metrics."""
    initial: float = 0.6
    weight: float = 0.05                 # of each new draft token
    rate: float = field(init=False)
    drafted: int = 0
    accepted: int = 0
    per_position: list[list[int]] = field(default_factory=list)   # [accepted, verified] at draft position i

    def __post_init__(self) -> None:
        self.rate = self.initial

    def update(self, drafted: int, accepted: int) -> None:
        """One request's verify step: `drafted` tokens proposed, the first `accepted` of them kept."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted ({accepted}) must be between 0 and drafted ({drafted})")
        self.drafted += drafted
        self.accepted += accepted
        while len(self.per_position) < drafted:
            self.per_position.append([0, 0])
        for i in range(min(drafted, accepted + 1)):   # the first rejection ends what was verified
            kept = i < accepted
            self.per_position[i][0] += kept
            self.per_position[i][1] += 1
            self.rate += self.weight * (float(kept) - self.rate)

    @property
    def mean_length(self) -> float:
        """Accepted draft tokens per verify step that drafted any (its metrics' mean acceptance
        length, without the target's own token)."""
        steps = self.per_position[0][1] if self.per_position else 0
        return self.accepted / steps if steps else 0.0

"""Speculative proposers: a guess of a request's next tokens, which the target model verifies in
the same step. A proposer only guesses; the engine decides how many tokens to ask for, schedules
them in the token budget and keeps those the target would have produced anyway.

`NgramProposer` is prompt lookup: the longest n-gram (n from `prompt_lookup_max` down to
`prompt_lookup_min`) that ends the sequence and occurred before in it (prompt or output), and the
tokens that followed its latest earlier occurrence. Each request keeps an index of its n-grams,
updated as tokens arrive, so a proposal costs O(prompt_lookup_max) lookups, not a scan of the
sequence.
"""
from dataclasses import dataclass, field
from typing import Protocol

from workers.engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """For each request, up to ks[i] tokens that may follow its tokens (fewer, or none, when there
        is no guess). A request's tokens only grow between calls, except that a request started again
        under its id (preempted, moved) may be a new sequence."""

    def forget(self, request_id: str) -> None:
        """The request has ended (finished, aborted or moved): drop what was kept for it."""


@dataclass(slots=True)
class NgramIndex:
    """For one sequence and each n in [low, high]: every n-gram that some token follows, mapped to
    the position of the token after its latest occurrence."""
    low: int
    high: int
    tokens: list[int] = field(default_factory=list)
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-grams of every n share it

    def extend(self, token_ids: list[int]) -> None:
        """Catch up with token_ids, of which self.tokens must be a prefix."""
        for t in token_ids[len(self.tokens):]:
            end = len(self.tokens)         # t is about to follow the n-grams ending here
            for n in range(self.low, min(self.high, end) + 1):
                self.latest[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(t)

    def lookup(self, k: int) -> list[int]:
        end = len(self.tokens)
        for n in range(min(self.high, end), self.low - 1, -1):
            start = self.latest.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) must be at least 1 and at most "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.low, self.high = prompt_lookup_min, prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [self.propose_one(r.request_id, r.token_ids, k) for r, k in zip(requests, ks)]

    def propose_one(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        index = self.indexes.get(request_id)
        if index is None or not extends(token_ids, index.tokens):
            index = self.indexes[request_id] = NgramIndex(self.low, self.high)
        index.extend(token_ids)
        return index.lookup(k) if k > 0 else []

    def forget(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)


def extends(token_ids: list[int], seen: list[int]) -> bool:
    """Whether token_ids goes on from seen. A request's tokens only grow, so the length and the last
    seen token tell it (a request started again under the same id fails one or the other, or is
    the same sequence)."""
    n = len(seen)
    return len(token_ids) >= n and (n == 0 or token_ids[n - 1] == seen[-1])

"""The n-gram proposer (prompt lookup) against a plain scan of the sequence: the longest n-gram that
ends the sequence and occurred before, the tokens after its latest earlier occurrence."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.proposers import NgramProposer


def scan(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The reference: every n from high down to low, every earlier start from the latest back."""
    end = len(tokens)
    for n in range(min(high, end), low - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_longest_match():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # "5 6 7" (n=3) occurred at 0..2, followed by 8 1 6; "6 7" also at 5..6 (more recent, shorter)
    assert p.propose_one("a", seq, 3) == [8, 1, 6]
    assert p.propose_one("a", seq, 10) == [8, 1, 6, 7, 9, 5, 6, 7]      # up to the end of the sequence


def test_a_shorter_match_when_the_longer_never_occurred_and_nothing_without_one():
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    assert p.propose_one("a", [1, 2, 3, 9, 9, 2, 3], 2) == [9, 9]      # "2 3" only
    assert p.propose_one("b", [1, 2, 3, 4], 2) == []                    # no n-gram of 2+ repeats
    assert p.propose_one("c", [7], 2) == []
    assert p.propose_one("d", [1, 2, 1, 2], 0) == []


def test_a_repeating_pattern_proposes_its_own_continuation():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # "5 4 5" last occurred at 1..3, followed by 4 5 (the sequence's own end)
    assert p.propose_one("a", [4, 5, 4, 5, 4, 5], 4) == [4, 5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 3), st.integers(0, 2), st.integers(0, 6),
       st.lists(st.integers(1, 8), max_size=8))
def test_growing_a_sequence_step_by_step_proposes_what_a_scan_of_it_does(tokens, low, extra, k, steps):
    """The index kept across calls (as the engine calls it, a few tokens more each step) equals a
    scan of the whole sequence every time."""
    high = low + extra
    p = NgramProposer(low, high)
    seen = 0
    for step in [*steps, len(tokens)]:
        seen = min(len(tokens), seen + step)
        assert p.propose_one("r", tokens[:seen], k) == scan(tokens[:seen], low, high, k)


def test_a_request_started_again_under_its_id_is_indexed_afresh_and_forget_drops_it():
    p = NgramProposer(1, 2)
    assert p.propose_one("a", [1, 2, 3, 1, 2], 1) == [3]
    assert p.propose_one("a", [9, 8, 9], 1) == [8]                      # not a continuation: rebuilt
    p.forget("a")
    p.forget("never-seen")
    assert p.indexes == {}


def test_lookup_bounds_are_checked_and_named():
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(3\).*prompt_lookup_max \(2\)"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(0\)"):
        NgramProposer(0, 2)

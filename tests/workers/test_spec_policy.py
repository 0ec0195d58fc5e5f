"""The speculation policy's goodput model: on at batch 1 where a step is memory-bound, off at a
large batch where it is compute-bound, off when drafts are rarely accepted; the acceptance tracker
counts only what was verified."""
import pytest

from workers.engine.spec_policy import Acceptance, choose_k, expected_tokens


def cpu_like(tokens: int) -> float:
    """A step: a fixed weight read (30 ms) until compute takes over at ~64 tokens (0.5 ms a token)."""
    return max(0.030, 0.0005 * tokens)


def test_expected_tokens_is_the_geometric_sum_and_k_plus_one_when_every_draft_is_right():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def at(batch: int, cost=cpu_like):
    """The step cost with k drafts for each of `batch` requests."""
    return lambda k: cost(batch * (1 + k))


def test_speculation_is_on_at_batch_1_and_off_at_a_busy_batch():
    assert choose_k(1, 0.7, 6, at(1)) == 6                     # 7 tokens cost what 1 does
    assert choose_k(64, 0.7, 6, at(64)) == 0                   # every extra token is paid in full
    assert 0 < choose_k(16, 0.7, 6, at(16)) < 6                # in between: up to the knee


def test_speculation_is_off_when_drafts_are_rarely_right_even_at_batch_1():
    slow_verify = lambda tokens: 0.030 + 0.004 * tokens        # noqa: E731  verifying costs something
    assert choose_k(1, 0.05, 6, at(1, slow_verify)) == 0
    assert choose_k(1, 0.9, 6, at(1, slow_verify)) > 0


def test_requests_that_cannot_draft_count_in_the_step_but_gain_nothing():
    # one drafting request beside 63 that do not: the step is already compute-bound
    assert choose_k(1, 0.9, 4, lambda k: cpu_like(64 + k), other=63) == 0
    assert choose_k(1, 0.9, 4, lambda k: cpu_like(1 + k)) == 4


def test_nothing_to_choose_without_requests_or_drafts():
    assert choose_k(0, 0.9, 4, at(0)) == 0
    assert choose_k(4, 0.9, 0, at(4)) == 0


def test_acceptance_counts_positions_up_to_the_first_rejection():
    a = Acceptance(initial=0.5, weight=0.5)
    a.update(drafted=4, accepted=2)      # positions 0, 1 kept, 2 rejected, 3 never verified
    assert a.per_position == [[1, 1], [1, 1], [0, 1], [0, 0]]
    assert (a.drafted, a.accepted) == (4, 2)
    assert a.rate == pytest.approx(0.4375)                        # 0.5 -> 0.75 -> 0.875 -> 0.4375
    a.update(drafted=4, accepted=4)
    assert a.per_position == [[2, 2], [2, 2], [1, 2], [1, 1]]
    assert a.mean_length == 3.0
    with pytest.raises(ValueError, match=r"accepted \(5\) must be between 0 and drafted \(4\)"):
        a.update(drafted=4, accepted=5)

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.sampling import SamplingParams
from workers.engine.request import Request
from workers.engine.sampler import Sampler, exponentials, mix64

sampler = Sampler()


def make_request(prompt=(1, 2, 3), outputs=(), seed=0, **params) -> Request:
    prompt, outputs = list(prompt), list(outputs)
    return Request(request_id="r", token_ids=prompt + outputs, num_prompt_tokens=len(prompt),
                   params=SamplingParams(**params), seed=seed, block_size=16)


def random_logits(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def frequencies(tokens: list[int], vocab_size: int) -> torch.Tensor:
    counts = Counter(tokens)
    return torch.tensor([counts[j] for j in range(vocab_size)], dtype=torch.float64) / len(tokens)


def chi_square(observed: torch.Tensor, expected: torch.Tensor, draws: int) -> float:
    """Pearson's statistic over the tokens `expected` allows; inf if a disallowed token was drawn."""
    allowed = expected > 0
    if observed[~allowed].sum() > 0:
        return math.inf
    o, e = observed[allowed] * draws, expected[allowed] * draws
    return float(((o - e) ** 2 / e).sum())


def chi_square_limit(categories: int) -> float:
    """About the 0.9999 quantile of chi-square with categories - 1 degrees of freedom."""
    df = categories - 1
    return df + 6 * math.sqrt(2 * df)


def draw_many(logits_row: torch.Tensor, draws: int, **params) -> list[int]:
    """`draws` samples of one distribution in one batched call, one seed per row."""
    requests = [make_request(seed=s, **params) for s in range(draws)]
    tokens, _ = sampler(logits_row.expand(draws, -1), requests)
    return tokens


def penalized_reference(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    out = logits.clone()
    for row, r in zip(out, requests):
        p = r.params
        for t in set(r.prompt_token_ids + r.output_token_ids):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t, count in Counter(r.output_token_ids).items():
            row[t] = row[t] - p.presence_penalty
            row[t] = row[t] - p.frequency_penalty * count
    return out


def nucleus(probs: list[float], top_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda j: -probs[j])
    kept, mass = set(), 0.0
    for j in order:
        if mass >= top_p:
            break
        kept.add(j)
        mass += probs[j]
    return kept


# --- the hash -------------------------------------------------------------------------------

def splitmix64_reference(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


@given(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=50))
def test_mix64_in_int64_tensors_equals_unsigned_splitmix64(values):
    got = mix64(torch.tensor(values, dtype=torch.long)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [splitmix64_reference(v) for v in values]


def test_exponentials_have_unit_mean_and_variance_and_differ_by_seed_position_and_index():
    e = exponentials(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), torch.arange(100_000)[None])
    assert e.min() > 0
    for row in e:
        assert abs(row.mean().item() - 1) < 0.02 and abs(row.var().item() - 1) < 0.05
    assert abs(torch.corrcoef(e)[0, 1:]).max() < 0.02
    assert len(set(e[0].tolist())) > 99_000


# --- greedy and penalties -------------------------------------------------------------------

def test_greedy_equals_argmax_and_returns_python_ints():
    logits = random_logits(8, 50, seed=1)
    tokens, logprobs = sampler(logits, [make_request(temperature=0) for _ in range(8)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert all(type(t) is int for t in tokens)
    assert logprobs == [None] * 8


def test_greedy_takes_lowest_index_among_ties():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    assert sampler(logits, [make_request(temperature=0)])[0] == [1]


def test_greedy_on_bfloat16_logits_matches_float32():
    logits = random_logits(4, 300, seed=2).bfloat16()
    requests = [make_request(temperature=0) for _ in range(4)]
    assert sampler(logits, requests)[0] == logits.float().argmax(dim=-1).tolist()


penalties = st.fixed_dictionaries({
    "repetition_penalty": st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    "presence_penalty": st.sampled_from([0.0, -1.0, 0.7, 2.0]),
    "frequency_penalty": st.sampled_from([0.0, -0.5, 0.4, 2.0]),
})
token_lists = st.lists(st.integers(0, 19), max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(token_lists, token_lists, penalties), min_size=1, max_size=6), st.integers(0, 2**32))
def test_greedy_with_penalties_equals_per_row_reference(rows, logits_seed):
    requests = [make_request(prompt, outputs, temperature=0, **p) for prompt, outputs, p in rows]
    logits = random_logits(len(requests), 20, logits_seed)
    expected = penalized_reference(logits, requests)
    tokens, _ = sampler(logits, requests)
    assert tokens == expected.argmax(dim=-1).tolist()


def test_penalties_change_the_greedy_choice_as_specified():
    logits = torch.tensor([[3.0, 2.9, -1.0, 2.8]] * 4)
    requests = [
        make_request(prompt=[0], temperature=0, repetition_penalty=1.1),        # 3/1.1 < 2.9 -> 1
        make_request(prompt=[0], temperature=0, presence_penalty=1.0),          # prompt only: stays 0
        make_request(prompt=[2], outputs=[0], temperature=0, presence_penalty=0.15),  # 2.85 < 2.9 -> 1
        make_request(prompt=[2], outputs=[0, 0], temperature=0, frequency_penalty=0.06),  # 2.88 < 2.9 -> 1
    ]
    assert sampler(logits, requests)[0] == [1, 0, 1, 1]


def test_penalties_leave_the_callers_logits_unchanged():
    logits = random_logits(2, 20, seed=3)
    before = logits.clone()
    sampler(logits, [make_request(outputs=[4, 4], temperature=0, repetition_penalty=2.0,
                                  frequency_penalty=1.0, logprobs=2)] * 2)
    assert torch.equal(logits, before)


# --- seeded sampling ------------------------------------------------------------------------

def test_seeded_sampling_reproduces():
    logits = torch.zeros(1, 1000)
    draws = [sampler(logits, [make_request(seed=42, outputs=[7] * 5)])[0] for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]


def test_different_positions_and_seeds_give_different_draws():
    logits = torch.zeros(100, 1000)  # uniform: 100 independent draws repeat ~5 tokens
    by_position, _ = sampler(logits, [make_request(seed=42, outputs=[7] * n) for n in range(100)])
    by_seed, _ = sampler(logits, [make_request(seed=s, outputs=[7] * 3) for s in range(100)])
    assert len(set(by_position)) > 85
    assert len(set(by_seed)) > 85
    assert by_position != by_seed


sampling_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7]),
    "top_k": st.sampled_from([0, 1, 5, 40]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "min_p": st.sampled_from([0.0, 0.05, 0.3]),
    "repetition_penalty": st.sampled_from([1.0, 1.2]),
    "frequency_penalty": st.sampled_from([0.0, 0.5]),
    "logprobs": st.sampled_from([None, 0, 3]),
})


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), position=st.integers(0, 40), params=sampling_params,
       others=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 40), sampling_params), max_size=7),
       row=st.integers(0, 7), logits_seed=st.integers(0, 2**32))
def test_request_draws_the_same_token_alone_and_at_any_row_of_any_batch(seed, position, params, others, row,
                                                                        logits_seed):
    vocab_size = 64
    request = make_request(outputs=[5] * position, seed=seed, **params)
    alone, alone_logprobs = sampler(random_logits(1, vocab_size, logits_seed), [request])
    row = min(row, len(others))
    requests = [make_request(outputs=[9] * p, seed=s, **ps) for s, p, ps in others]
    requests.insert(row, request)
    logits = random_logits(len(requests), vocab_size, logits_seed + 1)
    logits[row] = random_logits(1, vocab_size, logits_seed)[0]
    tokens, logprobs = sampler(logits, requests)
    assert tokens[row] == alone[0]
    assert logprobs[row] == alone_logprobs[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_match_cpu_draws():
    seeds, positions = torch.tensor([0, 1, 2**63 - 1]), torch.tensor([0, 17, 4000])
    cpu = exponentials(seeds, positions, torch.arange(50_000)[None])
    cuda = exponentials(seeds.cuda(), positions.cuda(), torch.arange(50_000, device="cuda")[None]).cpu()
    assert torch.allclose(cpu, cuda, rtol=1e-6, atol=0)
    requests = [make_request(seed=s, outputs=[1] * 3, temperature=0.9, top_p=0.8) for s in range(64)]
    logits = random_logits(64, 1000, seed=5)
    assert sampler(logits, requests)[0] == sampler(logits.cuda(), requests)[0]


# --- filters never leave their set ----------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 2**32))
def test_top_k_never_leaves_the_top_k(top_k, temperature, logits_seed):
    logits = random_logits(64, 100, logits_seed)
    tokens, _ = sampler(logits, [make_request(seed=s, temperature=temperature, top_k=top_k) for s in range(64)])
    top = logits.topk(top_k, dim=-1).indices.tolist()
    assert all(t in allowed for t, allowed in zip(tokens, top))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([0.05, 0.3, 0.6, 0.9]), st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 2**32))
def test_top_p_never_picks_outside_the_nucleus(top_p, temperature, logits_seed):
    logits = random_logits(64, 100, logits_seed)
    tokens, _ = sampler(logits, [make_request(seed=s, temperature=temperature, top_p=top_p) for s in range(64)])
    probs = (logits.double() / temperature).softmax(dim=-1).tolist()
    for t, row in zip(tokens, probs):
        assert t in nucleus(row, top_p + 1e-5)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([0.01, 0.1, 0.5, 0.9]), st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 2**32))
def test_min_p_never_picks_below_the_threshold(min_p, temperature, logits_seed):
    logits = random_logits(64, 100, logits_seed)
    tokens, _ = sampler(logits, [make_request(seed=s, temperature=temperature, min_p=min_p) for s in range(64)])
    probs = (logits.double() / temperature).softmax(dim=-1)
    chosen = probs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert (chosen >= min_p * probs.max(dim=-1).values * (1 - 1e-5)).all()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = random_logits(32, 100, seed=6)
    argmax = logits.argmax(dim=-1).tolist()
    assert sampler(logits, [make_request(seed=s, top_k=1) for s in range(32)])[0] == argmax
    assert sampler(logits, [make_request(seed=s, top_p=1e-9) for s in range(32)])[0] == argmax
    assert sampler(logits, [make_request(seed=s, min_p=1.0) for s in range(32)])[0] == argmax


# --- statistics -----------------------------------------------------------------------------

DRAWS = 20_000
STAT_LOGITS = torch.linspace(1.5, -1.5, 16)


def test_sampled_frequencies_match_softmax_of_logits_over_temperature():
    observed = frequencies(draw_many(STAT_LOGITS, DRAWS, temperature=0.5), 16)
    right = (STAT_LOGITS.double() / 0.5).softmax(dim=-1)
    wrong = STAT_LOGITS.double().softmax(dim=-1)  # what a sampler ignoring temperature would give
    assert chi_square(observed, right, DRAWS) < chi_square_limit(16)
    assert chi_square(observed, wrong, DRAWS) > 10 * chi_square_limit(16)


def test_frequencies_over_positions_of_one_seed_match_softmax():
    draws = 3000
    logits = torch.linspace(1.0, -1.0, 8)
    requests = [make_request(outputs=[3] * n, seed=7, temperature=0.8) for n in range(draws)]
    tokens, _ = sampler(logits.expand(draws, -1), requests)
    expected = (logits.double() / 0.8).softmax(dim=-1)
    assert chi_square(frequencies(tokens, 8), expected, draws) < chi_square_limit(8)


def padded(vocab_size: int) -> torch.Tensor:
    """STAT_LOGITS followed by tokens too unlikely to matter: a large vocabulary takes the sampler's
    top-candidates path, a vocabulary of 16 its full sort."""
    return torch.cat((STAT_LOGITS, torch.full((vocab_size - 16,), -40.0)))


@pytest.mark.parametrize("vocab_size", [16, 4096])
def test_top_k_frequencies_match_the_renormalized_top_k(vocab_size):
    tokens = draw_many(padded(vocab_size), DRAWS, temperature=1.0, top_k=5)
    assert max(tokens) < 16
    observed = frequencies(tokens, 16)
    expected = torch.zeros(16, dtype=torch.float64)
    expected[:5] = STAT_LOGITS[:5].double().softmax(dim=-1)
    assert chi_square(observed, expected, DRAWS) < chi_square_limit(5)
    assert chi_square(observed, STAT_LOGITS.double().softmax(dim=-1), DRAWS) > 10 * chi_square_limit(16)


@pytest.mark.parametrize("vocab_size", [16, 4096])
def test_top_p_frequencies_match_the_renormalized_nucleus(vocab_size):
    probs = STAT_LOGITS.double().softmax(dim=-1)
    kept = nucleus(probs.tolist(), 0.6)
    assert kept == set(range(len(kept))) and 2 < len(kept) < 15
    expected = torch.zeros(16, dtype=torch.float64)
    expected[:len(kept)] = probs[:len(kept)] / probs[:len(kept)].sum()
    tokens = draw_many(padded(vocab_size), DRAWS, temperature=1.0, top_p=0.6)
    assert max(tokens) < 16
    observed = frequencies(tokens, 16)
    assert chi_square(observed, expected, DRAWS) < chi_square_limit(len(kept))


def test_min_p_then_top_p_applies_top_p_to_the_min_p_survivors():
    probs = (STAT_LOGITS.double() / 0.7).softmax(dim=-1)
    survivors = probs >= 0.2 * probs.max()
    renormalized = torch.where(survivors, probs, 0) / probs[survivors].sum()
    kept = nucleus(renormalized.tolist(), 0.8)
    expected = torch.zeros(16, dtype=torch.float64)
    expected[list(kept)] = renormalized[list(kept)] / renormalized[list(kept)].sum()
    assert survivors.sum() > len(kept) > 2
    observed = frequencies(draw_many(STAT_LOGITS, DRAWS, temperature=0.7, min_p=0.2, top_p=0.8), 16)
    assert chi_square(observed, expected, DRAWS) < chi_square_limit(len(kept))


# --- logprobs -------------------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_with_a_sorted_top_list_of_the_requested_length():
    logits = random_logits(4, 200, seed=8)
    requests = [
        make_request(outputs=[1, 2, 2], seed=1, temperature=0.7, top_k=10, repetition_penalty=1.5,
                     presence_penalty=1.0, logprobs=5),
        make_request(temperature=0, frequency_penalty=2.0, outputs=[3], logprobs=20),
        make_request(seed=2, logprobs=0),
        make_request(seed=3),
    ]
    tokens, logprobs = sampler(logits, requests)
    expected = logits.log_softmax(dim=-1)
    for row, n in enumerate([5, 20, 0]):
        lp = logprobs[row]
        assert lp.logprob == pytest.approx(expected[row, tokens[row]].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == expected[row].topk(n).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(expected[row].topk(n).values.tolist(), abs=1e-5)
        assert len(lp.top) == n
        assert all(type(t) is int for t, _ in lp.top)
    assert logprobs[3] is None


def test_logprobs_of_bfloat16_logits_are_computed_in_float32():
    logits = random_logits(1, 200, seed=9).bfloat16()
    tokens, logprobs = sampler(logits, [make_request(temperature=0, logprobs=3)])
    expected = logits.float().log_softmax(dim=-1)[0]
    assert logprobs[0].logprob == pytest.approx(expected[tokens[0]].item(), abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([0.5, 8.0]))
def test_the_top_candidates_path_equals_filtering_the_full_sort(seed, sharpness):
    import workers.engine.sampler as sampler

    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randn(12, 4096, generator=gen) * sharpness).softmax(dim=-1)
    top_k = torch.tensor([4096, 5, 300, 4096, 1, 4096, 256, 4096, 4096, 40, 4096, 4096])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.8, 1.0, 0.3, 0.99, 0.95, 0.7, 0.95, 0.2, 0.6])
    full = sampler.filter_sorted(probs, top_k, top_p)
    values, ids, fits = sampler.filter_candidates(probs, top_k, top_p)
    fast = torch.zeros_like(probs).scatter_(1, ids, values)
    torch.testing.assert_close(fast[fits], full[fits], rtol=0, atol=0)
    assert bool(fits.all()) == (sharpness > 1)   # peaked rows fit the candidates, flat ones do not


def test_logit_bias_adds_to_the_logits_of_its_own_row_only():
    logits = random_logits(3, 50, seed=8)
    top = logits.argmax(dim=-1).tolist()
    requests = [make_request(temperature=0, logit_bias={top[0]: -100}),           # bans row 0's argmax
                make_request(temperature=0),
                make_request(temperature=0, logit_bias={"7": 100})]               # forces token 7
    tokens, _ = sampler(logits, requests)
    assert tokens == [logits[0].topk(2).indices[1].item(), top[1], 7]
    assert torch.equal(logits, random_logits(3, 50, seed=8))                      # the caller's logits unchanged
    # under sampling: a biased token's frequency follows softmax(logits + bias)
    row, bias = random_logits(1, 12, seed=10)[0] / 3, {3: 1.5, 11: -1.0}      # flat enough to count every token
    shifted = row.clone()
    for t, b in bias.items():
        shifted[t] += b
    draws = 4000
    tokens = draw_many(row, draws, logit_bias=bias)
    assert chi_square(frequencies(tokens, 12), shifted.softmax(dim=-1).double(), draws) < chi_square_limit(12)


def test_logit_bias_then_penalties_equal_the_reference_and_logprobs_stay_the_models():
    logits = random_logits(2, 40, seed=9)
    requests = [make_request(outputs=(3, 3, 9), temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                             logit_bias={3: 2.0, 20: 1.0}, logprobs=1),
                make_request(outputs=(1,), temperature=0, repetition_penalty=1.3, logit_bias={1: 0.5})]
    biased = logits.clone()
    biased[0, 3] += 2.0
    biased[0, 20] += 1.0
    biased[1, 1] += 0.5
    want = penalized_reference(biased, requests).argmax(dim=-1).tolist()
    tokens, logprobs = sampler(logits, requests)
    assert tokens == want
    assert logprobs[0].logprob == pytest.approx(logits[0].log_softmax(dim=-1)[tokens[0]].item(), abs=1e-6)

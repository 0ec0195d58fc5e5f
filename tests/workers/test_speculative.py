"""Speculative decoding keeps every output: with it on, greedy and seeded outputs (tokens and
logprobs) are the same as with it off, alone and batched, under preemption and chunked prefill,
with the n-gram proposer, a draft model, a perfect draft and an always-wrong one; the KV pool's
accounting after accepted and rejected drafts is that of a run without them; the adaptive policy
turns speculation on at batch 1 and off at a busy batch."""
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.workers.engine_helpers import check_invariants
from workers import LLM, SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.spec_policy import Acceptance
from workers.engine.speculative import SpeculativeConfig, StepCost

K = 4
OPTIONS = {"device": "cpu", "num_kv_blocks": 400}


def prompt(i: int, n: int) -> list[int]:
    """Prompts with repeats, so that the n-gram proposer finds matches."""
    return [(i * 7 + j % 11) % 60 + 10 for j in range(n)]


PARAMS = [
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, top_k=40, seed=3, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=33, temperature=1.0, seed=5, repetition_penalty=1.2, presence_penalty=0.3,
                   ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.7, min_p=0.1, seed=9, frequency_penalty=0.5, ignore_eos=True),
    SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, speculative=False),
    SamplingParams(max_tokens=40, temperature=0.9, top_k=5, seed=11),             # may stop at EOS
]
PROMPTS = [prompt(i, 12 + 9 * i) for i in range(len(PARAMS))]


def run(model: str, speculative=None, prompts=PROMPTS, params=PARAMS, **options) -> tuple[list, dict]:
    with LLM(model, **{**OPTIONS, **options}, speculative=speculative) as llm:
        outs = llm.generate(prompts, params)
        return [(o.token_ids, [lp.logprob for lp in o.logprobs or []], o.finish_reason) for o in outs], llm.stats()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return {"batched": run(tiny_model)[0], "alone": [run(tiny_model, None, [p], [s])[0][0]
                                                    for p, s in zip(PROMPTS[:2], PARAMS[:2])]}


def ngram(adaptive: bool = False, k: int = K) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "adaptive": adaptive}


def draft(model: str, adaptive: bool = False) -> dict:
    return {"method": "draft", "model": model, "num_speculative_tokens": K, "adaptive": adaptive}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_outputs_are_identical_with_speculation_on_alone_and_batched(tiny_model, reference, method):
    spec = ngram() if method == "ngram" else draft(tiny_model)
    got, stats = run(tiny_model, spec)
    assert got == reference["batched"]
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    alone = [run(tiny_model, spec, [p], [s])[0][0] for p, s in zip(PROMPTS[:2], PARAMS[:2])]
    assert alone == reference["alone"]


@pytest.mark.parametrize("options", [{"num_kv_blocks": 14}, {"max_num_batched_tokens": 16},
                                     {"num_kv_blocks": 30, "max_num_batched_tokens": 24, "block_size": 4}],
                         ids=["preemption", "chunked-prefill", "both"])
def test_outputs_are_identical_with_speculation_on_under_preemption_and_chunked_prefill(tiny_model, options):
    want, off = run(tiny_model, None, **options)
    got, on = run(tiny_model, ngram(), **options)
    assert got == want
    assert on["spec_accepted_tokens"] > 0
    if "num_kv_blocks" in options:
        assert on["preemptions"] > 0 and off["preemptions"] > 0


def test_a_draft_equal_to_the_target_is_always_accepted_and_gives_k_plus_1_tokens_a_step(tiny_model):
    params = SamplingParams(max_tokens=1 + 3 * (K + 1), temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)
    engine = LLMEngine(tiny_model, EngineConfig(**OPTIONS, speculative=draft(tiny_model)))
    req = engine.add_request("r", prompt(1, 30), params)
    gained = []
    while engine.has_unfinished():
        before = req.num_output_tokens
        engine.step()
        gained.append(req.num_output_tokens - before)
    assert gained == [1 + K, 1 + K, 1 + K, 1]   # the prefill's token and K drafts, ..., then room for 0 drafts
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_acceptance_length"] == K
    assert stats["spec_acceptance_per_position"] == [1.0] * K
    assert req.output_token_ids == run(tiny_model, None, [prompt(1, 30)], [params])[0][0][0]


class Wrong:
    """A proposer that knows each request's reference output and proposes other tokens."""

    def __init__(self, outputs: dict[str, list[int]], vocab: int):
        self.outputs, self.vocab = outputs, vocab

    def propose(self, requests, ks):
        return [[(self.outputs[r.request_id][r.num_output_tokens + j] + 1) % self.vocab for j in range(k)]
                for r, k in zip(requests, ks)]

    def forget(self, request_id):
        pass


class Oracle(Wrong):
    """Proposes the reference output's next tokens, turned wrong from a drawn draft position on."""

    def __init__(self, outputs, vocab, cuts):
        super().__init__(outputs, vocab)
        self.cuts = cuts

    def propose(self, requests, ks):
        out = []
        for r, k in zip(requests, ks):
            ref, at, cut = self.outputs[r.request_id], r.num_output_tokens, self.cuts.draw(st.integers(0, k))
            out.append([ref[at + j] if j < cut else (ref[at + j] + 1) % self.vocab for j in range(k)])
        return out


def spec_engine(model: str, proposer, **options) -> LLMEngine:
    engine = LLMEngine(model, EngineConfig(**{**OPTIONS, **options}, speculative=ngram()))
    engine.speculator.proposer = proposer
    return engine


def finish(engine: LLMEngine, prompts, params, first: int = 0) -> list:
    reqs = [engine.add_request(f"r{first + i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine.kv)
    return [(r.output_token_ids, [lp.logprob for lp in r.logprobs], r.finish_reason) for r in reqs]


def test_a_draft_that_is_always_wrong_is_never_accepted_and_changes_no_output(tiny_model, reference):
    outputs = {f"r{i}": out[0] + [0] * K for i, out in enumerate(reference["batched"])}
    engine = spec_engine(tiny_model, Wrong(outputs, 4096))
    assert finish(engine, PROMPTS, PARAMS) == reference["batched"]
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == 0
    assert stats["spec_acceptance_per_position"][0] == 0.0


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.data(), blocks=st.sampled_from([400, 14]))
def test_after_any_mix_of_accepted_and_rejected_drafts_the_kv_accounting_is_as_without_speculation(
        tiny_model, reference, cuts, blocks):
    """Each step every request's drafts are right up to a drawn position. At every step: ref counts
    equal holders, the free list holds exactly the unheld blocks, the hash index only blocks of
    computed final tokens (check_invariants, and no block past a request's computed tokens is
    hashed). At the end: the same outputs, the same cached hashes and the same free list (in
    order, one request at a time) as the run without speculation."""
    outputs = {f"r{i}": out[0] + [0] * K for i, out in enumerate(reference["batched"])}
    plain = LLMEngine(tiny_model, EngineConfig(**{**OPTIONS, "num_kv_blocks": blocks}))
    engine = spec_engine(tiny_model, Oracle(outputs, 4096, cuts), num_kv_blocks=blocks)
    for i, (p, s) in enumerate(zip(PROMPTS, PARAMS)):       # one request at a time, each after the last
        assert finish(engine, [p], [s], i) == [reference["batched"][i]] == finish(plain, [p], [s], i)
        assert [b.block_id for b in engine.kv.free] == [b.block_id for b in plain.kv.free]
        assert engine.kv.cached.keys() == plain.kv.cached.keys()


def test_no_block_past_the_computed_tokens_is_hashed_while_drafts_are_verified(tiny_model, reference):
    outputs = {f"r{i}": out[0] + [0] * K for i, out in enumerate(reference["batched"])}
    engine = spec_engine(tiny_model, Wrong(outputs, 4096), block_size=4)
    reqs = [engine.add_request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, PARAMS))]
    while engine.has_unfinished():
        engine.step()
        for r in reqs:
            if not r.finished:
                held = engine.kv.req_blocks[r.request_id]
                assert len(held) == engine.kv.num_blocks_for(r.num_computed_tokens)
                assert all(b.hash is None for b in held[r.num_computed_tokens // 4 + 1:])


def test_a_stop_string_ends_the_output_where_it_would_without_speculation(tiny_model, tiny_tokenizer):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(tiny_model, tiny_tokenizer, **OPTIONS) as llm:
        text = llm.generate([prompt(3, 40)], params)[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop)
    outs = []
    for spec in (None, ngram()):
        with LLM(tiny_model, tiny_tokenizer, **OPTIONS, speculative=spec) as llm:
            o = llm.generate([prompt(3, 40)], params)[0]
            outs.append((o.token_ids, o.text, o.finish_reason, o.stop_reason))
    assert outs[0] == outs[1] and outs[0][2] == "stop"


class FakeCost:
    """A step: a fixed weight read (30 ms) until compute takes over at ~64 tokens."""

    def observe(self, tokens, seconds):
        pass

    def __call__(self, tokens):
        return max(0.030, 0.0005 * tokens)


def test_the_adaptive_engine_speculates_at_batch_1_and_not_at_a_busy_batch(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(**OPTIONS, speculative=ngram(adaptive=True)))
    engine.speculator.cost = FakeCost()
    engine.speculator.acceptance = Acceptance(initial=0.7, weight=0.0)   # held, whatever the drafts do
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("one", prompt(0, 30), params)
    engine.step()
    engine.step()
    assert engine.stats()["spec_k"] == K and engine.stats()["spec_rows"] == 1
    while engine.has_unfinished():
        engine.step()
    for i in range(64):
        engine.add_request(f"busy{i}", prompt(i, 30), params)
    engine.step()
    engine.step()
    assert engine.stats()["spec_k"] == 0 and engine.stats()["spec_rows"] == 64


def test_the_step_cost_is_read_between_measured_sizes_and_pessimistic_beyond_them():
    cost = StepCost()
    assert cost(100) == 1.0
    cost.observe(1, 0.03)
    cost.observe(64, 0.04)
    assert cost(1) == 0.03 and cost(64) == 0.04
    assert cost(32) == pytest.approx(0.03 + 0.01 * 31 / 63)
    assert cost(128) == pytest.approx(0.08)
    cost.observe(64, 0.05)                    # a moving average
    assert 0.04 < cost(64) < 0.05


@pytest.mark.parametrize("value, message", [
    ("ngram:x", r"K must be a whole number"),
    ("eagle:4", r"expected ngram\[:K\] or draft:DIR\[:K\]"),
    ("draft", r"needs a model"),
    ({"method": "ngram", "k": 4}, r"unknown key\(s\) k"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\]"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, r"prompt_lookup_min \(3\)"),
])
def test_a_bad_speculative_setting_is_refused_naming_it(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative=value)


def test_the_command_line_forms_parse():
    assert SpeculativeConfig.parse("ngram") == SpeculativeConfig("ngram")
    assert SpeculativeConfig.parse("ngram:6").num_speculative_tokens == 6
    d = SpeculativeConfig.parse("draft:/models/a:b:3")
    assert (d.method, d.model, d.num_speculative_tokens) == ("draft", "/models/a:b", 3)
    assert SpeculativeConfig.parse("draft:/models/x").num_speculative_tokens == 4


PASSAGE = ("The lighthouse keeper climbed the stairs each evening at dusk, trimmed the wick, polished the "
           "great lens and wrote the weather in a leather book: wind, sea, and the ships that passed.")
TASKS = ["Repeat the following text exactly.", "Rewrite the following text, replacing 'lighthouse' with 'tower'.",
         "Copy this text, then add one sentence to it.", "Summarize the following text in one sentence."]


def test_on_the_real_model_outputs_are_identical_and_grounded_drafts_are_mostly_accepted(smollm2):
    """SmolLM2-135M-Instruct asked to repeat or edit a passage: greedy and seeded sampling, batched."""
    chats = [[{"role": "user", "content": f"{task}\n\n{PASSAGE}"}] for task in TASKS]
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=48, temperature=0.8, top_k=20, seed=2, ignore_eos=True)]
    outs = []
    for spec in (None, ngram(k=4)):
        with LLM(smollm2, num_kv_blocks=256, speculative=spec) as llm:
            outs.append([(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in llm.chat(chats, params)])
            stats = llm.stats()
    assert outs[1] == outs[0]
    assert stats["spec_acceptance_rate"] > 0.3 and stats["spec_mean_acceptance_length"] > 1, stats


def test_aborting_a_request_mid_speculation_frees_its_blocks_and_its_drafts_and_spares_the_others(
        tiny_model, reference):
    engine = LLMEngine(tiny_model, EngineConfig(**OPTIONS, speculative=draft(tiny_model)))
    reqs = [engine.add_request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS[:2], PARAMS[:2]))]
    for _ in range(3):
        engine.step()
    assert engine.stats()["spec_draft_tokens"] > 0
    engine.abort("r1")
    assert "r1" not in engine.speculator.proposer.mirrors and "r1" not in engine.kv.req_blocks
    check_invariants(engine.kv)
    while engine.has_unfinished():
        engine.step()
    assert reqs[0].output_token_ids == reference["batched"][0][0]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.speculator.proposer.kv.num_free_blocks == engine.speculator.proposer.kv.num_blocks


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_min_tokens_holds_back_eos_and_stop_ids_then_lets_them_end_the_request(tiny_model, spec):
    """EOS (and a stop token id) made the best token by logit_bias would end a request at once: min_tokens holds
    them back for that many tokens, with or without speculation, and the next one ends it."""
    eos = json.loads((Path(tiny_model) / "config.json").read_text())["eos_token_id"]
    params = [SamplingParams(max_tokens=20, temperature=0, logit_bias={str(eos): 100}, min_tokens=n) for n in (0, 7)]
    params.append(SamplingParams(max_tokens=20, temperature=0.8, seed=2, logit_bias={"42": 100}, stop_token_ids=[42],
                                 min_tokens=4))
    got, _ = run(tiny_model, ngram() if spec else None, PROMPTS[:3], params)
    assert [(len(tokens), reason) for tokens, _, reason in got] == [(1, "stop"), (8, "stop"), (5, "stop")]
    assert got[1][0][-1] == eos not in got[1][0][:-1] and got[2][0][-1] == 42 not in got[2][0][:-1]

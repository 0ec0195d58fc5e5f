"""Structured output in the engine (xgrammar), on the real model: constrained outputs follow their schema,
regex or choice in batches, after preemption and with speculative decoding, and unconstrained rows beside
them are unchanged."""
import json
import re
import time
from concurrent.futures import Future
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from schemas.sampling import MAX_SCHEMA_DEPTH, SamplingParams, to_grammar
from workers.engine import grammar
from workers.llm import LLM

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "score", "role", "address", "tags"],
}


@pytest.fixture(scope="module")
def llm(smollm2):
    with LLM(smollm2, num_kv_blocks=1024, max_num_seqs=64) as llm:
        yield llm


def chats(llm: LLM, n: int, ask: str = "Describe person {i} as JSON.") -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": ask.format(i=i)}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


def valid(text: str, schema: dict) -> bool:
    jsonschema.validate(json.loads(text), schema)
    return True


def test_fifty_json_schema_requests_in_one_batch_all_validate(llm):
    params = [SamplingParams(max_tokens=160, temperature=0 if i % 5 == 0 else 0.8, seed=i, json_schema=PERSON)
              for i in range(50)]
    outs = llm.generate(chats(llm, 50), params)
    assert [o.finish_reason for o in outs] == ["stop"] * 50
    assert all(valid(o.text, PERSON) for o in outs)


def test_regex_choice_and_json_object_always_match(llm):
    # a free object may go on for ever (this model can write one string past any max_tokens): asked for
    # two keys, it writes those and ends
    prompts = chats(llm, 16, "Give the number {i} and its name as a short JSON object.") + \
        chats(llm, 4, 'Write the number {i} as a JSON object with the keys "number" and "name".')
    params = ([SamplingParams(max_tokens=20, temperature=1.0, seed=i, regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}!")
               for i in range(8)]
              + [SamplingParams(max_tokens=20, temperature=1.0, seed=i, choice=["red", "green", "blue violet"])
                 for i in range(8)]
              + [SamplingParams(max_tokens=64, temperature=0.7, seed=i, json_object=True) for i in range(4)])
    outs = llm.generate(prompts, params)
    assert all(re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}!", o.text) for o in outs[:8])
    assert all(o.text in ("red", "green", "blue violet") for o in outs[8:16])
    assert [o.finish_reason for o in outs] == ["stop"] * 20
    assert all(isinstance(json.loads(o.text), dict) for o in outs[16:])


def test_unconstrained_greedy_and_seeded_outputs_are_unchanged_beside_constrained_rows(llm):
    prompts = chats(llm, 4, "Tell me a fact about {i}.")
    plain = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.9, seed=7)]
    alone = llm.generate(prompts[:2], plain)
    mixed = llm.generate(prompts, plain + [SamplingParams(max_tokens=24, json_schema=PERSON, seed=1),
                                           SamplingParams(max_tokens=24, temperature=0, choice=["a", "b"])])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert llm.stats()["failed_steps"] == 0      # constrained rows after unconstrained ones: no step ran twice


def test_masks_land_on_the_constrained_rows_wherever_they_are_in_the_batch(monkeypatch):
    import xgrammar as xgr

    vocab = ["a", "b", "c", "yes", "no", "</s>"] + [f"t{i}" for i in range(34)]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[5])).compile_regex("(yes|no)")

    class Row:
        def __init__(self, matcher=None):
            self.matcher = matcher

    rows = [Row(), Row(xgr.GrammarMatcher(compiled)), Row(), Row(xgr.GrammarMatcher(compiled))]
    raw = torch.randn(4, 40)
    logits = grammar.apply_grammars(raw, rows)
    allowed = [[i for i, x in enumerate(row.tolist()) if x > float("-inf")] for row in logits]
    assert allowed == [list(range(40)), [3, 4], list(range(40)), [3, 4]]
    assert torch.isfinite(raw).all()                # a new tensor: logprobs are taken from the raw logits
    bitmask = xgr.allocate_token_bitmask(4, 40)     # the unpacking against xgrammar's own kernel
    for i in (1, 3):
        rows[i].matcher.fill_next_token_bitmask(bitmask, i)
    want = raw.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=[1, 3])
    assert torch.equal(logits, want)
    every = grammar.apply_grammars(raw[1::2], rows[1::2])       # every row constrained
    assert torch.equal(every, want[1::2])
    monkeypatch.setattr(grammar.sys, "byteorder", "big")       # xgrammar's kernel, as on a GPU
    assert torch.equal(grammar.apply_grammars(raw, rows), want) and torch.isfinite(raw).all()


VOCAB = ["a", "b", "c", "yes", "no", "</s>"] + [f"t{i}" for i in range(34)]


def allowed_after(matcher, extra: list[int]) -> list[int]:
    """The tokens grammar.fill lets a row sample after the drafts `extra`."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    grammar.fill(matcher, extra, bitmask, 0)
    return [t for t in range(len(VOCAB)) if bitmask[0, t // 32].item() >> t % 32 & 1]


@pytest.mark.parametrize("extra, want", [
    ([1, 3], list(range(40))),          # "b" then "yes", "c" due: outside, the row's token is dropped
    ([0, 2, 4, 5], list(range(40))),    # "acno" and the stop token it accepts: the request ends there
    ([0, 2], [3, 4]),                   # "ac": then "yes" or "no"
    ([0, 2, 3], [5]),                   # "acyes": then only the stop token
], ids=["outside", "ends-in-stop", "inside", "inside-complete"])
def test_a_row_after_drafts_gets_the_mask_past_them_and_the_matcher_is_left_as_it_was(extra, want):
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[5])).compile_regex("(a|b)c(yes|no)")
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=grammar.MAX_ROLLBACK)
    assert allowed_after(matcher, extra) == want
    assert allowed_after(matcher, []) == [0, 1] and not matcher.is_terminated()
    assert all(matcher.accept_token(t) for t in (1, 2, 3, 5)) and matcher.is_terminated()


def test_preempted_constrained_requests_resume_and_validate(smollm2):
    with LLM(smollm2, num_kv_blocks=40, block_size=16, max_num_seqs=16) as small:
        params = [SamplingParams(max_tokens=160, temperature=0.8, seed=i, json_schema=PERSON) for i in range(12)]
        outs = small.generate(chats(small, 12), params)
        assert small.stats()["preemptions"] > 0
    assert all(valid(o.text, PERSON) for o in outs)


def test_drafts_outside_the_grammar_are_rejected_and_outputs_equal_no_speculation(smollm2, llm):
    prompts = chats(llm, 6)
    params = [SamplingParams(max_tokens=160, temperature=0, json_schema=PERSON)] * 3 + \
             [SamplingParams(max_tokens=160, temperature=0.8, seed=i, json_schema=PERSON) for i in range(3)]
    with LLM(smollm2, num_kv_blocks=512, speculative="ngram:4") as spec:
        drafted = spec.generate(prompts, params)
        assert spec.stats()["spec_draft_tokens"] > 0
    assert [o.token_ids for o in drafted] == [o.token_ids for o in llm.generate(prompts, params)]
    assert all(valid(o.text, PERSON) for o in drafted)


def test_a_draft_model_with_grammars_gives_the_outputs_of_no_speculation_when_a_draft_ends_in_the_stop_token(
        smollm2, llm):
    """The draft is the target, drafting unconstrained: greedy, the first prompt's drafts are its whole output
    ("No, 2 is not 3." and EOS, 10 tokens), 3 a step, so EOS comes as a draft (the second of the third step),
    and the grammar, complete, has no mask for the row after it. The second prompt's drafts leave the grammar."""
    qs = ["Is 2 bigger than 3? Reply yes or no.", "What colour is the sky? One word.", "Is water wet? Yes or no."]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for q in qs]
    regex = r"(Yes|No), [^\n]{1,40}"
    params = [SamplingParams(max_tokens=24, temperature=0, regex=regex)] * 2 + \
             [SamplingParams(max_tokens=24, temperature=0.8, seed=3, regex=regex)]
    want = llm.generate(prompts, params)
    spec = {"method": "draft", "model": smollm2, "num_speculative_tokens": 3, "adaptive": False}
    with LLM(smollm2, num_kv_blocks=256, speculative=spec) as drafted:
        drafted.engine.grammars = llm.engine.grammars   # its vocabulary's compiler and regex: seconds to build
        proposer, drafts = drafted.engine.speculator.proposer, []
        propose = proposer.propose
        proposer.propose = lambda reqs, ks: drafts.append(propose(reqs, ks)) or drafts[-1]
        got = drafted.generate(prompts, params)
        assert drafted.stats()["failed_steps"] == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(llm.engine.model_cfg.eos_token_ids[0] in step[0] for step in drafts)
    assert all(re.fullmatch(regex, o.text) and o.finish_reason == "stop" for o in got)


def test_resumed_request_rebuilds_its_matcher_past_its_output(llm):
    prompt = chats(llm, 1)[0]
    params = SamplingParams(max_tokens=160, temperature=0, json_schema=PERSON)
    whole = llm.generate([prompt], params)[0]
    req = llm.engine.add_request("resumed", prompt, params, output_token_ids=whole.token_ids[:10])
    while not req.finished:
        llm.engine.step()
    assert req.output_token_ids == whole.token_ids and req.finish_reason == "stop"


def test_a_grammar_is_compiled_once_per_text(llm):
    params = SamplingParams(max_tokens=8, regex="[0-9]{4}")
    llm.generate(chats(llm, 3), [params] * 3)
    first = llm.engine.grammars.cache[params.constraint]
    llm.generate(chats(llm, 1), [SamplingParams(max_tokens=8, regex="[0-9]{4}")])
    assert llm.engine.grammars.cache[params.constraint] is first


def test_the_grammar_cache_drops_the_least_recently_asked_for_past_its_count_and_bytes(monkeypatch):
    class Compiled:
        memory_size_bytes = 40 << 20

    monkeypatch.setattr(grammar, "MAX_GRAMMARS", 3)
    monkeypatch.setattr(grammar.Grammars, "compile", lambda self, params: Compiled())
    grammars = grammar.Grammars("unused", 100, (0,))
    grammars.compiler = object()                       # no vocabulary: compile() is the stand-in's
    try:
        def ask(text: str) -> Future:
            future = grammars.submit(SamplingParams(regex=text))
            future.result()
            return future

        first = ask("a")
        ask("b"), ask("c")
        assert ask("a") is first                       # asked again: now the most recent
        ask("d")
        assert [k[1] for k in grammars.cache] == ["c", "a", "d"]     # "b" was the least recent
        monkeypatch.setattr(grammar, "MAX_GRAMMAR_BYTES", 70 << 20)
        ask("e")                                       # "c" past the count, then "a": 2 × 40 MiB > 70 MiB
        assert [k[1] for k in grammars.cache] == ["d", "e"]
        assert ask("a") is not first                   # compiled again
    finally:
        grammars.close()


def test_bad_constraints_name_their_problem_before_running():
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{'type': 'object'}")
    with pytest.raises(ValueError, match=f"MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}"):
        SamplingParams(json_schema="{" + '"a":{' * 40 + "}" * 41)
    with pytest.raises(ValueError, match="1 to 65536 characters"):
        SamplingParams(json_schema=json.dumps({"enum": ["x" * 70000]}))
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match=r'json_schema is not one the engine can follow: Unsupported type "objectx"'):
        to_grammar(SamplingParams(json_schema={"type": "objectx"}))
    with pytest.raises(ValueError, match=r"regex is not one the engine can follow: .*parenthesis"):
        to_grammar(SamplingParams(regex="(("))


def test_a_bad_constraint_fails_offline_with_its_error(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]: grammar is not one the engine can follow"):
        llm.generate([[1, 2, 3]], SamplingParams(grammar="root ::= undefined_rule"))


def test_a_constraint_is_converted_once_per_text_in_a_process():
    """The tokenizer stage, the engine's check and its compile thread all ask; the conversion is cached."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert to_grammar(SamplingParams(json_schema=schema)) is to_grammar(SamplingParams(json_schema=dict(schema)))
    assert to_grammar(SamplingParams(choice=["a", "b"])) is to_grammar(SamplingParams(choice=("a", "b")))
    assert to_grammar(SamplingParams(choice=["a", "b"])) is not to_grammar(SamplingParams(choice=["a", "c"]))


@pytest.fixture
def slow_grammars(monkeypatch):
    """Grammars over VOCAB whose compile of the regex "slow" takes 0.6 s of CPU, past a MAX_COMPILE_SECONDS
    of 0.3 s; it counts the compiles."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[5]))
    compiled = compiler.compile_regex("(yes|no)")
    calls = []

    def compile(self, params):
        calls.append(params.regex)
        spin = time.thread_time() + (0.6 if params.regex == "slow" else 0)
        while time.thread_time() < spin:
            pass
        return compiled

    monkeypatch.setattr(grammar, "MAX_COMPILE_SECONDS", 0.3)
    monkeypatch.setattr(grammar.Grammars, "compile", compile)
    grammars = grammar.Grammars("unused", len(VOCAB), (5,))
    grammars.compiler, grammars.calls = compiler, calls
    yield grammars
    grammars.close()


def pending(grammars, regex: str) -> grammar.Pending:
    return grammar.Pending(SimpleNamespace(output_token_ids=[]), grammars.submit(SamplingParams(regex=regex)))


def matcher_of(waiting: grammar.Pending):
    """The matcher, once compiled (or the ValueError)."""
    while (matcher := waiting.matcher()) is None:
        time.sleep(0.01)
    return matcher


def test_a_grammar_queued_behind_a_slow_compile_gets_its_own_compile_time(slow_grammars):
    slow, quick = pending(slow_grammars, "slow"), pending(slow_grammars, "quick")
    with pytest.raises(ValueError, match=r"MAX_COMPILE_SECONDS=0\.3"):
        matcher_of(slow)
    assert matcher_of(quick).accept_string("yes")      # 0.6 s after it was asked for: it waited, then compiled


def test_a_grammar_past_its_time_fails_its_next_request_at_once_is_compiled_once_and_serves_when_done(slow_grammars):
    first = pending(slow_grammars, "slow")
    with pytest.raises(ValueError, match="to compile"):
        matcher_of(first)
    again = pending(slow_grammars, "slow")
    assert again.future is first.future
    with pytest.raises(ValueError, match="to compile"):
        again.matcher()                                 # at once: no second wait, no second compile
    first.future.result()
    assert matcher_of(pending(slow_grammars, "slow")).accept_string("yes")
    assert slow_grammars.calls == ["slow"]


def test_a_length_bounded_json_string_holds_no_raw_control_character():
    """xgrammar writes minLength/maxLength strings with a character class that lets U+0000-U+001F through;
    JSON does not (a streamed reading once came back with a raw \\x18)."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"unit": {"type": "string", "maxLength": 6}}, "required": ["unit"]}
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\x18"])) \
        .compile_grammar(to_grammar(SamplingParams(json_schema=schema)))
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_string(s) for s in ('{', '"unit"', ': ', '"', 'ab'))
    assert not matcher.accept_string("\x18")
    assert matcher.accept_string('c"}')

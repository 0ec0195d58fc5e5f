"""A failure inside an engine step belongs to the request that caused it: the step is bisected,
that request alone ends with finish_reason "error" (its KV freed, its unwritten blocks out of the
prefix cache), and every other request of the same steps gets exactly the tokens it gets without
the fault. Migration: a request added with the output tokens it had continues as if never moved."""
import pytest

from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine

POISON = 4042


@pytest.fixture
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128, max_num_seqs=8))


def prompts() -> dict[str, list[int]]:
    ps = {f"r{i}": [10 + i, 20 + i, 30 + i] * (3 + i) for i in range(6)}
    ps["r3"] = [7] * 5 + [POISON] + [8] * 20         # the poison is in the middle of a prompt
    return ps


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=6 + i, temperature=0.7 if i % 2 else 0, seed=i, ignore_eos=True)


def run_all(engine: LLMEngine, ps: dict[str, list[int]]) -> dict[str, tuple]:
    for i, (rid, p) in enumerate(ps.items()):
        engine.add_request(rid, p, params(i))
    done = {}
    while engine.has_unfinished():
        for req in engine.step():
            if req.finished:
                done[req.request_id] = (req.finish_reason, req.output_token_ids, req.error)
    return done


def test_a_fault_inside_the_step_fails_only_its_request_and_the_others_get_the_same_tokens(engine, tiny_model):
    want = run_all(LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128, max_num_seqs=8)), prompts())
    engine.inject_fault(POISON)
    got = run_all(engine, prompts())
    reason, tokens, error = got.pop("r3")
    assert reason == "error" and tokens == []
    assert "test hook: fault injected on token 4042" in error
    assert got == {rid: w for rid, w in want.items() if rid != "r3"}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks       # its KV is freed too
    assert not engine.requests and not engine.has_unfinished()


def test_the_engine_keeps_serving_after_a_failed_request(engine):
    engine.inject_fault(POISON)
    assert run_all(engine, {"bad": [1, POISON, 2]})["bad"][0] == "error"
    reason, tokens, _ = run_all(engine, {"good": [1, 3, 2]})["good"]
    assert reason == "length" and len(tokens) == params(0).max_tokens


def test_a_failed_request_leaves_no_block_in_the_prefix_cache_it_never_computed(engine):
    engine.inject_fault(POISON)
    poison = list(range(100, 148)) + [POISON]                      # 3 full blocks, then the fault
    run_all(engine, {"bad": poison})
    assert not engine.kv.cached
    got = run_all(engine, {"same-prefix": list(range(100, 148)) + [5]})
    assert got["same-prefix"][0] == "length" and engine.stats()["prefix_cache_hits"] == 0


def test_a_request_the_sampler_cannot_take_fails_alone(engine):
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    bad = engine.add_request("bad", [1, 2, 4], SamplingParams(max_tokens=4, seed=1, ignore_eos=True))
    bad.seed = 1 << 70                           # past int64: what a seed that skipped its bounds would do
    ends = {}
    while engine.has_unfinished():
        ends.update({r.request_id: r for r in engine.step() if r.finished})
    assert ends["bad"].finish_reason == "error" and "Overflow" in ends["bad"].error
    assert ends["ok"].finish_reason == "length" and len(ends["ok"].output_token_ids) == 4


def test_a_seed_past_int64_is_mapped_without_overflow(engine):
    req = engine.add_request("s", [1, 2], SamplingParams(max_tokens=3, seed=2**64 - 1, ignore_eos=True))
    assert req.seed == -1
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason == "length"


def test_a_top_k_past_the_vocabulary_is_refused_naming_it(engine):
    with pytest.raises(ValueError, match="top_k 1048576 is more than the vocabulary"):
        engine.add_request("k", [1], SamplingParams(top_k=1 << 20))


def test_a_suspect_request_runs_its_steps_alone_until_its_first_token(engine):
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request("s", list(range(40)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       isolate=True)
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["s"]
    engine.scheduler.update(batch, [[9]], [[None]])
    assert not engine.requests["s"].isolate
    assert {r.request_id for r in engine.scheduler.schedule().requests} == {"a", "s", "b"}


def test_a_moved_request_continues_from_its_tokens_as_if_it_never_moved(engine, tiny_model):
    p = SamplingParams(max_tokens=12, temperature=0.9, seed=5, repetition_penalty=1.3, presence_penalty=0.5,
                       ignore_eos=True)
    prompt = [3, 1, 4, 1, 5]
    ref = engine.add_request("ref", prompt, p)
    while engine.has_unfinished():
        engine.step()
    engine.kv.reset_prefix_cache()
    moved = engine.add_request("moved", prompt, p, output_token_ids=ref.output_token_ids[:5])
    assert moved.num_output_tokens == 5 and moved.num_resumed_tokens == 5
    first = engine.scheduler.schedule()
    assert first.num_new_tokens == [10] and first.samples == [True]   # prompt + tokens so far: one prefill
    engine.scheduler.update(first, *engine.runner.run(first, [engine.kv.block_ids("moved")]))
    sampled = 1
    while engine.has_unfinished():
        sampled += len(engine.step())
    assert moved.output_token_ids == ref.output_token_ids and moved.finish_reason == "length"
    assert sampled == 12 - 5                                            # only the tokens it did not have


def test_resuming_past_max_tokens_is_refused(engine):
    with pytest.raises(ValueError, match="output_token_ids: 4 tokens leave no room"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=4), output_token_ids=[1, 2, 3, 4])


def test_a_step_where_every_request_fails_alone_is_nobodys_fault_and_raises(engine):
    engine.inject_fault(POISON)
    engine.add_request("p1", [1, POISON], params(0))
    engine.add_request("p2", [2, POISON], params(0))
    with pytest.raises(RuntimeError, match="fault injected"):
        engine.step()

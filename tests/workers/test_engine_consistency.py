"""The same greedy tokens whatever the batching: alone vs batched, prefix caching on and off, a KV
pool so small that requests are preempted and resumed, a token budget so small that every
prompt is chunked. Seeded sampling likewise gives the same tokens alone and batched."""
import pytest

from workers import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine

SHARED = list(range(100, 148))  # a 3-block shared prefix, so prefix caching has something to hit
PROMPTS = [SHARED + [5, 6, 7], SHARED + list(range(200, 230)), list(range(300, 341)), [9, 8, 7],
           SHARED + [5, 6, 7, 8], list(range(20, 90))]
MAX_TOKENS = 20


def generate(model_dir: str, prompts, params: SamplingParams, **config) -> tuple[list[list[int]], dict]:
    engine = LLMEngine(model_dir, EngineConfig(**{"device": "cpu", **config}))
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [r.output_token_ids for r in reqs], engine.stats()


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(model_dir):
    return [generate(model_dir, [p], GREEDY, num_kv_blocks=64)[0][0] for p in PROMPTS]


def test_batched_equals_alone(model_dir, alone):
    assert generate(model_dir, PROMPTS, GREEDY, num_kv_blocks=64)[0] == alone


def test_prefix_caching_on_and_off_give_the_same_tokens(model_dir, alone):
    on, stats_on = generate(model_dir, PROMPTS, GREEDY, num_kv_blocks=64, max_num_seqs=1)
    off, stats_off = generate(model_dir, PROMPTS, GREEDY, num_kv_blocks=64, max_num_seqs=1,
                              enable_prefix_caching=False)
    assert on == off == alone
    assert stats_on["prefix_cache_hits"] >= 2 * len(SHARED) and stats_off["prefix_cache_hits"] == 0


def test_a_tiny_kv_pool_preempts_and_resumes_without_changing_tokens(model_dir, alone):
    out, stats = generate(model_dir, PROMPTS, GREEDY, num_kv_blocks=8)
    assert stats["preemptions"] > 0
    assert out == alone


def test_a_tiny_token_budget_chunks_every_prompt_without_changing_tokens(model_dir, alone):
    out, stats = generate(model_dir, PROMPTS, GREEDY, num_kv_blocks=64, max_num_batched_tokens=7)
    assert stats["steps"] > sum(len(p) for p in PROMPTS) // 7
    assert out == alone


def test_seeded_sampling_is_the_same_alone_batched_and_after_preemption(model_dir):
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True)
              for s in range(len(PROMPTS))]
    each = []
    for p, sp in zip(PROMPTS, params):
        engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_kv_blocks=64))
        req = engine.add_request("x", p, sp)
        while engine.has_unfinished():
            engine.step()
        each.append(req.output_token_ids)
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_kv_blocks=8, max_num_batched_tokens=16))
    reqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["preemptions"] > 0
    assert [r.output_token_ids for r in reqs] == each
    assert len({tuple(o) for o in each}) == len(each)

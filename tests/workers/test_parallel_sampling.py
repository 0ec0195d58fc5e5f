"""Parallel sampling (n > 1): the choices of one prompt are one request group; the first computes the
prompt and the others are forked onto its KV (its full blocks shared, its partial last block copied),
each computing only the prompt's last token and sampling with its own seed. Each choice is the same
bits as its seed run alone, and n choices hold far fewer blocks than n requests."""
import pytest

from tests.workers.engine_helpers import BLOCK, check_invariants, make_request, make_scheduler, scheduled, step
from workers import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.request import Status

pytestmark = pytest.mark.timeout(300)


def choice(rid: str, tokens: list[int], group: str = "g", **kw):
    req = make_request(rid, tokens, **kw)
    req.group = group
    return req


def blocks(sched, rid: str) -> list[int]:
    return sched.kv.block_ids(rid)


def test_choices_wait_for_the_first_s_prefill_then_share_its_full_blocks_and_copy_its_partial_one():
    sched = make_scheduler(num_blocks=16, budget=64, prefix=False)
    prompt = list(range(10, 20))                       # 10 tokens: 2 full blocks of 4 and 2 in a third
    for i in range(4):
        sched.add(choice(f"c{i}", prompt))
    first = step(sched)
    assert scheduled(first) == {"c0": 10} and len(sched.held) == 3 and not first.copies
    forked = step(sched)
    assert scheduled(forked) == {"c0": 1, "c1": 1, "c2": 1, "c3": 1}       # the prompt's last token each
    lead = blocks(sched, "c0")
    for i in (1, 2, 3):
        mine = blocks(sched, f"c{i}")
        assert mine[:2] == lead[:2] and len(set(mine[2:]) & set(lead)) == 0
    assert sorted(forked.block_copies) == sorted((lead[2], blocks(sched, f"c{i}")[2]) for i in (1, 2, 3))
    assert [sched.kv.blocks[b].ref_cnt for b in lead[:2]] == [4, 4]
    assert sched.num_forks == 3
    check_invariants(sched.kv)
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.num_free_blocks == 16 and not sched.leaders
    check_invariants(sched.kv)


def test_a_prompt_whose_last_token_starts_a_block_is_forked_without_a_copy():
    sched = make_scheduler(num_blocks=16, budget=64, prefix=False)
    prompt = list(range(10, 10 + 2 * BLOCK + 1))
    sched.add(choice("c0", prompt))
    sched.add(choice("c1", prompt))
    step(sched)
    forked = step(sched)
    assert scheduled(forked) == {"c0": 1, "c1": 1} and not forked.copies
    assert blocks(sched, "c1")[:2] == blocks(sched, "c0")[:2]
    check_invariants(sched.kv)


def test_a_choice_arriving_after_the_prefill_is_forked_at_once_and_a_chunked_prefill_holds_them():
    sched = make_scheduler(num_blocks=32, budget=8, prefix=False)
    prompt = list(range(10, 30))                       # 20 tokens: three steps of 8
    sched.add(choice("c0", prompt))
    sched.add(choice("c1", prompt))
    assert scheduled(step(sched)) == {"c0": 8}
    assert scheduled(step(sched)) == {"c0": 8}         # held while the first is mid-prompt
    assert scheduled(step(sched)) == {"c0": 4}
    assert scheduled(step(sched)) == {"c0": 1, "c1": 1}
    sched.add(choice("c2", prompt))                    # later: onto the first's computed prompt directly
    assert sched.held == [] and scheduled(step(sched)) == {"c0": 1, "c1": 1, "c2": 1}
    assert sched.num_forks == 2
    check_invariants(sched.kv)


def test_held_choices_of_a_first_that_ends_early_are_led_by_the_next():
    sched = make_scheduler(num_blocks=32, budget=8, prefix=False)
    prompt = list(range(10, 30))
    for i in range(3):
        sched.add(choice(f"c{i}", prompt))
    step(sched)
    sched.abort(next(r for r in sched.running if r.request_id == "c0"))
    assert scheduled(step(sched)) == {"c1": 8}          # the next computes the prompt, the last waits for it
    assert [r.request_id for r in sched.held] == ["c2"]
    step(sched), step(sched)
    assert scheduled(step(sched)) == {"c1": 1, "c2": 1} and sched.num_forks == 1
    check_invariants(sched.kv)
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.num_free_blocks == 32 and not sched.leaders


def test_held_choices_wait_while_their_first_is_preempted_and_recomputed():
    sched = make_scheduler(num_blocks=32, budget=8, prefix=False)
    prompt = list(range(10, 30))
    sched.add(choice("c0", prompt))
    sched.add(choice("c1", prompt))
    step(sched)
    lead = sched.running[0]
    sched.running.remove(lead)
    sched.preempt(lead)
    assert lead.status == Status.PREEMPTED and [r.request_id for r in sched.held] == ["c1"]
    assert [scheduled(step(sched)) for _ in range(4)] == [{"c0": 8}, {"c0": 8}, {"c0": 4}, {"c0": 1, "c1": 1}]
    check_invariants(sched.kv)


def test_a_resumed_request_or_another_prompt_in_the_group_is_not_forked():
    sched = make_scheduler(num_blocks=32, budget=64, prefix=False)
    prompt = list(range(10, 20))
    sched.add(choice("c0", prompt))
    other = choice("other", list(range(40, 50)))
    resumed = choice("resumed", prompt + [3, 4])
    resumed.num_prompt_tokens = len(prompt)            # came with 2 output tokens of its own
    sched.add(other)
    sched.add(resumed)
    assert scheduled(step(sched)) == {"c0": 10, "other": 10, "resumed": 12}
    assert sched.num_forks == 0
    check_invariants(sched.kv)


def test_an_aborted_held_choice_leaves_nothing():
    sched = make_scheduler(num_blocks=32, budget=8, prefix=False)
    prompt = list(range(10, 30))
    sched.add(choice("c0", prompt))
    sched.add(held := choice("c1", prompt))
    step(sched)
    sched.abort(held)
    assert held.finished and not sched.held
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.num_free_blocks == 32 and not sched.leaders


PROMPT = [(j * 11) % 4000 + 10 for j in range(203)]    # 12 full blocks of 16 and 11 tokens


def run(engine: LLMEngine, seeds: list[int], group: str) -> tuple[list, int]:
    """Each seed's (tokens, logprobs), and the most KV blocks held at once."""
    reqs = [engine.add_request(f"{group or 'alone'}-{s}", PROMPT, SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True, logprobs=1), group=group)
        for s in seeds]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
    return [(r.output_token_ids, [lp.logprob for lp in r.logprobs]) for r in reqs], peak


@pytest.mark.parametrize("options", [{"enable_prefix_caching": False},
                                     {"max_num_batched_tokens": 64}], ids=["no-prefix-cache", "chunked"])
def test_eight_choices_hold_a_fraction_of_eight_requests_blocks_and_each_is_its_seed_alone(tiny_model, options):
    engine = LLMEngine(tiny_model, EngineConfig(block_size=16, num_kv_blocks=256, **options))
    alone = []
    for s in range(8):
        (one,), peak_one = run(engine, [s], "")
        alone.append(one)
    engine.kv.reset_prefix_cache()
    together, peak = run(engine, list(range(8)), "n8")
    assert together == alone                            # tokens and logprobs, bit for bit
    assert len({tuple(t) for t, _ in together}) == 8
    assert engine.scheduler.num_forks == 7
    shared, own = len(PROMPT) // 16, -(-(len(PROMPT) + 12) // 16) - len(PROMPT) // 16
    assert peak <= shared + 8 * own < 8 * peak_one / 3  # the prompt's full blocks once, the rest each their own


def test_two_ranks_copy_a_forked_block_on_every_rank(tiny_model):
    """The block copies travel with the step's inputs to the follower ranks."""
    single = LLMEngine(tiny_model, EngineConfig(block_size=16, num_kv_blocks=128))
    want, _ = run(single, [1, 2, 3], "n3")
    tp = LLMEngine(tiny_model, EngineConfig(block_size=16, num_kv_blocks=128, tensor_parallel_size=2))
    try:
        got, _ = run(tp, [1, 2, 3], "n3")
    finally:
        tp.close()
    assert [t for t, _ in got] == [t for t, _ in want] and tp.scheduler.num_forks == 2

"""Scheduler with hand-built requests and model outputs: budget, chunking, preemption, resume."""
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.engine_helpers import check_invariants, make_request, make_scheduler, scheduled, step
from workers.engine.request import Status


def test_running_requests_go_first_then_waiting_ones_share_the_rest_of_the_budget():
    sched = make_scheduler(budget=10)
    sched.add(make_request("a", range(5)))
    assert scheduled(step(sched)) == {"a": 5}
    sched.add(make_request("b", range(100, 120)))
    assert scheduled(step(sched)) == {"a": 1, "b": 9}
    assert scheduled(step(sched)) == {"a": 1, "b": 9}
    assert scheduled(step(sched)) == {"a": 1, "b": 2}   # b's prompt done: it samples its first token
    assert scheduled(step(sched)) == {"a": 1, "b": 1}


def test_a_prompt_larger_than_the_budget_is_chunked_and_samples_only_at_its_end():
    sched = make_scheduler(budget=8)
    req = make_request("a", range(20))
    sched.add(req)
    assert [scheduled(step(sched))["a"] for _ in range(3)] == [8, 8, 4]
    assert req.num_output_tokens == 1 and req.num_computed_tokens == 20


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_it_fits():
    sched = make_scheduler(budget=8)
    sched.config.enable_chunked_prefill = False
    sched.add(make_request("a", range(6)))
    sched.add(make_request("b", range(10, 16)))
    assert scheduled(step(sched)) == {"a": 6}
    assert scheduled(step(sched)) == {"a": 1, "b": 6}


def test_a_request_hits_blocks_another_request_computes_in_the_same_step():
    sched = make_scheduler(budget=64)
    sched.add(make_request("a", range(10)))
    sched.add(make_request("b", range(10)))
    assert scheduled(step(sched)) == {"a": 10, "b": 2}   # b reuses a's two full blocks


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_request(f"r{i}", range(i * 10, i * 10 + 3)))
    assert scheduled(step(sched)) == {"r0": 3, "r1": 3}
    assert len(sched.waiting) == 1


def test_the_most_recently_admitted_request_is_preempted_when_a_block_runs_out():
    sched = make_scheduler(num_blocks=3, max_num_seqs=8)
    for i in range(3):
        sched.add(make_request(f"r{i}", range(i * 10, i * 10 + 4), max_tokens=20))
    assert scheduled(step(sched)) == {"r0": 4, "r1": 4, "r2": 4}   # 3 blocks, all full
    batch = step(sched)                                              # r0 needs a 4th block
    assert [r.request_id for r in batch.preempted] == ["r2", "r1"]
    assert scheduled(batch) == {"r0": 1}
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]     # earlier-admitted resumes first
    assert all(r.status == Status.PREEMPTED and r.num_computed_tokens == 0 for r in sched.waiting)
    assert sched.num_preemptions == 2
    check_invariants(sched.kv)


def test_a_request_preempts_itself_when_it_is_the_most_recent():
    sched = make_scheduler(num_blocks=2)
    a, b = make_request("a", range(4), max_tokens=20), make_request("b", range(10, 14), max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched)
    batch = step(sched)   # a needs a second block: b, admitted after it, gives its block up
    assert [r.request_id for r in batch.preempted] == ["b"] and scheduled(batch) == {"a": 1}
    sched2 = make_scheduler(num_blocks=1)
    c = make_request("c", range(3), max_tokens=20)
    sched2.add(c)
    step(sched2)
    step(sched2)          # c now holds 4 tokens in its one block
    batch = step(sched2)  # c needs a second block; the only victim is c itself
    assert batch.preempted == [c] and scheduled(batch) == {}


def test_waiting_requests_never_preempt_running_ones():
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", range(5), max_tokens=20)
    sched.add(a)
    step(sched)
    sched.add(make_request("b", range(100, 105)))   # needs 2 blocks, only 1 free
    for _ in range(3):
        batch = step(sched)
        assert scheduled(batch) == {"a": 1} and batch.preempted == []
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=3)
    for i in range(3):
        sched.add(make_request(f"r{i}", range(i * 10, i * 10 + 4), max_tokens=20))
    step(sched)
    sched.add(make_request("new", [1]))
    batch = step(sched)
    assert batch.preempted and "new" not in scheduled(batch)


def test_a_preempted_request_resumes_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=5)
    a = make_request("a", range(8), max_tokens=2)
    b = make_request("b", range(100, 108), max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched)                 # a: blocks 0,1; b: blocks 2,3; block 4 free; each has 1 output token
    batch = step(sched)         # a takes block 4; b finds none and is preempted (a then finishes)
    assert batch.preempted == [b] and a.finished
    assert sched.kv.prefix_hits == 0
    batch = step(sched)         # b resumes: its prompt blocks are still cached
    assert scheduled(batch) == {"b": 1} and b.num_computed_tokens == 9
    assert sched.kv.prefix_hits == 8 and b.num_cached_tokens == 0   # num_cached_tokens: first admission
    check_invariants(sched.kv)


def test_finished_requests_free_their_blocks_and_leave_running():
    sched = make_scheduler()
    req = make_request("a", range(6), max_tokens=3)
    sched.add(req)
    for _ in range(3):
        step(sched)
    assert req.finished and req.finish_reason == "length" and req.num_output_tokens == 3
    assert sched.running == [] and sched.kv.num_free_blocks == 16


def test_eos_and_stop_token_ids_end_a_request_unless_eos_is_ignored():
    sched = make_scheduler()
    sched.config.eos_token_ids = frozenset({2})
    req = make_request("a", range(6), max_tokens=9)
    req.params.ignore_eos = False
    sched.add(req)
    step(sched, token=2)
    assert req.finish_reason == "stop" and req.stop_reason == 2
    ignoring = make_request("b", range(6), max_tokens=2)   # ignore_eos=True
    sched.add(ignoring)
    step(sched, token=2)
    step(sched, token=2)
    assert ignoring.finish_reason == "length"


def test_max_model_len_ends_a_request_with_length():
    sched = make_scheduler(max_model_len=8)
    req = make_request("a", range(6), max_tokens=100)
    sched.add(req)
    for _ in range(2):
        step(sched)
    assert req.finished and req.finish_reason == "length" and req.num_tokens == 8


def test_abort_frees_everything_running_or_waiting():
    sched = make_scheduler(num_blocks=4, max_num_seqs=1)
    a, b = make_request("a", range(9), max_tokens=20), make_request("b", range(20, 29))
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.abort(a)
    sched.abort(b)
    assert a.finish_reason == b.finish_reason == "abort"
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 4
    check_invariants(sched.kv)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("asx"), st.integers(0, 3), st.integers(1, 40)), max_size=80),
       st.integers(4, 12), st.integers(4, 32))
def test_random_add_step_abort_sequences_never_leak_or_double_free(ops, num_blocks, budget):
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, max_num_seqs=4)
    live = []
    for i, (op, prefix, length) in enumerate(ops):
        if op == "a" and sched.kv.num_blocks_for(length + 4 + 6) <= num_blocks:
            req = make_request(f"r{i}", [prefix] * 4 + list(range(length)), max_tokens=6)
            sched.add(req)
            live.append(req)
        elif op == "s":
            step(sched, token=prefix)
        elif op == "x" and live:
            req = live.pop(length % len(live))
            if not req.finished:
                sched.abort(req)
        check_invariants(sched.kv)
        assert all(r.status == Status.RUNNING for r in sched.running)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        step(sched)
    assert not sched.has_unfinished(), "every request that fits the pool finishes"
    assert sched.kv.num_free_blocks == num_blocks
    check_invariants(sched.kv)


def test_queued_blocks_are_the_waiting_requests_blocks_less_their_cached_prefix():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("a", range(10), max_tokens=2))             # 3 blocks of 4; its first 2 get cached
    step(sched)
    sched.add(make_request("b", list(range(10)) + list(range(50, 56))))  # 4 blocks, 2 of them cached
    sched.add(make_request("c", range(100, 109)))                     # 3 blocks, none cached
    assert sched.queued_blocks() == 2 + 3
    step(sched)                                                       # a finishes
    step(sched)                                                       # b is admitted
    assert [r.request_id for r in sched.waiting] == ["c"] and sched.queued_blocks() == 3

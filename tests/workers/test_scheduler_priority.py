"""The priority scheduling policy (vLLM's rules): waiting requests by (priority, arrival), lower
first; the running request preempted for a block is the lowest-priority latest arrival; a waiting
request that finds no seat or no blocks preempts running requests of a strictly lower priority.
FCFS ignores priority. Priority changes the order, never the tokens. And the wire carries it."""
import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import GenerateRequest, TokenizedRequest, decode, encode
from schemas.sampling import SamplingParams
from schemas.wire import WireError
from tests.workers.engine_helpers import check_invariants, make_request, make_scheduler, scheduled, step
from workers.engine.request import Status
from workers.engine.scheduler import rank

# -- the scheduler, hand-built requests ---------------------------------------------------------


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def run_to_end(sched, most: int = 400) -> list[str]:
    """Steps until nothing is left; the request ids in the order they finished."""
    finished = []
    for _ in range(most):
        if not sched.has_unfinished():
            return finished
        finished += [r.request_id for r in step(sched).requests if r.finished]
    raise AssertionError("requests left unfinished")


def test_a_high_priority_request_takes_the_seat_of_the_lowest_priority_latest_running_one_in_the_next_step():
    sched = make_scheduler(max_num_seqs=4, policy="priority")
    for i, p in enumerate([20, 10, 20, 10]):
        sched.add(make_request(f"l{i}", range(i * 10, i * 10 + 4), max_tokens=20, priority=p))
    assert scheduled(step(sched)) == {"l0": 4, "l1": 4, "l2": 4, "l3": 4}
    sched.add(make_request("h0", range(100, 104), max_tokens=3, priority=0))
    sched.add(make_request("h1", range(110, 114), max_tokens=3, priority=0))
    batch = step(sched)
    assert ids(batch.preempted) == ["l2", "l0"]               # priority 20 first, the later arrival first
    assert scheduled(batch) == {"l1": 1, "l3": 1, "h0": 4, "h1": 4}
    assert ids(sched.running) == ["h0", "h1", "l1", "l3"]     # by (priority, arrival)
    assert ids(sched.waiting) == ["l0", "l2"]
    assert all(r.status == Status.PREEMPTED and r.num_computed_tokens == 0 for r in sched.waiting)
    check_invariants(sched.kv)
    assert run_to_end(sched)[:2] == ["h0", "h1"]


def test_a_preempted_requests_tokens_of_the_step_go_back_to_the_budget():
    sched = make_scheduler(max_num_seqs=2, budget=3, policy="priority")
    sched.add(make_request("a", range(2), max_tokens=20, priority=5))
    sched.add(make_request("b", range(10, 12), max_tokens=20, priority=5))
    step(sched)
    step(sched)                                               # both decoding: 1 token each, 1 left
    sched.add(make_request("h", range(100, 108), max_tokens=3, priority=1))
    batch = step(sched)
    assert ids(batch.preempted) == ["b"]
    assert scheduled(batch) == {"a": 1, "h": 2}               # b's token went to h: 3 - 1, not 3 - 2
    assert batch.num_tokens == 3
    check_invariants(sched.kv)


def test_a_waiting_request_short_of_budget_alone_waits_rather_than_preempt():
    sched = make_scheduler(max_num_seqs=4, budget=6, policy="priority")
    sched.config.enable_chunked_prefill = False
    sched.add(make_request("a", range(2), max_tokens=20, priority=5))
    sched.add(make_request("b", range(10, 12), max_tokens=20, priority=5))
    step(sched)
    sched.add(make_request("h", range(100, 105), max_tokens=3, priority=0))    # 5 tokens; 4 left after a and b
    batch = step(sched)
    assert scheduled(batch) == {"a": 1, "b": 1} and batch.preempted == []
    assert ids(sched.waiting) == ["h"]


def test_the_victim_for_a_block_is_the_lowest_priority_then_latest_arrival_not_the_last_admitted():
    def two_steps(policy):
        sched = make_scheduler(num_blocks=4, policy=policy)
        for i, p in enumerate([1, 5, 5, 0]):
            sched.add(make_request(f"r{i}", range(i * 10, i * 10 + 4), max_tokens=20, priority=p))
        step(sched)                                           # 4 blocks, all full
        return sched, step(sched)                             # each needs a second block

    sched, batch = two_steps("priority")
    assert ids(batch.preempted) == ["r2", "r1"]               # priority 5, later arrival first
    assert scheduled(batch) == {"r3": 1, "r0": 1}             # by priority: r3 (0) before r0 (1)
    assert ids(sched.waiting) == ["r1", "r2"]
    check_invariants(sched.kv)
    sched, batch = two_steps("fcfs")                          # FCFS: the last admitted, whatever its priority
    assert ids(batch.preempted) == ["r3", "r2"] and scheduled(batch) == {"r0": 1, "r1": 1}


def test_a_running_request_preempts_itself_when_it_has_the_lowest_priority():
    sched = make_scheduler(num_blocks=2, policy="priority")
    sched.add(make_request("low", range(4), max_tokens=20, priority=9))
    sched.add(make_request("high", range(10, 14), max_tokens=20, priority=0))
    step(sched)
    batch = step(sched)                                       # both need a second block; none is free
    assert ids(batch.preempted) == ["low"] and scheduled(batch) == {"high": 1}


def test_waiting_requests_run_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, p in [("a", 5), ("b", 1), ("c", 5), ("d", 1), ("e", 0)]:
        sched.add(make_request(rid, range(4), max_tokens=1, priority=p))
    assert ids(sched.waiting) == ["e", "b", "d", "a", "c"]
    assert [ids(step(sched).requests) for _ in range(5)] == [["e"], ["b"], ["d"], ["a"], ["c"]]


def test_a_waiting_request_never_preempts_one_of_equal_or_higher_priority():
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    sched.add(make_request("hi", range(4), max_tokens=20, priority=0))
    sched.add(make_request("eq", range(10, 14), max_tokens=20, priority=3))
    step(sched)
    sched.add(make_request("late", range(20, 24), max_tokens=20, priority=3))
    for _ in range(3):
        batch = step(sched)
        assert batch.preempted == [] and scheduled(batch) == {"hi": 1, "eq": 1}
    assert ids(sched.waiting) == ["late"]


def test_a_preempted_request_resumes_before_later_arrivals_of_its_priority_and_after_higher_ones():
    sched = make_scheduler(num_blocks=3, policy="priority")
    a = make_request("a", range(4), max_tokens=4, priority=3)
    x = make_request("x", range(10, 14), max_tokens=4, priority=3)
    sched.add(a)
    sched.add(x)
    step(sched)                                               # 2 blocks, 1 free
    assert ids(step(sched).preempted) == ["x"]                # a takes the free block; x, the later, gives its up
    sched.add(make_request("y", range(20, 24), max_tokens=4, priority=3))
    sched.add(make_request("z", range(30, 34), max_tokens=4, priority=1))
    assert ids(sched.waiting) == ["z", "x", "y"]
    batch = step(sched)                                       # z takes x's block; x waits: a is no lower
    assert scheduled(batch) == {"a": 1, "z": 4} and batch.preempted == []
    admitted = []
    while sched.has_unfinished():
        admitted += [r.request_id for r in step(sched).requests if r.request_id not in admitted + ["a", "z"]]
    assert admitted == ["x", "y"]
    assert sched.kv.num_free_blocks == 3
    check_invariants(sched.kv)


WORKLOAD = [("add", "a", 9), ("add", "b", 9), ("add", "c", 9), ("step",), ("add", "d", 0), ("step",),
            ("add", "e", 4), ("add", "f", 0), ("step",), ("step",), ("add", "g", 2), ("run",)]


def trace(policy: str, priorities: bool) -> list[tuple[dict[str, int], list[str]]]:
    """Each step's scheduled tokens and preempted requests over WORKLOAD (2 seats, 6 blocks)."""
    sched = make_scheduler(num_blocks=6, max_num_seqs=2, policy=policy)
    out = []
    for n, (op, *args) in enumerate(WORKLOAD):
        if op == "add":
            rid, p = args
            sched.add(make_request(rid, range(n * 10, n * 10 + 5), max_tokens=6, priority=p if priorities else 0))
        for _ in range({"add": 0, "step": 1, "run": 200}[op]):
            if sched.has_unfinished():
                batch = step(sched)
                out.append((scheduled(batch), ids(batch.preempted)))
    assert not sched.has_unfinished()
    return out


def test_fcfs_ignores_priority_entirely():
    fcfs = trace("fcfs", priorities=False)
    assert trace("fcfs", priorities=True) == fcfs
    assert trace("priority", priorities=True) != fcfs         # the workload is one where priority matters
    assert trace("priority", priorities=False) == fcfs        # and with one priority for all, it is FCFS


OPS = st.lists(st.tuples(st.sampled_from("aaisx"), st.integers(-2, 2), st.integers(1, 40)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(4, 12), st.integers(4, 32), st.integers(1, 4))
def test_random_priority_workloads_never_leak_keep_both_queues_in_order_and_finish(ops, num_blocks, budget, seats):
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, max_num_seqs=seats, policy="priority")
    live = []
    for i, (op, priority, length) in enumerate(ops):
        if op in "ai" and sched.kv.num_blocks_for(length + 4 + 6) <= num_blocks:
            req = make_request(f"r{i}", [priority % 3] * 4 + list(range(length)), max_tokens=6, priority=priority)
            req.isolate = op == "i"                   # a suspect: runs alone until its first token
            sched.add(req)
            live.append(req)
        elif op == "s":
            batch = step(sched)
            for victim in batch.preempted:            # never one ranked above a request the step runs
                assert all(rank(r) < rank(victim) for r in batch.requests if r is not victim)
        elif op == "x" and live:
            req = live.pop(length % len(live))
            if not req.finished:
                sched.abort(req)
        check_invariants(sched.kv)
        assert all(r.status == Status.RUNNING for r in sched.running)
        assert [rank(r) for r in sched.running] == sorted(rank(r) for r in sched.running)
        assert [rank(r) for r in sched.waiting] == sorted(rank(r) for r in sched.waiting)
    run_to_end(sched)
    assert sched.kv.num_free_blocks == num_blocks
    check_invariants(sched.kv)


@settings(max_examples=100, deadline=None)
@given(OPS, st.integers(4, 12), st.integers(4, 32), st.integers(1, 4))
def test_with_one_priority_for_all_the_priority_policy_schedules_exactly_like_fcfs(ops, num_blocks, budget, seats):
    scheds = [make_scheduler(num_blocks=num_blocks, budget=budget, max_num_seqs=seats, policy=p)
              for p in ("fcfs", "priority")]
    for i, (op, prefix, length) in enumerate(ops):
        if op in "ai" and scheds[0].kv.num_blocks_for(length + 4 + 6) <= num_blocks:
            for s in scheds:
                req = make_request(f"r{i}", [prefix % 3] * 4 + list(range(length)), max_tokens=6, priority=7)
                req.isolate = op == "i"
                s.add(req)
        elif op == "s":
            a, b = (step(s) for s in scheds)
            assert (scheduled(a), ids(a.preempted)) == (scheduled(b), ids(b.preempted))


# -- the engine, a tiny model: the same tokens in another order --------------------------------


LOW = [list(range(10 + i, 30 + i)) for i in range(5)]            # priority 10, from the start
HIGH = [list(range(200 + i, 209 + i)) for i in range(2)]         # priority 0, after two steps


def serve(model_dir: str, policy: str, **config) -> tuple[dict[str, list[int]], list[str], dict]:
    """Greedy outputs by request id, the order they finished, the engine's stats."""
    from workers.engine.engine import EngineConfig, LLMEngine
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", scheduling_policy=policy, **config))
    greedy = {"temperature": 0, "ignore_eos": True}
    reqs = [engine.add_request(f"low{i}", p, SamplingParams(max_tokens=12, **greedy), priority=10)
            for i, p in enumerate(LOW)]
    finished = []
    for n in range(500):
        if n == 2:
            reqs += [engine.add_request(f"high{i}", p, SamplingParams(max_tokens=4, **greedy), priority=0)
                     for i, p in enumerate(HIGH)]
        finished += [r.request_id for r in engine.step() if r.finished]
        if not engine.has_unfinished():
            break
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return {r.request_id: r.output_token_ids for r in reqs}, finished, engine.stats()


@pytest.mark.parametrize("config", [{"num_kv_blocks": 64, "max_num_seqs": 3},      # seats run out
                                    {"num_kv_blocks": 5, "max_num_seqs": 8, "block_size": 8}],   # blocks do
                         ids=["seats", "blocks"])
def test_priority_changes_the_order_not_the_tokens(model_dir, config):
    fcfs, fcfs_order, _ = serve(model_dir, "fcfs", **config)
    prio, prio_order, stats = serve(model_dir, "priority", **config)
    assert prio == fcfs
    assert stats["preemptions"] > 0
    assert prio_order == ["high0", "high1", "low0", "low1", "low2", "low3", "low4"]
    assert fcfs_order.index("high0") > 2                      # FCFS: behind the low-priority requests


def test_a_late_high_priority_request_starts_in_the_next_step_and_finishes_first(model_dir):
    from workers.engine.engine import EngineConfig, LLMEngine
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", scheduling_policy="priority", max_num_seqs=3,
                                               num_kv_blocks=64))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, p in enumerate(LOW[:3]):
        engine.add_request(f"low{i}", p, greedy, priority=10)
    engine.step()
    engine.add_request("high", HIGH[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), priority=0)
    assert "high" in ids(engine.step())
    assert ids(engine.scheduler.waiting) == ["low2"]
    finished = []
    while engine.has_unfinished():
        finished += [r.request_id for r in engine.step() if r.finished]
    assert finished[0] == "high"


def test_the_engine_refuses_a_priority_out_of_range_or_a_policy_it_does_not_know(model_dir):
    from workers.engine.engine import EngineConfig, LLMEngine
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_kv_blocks=16))
    with pytest.raises(ValueError, match=r"priority must be in \[MIN_PRIORITY, MAX_PRIORITY\] = "
                                         r"\[-2147483648, 2147483647\] \(got 2147483648\)"):
        engine.add_request("r", [1, 2, 3], SamplingParams(), priority=1 << 31)
    assert engine.add_request("r", [1, 2, 3], SamplingParams(), priority=-(1 << 31)).priority == -(1 << 31)


def test_the_offline_api_takes_one_priority_per_prompt(tiny_model):
    from workers import LLM
    llm = LLM(tiny_model, num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    plain = llm.generate(["a b", "c d", "e f"], params)
    ranked = llm.generate(["a b", "c d", "e f"], params, priority=[5, 0, 5])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]      # outputs in the prompts' order
    with pytest.raises(ValueError, match="priority: 1 priorities for 2 prompts"):
        llm.generate(["x", "y"], params, priority=[0])
    with pytest.raises(ValueError, match=r"priority\[1\]: priority must be in"):
        llm.generate(["x", "y"], params, priority=[0, 1 << 40])
    assert not llm.engine.has_unfinished()


# -- the wire: gateway → tokenizer → worker -------------------------------------------------------


def test_priority_round_trips_and_out_of_range_is_refused_naming_the_field_and_bound():
    for msg in (GenerateRequest("r1", "t", SamplingParams(), prompt="x", priority=-7),
                TokenizedRequest("r1", "t", SamplingParams(), [5, 6], priority=2**31 - 1)):
        assert decode(encode(msg)) == msg
    for msg in (GenerateRequest("r1", "t", SamplingParams(), prompt="x", priority=2**31),
                TokenizedRequest("r1", "t", SamplingParams(), [5], priority=-2**31 - 1)):
        with pytest.raises(WireError, match=r"priority: -?\d+ is outside \[-2147483648, 2147483647\]"):
            decode(encode(msg))
    with pytest.raises(WireError, match="priority"):
        decode(encode(GenerateRequest("r1", "t", SamplingParams(), prompt="x", priority="high")))


def test_the_router_carries_priority_weight_and_tokens_into_the_tokenized_request_and_seeds_it(monkeypatch):
    from services.router.service import RouterService

    routed = []

    async def route(self, msg, req):
        routed.append(req)

    monkeypatch.setattr(RouterService, "route", route)
    msg = SimpleNamespace(data=encode(GenerateRequest("r1", "t", SamplingParams(), prompt="x", priority=-3, weight=3,
                                                      tokens=[5, 6])), subject="tb.req.new.t")
    svc = RouterService(SimpleNamespace(jetstream=lambda: None, stats={"reconnects": 0}))
    asyncio.run(svc.handle_new(msg))
    assert [(p.priority, p.weight, p.prompt_token_ids) for p in routed] == [(-3, 3.0, [5, 6])]
    assert routed[0].sampling.seed is not None          # a re-routed or replayed request yields the same tokens


def test_the_worker_passes_priority_to_the_engine(model_dir):
    from bus.log import configure
    from workers.engine.engine import EngineConfig, LLMEngine
    from workers.service import WorkerService, engine_config, parser
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_kv_blocks=16, scheduling_policy="priority"))
    service = WorkerService(SimpleNamespace(jetstream=lambda: None), engine, "w0", "tiny", configure("worker"))
    service.intake.add(TokenizedRequest("r1", "t", SamplingParams(seed=1), [5, 6, 7], priority=4), [], 0)
    assert engine.requests["r1"].priority == 4
    assert engine_config(parser().parse_args(["--model", "m"])).scheduling_policy == "fcfs"
    args = parser().parse_args(["--model", "m", "--scheduling-policy", "priority"])
    assert engine_config(args).scheduling_policy == "priority"


def test_tokenbus_up_passes_the_scheduling_policy_to_its_workers():
    from ops.cli import parser as tokenbus
    from ops.up import worker_args
    assert worker_args(tokenbus().parse_args(["up"])) == []
    assert worker_args(tokenbus().parse_args(["up", "--scheduling-policy", "priority"])) == [
        "--scheduling-policy", "priority"]

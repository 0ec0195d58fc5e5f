"""The fair scheduling policy (a virtual token counter per tenant, workers/engine/fair.py): a steady
tenant's first tokens stay prompt under another tenant's flood, backlogged tenants' shares of
generated tokens follow their weights, the least deserving request is preempted, a tenant arriving idle
takes a seat from a tenant running several, idle time banks no credit, and idle tenants are forgotten.
The engine, the offline API, the worker and the wire carry tenants and weights (the tokenizer:
test_scheduler_priority.py)."""
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import GenerateRequest, TokenizedRequest, decode, encode
from schemas.sampling import SamplingParams
from schemas.wire import WireError
from tests.workers.engine_helpers import check_invariants, make_request, make_scheduler, scheduled, step
from workers.engine import fair


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def counter(sched, tenant: str) -> float:
    return sched.waiting.tenants[tenant].counter


# -- a flood and a steady tenant: the steady one's TTFT in steps -------------------------------------

FLOOD, STEADY = 48, 10              # a's requests, queued at once; b's, one every EVERY steps
EVERY = 6


def steady_ttfts(policy: str, flood: int = FLOOD, **shape) -> list[int]:
    """Steps from each of b's requests arriving to the step that samples its first token (1: the first
    step after it arrived), with a's flood queued ahead of it."""
    sched = make_scheduler(policy=policy, budget=64, **shape)
    for i in range(flood):
        sched.add(make_request(f"a{i}", range(1000 + 8 * i, 1008 + 8 * i), max_tokens=24, tenant="a"))
    arrived, ttft, n = {}, {}, 0
    while sched.has_unfinished() or len(arrived) < STEADY:
        if n % EVERY == 0 and len(arrived) < STEADY:
            rid = f"b{len(arrived)}"
            sched.add(make_request(rid, range(5000 + 8 * len(arrived), 5008 + 8 * len(arrived)), max_tokens=4,
                                   tenant="b"))
            arrived[rid] = n
        n += 1
        for req in step(sched).requests:
            if req.tenant == "b" and req.num_output_tokens and req.request_id not in ttft:
                ttft[req.request_id] = n - arrived[req.request_id]
        check_invariants(sched.kv)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return [ttft[f"b{i}"] for i in range(STEADY)]


@pytest.mark.parametrize("shape", [{"max_num_seqs": 4, "num_blocks": 256},      # seats run out
                                   {"max_num_seqs": 16, "num_blocks": 40}],     # blocks do
                         ids=["seats", "blocks"])
def test_a_steady_tenant_s_ttft_under_a_flood_stays_within_2x_of_idle_with_fair_and_not_with_fcfs(shape):
    idle = steady_ttfts("fair", flood=0, **shape)
    assert idle == [1] * STEADY                                 # its prompt and first token in one step
    fair_ttfts = steady_ttfts("fair", **shape)
    assert max(fair_ttfts) <= 2 * max(idle), fair_ttfts
    fcfs_ttfts = steady_ttfts("fcfs", **shape)
    print(f"\nb's TTFT in steps: idle {idle}, fair {fair_ttfts}, fcfs {fcfs_ttfts}")
    assert min(fcfs_ttfts) >= 50 * max(idle), fcfs_ttfts         # behind the flood: 105-289 steps


# -- two backlogged tenants: shares of generated tokens by weight ------------------------------------


def shares(policy: str, weights: dict[str, float], seats: int = 4, blocks: int = 512) -> dict[str, float]:
    """Each tenant's share of the tokens generated while both still have requests queued: 60 each,
    a's all queued before b's, 4-28 output tokens."""
    sched = make_scheduler(policy=policy, budget=64, max_num_seqs=seats, num_blocks=blocks)
    lengths = random.Random(1)
    for tenant, base in (("a", 0), ("b", 100_000)):
        for i in range(60):
            sched.add(make_request(f"{tenant}{i}", range(base + 8 * i, base + 8 * i + 8),
                                   max_tokens=lengths.randint(4, 28), tenant=tenant, weight=weights[tenant]))
    generated = {"a": 0, "b": 0}
    while {r.tenant for r in sched.waiting} == {"a", "b"}:
        batch = step(sched)
        for req, samples in zip(batch.requests, batch.samples):
            generated[req.tenant] += samples
    total = sum(generated.values())
    assert total > 500
    return {t: n / total for t, n in generated.items()}


@pytest.mark.parametrize("weights", [{"a": 1, "b": 1}, {"a": 2, "b": 1}, {"a": 1, "b": 3}], ids=["1:1", "2:1", "1:3"])
@pytest.mark.parametrize("shape", [{}, {"seats": 16, "blocks": 48}], ids=["seats", "blocks"])
def test_backlogged_tenants_shares_of_generated_tokens_are_within_10_percent_of_their_weights(weights, shape):
    got = shares("fair", weights, **shape)
    print(f"\nshares at weights {weights}: {({t: round(v, 3) for t, v in got.items()})}")
    for tenant, w in weights.items():
        want = w / sum(weights.values())
        assert abs(got[tenant] / want - 1) <= 0.10, (tenant, got, want)


def test_fcfs_serves_the_tenant_that_queued_first_alone():
    assert shares("fcfs", {"a": 1, "b": 1})["a"] > 0.95


# -- the counters ----------------------------------------------------------------------------------


def test_a_counter_grows_by_input_tokens_computed_once_and_twice_the_tokens_generated_over_the_weight():
    sched = make_scheduler(budget=8, policy="fair")
    sched.add(make_request("r", range(12), max_tokens=3, tenant="t", weight=2))
    step(sched)                                               # 8 of 12 prompt tokens, charged on admission
    assert counter(sched, "t") == 8 / 2
    step(sched)                                               # the other 4, and the first token
    assert counter(sched, "t") == (12 * fair.W_INPUT + 1 * fair.W_OUTPUT) / 2 == 7
    sched.add(make_request("s", [*range(8), 99, 98], max_tokens=2, tenant="t", weight=2))
    step(sched)                                               # s: 8 tokens hit r's blocks, 2 computed
    assert counter(sched, "t") == 7 + (2 + 1 * 2) / 2 + 1 * 2 / 2


def test_recomputing_a_preempted_request_is_not_charged_again():
    sched = make_scheduler(num_blocks=3, policy="fair")
    a = make_request("a", range(4), max_tokens=4, tenant="x")
    b = make_request("b", range(10, 14), max_tokens=4, tenant="y", weight=2)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert (counter(sched, "x"), counter(sched, "y")) == (4 + 2, (4 + 2) / 2)
    assert ids(step(sched).preempted) == ["a"]               # each needs a second block, 1 is free: x is higher
    assert (a.billed_input, a.billed_output) == (4, 1)
    while not b.finished:
        step(sched)
    assert counter(sched, "x") == 6
    assert scheduled(step(sched)) == {"a": 1}                 # a resumes: its first block a hit, 1 token recomputed
    assert counter(sched, "x") == 6 + 2                       # and only the token it generated is charged


# -- preemption ------------------------------------------------------------------------------------


def test_a_block_is_taken_from_the_tenant_with_the_highest_counter_its_latest_request_first():
    def two_steps(policy):
        sched = make_scheduler(num_blocks=4, policy=policy)
        for i, (rid, tenant, weight) in enumerate([("x0", "x", 1), ("y0", "y", 2), ("x1", "x", 1), ("y1", "y", 2)]):
            sched.add(make_request(rid, range(10 * i, 10 * i + 4), max_tokens=20, tenant=tenant, weight=weight))
        admitted = ids(step(sched).requests)                  # 4 blocks, all full
        counters = (counter(sched, "x"), counter(sched, "y")) if policy == "fair" else None
        return sched, admitted, counters, step(sched)         # each needs a second block

    sched, admitted, counters, batch = two_steps("fair")
    assert admitted == ["x0", "y0", "y1", "x1"]               # y1 at 2 before x1 at 4; then x1 (y runs 2, x 1)
    assert counters == (2 * 4 + 2 * 2, (2 * 4 + 2 * 2) / 2)
    assert ids(batch.preempted) == ["x1", "x0"]               # x: 12 > y: 6; the later arrival first
    assert scheduled(batch) == {"y0": 1, "y1": 1}
    check_invariants(sched.kv)
    sched, admitted, _, batch = two_steps("fcfs")                # FCFS: the last admitted, whatever its tenant
    assert ids(batch.preempted) == ["y1", "x1"]


def test_a_tenant_arriving_idle_takes_the_seat_of_the_latest_request_of_a_tenant_running_several_at_once():
    sched = make_scheduler(max_num_seqs=3, policy="fair")
    for i in range(4):
        sched.add(make_request(f"a{i}", range(10 * i, 10 * i + 4), max_tokens=20, tenant="a"))
    assert scheduled(step(sched)) == {"a0": 4, "a1": 4, "a2": 4}
    sched.add(make_request("b0", range(100, 104), max_tokens=2, tenant="b"))
    assert counter(sched, "b") == counter(sched, "a")         # lifted to the waiting tenants' floor
    batch = step(sched)
    assert ids(batch.preempted) == ["a2"]
    assert scheduled(batch) == {"a0": 1, "a1": 1, "b0": 4}    # its first token in the step after it arrived
    assert ids(sched.waiting) == ["a2", "a3"]                 # a2 back at its own place in a's queue
    check_invariants(sched.kv)


def test_a_tenant_arriving_idle_takes_blocks_even_in_a_step_where_another_tenant_s_request_preempted():
    sched = make_scheduler(num_blocks=6, max_num_seqs=8, policy="fair")
    for i in range(3):
        sched.add(make_request(f"a{i}", range(10 * i, 10 * i + 8), max_tokens=20, tenant="a"))
    step(sched)                                               # 6 blocks, all full
    sched.add(make_request("b0", range(100, 104), max_tokens=2, tenant="b"))
    batch = step(sched)                                       # a0 needs a block: a2 gives up two, a1 takes
    #                                                           the other; then b0 takes a1's
    assert ids(batch.preempted) == ["a2", "a1"]
    assert scheduled(batch) == {"a0": 1, "b0": 4}
    check_invariants(sched.kv)


def test_an_idle_tenant_does_not_preempt_a_tenant_s_only_request_nor_one_below_its_counter_nor_a_busy_one():
    def run(requests, seats):
        sched = make_scheduler(max_num_seqs=seats, policy="fair")
        for i, (rid, tenant) in enumerate(requests):
            sched.add(make_request(rid, range(10 * i, 10 * i + 4), max_tokens=20, tenant=tenant))
            step(sched)
        sched.add(make_request("late", range(900, 904), max_tokens=2, tenant="b"))
        return sched, step(sched)

    sched, batch = run([("a0", "a"), ("c0", "c")], seats=2)                 # each runs one: no seat to take
    assert batch.preempted == [] and ids(sched.waiting) == ["late"]
    sched, batch = run([("b0", "b"), ("a0", "a"), ("a1", "a")], seats=3)    # b runs one already
    assert batch.preempted == [] and ids(sched.waiting) == ["late"]
    sched = make_scheduler(max_num_seqs=2, policy="fair")
    sched.add(make_request("b0", range(40), max_tokens=1, tenant="b"))     # b was served 40 + 2
    step(sched)
    for i in range(2):
        sched.add(make_request(f"a{i}", range(100 + 10 * i, 104 + 10 * i), max_tokens=20, tenant="a", weight=100))
    step(sched)
    sched.add(make_request("b1", range(200, 204), max_tokens=2, tenant="b"))
    assert counter(sched, "a") < counter(sched, "b")          # a: lifted to 40, then 0.02 an input token
    batch = step(sched)
    assert batch.preempted == [] and ids(sched.waiting) == ["b1"]


def test_backlogged_tenants_never_preempt_each_other():
    sched = make_scheduler(max_num_seqs=4, num_blocks=256, policy="fair")
    lengths = random.Random(2)
    for tenant in "abcd":                                     # a's flood first, then b's, c's and d's
        for i in range(12):
            base = ord(tenant) * 1000 + 8 * i
            sched.add(make_request(f"{tenant}{i}", range(base, base + 8), max_tokens=lengths.randint(2, 20),
                                   tenant=tenant))
    while sched.has_unfinished():
        assert len(step(sched).requests) == 4 or not sched.waiting
    assert sched.num_preemptions == 0


def test_priority_comes_first_then_the_counters():
    sched = make_scheduler(max_num_seqs=1, policy="fair")
    for rid, tenant, p in [("a0", "a", 5), ("a1", "a", 5), ("b0", "b", 5), ("a2", "a", 1), ("b1", "b", 1)]:
        sched.add(make_request(rid, range(4), max_tokens=1, priority=p, tenant=tenant))
    assert [ids(step(sched).requests) for _ in range(5)] == [["a2"], ["b1"], ["a0"], ["b0"], ["a1"]]
    sched = make_scheduler(max_num_seqs=2, policy="fair")
    sched.add(make_request("low", range(4), max_tokens=20, priority=9, tenant="a"))
    sched.add(make_request("mine", range(10, 14), max_tokens=20, priority=0, tenant="b"))
    step(sched)
    sched.add(make_request("urgent", range(20, 24), max_tokens=2, priority=0, tenant="b"))
    batch = step(sched)                                       # a less urgent request is preempted, whoever runs it
    assert ids(batch.preempted) == ["low"] and scheduled(batch) == {"mine": 1, "urgent": 4}


# -- idle tenants ----------------------------------------------------------------------------------


def test_a_returning_tenant_banks_no_credit_for_its_idle_time():
    sched = make_scheduler(max_num_seqs=4, num_blocks=256, policy="fair")
    for i in range(80):
        sched.add(make_request(f"a{i}", range(8 * i, 8 * i + 8), max_tokens=16, tenant="a"))
    for _ in range(100):                                      # a alone: its counter grows, b's does not exist
        step(sched)
    for i in range(40):
        sched.add(make_request(f"b{i}", range(50_000 + 8 * i, 50_008 + 8 * i), max_tokens=16, tenant="b"))
    assert counter(sched, "b") == counter(sched, "a") > 800
    generated = {"a": 0, "b": 0}
    for _ in range(100):
        batch = step(sched)
        for req, samples in zip(batch.requests, batch.samples):
            generated[req.tenant] += samples
    assert abs(generated["b"] / sum(generated.values()) - 0.5) <= 0.05     # not b alone until it caught up


def test_a_tenant_arriving_to_an_empty_queue_is_lifted_to_the_floor_and_never_lowered():
    sched = make_scheduler(policy="fair")
    sched.add(make_request("a0", range(40), max_tokens=1, tenant="a"))
    step(sched)                                               # a's queue emptied at 40 (its prompt); a0 ended at 42
    sched.add(make_request("b0", range(100, 104), max_tokens=1, tenant="b"))
    assert counter(sched, "b") == 40                          # nothing waiting: the counter of the last that left
    step(sched)                                               # b's queue emptied at 44; b0 ended at 46
    sched.add(make_request("a1", range(200, 204), max_tokens=1, tenant="a"))
    assert counter(sched, "a") == 44                          # lifted from its 42
    sched.add(make_request("b1", range(300, 304), max_tokens=1, tenant="b"))
    assert counter(sched, "b") == 46                          # above the floor (a's 44): kept


def test_tenants_idle_for_forget_steps_are_forgotten(monkeypatch):
    monkeypatch.setattr(fair, "FORGET_STEPS", 8)
    sched = make_scheduler(policy="fair")
    sched.add(make_request("gone", range(4), max_tokens=1, tenant="old"))
    sched.add(make_request("long", range(10, 14), max_tokens=30, tenant="busy"))
    sched.add(make_request("late", range(20, 24), max_tokens=30, tenant="waits"))
    sched.config.max_num_seqs = 2
    for _ in range(7):
        step(sched)
    assert set(sched.waiting.tenants) == {"old", "busy", "waits"}
    for _ in range(9):
        step(sched)                                           # 16 steps: "old" idle 15 of them
    assert set(sched.waiting.tenants) == {"busy", "waits"}    # running and waiting tenants are kept


# -- properties ------------------------------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from("aaaisx"), st.integers(0, 3), st.integers(-1, 1), st.integers(1, 40)),
               max_size=80)


def check_tenants(sched) -> None:
    q = sched.waiting
    assert len(q) == sum(len(t.queue) for t in q.tenants.values()) == len(list(q))
    assert set(q.active) == {name for name, t in q.tenants.items() if t.queue}
    for name, t in q.tenants.items():
        assert t.running == sum(r.tenant == name for r in sched.running) >= 0


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(4, 12), st.integers(4, 32), st.integers(1, 4))
def test_random_fair_workloads_never_leak_keep_each_tenant_s_count_and_finish(ops, num_blocks, budget, seats):
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, max_num_seqs=seats, policy="fair")
    live = []
    for i, (op, tenant, priority, length) in enumerate(ops):
        if op in "ai" and sched.kv.num_blocks_for(length + 4 + 6) <= num_blocks:
            req = make_request(f"r{i}", [tenant] * 4 + list(range(length)), max_tokens=6, priority=priority,
                               tenant=f"t{tenant}", weight=1 + tenant)
            req.isolate = op == "i"
            sched.add(req)
            live.append(req)
        elif op == "s":
            step(sched)
        elif op == "x" and live:
            req = live.pop(length % len(live))
            if not req.finished:
                sched.abort(req)
        check_invariants(sched.kv)
        check_tenants(sched)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        step(sched)
        check_tenants(sched)
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == num_blocks


@settings(max_examples=100, deadline=None)
@given(OPS, st.integers(4, 12), st.integers(4, 32), st.integers(1, 4))
def test_with_one_tenant_the_fair_policy_schedules_exactly_like_the_priority_policy(ops, num_blocks, budget, seats):
    scheds = [make_scheduler(num_blocks=num_blocks, budget=budget, max_num_seqs=seats, policy=p)
              for p in ("priority", "fair")]
    for i, (op, prefix, priority, length) in enumerate(ops):
        if op in "ai" and scheds[0].kv.num_blocks_for(length + 4 + 6) <= num_blocks:
            for s in scheds:
                req = make_request(f"r{i}", [prefix] * 4 + list(range(length)), max_tokens=6, priority=priority,
                                   tenant="only", weight=3)
                req.isolate = op == "i"
                s.add(req)
        elif op == "s":
            a, b = (step(s) for s in scheds)
            assert (scheduled(a), ids(a.preempted)) == (scheduled(b), ids(b.preempted))


# -- the engine, a tiny model: the same tokens in another order --------------------------------------


def serve(model_dir: str, policy: str) -> tuple[dict[str, list[int]], list[str]]:
    """A flood of a's and two of b's arriving later, on 3 seats: greedy outputs by id, the order of first tokens."""
    from workers.engine.engine import EngineConfig, LLMEngine
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", scheduling_policy=policy, max_num_seqs=3,
                                               num_kv_blocks=64))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"a{i}", list(range(10 + i, 30 + i)), greedy, tenant="a") for i in range(6)]
    started = []
    for n in range(500):
        if n == 2:
            reqs += [engine.add_request(f"b{i}", list(range(200 + i, 209 + i)), greedy, tenant="b", weight=2)
                     for i in range(2)]
        engine.step()
        started += [r.request_id for r in reqs if r.num_output_tokens and r.request_id not in started]
        if not engine.has_unfinished():
            break
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return {r.request_id: r.output_token_ids for r in reqs}, started


def test_fair_changes_the_order_not_the_tokens(model_dir):
    fcfs, fcfs_order = serve(model_dir, "fcfs")
    fair_tokens, fair_order = serve(model_dir, "fair")
    assert fair_tokens == fcfs
    assert fair_order[3] == "b0"                              # the step after it arrived, taking a2's seat
    assert fcfs_order.index("b0") == 6                        # FCFS: after every a


def test_the_engine_refuses_a_weight_out_of_range(model_dir):
    from workers.engine.engine import EngineConfig, LLMEngine
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_kv_blocks=16, scheduling_policy="fair"))
    for weight in (0, -1, 1e4, float("nan"), "2", True):
        with pytest.raises(ValueError, match=r"weight must be a number in \[MIN_WEIGHT, MAX_WEIGHT\] = "
                                             r"\[0\.001, 1000\.0\]"):
            engine.add_request("r", [1, 2, 3], SamplingParams(), tenant="t", weight=weight)
    req = engine.add_request("r", [1, 2, 3], SamplingParams(), tenant="t", weight=2)
    assert (req.tenant, req.weight) == ("t", 2)


def test_the_offline_api_takes_a_tenant_per_prompt_and_weights_by_tenant(tiny_model):
    from workers import LLM
    llm = LLM(tiny_model, num_kv_blocks=64, max_num_seqs=1, scheduling_policy="fair")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    plain = llm.generate(["a b", "c d", "e f"], params)
    shared = llm.generate(["a b", "c d", "e f"], params, tenant=["x", "x", "y"], weights={"y": 4})
    assert [o.token_ids for o in shared] == [o.token_ids for o in plain]     # outputs in the prompts' order
    with pytest.raises(ValueError, match="tenant: 1 tenants for 2 prompts"):
        llm.generate(["x", "y"], params, tenant=["x"])
    with pytest.raises(ValueError, match=r"weights\['y'\]: weight must be a number in"):
        llm.generate(["x", "y"], params, tenant=["x", "y"], weights={"y": 0})
    assert not llm.engine.has_unfinished()


# -- the wire: gateway → tokenizer → worker -------------------------------------------------------


def test_weight_round_trips_and_out_of_range_is_refused_naming_the_field_and_bound():
    for msg in (GenerateRequest("r1", "t", SamplingParams(), prompt="x", weight=2.5),
                TokenizedRequest("r1", "t", SamplingParams(), [5, 6], weight=1e3)):
        assert decode(encode(msg)) == msg
    assert decode(encode(GenerateRequest("r1", "t", SamplingParams(), prompt="x", weight=2))).weight == 2.0
    for weight in (0.0, 1e3 + 1, float("nan"), float("inf")):
        for msg in (GenerateRequest("r1", "t", SamplingParams(), prompt="x", weight=weight),
                    TokenizedRequest("r1", "t", SamplingParams(), [5], weight=weight)):
            with pytest.raises(WireError, match=r"weight: \S+ is outside \[0\.001, 1000\.0\]"):
                decode(encode(msg))
    with pytest.raises(WireError, match="weight"):
        decode(encode(GenerateRequest("r1", "t", SamplingParams(), prompt="x", weight="heavy")))


def test_the_worker_passes_tenant_and_weight_to_the_engine_and_takes_the_fair_policy(model_dir):
    from bus.log import configure
    from workers.engine.engine import EngineConfig, LLMEngine
    from workers.service import WorkerService, engine_config, parser
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_kv_blocks=16, scheduling_policy="fair"))
    service = WorkerService(SimpleNamespace(jetstream=lambda: None), engine, "w0", "tiny", configure("worker"))
    service.intake.add(TokenizedRequest("r1", "acme", SamplingParams(seed=1), [5, 6, 7], priority=4, weight=2.5), [], 0)
    req = engine.requests["r1"]
    assert (req.tenant, req.weight, req.priority) == ("acme", 2.5, 4)
    args = parser().parse_args(["--model", "m", "--scheduling-policy", "fair"])
    assert engine_config(args).scheduling_policy == "fair"
    assert "fair" in parser().format_help() and "(the default)" in parser().format_help()


def test_tokenbus_up_passes_the_fair_policy_to_its_workers():
    from ops.cli import parser as tokenbus
    from ops.up import worker_args
    assert worker_args(tokenbus().parse_args(["up", "--scheduling-policy", "fair"])) == [
        "--scheduling-policy", "fair"]

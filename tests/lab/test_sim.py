"""tokenbus sim: it runs the real scheduler, KV manager and router, and its figures follow from the cost model."""
import dataclasses
import json
import math
import statistics

import pytest

from lab.capacity import cost as sim_cost
from lab.capacity.cost import RooflineCost, StepShape
from lab.capacity.sim import Arrival, Cell, SimConfig, SimTenant, cpu_config, parse_tenant, replayed, search, simulate
from ops import cli
from ops.plan import GPUS, Efficiency, Plan, Workload, model_config
from workers.engine.scheduler import Scheduler


@pytest.fixture(scope="module")
def cost():
    _, cfg = model_config("llama-3-8b")
    return RooflineCost(Plan(cfg, GPUS["h100-sxm"], 1, Workload(), Efficiency()))


def small(cost, **kw) -> SimConfig:
    base = SimConfig(workers=2, cost=cost, num_blocks=4096, max_num_seqs=64, rate=8.0, duration=10.0, drain=60.0,
                     turns=4, system_tokens=256, system_prompts=2, user_tokens=64, output_tokens=32, dispatch_s=0.005,
                     stream_s=0.002)
    return dataclasses.replace(base, **kw)


def test_one_request_takes_its_prefill_and_decode_steps(cost):
    """Alone on a worker, a request's TTFT is the dispatch, one prefill step of its prompt and the stream;
    each later token one decode step at its context: the cost model's numbers, to the microsecond."""
    prompt, out = 300, 5
    r = simulate(small(cost, workers=1), [Arrival(0.0, list(range(16, 16 + prompt)), out)])
    first = StepShape()
    first.add(prompt, prompt, 1)
    assert r["ttft_s"]["p50"] == pytest.approx(0.005 + cost.seconds(first) + 0.002, abs=1e-6)
    decode = []
    for i in range(out - 1):
        s = StepShape()
        s.add(1, prompt + 1 + i, 1)
        decode.append(cost.seconds(s))
    assert r["tpot_s"]["p50"] == pytest.approx(sum(decode) / len(decode), abs=1e-6)
    assert r["finished"] == 1 and r["workers"][0]["steps"] == out


class OneAdmissionAStep(Scheduler):
    """Another admission policy: at most one waiting request joins each step."""
    calls = 0

    def schedule_waiting(self, batch, budget, most=None):
        OneAdmissionAStep.calls += 1
        super().schedule_waiting(batch, budget, 1)


def test_the_scheduler_under_test_is_the_one_that_runs(cost):
    """A different scheduling policy changes the simulation: the simulator steps the class it is given."""
    burst = [Arrival(0.0, [16 + i] * 200, 16) for i in range(24)]
    base = simulate(small(cost, workers=1), burst)
    other = simulate(small(cost, workers=1, scheduler=OneAdmissionAStep), burst)
    assert OneAdmissionAStep.calls > 0
    assert other["workers"][0]["steps"] > base["workers"][0]["steps"]
    assert other["ttft_s"]["p99"] > 2 * base["ttft_s"]["p99"]
    assert other["config"]["scheduler"] == "OneAdmissionAStep"


def test_prefix_routing_keeps_conversations_where_their_kv_is(cost):
    """Multi-turn chats: the prefix policy finds each history's KV; round-robin mostly misses it."""
    prefix = simulate(small(cost, workers=4, rate=12.0, duration=20.0, system_tokens=32))
    rr = simulate(small(cost, workers=4, rate=12.0, duration=20.0, system_tokens=32, policy="round-robin"))
    assert prefix["requests"] == rr["requests"] > 200
    assert prefix["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.2
    assert prefix["finished"] == prefix["requests"]


def test_speculation_emits_the_expected_tokens_per_step(cost):
    """k drafts each kept with probability a, up to the first rejected: (1 − a^(k+1)) / (1 − a) tokens a step."""
    prompt, out, k, a = 64, 400, 3, 0.7
    r = simulate(small(cost, workers=1, spec_k=k, spec_acceptance=a), [Arrival(0.0, list(range(16, 80)), out)])
    steps = r["workers"][0]["steps"] - 1             # the first step prefills
    assert (out - 1) / steps == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=0.12)
    plain = simulate(small(cost, workers=1), [Arrival(0.0, list(range(16, 80)), out)])
    assert r["tpot_s"]["p50"] < plain["tpot_s"]["p50"] / 1.8
    assert prompt < out


def test_disaggregated_prefill_hands_every_long_prompt_off(cost):
    """Long prompts go to the prefill worker and come back to the decode worker; a slower KV link costs
    time between the first token and the rest."""
    arrivals = [Arrival(i * 0.5, [16 + i] * 2000, 8) for i in range(10)]
    fast = simulate(small(cost, workers=0, prefill_workers=1, decode_workers=1, kv_bytes_per_token=131072,
                          kv_bandwidth=25e9), arrivals)
    slow = dataclasses.replace(small(cost, workers=0, prefill_workers=1, decode_workers=1,
                                     kv_bytes_per_token=131072, kv_bandwidth=0.25e9))
    slow = simulate(slow, arrivals)
    assert fast["handoffs"] == slow["handoffs"] == 10
    assert fast["finished"] == 10
    assert [w["requests"] for w in fast["workers"]] == [0, 10]           # p0 hands off, d0 finishes
    transfer = 2000 * 131072 / 0.25e9
    assert slow["e2e_s"]["p50"] - fast["e2e_s"]["p50"] == pytest.approx(transfer, rel=0.2)


def test_search_finds_the_fewest_workers(cost):
    cfg = small(cost, rate=30.0, duration=8.0, ttft_slo=0.2, tpot_slo=0.02, turns=1, system_prompts=1000,
                user_tokens=1500, output_tokens=64)
    workers, r = search(cfg)
    assert workers > 1 and r["meets_slo"]
    assert not simulate(dataclasses.replace(cfg, workers=workers - 1))["meets_slo"]


def test_sampled_cells_stand_for_the_fleet(cost):
    cfg = small(cost, cells=4, sample_cells=2, processes=2, rate=32.0, duration=10.0)
    r = simulate(cfg)
    assert r["nodes"] == 8 and r["cells_simulated"] == 2
    assert len(r["workers"]) == 4
    assert r["requests"] == pytest.approx(32 * 10, rel=0.25)


def test_a_log_export_replays(tmp_path, cost):
    records = [{"id": f"r{i}", "created": 1000.0 + i, "prompt_token_ids": [20 + i] * 40, "output_token_ids": [5] * 7,
                "sampling": {"max_tokens": 64}} for i in range(5)]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    arrivals = replayed(str(path))
    assert [a.at for a in arrivals] == [0.0, 1.0, 2.0, 3.0, 4.0] and arrivals[0].max_tokens == 7
    r = simulate(small(cost), arrivals)
    assert r["finished"] == 5 and r["output_tokens_per_s"] > 0


def test_a_replayed_turn_that_carries_the_last_reply_finds_it_in_the_prefix_cache(cost):
    """A replayed request samples the tokens it got, so the next turn of its conversation, whose prompt
    carries them, hits the prefix cache over the reply's computed full blocks as on the real stack; sampled
    at random they would miss. The trace has every step's shape, start and end."""
    first, reply = [16 + i for i in range(64)], [300 + i for i in range(32)]
    second = first + reply + [500] * 16

    def run(output):
        return simulate(small(cost, workers=1, trace=True), [Arrival(0.0, first, len(reply), output=output),
                                                             Arrival(5.0, second, 4)])
    known, unknown = run(reply), run(None)
    assert known["prefix_hit_rate"] == pytest.approx(80 / (64 + 112))     # 64 + 31 reply tokens computed: 5 blocks
    assert unknown["prefix_hit_rate"] == pytest.approx(64 / (64 + 112))
    steps = known["steps"]
    assert known["requests"] == 2 and [t["cached"] for t in known["tracks"]] == [0, 80]   # the count stays a count
    assert [s["tokens"] for s in steps] == [64] + [1] * 31 + [112 - 80] + [1] * 3
    assert all(s["at"] < s["end"] for s in steps) and steps[32]["at"] >= 5.0
    assert steps[0]["seconds"] == pytest.approx(steps[0]["end"] - steps[0]["at"])


def test_the_command_prints_json(capsys):
    cli.main(["sim", "--model", "llama-3-8b", "--tp", "1", "--workers", "2", "--rate", "4", "--duration", "5",
              "--output-tokens", "16", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["nodes"] == 2 and r["finished"] == r["requests"] > 5
    assert set(r["ttft_s"]) == {"p50", "p90", "p99", "mean"} and "samples" not in r and "steps" not in r


def test_cpu_workers_share_the_cores(cost):
    """Two busy workers on one core: each step takes twice as long as on a core of its own."""
    arrivals = [Arrival(0.0, [16 + i] * 64, 50) for i in range(2)]
    own = simulate(small(cost, policy="round-robin"), arrivals)
    shared = simulate(small(cost, policy="round-robin", cores=1.0), arrivals)
    assert [w["requests"] for w in shared["workers"]] == [1, 1]
    assert shared["tpot_s"]["p50"] == pytest.approx(2 * own["tpot_s"]["p50"], rel=0.05)


class Second:
    """Every step takes one second of a core."""
    name = "1 s a step"

    def seconds(self, shape: StepShape) -> float:
        return 1.0


def test_a_step_slows_while_another_worker_steps_beside_it_and_speeds_up_when_it_ends():
    """Processor sharing on one core: A's one-step request runs alone for 0.5 s, then both share the core, so
    A's step ends at 1.5 s (not at 1.0 s, as if its start had fixed its speed) and B's, half done by then,
    at 2.0 s (not 2.5 s: alone again for its last half)."""
    arrivals = [Arrival(0.0, [16] * 32, 1), Arrival(0.5, [17] * 32, 1)]
    r = simulate(small(Second(), policy="round-robin", cores=1.0, dispatch_s=0.0, stream_s=0.0), arrivals)
    assert [w["requests"] for w in r["workers"]] == [1, 1]
    assert sorted(r["samples"]["ttft"]) == pytest.approx([1.5, 1.5])
    assert r["sim_seconds"] == pytest.approx(2.0)


def test_the_other_processes_slow_the_steps_only_while_the_workers_fill_the_cores():
    """Steps of one second of a core: the other processes' half core leaves one worker on one core half of
    it (2 s a step) and two workers on two cores 0.75 of one each (1.33 s); one worker on two cores steps in
    1 s (they take the other)."""
    def ttft(workers: int, cores: float) -> list[float]:
        cfg = small(Second(), workers=workers, policy="round-robin", dispatch_s=0.0, stream_s=0.0, cores=cores,
                    background_cores=0.5)
        return simulate(cfg, [Arrival(0.0, [16 + i] * 32, 1) for i in range(workers)])["samples"]["ttft"]
    assert ttft(1, 1.0) == pytest.approx([2.0])
    assert ttft(2, 2.0) == pytest.approx([4 / 3, 4 / 3])
    assert ttft(1, 2.0) == pytest.approx([1.0])


def test_steps_side_by_side_slow_each_other_by_the_contention_of_their_kind():
    """Steps of one second of a core, two workers on two cores: each has a core, yet beside each other their
    prefills take 1.25 s and their decodes 1.5 s (contention 0.25 and 0.5 per other core in use); one
    worker alone on the two cores steps in 1 s."""
    def run(workers: int) -> dict:
        cfg = small(Second(), workers=workers, policy="round-robin", dispatch_s=0.0, stream_s=0.0, cores=2.0,
                    contention=(0.5, 0.25))
        return simulate(cfg, [Arrival(0.0, [16 + i] * 32, 2) for i in range(workers)])
    two, one = run(2), run(1)
    assert [w["requests"] for w in two["workers"]] == [1, 1]
    assert two["samples"]["ttft"] == pytest.approx([1.25, 1.25]) and two["tpot_s"]["p50"] == pytest.approx(1.5)
    assert one["samples"]["ttft"] == pytest.approx([1.0]) and one["tpot_s"]["p50"] == pytest.approx(1.0)


def test_a_step_s_jitter_spreads_its_time_about_the_cost_model_and_its_seed_repeats_it():
    """Jitter 0.2 on steps of one second: 400 decode steps keep a mean of 1 s, their logs spread with a
    standard deviation of 0.2; the same seed draws the same steps and another seed others. A negative
    jitter is refused."""
    def steps(seed: int, jitter: float) -> list[float]:
        cfg = small(Second(), workers=1, dispatch_s=0.0, stream_s=0.0, drain=1000.0, trace=True, jitter=jitter,
                    seed=seed)
        return [s["seconds"] for s in simulate(cfg, [Arrival(0.0, [16] * 32, 401)])["steps"]]
    drawn = steps(0, 0.2)
    assert len(drawn) == 401 and statistics.fmean(drawn) == pytest.approx(1.0, rel=0.03)
    assert statistics.pstdev(math.log(s) for s in drawn) == pytest.approx(0.2, rel=0.1)
    assert steps(0, 0.2) == drawn and steps(1, 0.2) != drawn and steps(0, 0.0) == [1.0] * 401
    with pytest.raises(ValueError, match="jitter"):
        simulate(small(Second(), jitter=-0.1), [Arrival(0.0, [16] * 32, 2)])


def test_the_cpu_simulation_takes_the_cores_the_others_share_and_the_contention_from_the_command_line(monkeypatch):
    monkeypatch.setattr(sim_cost, "load_or_fit", lambda model, threads: Second())
    args = cli.parser().parse_args(["sim", "--gpu", "cpu", "--model", "tiny", "--cores", "2",
                                    "--background-cores", "0.07", "--contention", "0.15", "0.05"])
    cfg = cpu_config(args)
    assert (cfg.cores, cfg.background_cores, cfg.contention) == (2.0, 0.07, (0.15, 0.05))
    assert isinstance(cfg.cost, Second)


def test_a_heartbeat_due_during_a_step_says_the_last_one_again_and_a_fresh_one_follows_the_step():
    """As the real worker sends them: built between steps, so during a 1 s step the router hears the counts
    of before it (with fresh times), and the step's end brings the new ones."""
    cell = Cell(small(Second(), workers=1, dispatch_s=0.0, stream_s=0.0), 0, [Arrival(0.1, [16] * 32, 3)])
    heard = []
    update = cell.registry.update
    cell.registry.update = lambda hb: (heard.append((round(cell.now, 3), hb.running, hb.requests_finished)),
                                       update(hb))
    cell.run()
    assert heard[:4] == [(0.0, 0, 0), (0.5, 0, 0), (1.0, 0, 0), (1.1, 1, 0)]   # t=0.5, 1.0: stand-ins; 1.1: built
    assert (3.1, 0, 1) in heard                                                  # after the third step


def test_the_workers_scheduling_policy_and_tenants_shape_who_waits(cost):
    """One worker past its seats, a flooding tenant and a steady one: under FCFS the steady tenant waits in
    the flood's queue; the fair policy serves it almost at once, as a better priority does."""
    tenants = (SimTenant("flood", 0.9), SimTenant("steady", 0.1))
    base = small(cost, workers=1, max_num_seqs=16, rate=20.0, duration=20.0, output_tokens=200, turns=8,
                 tenants=tenants)
    runs = {p: simulate(dataclasses.replace(base, scheduling_policy=p)) for p in ("fcfs", "fair")}
    urgent = simulate(dataclasses.replace(base, scheduling_policy="priority",
                                          tenants=(tenants[0], SimTenant("steady", 0.1, priority=-1))))
    steady = {p: r["tenants"]["steady"]["ttft_s"]["p50"] for p, r in {**runs, "priority": urgent}.items()}
    assert runs["fcfs"]["tenants"]["flood"]["ttft_s"]["p50"] > 5.0                 # the worker is past its seats
    assert steady["fair"] * 10 < steady["fcfs"] and steady["priority"] * 10 < steady["fcfs"], steady
    assert all(r["tenants"]["steady"]["requests"] > 10 for r in runs.values())
    shares = runs["fair"]["tenants"]
    assert shares["flood"]["token_share"] + shares["steady"]["token_share"] == pytest.approx(1.0)


def test_a_tenant_is_name_share_and_optionally_weight_and_priority():
    assert parse_tenant("batch:0.8:2:5") == SimTenant("batch", 0.8, 2.0, 5)
    assert parse_tenant("chat:0.2") == SimTenant("chat", 0.2, 1.0, 0)
    for bad in ("chat", "chat:x", ":0.5", "chat:0.5:0", "chat:0:1"):
        with pytest.raises(ValueError, match="--tenant"):
            parse_tenant(bad)


def test_the_command_searches_on_a_replayed_log_and_plots_it(tmp_path, capsys):
    """--search with --replay sizes the fleet for the log's requests, not for Poisson arrivals; --plot writes
    the figure."""
    records = [{"id": f"r{i}", "created": 1000.0 + i / 4, "prompt_token_ids": [20 + i] * 300,
                "output_token_ids": [5] * 16, "sampling": {"max_tokens": 64}} for i in range(12)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    png = tmp_path / "sim.png"
    cli.main(["sim", "--model", "llama-3-8b", "--tp", "1", "--workers", "1", "--replay", str(log), "--search",
              "--plot", str(png), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["requests"] == r["finished"] == 12 and r["search"]["workers_per_cell"] >= 1 and r["meets_slo"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

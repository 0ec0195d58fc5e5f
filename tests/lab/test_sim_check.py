"""`tokenbus sim-check` on the tiny model, small: the real stack and the simulator (with the CPU cost fitted
here) run the same requests, and the simulator's TTFT, TPOT and throughput land near the real ones."""
import math
import os
import random
import statistics
import time
from argparse import Namespace

import orjson
import pytest

from lab.capacity import check as sim_check
from lab.capacity import cost as sim_cost
from lab.common.results import Result
from ops.cli import parser
from ops.procs import cpu_seconds

BOUND = 0.5                   # generous: a small run on a shared, noisy CPU


def check_args(model: str, **kw) -> Namespace:
    defaults = vars(parser().parse_args(["sim-check"]))
    return Namespace(**{**defaults, "model": model, "workers": [1], "requests": 16, "conversations": 2, "turns": 3,
                        "think": 1.0, **kw})


@pytest.mark.slow
@pytest.mark.serial                   # it times a real stack
def test_the_simulator_predicts_the_real_stack_within_a_generous_bound(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path))
    assert sim_check.main(check_args(tiny_model, json=True, steps=True)) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert [(r["workload"], r["workers"]) for r in report["results"]] == [("poisson", 1), ("chat", 1)]
    for r in report["results"]:
        steps = r["steps"]                                         # --steps: the workers' traces and the sim's
        real, simd = (sum(s[k]["tokens"] * s[k]["steps"] for k in ("decode", "prefill")) for s in (steps["real"],
                                                                                                    steps["sim"]))
        assert real == pytest.approx(simd, rel=0.25), steps        # as many tokens computed: the same cache hits
        assert steps["cost_on_real_steps"]["prefill"]["median_error"] is not None
        (run,) = r["requests"]                                      # each request on both sides, paired
        assert len(run) == r["real"]["requests"] and all(q["real"]["worker"] and q["sim"]["worker"] for q in run)
        assert sum(q["real"]["cached"] for q in run) == pytest.approx(sum(q["sim"]["cached"] for q in run), rel=0.25)
        assert r["real"]["requests"] == r["sim"]["requests"] == (16 if r["workload"] == "poisson" else 6)
        assert r["sim"]["output_tokens"] == pytest.approx(r["real"]["output_tokens"])   # EOS ignored: max_tokens each
        # medians and throughput only: a p99 of 16 requests is their slowest one, and a loaded CI machine put
        # a TTFT p99 at +0.83 (its median +0.14) and a TPOT p99 at -0.50
        for errors in (r["error"], r["run_speed"]["error"], r["probed_speed"]["error"]):
            assert all(abs(e) < BOUND for k, e in errors.items() if not k.endswith("p99")), errors
        assert r["step_scale"] > 0 and r["decode_scale"] > 0            # timed on the pilots, before and after
        assert r["pilot_requests"] == 2 * (6 if r["workload"] == "poisson" else 2)   # a third; half of 3 turns
        assert r["pilot_steps"] > r["pilot_requests"]                   # their steps found in the workers' trace
        assert r["run_speed"]["step_scale"] > 0 and r["run_speed"]["decode_scale"] > 0
        assert r["constants"]["intake_steps"] >= 0                  # probed with the worker busy
        assert r["runs"] == 1 and len(r["probes"]) == 2 and "real_spread" not in r   # probed before and after
        probed = r["probed_speed"]["step_scale"]
        assert min(p["step_scale"] for p in r["probes"]) <= probed <= max(p["step_scale"] for p in r["probes"])
        for side in ("real", "sim"):                                # where the TTFT goes: dispatch, then worker
            assert 0 < r[side]["dispatch_s"]["p50"] < r[side]["ttft_s"]["p99"]
            assert r[side]["worker_ttft_s"]["p50"] > 0
    assert report["fits"][f"{sim_check.threads_for(1)}t"]["quality"]["held_out_steps"] > 0


def test_a_repeat_draws_the_same_lengths_in_other_token_ids():
    first, again = (sim_check.tokens(random.Random(3), 50, 1000, shift) for shift in (0, sim_check.SHIFT))
    assert len(first) == len(again) == 50 and all(16 <= t < 1000 for t in first + again)
    assert all(a != b for a, b in zip(first, again))                     # no shared prefix: no shared KV block
    assert sim_check.tokens(random.Random(3), 50, 1000) == first


def test_a_pilot_is_the_workload_shorter_at_the_same_rate_and_concurrency():
    args = check_args("tiny", requests=60, conversations=10, turns=4, rate=0.5)
    small = sim_check.pilot_args(args)
    assert (small.requests, small.turns) == (20, 2)                      # a third of Poisson's; half the turns
    assert (small.rate, small.conversations, small.prompt_len) == (0.5, 10, args.prompt_len)
    assert (args.requests, args.turns) == (60, 4)                        # the run's own are left as they are
    one = sim_check.pilot_args(check_args("tiny", requests=1, turns=1))
    assert (one.requests, one.turns) == (1, 1)                           # never none


def test_repeat_and_replicas_out_of_range_are_refused_by_name(tiny_model):
    for kw, named in (({"repeat": [2, 6, 1]}, "--repeat 2 6 1"), ({"repeat": [0]}, "--repeat 0"),
                      ({"replicas": 0}, "--replicas 0")):
        with pytest.raises(SystemExit, match=named):
            sim_check.main(check_args(tiny_model, **kw))
    assert parser().parse_args(["sim-check", "--repeat", "2", "6"]).repeat == [2, 6]


def test_runs_are_compared_by_their_means_and_the_real_runs_spread_is_reported():
    def figures(ttft_p50: float, tpot_p99: float, rate: float) -> dict:
        return {"ttft_s": {"p50": ttft_p50, "p99": 2.0}, "tpot_s": {"p50": 0.1, "p99": tpot_p99},
                "output_tokens_per_s": rate, "requests": 30}
    runs = [figures(1.0, 0.3, 40.0), figures(1.5, 0.3, 44.0)]
    mean = sim_check.mean_figures(runs)
    assert mean["ttft_s"]["p50"] == 1.25 and mean["output_tokens_per_s"] == 42.0 and mean["requests"] == 30
    assert sim_check.spread(runs) == {"ttft_p50": 0.4, "ttft_p99": 0.0, "tpot_p50": 0.0, "tpot_p99": 0.0,
                                      "throughput": round(4 / 42, 4)}


def test_the_run_s_speed_is_the_scale_that_times_its_own_steps_as_the_simulator_shares_the_cores():
    """Steps 1.2× (prefill) and 0.9× (decode) the fit, plus the overhead, three workers at once on two
    cores for a while: the scales come back, whatever the sharing did to the wall times."""
    cost = sim_cost.FittedCost("fit", 0.01, {"tokens": 0.001, "rows": 0.002}, {})
    scaled, overhead = sim_check.Scaled(cost, 1.0, 1.0), 0.005

    def step(worker: str, at: float, tokens: int, rows: int, scale: float, slowdown: float) -> dict:
        shape = sim_cost.StepShape(tokens, rows, rows, 0, 0)
        return {"worker": worker, "at": at, "tokens": tokens, "rows": rows, "sampled": rows, "attention": 0,
                "kv_read": 0, "loop_s": (scale * cost.seconds(shape) + overhead) * slowdown}
    alone = [step("w0", 0.0, 200, 2, 1.2, 1.0), step("w0", 1.0, 3, 3, 0.9, 1.0)]
    together = [step(w, 10.0, 100, 1, 1.2, 1.5) for w in ("w0", "w1", "w2")] + \
        [step(w, 20.0, 4, 4, 0.9, 1.5) for w in ("w0", "w1", "w2")]
    got = sim_check.run_speed(alone + together, scaled, overhead, 2.0)
    assert (got.scale, got.decode_scale) == (pytest.approx(1.2), pytest.approx(0.9))
    kept = sim_check.run_speed(alone[1:], sim_check.Scaled(cost, 1.1, 1.0), overhead, 2.0)
    assert (kept.scale, kept.decode_scale) == (1.1, pytest.approx(0.9))     # no prefill step: the probed scale


def test_the_probed_scales_follow_the_machine_below_the_fit_too():
    """A stack 10% faster than when the cost was fitted probes 0.9, not 1; a decode slower than the prefill's
    scale leaves its excess to the step overhead."""
    cost = sim_cost.FittedCost("fit", 0.01, {"tokens": 0.001, "rows": 0.002}, {})
    decode, prefill = sim_cost.StepShape(), sim_cost.StepShape()
    decode.add(1, sim_check.PROBE_PROMPT + sim_check.PROBE_OUTPUT // 2, 1)
    prefill.add(sim_check.PROBE_LONG, sim_check.PROBE_LONG, 1)
    fast, overhead = sim_check.scales(cost, 0.9 * cost.seconds(decode), 0.9 * cost.seconds(prefill))
    assert (fast.scale, fast.decode_scale, overhead) == (pytest.approx(0.9), pytest.approx(0.9), pytest.approx(0))
    slow, overhead = sim_check.scales(cost, 1.2 * cost.seconds(decode) + 0.003,
                                      1.2 * cost.seconds(prefill) + 0.003)
    assert (slow.scale, slow.decode_scale) == (pytest.approx(1.2), pytest.approx(1.2))
    assert overhead == pytest.approx(0.003)


def test_contention_is_how_much_slower_the_busy_probes_steps_ran_than_the_idle_ones_per_other_core():
    """Idle probes at 1.1× the fit; busy ones, two workers on two cores at once, decode at 1.1 × 1.2 and
    prefill a long prompt at 1.1 × 1.1: contention 0.2 and 0.1 per other core. On three workers at once the
    share of the cores (1.5) is left out first, and a step that runs alone is not counted."""
    cost = sim_cost.FittedCost("fit", 0.01, {"tokens": 0.001, "rows": 0.002}, {})
    overhead, long = 0.002, sim_check.PROBE_LONG

    def step(worker: str, at: float, tokens: int, rows: int, scale: float) -> dict:
        shape = sim_cost.StepShape(tokens, rows, rows, 0, 0)
        return {"worker": worker, "at": at, "tokens": tokens, "rows": rows, "sampled": rows, "attention": 0,
                "kv_read": 0, "loop_s": 1.1 * scale * cost.seconds(shape) + overhead}
    idle = [step("w0", 0.0, 1, 1, 1.0), step("w0", 1.0, long, 1, 1.0)]
    decode = step("w1", 20.0, 1, 1, 1.2)["loop_s"]
    busy = [step(w, 10.0, 1, 1, 1.2) for w in ("w0", "w1")] + [step("w0", 20.0, long + 1, 2, 1.1)] + \
        [step("w1", 20.0 + i * decode, 1, 1, 1.2) for i in range(40)]     # w1 decodes all through w0's prefill
    assert sim_check.contention(idle, busy, cost, overhead, 2.0) == (pytest.approx(0.2), pytest.approx(0.1))
    three = [dict(t, loop_s=1.1 * 1.2 * 1.5 * cost.seconds(sim_cost.StepShape(1, 1, 1, 0, 0)) + 1.5 * overhead,
                  worker=w) for t, w in zip([step("w", 30.0, 1, 1, 1.0)] * 3, ("w0", "w1", "w2"))]
    lone = [step("w0", 40.0, 1, 1, 3.0)]
    assert sim_check.contention(idle, three + lone, cost, overhead, 2.0) == (pytest.approx(0.2), 0.0)
    assert sim_check.contention(idle, [step("w0", 40.0, 1, 1, 1.5)], cost, overhead, 2.0) == (0.0, 0.0)


def test_the_jitter_is_the_spread_of_the_steps_alone_about_the_fit_each_kind_about_its_own_scale():
    """Idle probes' decodes at 1.1× the fit and prefills at 0.9×, each × e^N(0, 0.1), and one step stalled
    tenfold: the jitter is 0.1, the two scales and the stall left out. Too few steps say nothing (0)."""
    cost = sim_cost.FittedCost("fit", 0.01, {"tokens": 0.001, "rows": 0.002}, {})
    overhead, rng = 0.002, random.Random(5)

    def step(at: float, tokens: int, scale: float) -> dict:
        shape = sim_cost.StepShape(tokens, 1, 1, 0, 0)
        return {"worker": "w0", "at": at, "tokens": tokens, "rows": 1, "sampled": 1, "attention": 0, "kv_read": 0,
                "loop_s": scale * math.exp(rng.gauss(0, 0.1)) * cost.seconds(shape) + overhead}
    idle = [step(i, 1, 1.1) for i in range(300)] + [step(300 + i, sim_check.PROBE_LONG, 0.9) for i in range(100)]
    idle.append(step(400, 1, 11.0))
    assert sim_check.jitter(idle, cost, overhead) == pytest.approx(0.1, rel=0.15)
    assert sim_check.jitter(idle[:3], cost, overhead) == 0.0


def test_the_simulated_figures_are_the_means_of_replays_each_drawing_its_own_jitter():
    """Four replays of a run whose steps spread (jitter 0.2) move its TTFT and TPOT; the figures compared are
    their means, and their TTFT samples all of theirs. Without jitter one replay is all there is."""
    cost = sim_cost.FittedCost("fit", 0.01, {"tokens": 0.001, "rows": 0.002}, {})
    sent = [sim_check.Sent(0.05 * i, [16 + i] * 64, 8, Result(0.0), [20] * 8) for i in range(12)]
    args = check_args("tiny", replicas=4, max_model_len=2048)
    consts = {"dispatch_s": 0.004, "stream_s": 0.002, "step_overhead_s": 0.001, "intake_steps": 0, "cores": 2,
              "background_cores": 0.0, "contention_decode": 0.0, "contention_prefill": 0.0, "jitter": 0.2}
    each = [sim_check.simulated(sent, cost, consts, 3, args, seed=k) for k in range(4)]
    assert len({e["ttft_s"]["p99"] for e in each}) > 1                   # each replay a draw of its own
    mean = sim_check.replicated(sent, cost, consts, 3, args)
    for m in ("ttft_s", "tpot_s"):
        assert mean[m]["p99"] == pytest.approx(statistics.fmean(e[m]["p99"] for e in each))
    assert sorted(mean["ttft_samples"]) == sorted(t for e in each for t in e["ttft_samples"])
    still = sim_check.replicated(sent, cost, consts | {"jitter": 0.0}, 3, args)
    assert still["ttft_s"] == sim_check.simulated(sent, cost, consts | {"jitter": 0.0}, 3, args)["ttft_s"]
    assert len(still["ttft_samples"]) == len(sent)


@pytest.mark.serial                   # it meters CPU time
def test_the_other_processes_are_metered_over_spans_of_the_stack_s_life():
    """A span counts the CPU the metered processes took during it; cores are CPU seconds over seconds."""
    meter, spans = sim_check.Meter([os.getpid()]), []
    with meter.span(spans):
        sum(i * i for i in range(2_000_000))
    with meter.span(spans):
        time.sleep(0.3)
    (busy, busy_cpu), (idle, idle_cpu) = spans
    assert busy_cpu > 0.5 * busy and idle_cpu < 0.5 * idle and idle >= 0.3
    assert sim_check.cores([(10.0, 1.0), (30.0, 1.0)]) == 0.05


def test_a_process_cpu_seconds_grow_with_its_work_and_a_gone_one_is_an_error():
    """The meter reads ops.procs.cpu_seconds; a metered process gone mid-check fails it, not reads 0."""
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(3_000_000))
    assert cpu_seconds(os.getpid()) > before > 0
    with pytest.raises(FileNotFoundError):
        cpu_seconds(2 ** 22 + 1)

"""`tokenbus sim-check` on the tiny model, small: the real stack and the simulator (with the CPU cost fitted
here) run the same requests, and the simulator's TTFT, TPOT and throughput land near the real ones."""
from argparse import Namespace

import orjson
import pytest

from ops import sim_check
from ops.cli import parser

BOUND = 0.5                   # generous: a small run on a shared, noisy CPU


def check_args(model: str, **kw) -> Namespace:
    defaults = vars(parser().parse_args(["sim-check"]))
    return Namespace(**{**defaults, "model": model, "workers": [1], "requests": 16, "conversations": 2, "turns": 3,
                        "think": 1.0, **kw})


@pytest.mark.slow
def test_the_simulator_predicts_the_real_stack_within_a_generous_bound(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path))
    assert sim_check.main(check_args(tiny_model, json=True)) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert [(r["workload"], r["workers"]) for r in report["results"]] == [("poisson", 1), ("chat", 1)]
    for r in report["results"]:
        assert r["real"]["requests"] == r["sim"]["requests"] == (16 if r["workload"] == "poisson" else 6)
        assert r["sim"]["output_tokens"] == pytest.approx(r["real"]["output_tokens"])   # EOS ignored: max_tokens each
        assert all(abs(e) < BOUND for e in r["error"].values()), r["error"]
        assert r["constants"]["intake_steps"] >= 0                  # probed with the worker busy
        for side in ("real", "sim"):                                # where the TTFT goes: dispatch, then worker
            assert 0 < r[side]["dispatch_s"]["p50"] < r[side]["ttft_s"]["p99"]
            assert r[side]["worker_ttft_s"]["p50"] > 0
    assert report["fits"][f"{sim_check.threads_for(1)}t"]["quality"]["held_out_steps"] > 0

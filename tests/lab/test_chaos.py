"""tokenbus chaos: the scoring of what clients saw, the table, and a small run of real scenarios."""
import json
import subprocess
import sys

import pytest

from lab.chaos import cluster as bench_cluster
from lab.chaos import scenarios as chaos
from lab.chaos.scenarios import CLUSTER_SCENARIOS, SCENARIOS, Outcome, Result, Run, table
from ops import cli


def scored(outcomes: dict[str, Outcome], expected: dict[str, list[int]]) -> Result:
    run = Run.__new__(Run)
    run.outcomes, run.expected, run.result = outcomes, expected, Result("t")
    run.scenario, run.canary, run.probe_done, run.fault_at = "t", None, [], 0.0
    run.score()
    return run.result


def done(tokens: list[int]) -> Outcome:
    return Outcome(tokens=tokens, end={"type": "done", "usage": {"completion_tokens": len(tokens)}})


def test_scoring_tells_completed_wrong_refused_lost_and_cut_apart():
    refused = Outcome(end={"type": "error", "code": "overloaded"})
    failed = Outcome(end={"type": "error", "code": "timeout", "message": "deadline"})
    claims_more = Outcome(tokens=[1, 2], end={"type": "done", "usage": {"completion_tokens": 3}})
    r = scored({"a": done([1, 2, 3]), "b": done([1, 9, 3]), "c": refused, "d": Outcome(), "e": Outcome(cut=True),
                "f": failed, "g": claims_more},
               {k: [1, 2, 3] for k in "abcdefg"})
    assert (r.accepted, r.completed, r.wrong, r.lost, r.cut, r.errors) == (6, 1, 2, 1, 1, 1)
    assert not r.clean


def test_a_resumed_request_counts_as_completed_when_its_tokens_are_whole_and_as_resumed():
    resumed = done([1, 2, 3])
    resumed.resumed = 1
    r = scored({"a": resumed, "b": done([1, 2, 3])}, {k: [1, 2, 3] for k in "ab"})
    assert (r.accepted, r.completed, r.resumed, r.cut, r.lost) == (2, 2, 1, 0, 0) and r.clean


def test_the_table_has_a_row_per_scenario_under_the_issue_s_columns():
    text = table([Result("none", sent=3, accepted=3, completed=3, recovery_s=0.4), Result("poison", poison_sent=2,
                                                                                          poison_answered=2)])
    head, _, none, poison = text.splitlines()
    assert head.split()[:7] == ["scenario", "sent", "accepted", "completed", "lost", "duplicated", "wrong"]
    assert none.split()[:4] == ["none", "3", "3", "3"] and "0.4" in none
    assert "2/2" in poison


def test_every_scenario_the_issue_names_is_there():
    for name in ("kill-worker", "kill-router", "kill-tokenizer", "kill-gateway", "stop-worker", "stop-router",
                 "stop-tokenizer", "stop-gateway", "broker-restart", "poison", "slow-client", "overload",
                 "kill-recorder", "database-restart", "backlog-full", "roll-workers", "roll-gateways", "roll-router",
                 "roll-tokenizer", "roll-revision"):
        assert name in SCENARIOS


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_chaos_poison_and_broker_restart_lose_nothing(tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "chaos", "--model", tiny_model, "--scenarios", "poison",
                           "broker-restart", "--requests", "12", "--max-tokens", "24", "--patience", "60",
                           "--data-dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=380)
    results = {r["scenario"]: r for r in json.loads(proc.stdout)}
    for r in results.values():
        assert r["sent"] >= 12 and r["accepted"] == r["completed"], r
        assert (r["lost"], r["duplicated"], r["wrong"], r["errors"]) == (0, 0, 0, 0), r
        assert r["workers_registered"] == 2, r
    assert results["poison"]["poison_answered"] == results["poison"]["poison_sent"] > 0
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_kill_gateway_clients_resume_on_the_other_gateway_and_lose_nothing(tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "chaos", "--model", tiny_model, "--scenarios",
                           "kill-gateway", "--requests", "16", "--max-tokens", "32", "--patience", "60",
                           "--data-dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=280)
    r = json.loads(proc.stdout)[0]
    assert r["sent"] == 16 and r["accepted"] == r["completed"] == 16, r
    assert (r["lost"], r["duplicated"], r["wrong"], r["errors"], r["cut"]) == (0, 0, 0, 0, 0), r
    assert r["resumed"] > 0 and r["metered"] == r["stored"], r           # cut clients came back; metered once
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_chaos_recorder_killed_database_away_and_backlog_full_bill_every_request_once(tiny_model, tmp_path):
    """The records scenarios at a small size: every completed request metered once, with the tokens its client
    got, in PostgreSQL; a full backlog refused requests with "metering backlog full" and let them in again."""
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "chaos", "--model", tiny_model, "--scenarios",
                           "kill-recorder", "database-restart", "backlog-full", "--requests", "12", "--max-tokens",
                           "16", "--database-down", "5", "--patience", "60", "--data-dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=480)
    results = {r["scenario"]: r for r in json.loads(proc.stdout)}
    assert set(results) == {"kill-recorder", "database-restart", "backlog-full"}
    for r in results.values():
        assert r["accepted"] == r["completed"] == 12, r
        assert (r["lost"], r["duplicated"], r["wrong"], r["errors"], r["misbilled"]) == (0, 0, 0, 0, 0), r
        assert r["metered"] >= r["completed"], r                # each completed request's row: misbilled above
        # (stored, recorded and metered also count the probes: one its client aborted may be metered unstored)
    assert results["backlog-full"]["backlog_refused"] > 0, results["backlog-full"]
    assert results["backlog-full"]["notes"][0].startswith("backlog full after")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_cluster_scenarios_need_cluster_and_their_table_adds_the_time_without_a_leader():
    for name in ("kill-leader-node", "kill-follower-node", "partition-node", "throughput"):
        assert name in CLUSTER_SCENARIOS
        with pytest.raises(ValueError, match="with --cluster"):
            chaos.main(cli.parser().parse_args(["chaos", "--scenarios", name]))
    text = table([Result("kill-leader-node", sent=3, accepted=3, completed=3, leaderless_s=5.5),
                  Result("partition-node (not run: no network namespaces here)")])
    head, _, killed, skipped = text.splitlines()
    assert head.split()[-1] == "leaderless_s" and killed.split()[-1] == "5.5" and skipped.split()[-1] == "-"


def test_the_throughput_table_shows_each_layout_against_one_server_with_nats_default_fsync():
    rows = [bench_cluster.Row(1, "2m", 0.1, 0.5, 20000, 4.0, 900), bench_cluster.Row(3, "always", 1.1, 5.0, 5000, 3.0,
                                                                                      1200)]
    head, _, base, r3 = bench_cluster.table(rows).splitlines()
    assert "publishes/s" in head and "requests/s" in head
    assert base.startswith("1 server, R1") and "20000" in base and "%" not in base
    assert r3.startswith("3 servers, R3") and "5000 (-75%)" in r3 and "3 (-25%)" in r3


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_chaos_cluster_kills_a_follower_node_and_loses_nothing(tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "chaos", "--cluster", "--model", tiny_model,
                           "--scenarios", "kill-follower-node", "--requests", "8", "--max-tokens", "16",
                           "--patience", "60", "--data-dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=380)
    out = json.loads(proc.stdout)
    [r] = out["scenarios"]
    assert r["scenario"] == "kill-follower-node" and out["throughput"] == []
    assert r["sent"] == r["accepted"] == r["completed"] == 8, r
    assert (r["lost"], r["duplicated"], r["wrong"], r["errors"]) == (0, 0, 0, 0), r
    assert r["leaderless_s"] is not None and r["notes"][0].startswith("tb-"), r
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rolling_upgrades_of_every_service_under_load_lose_cut_and_duplicate_nothing(tiny_model, tmp_path):
    """Workers, gateways, the router and the tokenizer replaced one by one (each drained), and a worker moved to
    a new revision served as a canary, while requests stream: every accepted request completes with the
    offline engine's tokens (of the revision that answered it), once; the TTFT before and during the roll is
    reported."""
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "chaos", "--model", tiny_model, "--scenarios",
                           *chaos.ROLLS, "--requests", "12", "--max-tokens", "24", "--patience", "60",
                           "--data-dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=580)
    results = {r["scenario"]: r for r in json.loads(proc.stdout)}
    assert set(results) == set(chaos.ROLLS)
    for r in results.values():
        after = 12 if r["scenario"] == "roll-revision" else 4                  # sent after the roll
        assert r["sent"] == 12 + after and r["accepted"] == r["completed"], r
        assert (r["lost"], r["duplicated"], r["wrong"], r["errors"], r["cut"], r["misbilled"]) == (0,) * 6, r
        assert r["workers_registered"] == 2 and r["ttft_before_ms"] and r["ttft_during_ms"], r
    assert results["roll-revision"]["canary"] > 0, results["roll-revision"]   # tokens checked per revision
    assert proc.returncode == 0, proc.stderr[-2000:]

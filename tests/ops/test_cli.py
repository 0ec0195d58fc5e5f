"""The `tokenbus` commands of this issue run end to end as a user types them."""
import asyncio
import json
import subprocess
import sys
import time

import pytest

from schemas import subjects

TOKENBUS = [sys.executable, "-m", "ops.cli"]


def run(*args, env=None) -> str:
    return subprocess.run([*TOKENBUS, *args], check=True, capture_output=True, text=True, timeout=300, env=env).stdout


def test_model_tiny_writes_a_loadable_checkpoint(tmp_path):
    out = run("model", "tiny", str(tmp_path / "m"))
    assert out.strip() == str(tmp_path / "m")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}


def test_generate_prints_each_prompts_output(tiny_model):
    out = run("generate", "--model", tiny_model, "--max-tokens", "5", "hello", "world")
    assert out.count("5 tokens, finish_reason=length") == 2 and "stats:" in out


def test_bench_engine_json_reports_both_throughputs_and_their_ratio(tiny_model):
    out = run("bench-engine", "--model", tiny_model, "--num-requests", "6", "--input-len", "8", "16",
              "--output-len", "4", "8", "--hf-batch-size", "3", "--repeat", "1", "--json")
    r = json.loads(out)
    assert r["engine"]["output_tokens_per_s"] > 0 and r["hf_generate"]["output_tokens_per_s"] > 0
    assert r["ratio"] > 0 and r["num_requests"] == 6
    assert r["engine"]["steps"] >= 4 and 1 < r["engine"]["mean_batch_size"] <= 6   # the requests ran batched
    assert 0 <= r["engine"]["kv_waste_slots_per_request"] < r["engine"]["block_size"]


def test_a_bad_argument_is_a_clear_error_not_a_traceback(tiny_model):
    p = subprocess.run([*TOKENBUS, "generate", "--model", tiny_model, "--max-tokens", "0", "x"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "max_tokens must be in [1, " in p.stderr and "Traceback" not in p.stderr


def test_every_chunk_rate_flag_refuses_a_negative_rate_naming_the_flag(capsys):
    """`tokenbus up` and bench-pipeline pass --chunk-rate to the worker: they check it as it does,
    before anything starts."""
    from lab.benchmarks.pipeline import stand_in_parser
    from ops.cli import parser as tokenbus
    from workers.service import parser as worker

    for p, args in ((tokenbus(), ["up"]), (tokenbus(), ["bench-pipeline"]), (worker(), ["--model", "m"]),
                    (stand_in_parser(), ["--nats-url", "x", "--step-ms", "1", "--vocab", "9",
                                       "--served-model-name", "m"])):
        with pytest.raises(SystemExit):
            p.parse_args([*args, "--chunk-rate", "-1"])
        assert "argument --chunk-rate: '-1': expected chunks per second, a number from 0 up" in capsys.readouterr().err
        assert p.parse_args([*args, "--chunk-rate", "0"]).chunk_rate == 0.0


@pytest.mark.parametrize("spec, why", [
    ("medusa", "'medusa': expected ngram[:K] or draft:DIR[:K]"),
    ("ngram:x", "'ngram:x': K must be a whole number of draft tokens, not 'x'"),
    ("ngram:0", "'ngram:0': num_speculative_tokens must be in [1, 16], not 0"),
    ("draft:d:0", "'draft:d:0': num_speculative_tokens must be in [1, 16], not 0"),
    ("draft", "'draft': speculative method 'draft' needs a model"),
])
def test_every_speculative_flag_refuses_a_bad_spec_naming_the_flag(spec, why, capsys):
    """`tokenbus up` passes --speculative to every worker: it checks it as the worker does, before anything
    starts."""
    from ops.cli import parser as tokenbus
    from workers.service import parser as worker

    for p, args in ((tokenbus(), ["up"]), (worker(), ["--model", "m"])):
        with pytest.raises(SystemExit):
            p.parse_args([*args, "--speculative", spec])
        assert f"argument --speculative: {why}" in capsys.readouterr().err


def test_up_starts_every_worker_with_its_speculation_and_a_draft_directory_made_absolute(tmp_path, monkeypatch):
    from ops.cli import parser as tokenbus
    from ops.up import worker_args
    from workers.service import engine_config
    from workers.service import parser as worker

    def worker_config(*up: str):
        """The EngineConfig.speculative of a worker that `tokenbus up *up` starts in another directory."""
        monkeypatch.chdir(tmp_path)
        argv = worker_args(tokenbus().parse_args(["up", *up]))
        monkeypatch.chdir("/")
        return argv, engine_config(worker().parse_args(["--model", "m", *argv])).speculative

    argv, spec = worker_config("--speculative", "draft:drafts/small:3", "--no-speculative-adaptive")
    assert argv == ["--speculative", f"draft:{tmp_path}/drafts/small:3", "--no-speculative-adaptive"]
    assert (spec["method"], spec["model"], spec["num_speculative_tokens"], spec["adaptive"]) == (
        "draft", f"{tmp_path}/drafts/small", 3, False)
    argv, spec = worker_config("--speculative", "ngram:2", "--max-num-seqs", "8")
    assert argv == ["--max-num-seqs", "8", "--speculative", "ngram:2"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["adaptive"]) == ("ngram", 2, True)
    assert worker_config() == ([], None)


def test_a_fixed_k_without_speculative_is_refused_by_up_and_by_the_worker(capsys):
    from ops.cli import parser as tokenbus
    from ops.up import check_speculative
    from workers.service import main as worker

    with pytest.raises(ValueError, match="--no-speculative-adaptive fixes the K of --speculative"):
        check_speculative(tokenbus().parse_args(["up", "--no-speculative-adaptive"]))
    with pytest.raises(SystemExit):
        worker(["--model", "m", "--no-speculative-adaptive"])
    assert "--no-speculative-adaptive fixes the K of --speculative" in capsys.readouterr().err


def test_status_shows_whether_each_worker_speculates_with_its_method_k_and_acceptance(nats_url, capsys):
    import bus
    from ops.cli import main
    from schemas.messages import Heartbeat, Speculation, encode

    spec = Speculation("ngram", 2, 4, True, 1, 0.61, 40, 120, 75, 0.625, 1.875, [0.8, 0.65])

    async def register():
        nc = await bus.connect(nats_url, "test")
        await bus.ensure_streams(nc.jetstream())
        kv = await bus.registry(nc.jetstream())
        await kv.put("w0", encode(Heartbeat("w0", time.time(), "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0)))
        await kv.put("w1", encode(Heartbeat("w1", time.time(), "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0, speculation=spec)))
        await nc.close()

    asyncio.run(register())
    main(["status", "--nats-url", nats_url])
    workers_table, streams_table = capsys.readouterr().out.split("\n\n")
    head, w0, w1 = workers_table.splitlines()
    assert head.split()[-1] == "speculation"
    assert w0.endswith(" off") and w1.endswith(" ngram k=2/4, 62.5% accepted")
    assert streams_table.splitlines()[0].split() == ["stream", "max", "held", "fill", "messages", "keeps"]
    assert streams_table.splitlines()[5].split()[0] == subjects.USAGE_STREAM
    assert streams_table.splitlines()[5].endswith("until recorded")
    main(["status", "--json", "--nats-url", nats_url])
    out = json.loads(capsys.readouterr().out)
    usage = next(s for s in out["streams"] if s["name"] == subjects.USAGE_STREAM)
    assert usage["max_bytes"] == subjects.stream_bytes(subjects.USAGE_STREAM, subjects.bus_storage())
    workers = out["workers"]
    assert workers[0]["speculation"] is None
    assert workers[1]["speculation"]["method"] == "ngram" and workers[1]["speculation"]["acceptance_rate"] == 0.625


@pytest.mark.slow
def test_bench_pipeline_runs_both_sides_and_reports_ratio_and_added_ttft(tiny_model):
    out = run("bench-pipeline", "--model", tiny_model, "--num-requests", "6", "--input-len", "8", "16",
              "--output-len", "4", "8", "--ttft-requests", "3", "--repeat", "1", "--json")
    r = json.loads(out)
    assert r["engine_output_tokens_per_s"] > 0 and r["pipeline_output_tokens_per_s"] > 0
    assert r["throughput_ratio"] == pytest.approx(r["pipeline_output_tokens_per_s"] / r["engine_output_tokens_per_s"],
                                                  abs=0.01)
    assert len(r["rounds"]["ttft_added"]) == 1 and r["pipeline_ttft_ms_median"] > 0


@pytest.mark.slow
def test_bench_pipeline_with_a_stand_in_engine_measures_the_pipeline_alone_and_every_process(tiny_model):
    out = run("bench-pipeline", "--model", tiny_model, "--stand-in", "5", "--num-requests", "6", "--input-len", "8",
              "16", "--output-len", "20", "20", "--repeat", "1", "--chunk-rate", "0", "--json")
    r = json.loads(out)
    assert r["engine_output_tokens_per_s"] is None and r["throughput_ratio"] is None
    assert r["pipeline_output_tokens_per_s"] <= 6 * 20 / (20 * 0.005)      # 20 steps of 5 ms at least
    cpu = r["pipeline_cpu"]
    assert set(cpu) == {"nats", "tokenizer", "router", "recorder", "worker", "gateway", "client"}
    assert all(u["cores"] >= 0 and u["us_per_token"] >= 0 for u in cpu.values())
    assert r["pipeline_cpu_but_worker"]["us_per_token"] == pytest.approx(
        sum(u["us_per_token"] for k, u in cpu.items() if k != "worker"), abs=0.01)


def test_bench_tp_splits_each_step_into_compute_and_communication(tiny_model):
    out = run("bench-tp", "--model", tiny_model, "--tp", "1", "2", "--num-requests", "4", "--input-len", "16", "24",
              "--output-len", "4", "6", "--num-kv-blocks", "64", "--json")
    r = json.loads(out)["results"]
    assert set(r) == {"1", "2"} and all(set(phases) == {"prefill", "decode"} for phases in r.values())
    for phase in ("prefill", "decode"):
        one, two = r["1"][phase], r["2"][phase]
        assert one["comm_ms"] == 0 and two["comm_ms"] > 0        # only a group of two talks
        assert 0 < two["transfer_ms"] <= two["comm_ms"]          # the wait for a slower rank taken out
        assert two["compute_ms"] + two["comm_ms"] == pytest.approx(two["step_ms"])
        assert one["steps"] == two["steps"]                      # the same schedule on both


@pytest.mark.slow
def test_bench_routing_runs_each_policy_on_one_stack_and_reports_hits_ttft_load_and_the_ceiling(tiny_model):
    out = run("bench-routing", "--model", tiny_model, "--policies", "round-robin", "prefix", "--conversations", "3",
              "--turns", "2", "--system-len", "32", "--user-len", "16", "32", "--reply-len", "4", "--kv-blocks", "64",
              "--shared-requests", "6", "--shared-clients", "2", "--think-ms", "0", "--json")
    r = json.loads(out)
    assert list(r["policies"]) == ["round-robin", "prefix"] and r["shared_prompt"]["requests"] == 6
    for m in [*r["policies"].values(), r["shared_prompt"]]:
        assert sum(m["requests_per_worker"].values()) == m["requests"] and m["ttft_ms_p99"] >= m["ttft_ms_p50"] > 0
        assert m["hit_rate"] == pytest.approx(m["hit_tokens"] / m["prompt_tokens"], abs=1e-4)
        assert m["actual_hit_tokens"] == m["hit_tokens"]            # the router saw every completion
    prefix = r["policies"]["prefix"]
    assert prefix["requests"] == 6 and prefix["hit_tokens"] > 0 and prefix["one_worker_hit_rate"] > 0
    assert set(r["goals"]) == {"prefix_vs_round_robin", "prefix_vs_one_worker", "prefix_load_ratio",
                               "shared_prompt_load_ratio"}


def test_building_the_parser_imports_no_torch_and_registers_the_lab_s_commands():
    code = ("import sys; from ops.cli import parser; p = parser(); "
            "names = p._subparsers._group_actions[0].choices; "
            "print('torch' in sys.modules, 'bench' in names, 'sim-check' in names, 'up' in names)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120).stdout
    assert out.split() == ["False", "True", "True", "True"]


def test_a_command_whose_package_is_absent_is_left_out_and_a_broken_one_is_an_error(monkeypatch, tmp_path):
    """The Docker image ships without lab/: its entry points name modules that are not there."""
    import importlib.metadata

    from ops import cli

    absent = importlib.metadata.EntryPoint("bench", "nolab.commands:bench", cli.GROUP)
    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda group: [absent])
    names = cli.parser()._subparsers._group_actions[0].choices
    assert "bench" not in names and {"model", "up", "log"} <= set(names)
    (tmp_path / "brokenlab.py").write_text("import no_such_dependency\n")    # there, but it cannot import
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = importlib.metadata.EntryPoint("bench", "brokenlab:bench", cli.GROUP)
    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda group: [broken])
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency"):
        cli.parser()

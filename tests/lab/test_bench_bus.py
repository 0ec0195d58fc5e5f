"""`tokenbus bench-bus`: a small run (one mock worker, one nats-server, both protocols, a second of Poisson
arrivals) reports every figure it promises, from what the stack really did: each request streamed to its
length, the pipeline's added TTFT paired per request from the records, the CPU of every service and of
nats-server, and the durable writes by stream; the mock model is the source's tokenizer with the shape's
layers; the command parses."""
import json
from argparse import Namespace
from pathlib import Path

import orjson
import pytest

from lab.benchmarks import bus_load
from ops.cli import parser

OUTPUT_LEN = 12


def bench_args(model: str, tmp_path: Path, **kw) -> Namespace:
    defaults = {"model": model, "shape": "llama-3-8b", "mock_gpu": "h100-sxm", "tp": 1, "workers": 1,
                "max_num_seqs": 64, "bus": ["single"], "fsync": ["default"], "protocol": ["ws", "sse"],
                "rate": [6.0], "duration": 1.5, "input_len": 48, "output_len": [OUTPUT_LEN], "idle": 1.0,
                "connections": 2, "timeout": 60.0, "seed": 0, "json": str(tmp_path / "r.json"),
                "plot": str(tmp_path / "r.png"), "calibration": str(tmp_path / "calibration.json")}
    return Namespace(**{**defaults, **kw})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_small_run_reports_rates_added_latency_cpu_and_durable_writes(tiny_model, tmp_path, capsys):
    args = bench_args(tiny_model, tmp_path)
    assert bus_load.main(args) == 0
    assert Path(args.plot).read_bytes().startswith(b"\x89PNG")
    report = orjson.loads(Path(args.json).read_bytes())
    assert [r["protocol"] for r in report["runs"]] == ["ws", "sse"]
    for r in report["runs"]:
        assert r["requests"] >= 2 and r["errors"] == 0, r
        assert r["tokens_per_s"] > 0 and r["sustained_rps"] > 0
        assert r["tokens_per_s"] / r["sustained_rps"] == pytest.approx(OUTPUT_LEN, rel=0.01)   # each to its length
        assert 0 < r["ttft_added_ms"]["p50"] <= r["ttft_added_ms"]["p99"] < r["ttft_ms"]["p99"]
        assert r["engine_itl_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
        for process in ("gateway", "tokenizer", "router", "w0", "w0.engine", "nats"):
            assert r["cpu_s"][process] >= 0 and r["cpu_ms_per_request"][process] >= 0, process   # net of idle CPU
            assert r["idle_cores"][process] < 0.5, process
        for process in ("gateway", "w0", "nats"):     # CPU counts in 10 ms ticks: the tokenizer's and the router's
            assert r["cpu_s"][process] > 0, process  # few ms of a small run can round to none
        assert r["pipeline_cpu_ms_per_request"] > 0
        assert "w0.engine" not in r["busiest"]["process"]
        d = r["durable"]
        for stream in ("TB_REQUESTS", "TB_WORK", "TB_RESULTS", "TB_USAGE"):
            assert d["stored_by_stream"][stream] >= r["requests"], stream    # at least one write a request each
        assert d["publishes_per_request"] >= d["stored_per_request"] >= 4     # request, work, end, usage
        assert d["bytes_per_request"] > 48                                    # the prompt's text, at least
    assert [s["protocol"] for s in report["saturation"]] == ["ws", "sse"]
    cal = json.loads(Path(args.calibration).read_text())
    assert (cal["bus"], cal["nodes"], cal["input_len"], cal["tokens_separated"]) == ("single", 1, 48, False)
    assert set(cal["roles"]) == {"gateway", "tokenizer", "router", "worker_service", "broker"}
    assert cal["roles"]["gateway"]["ms_per_request"] > 0 and cal["durable"]["stored_per_request"] >= 4
    out = capsys.readouterr().out
    assert "saturates first" in out and "single  default ws" in out


def test_the_calibration_separates_a_requests_cost_from_its_tokens_given_two_output_lengths():
    """Runs whose CPU is exactly 3 ms a request + 20 ms per 1,000 tokens (gateway), 5 ms a request (router),
    split over the cluster's three nodes (broker): the fit gives those back."""
    def row(n: int, output_len: int) -> dict:
        tokens = n * output_len
        cpu = {"gateway": 3 + 20 * output_len / 1e3, "router": 5.0, "tokenizer": 1.0, "w0": 2.0, "w0.engine": 50.0,
               **{f"tb-{i}": (1.0 + 3 * output_len / 1e3) / 3 for i in (1, 2, 3)}}     # ms a request
        return {"bus": "cluster", "fsync": "always", "output_len": output_len, "completed": n, "tokens": tokens,
                "cpu_ms_per_request": cpu, "durable": {"stored_per_request": 6, "publishes_per_request": 7,
                                                       "bytes_per_request": 40000}}
    rows = [row(40, 100), row(30, 400), row(80, 100), row(60, 400)]
    cal = bus_load.calibration(rows, Namespace(input_len=3000))
    assert cal["tokens_separated"] and cal["output_lens"] == [100, 400] and cal["nodes"] == 3
    r = cal["roles"]
    assert r["gateway"] == {"ms_per_request": pytest.approx(3, abs=1e-3),
                            "ms_per_1k_tokens": pytest.approx(20, abs=1e-3)}
    assert r["router"]["ms_per_request"] == pytest.approx(5, abs=1e-3) and r["router"]["ms_per_1k_tokens"] < 1e-3
    assert r["broker"] == {"ms_per_request": pytest.approx(1, abs=1e-3), "ms_per_1k_tokens": pytest.approx(3, abs=1e-3)}
    assert r["worker_service"]["ms_per_request"] == pytest.approx(2, abs=1e-3)        # the engine's thread not counted


def test_the_mock_model_has_the_shapes_layers_and_the_sources_tokenizer(tiny_model, tmp_path):
    path = Path(bus_load.shaped_model(tiny_model, "llama-3-70b", tmp_path))
    config, source = json.loads((path / "config.json").read_text()), json.loads(
        (Path(tiny_model) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (80, 8192, 8)
    assert config["vocab_size"] == source["vocab_size"]          # the tokens the tokenizer knows
    assert (path / "tokenizer.json").read_bytes() == (Path(tiny_model) / "tokenizer.json").read_bytes()
    assert [f.name for f in path.iterdir() if f.is_symlink()] == ["model.safetensors"]


def test_the_command_parses():
    args = parser().parse_args(["bench-bus", "--bus", "single", "cluster", "--fsync", "default", "always",
                                "--rate", "2", "4", "--tp", "8", "--json", "r.json"])
    assert (args.bus, args.fsync, args.rate, args.tp, args.shape) == (["single", "cluster"], ["default", "always"],
                                                                      [2.0, 4.0], 8, "llama-3-70b")
    assert args.protocol == ["ws", "sse"] and args.input_len == 3000 and args.output_len == [400]

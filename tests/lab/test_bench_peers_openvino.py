"""OpenVINO GenAI as a peer in `tokenbus bench-peers` (lab/peers/openvino_peer.py, run in the venv that
lab/peers/clients.py installs): the tiny model exported once and then reused, made again when its marker
is missing; the command's rows for it, every request run to its length; and its greedy tokens, computed
in float32, equal to the engine's on the same prompts."""
import random
from pathlib import Path

import pytest

from lab.common.turns import Turn, Workload
from lab.peers import bench as bp
from lab.peers import openvino_peer
from ops.cli import parser
from schemas.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]   # a first install downloads OpenVINO and optimum-intel

F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}   # OpenVINO's defaults here: bf16, f16


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The exports' folder of this module's tests, in place of $TOKENBUS_HOME/peers/openvino."""
    root = tmp_path_factory.mktemp("openvino")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openvino_peer, "exports_dir", lambda: root)
        yield root


@pytest.fixture(scope="module")
def export(exports, tiny_model) -> Path:
    """The tiny model exported with fp32 weights (its venv installed first, unless it is there)."""
    return openvino_peer.exported(openvino_peer.label(tiny_model, tiny_model), tiny_model, "fp32")


def test_the_export_is_made_once_and_made_again_when_its_marker_is_missing(export, tiny_model, monkeypatch):
    assert (export / "openvino_model.xml").exists() and (export / "openvino_tokenizer.xml").exists()
    assert openvino_peer.made(export) == openvino_peer.source(Path(tiny_model), "fp32")
    calls = []
    monkeypatch.setattr(openvino_peer, "export", lambda *args: calls.append(args))
    name = openvino_peer.label(tiny_model, tiny_model)
    assert openvino_peer.exported(name, tiny_model, "fp32") == export and calls == []       # reused
    marker = export / openvino_peer.MARKER
    kept = marker.read_text()
    marker.unlink()                                       # as an export cut off before its end leaves it
    try:
        assert openvino_peer.exported(name, tiny_model, "fp32") == export and len(calls) == 1
    finally:
        marker.write_text(kept)


def test_its_greedy_tokens_in_float32_are_the_engines(export, tiny_model, tmp_path):
    from workers import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(16, 4096) for _ in range(n)] for n in (5, 17, 40, 64)]
    w = Workload("greedy", [[Turn(p, 12)] for p in prompts], concurrency=3)
    out = openvino_peer.run_pipeline(export, [w], threads=1, log_file=tmp_path / "openvino.log", properties=F32)
    assert out["compiled"]["INFERENCE_PRECISION_HINT"] == "f32" and out["compiled"]["KV_CACHE_PRECISION"] == "f32"
    got = {r["conversation"]: r["token_ids"] for r in out["runs"][0]["results"]}
    llm = LLM(tiny_model, dtype="float32", num_kv_blocks=64)
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    assert [got[i] for i in range(len(prompts))] == want


def test_the_command_runs_every_request_to_its_length_and_says_what_precision_it_ran_in(export, tiny_model,
                                                                                        tmp_path):
    args = parser().parse_args([
        "bench-peers", "--model", tiny_model, "--engines", "engine", "openvino", "--workloads", "single",
        "concurrent", "--single-requests", "2", "--single-input-len", "8", "--single-output-len", "4",
        "--num-requests", "6", "--concurrency", "3", "--input-len", "4", "24", "--output-len", "5", "--threads", "1",
        "--peak-gflops", "100", "--peak-gflops-bf16", "1000", "--data-dir", str(tmp_path)])
    report = bp.main(args)
    for wname, asked in (("single", 8), ("concurrent", 30)):
        row = report["workloads"][wname]["engines"]["openvino"]
        assert "error" not in row, row.get("error")
        assert row["output_tokens"] == row["output_tokens_asked"] == asked and row["failed"] == 0
        assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["p50"] > 0 and row["peak_rss_bytes"] > 0
        assert row["export"] == str(export)                                           # the one made before
        assert row["precision"] in ("bf16", "fp32") and row["note"].startswith("fp32 weights, compiled for")
        assert row["scheduler"]["max_num_seqs"] == (1 if wname == "single" else 3)
        assert row["compiled"]["INFERENCE_NUM_THREADS"] == "1"

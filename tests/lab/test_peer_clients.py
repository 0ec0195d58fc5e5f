"""Other projects' benchmark clients, unchanged (lab/peers/clients.py installs each pinned version into a
venv of its own), run a short benchmark of the OpenAI chat API of a real stack (one worker, the tiny
model): guidellm 0.8.1 and aiperf 0.13. Each must finish every request without an error, count the
output tokens asked for (ignore_eos, by the server's usage) and measure a TTFT for every request."""
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from lab.peers import clients as peer_clients
from ops.procs import free_port
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]   # a first install downloads the clients

REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 2, 32, 8
RUN_TIMEOUT = 300.0
QUIET = {"HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "HF_DATASETS_OFFLINE": "1"}
OFFLINE = {**QUIET, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# aiperf 0.13 cannot load a tokenizer from a local directory in HF offline mode (it looks the path up as a
# hub repo id: HFValidationError), so it runs online against a hub that is a refused port of this machine.
NO_HUB = {**QUIET, "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    with running(Stack(tiny_model, free_port(), tmp_path_factory.mktemp("peer-clients"), nats_port=free_port(),
                       workers=1, worker_args=[*WORKER_ARGS, "--threads", "1"])) as s:
        yield s


@pytest.fixture(scope="module")
def model(stack) -> str:
    """The model name the gateway serves, as GET /v1/models says."""
    with urllib.request.urlopen(f"{stack.http}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def run(args: list, cwd: Path, env: dict) -> None:
    """The client in a process group of its own (its workers are processes too), killed whole on timeout;
    env's None values are unset."""
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    p = subprocess.Popen([str(a) for a in args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=RUN_TIMEOUT)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, f"{Path(args[0]).name} exited with {p.returncode}:\n{out[-6000:]}"


def test_guidellm_benchmarks_the_chat_api_without_an_error(stack, model, tiny_model, tmp_path):
    guidellm = peer_clients.client("guidellm")
    report = tmp_path / "guidellm.json"
    run([guidellm, "run", "--backend", f"kind=openai_http,target={stack.http},model={model}",
         "--profile", f"kind=concurrent,streams={CONCURRENCY}",
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
         "--tokenizer", f"kind=huggingface_auto,model={tiny_model}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        tmp_path, {**OFFLINE, "GUIDELLM__MAX_WORKER_PROCESSES": "1"})   # one process: 2 streams need no more
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    output = metrics["output_token_count"]["successful"]
    assert output["count"] == REQUESTS and output["min"] == output["max"] == OUTPUT_TOKENS
    assert metrics["prompt_token_count"]["successful"]["min"] >= PROMPT_TOKENS      # plus the chat template's
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == REQUESTS and ttft["min"] > 0


def test_aiperf_benchmarks_the_chat_api_without_an_error(stack, model, tiny_model, tmp_path):
    aiperf = peer_clients.client("aiperf")
    artifacts = tmp_path / "artifacts"
    run([aiperf, "profile", "--model", model, "--url", stack.http, "--endpoint-type", "chat", "--streaming",
         "--request-count", REQUESTS, "--concurrency", CONCURRENCY,
         "--synthetic-input-tokens-mean", PROMPT_TOKENS, "--synthetic-input-tokens-stddev", 0,
         "--output-tokens-mean", OUTPUT_TOKENS, "--extra-inputs", "ignore_eos:true",
         "--use-server-token-count",        # our usage, not the text retokenized (not a round trip)
         "--tokenizer", tiny_model, "--artifact-dir", artifacts, "--ui", "none", "--no-gpu-telemetry"],
        tmp_path, NO_HUB)
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["completed_request_count"]["avg"] == REQUESTS
    assert summary["request_error_rate"]["avg"] == 0 and not summary["error_summary"]
    output = summary["output_sequence_length"]
    assert output["count"] == REQUESTS and output["min"] == output["max"] == OUTPUT_TOKENS
    ttft = summary["time_to_first_token"]
    assert ttft["count"] == REQUESTS and ttft["min"] > 0
    scraped = json.loads((artifacts / "server_metrics_export.json").read_text())["summary"]
    assert scraped["endpoints_successful"] == [f"{stack.http}/metrics"]     # it reads our Prometheus text

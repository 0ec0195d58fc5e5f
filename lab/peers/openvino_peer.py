"""Intel's OpenVINO GenAI as a peer of the engine: our checkpoint exported once by optimum-intel to
OpenVINO's format, run by its ContinuousBatchingPipeline on the CPU, both from the OpenVINO venv of
lab/peers/clients.py (openvino-genai and optimum-intel, pinned there):

    export = exported(name, model_dir, "int8")     # $TOKENBUS_HOME/peers/openvino/<name>-int8/, made on first use
    out = run_pipeline(export, [warm, w], threads=2, log_file=path)   # lab/peers/openvino_run.py there

The export: `optimum-cli export openvino --task text-generation-with-past --weight-format fp32|int8`
(int8: weights compressed per channel by NNCF, activations left to the runtime), under a lock, its
marker written last (a cut-off export, or one of another checkpoint or pin, is made again).

The pipeline, sized as the engine's own runs are sized (lab.common.turns.EngineLoop): max_num_seqs the
concurrency, max_num_batched_tokens 2048 (the engine's token budget of a step; OpenVINO's default is 256),
num_kv_blocks enough for every request at the workload's longest context (blocks of 32 tokens, OpenVINO's
on a CPU), prefix caching on (as the engine's and llama-server's are; rounds draw fresh prompts, so no
cache carries over), dynamic split-fuse as OpenVINO defaults (on). Properties: INFERENCE_NUM_THREADS the
--threads, the rest as OpenVINO picks them for this CPU and export: the inference precision bf16 where the
CPU has bf16 instructions (else f32); the KV cache u8, but f16 for an fp32 export (optimum-intel writes
that into its runtime options); for int8 weights, activations quantized to int8 on the fly (dynamic
quantization, groups of 32). Each row says what the compiled model reports."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from lab.common.results import Result
from lab.common.turns import Workload, figures, warmup
from lab.peers import clients
from lab.peers.llamacpp import PeerError, peers_dir
from workers.models import catalogue

CLIENT = "openvino"
SCRIPT = Path(__file__).with_name("openvino_run.py")
WEIGHTS = ("fp32", "int8")          # --weight-format of the export
MARKER = "tokenbus-openvino-export.json"
EXPORT_TIMEOUT = 1800.0
BLOCK = 32                          # OpenVINO's KV block on a CPU, in tokens
STEP_TOKENS = 2048
PRECISIONS = {"bf16": "bf16", "f32": "fp32", "f16": "f16"}     # INFERENCE_PRECISION_HINT -> Engine.precision


def exports_dir() -> Path:
    return peers_dir() / "openvino"


# -- the export -----------------------------------------------------------------------------------

def exported(name: str, model_dir: str | Path, weights: str, log=print) -> Path:
    """exports_dir()/<name>-<weights>/: `model_dir` (a HF checkpoint) exported with `weights` (fp32, int8)
    unless an export of the same checkpoint by the same tools is there."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    out = exports_dir() / f"{name}-{weights}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        want = source(Path(model_dir), weights)
        if made(out) != want:
            export(Path(model_dir), out, weights, want, log)
    return out


def source(model_dir: Path, weights: str) -> dict:
    """What an export is made of: the checkpoint (its path and files), the weight format, the tools."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    digest = hashlib.sha256("\n".join(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files).encode())
    return {"checkpoint": str(model_dir.resolve()), "files": digest.hexdigest()[:16], "weights": weights,
            "tools": " ".join(clients.specs(CLIENT))}


def made(out: Path) -> dict | None:
    """The marker's source of a whole export at `out`, None if there is none."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return {k: marker.get(k) for k in ("checkpoint", "files", "weights", "tools")}


def export(model_dir: Path, out: Path, weights: str, want: dict, log=print) -> None:
    """optimum-cli of the OpenVINO venv writes the export into `out` (emptied first); the marker last."""
    cli = tool("optimum-cli", log)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past",
           "--weight-format", weights, str(out)]
    log(f"exporting {model_dir} to OpenVINO ({weights} weights) into {out} (once; later runs reuse it)")
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=EXPORT_TIMEOUT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise PeerError(f"optimum-cli export openvino exited with code {done.returncode}:\n{tail}")
    seconds = round(time.monotonic() - start, 1)
    (out / MARKER).write_text(json.dumps({**want, "command": cmd, "seconds": seconds}, indent=1))
    log(f"exported in {seconds} s")


def tool(command: str, log=print) -> Path:
    """`command` of the OpenVINO venv, made first unless it is complete."""
    try:
        return clients.client(CLIENT, command, log)
    except clients.InstallError as e:
        raise PeerError(f"cannot install OpenVINO: {e}") from e


def label(model_name: str, model_dir: str | Path) -> str:
    """The name of a model's exports: a catalogue model's name, else its directory's name and a hash of its path."""
    if model_name in catalogue.CATALOGUE:
        return model_name
    path = str(Path(model_dir).resolve())
    return f"{Path(path).name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


# -- the runs -------------------------------------------------------------------------------------

def scheduler(rounds: list[Workload]) -> dict:
    """SchedulerConfig's fields for `rounds` (see the module's docstring)."""
    concurrency = rounds[0].concurrency
    context = max(w.context for w in rounds)
    return {"max_num_seqs": concurrency, "max_num_batched_tokens": STEP_TOKENS,
            "num_kv_blocks": concurrency * math.ceil(context / BLOCK), "enable_prefix_caching": True}


def run_pipeline(export_dir: Path, workloads: list[Workload], threads: int, log_file: Path,
                 properties: dict | None = None, config: dict | None = None, log=print) -> dict:
    """openvino_run.py in the OpenVINO venv: `workloads` in turn through one pipeline on the CPU with
    INFERENCE_NUM_THREADS `threads` and `properties`, sized by scheduler(workloads) unless `config` is
    given. Its output (openvino_run.py's RESULT, its stdout and stderr in `log_file`); PeerError with the
    log's tail if it fails."""
    python = tool("python", log)
    request = {"model": str(export_dir), "device": "CPU",
               "properties": {"INFERENCE_NUM_THREADS": threads, **(properties or {})},
               "scheduler": config or scheduler(workloads),
               "workloads": [{"concurrency": w.concurrency,
                              "conversations": [[[t.prompt, t.max_tokens] for t in c] for c in w.conversations]}
                             for w in workloads]}
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokenbus-openvino-") as tmp:
        asked, answer = Path(tmp) / "request.json", Path(tmp) / "result.json"
        asked.write_text(json.dumps(request))
        with open(log_file, "w") as out:
            done = subprocess.run([str(python), str(SCRIPT), str(asked), str(answer)], stdout=out,
                                  stderr=subprocess.STDOUT)
        if done.returncode:
            tail = "\n".join(log_file.read_text(errors="replace").strip().splitlines()[-15:])
            raise PeerError(f"{SCRIPT.name} exited with code {done.returncode}:\n{tail}")
        result = json.loads(answer.read_text())
    return {**result, "scheduler": request["scheduler"], "properties": request["properties"]}


def results(run: dict) -> tuple[list[Result], float]:
    """One run of openvino_run.py as closed_loop() returns one: its Results and seconds."""
    return [Result(r["start"], chunks=r["chunks"], end=r["end"], prompt_tokens=r["prompt_tokens"],
                   output_tokens=len(r["token_ids"]), error=r["error"]) for r in run["results"]], run["seconds"]


def measure(name: str, model_name: str, model_dir: str, rounds: list[Workload], threads: int, vocab: int,
            log_dir: Path, log=print) -> dict:
    """The engine `name` (openvino: fp32 weights; openvino-int8: int8 weights) on the model `model_name`
    (a catalogue name or a path) at `model_dir`: the warm-up, then each round, in one process; their
    figures, its peak RSS, and the precisions it ran in."""
    weights = "int8" if name == "openvino-int8" else "fp32"
    export_dir = exported(label(model_name, model_dir), model_dir, weights, log)
    out = run_pipeline(export_dir, [warmup(rounds[0], vocab), *rounds], threads,
                       log_dir / f"{name}-{rounds[0].name}.log", log=log)
    runs = [figures(w, *results(r)) for w, r in zip(rounds, out["runs"][1:], strict=True)]
    compiled = out["compiled"]
    ran_in = PRECISIONS.get(compiled["INFERENCE_PRECISION_HINT"], compiled["INFERENCE_PRECISION_HINT"])
    row = {"runs": runs, "peak_rss_bytes": out["peak_rss_bytes"], "rss_of": "the OpenVINO process (spawned for "
           "this workload)", "export": str(export_dir), "compiled": compiled, "scheduler": out["scheduler"],
           "versions": out["versions"], "note": note(weights, compiled)}
    if weights == "fp32":
        row["precision"] = ran_in               # the weights are f32; the runtime computes in its own precision
    return row


def note(weights: str, compiled: dict) -> str:
    """What the compiled model says it computes in: the inference precision, the KV cache's, and for int8
    weights whether activations are quantized too (dynamic quantization)."""
    text = (f"{weights} weights, compiled for {compiled['INFERENCE_PRECISION_HINT']} inference, "
            f"KV cache {compiled['KV_CACHE_PRECISION']}")
    if weights != "int8":
        return text
    group = int(compiled["DYNAMIC_QUANTIZATION_GROUP_SIZE"] or 0)
    return text + (f", activations quantized to int8 dynamically (groups of {group})" if group else
                   ", activations not quantized (no dynamic quantization)")

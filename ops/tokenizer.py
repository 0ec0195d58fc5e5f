"""The tokenizer of a checkpoint, to show token ids as text (inspect, replay) and to cut prompts to token
lengths (bench), without importing torch."""
import os
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model: str | None = None, build: bool = True) -> Tokenizer | None:
    """The checkpoint's tokenizer.json (default: the tiny model, built on first use; None when it is not
    built and build is False)."""
    if model is None:
        model = tiny_model(build)
        if model is None:
            return None
    return Tokenizer.from_file(str(Path(model) / "tokenizer.json"))


def tiny_model(build: bool) -> Path | None:
    if build:
        from workers.models.builder import default_model_dir  # torch and transformers: only to build it
        return default_model_dir()
    tiny = Path(os.environ.get("TOKENBUS_HOME") or Path.home() / ".cache" / "tokenbus") / "models" / "tiny"
    return tiny if (tiny / "tokenizer.json").exists() else None

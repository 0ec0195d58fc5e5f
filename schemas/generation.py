"""A served model's default sampling parameters: what its authors recommend, given to every field of FIELDS
that a request leaves unset (vLLM's `--generation-config`). Where they come from (`source`):

- `auto`: every field of FIELDS the model's generation_config.json sets; for a catalogue model whose file sets
  none, its catalogue entry's (workers/models/catalogue.py), which its pull stamp carries;
- `none`: none, so an unset field is SamplingParams' own (temperature 1, no filter, no penalty);
- a path: that JSON file, or the generation_config.json in that directory.

The gateway fills them in before it stores a request in the request log, so both logs hold the parameters a
request ran with and a replay of it is the same request whatever the stack's defaults. A request that asks for
greedy decoding (temperature 0) gets none of them: it stays the argmax of the model's own logits."""
import json
from collections.abc import Collection
from pathlib import Path

from schemas.sampling import SamplingParams

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")   # what vLLM's --generation-config takes
CONFIG = "generation_config.json"
STAMP = "tokenbus_pull.json"                     # a pulled catalogue model's stamp: its entry, "sampling" included
HELP = ("the default sampling parameters, for every field of " + ", ".join(FIELDS) + " a request leaves unset: auto, "
        "the model's generation_config.json (a catalogue model's recommended ones where it sets none); none, "
        "SamplingParams' own (temperature 1, no filter, no penalty); or a JSON file of them (default: auto)")


def load(model_dir: str | Path, source: str = "auto") -> dict[str, float | int]:
    """The defaults of the model whose files are in model_dir, by `source` (auto, none or a path); ValueError
    naming the file and the field when a file cannot be read or holds a value SamplingParams refuses."""
    if source == "none":
        return {}
    if source == "auto":
        path = Path(model_dir) / CONFIG
        found = picked(read(path)) if path.is_file() else {}
        stamp = Path(model_dir) / STAMP
        if not found and stamp.is_file():
            path, found = stamp, picked(read(stamp).get("sampling") or {})
    else:
        path = Path(source) / CONFIG if Path(source).is_dir() else Path(source)
        found = picked(read(path))
    try:
        params = SamplingParams(**found)
    except ValueError as e:
        raise ValueError(f"generation config {path}: {e}") from None
    return {k: getattr(params, k) for k in found}              # as SamplingParams holds them (top_k -1 is 0)


def read(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation config {path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"generation config {path}: not a JSON object")
    return obj


def picked(obj: dict) -> dict:
    return {k: obj[k] for k in FIELDS if obj.get(k) is not None}


def fill(params: SamplingParams, given: Collection[str], defaults: dict) -> None:
    """Sets each field of `defaults` that the request did not set (`given`: the names it set), unless it set
    temperature 0: a greedy request keeps SamplingParams' own for every field it left unset."""
    if "temperature" in given and params.temperature == 0:
        return
    for name, value in defaults.items():
        if name not in given:
            setattr(params, name, value)


def shown(defaults: dict) -> str:
    """The defaults in a line: `temperature 0.2, top_p 0.9, repetition_penalty 1.1`, or `none`."""
    return ", ".join(f"{k} {v:g}" for k, v in defaults.items()) or "none"

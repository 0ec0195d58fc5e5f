"""The served models file: what `tokenbus up` serves, one entry per (name, revision), written once it has
resolved every model and given to the tokenizer and the gateways (`--models FILE`):

    {"models": [{"name": "chat", "revision": "3f9a27c1d2e4", "files": "/m/chat", "share": 0.0}, ...]}

`files` is the directory with the model's config.json and tokenizer files. A name's entries are its
revisions: one with share 0, the stable one, and any canaries, each taking `share` of the name's requests
(together less than all of them). The first entry's name is the default model."""
import json
from dataclasses import asdict, dataclass
from pathlib import Path

SEPARATOR = "@"                                  # a model name pinned to a revision: name@revision


@dataclass(slots=True)
class Served:
    name: str
    revision: str
    files: str
    share: float = 0.0                           # a canary's share of its name's requests; 0: the stable revision


def serves(hb, model: str, revision: str) -> bool:
    """Whether a worker (its Heartbeat) serves the model a request names, and its revision when pinned ("": any)."""
    return (not model or hb.model == model) and (not revision or hb.revision == revision)


def check(models: list[Served], where: str = "models") -> None:
    """ValueError naming the entry and the rule: a name with no stable revision or two, a revision served
    twice under one name, a share outside [0, 1) or shares of one name adding up to 1 or more."""
    if not models:
        raise ValueError(f"{where}: no model to serve")
    seen = set()
    for i, m in enumerate(models):
        if not m.name or SEPARATOR in m.name:
            raise ValueError(f"{where}[{i}].name: {m.name!r} must be non-empty and without {SEPARATOR!r}")
        if not 0 <= m.share < 1:
            raise ValueError(f"{where}[{i}].share: {m.share} must be in (0, 1) for a canary, or left out")
        if (m.name, m.revision) in seen:
            raise ValueError(f"{where}[{i}]: {m.name}{SEPARATOR}{m.revision} is served twice (the same weights "
                             f"under one name)")
        seen.add((m.name, m.revision))
    for name in dict.fromkeys(m.name for m in models):
        mine = [m for m in models if m.name == name]
        stable = [m for m in mine if m.share == 0]
        if len(stable) != 1:
            raise ValueError(f"{where}: model {name!r} has {len(stable)} entries without a share; exactly one is "
                             "its stable revision, the others are canaries with a share")
        if sum(m.share for m in mine) >= 1:
            raise ValueError(f"{where}: the canaries of {name!r} share {sum(m.share for m in mine):g} of its "
                             "requests; together they must take less than 1, the stable revision the rest")


def load(path: str | Path) -> list[Served]:
    """The entries of a served models file, checked; ValueError naming the file and the entry."""
    try:
        obj = json.loads(Path(path).read_text())
        models = [Served(str(m["name"]), str(m["revision"]), str(m["files"]), float(m.get("share", 0.0)))
                  for m in obj["models"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a served models file ({type(e).__name__}: {e})") from None
    check(models, str(path))
    return models


def dump(models: list[Served], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"models": [asdict(m) for m in models]}, indent=1))

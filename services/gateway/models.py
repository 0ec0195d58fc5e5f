"""The models a gateway serves: per name its revisions, each with its tokenizer and context, and the canary
split that decides which revision answers a request. A client names a model (`chat`) or pins a revision
(`chat@3f9a27c1d2e4`). The split is a function of the request id alone: the first 8 bytes of its SHA-256
as a fraction of 2^64, against the canaries' cumulative shares; so it is reproducible, and over many
requests each canary takes its share."""
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from tokenizers import Tokenizer

from schemas import generation
from schemas.revision import revision as revision_of
from schemas.served import SEPARATOR, Served, check
from services.gateway.errors import ApiError
from text import toolcalls


@dataclass(slots=True)
class Revision:
    revision: str
    share: float                                  # of its name's requests; 0: the stable revision
    tokenizer: Tokenizer
    max_model_len: int
    tool_parser: str = "hermes"                   # how its model writes tool calls (text/toolcalls.py)
    sampling: dict = field(default_factory=dict)  # its defaults for what a request leaves unset (schemas/generation.py)


@dataclass(slots=True)
class Model:
    name: str
    revisions: list[Revision] = field(default_factory=list)    # the stable one first, then the canaries

    def split(self, rid: str) -> Revision:
        """The revision that answers request `rid`: a canary for its share of the ids, else the stable one."""
        x, edge = fraction(rid), 0.0
        for r in self.revisions[1:]:
            edge += r.share
            if x < edge:
                return r
        return self.revisions[0]

    def pinned(self, rev: str) -> Revision:
        r = next((r for r in self.revisions if r.revision == rev), None)
        if r is None:
            have = ", ".join(f"{self.name}{SEPARATOR}{r.revision}" for r in self.revisions)
            raise ApiError(404, f"model {self.name!r} has no revision {rev!r}; it serves {have}", "model_not_found",
                           "model")
        return r


def fraction(rid: str) -> float:
    """Where request `rid` falls in [0, 1): the canary split's uniform draw."""
    return int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big") / 2.0 ** 64


class Models:
    """Every served model by name, in the order given; the first is the default. `generation_config` is where each
    model's sampling defaults come from (auto, none or a file: schemas/generation.py)."""

    def __init__(self, served: list[Served], tool_parser: str | None = None, generation_config: str = "auto"):
        check(served)
        files: dict[str, tuple[Tokenizer, int, str, dict]] = {}
        self.by_name: dict[str, Model] = {}
        for s in sorted(served, key=lambda s: s.share > 0):          # stable revisions first, order kept
            if s.files not in files:
                config = orjson.loads(Path(s.files, "config.json").read_bytes())
                files[s.files] = (Tokenizer.from_file(f"{s.files}/tokenizer.json"),
                                  config.get("max_position_embeddings") or 1 << 30,
                                  tool_parser or toolcalls.pick(chat_template(s.files)),
                                  generation.load(s.files, generation_config))
            model = self.by_name.setdefault(s.name, Model(s.name))
            model.revisions.append(Revision(s.revision, s.share, *files[s.files]))
        self.default = served[0].name
        self.by_name = {s.name: self.by_name[s.name] for s in served}                    # the file's order

    @classmethod
    def one(cls, model_dir: str, name: str | None = None, tool_parser: str | None = None,
            generation_config: str = "auto") -> "Models":
        """A gateway of one model: its checkpoint directory (revision "" when it holds no weights, e.g. a
        GGUF's files) served under `name` (default: the directory's name)."""
        try:
            rev = revision_of(model_dir)
        except ValueError:
            rev = ""
        return cls([Served(name or os.path.basename(os.path.normpath(model_dir)), rev, model_dir)], tool_parser,
                   generation_config)

    def find(self, asked: str, rid: str = "") -> tuple[Model, Revision]:
        """The model and revision that answer a request for `asked` (a name, or name@revision pinned) with
        id `rid`; ApiError 404 model_not_found naming what is served."""
        name, _, rev = asked.partition(SEPARATOR)
        model = self.by_name.get(name)
        if model is None:
            raise ApiError(404, f"model {asked[:200]!r} does not exist; this server serves {self.names()}",
                           "model_not_found", "model")
        return model, model.pinned(rev) if rev else model.split(rid)

    def names(self) -> str:
        return ", ".join(repr(n) for n in self.by_name)

    def ids(self) -> list[str]:
        """What a client may ask for: each name, and each name@revision."""
        return [*self.by_name, *(f"{m.name}{SEPARATOR}{r.revision}" for m in self.by_name.values()
                                 for r in m.revisions if r.revision)]


def chat_template(model_dir: str) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, or tokenizer_config.json's (the default of a list)."""
    path = Path(model_dir, "chat_template.jinja")
    if path.exists():
        return path.read_text()
    config = Path(model_dir, "tokenizer_config.json")
    template = orjson.loads(config.read_bytes()).get("chat_template") if config.exists() else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None

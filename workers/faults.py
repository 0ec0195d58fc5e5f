"""Faults a worker injects into itself on purpose, for tests and chaos runs only: off unless asked for.

    python -m workers.service ... --inject-fault drop-chunks=2,final --inject-fault kv-die-after=1

Each `--inject-fault NAME=VALUE` (repeatable) turns on one fault (docs/containment.md, "Injected faults"):

- `drop-chunks=2,final`: the listed token chunks of every request (chunk numbers, and `final`) are not
  published on tb.out; the gateway must recover them (Resend, the request's end record).
- `kv-die-after=N`: a prefill worker SIGKILLs itself after answering N KV fetches (a death mid-transfer).
- `forward-raise=TOKEN`: the model forward of any step whose input holds TOKEN raises (a poison request).
- `forward-exit=TOKEN`: the same, but the process ends at once (exit code 70), as a crash in a kernel would.

The components that can fail are handed the parsed `Faults`; with none asked for, what each pays on its
hot path is one check of an empty field.
"""
import argparse
from dataclasses import dataclass

NAMES = {"drop-chunks": "CHUNKS", "kv-die-after": "N", "forward-raise": "TOKEN", "forward-exit": "TOKEN"}


@dataclass(frozen=True, slots=True)
class Faults:
    drop_chunks: frozenset[str] = frozenset()    # chunk numbers (as text) and "final", not published
    kv_die_after: int = 0                         # KV fetches answered before a SIGKILL (0: never)
    forward_raise: int | None = None              # a token whose step's model forward raises
    forward_exit: int | None = None               # a token whose step's model forward ends the process

    @classmethod
    def of(cls, asked: list[tuple[str, str]]) -> "Faults":
        """The faults of the parsed `--inject-fault` flags (see `fault`)."""
        fields = {}
        for name, value in asked:
            if name == "drop-chunks":
                fields["drop_chunks"] = frozenset(p.strip() for p in value.split(",") if p.strip())
            else:
                fields[name.replace("-", "_")] = int(value)
        return cls(**fields)

    def __bool__(self) -> bool:
        return self != NO_FAULTS

    def inject(self, engine) -> None:
        """The model-forward faults, into the engine (LLMEngine.inject_fault)."""
        if self.forward_raise is not None:
            engine.inject_fault(self.forward_raise, "raise")
        if self.forward_exit is not None:
            engine.inject_fault(self.forward_exit, "exit")


NO_FAULTS = Faults()


def fault(text: str) -> tuple[str, str]:
    """An argparse type: one `--inject-fault NAME=VALUE`, checked."""
    name, _, value = text.partition("=")
    if name not in NAMES:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown fault (known: {', '.join(NAMES)})")
    if not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give {name}={NAMES[name]}")
    if name != "drop-chunks" and not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: {NAMES[name]} must be a whole number")
    return name, value


def add_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inject-fault", type=fault, action="append", default=[], metavar="NAME=VALUE",
                   help="for tests and chaos runs only, off unless given (repeatable): drop-chunks=2,final, "
                        "kv-die-after=N, forward-raise=TOKEN or forward-exit=TOKEN (docs/containment.md)")

"""What the commands' parsers share: argument types, option groups, and a command that imports its
implementation only when it runs (torch is slow to import)."""
import argparse
import importlib
import re
import sys

from schemas import records

MODEL = "an HF checkpoint directory, a GGUF file or a model name: smollm2-135m-instruct, tiny or small"
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
GPU_PRESETS = ["h100-sxm", "h200", "a100", "l4"]    # workers.engine.roofline.GPUS (importing workers imports torch)
PLAN_MODELS = ["llama-3-70b", "llama-3-8b", "smollm2-135m"]   # ops.plan.MODELS (it imports workers)


def delegate(module: str, function: str = "main", exits: bool = False):
    """A subcommand that is `module`.`function`(args), imported only when chosen (torch is slow to
    import); exits: it returns the exit status."""
    def run(args) -> None:
        status = getattr(importlib.import_module(module), function)(args)
        if exits:
            sys.exit(status)
    return run


def size(text: str) -> int:
    """Bytes: 1073741824, 1GiB, 512MiB, 512M."""
    m = re.fullmatch(r"(\d+)\s*([kmgt]?)(i?b)?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, e.g. 4GiB, 512MiB or 1073741824")
    return int(m.group(1)) * UNITS[m.group(2)]


def count(text: str) -> int:
    """A whole number from 0 up: workers, tokens or requests."""
    if text.strip().isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from 0 up")


def deployment(p: argparse.ArgumentParser, gpu_help: str) -> None:
    """The model and GPU of a planned or simulated deployment (`tokenbus plan`, `tokenbus sim`): the
    presets are ops.plan's MODELS and GPUS (workers.engine.roofline's), named here since importing it imports torch."""
    p.add_argument("--model", default="llama-3-70b", help="a preset (llama-3-70b, llama-3-8b, smollm2-135m), an HF "
                   "checkpoint directory or its config.json, a GGUF file, or a catalogue name (default llama-3-70b)")
    p.add_argument("--gpu", default="h100-sxm", choices=[*GPU_PRESETS, "cpu"], help=gpu_help)


def nats_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="the stack's nats-server")


def archive(p: argparse.ArgumentParser) -> None:
    """--archive: the request log's Parquet archive (services/recorder/archive.py), read beside TB_RESULTS."""
    p.add_argument("--archive", metavar="URL", default=records.default_archive(),
                   help="the request log's archive, a directory or an fsspec URL (default: $TB_ARCHIVE, else "
                        "$TOKENBUS_HOME/data/archive; a missing one holds no records)")


def window(p: argparse.ArgumentParser, file: bool = False) -> None:
    """Which records of the completions log: --last N | --since TIME | --request-id ID (| --file F)."""
    w = p.add_mutually_exclusive_group()
    w.add_argument("--last", type=int, metavar="N", help="the last N records")
    w.add_argument("--since", metavar="TIME", help="records stored since an ISO time or a duration back (15m, 2h)")
    w.add_argument("--request-id", metavar="ID", help="the record of one request")
    if file:
        w.add_argument("--file", metavar="F", help="records exported with `tokenbus log export` (JSON lines)")

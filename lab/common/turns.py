"""Token-id workloads (conversations of turns, the same ids for every engine a bench compares), greedy
with EOS ignored, and the closed loop that runs one through an engine in this process: `concurrency`
conversations in flight, a turn sent when the one before it ended. figures() sums a run up."""
import collections
import gc
import itertools
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

from lab.common.results import Result, stats

OPTIONS = {"temperature": 0, "ignore_eos": True}      # greedy, every request to its output length
BLOCK_SIZE = 16                                        # the engine's KV block


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    conversations: list[list[Turn]]
    concurrency: int

    @property
    def turns(self) -> list[Turn]:
        return [t for c in self.conversations for t in c]

    @property
    def context(self) -> int:
        """Tokens one request holds at most: its prompt and its output."""
        return max(len(t.prompt) + t.max_tokens for t in self.turns)


def warmup(w: Workload, vocab: int) -> Workload:
    """A few of w's first requests, shorter and of other tokens: the first call's costs stay out of the
    runs, and no round's prompt is cached by it."""
    rng = random.Random("warmup")
    return Workload("warmup", [[Turn([rng.randrange(16, vocab) for _ in t.prompt], min(t.max_tokens, 4))]
                               for t in w.turns[:min(w.concurrency, 4)]], w.concurrency)


def closed_loop(workload: Workload, engine) -> tuple[list[Result], float]:
    """drive()'s schedule around an engine in this process: engine.submit(key, turn) queues a turn,
    engine.poll() advances the engine and returns the (key, Result) of the turns that ended."""
    queue: collections.deque[Iterator[Turn]] = collections.deque(iter(c) for c in workload.conversations)
    live: dict[int, Iterator[Turn]] = {}                  # key -> the rest of its conversation
    keys, results = itertools.count(), []

    def send_next(turns: Iterator[Turn]) -> bool:
        turn = next(turns, None)
        if turn is not None:
            key = next(keys)
            live[key] = turns
            engine.submit(key, turn)
        return turn is not None

    def refill() -> None:
        while len(live) < workload.concurrency and queue:
            send_next(queue.popleft())

    start = time.perf_counter()
    refill()
    while live:
        for key, result in engine.poll():
            results.append(result)
            if not send_next(live.pop(key)):
                refill()
    return results, time.perf_counter() - start


def figures(workload: Workload, results: list[Result], seconds: float) -> dict:
    ok = [r for r in results if r.error is None and r.chunks]
    out = sum(r.output_tokens for r in ok)
    return {
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(out / seconds, 2),
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": dict(collections.Counter(r.error for r in results if r.error is not None)),
        "output_tokens": out, "output_tokens_asked": sum(t.max_tokens for t in workload.turns),
        "ttft_ms": stats([r.ttft * 1e3 for r in ok]),
        "tpot_ms": stats([r.tpot * 1e3 for r in ok if r.tpot is not None]),
    }


class EngineLoop:
    """The tokenbus engine stepped as LLM.generate steps it: a detokenizer per request. `options`: more
    of LLM's (EngineConfig's fields, e.g. speculative; a tokenizer), over the defaults sized here."""

    def __init__(self, model: str, workload: Workload, dtype: str | None, **options):
        from workers import LLM

        blocks = workload.concurrency * math.ceil(workload.context / BLOCK_SIZE)
        self.llm = LLM(model, **{"max_num_seqs": workload.concurrency, "num_kv_blocks": blocks,
                                 "block_size": BLOCK_SIZE, "dtype": dtype, **options})
        gc.freeze()                                  # as a worker process does once its engine is built
        self.live: dict[str, tuple[int, Result, object]] = {}
        self.outputs: dict[int, list[int]] = {}      # key -> the output token ids of a turn that ended

    def submit(self, key: int, turn: Turn) -> None:
        from schemas.sampling import SamplingParams
        from text.detokenizer import Detokenizer

        r = Result(time.perf_counter(), prompt_tokens=len(turn.prompt))
        self.llm.engine.add_request(str(key), turn.prompt, SamplingParams(max_tokens=turn.max_tokens, **OPTIONS))
        self.live[str(key)] = (key, r, Detokenizer(self.llm.tokenizer.backend_tokenizer, turn.prompt))

    def poll(self) -> list[tuple[int, Result]]:
        done = []
        for req in self.llm.engine.step():
            t = time.perf_counter()
            key, r, detok = self.live[req.request_id]
            detok.push(req.output_token_ids[r.output_tokens:])    # a token a step, or more with drafts
            r.chunks.append(t)
            r.output_tokens = req.num_output_tokens
            if req.finished:
                r.end = t
                self.outputs[key] = req.output_token_ids
                del self.live[req.request_id]
                done.append((key, r))
        return done

    def close(self) -> None:
        pass

"""Structured output (xgrammar): each constraint compiled once, off the step loop, and cached by its
text; a compiled grammar's matcher per request, which gives its row's token bitmask each step and
advances with each token the request keeps."""
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from schemas.sampling import MAX_COMPILE_SECONDS, SamplingParams, to_grammar

MAX_ROLLBACK = 64   # tokens a matcher can take back: a verify step's drafts
MAX_GRAMMARS = 512  # compiled grammars a worker keeps, the least recently asked for dropped first
MAX_GRAMMAR_BYTES = 256 << 20   # and the most memory they may hold together


class Grammars:
    """The compiler of one model's vocabulary, built on the first constrained request."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, list(eos_token_ids)
        self.compiler = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()   # least recently asked for first
        self.sizes: dict[tuple[str, str], int] = {}                         # bytes of those compiled

    def submit(self, params: SamplingParams) -> Future:
        """The constraint's compiled grammar, from the cache or compiling; a request holds its own future,
        so an eviction never takes a grammar from one. A compile past its time stays: its text's requests fail
        at once while it runs on (one compile per text, however often a slow one is asked for), and get
        the grammar once it is done."""
        key = params.constraint
        future = self.cache.pop(key, None)
        if future is None:
            future = Future()
            future.started = None               # set by the compile thread when it starts on it
            self.pool.submit(self.run, future, params)
        self.cache[key] = future
        self.evict()
        return future

    def evict(self) -> None:
        """Least recently asked for first, until at most MAX_GRAMMARS are cached and the compiled ones hold at
        most MAX_GRAMMAR_BYTES."""
        for key, future in self.cache.items():
            if key not in self.sizes and future.done():
                self.sizes[key] = 0 if future.exception() else future.result().memory_size_bytes
        total = sum(self.sizes.values())
        while len(self.cache) > MAX_GRAMMARS or (total > MAX_GRAMMAR_BYTES and len(self.cache) > 1):
            key, _ = self.cache.popitem(last=False)
            total -= self.sizes.pop(key, 0)

    def run(self, future: Future, params: SamplingParams) -> None:
        """On the compile thread: the future's grammar, and the compile thread's CPU clock and its reading when
        the compile started. The time limit counts the CPU the compile itself takes: not a compile queued
        behind a slow one, not the vocabulary's one-off preparation, not the time a loaded machine gives
        other processes."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            if self.compiler is None:
                self.compiler = self.prepare()
            future.clock = time.pthread_getcpuclockid(threading.get_ident())
            future.started = time.clock_gettime(future.clock)
            future.set_result(self.compile(params))
        except BaseException as e:
            future.set_exception(e)

    def prepare(self):
        """This vocabulary's grammar compiler, made on the first constrained request."""
        import xgrammar as xgr

        # one thread: compiling shares the cores with the steps; our cache, bounded, in place of xgrammar's
        return xgr.GrammarCompiler(self.tokenizer_info(), max_threads=1, cache_enabled=False)

    def compile(self, params: SamplingParams):
        """The constraint's grammar (to_grammar: the tokenizer stage's conversion, its errors) compiled for this
        vocabulary."""
        return self.compiler.compile_grammar(to_grammar(params))

    def tokenizer_info(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        from workers.models.gguf import hf_dir
        tokenizer = AutoTokenizer.from_pretrained(hf_dir(self.model_dir))
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids)

    def close(self) -> None:
        for future in self.cache.values():
            future.cancel()             # the queued ones: the pool's own futures are not those
        self.pool.shutdown(wait=False, cancel_futures=True)


def late(future: Future) -> bool:
    """Whether a compile has taken more than MAX_COMPILE_SECONDS of its thread's CPU since it started (a
    queued one has not)."""
    return not future.done() and future.started is not None and \
        time.clock_gettime(future.clock) - future.started > MAX_COMPILE_SECONDS


class Pending:
    """A constrained request waiting for its grammar."""
    __slots__ = ("future", "req")

    def __init__(self, req, future: Future):
        self.req, self.future = req, future

    def matcher(self):
        """The request's matcher, past its output tokens so far (a resumed request's); None while compiling.
        ValueError when the grammar failed or its compile has run past MAX_COMPILE_SECONDS."""
        if not self.future.done():
            if late(self.future):
                raise ValueError(f"the grammar took longer than MAX_COMPILE_SECONDS={MAX_COMPILE_SECONDS:g} "
                                 "to compile")
            return None
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.future.result(), max_rollback_tokens=MAX_ROLLBACK)
        for token in self.req.output_token_ids:
            if not matcher.accept_token(token):
                raise ValueError(f"output_token_ids: token {token} does not follow the grammar")
        return matcher


def apply_grammars(logits: torch.Tensor, requests: list) -> torch.Tensor:
    """Each constrained row's logits with the tokens its grammar forbids at -inf (rows of a request's drafts
    see the grammar past the drafts before them). Unconstrained batches return logits untouched."""
    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for n, i in enumerate(rows):
        fill(requests[i].matcher, getattr(requests[i], "extra", ()), bitmask, n)
    if logits.device.type == "cpu" and sys.byteorder == "little":
        return apply_bitmask_cpu(logits, bitmask, rows)
    logits = logits.to(torch.float32, copy=True)    # a new tensor, as the bias and penalties give: logprobs are raw
    full = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])   # xgrammar's indices name rows of both
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=rows)
    return logits


BIT = torch.arange(8, dtype=torch.uint8)


def apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits' rows `rows` with the tokens bitmask's rows (in order) forbid at -inf: xgrammar's bitmask (bit j of
    int32 word w is token 32w + j, so on a little-endian machine bit b of byte k is token 8k + b) unpacked and
    applied by torch, vectorized over the rows and threads. xgrammar's CPU kernel does one row at a time,
    about 3× slower for 64 rows of SmolLM2's 49,152 tokens (`tokenbus bench-structured` times both)."""
    logits = logits.float()
    forbidden = (bitmask.view(torch.uint8).unsqueeze(-1) >> BIT & 1).view(len(rows), -1)[:, :logits.shape[1]] == 0
    if rows == list(range(logits.shape[0])):     # a new tensor, as the bias and penalties give: logprobs are raw
        return logits.masked_fill(forbidden, float("-inf"))
    index = torch.tensor(rows)
    return logits.index_put((index,), logits[index].masked_fill(forbidden, float("-inf")))


def fill(matcher, extra: list[int], bitmask: torch.Tensor, n: int) -> None:
    """Row n of bitmask: the tokens the matcher allows after `extra`; all tokens when a draft of extra is
    outside the grammar (the row before it cannot sample that draft, so this row's token is dropped) or
    extra ends with a stop token the grammar accepts (the request ends at that token, so this one is dropped
    too; xgrammar has no mask after its stop token). The matcher is rolled back to where it was."""
    taken = 0
    for token in extra:
        if not matcher.accept_token(token):
            break
        taken += 1
    if taken == len(extra) and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(bitmask, n)
    if taken:
        matcher.rollback(taken)

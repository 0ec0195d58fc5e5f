"""Structured output (xgrammar): each constraint compiled once, off the step loop, and cached by its
text; a compiled grammar's matcher per request, which gives its row's token bitmask each step and
advances with each token the request keeps."""
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from schemas.sampling import MAX_COMPILE_SECONDS, SamplingParams, to_grammar

MAX_ROLLBACK = 64   # tokens a matcher can take back: a verify step's drafts


class Grammars:
    """The compiler of one model's vocabulary, built on the first constrained request."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, list(eos_token_ids)
        self.compiler = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.cache: dict[tuple[str, str], Future] = {}

    def submit(self, params: SamplingParams) -> Future:
        key = params.constraint
        if key not in self.cache:
            self.cache[key] = self.pool.submit(self.compile, params)
        return self.cache[key]

    def compile(self, params: SamplingParams):
        """The constraint's grammar (to_grammar: the tokenizer stage's conversion, its errors) compiled for this
        vocabulary."""
        import xgrammar as xgr

        if self.compiler is None:
            self.compiler = xgr.GrammarCompiler(self.tokenizer_info(), max_threads=1)
        return self.compiler.compile_grammar(to_grammar(params))

    def tokenizer_info(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        from workers.models.gguf import hf_dir
        tokenizer = AutoTokenizer.from_pretrained(hf_dir(self.model_dir))
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Pending:
    """A constrained request waiting for its grammar."""
    __slots__ = ("future", "req", "since")

    def __init__(self, req, future: Future):
        self.req, self.future, self.since = req, future, time.monotonic()

    def matcher(self):
        """The request's matcher, past its output tokens so far (a resumed request's); None while compiling.
        ValueError when the grammar failed or ran past MAX_COMPILE_SECONDS."""
        if not self.future.done():
            if time.monotonic() - self.since > MAX_COMPILE_SECONDS:
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

    logits = logits.float()
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for n, i in enumerate(rows):
        fill(requests[i].matcher, getattr(requests[i], "extra", ()), bitmask, n)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits


def fill(matcher, extra: list[int], bitmask: torch.Tensor, n: int) -> None:
    """Row n of bitmask: the tokens the matcher allows after `extra` (all tokens when a draft of extra is
    outside the grammar: the row before it cannot sample that draft, so this row's token is dropped)."""
    taken = 0
    for token in extra:
        if not matcher.accept_token(token):
            break
        taken += 1
    if taken == len(extra):
        matcher.fill_next_token_bitmask(bitmask, n)
    if taken:
        matcher.rollback(taken)

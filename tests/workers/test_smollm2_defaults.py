"""SmolLM2-135M-Instruct with the sampling its authors recommend (its catalogue entry's, which the offline engine
and the gateway take for every field a request leaves unset) against what the chat page and `tokenbus chat` sent
before (temperature 0.7 and nothing else): five everyday questions, each answer seeded, so the outcome is the
same on every run. The defaults' answers end by themselves and do not loop; two of the others loop to
max_tokens."""
import collections

import pytest

from schemas.sampling import SamplingParams
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.", "How do I boil an egg?",
             "Explain what a black hole is in simple terms.", "Write a haiku about autumn."]
MAX_TOKENS = 256
SEED = 0
FEW = 3                                           # times one 4-gram of words may come back in a good answer
RECOMMENDED = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}


def repeats(text: str) -> int:
    """How often the answer's most frequent 4-gram of words (lower-cased, split at white space) occurs: a model
    stuck in a loop says the same few words again and again ("- 9. - 10. - 11." is `- 1x.` over and over)."""
    words = text.lower().split()
    return max(collections.Counter(zip(words, words[1:], words[2:], words[3:])).values(), default=0)


def good(out) -> bool:
    """It ended by itself within MAX_TOKENS and repeats no 4-gram more than FEW times."""
    return out.finish_reason == "stop" and repeats(out.text) <= FEW


def test_the_recommended_defaults_end_five_everyday_answers_by_themselves_where_temperature_alone_loops(smollm2):
    llm = LLM(smollm2)
    assert llm.sampling_defaults == RECOMMENDED
    defaults = llm.sampling_params(max_tokens=MAX_TOKENS, seed=SEED)
    before = SamplingParams(max_tokens=MAX_TOKENS, seed=SEED, temperature=0.7)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(chats * 2, [defaults] * len(QUESTIONS) + [before] * len(QUESTIONS))   # one batch: invariant
    ours, theirs = outs[:len(QUESTIONS)], outs[len(QUESTIONS):]
    shown = "\n".join(f"{o.finish_reason} {len(o.token_ids)} tokens, repeats {repeats(o.text)}: {o.text[:80]!r}"
                      for o in outs)
    assert all(map(good, ours)), shown
    looped = [o for o in theirs if o.finish_reason == "length" and repeats(o.text) > FEW]
    assert len(looped) >= 2, shown

"""Real text of a given token length, from the tokenizer's corpus, and lengths drawn around a mean."""
import math
import random
from pathlib import Path

CORPUS = Path(__file__).parents[2] / "workers" / "models" / "data" / "corpus.txt"   # the tiny model's


class Corpus:
    """Text of a given token length: windows of the tokenized corpus at random offsets, decoded."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids = tokenizer.encode(CORPUS.read_text()).ids

    def text(self, rng: random.Random, n: int) -> str:
        ids = self.ids * (n // len(self.ids) + 2)
        at = rng.randrange(len(self.ids))
        return self.tok.decode(ids[at:at + n])


def length(rng: random.Random, mean: int, ratio: float, dist: str) -> int:
    """uniform over mean·(1 ± ratio), or lognormal with that mean and sigma = ratio."""
    if dist == "lognormal" and ratio > 0:
        return max(1, round(rng.lognormvariate(math.log(mean) - ratio ** 2 / 2, ratio)))
    return rng.randint(max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio))))

"""A chat's tokens a segment at a time. A tokenizer splits its added tokens (<|im_start|>, <|im_end|>, ...) out
of the text before it normalizes and pre-tokenizes, so the text between two of them encodes to the same ids
wherever it stands. A chat template puts added tokens around every message, and a chat sends its whole
history again every turn: kept in a bounded LRU, each message's text is encoded once per conversation, and
a turn costs the new message's encode, not the history's (`python -m lab.benchmarks.chat_tokens`: the 8th
turn of a 3,300-token chat, 17 ms whole, under 3 ms with its history kept).

It is used only where it is exact: a tokenizer without a normalizer whose added tokens match as written
(no lstrip, rstrip, single-word or normalized matching), checked against the whole-text encode once at
start; any other tokenizer encodes the whole text, as before."""
import re
from array import array
from collections import OrderedDict

MAX_SEGMENTS = 65_536            # texts kept
MAX_CHARS = 16 << 20             # their characters in all (~50 MB with their ids, 4 bytes each)
MIN_CACHED = 64                  # shorter texts are encoded each time: a lookup would save nothing
# the start's check: texts whose pieces are all shorter than MIN_CACHED, so checking leaves nothing kept
CHECK = ("Hello, world!<|im_end|>\n<|im_start|>user\n  12345 tokens\n\n<|im_start|>assistant\n"
         "x<|im_end|><|im_end|> trailing   ", "no added token here at all: 3.14159 \t\n end")


class Segments:
    def __init__(self, backend):
        """backend: a `tokenizers.Tokenizer` (a transformers tokenizer's backend_tokenizer)."""
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.ids = {t.content: i for i, t in added.items()}
        plain = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        pattern = "|".join(re.escape(c) for c in sorted(self.ids, key=len, reverse=True))
        self.split = re.compile(pattern) if pattern else None
        self.kept: OrderedDict[str, array] = OrderedDict()
        self.chars = self.hits = self.misses = 0
        self.exact = backend.normalizer is None and plain and self.split is not None \
            and all(self.encode(t) == self.whole(t) for t in (*CHECK, *self.ids))   # keeps nothing: all short

    def whole(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def __call__(self, text: str) -> list[int]:
        """text's ids, as `whole(text)` gives them."""
        return self.encode(text) if self.exact else self.whole(text)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        at = 0
        for m in self.split.finditer(text):
            if m.start() > at:
                out += self.piece(text[at:m.start()])
            out.append(self.ids[m.group()])
            at = m.end()
        if at < len(text):
            out += self.piece(text[at:])
        return out

    def piece(self, text: str) -> list[int] | array:
        if len(text) < MIN_CACHED:
            return self.whole(text)
        ids = self.kept.get(text)
        if ids is not None:
            self.kept.move_to_end(text)
            self.hits += 1
            return ids
        self.misses += 1
        ids = array("i", self.whole(text))
        self.kept[text] = ids
        self.chars += len(text)
        while len(self.kept) > MAX_SEGMENTS or self.chars > MAX_CHARS:
            old, _ = self.kept.popitem(last=False)
            self.chars -= len(old)
        return ids

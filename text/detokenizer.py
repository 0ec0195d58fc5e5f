"""Incremental, UTF-8-safe detokenization with stop strings: the one definition of "the text of a
token stream", used by the offline engine and by the gateway.

Text is released only in whole characters (a multi-byte character split across tokens waits for
its last byte), and never includes a stop string or a piece that may grow into one: the last
len(longest stop) - 1 characters are held back until the request ends.
"""
import re

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 4  # prompt tokens fed first, so the first output token decodes with its leading space right


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] = (), stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer, self.stop = tokenizer, stop
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if context:
            self.stream.step(tokenizer, context)
        self.text = ""          # all decoded output text (cut at a stop string once one is found)
        self.sent = 0           # characters of `text` already released
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stop_reason: str | None = None

    def push(self, token_ids: list[int]) -> str | None:
        """Decodes new tokens; returns the stop string they completed, if any."""
        if self.stop_reason is not None:
            return self.stop_reason
        for token in token_ids:
            piece = self.stream.step(self.tokenizer, token)
            if piece:
                start = len(self.text)
                self.text += piece
                if self.stop and self.find_stop(start - self.hold):
                    break
        return self.stop_reason

    def find_stop(self, start: int) -> bool:
        found = [(i, s) for s in self.stop if (i := self.text.find(s, max(start, 0))) >= 0]
        if not found:
            return False
        i, self.stop_reason = min(found)
        self.text = self.text[:i]
        return True

    def release(self, finished: bool = False) -> str:
        """The text not yet released, less the held-back tail unless the request has ended."""
        end = len(self.text) if finished or self.stop_reason else max(len(self.text) - self.hold, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta


BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # SentencePiece's byte fallback


def gpt2_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode), reversed: the character each byte is written as,
    mapped back to the byte. Printable Latin-1 bytes are themselves; the rest are chr(256 + n) in order."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {chr(c): b for b, c in zip(shown + hidden, shown + [256 + n for n in range(len(hidden))])}


GPT2_BYTES = gpt2_bytes()


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for: a token may hold part of a UTF-8 character, which decoding alone shows
    as "\ufffd" (the logprobs' `bytes` of such a token are its own)."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if m := BYTE_TOKEN.fullmatch(piece):
        return bytes([int(m[1], 16)])
    if "ByteLevel" in repr(tokenizer.decoder) and all(c in GPT2_BYTES for c in piece):
        return bytes(GPT2_BYTES[c] for c in piece)
    return piece.replace("\u2581", " ").encode()      # SentencePiece's word start is a space

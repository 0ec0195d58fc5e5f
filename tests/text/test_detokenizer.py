"""Incremental detokenization: whole characters only, the same text as a full decode, stop strings
cut and never leaked while streaming."""
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from text.detokenizer import Detokenizer

TEXTS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


def stream(tokenizer, ids, stop=(), prompt=()):
    detok = Detokenizer(tokenizer.backend_tokenizer, list(prompt), tuple(stop))
    pieces = []
    for t in ids:
        detok.push([t])
        pieces.append(detok.release())
        if detok.stop_reason:
            break
    pieces.append(detok.release(finished=True))
    return detok, pieces


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_streamed_pieces_join_to_the_full_decode_and_never_split_a_character(tiny_tokenizer, text):
    assume("<|" not in text)  # special-token markup encodes to special tokens, which output text skips
    ids = tiny_tokenizer.encode(text)
    detok, pieces = stream(tiny_tokenizer, ids, prompt=tiny_tokenizer.encode("Hello"))
    assert "".join(pieces) == detok.text == text
    assert not any("\ufffd" in p for p in pieces)


def test_a_multibyte_character_split_over_byte_tokens_waits_for_its_last_byte(tiny_tokenizer):
    ids = tiny_tokenizer.encode("🙂")
    assert len(ids) > 1   # byte-level BPE: the emoji is several byte tokens
    _detok, pieces = stream(tiny_tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and "".join(pieces) == "🙂"


def test_a_stop_string_cuts_the_text_and_no_part_of_it_is_ever_released(tiny_tokenizer):
    text = "alpha beta gamma delta"
    detok, pieces = stream(tiny_tokenizer, tiny_tokenizer.encode(text), stop=("gam", "zzz"))
    assert detok.stop_reason == "gam" and detok.text == "alpha beta "
    assert "".join(pieces) == "alpha beta "
    assert not any("g" in p for p in pieces)


def test_the_earliest_of_several_stop_strings_wins(tiny_tokenizer):
    detok, _ = stream(tiny_tokenizer, tiny_tokenizer.encode("one two three"), stop=("three", "two"))
    assert detok.stop_reason == "two" and detok.text == "one "


def test_text_held_back_for_a_possible_stop_is_released_when_the_request_ends(tiny_tokenizer):
    detok, pieces = stream(tiny_tokenizer, tiny_tokenizer.encode("ab ga"), stop=("gamma",))
    assert detok.stop_reason is None and "".join(pieces) == "ab ga"
    assert not pieces[-2].endswith("ga")   # while streaming, the tail that might become "gamma" waited

import pytest

from schemas.messages import GenerateRequest
from schemas.sampling import SamplingParams
from services.tokenizer.service import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model, max_model_len=64)


def request(**prompt) -> GenerateRequest:
    return GenerateRequest("r1", "t", SamplingParams(), **prompt)


def test_messages_get_the_models_chat_template(tok, tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}]
    expected = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert tok.encode(request(messages=messages)) == list(expected)


def test_prompt_text_and_token_ids_encode_like_the_offline_llm(tok, tiny_tokenizer):
    assert tok.encode(request(prompt="The engine")) == tiny_tokenizer.encode("The engine")
    assert tok.encode(request(prompt_token_ids=[5, 6, 7])) == [5, 6, 7]


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "word " * 200}, "max_model_len=64"),
    ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids: token id 99999 is outside the vocabulary"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]: needs a string role and a string content"),
])
def test_requests_it_cannot_encode_are_errors_naming_the_field_or_limit(tok, prompt, message):
    with pytest.raises(ValueError, match=message):
        tok.encode(request(**prompt))


def test_the_context_limit_defaults_to_the_models(tiny_model):
    assert Tokenizer(tiny_model).max_model_len == 4096


def test_a_top_k_larger_than_the_vocabulary_is_refused_naming_it(tok):
    with pytest.raises(ValueError, match=f"top_k 1048576 is more than the vocabulary \\({tok.vocab_size} tokens\\)"):
        tok.encode(GenerateRequest("r1", "t", SamplingParams(top_k=1 << 20), prompt="x"))
    assert tok.encode(GenerateRequest("r1", "t", SamplingParams(top_k=tok.vocab_size), prompt="x"))


def test_a_logit_bias_token_outside_the_vocabulary_is_refused_naming_it(tok):
    n = tok.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias: token id {n} is outside the vocabulary \\[0, {n}\\)"):
        tok.encode(GenerateRequest("r1", "t", SamplingParams(logit_bias={n: 1}), prompt="x"))
    assert tok.encode(GenerateRequest("r1", "t", SamplingParams(logit_bias={n - 1: 1}), prompt="x"))


def test_prepare_answers_the_tokens_or_the_refusal_the_pipeline_would_send(tok):
    from types import SimpleNamespace

    from schemas.messages import encode
    from services.tokenizer.service import TokenizerService

    svc = TokenizerService(SimpleNamespace(), tok)
    got = svc.prepared(encode(request(prompt="The engine")))
    assert (got.token_ids, got.max_model_len, got.code) == (tok.encode(request(prompt="The engine")), 64, "")
    for data, code, message in (
            (encode(request(prompt="word " * 200)), "context_length_exceeded", "max_model_len=64"),
            (encode(GenerateRequest("r1", "t", SamplingParams(logit_bias={1 << 20: 1}), prompt="x")),
             "invalid_request", "logit_bias: token id"),
            (b"\xc1garbage", "invalid_request", "")):
        got = svc.prepared(data)
        assert (got.token_ids, got.code) == ([], code) and message in got.message


def conversations(seed: int, n: int) -> list[list[dict[str, str]]]:
    """Random chats whose texts hold what splits or merges tokens: spaces, newlines, digits, emoji, added tokens."""
    import random
    rng = random.Random(seed)
    words = ["hello", "world", "  ", "\n", "\n\n", "123", "3.14", "é", "日本語", "😀", "<|im_start|>", "<|im_end|>",
             "tab\t", " x", "'s", "don't", "a" * 70, "The engine streams its tokens back to the gateway."]
    return [[{"role": ("system" if t == 0 and rng.random() < 0.5 else ("user", "assistant")[t % 2]),
              "content": "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(0, 40)))}
             for t in range(rng.randint(1, 6))] for _ in range(n)]


def test_a_chat_s_tokens_a_message_at_a_time_equal_the_templates_whole_encode(tok):
    assert tok.segments.exact
    for messages in conversations(0, 200):
        assert tok.chat(messages) == list(tok.hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False))


def test_a_chat_s_history_is_encoded_once_and_the_next_turn_encodes_only_its_new_messages(tiny_model):
    tok = Tokenizer(tiny_model)
    history = [{"role": "system", "content": "You answer questions about paged attention. " * 8}]
    misses = []
    for turn in range(4):
        history.append({"role": "user", "content": f"Question {turn}: how are blocks of the KV cache shared? " * 3})
        before = tok.segments.misses
        ids = tok.chat(history)
        misses.append(tok.segments.misses - before)
        assert ids == list(tok.hf.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
        history.append({"role": "assistant", "content": f"Answer {turn}: by reference counts on full blocks. " * 3})
    assert misses == [2, 2, 2, 2] and tok.segments.hits == 2 + 4 + 6    # each turn: its question and the reply


def test_a_tokenizer_the_segments_cannot_match_encodes_whole_texts():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers

    from services.tokenizer.segments import Segments

    backend = Backend(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|im_end|>"])
    assert Segments(backend).exact                      # no normalizer: exact
    backend.normalizer = normalizers.Lowercase()        # added tokens matched after normalizing: not
    segments = Segments(backend)
    assert not segments.exact and segments("Hello<|im_end|>WORLD") == [1, 3, 2] and not segments.kept

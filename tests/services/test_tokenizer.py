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

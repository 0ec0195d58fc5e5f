"""Every field of a request is bounded where it is decoded: a value the engine could not take (an
integer past int64, NaN or ±inf, a huge list) is a WireError / ValueError naming the field and the
limit, before any service acts on it."""
import math

import msgpack
import pytest

from schemas.messages import (
    MAX_PROMPT_TOKENS,
    GenerateRequest,
    Progress,
    TokenizedRequest,
    WorkItem,
    decode,
    encode,
)
from schemas.sampling import MAX_STOP, SamplingParams
from schemas.subjects import MAX_STOP as SUBJECTS_MAX_STOP
from schemas.wire import WireError

U64 = 2**64 - 1
POISON_SAMPLING = [
    ({"top_k": U64}, "top_k must be in [1, 1048576]"),
    ({"top_k": 2**63}, "top_k must be in"),
    ({"max_tokens": U64}, "max_tokens must be in [1, 1048576]"),
    ({"max_tokens": -2**63}, "max_tokens must be in"),
    ({"logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"logprobs": U64}, "logprobs must be in [0, 20]"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"temperature": 1e-30}, "temperature must be 0 (greedy) or in"),
    ({"temperature": 1e30}, "temperature must be 0 (greedy) or in"),
    ({"top_p": math.nan}, "top_p must be a finite number"),
    ({"min_p": -math.inf}, "min_p must be a finite number"),
    ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number"),
    ({"repetition_penalty": 1e30}, "repetition_penalty must be in [0.01, 100.0]"),
    ({"repetition_penalty": 1e-320}, "repetition_penalty must be in [0.01, 100.0]"),
    ({"presence_penalty": math.nan}, "presence_penalty must be a finite number"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty must be a finite number"),
    ({"stop": ["x"] * (MAX_STOP + 1)}, "stop has more than MAX_STOP=16"),
    ({"stop": ["x" * 5000]}, "stop strings must be at most MAX_STOP_CHARS=1024"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids has more than MAX_STOP_TOKEN_IDS=256"),
    ({"stop_token_ids": [U64]}, "stop_token_ids must be token ids in [0, 2147483647]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be token ids"),
]


@pytest.mark.parametrize(("fields", "message"), POISON_SAMPLING, ids=lambda x: str(x)[:40])
def test_poison_sampling_values_are_refused_naming_the_field_and_the_limit(fields, message):
    with pytest.raises(ValueError, match=pattern(message)):
        SamplingParams(**fields)


@pytest.mark.parametrize(("fields", "message"), POISON_SAMPLING, ids=lambda x: str(x)[:40])
def test_poison_sampling_values_on_the_wire_are_wire_errors(fields, message):
    obj = tokenized_obj()
    obj["sampling"].update(fields)
    with pytest.raises(WireError, match="sampling." + pattern(message)):
        decode(msgpack.packb(obj))


def test_a_seed_is_any_unsigned_64_bit_integer_and_nothing_else():
    assert SamplingParams(seed=U64).seed == U64
    assert decode(encode(TokenizedRequest("r", "t", SamplingParams(seed=U64), [1]))).sampling.seed == U64
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=pattern("seed must be in [0, 2**64)")):
            SamplingParams(seed=bad)


@pytest.mark.parametrize(("change", "message"), [
    ({"prompt_token_ids": [U64]}, "prompt_token_ids: token id 18446744073709551615 is outside [0, 2147483647]"),
    ({"prompt_token_ids": [-5]}, "prompt_token_ids: token id -5 is outside"),
    ({"prompt_token_ids": []}, "prompt_token_ids: at least one token id is needed"),
    ({"prompt_token_ids": [1] * (MAX_PROMPT_TOKENS + 1)}, f"MAX_PROMPT_TOKENS={MAX_PROMPT_TOKENS}"),
    ({"id": "a.b"}, "request id 'a.b' must be 1-64 characters"),
    ({"id": "x" * 65}, "request id"),
    ({"tenant": "t>"}, "tenant 't>' must be"),
    ({"cache_salt": "s" * 300}, "cache_salt: 300 characters is more than MAX_SALT_CHARS=256"),
    ({"created": math.nan}, "created: must be a finite number"),
])
def test_a_tokenized_request_out_of_bounds_is_a_wire_error_naming_the_field(change, message):
    with pytest.raises(WireError, match=pattern(message)):
        decode(msgpack.packb({**tokenized_obj(), **change}))


def test_a_work_item_checks_its_request_and_its_counters():
    item = msgpack.unpackb(encode(WorkItem(TokenizedRequest("r", "t", SamplingParams(), [1]), "w0")))
    with pytest.raises(WireError, match=pattern("sampling.top_k must be in")):
        decode(msgpack.packb({**item, "request": {**item["request"], "sampling": {"top_k": U64}}}))
    with pytest.raises(WireError, match=pattern("strikes: -1 is outside")):
        decode(msgpack.packb({**item, "strikes": -1}))
    with pytest.raises(WireError, match=pattern("attempt: 18446744073709551615 is outside")):
        decode(msgpack.packb({**item, "attempt": U64}))


def test_a_generate_request_bounds_its_prompt_whatever_its_form():
    with pytest.raises(WireError, match="MAX_MESSAGES=512"):
        decode(encode(GenerateRequest("r", "t", SamplingParams(), messages=[{"role": "user", "content": "x"}] * 513)))
    with pytest.raises(WireError, match="MAX_PROMPT_CHARS=400000"):
        decode(encode(GenerateRequest("r", "t", SamplingParams(), prompt="x" * 400_001)))


def test_a_progress_answer_carries_valid_token_ids_only():
    assert decode(encode(Progress("r", []))).token_ids == []
    with pytest.raises(WireError, match="token_ids: token id -1"):
        decode(encode(Progress("r", [1, -1])))


def test_the_stop_limit_is_one_number_everywhere():
    assert MAX_STOP == SUBJECTS_MAX_STOP


def tokenized_obj() -> dict:
    return msgpack.unpackb(encode(TokenizedRequest("r1", "t", SamplingParams(seed=1), [1, 2, 3])))


def pattern(message: str) -> str:
    return "".join("\\" + c if c in "[]()|*.+?" else c for c in message)


def test_a_denormal_top_p_is_allowed_it_is_greedy_in_float32():
    assert SamplingParams(top_p=1e-320).top_p == 1e-320

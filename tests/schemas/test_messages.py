import contextlib
import dataclasses

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.messages import (
    TYPES,
    Cancel,
    Completion,
    DeadLetter,
    ErrorChunk,
    FinalChunk,
    GenerateRequest,
    Heartbeat,
    KvEvent,
    KvFetch,
    KvSnapshot,
    KvTransfer,
    Logprobs,
    Prefilled,
    Progress,
    Resend,
    Resumed,
    RouterStats,
    Speculation,
    TenantBucket,
    TokenChunk,
    TokenizedRequest,
    Tokens,
    Usage,
    WorkItem,
    decode,
    encode,
)
from schemas.sampling import SamplingParams
from schemas.wire import WireError

INTS = st.integers(-2**63, 2**64 - 1)
SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("\n\n",), stop_token_ids=(2,))
EXAMPLES = [
    GenerateRequest("r1", "t", SAMPLING, messages=[{"role": "user", "content": "hi ✓"}], created=1.5),
    GenerateRequest("r2", "t", SAMPLING, prompt_token_ids=[1, 2, 3], cache_salt="s"),
    TokenizedRequest("r1", "t", SAMPLING, [5, 6], None, 2.0),
    WorkItem(TokenizedRequest("r1", "t", SAMPLING, [5, 6]), "w0", 3.0),
    TokenChunk("r1", 0, 0, [9, 10], 2, [5, 6]),
    FinalChunk("r1", 3, 7, [], "length", None, {"prompt_tokens": 2, "completion_tokens": 7}, {"e2e_ms": 1.5}, "w0"),
    FinalChunk("r1", 3, 7, [4], "stop", 2),
    ErrorChunk("r1", "invalid_request", "prompt has 9 tokens; max_model_len=8"),
    Cancel("r1", "stop"),
    Heartbeat("w0", 1.0, "tiny", 16, 64, 1, 2, 100, 90, 32, 16, 5),
    Heartbeat("w1", 1.0, "tiny", 16, 64, 1, 2, 100, 90, 32, 16, 5, kv_blocks_queued=12),
    KvEvent("w0", 4, [2**64 - 1, 1], [7]),
    KvSnapshot("w0", 4, 0, 2, [2**64 - 1, 1]),
    RouterStats("r0", 1.0, "prefix", 5, 1, 4, 400, 96, 80, 3, 2, 0, {"w0": 5}, {"w0": 42}),
    Completion("r1", "t", "w0", SAMPLING, [1], [2, 3], "length", None, {"prompt_tokens": 1}, {"e2e_ms": 2.0}, 1.0),
    TokenChunk("r1", 0, 0, [9, 10], 2, [5, 6], 16,
               Logprobs([-0.5, -1.0], [[9, 3], [10, 4]], [[-0.5, -2.0], [-1.0, -3.0]])),
    Usage("r1", "t", "0123456789ab", "tiny", "chat", "stop", 9, 4, 7, {"ttft_ms": 1.5, "e2e_ms": 9.0}, 1.0, 2.0),
    Resend("r1", 4),
    Progress("r1", [9, 10]),
    Resumed("r1", "3f9a0c1e2b4d"),
    TenantBucket(1250.5, 1.7e9),
    Completion("r1", "t", "w0", SAMPLING, [5, 6], [9], "error", error_code="engine_error",
               error_message="sampling failed", ended=3.0),
    DeadLetter(TokenizedRequest("r1", "t", SAMPLING, [5, 6]), "crashed 2 workers", 2, "w1", 3.0),
    KvFetch("l-r1", [2**64 - 1, 7], 0, 30),
    KvFetch("l-r1", release=True),
    TokenizedRequest("r1", "t", SAMPLING, [5, 6], prefilled=Prefilled("w0", "l-r1", [2**64 - 1], 16, [9], -5, 16)),
    WorkItem(TokenizedRequest("r1", "t", SAMPLING, [5, 6]), "w0", 3.0, prefill=True),
    Heartbeat("w3", 1.0, "tiny", 16, 64, 1, 2, 100, 90, 32, 16, 5, role="decode",
              kv_transfer=KvTransfer(transfers=3, pulled_blocks=40, transfer_ms_p99=12.5)),
    RouterStats("r0", 1.0, "prefix", 5, 1, 4, 400, 96, 80, 3, 2, 0, prefill={"remote:long": 2}, handoffs=2),
    TokenizedRequest("r1", "t", SamplingParams(logit_bias={5: -100, "7": 2.5}), [5, 6]),
    GenerateRequest("r3", "t", SAMPLING, prompt="hi", priority=-2**31),
    WorkItem(TokenizedRequest("r1", "t", SAMPLING, [5, 6], priority=2**31 - 1), "w0", 3.0),
    Heartbeat("w4", 1.0, "tiny", 16, 64, 1, 2, 100, 90, 32, 16, 5, scheduling_policy="priority"),
    GenerateRequest("r4", "t", SAMPLING, prompt="hi", weight=0.001),
    WorkItem(TokenizedRequest("r1", "t", SAMPLING, [5, 6], weight=1000.0), "w0", 3.0),
    Heartbeat("w5", 1.0, "tiny", 16, 64, 1, 2, 100, 90, 32, 16, 5, scheduling_policy="fair"),
    WorkItem(TokenizedRequest("r1", "t", SamplingParams(json_schema={"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0}}, "required": ["n"]}), [5, 6]), "w0", 3.0),
    GenerateRequest("r5", "t", SamplingParams(choice=["yes", "no ✓"]), prompt="hi"),
    Completion("r6", "t", "w0", SamplingParams(regex="[0-9]{3}"), [5, 6], [7, 8, 9], "stop", 2, created=1.0),
    GenerateRequest("r3", "t", SAMPLING, messages=[{"role": "assistant", "content": "", "tool_calls": "[]"}],
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    Tokens([5, 6], 8192),
    Tokens([], 8192, "invalid_request", "messages: the chat template refused them"),
]
SPECULATING = Heartbeat("w2", 1.0, "tiny", 16, 64, 1, 2, 100, 90, 32, 16, 5, speculation=Speculation(
    "ngram", 2, 4, True, 1, 0.61, 40, 120, 75, 0.625, 1.875, [0.8, 0.65, 0.5, 0.0]))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips_through_msgpack(msg):
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), type(msg)) == msg


def test_a_heartbeat_carries_speculation_and_one_from_an_older_worker_without_it_still_decodes():
    assert decode(encode(SPECULATING), Heartbeat) == SPECULATING
    older = wire(SPECULATING, speculation=...)                      # the field left out, as before it existed
    assert decode(older, Heartbeat) == dataclasses.replace(SPECULATING, speculation=None)


def test_every_message_type_is_in_the_registry_with_a_version():
    assert {type(m) for m in EXAMPLES} == set(TYPES.values())
    assert all(msgpack.unpackb(encode(m))["v"] == 1 for m in EXAMPLES)


def wire(msg, **changes) -> bytes:
    obj = {"t": msg.TYPE, "v": 1, **msgpack.unpackb(encode(msg)), **changes}
    return msgpack.packb({k: v for k, v in obj.items() if v is not ...})


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2]), "a message is a map"),
    (wire(EXAMPLES[4], v=2), "v: version 2 is not supported"),
    (wire(EXAMPLES[4], t="bogus"), "t: message type 'bogus'"),
    (wire(EXAMPLES[4], seq="1"), "seq: expected int, got str"),
    (wire(EXAMPLES[4], seq=True), "seq: expected int, got bool"),
    (wire(EXAMPLES[4], token_ids=[1, "x"]), "token_ids[1]: expected int"),
    (wire(EXAMPLES[4], id=...), "id: missing"),
    (wire(EXAMPLES[0], sampling={"max_tokens": 0}), "sampling.max_tokens must be in [1, 1048576]"),
    (wire(EXAMPLES[0], sampling={"temperature": "hot"}), "sampling.temperature: expected float"),
    (wire(EXAMPLES[0], messages=None), "exactly one of messages, prompt, prompt_token_ids"),
    (wire(EXAMPLES[0], prompt="also"), "exactly one of messages, prompt, prompt_token_ids"),
    (wire(EXAMPLES[3], request={"id": "r"}), "request.tenant: missing"),
    (wire(EXAMPLES[5], stop_reason=[1]), "stop_reason: [1] is not int | str | NoneType"),
    (wire(EXAMPLES[15], logprobs={"logprob": [0.5], "top_ids": [["x"]], "top_logprobs": [[]]}),
     "logprobs.top_ids[0][0]: expected int"),
    (wire(EXAMPLES[16], prompt_tokens=1.5), "prompt_tokens: expected int, got float"),
    (wire(SPECULATING, speculation={"method": "ngram"}), "speculation.k: missing"),
    (wire(SPECULATING, speculation={**dataclasses.asdict(SPECULATING.speculation), "acceptance_per_position": ["x"]}),
     "speculation.acceptance_per_position[0]: expected float"),
])
def test_bad_messages_are_wire_errors_that_name_the_field(data, message):
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")):
        decode(data)


def test_a_message_of_another_type_than_expected_is_refused():
    with pytest.raises(WireError, match="not one of: chunk, final"):
        decode(encode(Cancel("r1")), TokenChunk, FinalChunk)


@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_wire_error_only(data):
    with contextlib.suppress(WireError):
        decode(data)


@given(st.dictionaries(st.sampled_from(["t", "v", "id", "seq", "offset", "token_ids", "sampling", "prompt"]),
                       st.one_of(st.none(), INTS, st.text(max_size=5), st.lists(INTS, max_size=3),
                                 st.dictionaries(st.text(max_size=3), INTS, max_size=2)), max_size=8),
       st.sampled_from(sorted(TYPES)))
def test_random_maps_decode_or_raise_wire_error_only(obj, kind):
    try:
        msg = decode(msgpack.packb({"t": kind, "v": 1, **obj}))
    except WireError:
        return
    assert dataclasses.is_dataclass(msg)


def test_the_decode_leg_of_a_disaggregated_request_has_its_own_message_id():
    """The prefill worker's work item and the decode worker's share a request id: the same Nats-Msg-Id would
    make JetStream drop the second as a duplicate."""
    r = TokenizedRequest("r1", "t", SAMPLING, [5, 6])
    handed = dataclasses.replace(r, prefilled=Prefilled("w0", "l-r1", [], 16, [9], 1))
    assert WorkItem(r, "w0", prefill=True).msg_id == "r1"
    assert WorkItem(handed, "w1").msg_id == "r1.pd"
    assert WorkItem(handed, "w2", attempt=2).msg_id == "r1.pd.2"


def test_a_handoff_with_a_bad_prefilled_field_is_refused_naming_it():
    bad = TokenizedRequest("r1", "t", SAMPLING, [5, 6], prefilled=Prefilled("w 0", "l-r1", [], 16, [9], 1))
    with pytest.raises(WireError, match=r"prefilled\.worker"):
        decode(encode(bad))

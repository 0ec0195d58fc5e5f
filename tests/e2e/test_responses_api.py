"""The Responses API on a real stack (SmolLM2, two gateways, two tenants with API keys), through the official
openai client unchanged: create (a string, items, instructions), stream (the response.* events the client
parses), retrieve, delete, previous_response_id continued on the other gateway, store false, function tools and
their outputs, text.format; a stored response survives its gateway's SIGKILL; no tenant reads another's."""
import json

import jsonschema
import openai
import pytest

from ops.procs import free_port
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
KEYS = {"sk-acme": {"tenant": "acme"}, "sk-globex": {"tenant": "globex"}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def stack(smollm2, tmp_path_factory):
    home = tmp_path_factory.mktemp("responses")
    (home / "keys.json").write_text(json.dumps(KEYS))
    with running(Stack(smollm2, free_port(), home, nats_port=free_port(), workers=1, gateways=2,
                       worker_args=[*WORKER_ARGS, "--threads", "1"], api_keys=str(home / "keys.json"))) as s:
        yield s


def client(stack, key: str = "sk-acme", gateway: int = 0) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=stack.https[gateway] + "/v1", max_retries=0, timeout=120)


def test_create_retrieve_continue_on_the_other_gateway_and_delete(stack):
    one, other = client(stack), client(stack, gateway=1)
    first = one.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=20,
                                 temperature=0, instructions="Answer in one short sentence.")
    assert first.id.startswith("resp_") and first.status == "completed" and "Paris" in first.output_text
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    assert other.responses.retrieve(first.id).output_text == first.output_text
    second = other.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                    max_output_tokens=20, temperature=0)
    assert "Rome" in second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens           # the conversation came with it
    one.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(second.id)
    unstored = one.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(unstored.id)


def test_streamed_events_build_the_same_response(stack):
    c = client(stack)
    params = {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text",
                                                                       "text": "Name three colors."}]}],
              "max_output_tokens": 24, "temperature": 0}
    whole = c.responses.create(**params)
    events = list(c.responses.create(stream=True, **params))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    with c.responses.stream(**params) as s:                    # the client's own accumulating helper
        assert s.get_final_response().output_text == whole.output_text


def test_function_tools_and_their_outputs_round_trip(stack):
    c = client(stack)
    asked = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                               temperature=0)
    calls = [o for o in asked.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    answered = c.responses.create(model=MODEL, previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=30,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                         "output": json.dumps({"sky": "clear", "celsius": 18})}])
    assert answered.status in ("completed", "incomplete") and answered.output
    streamed = list(c.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER], stream=True,
                                       tool_choice="required", max_output_tokens=60, temperature=0))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == args
    shaped = c.responses.create(model=MODEL, input="Give a city and its country.", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "place", "strict": True, "schema": {
                                    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                                     "country": {"type": "string", "maxLength": 30}},
                                    "required": ["city", "country"], "additionalProperties": False}}})
    assert set(json.loads(shaped.output_text)) == {"city", "country"}


def test_a_stored_response_survives_its_gateway_and_no_tenant_reads_another_s(stack):
    acme = client(stack)
    kept = acme.responses.create(model=MODEL, input="Remember the number 7.", max_output_tokens=8)
    stack.kill("gateway")
    try:
        assert client(stack, gateway=1).responses.retrieve(kept.id).id == kept.id
        with pytest.raises(openai.NotFoundError):
            client(stack, "sk-globex", gateway=1).responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            client(stack, "sk-globex", gateway=1).responses.create(model=MODEL, input="What number?",
                                                                  previous_response_id=kept.id)
        with pytest.raises(openai.BadRequestError) as e:
            client(stack, gateway=1).responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
        assert "tools[0].type: only function tools" in e.value.message
    finally:
        stack.restart("gateway")

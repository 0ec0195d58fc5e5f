"""Agent frameworks built on the official openai client run against the stack unchanged: the OpenAI Agents SDK
(openai-agents) runs its tool loop (the model calls a function tool, the SDK runs it and sends its result, the model
answers) over Chat Completions and over the Responses API, whole (tool_choice required) and streamed (the tool named),
on a real stack serving SmolLM2."""
import asyncio
import json

import jsonschema
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
from agents.items import ToolCallItem, ToolCallOutputItem
from agents.result import RunResult, RunResultStreaming
from agents.tracing import set_tracing_disabled

from ops.procs import free_port
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "smollm2-135m-instruct"
FORECAST = {"sky": "clear", "celsius": 18}


@pytest.fixture(scope="module")
def stack(smollm2, tmp_path_factory):
    with running(Stack(smollm2, free_port(), tmp_path_factory.mktemp("agents"), nats_port=free_port(), workers=1,
                       worker_args=[*WORKER_ARGS, "--threads", "1"])) as s:
        yield s


@pytest.fixture(scope="module", autouse=True)
def no_tracing():
    """The SDK exports its traces to OpenAI by default; the tests reach no network."""
    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


def weather_agent(model, choice: str) -> tuple[Agent, list[dict]]:
    """An agent whose one tool records each call's arguments, its first turn made to call the tool by tool_choice
    (`required` or the tool's name: SmolLM2-135M rarely decides to by itself); the SDK resets tool_choice after the
    call (reset_tool_choice, its default), so the second turn may answer in text."""
    calls: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: The city's name.
        """
        calls.append({"city": city})
        return json.dumps({"city": city, **FORECAST})

    agent = Agent(name="weather", instructions="Answer in one short sentence, using the tools you are given.",
                  model=model, tools=[get_weather], reset_tool_choice=True, tool_use_behavior="run_llm_again",
                  model_settings=ModelSettings(tool_choice=choice, temperature=0, max_tokens=48))
    return agent, calls


def models(stack) -> dict:
    client = openai.AsyncOpenAI(api_key="sk-local", base_url=stack.http + "/v1", max_retries=0, timeout=120)
    return {"chat": OpenAIChatCompletionsModel(MODEL, client), "responses": OpenAIResponsesModel(MODEL, client)}


def assert_the_loop_ran(result: RunResult | RunResultStreaming, calls: list[dict], agent: Agent) -> None:
    """The SDK called the tool with arguments valid for its schema, the run's items hold the call and its output,
    and the model answered after the output."""
    schema = agent.tools[0].params_json_schema
    called = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert calls and len(called) == len(outputs) == len(calls), result.new_items
    for item, args in zip(called, calls, strict=True):
        assert item.raw_item.name == "get_weather"
        jsonschema.validate(json.loads(item.raw_item.arguments), schema)
        assert json.loads(item.raw_item.arguments) == args
    assert json.loads(outputs[0].output) == {**calls[0], **FORECAST}
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.new_items
    assert result.new_items.index(called[0]) < result.new_items.index(outputs[0]) < len(result.new_items) - 1


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_made_to_call_a_tool_calls_it_and_answers_with_the_result(stack, api):
    agent, calls = weather_agent(models(stack)[api], "required")
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert_the_loop_ran(result, calls, agent)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_streamed_run_with_a_named_tool_calls_it_and_streams_the_answer(stack, api):
    agent, calls = weather_agent(models(stack)[api], "get_weather")

    async def run() -> tuple[RunResultStreaming, list]:
        result = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
        return result, [e async for e in result.stream_events()]

    result, events = asyncio.run(run())
    assert_the_loop_ran(result, calls, agent)
    kinds = {e.name for e in events if e.type == "run_item_stream_event"}
    assert {"tool_called", "tool_output", "message_output_created"} <= kinds, kinds
    raw = [e.data for e in events if e.type == "raw_response_event"]
    assert any(getattr(d, "type", "") == "response.output_text.delta" for d in raw)

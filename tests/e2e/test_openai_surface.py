"""The rest of the OpenAI surface on a real stack serving SmolLM2, through the official openai client: tool calling
(required and named constrained by the grammar engine, auto parsed from what the model writes, a full round trip,
streamed and not), the token endpoints, min_tokens, and the errors a client can act on (a prompt over the context,
an integer out of range)."""
import asyncio
import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest
import websockets

from ops.procs import free_port
from ops.status import read_registry
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHT = {"type": "function", "function": {
    "name": "book_flight", "description": "Books a flight.",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "minLength": 3, "maxLength": 3}, "destination": {"type": "string", "maxLength": 3},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "flexible": {"type": "boolean"}},
        "required": ["origin", "destination", "passengers"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone.",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                                 "maxLength": 40}},
                                                        "required": ["zone"]}}}
TOOLS = [WEATHER, FLIGHT, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def stack(smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("surface")
    with running(Stack(smollm2, free_port(), tmp, nats_port=free_port(), workers=1,
                       worker_args=[*WORKER_ARGS, "--threads", "1"])) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-local", base_url=stack.http + "/v1", max_retries=0, timeout=120)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_required_and_named_calls_always_parse_and_validate_against_their_schemas(client):
    """50 constrained calls with several schemas, 8 at a time: every arguments object validates, whatever the
    model (whose strings are bounded here: SmolLM2-135M repeats itself in an unbounded one until max_tokens).
    Sampled with temperature 0.7 alone: with SmolLM2's recommended top_p and repetition_penalty (the defaults of a
    request that leaves them unset) a few answers ran to 450-670 tokens, past the client's timeout on 2 cores."""
    prompts = ["What is the weather in Paris?", "Book me a flight from Boston to Denver for two.",
               "What time is it in Tokyo?", "Help me plan a trip.", "Hello!"]

    def ask(i: int):
        choice = "required" if i % 2 else {"type": "function", "function": {"name": TOOLS[i % 3]["function"]["name"]}}
        patient = client.with_options(timeout=300)    # 8 at a time on 2 cores shared with the suite's other half
        r = patient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i % 5]}],
                                            tools=TOOLS, tool_choice=choice, parallel_tool_calls=i % 8 == 1,
                                            max_tokens=800, temperature=0.7, seed=i,
                                            extra_body={"top_p": 1.0, "repetition_penalty": 1.0})
        return choice, r

    seen = set()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i, (choice, r) in enumerate(pool.map(ask, range(50))):
            got = calls_of(r.choices[0].message)
            assert got and r.choices[0].finish_reason == "tool_calls", r
            assert len(got) == 1 or i % 8 == 1
            for name, args in got:
                jsonschema.validate(args, SCHEMAS[name])
                seen.add(name)
            if isinstance(choice, dict):
                assert [name for name, _ in got] == [choice["function"]["name"]]
            assert all(c.id.startswith("call_") and c.type == "function" for c in r.choices[0].message.tool_calls)
    assert seen == set(SCHEMAS)


def test_a_named_call_streams_its_header_then_its_arguments_and_equals_the_whole_answer(client):
    params = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(stream=True, **params))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].index == 0
    assert all(p.id is None and p.function.name is None for p in pieces[1:]) and len(pieces) > 2
    streamed = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(streamed) == calls_of(whole.choices[0].message)[0][1]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_round_trip_call_result_answer(client, stack):
    """The call, the tool's result in the history (an assistant message with tool_calls, a tool message), and the
    model's answer: the chat template is given the whole history."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    message = answer.choices[0].message
    assert message.content or message.tool_calls
    tokens = httpx.post(f"{stack.http}/tokenize", json={"model": MODEL, "messages": history, "tools": TOOLS}).json()
    assert tokens["count"] == answer.usage.prompt_tokens           # the history as the pipeline rendered it


def test_auto_answers_text_or_calls_and_streams_the_same(client):
    """auto: whatever SmolLM2 writes is parsed the same streamed or not; a call names a known tool."""
    for messages in (ASK, [{"role": "user", "content": "Say hello in French."}]):
        params = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 60, "temperature": 0}
        whole = client.chat.completions.create(**params).choices[0]
        chunks = [c for c in client.chat.completions.create(stream=True, **params) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert (content or None) == (whole.message.content or None)
        names = [tc.function.name for c in chunks for tc in c.choices[0].delta.tool_calls or [] if tc.function.name]
        assert names == [name for name, _ in calls_of(whole.message)]
        assert set(names) <= set(SCHEMAS)
        assert whole.finish_reason == ("tool_calls" if names else chunks[-1].choices[0].finish_reason)


def test_tool_choice_none_and_bad_tools_are_answered_by_name(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    for bad, param in (({"tools": [{"type": "function"}]}, "tools[0]"),
                       ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                        "tool_choice.function.name"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                        "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **bad)
        assert e.value.message.startswith(f"Error code: 400 - {param}"), e.value.message


def test_tokenize_counts_what_a_completion_counts_and_detokenize_inverts_it(client, stack):
    base = stack.http
    text = "The engine's paged KV cache"
    got = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text}).json()
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert got["count"] == len(got["tokens"]) == r.usage.prompt_tokens and got["max_model_len"] == 8192
    assert httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": got["tokens"]}).json() == \
        {"prompt": text}
    chat = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": ASK}).json()
    assert chat["count"] == client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage.prompt_tokens
    for path, body, field in (("/tokenize", {"prompt": "x", "messages": ASK}, "exactly one of"),
                              ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens: 1000000000 is outside the vocabulary")):
        refused = httpx.post(base + path, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(field), refused.text


def test_min_tokens_holds_back_the_end_and_errors_a_client_can_act_on(client):
    capital = [{"role": "user", "content": "What is the capital of France?"}]
    short = client.chat.completions.create(model=MODEL, messages=capital, max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens + 10
    longer = client.chat.completions.create(model=MODEL, messages=capital, max_tokens=80, temperature=0,
                                            extra_body={"min_tokens": n})
    assert longer.usage.completion_tokens >= n
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as e:             # the prompt alone is over SmolLM2's 8,192
        client.completions.create(model=MODEL, prompt=[100 + i % 3000 for i in range(8200)], max_tokens=4)
    assert e.value.code == "context_length_exceeded" and "8192" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, seed=2 ** 80)
    assert "seed: 1208925819614629174706176 is out of range" in e.value.message


def test_the_websocket_carries_tools_and_tokenbus_chat_shows_the_call(stack, tmp_path):
    """A plain websockets client: the same tool objects in a generate frame, the call's pieces in the delta
    frames (OpenAI's delta objects), finish_reason tool_calls; tokenbus chat --tools prints the call."""
    async def ask() -> list[dict]:
        async with websockets.connect(stack.urls[0]) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "c", "messages": ASK, "tools": TOOLS, "max_tokens": 60,
                                      "temperature": 0, "tool_choice": {"type": "function",
                                                                        "function": {"name": "get_weather"}}}))
            frames = [json.loads(await ws.recv())]
            while frames[-1]["type"] == "delta":
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return frames

    frames = asyncio.run(ask())
    pieces = [p for f in frames for p in f.get("tool_calls", ())]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    args = json.loads("".join(p["function"]["arguments"] for p in pieces))
    jsonschema.validate(args, SCHEMAS["get_weather"])
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "tool_calls"
    assert "".join(f.get("text", "") for f in frames) == ""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    p = subprocess.run([sys.executable, "-m", "ops.cli", "chat", "--url", stack.urls[0], "--tools", str(tools),
                        "--tool-choice", "get_weather", "--temperature", "0", "--max-tokens", "60"],
                       input=ASK[0]["content"] + "\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "[tool call get_weather " in p.stdout, p.stdout
    shown = p.stdout.split("[tool call get_weather ", 1)[1].split("]\n")[0]
    assert json.loads(shown) == args and "finish tool_calls" in p.stdout, p.stdout


def forks(stack) -> int:
    """The choices the worker forked onto a sibling's prompt, as its last heartbeat says."""
    return sum(hb.forks for hb in asyncio.run(read_registry(stack.nats_url)))


def test_n_choices_are_seeded_reproducible_different_and_counted_once_per_prompt(client, stack):
    """n=3: three choices, choice i equal to the same request alone with seed + i; the prompt counted once and
    computed once (the other choices forked onto it, unless the first ended before they arrived)."""
    params = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    before = forks(stack)
    r = client.chat.completions.create(n=3, **params)
    deadline = time.monotonic() + 10
    while forks(stack) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert forks(stack) > before
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    alone = [client.chat.completions.create(**{**params, "seed": 7 + i}) for i in range(3)]
    assert texts == [a.choices[0].message.content for a in alone]
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **params))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]


def test_the_websocket_streams_n_choices_by_index_equal_to_the_http_ones_and_cancels_them_together(client, stack):
    params = {"messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    want = client.chat.completions.create(model=MODEL, n=3, **params)

    async def ask():
        async with websockets.connect(stack.urls[0]) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "n3", "n": 3, **params}))
            got, ends = {}, {}
            while len(ends) < 3:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert f["id"] == "n3", f
                if f["type"] == "delta":
                    got[f["index"]] = got.get(f["index"], "") + f["text"]
                else:
                    ends[f["index"]] = f
            await ws.send(json.dumps({"type": "generate", "id": "n17", "n": 17, **params}))
            refused = json.loads(await asyncio.wait_for(ws.recv(), 60))
            await ws.send(json.dumps({"type": "generate", "id": "long", "n": 2, **params, "max_tokens": 400,
                                      "ignore_eos": True}))
            await ws.send(json.dumps({"type": "cancel", "id": "long"}))
            cancelled = {}
            while len(cancelled) < 2:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if f["type"] == "done":
                    cancelled[f["index"]] = f["finish_reason"]
            return got, ends, refused, cancelled

    got, ends, refused, cancelled = asyncio.run(ask())
    assert [got[i] for i in range(3)] == [c.message.content for c in sorted(want.choices, key=lambda c: c.index)]
    assert all(ends[i]["type"] == "done" and ends[i]["usage"]["completion_tokens"] > 0 for i in range(3))
    assert refused["type"] == "error" and "n: must be an integer in [1, MAX_N=16]" in refused["message"]
    assert refused["id"] == "n17" and cancelled == {0: "abort", 1: "abort"}


def test_completions_take_a_list_of_prompts_and_echo(client):
    prompts = ["The engine", "A paged KV cache"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text.startswith(prompts[c.index // 2]) and len(c.text) > len(prompts[c.index // 2])
    alone = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0)
    assert r.choices[2].text == prompts[1] + alone.choices[0].text
    assert r.usage.prompt_tokens == sum(client.completions.create(model=MODEL, prompt=p, max_tokens=1)
                                        .usage.prompt_tokens for p in prompts)
    pieces = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                            echo=True))
    assert "".join(c.choices[0].text for c in pieces if c.choices and c.choices[0].index == 1) == r.choices[2].text

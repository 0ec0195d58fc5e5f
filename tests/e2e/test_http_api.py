"""The OpenAI-compatible HTTP API of a real stack (one worker, two tenants), driven by the official
openai client: models, chat and completions streamed and not, usage, cached tokens on a repeated
prompt and never across tenants, logprobs, the context limit, and the usage records it leaves."""
import asyncio
import json
import os
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from ops.cli import main
from ops.procs import free_port
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KEYS = {"sk-alpha": {"tenant": "alpha"}, "sk-beta": {"tenant": "beta"}}
# with a system message of its own: without one, SmolLM2's template starts every chat with the same one
QUESTION = [{"role": "system", "content": "Answer as an engineer."},
            {"role": "user", "content": "Explain how a paged KV cache shares the blocks of a common prompt "
                                        "prefix between requests, and why the last prompt token is recomputed."}]

ARGS = ["--threads", "1",            # steadier than two threads on a busy CPU
        "--num-kv-blocks", "520"]    # room for a prompt past SmolLM2's context (8,192 tokens), refused for that


@pytest.fixture(scope="module", params=["tiny_model", "smollm2"], ids=["tiny", "smollm2"])
def stack(request, tmp_path_factory):
    """On the tiny model, then on SmolLM2 (a trained model)."""
    tmp = tmp_path_factory.mktemp("http")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    model = request.getfixturevalue(request.param)
    with running(Stack(model, free_port(), tmp, nats_port=free_port(), workers=1,   # one worker: one prefix cache
              worker_args=[*WORKER_ARGS, *ARGS], api_keys=str(tmp / "keys.json"))) as s:
        yield s


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=stack.http + "/v1", max_retries=0, timeout=60)


def test_models_and_the_same_answer_streamed_or_not_for_the_same_seed(stack):
    alpha = client(stack, "sk-alpha")
    model = os.path.basename(stack.model)
    assert [m.id for m in alpha.models.list()] == [model]
    params = {"model": model, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 42}
    messages = [{"role": "user", "content": "Tell me about streams."}]
    whole = alpha.chat.completions.create(messages=messages, **params)
    chunks = list(alpha.chat.completions.create(messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **params))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and len(chunks) > 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.choices[0].finish_reason in ("stop", "length")

    text = alpha.completions.create(model=model, prompt="The engine", **{k: v for k, v in params.items()
                                                                         if k != "model"})
    pieces = list(alpha.completions.create(model=model, prompt="The engine", stream=True,
                                           **{k: v for k, v in params.items() if k != "model"}))
    assert "".join(c.choices[0].text for c in pieces) == text.choices[0].text and text.usage.completion_tokens > 0


def test_a_repeated_prompt_hits_the_prefix_cache_of_its_own_tenant_only(stack):
    alpha, beta = client(stack, "sk-alpha"), client(stack, "sk-beta")
    model = os.path.basename(stack.model)

    def cached(c) -> tuple[int, int]:
        r = c.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    prompt, first = cached(alpha)
    assert prompt >= 32 and first == 0
    assert cached(alpha)[1] >= 16 * ((prompt - 1) // 16)      # every full block but the last token's
    assert cached(beta)[1] == 0                                # the same prompt, another tenant: no hit
    assert cached(beta)[1] > 0


def test_a_one_token_completion_counts_its_prompt_streamed_or_not_on_both_apis(stack):
    """The worker's first chunk is also its last: the prompt is still counted (it once reported 0)."""
    alpha = client(stack, "sk-alpha")
    model = os.path.basename(stack.model)
    prompt = [{"role": "user", "content": "Count the prompt of a one-token answer."}]
    whole = alpha.chat.completions.create(model=model, messages=prompt, max_tokens=1, temperature=0)
    n = whole.usage.prompt_tokens
    assert n > 8 and whole.usage.completion_tokens == 1 and whole.usage.total_tokens == n + 1
    last = list(alpha.chat.completions.create(model=model, messages=prompt, max_tokens=1, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))[-1]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (n, 1)
    text = alpha.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=1, temperature=0)
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (4, 1)
    last = list(alpha.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=1, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))[-1]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 1)


def test_logprobs_and_the_context_limit_through_the_pipeline(stack):
    alpha = client(stack, "sk-alpha")
    model = os.path.basename(stack.model)
    r = alpha.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)   # greedy: the best one
    context = json.loads((Path(stack.model) / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(openai.BadRequestError) as refused:
        alpha.completions.create(model=model, prompt=[100 + i % 3000 for i in range(context + 10)], max_tokens=4)
    assert f"max_model_len={context}" in refused.value.message


class Reading(pydantic.BaseModel):
    """A structured output through the official client's parse(): its strict JSON schema."""
    sensor: Literal["temperature", "pressure", "humidity"]
    value: int = pydantic.Field(ge=0, le=999)
    unit: str = pydantic.Field(max_length=6)
    ok: bool


def test_structured_outputs_through_the_openai_client_and_bad_schemas_refused_by_name(stack):
    alpha = client(stack, "sk-alpha")
    model = os.path.basename(stack.model)
    messages = [{"role": "user", "content": "Report one sensor reading as JSON."}]
    parsed = alpha.chat.completions.parse(model=model, messages=messages, response_format=Reading, max_tokens=200,
                                          temperature=0.8, seed=3)
    assert isinstance(parsed.choices[0].message.parsed, Reading) and parsed.choices[0].finish_reason == "stop"
    chunks = alpha.chat.completions.create(model=model, messages=messages, max_tokens=200, seed=5, stream=True,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "reading", "schema": Reading.model_json_schema()}})
    Reading.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    picked = alpha.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           extra_body={"guided_choice": ["up", "down"]})
    assert picked.choices[0].message.content in ("up", "down")
    with pytest.raises(openai.BadRequestError) as refused:
        alpha.chat.completions.create(model=model, messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}})
    assert "json_schema" in refused.value.message and "objectx" in refused.value.message


def strict(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# nested, its string and array bounded: any output that follows it ends well within max_tokens; SmolLM2
# writes about 48 tokens (the flat Reading, 33)
SITE_READING = strict({
    "sensor": {"enum": ["temperature", "pressure", "humidity"]},
    "value": {"type": "number", "minimum": -40, "maximum": 125},
    "site": strict({"room": {"type": "string", "minLength": 1, "maxLength": 6}}),
    "flags": {"type": "array", "items": {"enum": ["low", "high", "stale"]}, "maxItems": 2},
})


def test_fifty_json_schema_requests_24_at_a_time_half_streamed_all_validate(stack):
    model = os.path.basename(stack.model)
    fmt = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SITE_READING, "strict": True}}
    seats = asyncio.Semaphore(24)       # 16 running, 8 waiting: under the gateway's queue watermark

    async def ask(api: openai.AsyncOpenAI, i: int) -> str:
        async with seats:
            return await asked(api, i)

    async def asked(api: openai.AsyncOpenAI, i: int) -> str:
        params = {"model": model, "max_tokens": 200, "temperature": 0.8, "seed": 100 + i, "response_format": fmt,
                  "messages": [{"role": "user", "content": f"Report sensor reading number {i} as JSON."}]}
        if i % 2:
            return (await api.chat.completions.create(**params)).choices[0].message.content
        chunks = await api.chat.completions.create(stream=True, **params)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(api_key="sk-alpha", base_url=stack.http + "/v1", max_retries=0,
                                      timeout=120) as api:
            return await asyncio.gather(*(ask(api, i) for i in range(50)))

    for text in asyncio.run(run()):
        jsonschema.validate(json.loads(text), SITE_READING)


def test_usage_sums_the_requests_of_each_tenant(stack, capsys):
    main(["usage", "--nats-url", stack.nats_url, "--database", stack.database_url, "--json"])
    rows = {r["tenant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) >= {"alpha", "beta"}
    assert rows["alpha"]["cached_tokens"] > 0 and rows["beta"]["requests"] == 2
    assert all(r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())

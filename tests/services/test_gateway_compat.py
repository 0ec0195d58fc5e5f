"""What clients built for OpenAI and vLLM send, against a real nats-server and uvicorn with the rest of
the pipeline played by the scripted fake (Downstream): /health and /v1/models/{id}, stream_options'
continuous_usage_stats and include_obfuscation, the fields accepted and ignored, logit_bias, exact
usage for 1- and 0-token completions on every API and streaming mode (and in the usage records and
the rate limit's settlement), a token's own bytes in logprobs, and every refusal counted by its code."""
import asyncio
import json
import re

import openai
import orjson
import pytest
from tokenizers import Tokenizer
from websockets.asyncio.client import connect

from schemas.subjects import MAX_HEADER_BYTES, MAX_HEADERS
from services.gateway import api
from services.gateway.admission import Admission
from tests.services.fake_pipeline import PROMPT_TOKENS, gateway, heartbeat, said, served
from tests.services.test_gateway_api import chat, error_of, http, post, raw_request, run, usage_records
from tests.services.test_metrics import scrape

CACHED = 3
KEYS = {"sk-acme": {"tenant": "acme", "tokens_per_minute": 100000},
        "sk-tight": {"tenant": "tight", "tokens_per_minute": 100}}


def partial_token(tok: Tokenizer) -> int:
    """A token that is one byte of a multi-byte UTF-8 character (0xE6, the first of "本"'s three)."""
    return tok.token_to_id("æ")


async def script(down, req):
    """"one": the first chunk is also the last, with one token; "zero": a last chunk with none (a stop token
    came first); "partial": one token holding part of a character, with logprobs; else " echo <said>"."""
    text = said(req)
    if text in ("one", "zero", "partial"):
        ids = {"one": down.ids(" echo")[:1], "zero": [], "partial": [partial_token(down.tok)]}[text]
        final = down.final(req.id, 0, ids, "length" if ids else "stop")
        final.usage["cached_tokens"] = CACHED
        if req.sampling.logprobs is not None:
            from schemas.messages import Logprobs
            final.logprobs = Logprobs([-0.25] * len(ids), [[*ids, 7][:req.sampling.logprobs] for _ in ids],
                                      [[-0.25, -2.0][:req.sampling.logprobs] for _ in ids])
        await down.publish(req.id, final)
        return
    await down.reply(req, f" echo {text}")


class Spy(Admission):
    """Admission that records each settlement: (tenant, tokens used)."""
    settled: list

    def settle(self, ticket, used, now=None):
        self.settled.append((ticket.key.tenant, used))
        super().settle(ticket, used, now)


# -- routes -----------------------------------------------------------------------------------------

def test_health_answers_as_healthz_and_a_model_is_retrieved_by_its_id(nats_url, tiny_model, tok):
    with served(nats_url, tiny_model, tok, script) as down:
        for path in ("/health", "/healthz"):
            status, _, got = http("GET", down.http + path)
            assert status == 200 and orjson.loads(got) == {"status": "ok", "workers": 1}
        client = openai.OpenAI(api_key="none", base_url=down.http + "/v1", max_retries=0)
        model = client.models.retrieve("tiny")
        assert (model.id, model.object, model.owned_by) == ("tiny", "model", "tokenbus")
        assert model.model_dump() == client.models.list().data[0].model_dump()
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("org/gpt-9")
        assert e.value.code == "model_not_found" and "'org/gpt-9' does not exist" in e.value.message


# -- usage ------------------------------------------------------------------------------------------

def test_usage_is_exact_for_one_and_zero_token_completions_on_every_api_and_streaming_mode(
        nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script, api_keys=keys_file) as down:
            gw = down.app.state.gateway
            gw.admission = Spy(gw.admission.cluster, gw.admission.tenants)
            gw.admission.settled = []
            want = {"one": (tok.decode(tok.encode(" echo").ids[:1]), 1, "length"), "zero": ("", 0, "stop")}
            asked = 0
            for said_, (text, n, reason) in want.items():
                expected = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n,
                            "prompt_tokens_details": {"cached_tokens": CACHED}}
                for path, b in (("/v1/chat/completions", chat(said_, max_tokens=1)),
                                ("/v1/completions", {"model": "tiny", "prompt": said_, "max_tokens": 1})):
                    status, _, got = await post(down, path, b)
                    assert status == 200 and got["usage"] == expected, got
                    assert got["choices"][0]["finish_reason"] == reason
                    status, _, raw = await post(down, path, {**b, "stream": True,
                                                             "stream_options": {"include_usage": True}})
                    chunks = events(raw)
                    assert status == 200 and chunks[-1]["usage"] == expected and chunks[-1]["choices"] == []
                    assert all(c["usage"] is None for c in chunks[:-1])
                    assert streamed_text(chunks) == text
                    asked += 2
                async with connect(down.ws + "?api_key=sk-acme") as ws:
                    await ws.send(orjson.dumps({"type": "generate", "id": "w", "prompt": said_,
                                                "max_tokens": 1}).decode())
                    frames = [orjson.loads(await ws.recv()) for _ in range(2 if n else 1)]
                assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == reason
                assert frames[-1]["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n}
                asked += 1
            records = await usage_records(down.nc, asked)
            assert sorted((u.api, u.prompt_tokens, u.cached_tokens, u.completion_tokens) for u in records) == sorted(
                (api, PROMPT_TOKENS, CACHED, n) for n in (1, 0) for api in ("chat", "chat", "completions",
                                                                            "completions", "ws"))
            assert sorted(gw.admission.settled) == sorted([("acme", PROMPT_TOKENS + 1)] * 5 +
                                                          [("acme", PROMPT_TOKENS)] * 5)
    run(body())


def events(raw: bytes) -> list[dict]:
    """The JSON chunks of a server-sent event stream, [DONE] checked and left out."""
    data = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]", data[-3:]
    return [orjson.loads(d) for d in data[:-1]]


def streamed_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" if "delta" in c["choices"][0]
                   else c["choices"][0]["text"] for c in chunks if c["choices"])


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(nats_url, tiny_model, tok):
    with served(nats_url, tiny_model, tok, script) as down:
        client = openai.OpenAI(api_key="none", base_url=down.http + "/v1", max_retries=0)
        n = len(tok.encode(" echo a b c").ids)
        for create, kw in ((client.chat.completions.create, {"messages": [{"role": "user", "content": "a b c"}]}),
                           (client.completions.create, {"prompt": "a b c"})):
            chunks = list(create(model="tiny", stream=True, max_tokens=20, **kw, stream_options={
                "include_usage": True, "continuous_usage_stats": True}))
            assert all(c.usage is not None and c.usage.prompt_tokens == PROMPT_TOKENS for c in chunks)
            counts = [c.usage.completion_tokens for c in chunks if c.choices]
            assert counts == sorted(counts) and counts[-1] == n and chunks[-1].usage.completion_tokens == n
            assert all(c.usage.total_tokens == PROMPT_TOKENS + c.usage.completion_tokens for c in chunks)
            if create == client.chat.completions.create:
                assert counts[0] == 0                                   # the role chunk, before any token
            # each token chunk counts its own tokens
            deltas = [c for c in chunks if c.choices and streamed_text([c.model_dump()])]
            assert [c.usage.completion_tokens for c in deltas] == list(range(1, n + 1))
            # without include_usage, continuous_usage_stats alone changes nothing (vLLM's rule)
            alone = list(create(model="tiny", stream=True, max_tokens=20, **kw,
                                stream_options={"continuous_usage_stats": True}))
            assert all(c.usage is None for c in alone)


def test_include_obfuscation_pads_each_chunk_to_a_multiple_of_64_bytes(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down:
            b = chat("pad me", stream=True, stream_options={"include_usage": True, "include_obfuscation": True})
            status, _, raw = await post(down, "/v1/chat/completions", b, key=None)
            data = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")][:-1]
            padded = [d for d in data if orjson.loads(d)["choices"]]
            assert status == 200 and len(padded) >= 3
            assert all(len(d) % 64 == 0 and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", orjson.loads(d)["obfuscation"])
                       for d in padded)
            assert "obfuscation" not in orjson.loads(data[-1])          # the usage chunk has no choices
            assert streamed_text([orjson.loads(d) for d in data]) == " echo pad me"
            status, _, raw = await post(down, "/v1/chat/completions", {**b, "stream_options": {
                "include_obfuscation": False}}, key=None)
            assert b"obfuscation" not in raw
    run(body())


# -- fields accepted, ignored or refused -------------------------------------------------------------

def test_the_openai_client_with_every_accepted_field(nats_url, tiny_model, tok):
    with served(nats_url, tiny_model, tok, script) as down:
        client = openai.OpenAI(api_key="none", base_url=down.http + "/v1", max_retries=0)
        bias = {str(tok.token_to_id("a")): 5, "7": -100}
        common = {"max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 4, "stop": ["zz"], "n": 1,
                  "presence_penalty": 0.1, "frequency_penalty": 0.2, "logit_bias": bias, "user": "u", "store": True,
                  "metadata": {"run": "7"}, "service_tier": "auto",
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True,
                                     "include_obfuscation": True},
                  "extra_body": {"ignore_eos": False, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                 "stop_token_ids": [2], "speculative": True}}
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x y"}], logprobs=True,
                                           top_logprobs=1, parallel_tool_calls=False, tool_choice="none",
                                           **{**common, "stream_options": None})
        assert r.choices[0].message.content == " echo x y"
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x y"}], stream=True, max_completion_tokens=20,
            **{k: v for k, v in common.items() if k != "max_tokens"}))
        assert streamed_text([c.model_dump() for c in chunks]) == " echo x y"
        chat_only = ("store", "metadata", "service_tier")      # the client's completions.create has no such fields
        t = client.completions.create(model="tiny", prompt="x y", logprobs=1, stream=True,
                                      **{k: v for k, v in common.items() if k not in chat_only})
        assert "".join(c.choices[0].text for c in t if c.choices) == " echo x y"
        for req in down.requests:
            s = req.sampling
            assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.presence_penalty, s.frequency_penalty,
                    s.top_k, s.min_p, s.repetition_penalty, s.stop_token_ids, s.speculative) == (
                20, 0.5, 0.9, 4, ("zz",), 0.1, 0.2, 5, 0.05, 1.1, (2,), True)
            assert s.logit_bias == {k: float(v) for k, v in bias.items()}
        assert [r.sampling.logprobs for r in down.requests] == [1, None, 1]


REFUSED = [  # (body, words in the message, param)
    (chat(tool_choice="auto"), ["tool_choice: 'auto' needs tools"], "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="any"),
     ["tool_choice: must be one of none, auto, required"], "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                               "function": {"name": "g"}}),
     ["tool_choice.function.name: 'g' is not one of the tools (f)"], "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
     ["tools[0].function.parameters: expected an object"], "tools"),
    (chat(store="yes"), ["store: expected true or false"], "store"),
    (chat(metadata=[1]), ["metadata: expected an object"], "metadata"),
    (chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": 1}),
     ["stream_options.continuous_usage_stats: expected true or false"], "stream_options"),
    (chat(stream=True, stream_options={"include_usage": True, "other": True}),
     ["stream_options.other: unknown option"], "stream_options"),
    (chat(stream=True, stream_options=[1]), ["stream_options: expected an object, got an array"], "stream_options"),
    (chat(logit_bias={"x": 1}), ["logit_bias keys must be token ids"], "logit_bias"),
    (chat(logit_bias={"5": 101}), ["logit_bias[5] must be a number in [-100, 100]"], "logit_bias"),
    (chat(logit_bias={str(i): 1 for i in range(301)}), ["MAX_LOGIT_BIAS=300"], "logit_bias"),
    (chat(logit_bias=[5]), ["logit_bias: expected an object of token id to bias"], "logit_bias"),
    (chat(response_format={"type": "xml"}), ["response_format.type: must be one of text, json_object"],
     "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": "{}"}}),
     ["response_format.json_schema: expected an object with a schema object"], "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": 1}}),
     ["response_format.json_schema.strict: expected true or false"], "response_format"),
    (chat(guided_json={"enum": ["x" * 70000]}), ["json_schema must have 1 to 65536 characters"], "json_schema"),
    (chat(guided_json={"x": json.loads("[" * 33 + "]" * 33)}),
     ["MAX_SCHEMA_DEPTH=32"], "json_schema"),
    (chat(guided_regex="a", guided_choice=["a"]), ["takes at most one of"], "structured"),
    (chat(guided_choice=[]), ["choice must be a list of 1 to MAX_CHOICES=256"], "choice"),
]


def test_fields_that_would_change_the_output_are_refused_naming_them(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down:
            for b, words, param in REFUSED:
                status, _, got = await post(down, "/v1/chat/completions", b, key=None)
                error_of(status, got, 400, *words)
                assert got["error"]["param"] == param, got
            assert down.requests == []
    run(body())


def test_logit_bias_on_the_websocket_and_a_token_outside_the_vocabulary(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            frame = {"type": "generate", "id": "b", "prompt": "q", "logit_bias": {"3": -5}}
            await ws.send(orjson.dumps(frame).decode())
            while (f := orjson.loads(await ws.recv()))["type"] != "done":
                pass
            assert down.requests[-1].sampling.logit_bias == {"3": -5.0}
            await ws.send(orjson.dumps({"type": "generate", "id": "c", "prompt": "q", "logit_bias": 3}).decode())
            f = orjson.loads(await ws.recv())
            assert f["type"] == "error" and "logit_bias: expected an object of token id to bias" in f["message"]
    run(body())


# -- logprobs ----------------------------------------------------------------------------------------

def test_logprobs_report_a_partial_character_token_by_its_own_bytes(nats_url, tiny_model, tok):
    with served(nats_url, tiny_model, tok, script) as down:
        client = openai.OpenAI(api_key="none", base_url=down.http + "/v1", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "partial"}],
                                           logprobs=True, top_logprobs=2)
        (entry,) = r.choices[0].logprobs.content
        assert entry.token == "\ufffd" and entry.bytes == [0xE6]
        assert entry.top_logprobs[0].bytes == [0xE6]
        assert bytes(entry.top_logprobs[1].bytes).decode() == tok.decode([7])


# -- refusals in the metrics -------------------------------------------------------------------------

def test_every_refusal_is_counted_by_its_code_in_the_metrics(nats_url, tiny_model, tok, keys_file, monkeypatch):
    def boom(*_):
        raise RuntimeError("forced")

    async def body():
        async with gateway(nats_url, tiny_model, tok, script, api_keys=keys_file) as down:
            port = int(down.http.rsplit(":", 1)[1])
            many = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
            got = await asyncio.to_thread(raw_request, port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + many +
                                          b"connection: close\r\n\r\n")                          # 431 (count)
            assert got.startswith(b"HTTP/1.1 431"), got[:40]
            huge = b"x-big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\nconnection: close\r\n\r\n"
            got = await asyncio.to_thread(raw_request, port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + huge)
            assert got.startswith(b"HTTP/1.1 431"), got[:40]                                  # 431 (h11's)
            with monkeypatch.context() as m:
                m.setattr(api, "card", boom)
                status, _, _ = await asyncio.to_thread(http, "GET", down.http + "/v1/models",
                                                       headers={"authorization": "Bearer sk-acme"})
                assert status == 500                                                         # 500
            await post(down, "/v1/chat/completions", chat(n=17), key="sk-acme")                      # 400
            await post(down, "/v1/chat/completions", chat(), key="sk-wrong")                        # 401
            await post(down, "/v1/chat/completions", chat(model="gpt-9"), key="sk-acme")             # 404
            await asyncio.to_thread(http, "GET", down.http + "/v1/models/gpt-9",
                                    headers={"authorization": "Bearer sk-acme"})                    # 404
            await post(down, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 90},
                       key="sk-tight")                                                              # ok
            await post(down, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 95},
                       key="sk-tight")                                                              # 429
            await post(down, "/v1/chat/completions", chat(max_tokens=10**6), key="sk-acme")         # 400 (cap)
            await down.drop("fake0")
            await until_no_worker(down)
            await post(down, "/v1/chat/completions", chat(), key="sk-acme")                         # 503
            async with connect(down.ws + "?api_key=sk-acme") as ws:                                  # ws 400
                await ws.send(orjson.dumps({"type": "generate", "id": "x", "prompt": "a", "top_p": 5}).decode())
                await ws.recv()
            with pytest.raises(Exception):                                   # noqa: B017 (the handshake's 401)
                async with connect(down.ws + "?api_key=sk-nope"):
                    pass
            got = {(dict(labels)["code"], dict(labels)["tenant"]): v
                   for (name, labels), v in (await asyncio.to_thread(scrape, down.http)).items()
                   if name == "tokenbus_request_errors_total"}
            assert got == {("invalid_request", "acme"): 2.0, ("max_tokens_too_large", "acme"): 1.0,
                           ("invalid_api_key", "-"): 2.0, ("model_not_found", "acme"): 2.0,
                           ("rate_limit_exceeded", "tight"): 1.0, ("unavailable", "acme"): 1.0,
                           ("too_many_headers", "-"): 1.0, ("headers_too_large", "-"): 1.0,
                           ("internal", "-"): 1.0}, got
            await down.register(heartbeat("fake0"))
    run(body())


async def until_no_worker(down) -> None:
    gw = down.app.state.gateway
    for _ in range(500):
        if not gw.admission.cluster.workers:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the gateway still sees a worker")

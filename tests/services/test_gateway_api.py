"""The OpenAI-compatible HTTP API, keys, rate limits, admission and limits, against a real nats-server
and uvicorn with the rest of the pipeline played by the scripted fake (Downstream)."""
import asyncio
import hashlib
import socket
import time
import urllib.error
import urllib.request

import openai
import orjson
import pytest
import websockets
from websockets.asyncio.client import connect

from schemas import subjects
from schemas.messages import ErrorChunk, Logprobs, Usage, decode
from schemas.subjects import MAX_BODY_BYTES, MAX_FRAME_BYTES, MAX_HEADER_BYTES, MAX_HEADERS, MAX_STOP
from services.gateway.http_parse import FIELDS
from services.gateway.openapi import document
from tests.services.fake_pipeline import PROMPT_TOKENS, gateway, heartbeat, said, served

KEYS = {"sk-acme": {"tenant": "acme"},
        "sha256:" + hashlib.sha256(b"sk-globex").hexdigest(): {"tenant": "globex"},
        "sk-small": {"tenant": "small", "tokens_per_minute": 1000, "max_concurrent_requests": 2}}
CACHED = 5


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def script(down, req):
    """Echoes what was said; "hold" holds; "fail" fails; logprobs when asked; reports CACHED cached tokens."""
    text = said(req)
    if text == "hold":
        return
    if text == "fail":
        await down.publish(req.id, ErrorChunk(req.id, "invalid_request", "prompt has 5000 tokens; max_model_len=4096"))
        return
    ids = down.ids(f" echo {text}")
    for i, t in enumerate(ids[:-1]):
        c = down.chunk(req.id, i, [t])
        c.cached_tokens, c.logprobs = (CACHED if i == 0 else 0), logprobs(req, [t])
        await down.publish(req.id, c)
        await asyncio.sleep(0.001)
    final = down.final(req.id, len(ids) - 1, ids[-1:], "stop")
    final.usage["cached_tokens"], final.logprobs = CACHED, logprobs(req, ids[-1:])
    await down.publish(req.id, final)


def logprobs(req, ids: list[int]) -> Logprobs | None:
    n = req.sampling.logprobs
    if n is None:
        return None
    return Logprobs([-0.5] * len(ids), [[t, 7, 8][:n] for t in ids], [[-0.5, -1.0, -2.0][:n] for _ in ids])


def http(method: str, url: str, body=None, headers=None, raw: bytes | None = None) -> tuple[int, dict, bytes]:
    data = raw if raw is not None else (None if body is None else orjson.dumps(body))
    req = urllib.request.Request(url, data, {"content-type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


async def post(down, path: str, body: dict, key: str | None = "sk-acme", **kw) -> tuple[int, dict, dict | bytes]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    status, h, data = await asyncio.to_thread(http, "POST", down.http + path, body, headers, **kw)
    return status, h, orjson.loads(data) if h.get("content-type", "").startswith("application/json") else data


def chat(content: str = "hi", **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}


def error_of(status: int, body: dict, code: int, *words: str) -> None:
    assert status == code, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    for w in words:
        assert w in body["error"]["message"], (w, body)


# -- the openai client --------------------------------------------------------------------------

def test_the_openai_client_lists_models_and_gets_chat_and_completions_streamed_and_not(
        nats_url, tiny_model, tok, keys_file):
    with served(nats_url, tiny_model, tok, script, api_keys=keys_file) as down:
        client = openai.OpenAI(api_key="sk-acme", base_url=down.http + "/v1", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]

        whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one two"}],
                                               max_tokens=20, temperature=0.5, seed=3)
        assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
        assert whole.choices[0].message.content == " echo one two" and whole.choices[0].finish_reason == "stop"
        n = len(tok.encode(" echo one two").ids)
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
            PROMPT_TOKENS, n, PROMPT_TOKENS + n)
        assert whole.usage.prompt_tokens_details.cached_tokens == CACHED

        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one two"}],
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " echo one two"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == CACHED
        assert all(c.usage is None for c in chunks[:-1])

        text = client.completions.create(model="tiny", prompt="say", max_tokens=9)
        assert text.object == "text_completion" and text.choices[0].text == " echo say"
        streamed = list(client.completions.create(model="tiny", prompt=[[5, 6, 7]], stream=True))
        assert "".join(c.choices[0].text for c in streamed) == " echo 3 tokens"
        assert streamed[-1].usage is None                    # no include_usage: no usage chunk

        req = {said(r): r for r in down.requests}
        assert req["say"].sampling.max_tokens == 9 and req["3 tokens"].prompt_token_ids == [5, 6, 7]
        assert req["one two"].sampling.max_tokens == 4096      # chat's default: the gateway's cap
        assert all(r.tenant == r.cache_salt == "acme" for r in down.requests)


def test_every_parameter_reaches_the_sampling_params(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down:
            status, _, _ = await post(down, "/v1/chat/completions", chat(
                "p", max_completion_tokens=33, max_tokens=99, temperature=0.3, top_p=0.8, seed=11, stop=["x", "y"],
                n=1, presence_penalty=0.5, frequency_penalty=-0.5, user="u1", ignore_eos=True, top_k=7, min_p=0.1,
                repetition_penalty=1.2, stop_token_ids=[3], speculative=False), key=None)
            assert status == 200
            s = down.requests[0].sampling
            assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.presence_penalty, s.frequency_penalty,
                    s.ignore_eos, s.top_k, s.min_p, s.repetition_penalty, s.stop_token_ids, s.logprobs,
                    s.speculative) == (33, 0.3, 0.8, 11, ("x", "y"), 0.5, -0.5, True, 7, 0.1, 1.2, (3,), None, False)
            status, _, _ = await post(down, "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "system", "content": [{"type": "text", "text": "be "},
                                                                           {"type": "text", "text": "brief"}]},
                                              {"role": "user", "content": "q"}]}, key=None)
            assert status == 200 and down.requests[1].messages[0] == {"role": "system", "content": "be brief"}
    run(body())


def test_logprobs_come_back_in_openai_shape(nats_url, tiny_model, tok):
    with served(nats_url, tiny_model, tok, script) as down:
        client = openai.OpenAI(api_key="none", base_url=down.http + "/v1", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "lp"}],
                                           logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        ids = tok.encode(" echo lp").ids
        assert [c.token for c in content] == [tok.decode([t]) for t in ids]
        assert all(c.logprob == -0.5 and [t.logprob for t in c.top_logprobs] == [-0.5, -1.0] for c in content)
        assert down.requests[-1].sampling.logprobs == 2
        streamed = list(client.completions.create(model="tiny", prompt="lp", logprobs=1, stream=True))
        tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
        assert "".join(tokens) == " echo lp"
        assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}]
                                              ).choices[0].logprobs is None


# -- errors and limits ----------------------------------------------------------------------------

BAD = [  # (path, body, status, words in the message, param)
    ("/v1/chat/completions", chat(n=17), 400, ["n: must be an integer in [1, MAX_N=16]"], "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 5, "n": 16}, 400, ["MAX_COMPLETIONS=64"], "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 33}, 400, ["MAX_PROMPTS=32"], "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1}, 400, ["echo: with logprobs"],
     "echo"),
    ("/v1/chat/completions", chat(max_tokens=5000), 400, ["max_tokens=4096"], "max_tokens"),
    ("/v1/chat/completions", chat(stop=["s"] * (MAX_STOP + 1)), 400, [f"MAX_STOP={MAX_STOP}"], "stop"),
    ("/v1/chat/completions", chat(temperature="hot"), 400, ["temperature: expected a number"], "temperature"),
    ("/v1/chat/completions", chat(top_p=0), 400, ["top_p must be in (0, 1]"], "top_p"),
    ("/v1/chat/completions", chat(tools=[{}]), 400, ['tools[0]: expected {"type": "function"'], "tools"),
    ("/v1/chat/completions", chat(tool_choice="required"), 400, ["tool_choice: 'required' needs tools"], "tool_choice"),
    ("/v1/chat/completions", chat(min_tokens=9, max_tokens=5), 400, ["min_tokens must be in [0, max_tokens=5]"],
     "min_tokens"),
    ("/v1/chat/completions", chat(stream_options={"include_usage": True}), 400, ["only allowed when stream"],
     "stream_options"),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, ["needs logprobs"], "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, ["[0, 20]"], "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, ["messages: required"], "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400,
     ["messages[0].role: must be one of"], "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, ["only {\"type\": \"text\""], "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x", "name": 5}]}, 400,
     ["messages[0].name: expected a string"], "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, ["model: required"], "model"),
    ("/v1/chat/completions", chat(model="gpt-9"), 404, ["'gpt-9' does not exist"], "model"),
    ("/v1/completions", {"model": "tiny", "prompt": {"x": 1}}, 400, ["prompt: required"], "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": 1}, 400, ["echo: expected true or false"], "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, ["max_tokens must be in [1, "],
     "max_tokens"),
    ("/v1/chat/completions", chat(top_k=2**64 - 1), 400, ["top_k must be in [1, 1048576]"], "top_k"),
    ("/v1/chat/completions", chat(seed=2**64 - 1, temperature=1e308), 400, ["temperature must be 0 (greedy) or in"],
     "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "speculative": "off"}, 400,
     ["speculative: expected true or false, got a string"], "speculative"),
    ("/v1/chat/completions", chat(repetition_penalty=1e300), 400, ["repetition_penalty must be in [0.01, 100.0]"],
     "repetition_penalty"),
    ("/v1/chat/completions", chat(stop_token_ids=[2**64 - 1]), 400, ["stop_token_ids must be token ids"],
     "stop_token_ids"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=2**64 - 1), 400, ["[0, 20]"], "top_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2**64 - 1]}, 400,
     ["prompt_token_ids[1]: 18446744073709551615 is not a token id"], "prompt_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2**64 - 1}, 400, ["max_tokens"], "max_tokens"),
]


def test_each_bad_request_gets_a_4xx_in_openai_shape_naming_the_field_and_nothing_is_published(
        nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down:
            for path, b, code, words, param in BAD:
                status, _, got = await post(down, path, b, key=None)
                error_of(status, got, code, *words)
                assert got["error"]["param"] == param, got
                assert got["error"]["type"] == "invalid_request_error"
            for raw, words in [(b"{not json", ["not valid JSON"]), (b"[1]", ["must be a JSON object, got an array"])]:
                status, _, got = await post(down, "/v1/chat/completions", None, key=None, raw=raw)
                error_of(status, got, 400, *words)
            port = int(down.http.rsplit(":", 1)[1])
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            said_size = head + b"content-length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)   # refused before the body
            chunked = head + b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (
                MAX_BODY_BYTES + 1, b"a" * (MAX_BODY_BYTES + 1))                     # refused once past the cap
            for request in (said_size, chunked):
                got = await asyncio.to_thread(raw_request, port, request)
                assert got.startswith(b"HTTP/1.1 413") and f"MAX_BODY_BYTES={MAX_BODY_BYTES}".encode() in got
            assert down.requests == []
    run(body())


def test_a_pipeline_error_before_any_token_gets_its_status_streamed_or_not(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down:
            for stream in (False, True):
                status, _, got = await post(down, "/v1/chat/completions", chat("fail", stream=stream), key=None)
                error_of(status, got, 400, "max_model_len=4096")
    run(body())


def test_unknown_paths_and_methods_answer_in_openai_shape(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down:
            status, _, got = await asyncio.to_thread(http, "GET", down.http + "/v1/nothing")
            error_of(status, orjson.loads(got), 404, "/v1/nothing")
            status, _, got = await asyncio.to_thread(http, "GET", down.http + "/v1/chat/completions")
            error_of(status, orjson.loads(got), 405)
    run(body())


def raw_request(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


def raw_flood(port: int, piece: bytes) -> bytes:
    """Sends header lines in pieces until the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(0.05)
        data = b""
        for _ in range(100):
            try:
                s.sendall(piece)
                piece = b"x-h: v\r\n" * 1000
                data += s.recv(65536)
                break
            except TimeoutError:
                continue
            except OSError:
                break
        s.settimeout(5)
        while chunk := s.recv(65536):
            data += chunk
        return data


def test_header_floods_get_431_naming_the_limit(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down:
            port = int(down.http.rsplit(":", 1)[1])
            many = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
            got = await asyncio.to_thread(raw_request, port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + many +
                                          b"connection: close\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 431") and f"MAX_HEADERS={MAX_HEADERS}".encode() in got
            huge = b"x-big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\nconnection: close\r\n\r\n"
            got = await asyncio.to_thread(raw_request, port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + huge)
            assert got.startswith(b"HTTP/1.1 431") and f"MAX_HEADER_BYTES={MAX_HEADER_BYTES}".encode() in got
            endless = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"x-h: v\r\n" * 1000   # no end in sight
            got = await asyncio.to_thread(raw_flood, port, endless)
            assert got.startswith(b"HTTP/1.1 431") and f"MAX_HEADER_BYTES={MAX_HEADER_BYTES}".encode() in got
            assert (await asyncio.to_thread(http, "GET", down.http + "/healthz"))[0] == 200   # still serving
    run(body())


def test_a_websocket_frame_over_1_mib_closes_the_connection_naming_the_limit(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down, connect(down.ws, max_size=None) as ws:
            await ws.send("x" * (MAX_FRAME_BYTES + 1))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 5)
            assert closed.value.rcvd.code == 1009 and str(MAX_FRAME_BYTES) in closed.value.rcvd.reason
    run(body())


# -- keys -----------------------------------------------------------------------------------------

def test_keys_map_to_tenants_and_a_missing_or_wrong_key_is_401_on_http_and_websocket(
        nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script, api_keys=keys_file) as down:
            for key in (None, "sk-wrong", "sha256:" + hashlib.sha256(b"sk-globex").hexdigest()):
                status, _, got = await post(down, "/v1/chat/completions", chat(), key=key)
                error_of(status, got, 401, "API key")
                assert got["error"]["type"] == "authentication_error"
            status, _, _ = await asyncio.to_thread(http, "GET", down.http + "/v1/models")
            assert status == 401
            for url in (down.ws, down.ws + "?api_key=sk-wrong"):
                with pytest.raises(websockets.InvalidStatus) as refused:
                    async with connect(url):
                        pass
                assert refused.value.response.status_code == 401
            assert (await post(down, "/v1/chat/completions", chat("a"), key="sk-acme"))[0] == 200
            assert (await post(down, "/v1/chat/completions", chat("b"), key="sk-globex"))[0] == 200
            async with connect(down.ws + "?api_key=sk-globex") as ws:
                await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": "c"}).decode())
                while orjson.loads(await ws.recv())["type"] != "done":
                    pass
            async with connect(down.ws, additional_headers={"Authorization": "Bearer sk-acme"}) as ws:
                await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": "d"}).decode())
                while orjson.loads(await ws.recv())["type"] != "done":
                    pass
            tenants = {said(r): (r.tenant, r.cache_salt) for r in down.requests}
            assert tenants == {"a": ("acme", "acme"), "b": ("globex", "globex"), "c": ("globex", "globex"),
                               "d": ("acme", "acme")}
    run(body())


# -- rate limits, concurrency, admission -----------------------------------------------------------

@pytest.mark.serial
def test_over_the_token_rate_is_429_with_retry_after_fast_and_unused_tokens_are_refunded(
        nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script, api_keys=keys_file) as down:
            # tokens_per_minute=1000: this charges about 900 and uses about 14 ...
            status, _, got = await post(down, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 900},
                                        key="sk-small")
            assert status == 200 and got["usage"]["total_tokens"] < 20
            # ... so, refunded, the next one passes at once; it holds its 900 ...
            held = await post_nowait(down, {"model": "tiny", "prompt": "hold", "max_tokens": 900}, "sk-small")
            await until(lambda: len(down.requests) == 2)
            # ... and leaves too few for a third
            started = time.perf_counter()
            status, headers, got = await post(down, "/v1/completions", {"model": "tiny", "prompt": "b",
                                                                         "max_tokens": 500}, key="sk-small")
            error_of(status, got, 429, "tokens_per_minute=1000", "retry after")
            assert got["error"]["code"] == "rate_limit_exceeded" and got["error"]["type"] == "rate_limit_error"
            assert 1 <= int(headers["retry-after"]) <= 60
            assert time.perf_counter() - started < 0.5
            status, _, got = await post(down, "/v1/completions", {"model": "tiny", "prompt": "b", "max_tokens": 1500},
                                        key="sk-small")
            error_of(status, got, 400, "tokens_per_minute=1000")           # never fits: no point retrying
            assert len(down.requests) == 2
            held.close()
    run(body())


async def post_nowait(down, body: dict, key: str) -> asyncio.StreamWriter:
    """Sends a request and does not wait for the answer; closing the writer is the client leaving."""
    _, writer = await asyncio.open_connection("127.0.0.1", int(down.http.rsplit(":", 1)[1]))
    data = orjson.dumps(body)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s" % (key.encode(), len(data), data))
    await writer.drain()
    return writer


async def until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_concurrency_cap_is_429_until_a_request_ends(nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script, api_keys=keys_file) as down, \
                connect(down.ws + "?api_key=sk-small") as ws:
            for i in range(2):
                await ws.send(orjson.dumps({"type": "generate", "id": f"h{i}", "prompt": "hold"}).decode())
            await until(lambda: len(down.requests) == 2)
            status, headers, got = await post(down, "/v1/chat/completions", chat(max_tokens=5), key="sk-small")
            error_of(status, got, 429, "max_concurrent_requests=2")
            assert headers["retry-after"] == "1"
            await ws.send(orjson.dumps({"type": "generate", "id": "x", "prompt": "more"}).decode())
            err = orjson.loads(await ws.recv())
            assert err["type"] == "error" and err["code"] == "too_many_requests" and "max_concurrent" in err["message"]
            await ws.send(orjson.dumps({"type": "cancel", "id": "h0"}).decode())
            assert orjson.loads(await ws.recv())["finish_reason"] == "abort"
            assert (await post(down, "/v1/chat/completions", chat(max_tokens=5), key="sk-small"))[0] == 200
    run(body())


def test_admission_is_503_with_retry_after_when_no_worker_could_take_the_request_soon(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script, workers=0) as down:
            status, headers, got = await post(down, "/v1/chat/completions", chat(max_tokens=5), key=None)
            error_of(status, got, 503, "no worker is registered")
            assert headers["retry-after"] == "1"
            await down.register(heartbeat("w1", running=8, waiting=8, max_num_seqs=8))   # queue at the watermark
            await until(lambda: "w1" in down.app.state.gateway.admission.cluster.workers)
            status, headers, got = await post(down, "/v1/chat/completions", chat(max_tokens=5), key=None)
            error_of(status, got, 503, "every worker is busy", "QUEUE_WATERMARK")
            assert got["error"]["type"] == "server_error" and headers["retry-after"] == "1"
            await down.drop("w1")
            await down.register(heartbeat("w2", kv_blocks=4, block_size=16))             # idle but small
            await until(lambda: list(down.app.state.gateway.admission.cluster.workers) == ["w2"])
            status, _, got = await post(down, "/v1/chat/completions", chat(max_tokens=100), key=None)
            error_of(status, got, 400, "the largest worker holds 4 blocks")
            assert got["error"]["code"] == "context_length_exceeded"
            assert (await post(down, "/v1/chat/completions", chat(max_tokens=5), key=None))[0] == 200
            async with connect(down.ws) as ws:                       # the websocket is admitted the same way
                await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": "x", "max_tokens": 100}).decode())
                err = orjson.loads(await ws.recv())
                assert err["code"] == "context_length_exceeded" and "KV blocks" in err["message"]
            assert [said(r) for r in down.requests] == ["hi"]
    run(body())


# -- streaming, disconnects, metering ----------------------------------------------------------------

def test_a_client_leaving_a_stream_or_a_waiting_request_cancels_it_in_the_worker(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down:
            for i, stream in enumerate((True, False)):
                client = await post_nowait(down, {"model": "tiny", "prompt": "hold", "stream": stream}, "none")
                await until(lambda n=i + 1: len(down.requests) == n)
                client.close()
                await until(lambda: down.cancelled("abort") == {r.id for r in down.requests})
            records = await usage_records(down.nc, 2)
            assert [u.finish_reason for u in records] == ["abort", "abort"]
    run(body())


def test_every_finished_request_writes_a_usage_record_and_errors_do_not(nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, script, api_keys=keys_file) as down:
            await post(down, "/v1/chat/completions", chat("one"), key="sk-acme")
            await post(down, "/v1/completions", {"model": "tiny", "prompt": "two", "stream": True}, key="sk-globex")
            await post(down, "/v1/chat/completions", chat("fail"), key="sk-acme")
            async with connect(down.ws + "?api_key=sk-acme") as ws:
                await ws.send(orjson.dumps({"type": "generate", "id": "h", "prompt": "hold"}).decode())
                await until(lambda: len(down.requests) == 4)
                await ws.send(orjson.dumps({"type": "cancel", "id": "h"}).decode())
                await ws.recv()
            records = await usage_records(down.nc, 3)
            by_api = {u.api: u for u in records}
            assert sorted(by_api) == ["chat", "completions", "ws"]
            acme = hashlib.sha256(b"sk-acme").hexdigest()[:12]
            n = len(tok.encode(" echo one").ids)
            assert (by_api["chat"].tenant, by_api["chat"].key_id, by_api["chat"].model, by_api["chat"].finish_reason,
                    by_api["chat"].prompt_tokens, by_api["chat"].cached_tokens, by_api["chat"].completion_tokens) == (
                "acme", acme, "tiny", "stop", PROMPT_TOKENS, CACHED, n)
            assert by_api["chat"].timing["e2e_ms"] >= by_api["chat"].timing["ttft_ms"] > 0
            assert (by_api["completions"].tenant, by_api["completions"].key_id) == (
                "globex", hashlib.sha256(b"sk-globex").hexdigest()[:12])
            assert (by_api["ws"].finish_reason, by_api["ws"].completion_tokens) == ("abort", 0)
    run(body())


async def usage_records(nc, n: int) -> list[Usage]:
    sub = await nc.jetstream().subscribe(subjects.USAGE_SUBJECTS, ordered_consumer=True)
    records = [decode((await sub.next_msg(timeout=5)).data, Usage) for _ in range(n)]
    with pytest.raises(Exception):                        # noqa: B017 (nats-py's TimeoutError): no more
        await sub.next_msg(timeout=0.3)
    await sub.unsubscribe()
    return records


def test_the_openapi_document_lists_the_operations(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down:
            status, _, got = await asyncio.to_thread(http, "GET", down.http + "/openapi.json")
            doc = orjson.loads(got)
            assert status == 200 and doc["openapi"].startswith("3.")
            assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= doc["paths"].keys()
            assert doc["paths"]["/v1/chat/completions"]["post"]["responses"]["429"]["headers"]["Retry-After"]
    run(body())


def test_the_openapi_document_has_every_body_field_the_gateway_takes_and_no_other():
    doc = document(["tiny"], 4096)["paths"]
    for api, path in (("chat", "/v1/chat/completions"), ("completions", "/v1/completions")):
        body = doc[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(body["properties"]) == FIELDS[api], path
        assert body["properties"]["speculative"]["type"] == "boolean"


def test_the_chat_page_is_served_at_the_root(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down:
            status, headers, got = await asyncio.to_thread(http, "GET", down.http + "/")
            assert status == 200 and headers["content-type"].startswith("text/html")
            assert b'id="prompt"' in got and b"/ws" in got
    run(body())


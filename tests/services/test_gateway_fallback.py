"""The gateway's fallback upstream (--fallback-url): requests the cluster cannot take (no worker registered,
the bus unreachable, a publish not stored) answered by an OpenAI-compatible upstream in the same format,
metered and limited as the tenant's; keys that may not fall back; the circuit breaker, opening after K
failures, probing after its cooldown, closed by a probe's success and opened again by its failure. The
upstream is a fake (fake_upstream.py), the pipeline the scripted fake of fake_pipeline.py."""
import asyncio
import time

import openai
import orjson
import pytest
from websockets.asyncio.client import connect

import bus
from ops.cli import parser as tokenbus
from ops.procs import free_port, start_nats, stop
from ops.up import FALLBACK, given
from services.gateway import app, keys
from services.gateway.fallback import Breaker, Upstream
from tests.services.fake_pipeline import gateway, said, served
from tests.services.fake_upstream import WORDS, upstream
from tests.services.test_gateway_api import chat, error_of, post, usage_records

KEYS = {"sk-acme": {"tenant": "acme"}, "sk-stay": {"tenant": "stay", "fallback": False},
        "sk-nightly": {"tenant": "night", "class": "batch"}, "sk-small": {"tenant": "small", "tokens_per_minute": 100}}
TEXT = "".join(WORDS)
COOL = 1.0                                        # the breaker's cooldown in these tests, seconds


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


async def metrics(down) -> str:
    return (await post_get(down.http + "/metrics")).decode()


async def post_get(url: str) -> bytes:
    from tests.services.test_gateway_api import http
    return (await asyncio.to_thread(http, "GET", url))[2]


# -- the breaker and the keys file, alone ----------------------------------------------------------

def test_the_breaker_opens_after_k_failures_in_a_row_lets_one_probe_through_after_its_cooldown_and_the_probe_decides():
    b = Breaker(failures=3, cooldown=10)
    for _ in range(2):
        assert b.allow(0) == "closed"
        b.record("closed", False, 0)
    b.record("closed", True, 0)                   # a success in between: the count starts over
    for _ in range(2):
        b.record("closed", False, 0)
    assert b.state == "closed"
    b.record("closed", False, 1)
    assert (b.state, b.allow(5), b.shown(5), b.shown(11)) == ("open", None, "open", "half_open")
    assert b.allow(11) == "half_open" and b.allow(11) is None     # one probe at a time
    b.record("closed", True, 11)                  # a request sent before it opened does not close it
    assert b.state == "half_open"
    b.record("half_open", False, 12)              # the probe failed: open again, for a whole cooldown
    assert (b.state, b.allow(21), b.allow(22)) == ("open", None, "half_open")
    b.release("half_open")                        # a probe whose client left: the next request probes
    assert b.allow(22) == "half_open"
    b.record("half_open", True, 22)
    assert (b.state, b.failed, b.allow(22)) == ("closed", 0, "closed")


def test_a_key_s_fallback_defaults_to_true_false_for_batch_keys_and_a_bad_one_is_named(tmp_path, keys_file):
    loaded = {k.tenant: k.fallback for k in keys.load(keys_file).values()}
    assert loaded == {"acme": True, "stay": False, "night": False, "small": True}
    assert keys.OPEN.fallback                     # no keys file: the flag decides
    path = tmp_path / "bad.json"
    path.write_text('{"sk-x": {"tenant": "a", "fallback": "yes"}}')
    with pytest.raises(ValueError, match=r"fallback must be true or false \(got 'yes'\)"):
        keys.load(path)
    for url in ("host:8000/v1", "ftp://host/v1"):
        with pytest.raises(ValueError, match="--fallback-url"):
            Upstream(url, None, None)


def test_up_passes_the_fallback_flags_to_the_gateway_which_takes_the_upstream_s_key_from_the_environment(
        monkeypatch):
    argv = given(tokenbus().parse_args(["up", "--fallback-url", "http://up:8000/v1", "--fallback-cooldown", "2"]),
                    *FALLBACK)
    assert argv == ["--fallback-url", "http://up:8000/v1", "--fallback-cooldown", "2.0"]
    assert given(tokenbus().parse_args(["up"]), *FALLBACK) == []
    monkeypatch.setenv("TOKENBUS_FALLBACK_KEY", "sk-secret")
    u = app.fallback(app.parser().parse_args(["--model", "m", *argv]))
    assert (u.url, u.key, u.model, u.breaker.failures, u.breaker.cooldown) == (
        "http://up:8000/v1", "sk-secret", None, 5, 2.0)
    assert app.fallback(app.parser().parse_args(["--model", "m"])) is None
    with pytest.raises(SystemExit, match="gateway: --fallback-url 'up:8000': expected the upstream's base URL"):
        app.main(["--model", "m", "--fallback-url", "up:8000"])


# -- answered by the fallback ------------------------------------------------------------------------

def test_with_no_worker_registered_the_openai_client_is_answered_by_the_fallback_streamed_and_not_and_metered(
        nats_url, tiny_model, tok, keys_file):
    with upstream() as up, served(nats_url, tiny_model, tok, api_keys=keys_file, workers=0,
                                  upstream=Upstream(up.url, "sk-upstream", "up-model")) as down:
        client = openai.OpenAI(api_key="sk-acme", base_url=down.http + "/v1", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, extra_body={"priority": 3})
        assert raw.headers["x-tokenbus-fallback"] == "1"
        whole = raw.parse()
        assert whole.choices[0].message.content == TEXT and whole.choices[0].finish_reason == "stop"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (7, 3)

        plain = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in plain) == TEXT
        assert all(c.choices and c.usage is None for c in plain)     # no usage chunk: the client did not ask
        counted = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      stream=True, stream_options={"include_usage": True}))
        assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == 3

        text = client.completions.create(model="tiny", prompt="say")
        assert text.choices[0].text == TEXT
        streamed = list(client.completions.create(model="tiny", prompt="say", stream=True))
        assert "".join(c.choices[0].text for c in streamed) == TEXT

        sent = up.requests
        assert [r["model"] for r in sent] == ["up-model"] * 5
        assert {r["authorization"] for r in sent} == {"Bearer sk-upstream"}
        assert [r.get("max_tokens") for r in sent] == [20, 4096, 4096, 16, 16]     # what admission charged
        assert [bool(r.get("stream")) for r in sent] == [False, True, True, False, True]
        assert all(r["stream_options"]["include_usage"] for r in sent if r.get("stream"))
        assert all("priority" not in r for r in sent)                  # this cluster's scheduling stays here

        records = down.call(usage_records(down.nc, 5))
        assert {(u.fallback, u.model, u.tenant, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                 u.finish_reason) for u in records} == {(True, "up-model", "acme", 7, 2, 3, "stop")}
        assert sorted(u.api for u in records) == ["chat", "chat", "chat", "completions", "completions"]
        gw = down.app.state.gateway
        assert gw.admission.tenants["acme"].active == 0
        shown = down.call(metrics(down))
        assert 'tokenbus_fallback_requests_total{outcome="ok",tenant="acme"} 5.0' in shown
        assert 'tokenbus_fallback_breaker_state{state="closed"} 1.0' in shown


def test_keys_that_may_not_fall_back_get_the_503_and_the_tenant_s_limits_still_apply(
        nats_url, tiny_model, tok, keys_file):
    async def body():
        with upstream() as up:
            async with gateway(nats_url, tiny_model, tok, api_keys=keys_file, workers=0,
                               upstream=Upstream(up.url, None, None)) as down:
                for key in ("sk-stay", "sk-nightly"):
                    status, h, got = await post(down, "/v1/chat/completions", chat(), key=key)
                    error_of(status, got, 503, "no worker is registered")
                    assert "x-tokenbus-fallback" not in h
                assert up.requests == []
                # tokens_per_minute=100: a charge of prompt + 60 passes twice only because the first is
                # settled with the upstream's 10 tokens; one of 95 does not (429, not a fallback)
                for _ in range(2):
                    status, h, got = await post(down, "/v1/chat/completions", chat(max_tokens=60), key="sk-small")
                    assert status == 200 and h["x-tokenbus-fallback"] == "1", got
                status, h, got = await post(down, "/v1/chat/completions", chat(max_tokens=95), key="sk-small")
                error_of(status, got, 429, "tokens_per_minute=100")
                status, h, got = await post(down, "/v1/chat/completions", chat(max_tokens=200), key="sk-small")
                error_of(status, got, 400, "tokens_per_minute=100")
                assert len(up.requests) == 2
    run(body())


def test_the_upstream_s_refusals_and_a_stream_it_cuts_are_clear_errors_that_do_not_open_the_breaker(
        nats_url, tiny_model, tok):
    async def body():
        with upstream() as up:
            async with gateway(nats_url, tiny_model, tok, workers=0,
                               upstream=Upstream(up.url, None, None, failures=2, cooldown=60)) as down:
                up.status = 400
                status, _, got = await post(down, "/v1/chat/completions", chat(), key=None)
                error_of(status, got, 400, "the fallback upstream refused the request (HTTP 400): told to fail")
                assert (got["error"]["code"], got["error"]["param"]) == ("told_to", "temperature")
                up.status = 401
                for _ in range(2):
                    status, _, got = await post(down, "/v1/chat/completions", chat(), key=None)
                    error_of(status, got, 502, "refused the gateway's key", "--fallback-key-env")
                assert down.app.state.gateway.upstream.breaker.state == "closed"     # 4xx: the upstream is up
                up.status, up.cut = 200, True
                status, h, got = await post(down, "/v1/chat/completions", chat(stream=True), key=None)
                assert status == 200 and h["x-tokenbus-fallback"] == "1"
                events = [e.removeprefix(b"data: ") for e in got.split(b"\n\n") if e]
                assert orjson.loads(events[1])["choices"][0]["delta"]["content"] == WORDS[0]
                error = orjson.loads(events[-1])["error"]
                assert error["code"] == "fallback_failed" and "ended before [DONE]" in error["message"]
                assert down.app.state.gateway.admission.tenants["default"].active == 0
                with pytest.raises(Exception):     # noqa: B017 (nats-py's TimeoutError): failures write no record
                    await usage_records(down.nc, 1)
    run(body())


# -- the circuit breaker, end to end -----------------------------------------------------------------

@pytest.mark.serial
def test_k_failures_open_the_breaker_then_503s_come_at_once_and_a_probe_after_the_cooldown_closes_or_reopens_it(
        nats_url, tiny_model, tok):
    async def ask(down, stream=False):
        t = time.perf_counter()
        status, h, got = await post(down, "/v1/chat/completions", chat(stream=stream), key=None)
        return status, h, got, time.perf_counter() - t

    async def state(down) -> str:
        lines = [x for x in (await metrics(down)).splitlines() if x.startswith("tokenbus_fallback_breaker_state")]
        return next(x.split('"')[1] for x in lines if x.endswith(" 1.0"))

    async def body():
        with upstream() as up:
            async with gateway(nats_url, tiny_model, tok, workers=0,
                               upstream=Upstream(up.url, None, None, failures=2, cooldown=COOL)) as down:
                up.status = 500
                for _ in range(2):
                    status, h, got, _ = await ask(down)
                    error_of(status, got, 503, "no worker is registered",
                             "the fallback upstream failed too: HTTP 500: told to fail with 500")
                    assert got["error"]["code"] == "unavailable" and h["retry-after"]
                assert await state(down) == "open"
                status, _, got, took = await ask(down)            # open: the cluster's 503, the upstream untouched
                error_of(status, got, 503, "no worker is registered", "circuit breaker", "--fallback-cooldown")
                assert len(up.requests) == 2 and took < COOL

                await asyncio.sleep(COOL)
                assert await state(down) == "half_open"
                up.status, up.hang = 200, True
                probe = asyncio.create_task(ask(down, stream=True))
                while len(up.requests) < 3:
                    await asyncio.sleep(0.02)
                status, _, got, _ = await ask(down)                # one probe at a time
                error_of(status, got, 503, "circuit breaker")
                up.hang = False
                status, h, got, _ = await probe
                assert status == 200 and b"[DONE]" in got
                assert await state(down) == "closed" and (await ask(down))[0] == 200

                up.status = 500
                for _ in range(2):
                    assert (await ask(down))[0] == 503
                await asyncio.sleep(COOL)
                n = len(up.requests)
                status, _, got, _ = await ask(down)                # the probe fails: open again
                error_of(status, got, 503, "failed too: HTTP 500")
                status, _, got, _ = await ask(down)
                error_of(status, got, 503, "circuit breaker")
                assert len(up.requests) == n + 1 and await state(down) == "open"
                shown = await metrics(down)
                assert 'tokenbus_fallback_requests_total{outcome="failed",tenant="default"} 5.0' in shown
                assert 'tokenbus_fallback_requests_total{outcome="open",tenant="default"} 3.0' in shown
                assert 'tokenbus_fallback_requests_total{outcome="ok",tenant="default"} 2.0' in shown
    run(body())


# -- the bus unreachable -------------------------------------------------------------------------------

@pytest.mark.serial
def test_with_the_nats_server_gone_a_request_is_answered_by_the_fallback_at_once(tiny_model, tok, tmp_path):
    async def body(nats_url, proc):
        with upstream() as up:
            async with gateway(nats_url, tiny_model, tok, upstream=Upstream(up.url, None, None)) as down:
                assert (await post(down, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=None))[0] == 200
                assert up.requests == []                     # a worker is registered: the cluster answered
                stop([proc])
                gw = down.app.state.gateway
                while gw.nc.is_connected:
                    await asyncio.sleep(0.05)
                t = time.perf_counter()
                status, h, got = await post(down, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=None)
                assert status == 200 and h["x-tokenbus-fallback"] == "1" and got["choices"][0]["text"] == TEXT
                assert time.perf_counter() - t < 5 and len(up.requests) == 1

    port = free_port()
    proc = start_nats(port, tmp_path / "nats")
    try:
        run(body(f"nats://127.0.0.1:{port}", proc))
    finally:
        stop([proc])


def test_a_request_whose_publish_is_not_stored_goes_to_the_fallback_and_a_cancel_follows_it(
        nats_url, tiny_model, tok, monkeypatch):
    real = bus.publish

    async def refusing(js, subject, *args, **kw):
        if subject.startswith("tb.req.new."):
            raise bus.NotStored(f"{subject}: refused by the stream: told to")
        return await real(js, subject, *args, **kw)

    monkeypatch.setattr(bus, "publish", refusing)

    async def body():
        with upstream() as up:
            async with gateway(nats_url, tiny_model, tok, upstream=Upstream(up.url, None, None)) as down:
                status, h, got = await post(down, "/v1/chat/completions", chat(), key=None)
                assert status == 200 and h["x-tokenbus-fallback"] == "1", got
                assert got["choices"][0]["message"]["content"] == TEXT
                while not down.cancels:
                    await asyncio.sleep(0.02)
                assert down.requests == [] and len(up.requests) == 1
                [record] = await usage_records(down.nc, 1)
                assert record.fallback and record.id == down.cancels[0].id
    run(body())


# -- the websocket ---------------------------------------------------------------------------------------

def test_a_websocket_generate_is_answered_by_the_fallback_as_delta_and_done_frames_and_a_cancel_stops_it(
        nats_url, tiny_model, tok):
    async def frames_of(ws, cid: str) -> list[dict]:
        got = []
        while not got or got[-1]["type"] not in ("done", "error"):
            f = orjson.loads(await ws.recv())
            assert f["id"] == cid, f
            got.append(f)
        return got

    async def body():
        with upstream() as up:
            async with gateway(nats_url, tiny_model, tok, workers=0,
                               upstream=Upstream(up.url, None, "up-model")) as down:
                async with connect(down.ws) as ws:
                    await ws.send(orjson.dumps({"type": "generate", "id": "a", "max_tokens": 12, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hi"}]}).decode())
                    got = await frames_of(ws, "a")
                    assert [f["text"] for f in got[:-1]] == WORDS and all(f["token_ids"] == [] for f in got[:-1])
                    assert got[-1]["fallback"] and got[-1]["finish_reason"] == "stop"
                    assert got[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}
                    await ws.send(orjson.dumps({"type": "generate", "id": "b", "prompt_token_ids": [5, 6]}).decode())
                    assert "".join(f.get("text", "") for f in await frames_of(ws, "b")) == TEXT
                    asked = [(r.get("messages", r.get("prompt")), r["max_tokens"], r.get("temperature"))
                             for r in up.requests]
                    assert asked == [([{"role": "user", "content": "hi"}], 12, 0), ([5, 6], 16, None)]     # its default

                    up.hang = True
                    await ws.send(orjson.dumps({"type": "generate", "id": "c", "prompt": "wait"}).decode())
                    while len(up.requests) < 3:
                        await asyncio.sleep(0.02)
                    await ws.send(orjson.dumps({"type": "cancel", "id": "c"}).decode())
                    got = await frames_of(ws, "c")
                    assert got[-1]["finish_reason"] == "abort" and got[-1]["fallback"]
                    up.hang = False
                records = await usage_records(down.nc, 2)          # the cancelled one got nothing: no record
                assert {(u.api, u.fallback, u.model) for u in records} == {("ws", True, "up-model")}
                assert down.app.state.gateway.admission.tenants["default"].active == 0
    run(body())


def test_a_second_tokenbus_gateway_serves_as_the_fallback_of_one_with_no_worker(nats_url, tiny_model, tok, tmp_path):
    """The upstream is tokenbus's own HTTP API (which refuses any parameter it does not know) before a
    second pipeline on a nats-server of its own."""
    async def body(other_nats):
        async with gateway(other_nats, tiny_model, tok) as second, gateway(
                nats_url, tiny_model, tok, workers=0, upstream=Upstream(second.http + "/v1", None, None)) as first:
            status, h, got = await post(first, "/v1/chat/completions", chat("one", priority=2), key=None)
            assert status == 200 and h["x-tokenbus-fallback"] == "1", got
            assert got["choices"][0]["message"]["content"] == " echo one"
            status, h, got = await post(first, "/v1/completions", {"model": "tiny", "prompt": "two", "stream": True},
                                        key=None)
            events = [orjson.loads(e.removeprefix(b"data: ")) for e in got.split(b"\n\n") if e.startswith(b"data: {")]
            assert "".join(e["choices"][0]["text"] for e in events) == " echo two"
            assert all("usage" not in e for e in events)
            [u1, u2] = await usage_records(first.nc, 2)
            n = len(tok.encode(" echo two").ids)
            assert (u1.fallback, u2.fallback, u2.completion_tokens) == (True, True, n)
            assert [said(r) for r in second.requests] == ["one", "two"]

    port = free_port()
    proc = start_nats(port, tmp_path / "second")
    try:
        run(body(f"nats://127.0.0.1:{port}"))
    finally:
        stop([proc])

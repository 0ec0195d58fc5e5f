"""The gateway against a real nats-server and a real uvicorn, with the rest of the pipeline played by a
scripted fake (Downstream) that answers with token ids of the tiny model's tokenizer."""
import asyncio
import contextlib
import signal
import subprocess
import time

import orjson
from websockets.asyncio.client import connect

import bus
from ops.procs import free_port, python_module
from schemas import subjects
from schemas.messages import Cancel, ErrorChunk, GenerateRequest, Heartbeat, decode, encode
from schemas.subjects import MAX_INFLIGHT_PER_CONNECTION, MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_STOP
from services.gateway.app import Ws
from tests.e2e.conftest import get
from tests.services.fake_pipeline import PROMPT_TOKENS, gateway, said


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


async def send(ws, frame) -> None:
    await ws.send(frame if isinstance(frame, str | bytes) else orjson.dumps(frame).decode())


async def recv(ws) -> dict:
    return orjson.loads(await asyncio.wait_for(ws.recv(), 5))


async def collect(ws, *ids: str) -> dict[str, list[dict]]:
    """Every frame of the given requests, until each has its done or error frame."""
    got, left = {i: [] for i in ids}, set(ids)
    while left:
        f = await recv(ws)
        assert f["id"] in got, f
        got[f["id"]].append(f)
        if f["type"] in ("done", "error"):
            left.discard(f["id"])
    return got


def text(frames: list[dict]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "delta")


def tokens(frames: list[dict]) -> list[int]:
    return [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]


async def until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def generate(id: str, prompt: str = "hi", **kw) -> dict:
    return {"type": "generate", "id": id, "prompt": prompt, **kw}


# -- streaming ------------------------------------------------------------------------------------

def test_concurrent_generates_on_one_connection_each_stream_their_text_and_done(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down, connect(down.ws) as ws:
            await send(ws, {"type": "generate", "id": "m", "messages": [{"role": "user", "content": "first one"}],
                            "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 7, "stop": ["\n\n"],
                            "ignore_eos": False})
            await send(ws, generate("p", "second prompt", top_k=5, min_p=0.1, repetition_penalty=1.1,
                                    speculative=False))
            await send(ws, {"type": "generate", "id": "t", "prompt_token_ids": [5, 6, 7], "stop_token_ids": [9]})
            got = await collect(ws, "m", "p", "t")
            for cid, said_ in [("m", "first one"), ("p", "second prompt"), ("t", "3 tokens")]:
                frames, expected = got[cid], f" echo {said_}"
                assert text(frames) == expected and tokens(frames) == down.ids(expected)
                done = frames[-1]
                assert done["type"] == "done" and done["finish_reason"] == "length"
                assert done["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(down.ids(expected))}
                assert 0 < done["timing"]["ttft_ms"] <= done["timing"]["e2e_ms"]
            by_said = {said(r): r for r in down.requests}
            m = by_said["first one"]
            assert m.tenant == m.cache_salt == "default" and len(m.id) == 32 and m.created > 0
            assert (m.sampling.max_tokens, m.sampling.temperature, m.sampling.top_p, m.sampling.seed,
                    m.sampling.stop, m.sampling.speculative) == (64, 0.7, 0.9, 7, ("\n\n",), True)
            p = by_said["second prompt"].sampling
            assert (p.top_k, p.min_p, p.repetition_penalty, p.speculative) == (5, 0.1, 1.1, False)
            assert by_said["3 tokens"].prompt_token_ids == [5, 6, 7]
            assert by_said["3 tokens"].sampling.stop_token_ids == (9,)
            assert len({r.id for r in down.requests}) == 3
    run(body())


def test_a_burst_of_frames_goes_out_in_few_socket_writes_whole_and_in_order(nats_url, tiny_model, tok, monkeypatch):
    """A worker step publishes a chunk of every stream at once: the gateway writes such a burst in one
    socket write (Ws), and a plain websockets client still reads every frame, in order."""
    writes: list[int] = []                                      # frames per socket write
    flush = Ws.flush

    def counting(self):
        if self.outbox:
            writes.append(len(self.outbox))
        flush(self)
    monkeypatch.setattr(Ws, "flush", counting)
    n, streams = 30, 4

    async def burst(down, req):
        ids = (down.ids(" one two three four five six seven eight nine ten") * 3)[:n]
        for i in range(n - 1):
            await down.publish(req.id, down.chunk(req.id, i, [ids[i]]))      # no pause: one burst
        await down.publish(req.id, down.final(req.id, n - 1, ids[-1:]))

    async def body():
        async with gateway(nats_url, tiny_model, tok, script=burst) as down, connect(down.ws) as ws:
            for i in range(streams):
                await send(ws, generate(str(i), max_tokens=n))
            got = await collect(ws, *map(str, range(streams)))
            expected = (down.ids(" one two three four five six seven eight nine ten") * 3)[:n]
            for frames in got.values():
                assert tokens(frames) == expected and frames[-1]["type"] == "done"
                assert [f["type"] for f in frames[:-1]] == ["delta"] * (len(frames) - 1)
            return sum(len(f) for f in got.values())

    frames = asyncio.run(asyncio.wait_for(body(), 20))
    assert sum(writes) == frames                                # every frame was written, once
    assert len(writes) < frames / 3 and max(writes) >= n / 2, writes


def test_duplicate_and_overlapping_chunks_are_dropped(nats_url, tiny_model, tok):
    async def script(down, req):
        ids = down.ids(" Hello world and more")
        await down.publish(req.id, down.chunk(req.id, 0, ids[0:2]), down.chunk(req.id, 0, ids[0:2]),
                           down.chunk(req.id, 1, ids[1:4]), down.chunk(req.id, 2, ids[2:3]),
                           down.final(req.id, 4, ids[4:]), down.final(req.id, 4, ids[4:]))

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            await send(ws, generate("r"))
            frames = (await collect(ws, "r"))["r"]
            assert text(frames) == " Hello world and more" and tokens(frames) == down.ids(" Hello world and more")
            assert [len(f["token_ids"]) for f in frames[:-1]] == [2, 2, 1]   # only the new tokens of each chunk
            assert frames[-1]["finish_reason"] == "length"
    run(body())


def test_a_utf8_character_split_across_tokens_is_never_sent_half(nats_url, tiny_model, tok):
    reply = " café 😀 ok"

    async def script(down, req):
        await down.reply(req, reply)

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            assert len(down.ids("😀")) == 4 and len(down.ids("é")) == 2    # the characters are byte tokens
            await send(ws, generate("r"))
            frames = (await collect(ws, "r"))["r"]
            deltas = [f for f in frames if f["type"] == "delta"]
            assert text(frames) == reply and not any("\ufffd" in f["text"] for f in deltas)
            assert [f["text"] for f in deltas].count("") == 4          # 1 byte of é, 3 of 😀 waited for the rest
            assert "😀" in [f["text"] for f in deltas]
    run(body())


def test_a_stop_string_ends_the_request_with_stop_and_cancels_the_worker(nats_url, tiny_model, tok):
    async def script(down, req):
        if said(req) == "stop":
            ids = down.ids(" Hello world and more")
            await down.publish(req.id, *(down.chunk(req.id, i, [t]) for i, t in enumerate(ids)))
        else:
            await down.echo(req)

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            await send(ws, generate("r", "stop", stop=["world"]))
            frames = (await collect(ws, "r"))["r"]
            assert text(frames) == " Hello " and frames[-1]["finish_reason"] == "stop"
            assert frames[-1]["usage"]["completion_tokens"] == 3
            await until(lambda: down.cancelled("stop") == {down.requests[0].id})
            await send(ws, generate("next"))                     # nothing more of "r" comes
            assert {f["id"] for f in (await collect(ws, "next"))["next"]} == {"next"}
    run(body())


def test_an_error_chunk_from_the_pipeline_becomes_an_error_frame_with_its_code(nats_url, tiny_model, tok):
    async def script(down, req):
        await down.publish(req.id, ErrorChunk(req.id, "invalid_request", "prompt has 5000 tokens; max_model_len=4096"))

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            await send(ws, generate("r"))
            assert (await collect(ws, "r"))["r"] == [{"type": "error", "id": "r", "code": "invalid_request",
                                                    "message": "prompt has 5000 tokens; max_model_len=4096"}]
    run(body())


def test_bad_messages_on_the_out_subject_are_logged_and_the_request_still_completes(nats_url, tiny_model, tok, capfd):
    async def script(down, req):
        await down.publish(req.id, b"\xc1 not msgpack", Cancel(req.id), down.chunk("someone-else", 0, [5]))
        await down.reply(req, " fine")

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            await send(ws, generate("r"))
            frames = (await collect(ws, "r"))["r"]
            assert text(frames) == " fine" and frames[-1]["type"] == "done"
    run(body())
    err = capfd.readouterr().err
    assert err.count('"bad chunk dropped"') == 2 and "not msgpack" in err and "'cancel' is not one of" in err
    assert '"chunk of another request dropped"' in err


# -- cancel and disconnect ------------------------------------------------------------------------

def test_a_cancel_frame_ends_the_request_with_abort_and_cancels_the_worker(nats_url, tiny_model, tok):
    async def script(down, req):
        if said(req) == "again":
            await down.echo(req)
        else:
            await down.publish(req.id, down.chunk(req.id, 0, down.ids(" Hello")))   # then nothing: a long generation

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            await send(ws, generate("r"))
            assert (await recv(ws))["type"] == "delta"
            await send(ws, {"type": "cancel", "id": "r"})
            done = await recv(ws)
            assert done["type"] == "done" and done["finish_reason"] == "abort"
            assert done["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(down.ids(" Hello"))}
            await until(lambda: down.cancelled("abort") == {down.requests[0].id})
            await send(ws, generate("r", "again"))              # the id is free again
            assert text((await collect(ws, "r"))["r"]) == " echo again"
    run(body())


def test_a_client_disconnect_cancels_every_request_it_had_in_flight(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down:
            async with connect(down.ws) as ws:
                for i in range(3):
                    await send(ws, generate(f"h{i}", "hold"))
                await send(ws, generate("quick"))
                await collect(ws, "quick")
                await until(lambda: len(down.requests) == 4)
            held = {r.id for r in down.requests if said(r) == "hold"}
            await until(lambda: down.cancelled("abort") == held)
    run(body())


# -- malformed frames -----------------------------------------------------------------------------

def msgs(n: int) -> list[dict]:
    return [{"role": "user", "content": "x"}] * n


MALFORMED = [  # (frame, what the error message names, the id the error frame carries)
    (b"\x00\x01", "binary frame", None),
    ("{not json", "not valid JSON", None),
    ("[1, 2]", "a frame is a JSON object, got an array", None),
    ({"type": "launch", "id": "a"}, "type: must be one of generate, cancel, resume (got 'launch')", "a"),
    ({"id": "a", "prompt": "x"}, "type: must be one of generate, cancel, resume (got missing)", "a"),
    ({"type": "generate", "prompt": "x"}, "id: missing", None),
    ({"type": "generate", "id": 7, "prompt": "x"}, "id: expected a string, got an integer", None),
    ({"type": "generate", "id": "", "prompt": "x"}, "id: must be 1 to MAX_ID_CHARS=256 characters", None),
    (generate("a", colour="red"), "colour: unknown field in a generate frame", "a"),
    ({"type": "cancel", "id": "a", "prompt": "x"}, "prompt: unknown field in a cancel frame", "a"),
    (generate("a", max_tokens="9"), "max_tokens: expected an integer, got a string", "a"),
    (generate("a", temperature=True), "temperature: expected a number, got a boolean", "a"),
    (generate("a", stop=[1]), "stop[0]: expected a string, got an integer", "a"),
    (generate("a", stop=5), "stop: expected a string or an array of strings, got an integer", "a"),
    (generate("a", stop_token_ids=[1, "x"]), "stop_token_ids[1]: expected an integer, got a string", "a"),
    (generate("a", ignore_eos="yes"), "ignore_eos: expected true or false, got a string", "a"),
    (generate("a", speculative=0), "speculative: expected true or false, got an integer", "a"),
    (generate("a", 5), "prompt: expected a string, got an integer", "a"),
    ({"type": "generate", "id": "a", "messages": "hi"}, "messages: expected a non-empty array", "a"),
    ({"type": "generate", "id": "a", "messages": [{"role": "user"}]}, "messages[0].content: missing", "a"),
    ({"type": "generate", "id": "a", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content: expected a string, got an integer", "a"),
    ({"type": "generate", "id": "a", "prompt_token_ids": [1, 2.5]},
     "prompt_token_ids[1]: expected an integer, got a float", "a"),
    ({"type": "generate", "id": "a", "prompt_token_ids": "12"}, "prompt_token_ids: expected an array of integers", "a"),
    (generate("a", seed=7.0), "seed: expected an integer, got a float", "a"),
    ({"type": "generate", "id": "a", "prompt": "x", "messages": msgs(1)}, "exactly one of messages, prompt", "a"),
    ({"type": "generate", "id": "a"}, "exactly one of messages, prompt, prompt_token_ids is needed (got none)", "a"),
    (generate("a", temperature=-1), "temperature must be 0 (greedy) or in [1e-05, 100.0]", "a"),
    (generate("a", top_p=0), "top_p must be in (0, 1]", "a"),
    (generate("a", max_tokens=0), "max_tokens must be in [1, 1048576]", "a"),
    (generate("a", seed=-1), "seed must be in [0, 2**64)", "a"),
    (generate("a", top_k=2**64 - 1), "top_k must be in [1, 1048576], or 0 / -1 to disable", "a"),
    (generate("a", max_tokens=2**64 - 1), "max_tokens must be in [1, 1048576]", "a"),
    (generate("a", temperature=1e308), "temperature must be 0 (greedy) or in", "a"),
    (generate("a", temperature=1e-300), "temperature must be 0 (greedy) or in", "a"),
    (generate("a", repetition_penalty=1e308), "repetition_penalty must be in [0.01, 100.0]", "a"),
    (generate("a", stop_token_ids=[2**64 - 1]), "stop_token_ids must be token ids in [0, 2147483647]", "a"),
    (generate("a", stop_token_ids=list(range(300))), "MAX_STOP_TOKEN_IDS=256", "a"),
    (generate("a", stop=["x" * 2000]), "MAX_STOP_CHARS=1024", "a"),
    ({"type": "generate", "id": "a", "prompt_token_ids": [1, 2**64 - 1]},
     "prompt_token_ids[1]: 18446744073709551615 is not a token id in [0, 2147483647]", "a"),
    ({"type": "generate", "id": "a", "messages": msgs(MAX_MESSAGES + 1)},
     f"messages: {MAX_MESSAGES + 1} messages is more than MAX_MESSAGES={MAX_MESSAGES}", "a"),
    (generate("a", "x" * (MAX_PROMPT_CHARS + 1)),
     f"prompt: {MAX_PROMPT_CHARS + 1} characters is more than MAX_PROMPT_CHARS={MAX_PROMPT_CHARS}", "a"),
    (generate("a", stop=["s"] * (MAX_STOP + 1)), f"stop: {MAX_STOP + 1} stop strings is more than MAX_STOP", "a"),
    ({"type": "cancel", "id": "nope"}, "id: no request 'nope' is in flight", "nope"),
    (generate("held", "hold"), "id: 'held' is already in flight", None),  # after the first "held" below
]


def test_each_malformed_frame_gets_an_error_naming_the_field_and_the_connection_keeps_working(
        nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down, connect(down.ws) as ws:
            await send(ws, generate("held", "hold"))
            for frame, message, cid in MALFORMED:
                await send(ws, frame)
                err = await recv(ws)
                assert err["type"] == "error" and err["code"] == "invalid_request", (frame, err)
                assert message in err["message"] and err["id"] == cid, (message, err)
            await send(ws, generate("ok", "still works"))
            assert text((await collect(ws, "ok"))["ok"]) == " echo still works"
            assert sorted(said(r) for r in down.requests) == ["hold", "still works"]  # nothing malformed got through
    run(body())


def test_more_than_max_inflight_requests_on_one_connection_is_refused_naming_the_limit(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down, connect(down.ws) as ws:
            for i in range(MAX_INFLIGHT_PER_CONNECTION):
                await send(ws, generate(f"h{i}", "hold"))
            await send(ws, generate("one-more"))
            err = await recv(ws)
            assert err["code"] == "too_many_requests" and err["id"] == "one-more"
            assert f"MAX_INFLIGHT_PER_CONNECTION={MAX_INFLIGHT_PER_CONNECTION}" in err["message"]
            await send(ws, {"type": "cancel", "id": "h0"})
            assert (await recv(ws))["finish_reason"] == "abort"
            await send(ws, generate("one-more"))
            assert text((await collect(ws, "one-more"))["one-more"]) == " echo hi"
    run(body())


# -- NATS side ------------------------------------------------------------------------------------

def test_generate_request_is_stored_in_tb_requests_with_the_request_id_as_msg_id(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok) as down, connect(down.ws) as ws:
            await send(ws, {"type": "generate", "id": "r", "messages": [{"role": "user", "content": "store me"}]})
            await collect(ws, "r")
            stored = await down.nc.jetstream().get_last_msg(subjects.REQUESTS_STREAM,
                                                            subjects.request_new("default", down.requests[0].id))
            req = decode(stored.data, GenerateRequest)
            assert stored.headers["Nats-Msg-Id"] == req.id == down.requests[0].id
            assert req.messages == [{"role": "user", "content": "store me"}]
    run(body())


def test_a_request_the_stream_refuses_gets_an_unavailable_error(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, requests=False) as down, connect(down.ws) as ws:
            js = down.nc.jetstream()
            await js.delete_stream(subjects.REQUESTS_STREAM)
            await js.add_stream(name=subjects.REQUESTS_STREAM, subjects=[subjects.REQUESTS_SUBJECTS], max_msg_size=16)
            await send(ws, generate("r"))
            err = await recv(ws)
            assert err["type"] == "error" and err["id"] == "r" and err["code"] == "unavailable"
            assert "TB_REQUESTS" in err["message"]
    run(body())


def test_a_request_whose_stream_was_deleted_is_stored_in_the_stream_made_again(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, requests=False) as down, connect(down.ws) as ws:
            js = down.nc.jetstream()
            await js.delete_stream(subjects.REQUESTS_STREAM)
            await send(ws, generate("r"))
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(Exception):
                    if (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages == 1:
                        break
                assert time.monotonic() < deadline, "the request was not stored"
                await asyncio.sleep(0.1)
    run(body())


def test_a_refusal_on_the_websocket_says_when_to_retry_like_http_retry_after(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, workers=0) as down, connect(down.ws) as ws:
            await send(ws, generate("r"))
            err = await recv(ws)
            assert (err["type"], err["id"], err["code"], err["retry_after"]) == ("error", "r", "unavailable", 1)
            await send(ws, {"type": "generate", "id": "bad", "prompt": "x", "max_tokens": 0})
            assert "retry_after" not in await recv(ws)          # a bad field: retrying will not help
    run(body())


def test_healthz_is_503_without_workers_and_200_once_a_heartbeat_is_registered(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, workers=0) as down:
            assert await asyncio.to_thread(get, down.http + "/healthz") == (
                503, {"status": "unavailable", "workers": 0})
            kv = await bus.registry(down.nc.jetstream())
            await kv.put("w1", encode(Heartbeat("w1", time.time(), "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0)))
            assert await asyncio.to_thread(get, down.http + "/healthz") == (200, {"status": "ok", "workers": 1})
    run(body())


def test_python_m_services_gateway_serves_and_exits_cleanly_on_sigterm(nats_url, tiny_model):
    port = free_port()
    p = subprocess.Popen(python_module("services.gateway", "--nats-url", nats_url, "--model", tiny_model,
                                       "--port", str(port)), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError):
                assert get(f"http://127.0.0.1:{port}/healthz")[0] == 503
                break
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        assert '"gateway stopped"' in p.stderr.read()
    finally:
        p.kill()

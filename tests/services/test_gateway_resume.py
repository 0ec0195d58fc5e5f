"""Resumable streams against real gateways (two, in the test's event loop) and a real nats-server, the
rest of the pipeline played by a fake worker that streams TEXT a token at a time, answers Resend with
what it published and stores the end record, as workers do. A client whose connection dropped resumes
on the same gateway or another, over the websocket (a plain websockets client) and over SSE
(urllib, then the openai client with Last-Event-ID), and what it ends with is exactly an
uninterrupted run: the same tokens, and text deltas that concatenate to the same text through
multi-byte characters split across tokens and text held back for a stop string."""
import asyncio
import contextlib
import time
import urllib.error
import urllib.request

import openai
import orjson
import pytest
from websockets.asyncio.client import connect

import bus
from schemas import subjects
from schemas.messages import GenerateRequest, Usage, decode, encode
from schemas.sampling import SamplingParams
from tests.e2e.conftest import text, tokens
from tests.services.fake_pipeline import gateway, said
from text.detokenizer import Detokenizer

TEXT = " Héllo wörld 🙂 and more words xyz end"   # é, ö and 🙂 are split across tokens
STOP = "a stop that never comes"                  # the gateway holds back len(STOP) - 1 characters
PACE = 0.05                                       # seconds between the fake worker's tokens
KEYS = {"sk-acme": {"tenant": "acme"}, "sk-globex": {"tenant": "globex"}}


def run(coro, timeout: float = 30) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


async def worker(down, req) -> None:
    """TEXT a token every PACE seconds, as a worker streams it ("hold": one token, then nothing for an hour;
    "gone": nothing, a request that ended long ago)."""
    if said(req) != "gone":
        await down.stream(req, TEXT, PACE if said(req) != "hold" else 3600)


def generate(cid: str, prompt: str = "hi", **kw) -> dict:
    return {"type": "generate", "id": cid, "prompt": prompt, "max_tokens": 64, "stop": [STOP], "resumable": True,
            **kw}


async def send(ws, frame: dict) -> None:
    await ws.send(orjson.dumps(frame).decode())


async def recv(ws) -> dict:
    return orjson.loads(await asyncio.wait_for(ws.recv(), 10))


async def until_end(ws, cid: str) -> list[dict]:
    got = []
    while not got or got[-1]["type"] not in ("done", "error"):
        f = await recv(ws)
        assert f["id"] == cid, f
        got.append(f)
    return got



async def started(ws, cid: str, n: int) -> tuple[str, list[dict]]:
    """Sends a resumable generate; its resume id and its frames until n tokens came."""
    await send(ws, generate(cid))
    accepted = await recv(ws)
    assert accepted["type"] == "accepted" and accepted["id"] == cid, accepted
    frames = []
    while len(tokens(frames)) < n:
        frames.append(await recv(ws))
        assert frames[-1]["type"] == "delta", frames[-1]
    return accepted["resume_id"], frames


def drop(ws) -> None:
    """The connection is cut: no close frame, as a crash or a network blip leaves it."""
    ws.transport.abort()


async def until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def post(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, orjson.dumps(body) if body is not None else b"",
                                 {"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def read_until(url: str, body: dict, n: int) -> tuple[str, str, list[int]]:
    """Reads an SSE stream until its events' ids say n tokens came, then leaves: the text so far, the last
    event id and the offsets of the ids seen."""
    req = urllib.request.Request(url, orjson.dumps(body), {"content-type": "application/json"})
    text, last, offsets = "", "", []
    with urllib.request.urlopen(req, timeout=10) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                last = line[4:]
                offsets.append(int(last.rsplit(".", 1)[1]))
            elif line.startswith("data: {"):
                text += "".join(c["text"] for c in orjson.loads(line[6:])["choices"])
                if offsets[-1] >= n:
                    break                                  # the client is cut off here
    return text, last, offsets


async def usage_of(nc, rid: str) -> list[Usage]:
    """The usage records of request rid in TB_USAGE."""
    js, out = nc.jetstream(), []
    if (await js.stream_info(subjects.USAGE_STREAM)).state.messages:
        sub = await js.subscribe(subjects.USAGE_SUBJECTS, ordered_consumer=True)
        with contextlib.suppress(Exception):              # nats-py's TimeoutError: no more
            while True:
                out.append(decode((await sub.next_msg(timeout=0.5)).data, Usage))
        await sub.unsubscribe()
    return [u for u in out if u.id == rid]


# -- the websocket ----------------------------------------------------------------------------------

def test_accepted_frames_carry_the_resume_id_only_for_requests_that_ask(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, worker) as down, connect(down.ws) as ws:
            rid_seq, _ = await started(ws, "r", 1)
            rid, seq = rid_seq.split(".")
            assert rid == down.requests[0].id and int(seq) >= 1
            assert (await until_end(ws, "r"))[-1]["type"] == "done"
            await send(ws, {**generate("plain"), "resumable": False})
            frames = await until_end(ws, "plain")
            assert {f["type"] for f in frames} == {"delta", "done"}
            await send(ws, {**generate("bad"), "resumable": "yes"})
            err = await recv(ws)
            assert err["code"] == "invalid_request" and err["message"].startswith("resumable: expected true or false")
    run(body())


def test_tokens_that_come_before_the_publish_ack_wait_for_the_accepted_frame(nats_url, tiny_model, tok,
                                                                            monkeypatch):
    publish = bus.publish

    async def slow_ack(*a, **kw):                   # a worker took the request and streamed before the ack came
        ack = await publish(*a, **kw)
        await asyncio.sleep(0.5)
        return ack
    monkeypatch.setattr(bus, "publish", slow_ack)

    async def quick(down, req) -> None:
        await down.stream(req, TEXT, 0.0)

    async def body():
        async with gateway(nats_url, tiny_model, tok, quick) as down:
            async with connect(down.ws) as ws:
                resume_id, _ = await started(ws, "r", 0)
                whole = await until_end(ws, "r")
                assert resume_id.startswith(down.requests[0].id + ".")
                assert tokens(whole) == down.ids(TEXT) and text(whole) == TEXT
            status, data = await asyncio.to_thread(post, down.http + "/v1/completions", {
                "model": "tiny", "prompt": "hi", "max_tokens": 64, "stream": True})
            assert status == 200
            ids = [e.split("\n")[0] for e in data.decode().split("\n\n")[:-1]]
            rid = down.requests[1].id
            assert all(i.startswith(f"id: {rid}.") and int(i.split(".")[1]) >= 1 for i in ids), ids  # the seq
    run(body())


def test_a_dropped_stream_resumes_exactly_on_another_gateway_and_on_the_same_one(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, worker, resume_grace=1.0) as one, \
                gateway(nats_url, tiny_model, tok, requests=False, resume_grace=1.0) as two:
            for i, (where, again) in enumerate(((one, two), (one, one))):
                async with connect(where.ws) as ws:
                    resume_id, before = await started(ws, f"r{i}", 5 + 3 * i)
                    drop(ws)
                async with connect(again.ws) as ws:
                    await send(ws, {"type": "resume", "id": resume_id, "offset": len(tokens(before))})
                    after = await until_end(ws, resume_id)
                assert tokens(before) + tokens(after) == one.ids(TEXT)        # no gap, no repeat
                assert text(before) + text(after) == TEXT                     # the text continues exactly
                assert after[-1]["type"] == "done" and after[-1]["usage"]["completion_tokens"] == len(one.ids(TEXT))
            await asyncio.sleep(1.5)                    # past the grace: the parked streams were let go, not cancelled
            assert one.cancels == []
            assert [len(await usage_of(one.nc, r.id)) for r in one.requests] == [1, 1]     # metered once each
    run(body())


def test_a_stream_of_several_tokens_a_chunk_resumes_exactly_from_inside_a_chunk(nats_url, tiny_model, tok):
    async def chunky(down, req) -> None:            # as a worker under load sends them (--chunk-rate)
        await down.stream(req, TEXT, PACE, per=3)

    async def body():
        async with gateway(nats_url, tiny_model, tok, chunky, resume_grace=1.0) as one, \
                gateway(nats_url, tiny_model, tok, requests=False, resume_grace=1.0) as two:
            async with connect(one.ws) as ws:
                resume_id, before = await started(ws, "r", 5)
                drop(ws)
            ids, have = one.ids(TEXT), len(tokens(before)) - 1         # the client kept all but its last token
            assert [len(f["token_ids"]) for f in before] == [3, 3]
            async with connect(two.ws) as ws:
                await send(ws, {"type": "resume", "id": resume_id, "offset": have})
                after = await until_end(ws, resume_id)
            assert tokens(after) == ids[have:]                         # from inside the chunk, nothing repeated
            detok = Detokenizer(tok, one.tail, (STOP,))
            detok.push(ids[:have])
            assert detok.release() + text(after) == TEXT                # the text goes on from those tokens
    run(body())


def test_a_stream_resumed_elsewhere_ends_on_a_connection_still_open_with_resumed(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, worker) as one, \
                gateway(nats_url, tiny_model, tok, requests=False) as two, connect(one.ws) as first:
            resume_id, before = await started(first, "r", 3)
            async with connect(two.ws) as ws:
                await send(ws, {"type": "resume", "id": resume_id, "offset": len(tokens(before))})
                frames = await until_end(first, "r")           # the first connection's stream stops
                assert frames[-1]["code"] == "resumed"
                after = await until_end(ws, resume_id)
            assert tokens(before) + tokens(after) == one.ids(TEXT)
            assert tokens(frames) == tokens(after)[:len(tokens(frames))]    # the old stream was ahead, not wrong
            assert one.cancels == []
    run(body())


def test_a_finished_request_resumes_from_its_outcome_at_every_offset_and_not_past_its_end(nats_url, tiny_model,
                                                                                          tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, worker) as one, \
                gateway(nats_url, tiny_model, tok, requests=False) as two:
            async with connect(one.ws) as ws:
                resume_id, _ = await started(ws, "r", 0)
                whole = await until_end(ws, "r")
            ids, had = one.ids(TEXT), [""]                 # had[k]: the text a client has after k tokens
            for f in whole:
                had += [had[-1]] * (len(f.get("token_ids", ())) - 1) + [had[-1] + f.get("text", "")]
            async with connect(two.ws) as ws:
                for k in range(len(ids) + 1):
                    await send(ws, {"type": "resume", "id": resume_id, "offset": k})
                    after = await until_end(ws, resume_id)
                    assert tokens(after) == ids[k:] and had[k] + text(after) == TEXT, k
                    assert after[-1]["finish_reason"] == "length"
                await send(ws, {"type": "resume", "id": resume_id, "offset": len(ids) + 1})
                err = await recv(ws)
                assert err["code"] == "invalid_request" and err["id"] == resume_id
                assert err["message"] == f"offset: {len(ids) + 1} is past the request's {len(ids)} output tokens"
            assert len(await usage_of(one.nc, one.requests[0].id)) == 1      # the resumes were not metered
    run(body())


def test_resumes_of_another_tenant_an_unknown_id_or_a_bad_offset_are_refused(nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, worker, api_keys=keys_file) as down:
            async with connect(down.ws + "?api_key=sk-acme") as ws:
                resume_id, _ = await started(ws, "r", 1)
            rid = resume_id.split(".")[0]
            bad = [("globex", {"id": resume_id, "offset": 0}, "forbidden", f"id: request {rid} is not tenant globex's"),
                   ("acme", {"id": f"{rid}.99999", "offset": 0}, "not_found", f"id: no request {rid} at 99999"),
                   ("acme", {"id": "no-sequence", "offset": 0}, "invalid_request", "id: 'no-sequence' is not a resume"),
                   ("acme", {"id": resume_id}, "invalid_request", "offset: missing"),
                   ("acme", {"id": resume_id, "offset": -1}, "invalid_request", "offset: must be an integer in"),
                   ("acme", {"id": resume_id, "offset": "3"}, "invalid_request", "offset: must be an integer in"),
                   ("acme", {"id": resume_id, "offset": 65}, "invalid_request",
                    "offset: 65 is more than the request's max_tokens=64")]
            old = GenerateRequest("old", "acme", SamplingParams(max_tokens=8), prompt="gone",
                                  created=time.time() - 8 * 24 * 3600)     # past the logs' LOG_MAX_AGE
            seq = (await down.nc.jetstream().publish(subjects.request_new("acme", old.id), encode(old))).seq
            bad.append(("acme", {"id": f"old.{seq}", "offset": 0}, "not_found", "request old ended more than"))
            for tenant, frame, code, message in bad:
                async with connect(down.ws + f"?api_key=sk-{tenant}") as ws:
                    await send(ws, {"type": "resume", **frame})
                    err = await recv(ws)
                    assert (err["type"], err["code"]) == ("error", code) and err["message"].startswith(message), err
            url = down.http + "/v1/completions"
            for key, last, status, message in (
                    ("sk-globex", f"{resume_id}.0", 403, "id: request"),
                    ("sk-acme", f"{rid}.99999.0", 404, "id: no request"),
                    ("sk-acme", "garbage", 400, "Last-Event-ID: 'garbage' is not a resume point"),
                    ("sk-acme", f"{resume_id}.0", 400, f"Last-Event-ID: request {rid} was made on the websocket")):
                got, data = await asyncio.to_thread(post, url, None, {"authorization": f"Bearer {key}",
                                                                      "last-event-id": last})
                assert got == status and orjson.loads(data)["error"]["message"].startswith(message), data
    run(body())


@pytest.mark.serial
def test_dropped_streams_are_cancelled_after_the_grace_and_left_ones_at_once(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, worker, resume_grace=0.5) as down:
            for n, (cid, resumable, clean) in enumerate((("dropped", True, False), ("closed", True, True),
                                                         ("plain", False, False)), 1):
                async with connect(down.ws) as ws:
                    await send(ws, {**generate(cid, "hold"), "resumable": resumable})
                    await recv(ws)                        # accepted, or the first delta
                    await until(lambda n=n: len(down.requests) == n)   # accepted is the ack: the worker may not have it
                    left = time.monotonic()
                    if not clean:
                        drop(ws)
                rid = down.requests[-1].id
                await until(lambda r=rid: r in down.cancelled("abort"))
                waited = time.monotonic() - left
                assert (waited >= 0.5) == (cid == "dropped") and waited < 2.5, (cid, waited)
    run(body())


# -- server-sent events ------------------------------------------------------------------------------

def test_an_sse_stream_resumes_on_another_gateway_with_last_event_id(nats_url, tiny_model, tok):
    body_ = {"model": "tiny", "prompt": "hi", "max_tokens": 64, "stop": [STOP], "stream": True,
             "stream_options": {"include_usage": True}}

    async def body():
        async with gateway(nats_url, tiny_model, tok, worker) as one, \
                gateway(nats_url, tiny_model, tok, requests=False) as two:
            before, last, offsets = await asyncio.to_thread(read_until, one.http + "/v1/completions", body_, 5)
            rid = one.requests[0].id
            assert last.startswith(f"{rid}.") and offsets == sorted(offsets)

            def resumed() -> list:
                client = openai.OpenAI(base_url=two.http + "/v1", api_key="none", max_retries=0)
                return list(client.completions.create(**{k: v for k, v in body_.items() if k != "stream"},
                                                      stream=True, extra_headers={"Last-Event-ID": last}))
            chunks = await asyncio.to_thread(resumed)
            after = "".join(c.choices[0].text for c in chunks if c.choices)
            assert before + after == TEXT
            assert {c.id for c in chunks} == {f"cmpl-{rid}"}
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
                   ["length"]
            assert chunks[-1].usage.completion_tokens == len(one.ids(TEXT))
            await asyncio.sleep(0.5)
            assert one.cancels == [] and len(await usage_of(one.nc, rid)) == 1
    run(body())


def test_sse_event_ids_name_the_resume_point_after_each_event(nats_url, tiny_model, tok):
    async def body():
        async with gateway(nats_url, tiny_model, tok, worker) as down:
            status, data = await asyncio.to_thread(post, down.http + "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert status == 200
            stream = data.decode()
            rid, points = down.requests[0].id, []
            for e in stream.split("\n\n")[:-1]:
                head, data = e.split("\n")                 # one id line, then one data line
                assert head.startswith(f"id: {rid}.") and data.startswith("data: "), e
                points.append(tuple(map(int, head[4:].split(".")[1:])))
            seqs, offsets = zip(*points)
            assert len(set(seqs)) == 1 and offsets[0] == 0 and list(offsets) == sorted(offsets)
            assert offsets[-1] == len(down.ids(TEXT)) and stream.endswith("data: [DONE]\n\n")
    run(body())


def test_the_gateways_grace_is_a_flag(tiny_model):
    from services.gateway.app import parser
    assert parser().parse_args(["--model", tiny_model, "--resume-grace", "2.5"]).resume_grace == 2.5
    assert parser().parse_args(["--model", tiny_model]).resume_grace == subjects.RESUME_GRACE

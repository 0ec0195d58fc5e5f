"""A stream is never silently incomplete, and every request ends: the gateway holds chunks that come
past a gap until the worker resends the missing tokens or the request's Outcome has them, checks a
stream that went silent, answers tb.progress.<id>, and ends a request past its request timeout with a
"timeout" error on the websocket and on HTTP (streamed or not). The rest of the pipeline is the
scripted fake (Downstream) on a real nats-server."""
import asyncio
import time
import urllib.error
import urllib.request

import orjson
import pytest
from websockets.asyncio.client import connect

import bus
from schemas import subjects
from schemas.messages import Completion, Progress, Resend, TokenChunk, decode, encode
from schemas.sampling import SamplingParams
from tests.services.fake_pipeline import LOG, PROMPT_TOKENS, gateway, said

TEXT = " Hello world and more words"


@pytest.fixture
def quick_stall(monkeypatch):
    monkeypatch.setattr(subjects, "STALL_SECONDS", 1.0)


def run(coro, timeout: float = 20) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


async def frames_of(ws, cid: str) -> list[dict]:
    got = []
    while not got or got[-1]["type"] not in ("done", "error"):
        f = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
        assert f["id"] == cid, f
        got.append(f)
    return got


def tokens(frames: list[dict]) -> list[int]:
    return [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]


async def resender(down, rid: str, ids: list[int]) -> list[Resend]:
    """Answers tb.resend.<rid> as the worker running it would: the tokens from the asked offset."""
    asked = []

    async def answer(msg):
        r = decode(msg.data, Resend)
        asked.append(r)
        await down.nc.publish(msg.reply, encode(TokenChunk(rid, -1, r.offset, ids[r.offset:], PROMPT_TOKENS,
                                                           down.tail)))
    await down.nc.subscribe(subjects.resend(rid), cb=answer)
    return asked


async def record_outcome(down, rid: str, ids: list[int], reason: str = "length") -> None:
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(ids)}
    record = Completion(rid, "default", "fake0", SamplingParams(), down.tail, ids, reason, None, usage)
    await bus.store_end(down.nc.jetstream(), "default", rid, None, encode(record), LOG)


def test_chunks_past_a_gap_are_held_until_the_worker_resends_the_missing_tokens(nats_url, tiny_model, tok):
    asked = []

    async def script(down, req):
        ids = down.ids(TEXT)
        asked.append(await resender(down, req.id, ids))
        await down.publish(req.id, down.chunk(req.id, 0, ids[:1]), down.chunk(req.id, 2, ids[2:3]),
                           down.final(req.id, 3, ids[3:]))            # the chunk at offset 1 is lost

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": "hi"}).decode())
            frames = await frames_of(ws, "r")
            assert tokens(frames) == down.ids(TEXT)                  # token-exact, in order, nothing twice
            assert "".join(f["text"] for f in frames if f["type"] == "delta") == TEXT
            assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == len(down.ids(TEXT))
            assert [a.offset for a in asked[0]] == [1]
            metrics = await asyncio.to_thread(scrape, down.http)
            assert 'tokenbus_stream_checks_total{cause="gap",source="resend"} 1.0' in metrics
    run(body())


@pytest.mark.serial
def test_a_lost_final_chunk_is_read_from_the_outcome_when_the_stream_stalls(nats_url, tiny_model, tok, quick_stall):
    async def script(down, req):
        ids = down.ids(TEXT)
        await down.publish(req.id, down.chunk(req.id, 0, ids[:1]), down.chunk(req.id, 1, ids[1:2]))
        await record_outcome(down, req.id, ids, "stop")             # the final chunk itself never comes

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            t0 = time.monotonic()
            await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": "hi"}).decode())
            frames = await frames_of(ws, "r")
            assert tokens(frames) == down.ids(TEXT)
            assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "stop"
            assert time.monotonic() - t0 < 1.0 + 3 * 1.0             # a stall check or so after STALL_SECONDS
    run(body())


def test_a_gap_filled_by_nobody_is_never_passed_over_and_ends_with_a_timeout_error(nats_url, tiny_model, tok):
    async def script(down, req):
        ids = down.ids(TEXT)
        await down.publish(req.id, down.chunk(req.id, 0, ids[:1]), down.final(req.id, 2, ids[2:]))

    async def body():
        async with gateway(nats_url, tiny_model, tok, script, request_timeout=2.0) as down, connect(down.ws) as ws:
            await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": "hi"}).decode())
            frames = await frames_of(ws, "r")
            assert tokens(frames) == down.ids(TEXT)[:1]               # nothing past the gap, and no done
            assert frames[-1]["type"] == "error" and frames[-1]["code"] == "timeout"
            assert "--request-timeout=2 s" in frames[-1]["message"]
            await asyncio.sleep(0.2)
            assert down.requests[0].id in down.cancelled("abort")    # the worker is told
            metrics = await asyncio.to_thread(scrape, down.http)
            assert 'tokenbus_request_timeouts_total{tenant="default"} 1.0' in metrics
    run(body())


def scrape(http: str) -> str:
    with urllib.request.urlopen(http + "/metrics", timeout=5) as r:
        return r.read().decode()


def http_post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, orjson.dumps(body), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_request_nobody_finishes_times_out_on_http_streamed_and_not(nats_url, tiny_model, tok):
    async def script(down, req):                  # "part": one token, then silence; "hold": silence
        if said(req) == "part":
            await down.publish(req.id, down.chunk(req.id, 0, down.ids(TEXT)[:1]))

    async def body():
        async with gateway(nats_url, tiny_model, tok, script, request_timeout=1.5) as down:
            url = down.http + "/v1/completions"
            hold, part = ({"model": "tiny", "prompt": p, "max_tokens": 4} for p in ("hold", "part"))
            (status, data), (s_status, s_data) = await asyncio.gather(
                asyncio.to_thread(http_post, url, hold), asyncio.to_thread(http_post, url, {**part, "stream": True}))
            assert status == 504 and orjson.loads(data)["error"]["code"] == "timeout", data
            assert s_status == 200
            events = [orjson.loads(line[6:]) for line in s_data.decode().splitlines() if line.startswith("data: {")]
            assert events[0]["choices"][0]["text"] == tok.decode(down.ids(TEXT)[:1])
            assert events[-1]["error"]["code"] == "timeout" and "--request-timeout" in events[-1]["error"]["message"]
    run(body())


def test_progress_answers_the_tokens_the_client_received_and_nothing_held_past_a_gap(nats_url, tiny_model, tok):
    async def script(down, req):
        ids = down.ids(TEXT)
        await down.publish(req.id, down.chunk(req.id, 0, ids[:1]), down.chunk(req.id, 1, ids[1:2]),
                           down.chunk(req.id, 3, ids[3:4]))         # then silence; offset 2 is missing

    async def body():
        async with gateway(nats_url, tiny_model, tok, script) as down, connect(down.ws) as ws:
            await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": "hi"}).decode())
            got = []
            while len(got) < 2:
                got += orjson.loads(await asyncio.wait_for(ws.recv(), 5))["token_ids"]
            rid = down.requests[0].id
            reply = decode((await down.nc.request(subjects.progress(rid), b"", timeout=2)).data, Progress)
            assert reply.id == rid and reply.token_ids == down.ids(TEXT)[:2] == got
    run(body())

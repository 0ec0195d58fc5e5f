"""Streams resume across gateways on the real stack: two gateways, a worker, the tokenizer and router
as processes. A websocket client (a plain websockets client) and an SSE client (urllib, then the
openai client with Last-Event-ID) whose gateway is SIGKILLed mid-stream reconnect to the other
gateway, resume, and end with exactly the offline engine's tokens and text (greedy); a finished
request resumes from its end record; another tenant's resume is refused; the request is metered once."""
import asyncio
import contextlib
import json
import os
import threading
import time
import urllib.request

import openai
import orjson
import pytest
import websockets

from ops import usage
from ops.procs import free_port
from ops.up import Stack
from schemas.messages import Usage
from schemas.sampling import SamplingParams
from services.recorder.store import Window
from tests.e2e.conftest import WORKER_ARGS, receive, running, send, text, tokens
from workers import LLM
from workers.service import USAGE_BACKUP_SECONDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEYS = {"sk-acme": {"tenant": "acme"}, "sk-globex": {"tenant": "globex"}}
ACME = {"Authorization": "Bearer sk-acme"}
STOP = "a stop string the model will not write"          # text is held back: the resume must continue it
LONG = {"max_tokens": 160, "temperature": 0.0, "ignore_eos": True, "stop": [STOP]}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    home = tmp_path_factory.mktemp("resume")
    (home / "keys.json").write_text(json.dumps(KEYS))
    with running(Stack(tiny_model, free_port(), home, nats_port=free_port(), workers=1, worker_args=WORKER_ARGS,
              api_keys=str(home / "keys.json"), gateways=2)) as s:
        yield s


def offline(model: str, prompt: str, max_tokens: int):
    params = SamplingParams(**{**LONG, "max_tokens": max_tokens, "stop": (STOP,)})
    return LLM(model).generate([prompt], params)[0]


async def frames_until_end(ws, cid: str) -> list[dict]:
    got = []
    while not got or got[-1]["type"] not in ("done", "error"):
        f = await receive(ws)
        assert f["id"] == cid, f
        got.append(f)
    return got



async def usage_records(stack) -> list[Usage]:
    """Every usage record: the recorder's database's, and those still on the bus."""
    return await usage.requests(stack.nats_url, stack.database_url, Window())


def test_a_finished_request_resumes_from_its_outcome_on_the_other_gateway_and_not_for_another_tenant(stack,
                                                                                                      tiny_model):
    want = offline(tiny_model, "resume a finished one", 12)

    async def run():
        async with websockets.connect(stack.urls[0], additional_headers=ACME) as ws:
            await send(ws, {"type": "generate", "id": "f", "prompt": "resume a finished one", **LONG,
                            "max_tokens": 12, "resumable": True})
            resume_id = (await receive(ws))["resume_id"]
            whole = await frames_until_end(ws, "f")
        async with websockets.connect(stack.urls[1], additional_headers=ACME) as ws:
            await send(ws, {"type": "resume", "id": resume_id, "offset": 5})
            rest = await frames_until_end(ws, resume_id)
        async with websockets.connect(stack.urls[1], additional_headers={"Authorization": "Bearer sk-globex"}) as ws:
            await send(ws, {"type": "resume", "id": resume_id, "offset": 5})
            refused = await receive(ws)
        return whole, rest, refused

    whole, rest, refused = asyncio.run(run())
    assert tokens(whole) == want.token_ids and text(whole) == want.text
    assert tokens(rest) == want.token_ids[5:] and rest[-1]["usage"]["completion_tokens"] == 12
    assert refused["code"] == "forbidden" and "not tenant globex's" in refused["message"]


def sse_until_cut(url: str, body: dict, seen: threading.Event) -> tuple[str, str]:
    """Reads an SSE stream until its connection breaks: the text and the last event id it got."""
    req = urllib.request.Request(url, orjson.dumps(body), {"content-type": "application/json", **ACME})
    got, last = "", ""
    with contextlib.suppress(Exception), urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: {"):
                got += "".join(c["text"] for c in orjson.loads(line[6:])["choices"])
                seen.set()
    return got, last


def test_websocket_and_sse_clients_cut_by_a_gateway_sigkill_resume_on_the_other_token_exact(stack, tiny_model):
    n = LONG["max_tokens"]
    want_ws, want_sse = offline(tiny_model, "cut by a crash", n), offline(tiny_model, "cut by a crash too", n)
    model = os.path.basename(tiny_model)
    body = {"model": model, "prompt": "cut by a crash too", "stream": True, **LONG}

    async def run():
        seen = threading.Event()
        sse = asyncio.create_task(asyncio.to_thread(sse_until_cut, stack.https[0] + "/v1/completions", body, seen))
        async with websockets.connect(stack.urls[0], additional_headers=ACME) as ws:
            await send(ws, {"type": "generate", "id": "w", "prompt": "cut by a crash", **LONG, "resumable": True})
            resume_id = (await receive(ws))["resume_id"]
            before = [await receive(ws)]
            while not seen.is_set():
                await asyncio.sleep(0.01)
            stack.kill("gateway")                               # SIGKILL, mid-stream for both
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    before.append(await receive(ws))
        cut = time.monotonic()
        sse_before, last = await sse

        async def resume_ws() -> list[dict]:
            async with websockets.connect(stack.urls[1], additional_headers=ACME) as ws:
                await send(ws, {"type": "resume", "id": resume_id, "offset": len(tokens(before))})
                return await frames_until_end(ws, resume_id)

        def resume_sse() -> list:                           # the call again, resumed
            client = openai.OpenAI(base_url=stack.https[1] + "/v1", api_key="sk-acme", max_retries=0)
            return list(client.completions.create(model=model, prompt=body["prompt"], max_tokens=n, temperature=0,
                                                  stop=[STOP], stream=True, extra_body={"ignore_eos": True},
                                                  extra_headers={"Last-Event-ID": last}))
        after, chunks = await asyncio.gather(resume_ws(), asyncio.to_thread(resume_sse))
        return resume_id, before, after, sse_before, last, chunks, time.monotonic() - cut

    try:
        resume_id, before, after, sse_before, last, chunks, took = asyncio.run(run())
    finally:
        stack.restart("gateway")
    assert 0 < len(tokens(before)) < n, "the gateway was killed mid-stream"
    assert tokens(before) + tokens(after) == want_ws.token_ids                  # no gap, no repeat
    assert text(before) + text(after) == want_ws.text
    assert after[-1]["type"] == "done" and after[-1]["usage"]["completion_tokens"] == n
    assert 0 < int(last.rsplit(".", 1)[1]) < n, "the SSE stream was cut mid-stream"
    assert sse_before + "".join(c.choices[0].text for c in chunks if c.choices) == want_sse.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    print(f"resumed both streams {took:.2f} s after the cut")
    time.sleep(USAGE_BACKUP_SECONDS + 1)                     # the worker's backup usage records came too
    usage = [u.id for u in asyncio.run(usage_records(stack))]
    for rid in (resume_id.split(".")[0], last.split(".")[0]):
        assert usage.count(rid) == 1, usage                  # metered once

"""Chunks lost on tb.out are recovered token-exact, and a finished request delivered again is not run
again: a real stack whose worker drops chunk 2 and the final chunk of every request on purpose (the
drop-chunks injected fault, workers/faults.py); the gateway fills the gap from the worker (Resend) and the lost final
chunk from the request's end record, on the websocket and on HTTP streaming."""
import asyncio
import os
import time
import urllib.request

import nats
import orjson
import pytest

from ops.procs import free_port
from ops.up import Stack
from schemas import subjects
from schemas.messages import FinalChunk, TokenizedRequest, WorkItem, decode, encode
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, completions, connect, running, send
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GREEDY = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}   # still running when the gap shows


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    with running(Stack(tiny_model, free_port(), tmp_path_factory.mktemp("drops"), nats_port=free_port(), workers=1,
              worker_args=[*WORKER_ARGS, "--inject-fault", "drop-chunks=2,final"])) as s:
        yield s


def offline(model: str, prompt: str) -> list[int]:
    return LLM(model).generate([prompt], SamplingParams(**GREEDY))[0].token_ids


def test_a_dropped_chunk_and_a_dropped_final_chunk_are_recovered_token_exact_on_the_websocket(stack, tiny_model):
    async def run():
        async with connect(stack) as ws:
            for i in range(3):
                await send(ws, {"type": "generate", "id": f"d{i}", "prompt": f"dropped chunks {i}", **GREEDY})
            return await collect(ws, {f"d{i}" for i in range(3)}, timeout=60)

    got = asyncio.run(run())
    for i in range(3):
        want = offline(tiny_model, f"dropped chunks {i}")
        end = got[f"d{i}"]["end"]
        assert end["type"] == "done" and end["finish_reason"] == "length", end
        assert got[f"d{i}"]["token_ids"] == want and end["usage"]["completion_tokens"] == len(want)
    log = (stack.data_dir / "logs" / "gateway.log").read_text()
    assert '"source":"resend"' in log and '"source":"outcome"' in log     # both ways were taken


def test_a_dropped_chunk_and_a_dropped_final_chunk_are_recovered_on_http_streaming(stack, tiny_model):
    body = {"model": os.path.basename(tiny_model), "prompt": "dropped over http", "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY}
    req = urllib.request.Request(stack.http + "/v1/completions", orjson.dumps(body),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data = r.read().decode()
    events = [orjson.loads(line[6:]) for line in data.splitlines() if line.startswith("data: {")]
    assert data.rstrip().endswith("data: [DONE]")
    want = offline(tiny_model, "dropped over http")
    llm = LLM(tiny_model)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == llm.tokenizer.decode(want)
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == len(want)


def test_a_finished_request_delivered_again_late_is_not_run_again_and_recorded_once(stack, tiny_model):
    async def run():
        async with connect(stack) as ws:
            await send(ws, {"type": "generate", "id": "once", "prompt": "only once", **GREEDY})
            got = await collect(ws, {"once"}, timeout=60)
        assert got["once"]["end"]["type"] == "done"
        [done] = [c for c in await completions(stack.nats_url) if c.prompt_token_ids == LLM(tiny_model).encode(
            "only once")]
        nc = await nats.connect(stack.nats_url)
        outs = []

        async def out(msg):
            outs.append(msg.data)
        await nc.subscribe(subjects.out(done.id), cb=out)
        item = WorkItem(TokenizedRequest(done.id, done.tenant, done.sampling, done.prompt_token_ids, "default"), "w0",
                        time.time(), attempt=7)             # another Nats-Msg-Id: no dedup window stops it
        await nc.jetstream().publish(subjects.work("w0", done.id), encode(item),
                                     headers=subjects.msg_id(done.id, "late"))
        await asyncio.sleep(3)
        records = [c for c in await completions(stack.nats_url) if c.id == done.id]
        info = await nc.jetstream().consumer_info(subjects.WORK_STREAM, "worker-w0")
        await nc.close()
        return done, records, outs, info

    done, records, outs, info = asyncio.run(run())
    assert len(records) == 1
    assert info.num_ack_pending == 0 and info.num_pending == 0    # taken and acked
    chunks = [decode(d, FinalChunk) for d in outs]                # no token chunks: it did not run
    assert len(chunks) == 1 and chunks[0].token_ids == done.output_token_ids
    assert '"redelivered request had ended: not run again"' in (stack.data_dir / "logs" / "w0.log").read_text()

"""A stack whose workers run the mock engine (`--engine mock`) passes the end-to-end checks a real model does: a
streamed answer equals the offline mock engine's tokens, a cancel ends generation, a worker killed mid-stream
leaves its request to the other mock worker, which continues with the same tokens, and a resumable stream cut by
a gateway SIGKILL resumes on the other gateway. The model is the tiny model's directory with its config.json
reshaped to Llama-3-8B's layers (its weight file stays, for the stack's revision, and is never loaded): on an H100
preset a decode step is held ~6 ms, the time of an 8B model's weight reads."""
import asyncio
import contextlib
import json
import shutil

import pytest
import websockets

from ops.procs import free_port
from ops.up import Stack
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, completions, receive, running, send, tokens
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(240)]

MOCK = ["--engine", "mock", "--mock-gpu", "h100-sxm"]
SHAPE_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}
KEYS = {"sk-acme": {"tenant": "acme"}}
ACME = {"Authorization": "Bearer sk-acme"}


@pytest.fixture(scope="module")
def mock_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model, its config reshaped to Llama-3-8B's layers (the weights no longer fit it: the mock never
    loads them)."""
    path = tmp_path_factory.mktemp("mock") / "mock-8b"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **SHAPE_8B}))
    return str(path)


@pytest.fixture(scope="module")
def llm(mock_model):
    return LLM(mock_model, engine="mock", mock_gpu="h100-sxm", num_kv_blocks=512)


@pytest.fixture(scope="module")
def stack(mock_model, tmp_path_factory):
    home = tmp_path_factory.mktemp("mock-stack")
    (home / "keys.json").write_text(json.dumps(KEYS))
    with running(Stack(mock_model, free_port(), home, nats_port=free_port(), workers=2,
                       worker_args=[*WORKER_ARGS, *MOCK], api_keys=str(home / "keys.json"), gateways=2)) as s:
        yield s


def offline(llm: LLM, prompt: str, seed: int, max_tokens: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(seed=seed, max_tokens=max_tokens, temperature=0.8))[0].token_ids


def test_a_streamed_answer_equals_the_offline_mock_engines_and_a_cancel_ends_it(stack, llm):
    async def run():
        async with websockets.connect(stack.url, additional_headers=ACME) as ws:
            for i in range(3):
                await send(ws, {"type": "generate", "id": f"s{i}", "prompt": f"mock stream {i}", "seed": 10 + i,
                                "max_tokens": 40, "temperature": 0.8})
            got = await collect(ws, {"s0", "s1", "s2"})
            await send(ws, {"type": "generate", "id": "long", "prompt": "cancel me", "seed": 1, "max_tokens": 3000})
            while (await receive(ws))["type"] != "delta":
                pass
            await send(ws, {"type": "cancel", "id": "long"})
            end = await receive(ws)
            while end["type"] != "done":
                end = await receive(ws)
            return got, end

    got, end = asyncio.run(run())
    for i in range(3):
        assert got[f"s{i}"]["end"]["type"] == "done"
        assert got[f"s{i}"]["token_ids"] == offline(llm, f"mock stream {i}", 10 + i, 40)
    assert end["finish_reason"] == "abort"
    records = [r for r in asyncio.run(completions(stack.nats_url)) if r.finish_reason == "abort"]
    assert records and len(records[-1].output_token_ids) < 3000


def test_a_resumable_stream_cut_by_a_gateway_sigkill_resumes_on_the_other_gateway(stack, llm):
    n = 300

    async def run():
        async with websockets.connect(stack.urls[0], additional_headers=ACME) as ws:
            await send(ws, {"type": "generate", "id": "r", "prompt": "resume a mock", "seed": 3, "max_tokens": n,
                            "temperature": 0.8, "resumable": True})
            resume_id = (await receive(ws))["resume_id"]
            before = [await receive(ws)]
            stack.kill("gateway")                               # SIGKILL, mid-stream
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    before.append(await receive(ws))
        async with websockets.connect(stack.urls[1], additional_headers=ACME) as ws:
            await send(ws, {"type": "resume", "id": resume_id, "offset": len(tokens(before))})
            after = [await receive(ws)]
            while after[-1]["type"] not in ("done", "error"):
                after.append(await receive(ws))
        return before, after

    try:
        before, after = asyncio.run(run())
    finally:
        stack.restart("gateway")
    assert 0 < len(tokens(before)) < n, "the gateway was killed mid-stream"
    assert after[-1]["type"] == "done", after[-1]
    assert tokens(before) + tokens(after) == offline(llm, "resume a mock", 3, n)


def test_a_worker_killed_mid_stream_leaves_its_request_to_the_other_mock_worker_with_the_same_tokens(stack, llm):
    n = 400

    async def run():
        async with websockets.connect(stack.url, additional_headers=ACME) as ws:
            for i in range(2):
                await send(ws, {"type": "generate", "id": f"k{i}", "prompt": f"kill a mock {i}", "seed": i,
                                "max_tokens": n, "temperature": 0.8})
            before = {"k0": [], "k1": []}
            while min(map(len, before.values())) < 50:         # both are well into their streams
                frame = await receive(ws)
                before[frame["id"]] += frame["token_ids"]
            stack.kill("w1")
            got = await collect(ws, {"k0", "k1"}, timeout=120)
            return {i: {**g, "token_ids": before[i] + g["token_ids"]} for i, g in got.items()}

    got = asyncio.run(run())
    for i in range(2):
        assert got[f"k{i}"]["end"]["type"] == "done"
        assert got[f"k{i}"]["token_ids"] == offline(llm, f"kill a mock {i}", i, n)   # seamless, nothing twice
    workers = {r.worker for r in asyncio.run(completions(stack.nats_url))
               if r.prompt_token_ids in (llm.encode("kill a mock 0"), llm.encode("kill a mock 1"))}
    assert workers == {"w0"}
    events = [json.loads(line) for line in stack.log("w0").read_text().splitlines() if line.startswith("{")]
    moved = [e for e in events if e.get("event") == "request started" and e.get("attempt", 0) >= 1]
    assert len(moved) == 1 and moved[0]["resumed"] >= 50     # w1's request, continued from the client's tokens


def test_a_disaggregated_stack_of_mock_workers_hands_off_and_pulls_the_stand_in_kv(mock_model, llm, tmp_path):
    """A mock prefill worker p0 and a mock decode worker d0: the long prompt is prefilled on p0, handed off, its
    KV (the mock's stand-in) pulled by d0, which decodes the offline mock's tokens."""
    prompt = " ".join(f"word{i} of the long prompt," for i in range(40))
    stack = Stack(mock_model, free_port(), tmp_path, nats_port=free_port(), workers=0, prefill_workers=1,
                  decode_workers=1, worker_args=[*WORKER_ARGS, *MOCK], router_args=["--max-local-prefill", "32"])
    with running(stack):
        async def ask():
            async with websockets.connect(stack.url) as ws:
                await send(ws, {"type": "generate", "id": "d", "prompt": prompt, "seed": 4, "max_tokens": 30})
                return (await collect(ws, {"d"}, timeout=60))["d"]

        got = asyncio.run(ask())
        pulled = [json.loads(line) for line in stack.log("d0").read_text().splitlines() if '"kv pulled"' in line]
        handed = '"request handed off"' in stack.log("p0").read_text()
    assert got["end"]["type"] == "done" and got["token_ids"] == offline(llm, prompt, 4, 30)
    assert handed and len(pulled) == 1 and pulled[0]["pulled"] > 0 and pulled[0]["bytes"] > 0

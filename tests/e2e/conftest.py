"""The real stack for end-to-end tests: nats-server and every service as its own process, on free
127.0.0.1 ports, stopped after the module."""
import asyncio
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone

import orjson
import pytest
import websockets

import bus
from ops.procs import free_port
from ops.up import Stack
from schemas import subjects
from schemas.messages import Completion, decode

WORKER_ARGS = ["--max-num-seqs", "16", "--num-kv-blocks", "512"]


def start_stack(model: str, data_dir, workers: int = 2, extra_worker_args: tuple[str, ...] = ()) -> Stack:
    return started(Stack(model, free_port(), data_dir, nats_port=free_port(), workers=workers,
                         worker_args=[*WORKER_ARGS, *extra_worker_args]))


STACKS: list[Stack] = []                        # every stack started this session: a failing test's report
ROUTINE = ("routed", "router stats", "kv snapshot loaded", "tokenized", "request accepted", "request started",
           "request finished")
MAX_EVENTS = 80                                 # lines of a failing test's report, per stack


def events(stack: Stack, since: float = 0.0, until: float = float("inf")) -> str:
    """What the stack's services logged between two unix times, but the routine lines, in time order:
    why a failure failed."""
    lines = []
    for name in stack.children:
        path = stack.log(name)
        if name.startswith("nats") or not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                e = json.loads(line)
                ts = datetime.fromisoformat(e.pop("timestamp")).timestamp()
                if e.get("event") not in ROUTINE and since <= ts <= until:
                    when = datetime.fromtimestamp(ts, timezone.utc)
                    lines.append((ts, f"{when:%H:%M:%S.%f} {name}: {e.pop('event', '')} "
                                      + " ".join(f"{k}={v}" for k, v in e.items() if k != "service")))
    return "\n".join(text for _, text in sorted(lines))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing e2e test's report ends with what its stacks logged while it ran (CI keeps no files)."""
    report = (yield).get_result()
    if report.when == "call" and report.failed:
        # the tests import this file as tests.e2e.conftest, pytest as a module of its own: their list
        for stack in importlib.import_module("tests.e2e.conftest").STACKS:
            found = events(stack, call.start - 1, call.stop + 1).splitlines()
            if found:
                report.sections.append((f"events of the stack in {stack.data_dir.name}",
                                        "\n".join(found[-MAX_EVENTS:])))


def started(stack: Stack) -> Stack:
    """The stack started and ready, or stopped and the error raised."""
    STACKS.append(stack)
    try:
        stack.start()
        stack.wait_ready()
    except BaseException:
        stack.stop()
        raise
    return stack


@contextlib.contextmanager
def running(stack: Stack):
    """The stack started and ready for the block; stopped however the block ends."""
    started(stack)
    try:
        yield stack
    finally:
        stack.stop()


@dataclass
class Up:
    """A running `tokenbus up`: its process, the lines it printed, its gateway."""
    process: subprocess.Popen
    lines: list[str]
    port: int

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def tokenbus_up(data_dir, *args: str, env: dict | None = None):
    """`tokenbus up` as a user runs it (plus free ports and `data_dir`), until it says it is up;
    SIGTERM (killed if it does not stop within 30 s) when the block ends."""
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--nats-port", str(free_port()),
                           "--data-dir", str(data_dir), *args], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})})
    try:
        lines = []
        while "Ctrl-C stops everything." not in lines[-1:]:
            line = up.stdout.readline()
            assert line, f"tokenbus up ended early: {lines}"
            lines.append(line.strip())
        yield Up(up, lines, port)
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = start_stack(tiny_model, tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()


async def send(ws, frame: dict) -> None:
    await ws.send(orjson.dumps(frame).decode())


async def receive(ws, timeout: float = 30.0) -> dict:
    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout))


async def collect(ws, ids: set[str], timeout: float = 60.0) -> dict[str, dict]:
    """Reads frames until every id in ids has its done or error frame: id → text, token_ids, end frame."""
    out = {i: {"text": "", "token_ids": [], "deltas": 0} for i in ids}
    pending = set(ids)
    async with asyncio.timeout(timeout):
        while pending:
            frame = await receive(ws, timeout)
            got = out[frame["id"]]
            if frame["type"] == "delta":
                got["text"] += frame["text"]
                got["token_ids"] += frame["token_ids"]
                got["deltas"] += 1
            else:
                got["end"] = frame
                pending.discard(frame["id"])
    return out


@contextlib.asynccontextmanager
async def connect(stack: Stack):
    async with websockets.connect(stack.url, max_size=None) as ws:
        yield ws


async def completions(nats_url: str, wait: float = 1.0) -> list[Completion]:
    """Every record in TB_RESULTS."""
    nc = await bus.connect(nats_url, "test-results")
    js = nc.jetstream()
    sub = await js.subscribe(subjects.RESULTS_SUBJECTS, ordered_consumer=True)
    records = []
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
        while True:
            records.append(decode((await sub.next_msg(timeout=wait)).data, Completion))
    await nc.close()
    return records


def tokens(frames: list[dict]) -> list[int]:
    """The token ids of a stream's delta frames, in order."""
    return [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]


def text(frames: list[dict]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "delta")


def get(url: str) -> tuple[int, dict]:
    """An HTTP GET's status and JSON body, an error's included."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: dict) -> tuple[int, dict]:
    """A JSON POST's status and JSON body, an error's included."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

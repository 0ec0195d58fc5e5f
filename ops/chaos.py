"""`tokenbus chaos`: fault scenarios against a live local stack, each under a bounded, verified load.

Every scenario starts a fresh stack (nats-server, tokenizer, router, workers and gateway as processes
on free 127.0.0.1 ports, in a temporary directory), sends a fixed number of greedy requests over a
few websocket connections at a steady pace, injects its fault a third of the way in, and checks every
answer token for token against the offline engine. A probe sends a short request every half second
from the fault on; the recovery time is from the fault to the first probe answered in full (a
fault the stack absorbs shows the probe's own latency). The completions log is read at the end for
requests recorded twice.

Counts per scenario: sent; accepted (not refused at admission: an immediate error frame such as
"unavailable" or "overloaded", which carries retry_after); completed (a done frame with exactly the
offline engine's tokens); wrong (a done frame with other tokens); errors (an error frame after
acceptance: expected only for the poison requests, which are counted apart); cut (the connection
closed under the request: a gateway crash, until clients can resume); lost (accepted and never
answered within the client's patience); duplicated (extra completion records of one request id).
With --json also: stored, recorded and metered (requests in the request log, and of them those with a
completion record and a usage record: a request whose client was cut still runs and is metered)."""
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson
import websockets

from ops import procs
from ops.up import Stack

REFUSALS = {"unavailable", "overloaded", "rate_limit_exceeded", "concurrency_limit_exceeded", "too_many_requests"}
SERVICES = ("worker", "router", "tokenizer", "gateway")
SCENARIOS = ("none", *(f"kill-{s}" for s in SERVICES), *(f"stop-{s}" for s in SERVICES), "broker-restart",
             "poison", "slow-client", "overload")
POISON = [  # websocket frames no worker may crash on: each must be answered with an error
    {"prompt": "poison", "top_k": 18446744073709551615},
    {"prompt": "poison", "seed": 18446744073709551616},
    {"prompt": "poison", "max_tokens": 2**63},
    {"prompt": "poison", "temperature": 1e308, "top_p": 1e-320},
    {"prompt_token_ids": [2**62, 1, 2]},
    {"prompt_token_ids": [-1]},
    {"prompt": "poison", "stop_token_ids": list(range(100_000))},
    {"prompt": "poison", "repetition_penalty": 1e-320},
]
STOP_SECONDS = 5.0                    # a SIGSTOP lasts past the worker TTL
BROKER_DOWN_SECONDS = 3.0
RESTART_AFTER = 1.0                   # a killed service comes back, as its supervisor would bring it
SLOW_CLIENT_SECONDS = 20.0
PROBE_INTERVAL = 0.5


@dataclass(slots=True)
class Outcome:
    """What one client saw of one request."""
    frames: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    end: dict | None = None
    cut: bool = False


@dataclass(slots=True)
class Result:
    scenario: str
    sent: int = 0
    accepted: int = 0
    completed: int = 0
    wrong: int = 0
    errors: int = 0
    cut: int = 0
    lost: int = 0
    duplicated: int = 0
    poison_sent: int = 0
    poison_answered: int = 0
    recovery_s: float | None = None
    workers_registered: int = 0
    stored: int = 0                       # requests in TB_REQUESTS (probes included)
    recorded: int = 0                     # of them, with a completion record in TB_RESULTS
    metered: int = 0                      # of them, with a usage record in TB_USAGE
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        broken = self.wrong or self.lost or self.duplicated or self.errors
        return not broken and self.poison_answered == self.poison_sent


class Client:
    """One websocket connection: sends generate frames, files every frame under its request."""

    def __init__(self, url: str, outcomes: dict[str, Outcome], read: bool = True):
        self.url, self.outcomes, self.read = url, outcomes, read
        self.ws = None
        self.mine: set[str] = set()
        self.reader: asyncio.Task | None = None
        self.closing = False                     # we close it: what is unanswered then is lost, not cut
        self.may_read = asyncio.Event()
        if read:
            self.may_read.set()

    async def open(self) -> None:
        self.ws = await websockets.connect(self.url, max_size=None, open_timeout=10)
        self.reader = asyncio.create_task(self.read_loop())

    async def send(self, cid: str, frame: dict) -> None:
        self.outcomes[cid] = Outcome()
        try:
            if self.reader.done():               # the gateway closed on us: come back, as a client would
                await self.reopen()
            self.mine.add(cid)
            await self.ws.send(json.dumps({"type": "generate", "id": cid, **frame}))  # json: ints past 64 bits
        except (websockets.ConnectionClosed, OSError, TimeoutError):
            self.outcomes[cid].cut = True

    async def reopen(self, attempts: int = 20) -> None:
        for _ in range(attempts):
            with contextlib.suppress(OSError, TimeoutError, websockets.InvalidHandshake):
                self.mine = set()
                await self.open()
                return
            await asyncio.sleep(0.5)
        raise TimeoutError("the gateway did not come back")

    async def read_loop(self) -> None:
        await self.may_read.wait()
        try:
            async for text in self.ws:
                frame = orjson.loads(text)
                got = self.outcomes.get(frame.get("id"))
                if got is None:
                    continue
                got.frames.append(frame)
                if frame["type"] == "delta":
                    got.tokens += frame["token_ids"]
                else:
                    got.end = frame
        except websockets.ConnectionClosed:
            pass
        if self.closing:
            return
        for cid in self.mine:
            if self.outcomes[cid].end is None:
                self.outcomes[cid].cut = True

    async def close(self) -> None:
        self.closing = True
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
        if self.reader is not None:
            self.reader.cancel()


class Run:
    """One scenario on its own stack."""

    def __init__(self, scenario: str, model: str, expected: dict[str, list[int]], args, data_dir: Path):
        self.scenario, self.model, self.expected, self.args = scenario, model, expected, args
        self.stack = Stack(model, procs.free_port(), data_dir, nats_port=procs.free_port(), workers=args.workers,
                           worker_args=["--max-num-seqs", str(args.max_num_seqs)])
        self.outcomes: dict[str, Outcome] = {}
        self.result = Result(scenario)
        self.fault_at = 0.0
        self.probe_done: list[float] = []

    def run(self) -> Result:
        self.stack.start()
        try:
            self.stack.wait_ready()
            asyncio.run(self.load())
            r = self.result
            r.stored, r.recorded, r.duplicated, r.metered = asyncio.run(logs(self.stack.nats_url))
            self.result.workers_registered = asyncio.run(registered(self.stack.nats_url))
        finally:
            self.stack.stop()
        return self.result

    async def load(self) -> None:
        a = self.args
        clients = [Client(self.stack.url, self.outcomes) for _ in range(a.clients)]
        for c in clients:
            await c.open()
        n = a.requests * (3 if self.scenario == "overload" else 1)
        pace = 0.0 if self.scenario == "overload" else a.interval
        fault = asyncio.create_task(self.fault(clients))
        probes = asyncio.create_task(self.probe())
        for i in range(n):
            cid = f"c{i}"
            await clients[i % len(clients)].send(cid, request(cid, a.max_tokens))
            self.result.sent += 1
            if i == n // 3:
                self.fault_at = time.monotonic()
            await asyncio.sleep(pace)
        await fault
        await self.settle(clients, a.patience)
        probes.cancel()
        for c in clients:
            await c.close()
        self.score()

    async def settle(self, clients: list["Client"], patience: float) -> None:
        """Until every request has ended (or its connection closed), or patience runs out."""
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            if all(o.end is not None or o.cut for o in self.outcomes.values()):
                return
            await asyncio.sleep(0.2)

    async def fault(self, clients: list["Client"]) -> None:
        while not self.fault_at:
            await asyncio.sleep(0.05)
        kind, _, target = self.scenario.partition("-")
        name = "w1" if target == "worker" else target
        if kind == "kill":
            self.stack.kill(name)
            await asyncio.sleep(RESTART_AFTER)
            self.stack.restart(name)
        elif kind == "stop":
            os.kill(self.stack.children[name].pid, signal.SIGSTOP)
            await asyncio.sleep(STOP_SECONDS)
            os.kill(self.stack.children[name].pid, signal.SIGCONT)
        elif self.scenario == "broker-restart":
            self.stack.kill("nats")
            await asyncio.sleep(BROKER_DOWN_SECONDS)
            self.stack.restart_nats()            # in this thread: a child dies with the thread that started it
        elif self.scenario == "poison":
            await self.poison()
        elif self.scenario == "slow-client":
            await self.slow_client()

    async def poison(self) -> None:
        client = Client(self.stack.url, self.outcomes)
        await client.open()
        for i, frame in enumerate(POISON):
            await client.send(f"poison{i}", frame)
            self.result.poison_sent += 1
        await asyncio.sleep(2.0)
        ends = [self.outcomes[f"poison{i}"].end for i in range(len(POISON))]
        self.result.poison_answered = sum(end is not None and end["type"] == "error" for end in ends)
        await client.close()

    async def slow_client(self) -> None:
        """A client that sends requests and reads nothing for SLOW_CLIENT_SECONDS; its answers must
        still be whole when it reads, and the others must not wait for it."""
        client = Client(self.stack.url, self.outcomes, read=False)
        await client.open()
        for i in range(4):
            cid = f"slow{i}"
            await client.send(cid, request(cid, self.args.max_tokens))
            self.result.sent += 1
        await asyncio.sleep(SLOW_CLIENT_SECONDS)
        client.may_read.set()

    async def probe(self) -> None:
        """A short request every PROBE_INTERVAL from the fault on, each on a fresh connection."""
        while not self.fault_at:
            await asyncio.sleep(0.05)
        tasks = []
        for i in range(int(self.args.patience / PROBE_INTERVAL)):
            tasks.append(asyncio.create_task(self.one_probe(i)))
            await asyncio.sleep(PROBE_INTERVAL)

    async def one_probe(self, i: int) -> None:
        with contextlib.suppress(Exception):
            async with websockets.connect(self.stack.url, open_timeout=5) as ws:
                await ws.send(orjson.dumps({"type": "generate", "id": "p", "prompt": f"probe {i}", "max_tokens": 2,
                                            "temperature": 0, "ignore_eos": True}).decode())
                while True:
                    frame = orjson.loads(await ws.recv())
                    if frame["type"] == "done":
                        self.probe_done.append(time.monotonic())
                        return
                    if frame["type"] == "error":
                        return

    def score(self) -> None:
        r = self.result
        for cid, o in self.outcomes.items():
            if cid.startswith("poison"):
                continue
            end = o.end
            if end is not None and end["type"] == "error" and end.get("code") in REFUSALS and not o.tokens:
                continue                                  # refused at admission: not accepted
            r.accepted += 1
            if end is None:
                r.cut += o.cut
                r.lost += not o.cut
            elif end["type"] == "error":
                r.errors += 1
                r.notes.append(f"{cid}: {end.get('code')}: {end.get('message', '')[:80]}")
            elif o.tokens == self.expected[cid] and end["usage"]["completion_tokens"] == len(o.tokens):
                r.completed += 1
            else:
                r.wrong += 1
        after = [t for t in self.probe_done if t >= self.fault_at]
        if after:
            r.recovery_s = round(after[0] - self.fault_at, 2)


def request(cid: str, max_tokens: int) -> dict:
    return {"prompt": prompt(cid), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def prompt(cid: str) -> str:
    return f"chaos request {cid}: the pipeline must not lose this"


def expected_tokens(model: str, cids: list[str], max_tokens: int) -> dict[str, list[int]]:
    from workers import LLM, SamplingParams

    llm = LLM(model)
    outs = llm.generate([prompt(c) for c in cids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                  ignore_eos=True))
    return {c: o.token_ids for c, o in zip(cids, outs)}


async def logs(nats_url: str) -> tuple[int, int, int, int]:
    """From the stack's logs: (requests stored in TB_REQUESTS, request ids with a completion record,
    completion records beyond the first of a request id, request ids with a usage record)."""
    from schemas import subjects
    from schemas.messages import Completion, GenerateRequest, Usage

    nc = await subjects.connect(nats_url, "tokenbus-chaos")
    try:
        js = nc.jetstream()
        requests = await ids(js, subjects.REQUESTS_STREAM, subjects.REQUESTS_SUBJECTS, GenerateRequest)
        done = await ids(js, subjects.RESULTS_STREAM, subjects.RESULTS_SUBJECTS, Completion)
        usage = await ids(js, subjects.USAGE_STREAM, subjects.USAGE_SUBJECTS, Usage)
        return len(requests), len(set(done)), len(done) - len(set(done)), len(set(usage))
    finally:
        await nc.close()


async def ids(js, stream: str, subject: str, cls: type) -> list[str]:
    """The request id of every record of a stream, in order."""
    from schemas.messages import decode

    count, out = (await js.stream_info(stream)).state.messages, []
    if count:
        sub = await js.subscribe(subject, ordered_consumer=True)
        while len(out) < count:
            out.append(decode((await sub.next_msg(timeout=5)).data, cls).id)
        await sub.unsubscribe()
    return out


async def registered(nats_url: str) -> int:
    from schemas import subjects

    nc = await subjects.connect(nats_url, "tokenbus-chaos")
    try:
        return len(await subjects.live_workers(await subjects.registry(nc.jetstream())))
    finally:
        await nc.close()


COLUMNS = ("scenario", "sent", "accepted", "completed", "lost", "duplicated", "wrong", "errors", "cut", "poison",
           "recovery_s", "workers")


def row(r: Result) -> list[str]:
    poison = f"{r.poison_answered}/{r.poison_sent}" if r.poison_sent else "-"
    recovery = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
    return [r.scenario, *(str(getattr(r, k)) for k in ("sent", "accepted", "completed", "lost", "duplicated",
                                                        "wrong", "errors", "cut")), poison, recovery,
            str(r.workers_registered)]


def table(results: list[Result]) -> str:
    rows = [list(COLUMNS), *map(row, results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(args) -> int:
    from workers.models.catalogue import resolve

    args.scenarios = args.scenarios or list(SCENARIOS)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}; choose from: {', '.join(SCENARIOS)}")
    model = resolve(args.model or "tiny")
    cids = [f"c{i}" for i in range(3 * args.requests)] + [f"slow{i}" for i in range(4)]
    print(f"tokenbus chaos: {len(args.scenarios)} scenario(s), {args.requests} greedy requests of {args.max_tokens} "
          f"tokens each on {args.workers} workers; offline reference ...", file=sys.stderr, flush=True)
    expected = expected_tokens(model, cids, args.max_tokens)
    results = []
    root = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="tokenbus-chaos-"))
    for scenario in args.scenarios:
        print(f"tokenbus chaos: {scenario} ...", file=sys.stderr, flush=True)
        r = Run(scenario, model, expected, args, root / scenario).run()
        results.append(r)
        for note in r.notes[:5]:
            print(f"  {scenario}: {note}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps([{**asdict(r), "clean": r.clean} for r in results], indent=2))
    else:
        print(table(results))
        print(f"logs: {root}")
    return 0 if all(r.clean for r in results) else 1

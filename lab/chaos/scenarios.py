"""`tokenbus chaos`: fault scenarios against a live local stack, each under a bounded, verified load.

Every scenario starts a fresh stack (nats-server, tokenizer, router, workers and gateway as processes
on free 127.0.0.1 ports, in a temporary directory; kill-gateway runs two gateways), sends a fixed
number of greedy requests over a few websocket connections at a steady pace, injects its fault a
third of the way in, and checks every answer token for token against the offline engine. Clients
ask for resumable requests: one whose connection drops opens one to the next gateway and resumes
every unanswered request there from the tokens it has (one never accepted is sent again). A probe
sends a short request every half second from the fault on, to the gateways in turn; the recovery
time is from the fault to the first probe answered in full (a fault the stack absorbs shows the
probe's own latency). The completions log is read at the end for requests recorded twice.

Counts per scenario: sent; accepted (not refused at admission: an immediate error frame such as
"unavailable" or "overloaded", which carries retry_after); completed (a done frame with exactly the
offline engine's tokens); wrong (a done frame with other tokens); errors (an error frame after
acceptance: expected only for the poison requests, which are counted apart); resumed (answered after
its client resumed it on another connection); cut (its connection closed and no gateway took the
client back); lost (accepted and never answered within the client's patience); duplicated (extra
completion records of one request id).
With --json also: stored, recorded and metered (requests in the request log, and of them those with a
completion record and a usage record in the recorder's database or still on the bus: a request whose
client was cut or resumed elsewhere still runs and is metered once); misbilled counts the completed
requests whose usage record is missing or differs from the tokens their client got.

The rolls are planned changes, not faults: roll-workers, roll-router and roll-tokenizer replace each
process of their kind one by one as a Kubernetes rolling update does (the replacement started and ready,
then the old one drained by SIGTERM and gone); roll-gateways drains each of two gateways in turn and
starts it again on its port, its clients reconnecting to the other (close code 1012) and resuming;
roll-revision serves a new revision of the model as a canary (CANARY_SHARE of the requests once a worker
serves it; a tiny model of another seed) and moves w1 to it. A third more requests follow each roll
(roll-revision: as many again). Their rows must be as clean as "none" (roll-revision's answers checked
against the offline engine of the revision that answered); the TTFT p50 and p99 of the requests sent
before and during the roll give the latency it added.

Each stack's recorder writes to a PostgreSQL of its own (lab/common/postgres.py; SQLite where PostgreSQL
is not installed, and the database scenarios are not run). The records scenarios: kill-recorder
(SIGKILLed mid-batch, restarted), database-restart (PostgreSQL down --database-down seconds, 30 by
default), backlog-full (PostgreSQL down while filler records fill TB_USAGE to its limit: admission
refuses "metering backlog full" until the database returns and the recorder drains it).

With --cluster every scenario runs on a 3-node nats cluster (R3 streams), each node a process with its own
store and routes, in a network namespace of its own where the machine allows (lab/chaos/netns.py); the node
scenarios SIGKILL the node leading TB_REQUESTS or a follower of it (it comes back NODE_DOWN_SECONDS later,
from its store), or cut TB_REQUESTS' leader off the network for PARTITION_SECONDS. Their rows add the
longest time a stream or bucket the node led had no leader. "throughput" adds the cost of R3 and of an
fsync before every acknowledgement against a single server (lab/chaos/cluster.py)."""
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nats.errors
import orjson
import websockets

import bus
from lab.chaos import cluster as bench_cluster
from lab.chaos import netns
from lab.common.postgres import LocalPostgres, binary
from ops import cluster, procs
from ops.up import Entry, Stack
from schemas import roles, subjects
from schemas.messages import Usage, encode
from schemas.revision import revision

REFUSALS = {"unavailable", "overloaded", "rate_limit_exceeded", "concurrency_limit_exceeded", "too_many_requests"}
SERVICES = ("worker", "router", "tokenizer", "gateway", "recorder")
RECORDS_SCENARIOS = ("database-restart", "backlog-full")
ROLLS = ("roll-workers", "roll-gateways", "roll-router", "roll-tokenizer", "roll-revision")   # planned changes
CANARY_SHARE = 0.5                    # roll-revision: the new revision's share of the requests once it serves
SCENARIOS = ("none", *(f"kill-{s}" for s in SERVICES), *(f"stop-{s}" for s in SERVICES), *ROLLS, "broker-restart",
             "poison", "slow-client", "overload", *RECORDS_SCENARIOS)
NODE_SCENARIOS = ("kill-leader-node", "kill-follower-node", "partition-node")
CLUSTER_SCENARIOS = ("none", *NODE_SCENARIOS, "throughput")         # the default of --cluster
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
CLUSTER_SIZE = 3
NODE_DOWN_SECONDS = 5.0               # a killed node comes back, as its supervisor would bring it
PARTITION_SECONDS = 10.0
FILLER_TENANT = "chaosfill"           # backlog-full's filler records: a tenant of their own, not checked
BACKLOG_ROOM = 300_000                # bytes TB_USAGE gets in backlog-full: 10% of it above the refusal
BACKLOG_HOLD = 5.0                    # seconds the backlog stays full before the database returns
META = "meta"                         # JetStream's meta group: it creates streams and consumers


@dataclass(slots=True)
class Outcome:
    """What one client saw of one request."""
    frames: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    end: dict | None = None
    cut: bool = False
    frame: dict = field(default_factory=dict)        # the generate frame, sent again if it was never accepted
    resume_id: str | None = None                     # from its accepted frame
    resumed: int = 0                                 # times its client resumed it on a new connection
    sent_at: float = 0.0                             # time.monotonic() of its generate frame
    first_at: float = 0.0                            # and of its first token


@dataclass(slots=True)
class Result:
    scenario: str
    sent: int = 0
    accepted: int = 0
    completed: int = 0
    wrong: int = 0
    errors: int = 0
    resumed: int = 0
    cut: int = 0
    lost: int = 0
    duplicated: int = 0
    poison_sent: int = 0
    poison_answered: int = 0
    recovery_s: float | None = None
    leaderless_s: float | None = None     # a node scenario: the longest a stream the node led had no leader
    workers_registered: int = 0
    stored: int = 0                       # requests in TB_REQUESTS (probes included)
    recorded: int = 0                     # of them, with a completion record in TB_RESULTS
    metered: int = 0                      # of them, with a usage record (the database's, or still on the bus)
    misbilled: int = 0                    # completed requests whose usage record is missing or differs
    backlog_refused: int = 0              # requests and probes refused with "metering backlog full"
    ttft_before_ms: list[float] | None = None   # a roll: TTFT p50 and p99 of the requests sent before it
    ttft_during_ms: list[float] | None = None   # and of those sent while it ran (the latency it added)
    canary: int = 0                       # roll-revision: completed requests the new revision answered
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        broken = self.wrong or self.lost or self.duplicated or self.errors or self.misbilled
        return not broken and self.poison_answered == self.poison_sent


class Client:
    """One websocket connection at a time: sends resumable generate frames and files every frame under its
    request. When the connection drops, it connects to the next gateway (or the same, back again) and
    resumes there every request still unanswered, from the tokens it has."""

    def __init__(self, urls: list[str], outcomes: dict[str, Outcome], read: bool = True, at: int = 0):
        self.urls, self.outcomes, self.read, self.at = urls, outcomes, read, at
        self.ws = None
        self.mine: set[str] = set()
        self.aliases: dict[str, str] = {}         # resume id -> client id: a resumed stream's frames carry it
        self.reader: asyncio.Task | None = None
        self.closing = False                      # we close it: what is unanswered then is lost, not cut
        self.may_read = asyncio.Event()
        self.lock = asyncio.Lock()                # a send waits while the connection is made again
        if read:
            self.may_read.set()

    async def open(self) -> None:
        self.ws = await websockets.connect(self.urls[self.at % len(self.urls)], max_size=None, open_timeout=10)
        self.reader = asyncio.create_task(self.read_loop())

    async def send(self, cid: str, frame: dict) -> None:
        frame = {"type": "generate", "id": cid, **frame, "resumable": True}
        self.outcomes[cid] = Outcome(frame=frame, sent_at=time.monotonic())
        self.mine.add(cid)
        async with self.lock:
            with contextlib.suppress(websockets.ConnectionClosed, OSError):   # the reader resumes it
                await self.ws.send(json.dumps(frame))   # json: ints past 64 bits

    async def reopen(self, attempts: int = 20) -> None:
        """The next gateway that answers (the one that dropped us last), within `attempts` half-seconds."""
        for _ in range(attempts):
            self.at += 1
            with contextlib.suppress(OSError, TimeoutError, websockets.InvalidHandshake):
                await self.open()
                return
            await asyncio.sleep(0.5)
        raise TimeoutError("no gateway came back")

    async def read_loop(self) -> None:
        await self.may_read.wait()
        try:
            async for text in self.ws:
                frame = orjson.loads(text)
                got = self.outcomes.get(self.aliases.get(frame.get("id"), frame.get("id")))
                if got is None:
                    continue
                got.frames.append(frame)
                if frame["type"] == "accepted":
                    got.resume_id = frame["resume_id"]
                elif frame["type"] == "delta":
                    got.tokens += frame["token_ids"]
                    got.first_at = got.first_at or time.monotonic()
                else:
                    got.end = frame
        except websockets.ConnectionClosed:
            pass
        if not self.closing:
            await self.resume()

    async def resume(self) -> None:
        """The connection dropped: every unanswered request goes on over a new one, or is cut."""
        async with self.lock:
            left = [cid for cid in self.mine if self.outcomes[cid].end is None]
            try:
                await self.reopen()
            except TimeoutError:
                for cid in left:
                    self.outcomes[cid].cut = True
                return
            for cid in left:
                o = self.outcomes[cid]
                o.resumed += 1
                frame = o.frame
                if o.resume_id is not None:
                    self.aliases[o.resume_id] = cid
                    frame = {"type": "resume", "id": o.resume_id, "offset": len(o.tokens)}
                with contextlib.suppress(websockets.ConnectionClosed, OSError):
                    await self.ws.send(json.dumps(frame))

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
                           worker_args=["--max-num-seqs", str(args.max_num_seqs)],
                           gateways=2 if scenario in ("kill-gateway", "roll-gateways") else 1,
                           partitions=args.bus_partitions)
        self.canary = self.canary_revision = None
        self.canary_expected: dict[str, list[int]] = {}
        if scenario == "roll-revision":               # a new revision of the served model, a canary with no worker
            from workers.models.builder import build_tiny_model
            self.canary = str(build_tiny_model(data_dir / "canary-model", seed=1))
            self.canary_revision = revision(self.canary)
            name = os.path.basename(os.path.normpath(model))
            self.stack.models = [Entry(model, name), Entry(self.canary, name, workers=0, share=CANARY_SHARE)]
        self.outcomes: dict[str, Outcome] = {}
        self.result = Result(scenario)
        self.fault_at = self.fault_end = 0.0
        self.probe_done: list[float] = []
        self.pg = None

    def run(self) -> Result:
        self.net = netns.Network(CLUSTER_SIZE).create() if self.args.cluster and not self.args.no_netns else None
        if self.args.cluster:
            data = self.stack.data_dir
            self.stack.nats_nodes = self.net.nodes(data) if self.net else cluster.local_nodes(CLUSTER_SIZE, data)
        if postgres_here() is None:
            self.pg = LocalPostgres().start()
            self.stack.database = self.pg.url
        try:
            self.stack.start()
            self.stack.wait_ready()
            asyncio.run(self.load())
            if self.stack.nats_nodes:                 # the logs are read once the cluster is whole again
                cluster.wait_ready(self.stack.nats_nodes)
            r = self.result
            answered = r.completed + len(self.probe_done)    # each has its records on the way: wait for them all
            r.stored, r.recorded, r.duplicated, r.metered = asyncio.run(logs(
                self.stack.nats_url, answered, partitions=self.stack.partitions, database=self.stack.database_url))
            self.bill(asyncio.run(usage_records(self.stack.nats_url, self.stack.database_url, self.stack.partitions)))
            self.result.workers_registered = asyncio.run(registered(self.stack.nats_url))
        finally:
            self.stack.stop()
            if self.net:
                self.net.delete()
            if self.pg is not None:
                self.pg.close()
        return self.result

    def bill(self, metered: list) -> None:
        """misbilled: each completed request's usage record against what its client got (prompt and output
        tokens, from its done frame)."""
        by_id = {u.id: u for u in metered}
        for cid, o in self.outcomes.items():
            end = o.end
            if end is None or end["type"] != "done" or o.resume_id is None or cid not in self.expected or \
                    o.tokens != self.wanted(cid, end):
                continue
            u = by_id.get(o.resume_id.rsplit(".", 1)[0])
            if u is None or (u.prompt_tokens, u.completion_tokens) != (end["usage"]["prompt_tokens"],
                                                                      end["usage"]["completion_tokens"]):
                self.result.misbilled += 1
                self.result.notes.append(f"{cid}: billed {u and (u.prompt_tokens, u.completion_tokens)}, "
                                         f"served {end['usage']}")

    async def load(self) -> None:
        a = self.args
        clients = [Client(self.stack.urls, self.outcomes, at=i) for i in range(a.clients)]
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
        self.fault_end = time.monotonic()
        if self.scenario in ROLLS:                    # and after it: what replaced the old serves (the canary's
            for i in range(n, n + (n if self.canary else n // 3)):      # share of a whole load more)
                await clients[i % len(clients)].send(f"c{i}", request(f"c{i}", a.max_tokens))
                self.result.sent += 1
                await asyncio.sleep(pace)
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
        if self.scenario in NODE_SCENARIOS:
            await self.node_fault()
            return
        kind, _, target = self.scenario.partition("-")
        name = "w1" if target == "worker" else target
        if kind == "roll":
            await self.roll(target)
        elif kind == "kill":
            if name == "gateway":
                await self.streaming_on(clients, 0)
            self.stack.kill(name)
            await asyncio.sleep(RESTART_AFTER)
            self.stack.restart(name)
        elif kind == "stop":
            os.kill(self.stack.children[name].pid, signal.SIGSTOP)
            await asyncio.sleep(STOP_SECONDS)
            os.kill(self.stack.children[name].pid, signal.SIGCONT)
        elif self.scenario == "database-restart":
            await asyncio.to_thread(self.pg.stop, "immediate")
            await asyncio.sleep(self.args.database_down)
            await asyncio.to_thread(self.pg.start)
        elif self.scenario == "backlog-full":
            await self.backlog_full()
        elif self.scenario == "broker-restart":
            self.stack.kill("nats")
            await asyncio.sleep(BROKER_DOWN_SECONDS)
            self.stack.restart_nats()            # in this thread: a child dies with the thread that started it
        elif self.scenario == "poison":
            await self.poison()
        elif self.scenario == "slow-client":
            await self.slow_client()

    async def roll(self, target: str) -> None:
        """A rolling upgrade of every process of a kind, one by one, as Kubernetes rolls a Deployment: a
        replacement is started and ready before the old one is drained (SIGTERM: it finishes what it holds,
        bus/lifecycle.py) and gone; gateways, whose port the replacement takes, are drained first and then
        started again, their clients reconnecting to the other gateway meanwhile."""
        stack = self.stack
        names = {"workers": list(stack.worker_roles), "gateways": stack.gateway_names, "router": list(stack.routers),
                 "tokenizer": ["tokenizer"], "revision": ["w1"]}[target]
        for name in names:
            if target == "gateways":
                await asyncio.to_thread(self.drained, name)
                stack.restart(name)
                await asyncio.to_thread(self.ready, name, "gateway ready")
                continue
            old = stack.children[name]
            args = list(old.args[old.args.index("-m") + 2:])
            new = f"{name}-v2"
            if target == "revision":                  # w1 moves to the new revision, the canary's only worker
                args[args.index("--model") + 1] = self.canary
            if "--id" in args:
                args[args.index("--id") + 1] = new
            else:
                args += ["--id", new]
            role = "worker" if target in ("workers", "revision") else target
            stack.spawn(new, old.args[old.args.index("-m") + 1], *args, env=stack.envs.get(name), role=role)
            await asyncio.to_thread(self.ready, new, f"{role} ready")
            await asyncio.to_thread(self.drained, name)
            stack.children.pop(name)

    def drained(self, name: str, timeout: float = subjects.DRAIN_TIMEOUT) -> None:
        """SIGTERM to the process, then until it has exited (its drain done)."""
        child = self.stack.children[name]
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout)
        if code != 0:
            self.result.notes.append(f"{name} exited with code {code} after its drain")

    def ready(self, name: str, line: str, timeout: float = 120.0) -> None:
        """Until the process's log says `line` (its \"... ready\" event) since it started."""
        deadline = time.monotonic() + timeout
        while f'"{line}"' not in self.stack.log(name).read_text(errors="replace")[self.stack.log_starts.get(name, 0):]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} was not ready within {timeout:.0f} s")
            time.sleep(0.1)

    async def streaming_on(self, clients: list["Client"], gateway: int, within: float = 10.0) -> None:
        """Until a request is in flight (accepted, not ended) on a client of that gateway, so that killing
        it cuts a stream: the tiny model can answer a request between two sends."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for c in clients:
                if c.at % len(c.urls) != gateway:
                    continue
                if any(o.resume_id and o.end is None for o in map(self.outcomes.get, c.mine) if o is not None):
                    return
            await asyncio.sleep(0.005)

    async def node_fault(self) -> None:
        """SIGKILL of TB_REQUESTS' leader or of the follower that leads fewest streams (back after
        NODE_DOWN_SECONDS), or a PARTITION_SECONDS cut of TB_REQUESTS' leader; measures how long the
        streams it led went without another leader. start_node runs in this thread, which owns the stack."""
        nc = await bus.connect(self.stack.nats_url, "tokenbus-chaos", role="admin")
        js = nc.jetstream(timeout=0.5)
        try:
            leaders = await self.leaders(js)
            target = leaders[subjects.stream(subjects.REQUESTS_STREAM, subjects.parts(self.stack.partitions)[0])]
            if self.scenario == "kill-follower-node":
                followers = [n.name for n in self.stack.nats_nodes if n.name != target]
                target = min(followers, key=list(leaders.values()).count)
            led = [s for s, name in leaders.items() if name == target]
            self.result.notes.append(f"{target} led {', '.join(led) or 'nothing'}")
            node = next(n for n in self.stack.nats_nodes if n.name == target)
            others = [n for n in self.stack.nats_nodes if n is not node]
            cut, start = self.scenario == "partition-node", time.monotonic()
            if cut:
                self.net.cut(node)
            else:
                self.stack.kill(target)
            took = [await relead(js, others, s, target, start) for s in led]
            self.result.leaderless_s = round(max(took, default=0.0), 1)
            down = PARTITION_SECONDS if cut else NODE_DOWN_SECONDS
            await asyncio.sleep(max(0.0, down - (time.monotonic() - start)))
            if cut:
                self.net.heal(node)
            else:
                self.stack.start_node(target)
        finally:
            await nc.close()

    async def leaders(self, js) -> dict[str, str]:
        """The leader of every stream and bucket, and of JetStream's meta group (META), by server name."""
        while True:                                                    # a look may go unanswered on a busy CPU
            leaders = {s: await cluster.stream_leader(js, s) for s in roles.all_streams(self.stack.partitions)}
            leaders[META] = await asyncio.to_thread(cluster.meta_leader, self.stack.nats_nodes[0])
            if None not in leaders.values():
                return leaders

    async def backlog_full(self) -> None:
        """PostgreSQL stopped; TB_USAGE given BACKLOG_ROOM bytes and filled to the refusal with filler records;
        held BACKLOG_HOLD s; PostgreSQL started again: the note says how long admission refused."""
        from services.gateway.app import backed_up

        nc = await bus.connect(self.stack.nats_url, "tokenbus-chaos", role="admin")
        try:
            js = nc.jetstream()
            await asyncio.to_thread(self.pg.stop, "immediate")
            kept = {}
            for part in subjects.parts(self.stack.partitions):
                name = subjects.stream(subjects.USAGE_STREAM, part)
                info = await js.stream_info(name)
                kept[name] = info.config
                await js.update_stream(dataclasses.replace(info.config, max_bytes=info.state.bytes + BACKLOG_ROOM))
            i, start = 0, time.monotonic()
            while not await backed_up(js):
                filler = Usage(f"fill{i}", FILLER_TENANT, "", "filler", "ws", "stop", 1, 0, 1, {}, time.time(),
                               time.time())
                with contextlib.suppress(Exception):            # a partition already full refuses its share
                    await js.publish(subjects.usage(FILLER_TENANT, filler.id), encode(filler),
                                     headers=subjects.msg_id(filler.id))
                i += 1
            full = time.monotonic()
            await asyncio.sleep(BACKLOG_HOLD)
            await asyncio.to_thread(self.pg.start)
            while await backed_up(js):
                await asyncio.sleep(0.2)
            back = time.monotonic()
            for config in kept.values():
                await js.update_stream(config)
            self.result.notes.append(f"backlog full after {full - start:.1f} s ({i} filler records); admission "
                                     f"refused {back - full:.1f} s, until {back - full - BACKLOG_HOLD:.1f} s after "
                                     f"the database returned")
        finally:
            await nc.close()

    async def poison(self) -> None:
        client = Client(self.stack.urls, self.outcomes)
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
        client = Client(self.stack.urls, self.outcomes, read=False)
        await client.open()
        for i in range(4):
            cid = f"slow{i}"
            await client.send(cid, request(cid, self.args.max_tokens))
            self.result.sent += 1
        await asyncio.sleep(SLOW_CLIENT_SECONDS)
        client.may_read.set()

    async def probe(self) -> None:
        """A short request every PROBE_INTERVAL from the fault on, each on a fresh connection, to the
        gateways in turn."""
        while not self.fault_at:
            await asyncio.sleep(0.05)
        tasks = []
        for i in range(int(self.args.patience / PROBE_INTERVAL)):
            tasks.append(asyncio.create_task(self.one_probe(i)))
            await asyncio.sleep(PROBE_INTERVAL)

    async def one_probe(self, i: int) -> None:
        with contextlib.suppress(Exception):
            urls = self.stack.urls
            async with websockets.connect(urls[i % len(urls)], open_timeout=5) as ws:
                await ws.send(orjson.dumps({"type": "generate", "id": "p", "prompt": f"probe {i}", "max_tokens": 2,
                                            "temperature": 0, "ignore_eos": True}).decode())
                while True:
                    frame = orjson.loads(await ws.recv())
                    if frame["type"] == "done":
                        self.probe_done.append(time.monotonic())
                        return
                    if frame["type"] == "error":
                        self.result.backlog_refused += "metering backlog full" in frame.get("message", "")
                        return

    def wanted(self, cid: str, end: dict) -> list[int]:
        """The offline engine's tokens for the request, of the revision that answered it (roll-revision)."""
        if self.canary is not None and end.get("revision") == self.canary_revision:
            if not self.canary_expected:
                self.canary_expected = expected_tokens(self.canary, list(self.expected), self.args.max_tokens)
            return self.canary_expected[cid]
        return self.expected[cid]

    def score(self) -> None:
        r = self.result
        for cid, o in self.outcomes.items():
            if cid.startswith("poison"):
                continue
            end = o.end
            if end is not None and end["type"] == "error" and end.get("code") in REFUSALS and not o.tokens:
                r.backlog_refused += "metering backlog full" in end.get("message", "")
                continue                                  # refused at admission: not accepted
            r.accepted += 1
            r.resumed += o.resumed > 0
            if end is None:
                r.cut += o.cut
                r.lost += not o.cut
            elif end["type"] == "error":
                r.errors += 1
                r.notes.append(f"{cid}: {end.get('code')}: {end.get('message', '')[:80]}")
            elif o.tokens == self.wanted(cid, end) and end["usage"]["completion_tokens"] == len(o.tokens):
                r.completed += 1
                r.canary += self.canary is not None and end.get("revision") == self.canary_revision
            else:
                r.wrong += 1
        after = [t for t in self.probe_done if t >= self.fault_at]
        if after:
            r.recovery_s = round(after[0] - self.fault_at, 2)
        if self.scenario in ROLLS:
            firsts = [(o.sent_at, (o.first_at - o.sent_at) * 1e3) for cid, o in self.outcomes.items()
                      if o.first_at and cid.startswith("c")]
            r.ttft_before_ms = percentiles([t for at, t in firsts if at < self.fault_at])
            r.ttft_during_ms = percentiles([t for at, t in firsts if self.fault_at <= at <= self.fault_end])
            r.notes.insert(0, f"TTFT p50, p99: {r.ttft_before_ms} ms before the roll, {r.ttft_during_ms} ms during it")
        if self.canary is not None:
            r.notes.insert(1, f"{r.canary} of {r.completed} completed requests answered by the new revision "
                              f"{self.canary_revision} (share {CANARY_SHARE:g} once it served), each with its tokens")


def percentiles(ms: list[float]) -> list[float] | None:
    """[p50, p99] of these milliseconds, rounded; None if there are none."""
    if not ms:
        return None
    ms = sorted(ms)
    return [round(ms[len(ms) // 2], 1), round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1)]


async def relead(js, nodes: list[cluster.Node], stream: str, old: str, start: float, timeout: float = 60.0) -> float:
    """Seconds from start until `stream` (or META, as `nodes` see it) has a leader other than `old`."""
    async def leader() -> str | None:
        if stream == META:
            return await asyncio.to_thread(cluster.meta_leader, nodes[0])
        return await cluster.stream_leader(js, stream)
    while await leader() in (None, old) and time.monotonic() - start < timeout:
        await asyncio.sleep(0.1)
    return time.monotonic() - start


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


async def usage_records(nats_url: str, database: str, partitions: int = 1) -> list:
    """Every usage record but the filler's: the recorder's database's and those still on the bus (of its
    partitions), once each."""
    from ops import usage as metering
    from services.recorder.store import Window

    return [u for u in await metering.requests(nats_url, database, Window(), partitions)
            if u.tenant != FILLER_TENANT]


async def logs(nats_url: str, want: int = 0, timeout: float = 30.0, partitions: int = 1,
               database: str | None = None) -> tuple[int, int, int, int]:
    """From the stack's logs: (requests stored in TB_REQUESTS, request ids with a completion record,
    completion records beyond the first of a request id, request ids with a usage record: in the
    recorder's database or still on the bus), summed over the partitions of a partitioned bus. The
    completion and usage records are stored after the client's last frame (retried through a leader
    change), so with `want` the logs are read again until each holds `want` request ids or `timeout`
    seconds pass."""
    from schemas.messages import Completion, GenerateRequest

    nc = await bus.connect(nats_url, "tokenbus-chaos", role="admin")
    deadline = time.monotonic() + timeout
    try:
        js = nc.jetstream(timeout=10)
        while True:
            try:
                requests, done = [], []
                for part in subjects.parts(partitions):
                    requests += await ids(js, subjects.REQUESTS_STREAM, part, GenerateRequest)
                    done += await ids(js, subjects.RESULTS_STREAM, part, Completion,
                                      lambda c: c.finish_reason != "error")
                metered = {u.id for u in await usage_records(nats_url, database, partitions)} if database else set()
            except nats.errors.TimeoutError:
                # a cluster still settling after a fault (a stream's new leader, a consumer being placed)
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
                continue
            counts = len(requests), len(set(done)), len(done) - len(set(done)), len(metered)
            if min(counts[0], counts[1], counts[3]) >= want or time.monotonic() > deadline:
                return counts
            await asyncio.sleep(0.5)
    finally:
        await nc.close()


def postgres_here() -> str | None:
    """Why no PostgreSQL can be started here (None: it can)."""
    try:
        binary("pg_ctl")
    except FileNotFoundError as e:
        return str(e)
    return None


async def ids(js, base: str, part: int | None, cls: type, keep=None) -> list[str]:
    """The request id of every record of stream `base` (of partition `part`; those keep() is true of), in
    order."""
    from schemas.messages import decode

    stream = subjects.stream(base, part)
    count, out = (await js.stream_info(stream)).state.messages, []
    if count:
        sub = await js.subscribe(subjects.stream_subjects(base, part)[0], stream=stream, ordered_consumer=True)
        try:
            for _ in range(count):
                record = decode((await sub.next_msg(timeout=10)).data, cls)
                if keep is None or keep(record):
                    out.append(record.id)
        finally:
            await sub.unsubscribe()
    return out


async def registered(nats_url: str) -> int:
    nc = await bus.connect(nats_url, "tokenbus-chaos", role="admin")
    try:
        return len(await bus.live_workers(await bus.registry(nc.jetstream())))
    finally:
        await nc.close()


COLUMNS = ("scenario", "sent", "accepted", "completed", "lost", "duplicated", "wrong", "errors", "resumed", "cut",
           "misbilled", "poison", "recovery_s", "workers")


def row(r: Result, leaderless: bool) -> list[str]:
    poison = f"{r.poison_answered}/{r.poison_sent}" if r.poison_sent else "-"
    recovery = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
    cells = [r.scenario, *(str(getattr(r, k)) for k in ("sent", "accepted", "completed", "lost", "duplicated",
                                                         "wrong", "errors", "resumed", "cut", "misbilled")),
             poison, recovery,
             str(r.workers_registered)]
    return cells + ["-" if r.leaderless_s is None else f"{r.leaderless_s:.1f}"] * leaderless


def table(results: list[Result]) -> str:
    leaderless = any(r.leaderless_s is not None for r in results)      # a cluster run
    columns = [*COLUMNS, "leaderless_s"] if leaderless else list(COLUMNS)
    rows = [columns, *(row(r, leaderless) for r in results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(args) -> int:
    from workers.models.catalogue import resolve

    known = CLUSTER_SCENARIOS + SCENARIOS if args.cluster else SCENARIOS
    args.scenarios = args.scenarios or list(CLUSTER_SCENARIOS if args.cluster else SCENARIOS)
    unknown = [s for s in args.scenarios if s not in known]
    if unknown:
        needs = " (with --cluster)" if unknown[0] in CLUSTER_SCENARIOS else ""
        raise ValueError(f"unknown scenario {unknown[0]!r}{needs}; choose from: {', '.join(dict.fromkeys(known))}")
    args.no_netns = netns.available() if args.cluster else None
    faults = [s for s in args.scenarios if s != "throughput"]
    model = resolve(args.model or "tiny")
    cids = [f"c{i}" for i in range(3 * args.requests)] + [f"slow{i}" for i in range(4)]
    where = f" on a {CLUSTER_SIZE}-node nats cluster" if args.cluster else ""
    print(f"tokenbus chaos: {len(faults)} scenario(s), {args.requests} greedy requests of {args.max_tokens} "
          f"tokens each on {args.workers} workers{where}; offline reference ...", file=sys.stderr, flush=True)
    expected = expected_tokens(model, cids, args.max_tokens) if faults else {}
    results = []
    root = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="tokenbus-chaos-"))
    for scenario in faults:
        if scenario == "partition-node" and args.no_netns:
            results.append(Result(f"{scenario} (not run: {args.no_netns})"))
            continue
        if scenario in RECORDS_SCENARIOS and postgres_here():
            results.append(Result(f"{scenario} (not run: {postgres_here()})"))
            continue
        print(f"tokenbus chaos: {scenario} ...", file=sys.stderr, flush=True)
        r = Run(scenario, model, expected, args, root / scenario).run()
        results.append(r)
        for note in r.notes[:5]:
            print(f"  {scenario}: {note}", file=sys.stderr, flush=True)
    rows = []
    if "throughput" in args.scenarios:
        print("tokenbus chaos: throughput of 1 server and of a 3-node cluster, fsync every 2 min and always, "
              "and of 3 partitions on 3 and on 9 servers ...",
              file=sys.stderr, flush=True)
        rows = bench_cluster.measure(model, root / "throughput", args.requests, args.workers)
    scenarios = [{**asdict(r), "clean": r.clean} for r in results]
    if args.json:
        out = {"scenarios": scenarios, "throughput": bench_cluster.as_json(rows)} if args.cluster else scenarios
        print(json.dumps(out, indent=2))
    else:
        print("\n\n".join([*([table(results)] if results else []), *([bench_cluster.table(rows)] if rows else [])]))
        print(f"logs: {root}")
    return 0 if all(r.clean for r in results) else 1

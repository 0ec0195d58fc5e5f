"""`tokenbus up`: the whole local stack as processes. An embedded nats-server (unless --nats-url names
a running one), then tokenizer, router, the workers (N colocated ones, w0..; for disaggregated serving
P prefill workers, p0.., and D decode workers, d0..) and the gateways; it waits until every stage is
pulling and every worker is registered, prints where to connect, and on Ctrl-C or SIGTERM stops every
child (each child also gets SIGTERM from the kernel if this process dies)."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import bus as nats_bus
from ops import broker, bus, cluster, health, procs, retention
from ops.models import resolve
from ops.status import heartbeats
from schemas import generation, records, served, subjects
from schemas.credentials import CA_ENV, CREDS_ENV, USER_ENV, Credentials, default_dir
from schemas.revision import revision
from schemas.served import Served
from services.gateway import keys
from services.recorder.store import Database, redacted
from workers.models.builder import tokenbus_home
from workers.models.gguf import hf_dir

READY_TIMEOUT = 180.0
TAIL_LINES = 20                                   # of a child's log, shown when it fails to start


@dataclass(slots=True)
class Entry:
    """One model of the stack, as --model or an entry of a models file names it (the path resolved)."""
    model: str                                    # an HF checkpoint directory or a GGUF file
    name: str | None = None                       # its served name (default: the directory's or file's name)
    workers: int | None = None                    # its colocated workers (default: the stack's `workers`)
    share: float = 0.0                            # a canary: this share of its name's requests (0: stable)

    @property
    def served_name(self) -> str:
        return self.name or os.path.basename(os.path.normpath(self.model))


MODEL_KEYS = {"model", "name", "workers", "share"}


def read_models(path: str) -> list[Entry]:
    """The entries of a models file (`tokenbus up --models FILE`), their models resolved; ValueError naming
    the file, the entry and the key:
    {"models": [{"model": DIR|GGUF|NAME, "name": "chat", "workers": 1, "share": 0.05}, ...]}."""
    try:
        entries = json.loads(Path(path).read_text())["models"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--models {path}: not a models file, {{\"models\": [...]}} ({type(e).__name__}: {e})") \
            from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models {path}: \"models\" must be a non-empty list of entries")
    out = []
    for i, m in enumerate(entries):
        where = f"--models {path}: models[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("model"), str):
            raise ValueError(f"{where}.model: required, a directory, GGUF file or model name")
        if extra := sorted(m.keys() - MODEL_KEYS):
            raise ValueError(f"{where}.{extra[0]}: unknown key (known: {', '.join(sorted(MODEL_KEYS))})")
        if not isinstance(m.get("name", ""), str):
            raise ValueError(f"{where}.name: expected a string")
        workers = m.get("workers", 1)
        if type(workers) is not int or workers < 0:
            raise ValueError(f"{where}.workers: expected a whole number from 0, got {workers!r}")
        share = m.get("share", 0.0)
        if "share" in m and (type(share) not in (int, float) or not 0 < share < 1):
            raise ValueError(f"{where}.share: {share!r} must be a number in (0, 1): the canary's share of its "
                             "name's requests")
        out.append(Entry(resolve(m["model"]), m.get("name"), workers, float(share)))
    return out


class ChildFailed(RuntimeError):
    """A child of the stack exited: which (`name`), and its `log` from offset `since` (where this run began)."""
    def __init__(self, message: str, name: str, log: Path, since: int = 0):
        super().__init__(f"{message}; see {log}")
        self.name, self.log, self.since = name, log, since

    def tail(self, lines: int = TAIL_LINES) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.since)
            return b"".join(f.readlines()[-lines:]).decode(errors="replace").rstrip()


@dataclass
class Stack:
    """The processes of a local stack, started in order and stopped in reverse."""
    model: str
    port: int
    data_dir: Path
    nats_url: str | None = None
    nats_port: int = 4222
    workers: int = 1
    worker_args: list[str] = field(default_factory=list)
    api_keys: str | None = None                   # the gateway's keys file; without one it serves loopback only
    host: str = "127.0.0.1"                       # the gateway's address
    router_args: list[str] = field(default_factory=list)     # e.g. ["--policy", "round-robin"]
    tokenizer_args: list[str] = field(default_factory=list)  # e.g. ["--max-model-len", "512"]
    gateway_args: list[str] = field(default_factory=list)    # e.g. ["--request-timeout", "30"]
    worker_env: dict[str, str] = field(default_factory=dict)  # e.g. OMP_NUM_THREADS
    nats_host: str = "127.0.0.1"                  # the embedded nats-server's address
    bus_creds: Path | None = None                 # nkey seeds, <role>.nk (missing ones generated): the bus authorizes
    tls: bus.Tls | None = None                    # the embedded nats-server's certificate
    tls_ca: Path | None = None                    # what every service verifies the server's certificate with
    gateways: int = 1                             # "gateway" on port, then "gateway1" on port + 1, ...
    nats_nodes: list[cluster.Node] = field(default_factory=list)  # a nats cluster to start instead of one server
    nats_sync: str | None = None                  # the started nats-servers' fsync; None: always on a cluster,
                                                  # NATS's default (2m) on one server (docs/cluster.md)
    children: dict[str, subprocess.Popen] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)    # each child's own environment
    log_starts: dict[str, int] = field(default_factory=dict)  # each child's log size when it started
    prefill_workers: int = 0                      # workers with --role prefill, after the `workers` colocated ones
    decode_workers: int = 0                       # and with --role decode
    models: list[Entry] = field(default_factory=list)   # the models served; none: `model` alone
    served: list[Served] = field(default_factory=list)  # what the tokenizer and gateways are told (plan())
    partitions: int = 1                           # the bus's partitions (TB_BUS_PARTITIONS): a router for each
    storage: int = subjects.DEFAULT_BUS_STORAGE   # what the streams may hold in all (TB_BUS_STORAGE; ops/retention.py)
    database: str | None = None                   # the recorder's; None: SQLite under data_dir
    archive: str | None = None                    # the request log's archive; None: data_dir/archive
    recorder_port: int = 0                        # the recorder's /metrics (0: none)
    otlp_endpoint: str | None = None              # every service's --otlp-endpoint (docs/tracing.md); None: none given

    @property
    def address(self) -> str:
        """Where this machine reaches the gateway."""
        return procs.reachable(self.host)

    @property
    def credentials(self) -> Credentials | None:
        """What every process of the stack connects with; None: the environment's, as any process."""
        if self.bus_creds is None and self.tls_ca is None:
            return None
        return Credentials(self.bus_creds, self.tls_ca)

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def http(self) -> str:
        return self.https[0]

    @property
    def gateway_names(self) -> list[str]:
        return ["gateway", *(f"gateway{i}" for i in range(1, self.gateways))]

    @property
    def urls(self) -> list[str]:
        """Every gateway's websocket, in the order of gateway_names."""
        return [f"ws://{self.address}:{self.port + i}/ws" for i in range(self.gateways)]

    @property
    def https(self) -> list[str]:
        return [f"http://{self.address}:{self.port + i}" for i in range(self.gateways)]

    @property
    def entries(self) -> list[Entry]:
        return self.models or [Entry(self.model)]

    @property
    def worker_plan(self) -> dict[str, tuple[str, Entry]]:
        """Every worker's id, role and model: w0.. colocated (both), each model's in turn, then p0.. prefill and
        d0.. decode (of the first model: disaggregated serving serves one)."""
        colocated = [e for e in self.entries for _ in range(self.workers if e.workers is None else e.workers)]
        first = self.entries[0]
        return {**{f"w{i}": ("both", e) for i, e in enumerate(colocated)},
                **{f"p{i}": ("prefill", first) for i in range(self.prefill_workers)},
                **{f"d{i}": ("decode", first) for i in range(self.decode_workers)}}

    @property
    def worker_roles(self) -> dict[str, str]:
        return {name: role for name, (role, _) in self.worker_plan.items()}

    def plan(self) -> list[Served]:
        """What the tokenizer and the gateways serve: each model's name, revision (a hash of its weights,
        cached beside them), files (a GGUF's tokenizer and config, as the files they read) and canary share;
        ValueError naming the rule a models file breaks."""
        if not self.served:
            self.served = [Served(e.served_name, revision(e.model) if Path(e.model).exists() else "", hf_dir(e.model),
                                  e.share) for e in self.entries]     # a missing model: its worker says so
            served.check(self.served)
        return self.served

    def start(self) -> None:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        models_file = self.data_dir / "served-models.json"
        served.dump(self.plan(), models_file)
        if self.nats_nodes:
            self.start_cluster()
        elif self.nats_url is None:
            self.start_nats()
            self.nats_url = f"nats://{procs.reachable(self.nats_host)}:{self.nats_port}"
        asyncio.run(prepare(self.nats_url, self.credentials, self.partitions, self.storage))
        common = ["--nats-url", self.nats_url]
        self.spawn("tokenizer", "services.tokenizer", *common, "--models", str(models_file), *self.tokenizer_args)
        for name, part in self.routers.items():
            self.spawn(name, "services.router", *common, *self.router_args,
                       *([] if part is None else ["--partition", str(part)]))
        self.spawn("recorder", "services.recorder", *common, "--database", self.database_url, "--archive",
                   self.archive_url, *(["--metrics-port", str(self.recorder_port)] if self.recorder_port else []))
        for name, (role, entry) in self.worker_plan.items():
            self.spawn(name, "workers.service", *common, "--model", entry.model, "--served-model-name",
                       entry.served_name, "--id", name, *([] if role == "both" else ["--role", role]),
                       *(a.replace("{worker}", name) for a in self.worker_args), env=self.worker_env, role="worker")
        keys_arg = ["--api-keys", self.api_keys] if self.api_keys else []
        for i, name in enumerate(self.gateway_names):
            self.spawn(name, "services.gateway", *common, "--models", str(models_file), "--host", self.host,
                       "--port", str(self.port + i), *keys_arg, *self.gateway_args, role="gateway")

    @property
    def database_url(self) -> str:
        return self.database or records.sqlite_url(self.data_dir)

    @property
    def archive_url(self) -> str:
        return self.archive or records.archive_dir(self.data_dir)

    @property
    def routers(self) -> dict[str, int | None]:
        """Every router's name and the partition it routes: "router" alone, or router0.. one per partition."""
        parts = subjects.parts(self.partitions)
        return {"router": None} if parts == [None] else {f"router{p}": p for p in parts}

    @property
    def secure(self) -> bool:
        """Whether the nats-servers it starts authorize (nkeys) or serve TLS."""
        return self.bus_creds is not None or self.tls is not None

    @property
    def configured(self) -> bool:
        """Whether the nats-servers it starts need a config of ours: secured, or partitioned (mappings)."""
        return self.secure or self.partitions > 1

    def start_nats(self) -> None:
        """The embedded nats-server, with a config file when the bus is authorized or TLS."""
        config = bus.write_config(self.data_dir / "nats.conf", self.bus_creds, self.tls, self.partitions) \
            if self.configured else None
        self.log_starts["nats"] = self.log_size("nats")
        try:
            self.children["nats"] = procs.start_nats(self.nats_port, self.data_dir, self.log("nats"), self.nats_host,
                                                     config, self.nats_sync)
        except RuntimeError as e:                  # it exited before listening (a port in use, a bad store)
            raise ChildFailed(str(e), "nats", self.log("nats"), self.log_starts["nats"]) from None

    def start_cluster(self) -> None:
        """Every node of nats_nodes, then waits for their meta leader; the services get the whole list."""
        for node in self.nats_nodes:
            self.start_node(node.name)
        cluster.wait_ready(self.nats_nodes)
        self.nats_url = cluster.url(self.nats_nodes)

    def start_node(self, name: str) -> None:
        """Starts (again) the cluster node `name`, on its ports and store, with the bus's authorization and
        TLS blocks if it has them. Call it from the thread that runs the tests: a child dies with the thread
        that started it (PR_SET_PDEATHSIG)."""
        node = next(n for n in self.nats_nodes if n.name == name)
        blocks = bus.config(self.bus_creds, self.tls, self.partitions) if self.configured else ""
        self.log_starts[name] = self.log_size(name)
        try:
            self.children[name] = cluster.start(node, self.nats_nodes, self.log(name), self.nats_sync or cluster.SYNC,
                                                blocks, self.partitions)
        except RuntimeError as e:
            raise ChildFailed(str(e), name, self.log(name), self.log_starts[name]) from None

    @property
    def brokers(self) -> list[str]:
        """The children that are nats-servers."""
        return [name for name in self.children if name == "nats" or name in {n.name for n in self.nats_nodes}]

    def spawn(self, name: str, module: str, *args: str, env: dict | None = None, role: str | None = None) -> None:
        """Starts a service as `role` (default: its name, less a router's number) with the stack's credentials
        for that role, told the bus's partitions and where its traces go (--otlp-endpoint)."""
        role = role or ("router" if name in self.routers else name)
        creds = self.credentials.env(role) if self.credentials else {}
        self.envs[name] = {**creds, subjects.PARTITIONS_ENV: str(self.partitions),
                           subjects.BUS_STORAGE_ENV: str(self.storage), **(env or {})}
        self.log_starts[name] = self.log_size(name)
        traced = ["--otlp-endpoint", self.otlp_endpoint] if self.otlp_endpoint else []
        self.children[name] = procs.spawn(procs.python_module(module, *args, *traced), self.log(name), self.envs[name])

    def log(self, name: str) -> Path:
        return self.data_dir / "logs" / f"{name}.log"

    def log_size(self, name: str) -> int:
        return self.log(name).stat().st_size if self.log(name).exists() else 0

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until every gateway answers /healthz, the tokenizer and router are pulling and every worker
        is registered; RuntimeError if a child exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if all(map(healthy, self.https)) and asyncio.run(pipeline_ready(self.nats_url, len(self.worker_roles),
                                                                            self.credentials, self.partitions)):
                return
            time.sleep(0.25)
        raise TimeoutError(f"the stack was not ready within {timeout:.0f} s; logs in {self.data_dir / 'logs'}")

    def check_alive(self) -> None:
        """ChildFailed for the first child that exited."""
        for name, p in self.children.items():
            if p.poll() is not None:
                raise ChildFailed(f"{name} exited with code {p.returncode}", name, self.log(name),
                                  self.log_starts.get(name, 0))

    def stop(self) -> None:
        """Services first (so none reconnects in a loop), at once (SIGINT: the stack goes as a whole, nothing
        to hand over to), nats-server last."""
        services = [p for name, p in self.children.items() if name not in self.brokers]
        procs.stop(list(reversed(services)), sig=signal.SIGINT)
        procs.stop([self.children[name] for name in self.brokers])

    def kill(self, name: str) -> None:
        self.children[name].kill()
        self.children[name].wait()

    def restart_nats(self, down: float = 0.0) -> None:
        """SIGKILLs the embedded nats-server and starts it again `down` seconds later, on the same port and
        store (what it had on disk is all it keeps); the services reconnect by themselves. Call it from the
        thread that runs the tests: a child dies with the thread that started it (PR_SET_PDEATHSIG)."""
        self.kill("nats")
        time.sleep(down)
        self.start_nats()

    def restart(self, name: str) -> None:
        """Starts `name` again with the arguments it was started with."""
        old = self.children[name]
        if old.poll() is None:
            procs.stop([old])
        self.log_starts[name] = self.log_size(name)
        self.children[name] = procs.spawn(old.args, self.log(name), self.envs.get(name))


async def prepare(nats_url: str, credentials: Credentials | None = None, partitions: int | None = None,
                  storage: int | None = None) -> None:
    """The streams made, or brought to this build's config and sized to `storage` bytes in all."""
    nc = await broker.connect(nats_url, "tokenbus-up", role="admin", credentials=credentials)
    try:
        await nats_bus.ensure_streams(nc.jetstream(), partitions, storage)
    finally:
        await nc.close()


async def pipeline_ready(nats_url: str, num_workers: int, credentials: Credentials | None = None,
                         partitions: int | None = None) -> bool:
    nc = await nats_bus.connect(nats_url, "tokenbus-up", role="admin", credentials=credentials)
    try:
        js = nc.jetstream()
        if not (await health.routing(js, partitions) and await health.answering(nc)):
            return False
        return len(await heartbeats(js)) >= num_workers
    except Exception:
        return False
    finally:
        await nc.close()


def healthy(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/healthz", timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def check_keys(host: str, api_keys: str | None) -> None:
    """ValueError (the CLI prints it) for a public address without keys or a bad keys file."""
    keys.check_exposure(host, api_keys)
    if api_keys:
        keys.load(api_keys)
    else:
        print(f"tokenbus: no --api-keys: serving {host} only, without authentication", flush=True)


def secure(args) -> dict:
    """The Stack's bus security from up's flags; ValueError naming the flag that is missing or wrong."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together: the embedded nats-server's certificate and its key")
    if args.tls_cert and args.nats_url:
        raise ValueError("--tls-cert and --tls-key are the embedded nats-server's; with --nats-url give only "
                         "--tls-ca, the CA that signed its certificate")
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, flag) and not Path(getattr(args, flag)).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: no such file")
    creds = Path(args.bus_creds) if args.bus_creds else default_dir() if args.bus_auth else None
    if args.nats_url and creds is not None:
        bus.check_seeds(creds)
    elsewhere = args.nats_url is not None and any(os.environ.get(v) for v in (CREDS_ENV, USER_ENV))
    bus.check_exposure(args.nats_host, args.nats_url, creds is not None or elsewhere)
    return {"nats_host": args.nats_host, "bus_creds": creds, "tls_ca": Path(args.tls_ca) if args.tls_ca else None,
            "tls": bus.Tls(Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None}


def bus_line(stack: Stack) -> str:
    """How the bus is secured, after its URL."""
    parts = [f"an nkey per role in {stack.bus_creds}" if stack.bus_creds else "",
             f"TLS (CA {stack.tls_ca or 'of the system'})" if stack.tls else ""]
    return "".join(f", {p}" for p in parts if p)


def ops_env(stack: Stack) -> str:
    """What an ops command on this machine needs before it in the shell to reach this stack's bus."""
    env = []
    if stack.bus_creds is not None and stack.bus_creds != default_dir():
        env.append(f"{CREDS_ENV}={stack.bus_creds}")
    if stack.tls_ca is not None:
        env.append(f"{CA_ENV}={stack.tls_ca}")
    if stack.partitions > 1:
        env.append(f"{subjects.PARTITIONS_ENV}={stack.partitions}")
    if stack.database or stack.data_dir != records.data_dir():
        env.append(f"{records.DATABASE_ENV}={stack.database_url}")
    return "".join(f"{e} " for e in env)


def interrupt(*_) -> None:
    raise KeyboardInterrupt


def watch(stack: Stack) -> None:
    """Reports a child that exits; the stack serves on without it, except without nats-server (a cluster:
    without a majority of its nodes)."""
    gone, brokers = set(), set(stack.brokers)
    while len(gone & brokers) <= (len(brokers) - 1) // 2:
        for name, p in stack.children.items():
            if p.poll() is not None and name not in gone:
                gone.add(name)
                print(f"tokenbus: {name} exited with code {p.returncode} (log: {stack.log(name)})", flush=True)
        time.sleep(0.5)


def partitions(args) -> int:
    """--bus-partitions, or TB_BUS_PARTITIONS (ValueError naming it when it is not a number of partitions)."""
    return args.bus_partitions or subjects.partitions()


def check_nats(args) -> None:
    """ValueError (the CLI prints it) for an fsync policy nats-server would not take, or a cluster that
    cannot keep a majority through one failure or is asked for what a local cluster does not do."""
    if args.nats_sync is not None and not re.fullmatch(r"always|\d+(ms|s|m|h)", args.nats_sync):
        raise ValueError(f"--nats-sync {args.nats_sync!r}: always, or a duration such as 100ms, 30s, 2m")
    if args.nats_cluster == 1:
        return
    if args.nats_url:
        raise ValueError("--nats-cluster starts nats-servers; --nats-url uses running ones: give one of them")
    if args.nats_cluster < 3:
        raise ValueError(f"--nats-cluster {args.nats_cluster}: a cluster needs at least 3 servers to survive one "
                         f"failure (R{subjects.REPLICAS} streams); use 1 or 3")
    if procs.reachable(args.nats_host) != "127.0.0.1":
        raise ValueError("--nats-cluster runs its nodes on 127.0.0.1; a cluster across hosts is started on each "
                         "host (docs/cluster.md) and given to up with --nats-url")


FALLBACK = ("fallback-url", "fallback-key-env", "fallback-model", "fallback-failures", "fallback-cooldown")


def given(args, *options: str) -> list[str]:
    """`--option value` for each of `tokenbus up`'s options that was given: the child's own default otherwise."""
    values = ((o, getattr(args, o.replace("-", "_"))) for o in options)
    return [a for o, v in values if v is not None for a in (f"--{o}", str(v))]


def worker_args(args) -> list[str]:
    """What every worker of the stack is started with, from up's options."""
    return [*(["--tp", str(args.tp)] if args.tp > 1 else []),
            *given(args, "max-model-len", "max-num-seqs", "kv-cache-memory", "chunk-rate", "speculative",
                   "kv-load-failure-policy", "scheduling-policy"),
            *given(args, "dtype", "kv-cache-dtype"),
            *given(args, "engine", "mock-gpu"),
            *given(args, "quantization"),
            *given(args, "kv-host-memory", "kv-disk-size"), *disk_dirs(args),
            *(["--no-speculative-adaptive"] if args.no_speculative_adaptive else [])]


def disk_dirs(args) -> list[str]:
    """--kv-disk-dir for a worker: each worker's own directory under up's, made absolute (workers started together
    never share one; a worker's blocks are found again by the worker of the same place in the next `up`)."""
    if (args.kv_disk_dir is None) != (args.kv_disk_size is None):
        raise ValueError("--kv-disk-dir and --kv-disk-size go together: the disk tier needs both")
    return ["--kv-disk-dir", os.path.join(os.path.abspath(args.kv_disk_dir), "{worker}")] if args.kv_disk_dir else []


def colocated(args) -> int:
    """--workers, or its default: 1, or 0 with prefill or decode workers (a disaggregated stack)."""
    if args.workers is not None:
        return args.workers
    return 0 if args.prefill_workers or args.decode_workers else 1


def check_roles(args) -> None:
    """ValueError (the CLI prints it) for prefill workers with no worker to decode, or roles with --tp."""
    if args.prefill_workers and not args.decode_workers and not colocated(args):
        raise ValueError(f"--prefill-workers {args.prefill_workers} needs a worker to decode what they prefill: "
                         "give --decode-workers (or --workers) too")
    if (args.prefill_workers or args.decode_workers) and args.tp > 1:
        raise ValueError(f"--prefill-workers and --decode-workers do not take --tp {args.tp}: the KV transfer does "
                         "not support tensor-parallel workers yet")


def router_args(args) -> list[str]:
    return ["--policy", args.router, *given(args, "max-local-prefill", "max-prefill-queue")]


def workers_line(stack: Stack) -> str:
    """What up says it starts: '2 worker(s)', or '1 prefill and 1 decode worker(s)'."""
    roles = stack.prefill_workers or stack.decode_workers
    counts = [(stack.workers, " colocated" if roles else ""), (stack.prefill_workers, " prefill"),
              (stack.decode_workers, " decode")]
    parts = [f"{n}{kind}" for n, kind in counts if n]
    return f"{' and '.join(parts) or '0'} worker(s)"


def model_entries(args) -> list[Entry]:
    """The models up serves: a models file's, or each --model (the default model without one) with --workers
    workers each; ValueError naming the flags that do not go together."""
    if args.models and (args.model or args.served_model_name):
        raise ValueError("--models FILE names every model (and its name): give it without --model and "
                         "--served-model-name")
    if args.models:
        entries = read_models(args.models)
    else:
        if args.served_model_name and len(args.model or ()) > 1:
            raise ValueError(f"--served-model-name names one model; with {len(args.model)} --model give each its "
                             "name in a models file (--models FILE)")
        entries = [Entry(resolve(m), args.served_model_name) for m in args.model or [None]]
    if len(entries) > 1 and (args.prefill_workers or args.decode_workers):
        raise ValueError("--prefill-workers and --decode-workers serve one model: give one --model")
    return entries


def models_line(stack: Stack) -> str:
    """The models up starts on: a path, or each name@revision with its share."""
    if len(stack.served) == 1:
        return stack.model
    return ", ".join(f"{m.name}@{m.revision}" + (f" ({m.share:.1%})" if m.share else "") for m in stack.served)


def check_speculative(args) -> None:
    """ValueError (the CLI prints it) for --no-speculative-adaptive alone."""
    if args.no_speculative_adaptive and args.speculative is None:
        raise ValueError("--no-speculative-adaptive fixes the K of --speculative: give --speculative too")


def failed(e: ChildFailed | TimeoutError) -> str:
    """What `up` prints when the stack did not come up: the cause, from the failing child's own log."""
    if isinstance(e, TimeoutError):
        return f"tokenbus: {e}"
    return "\n  ".join([f"tokenbus: the stack did not start: {e}. The end of that log:",
                        *(e.tail().splitlines() or ["(nothing)"])])


def main(args) -> None:
    check_keys(args.host, args.api_keys)
    check_nats(args)
    check_speculative(args)
    check_roles(args)
    security = secure(args)
    data_dir = Path(args.data_dir) if args.data_dir else tokenbus_home() / "data"
    storage = retention.sized(data_dir, args.bus_storage, partitions(args), max(args.nats_cluster, 1),
                              embedded=not args.nats_url)        # a disk too small: one line, nothing started
    entries = model_entries(args)
    model = entries[0].model
    stack = Stack(model, args.port, data_dir, args.nats_url, args.nats_port, colocated(args), worker_args(args),
                  router_args=router_args(args), tokenizer_args=given(args, "max-model-len"),
                  gateway_args=given(args, "max-tokens", "tool-call-parser", "generation-config", *FALLBACK),
                  gateways=args.gateways, nats_sync=args.nats_sync, prefill_workers=args.prefill_workers,
                  decode_workers=args.decode_workers, models=entries, partitions=partitions(args),
                  database=args.database, archive=args.archive, recorder_port=procs.free_port(), storage=storage,
                  otlp_endpoint=args.otlp_endpoint, **security)
    if args.database:
        Database.open(args.database)              # a URL of neither kind: said before anything starts
    stack.plan()                                  # a models file's mistakes before anything starts
    for m in stack.served:                        # and a generation config's (the gateways load them)
        generation.load(m.files, args.generation_config or "auto")
    if args.nats_cluster > 1:
        stack.nats_nodes = cluster.local_nodes(args.nats_cluster, data_dir, args.nats_port)
    signal.signal(signal.SIGTERM, interrupt)
    stack.api_keys, stack.host = args.api_keys, args.host
    status = 0
    try:
        stack.start()
        tp = (f"mock engines of simulated tensor-parallel size {args.tp} × {args.mock_gpu or 'h100-sxm'}"
              if args.engine == "mock" else f"tensor-parallel size {args.tp}")
        print(f"tokenbus: starting {workers_line(stack)} of {tp} on "
              f"{models_line(stack)} (logs in {data_dir / 'logs'}) ...", flush=True)
        stack.wait_ready()
        more = "".join(f"\n  gateway {i}  {u}" for i, u in enumerate(stack.urls[1:], 1))
        urls = " ".join(f"--url {u}" for u in stack.urls)
        print(f"tokenbus is up\n  chat page  {stack.http}/\n  OpenAI API {stack.http}/v1  (OPENAI_BASE_URL)\n"
              f"  websocket  {stack.url}{more}\n  health     {stack.http}/healthz\n"
              f"  nats       {stack.nats_url}{bus_line(stack)}\n  chat       tokenbus chat {urls}\n"
              f"  status     {ops_env(stack)}tokenbus status --nats-url {stack.nats_url}\n"
              f"  usage      {ops_env(stack)}tokenbus usage --nats-url {stack.nats_url}\n"
              f"  logs       tokenbus logs --follow{f' --data-dir {data_dir}' if args.data_dir else ''}\n"
              f"  records    database {redacted(stack.database_url)}, archive {stack.archive_url} (7 d), "
              f"recorder metrics http://127.0.0.1:{stack.recorder_port}/metrics\n"
              f"  bus        {retention.gib(stack.storage)} for the streams:\n"
              + "".join(f"    {line}\n" for line in retention.lines(stack.storage, stack.partitions)) +
              "Ctrl-C stops everything.", flush=True)
        watch(stack)
    except KeyboardInterrupt:
        pass
    except (ChildFailed, TimeoutError) as e:
        print(failed(e), file=sys.stderr, flush=True)
        status = 1
    finally:
        print("tokenbus: stopping ...", flush=True)
        stack.stop()
    sys.exit(status)

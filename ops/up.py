"""`tokenbus up`: the whole local stack as processes. An embedded nats-server (unless --nats-url names
a running one), then tokenizer, router, N workers and the gateway; it waits until every stage is
pulling and a worker is registered, prints where to connect, and on Ctrl-C or SIGTERM stops every
child (each child also gets SIGTERM from the kernel if this process dies)."""
import asyncio
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ops import procs
from ops.models import resolve
from ops.status import heartbeats
from schemas import subjects
from services.gateway import keys
from workers.models.builder import tokenbus_home
from workers.models.gguf import hf_dir

READY_TIMEOUT = 180.0


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
    gateway_args: list[str] = field(default_factory=list)    # e.g. ["--request-timeout", "30"]
    worker_env: dict[str, str] = field(default_factory=dict)  # e.g. a test hook of the workers
    children: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """Where this machine reaches the gateway."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def url(self) -> str:
        return f"ws://{self.address}:{self.port}/ws"

    @property
    def http(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start(self) -> None:
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if self.nats_url is None:
            self.children["nats"] = procs.start_nats(self.nats_port, self.data_dir, logs / "nats.log")
            self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        asyncio.run(prepare(self.nats_url))
        common = ["--nats-url", self.nats_url]
        files = hf_dir(self.model)  # a GGUF's tokenizer and config, as the files the tokenizer and gateway read
        self.spawn("tokenizer", "services.tokenizer", *common, "--model", files)
        self.spawn("router", "services.router", *common, *self.router_args)
        for i in range(self.workers):
            self.spawn(f"w{i}", "workers.service", *common, "--model", self.model, "--id", f"w{i}", *self.worker_args,
                       env=self.worker_env)
        keys_arg = ["--api-keys", self.api_keys] if self.api_keys else []
        self.spawn("gateway", "services.gateway", *common, "--model", files, "--host", self.host,
                   "--port", str(self.port), *keys_arg, *self.gateway_args)

    def spawn(self, name: str, module: str, *args: str, env: dict | None = None) -> None:
        self.children[name] = procs.spawn(procs.python_module(module, *args), self.data_dir / "logs" / f"{name}.log",
                                          env)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the gateway answers /healthz, the tokenizer and router are pulling and every worker
        is registered; RuntimeError if a child exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if healthy(self.http) and asyncio.run(pipeline_ready(self.nats_url, self.workers)):
                return
            time.sleep(0.25)
        raise TimeoutError(f"the stack was not ready within {timeout:.0f} s; logs in {self.data_dir / 'logs'}")

    def check_alive(self) -> None:
        for name, p in self.children.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode}; see {self.data_dir / 'logs' / name}.log")

    def stop(self) -> None:
        """Services first (so none reconnects in a loop), nats-server last."""
        services = [p for name, p in self.children.items() if name != "nats"]
        procs.stop(list(reversed(services)))
        if "nats" in self.children:
            procs.stop([self.children["nats"]])

    def kill(self, name: str) -> None:
        self.children[name].kill()
        self.children[name].wait()

    def restart_nats(self, down: float = 0.0) -> None:
        """SIGKILLs the embedded nats-server and starts it again `down` seconds later, on the same port and
        store (what it had on disk is all it keeps); the services reconnect by themselves. Call it from the
        thread that runs the tests: a child dies with the thread that started it (PR_SET_PDEATHSIG)."""
        self.kill("nats")
        time.sleep(down)
        self.children["nats"] = procs.start_nats(self.nats_port, self.data_dir, self.data_dir / "logs" / "nats.log")

    def restart(self, name: str) -> None:
        """Starts `name` again with the arguments it was started with."""
        old = self.children[name]
        if old.poll() is None:
            procs.stop([old])
        self.children[name] = procs.spawn(old.args, self.data_dir / "logs" / f"{name}.log")


async def prepare(nats_url: str) -> None:
    nc = await subjects.connect(nats_url, "tokenbus-up")
    try:
        await subjects.ensure_streams(nc.jetstream())
    finally:
        await nc.close()


async def pipeline_ready(nats_url: str, num_workers: int) -> bool:
    nc = await subjects.connect(nats_url, "tokenbus-up")
    try:
        js = nc.jetstream()
        stages = ((subjects.REQUESTS_STREAM, subjects.TOKENIZER), (subjects.ROUTE_STREAM, subjects.ROUTER))
        for stream, config in stages:
            info = await js.consumer_info(stream, config.durable_name)
            if not info.num_waiting:
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


def interrupt(*_) -> None:
    raise KeyboardInterrupt


def watch(stack: Stack) -> None:
    """Reports a child that exits; the stack serves on without it, except without nats-server."""
    gone = set()
    while "nats" not in gone:
        for name, p in stack.children.items():
            if p.poll() is not None and name not in gone:
                gone.add(name)
                print(f"tokenbus: {name} exited with code {p.returncode} (log: {stack.data_dir / 'logs' / name}.log)",
                      flush=True)
        time.sleep(0.5)


def main(args) -> None:
    check_keys(args.host, args.api_keys)
    data_dir = Path(args.data_dir) if args.data_dir else tokenbus_home() / "data"
    model = resolve(args.model)
    worker_args = ["--tp", str(args.tp)] if args.tp > 1 else []
    stack = Stack(model, args.port, data_dir, args.nats_url, args.nats_port, args.workers, worker_args,
                  router_args=["--policy", args.router])
    signal.signal(signal.SIGTERM, interrupt)
    stack.api_keys, stack.host = args.api_keys, args.host
    try:
        stack.start()
        print(f"tokenbus: starting {args.workers} worker(s) of tensor-parallel size {args.tp} on {model} "
              f"(logs in {data_dir / 'logs'}) ...", flush=True)
        stack.wait_ready()
        print(f"tokenbus is up\n  chat page  {stack.http}/\n  OpenAI API {stack.http}/v1  (OPENAI_BASE_URL)\n"
              f"  websocket  {stack.url}\n  health     {stack.http}/healthz\n"
              f"  nats       {stack.nats_url}\n  chat       tokenbus chat --url {stack.url}\n"
              f"  status     tokenbus status --nats-url {stack.nats_url}\n"
              f"  usage      tokenbus usage --nats-url {stack.nats_url}\nCtrl-C stops everything.", flush=True)
        watch(stack)
    except KeyboardInterrupt:
        pass
    finally:
        print("tokenbus: stopping ...", flush=True)
        stack.stop()

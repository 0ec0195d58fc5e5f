"""The container world of the compose tests: tests/prepare-containers.sh (a Docker engine, the compose CLI, the
images compose.yaml and the Dockerfile name, stand-ins built offline where no registry answers), held by one
test at a time on a machine, and a compose project run from a checkout, always taken down at the end."""
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREPARE = ROOT / "tests" / "prepare-containers.sh"
NO_ENGINE = 3                       # the script's status when no container engine can start here


@contextlib.contextmanager
def container_world():
    """Prepares the world (skips only where no engine can start) and stops a dockerd it started."""
    with open("/tmp/tokenbus-containers.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one compose test at a time: a stack each, one dockerd
        p = subprocess.run(["sh", str(PREPARE)], capture_output=True, text=True, timeout=900)
        if p.returncode == NO_ENGINE:
            pytest.skip(f"no container engine can start here: {p.stderr.strip()}")
        assert p.returncode == 0, f"{PREPARE.name} failed ({p.returncode}): {p.stdout}{p.stderr}"
        started = [int(line.split()[-1]) for line in p.stdout.splitlines() if line.startswith("started dockerd")]
        try:
            yield
        finally:
            for pid in started:
                stop_dockerd(pid)


def stop_dockerd(pid: int) -> None:
    """Stops the dockerd the script started, and puts back the firewall it found (dockerd leaves its chains)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    before = Path("/tmp/tokenbus-iptables.before")
    if before.exists():
        subprocess.run(["iptables-restore"], input=before.read_bytes(), check=True, timeout=30)


class Compose:
    """`docker compose` on one project (its name unique to the test), in `cwd`, with `env` added."""

    def __init__(self, project: str, cwd: Path, env: dict):
        self.project, self.cwd, self.env = project, cwd, {**os.environ, **env, "COMPOSE_PROJECT_NAME": project}

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(["docker", "compose", "--profile", "cpu", *args], cwd=self.cwd, env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0 or not check, f"docker compose {' '.join(args)}: {p.stdout}{p.stderr}"
        return p

    def docker(self, *args: str, timeout: float = 120) -> str:
        p = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"docker {' '.join(args)}: {p.stdout}{p.stderr}"
        return p.stdout

    def containers(self, service: str) -> dict[str, str]:
        """A service's running containers: hostname (the worker's id) → container name."""
        names = self("ps", "--format", "{{.Name}}", service).stdout.split()
        return {json.loads(self.docker("inspect", "--format", "{{json .Config.Hostname}}", n)): n for n in names}

    def events(self, service: str, event: str) -> list[dict]:
        """The JSON log lines of a service's containers with this event."""
        out = []
        for line in self("logs", "--no-color", "--no-log-prefix", service).stdout.splitlines():
            with contextlib.suppress(ValueError):      # compose starts each line with an erase (ESC [2K)
                e = json.loads(line[line.find("{"):])
                if isinstance(e, dict) and e.get("event") == event:
                    out.append(e)
        return out

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers, networks and volumes that are still there."""
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: self.docker(*cmd, "--filter", label, "--format", name).split()
                for kind, name, cmd in (("containers", "{{.Names}}", ("ps", "-a")),
                                        ("networks", "{{.Name}}", ("network", "ls")),
                                        ("volumes", "{{.Name}}", ("volume", "ls")))}

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "--timeout", "10", check=False)


def served_dir(tmp: Path, models: dict[str, Path]) -> Path:
    """A model directory to mount (TB_MODEL_DIR): each model copied in, readable by the containers' user."""
    import shutil

    out = tmp / "models"
    for name, src in models.items():
        shutil.copytree(src, out / name)
    for path in [out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out

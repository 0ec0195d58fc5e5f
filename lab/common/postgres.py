"""A throwaway PostgreSQL server for the tests, chaos and the recorder's benchmark: initdb into a fresh
directory, pg_ctl start on a free port of 127.0.0.1, stop, and restart (a database that goes away and
comes back). The Debian binaries (pg_ctl, initdb) are found on PATH or under /usr/lib/postgresql; as root
the server runs as the `postgres` user, since PostgreSQL refuses to run as root."""
import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ops.procs import free_port

USER = "tokenbus"


def binary(name: str) -> str:
    """The path of a PostgreSQL program; FileNotFoundError naming it when it is not installed."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))[::-1]), None)
    if found is None:
        raise FileNotFoundError(f"{name}: PostgreSQL is not installed (apt-get install postgresql)")
    return found


class LocalPostgres:
    """One PostgreSQL server in its own directory; `url` connects to its `postgres` database. fsync off is
    for tests that restart it on purpose and care about speed, not about surviving a power cut."""

    def __init__(self, fsync: bool = True):
        self.dir = Path(tempfile.mkdtemp(prefix="tokenbus-pg-"))
        self.port = free_port()
        self.fsync = fsync
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.run(binary("initdb"), "-D", str(self.data), "-U", USER, "-A", "trust", "--no-sync", "-E", "UTF8")

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def run(self, *cmd: str) -> None:
        subprocess.run([*self.as_user, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> "LocalPostgres":
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync={'on' if self.fsync else 'off'}"
        self.run(binary("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.dir / "server.log"), "-w",
                 "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop: fast (sessions cut, a clean shutdown) or immediate (as a crash)."""
        self.run(binary("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, down: float = 0.0) -> None:
        """Stopped as a crash, started again `down` seconds later on the same port and data."""
        self.stop("immediate")
        time.sleep(down)
        self.start()

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):      # not running
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalPostgres":
        return self.start()

    def __exit__(self, *_) -> None:
        self.close()

"""Every code block of the README, and of the docs it sends a user to first (the APIs, operations), runs
as written, against a stack started as the README starts one:
`tokenbus up` with the default $TOKENBUS_HOME (~/.cache/tokenbus, under a fresh $HOME). Shell blocks
run in bash (set -e, pipefail) with `tokenbus` on the PATH, Python blocks in Python, JSON blocks are
parsed (and an --api-keys file is loaded as the gateway loads it). Two things in a block's text are
replaced: the default ports (8000, 4222) by the test stack's free ones, and the log-grep example's
request id by one the stack served. A block right after `<!-- not run: reason -->` is skipped; a fenced
block without a language, or in `text`/`console`, shows output or a diagram. Blocks are found by their
language and marker, not by position. A block that runs `docker compose` runs in a copy of the checkout, in
the compose tests' container world (tests/e2e/containers.py), on free ports of its own."""
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from ops.procs import free_port
from services.gateway import keys
from tests.e2e.containers import Compose, container_world

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!--\s*not run:(?P<why>.*?)-->\s*\n)?^```(?P<lang>\S*)\n(?P<code>.*?)^```\s*$", re.S | re.M)
EXAMPLE_ID = "7c31ba34422240909a8d2be2049e46af"   # the log-grep example's request id
SHELL, PYTHON, JSON = {"sh", "bash", "shell"}, {"python", "py"}, {"json"}
SHOWN = {"", "text", "console"}                     # output or a diagram: nothing to run
PAGES = ["README.md", "docs/api.md", "docs/operations.md"]
SERVED = "smollm2-135m-instruct"                    # the default model, which the snippets name


def blocks() -> list:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            if m["lang"] not in SHOWN:
                marks = [pytest.mark.skip(reason=f"not run: {m['why'].strip()}")] if m["why"] is not None else []
                found.append(pytest.param(m["lang"], m["code"], id=f"{m['lang']}@{page}:{line}", marks=marks))
    return found


def test_the_readme_has_snippets_in_languages_the_runner_knows_and_says_why_any_is_not_run():
    text = "\n".join((ROOT / page).read_text() for page in PAGES)
    ran = [m for m in BLOCK.finditer(text) if m["lang"] not in SHOWN and m["why"] is None]
    assert {m["lang"] for m in BLOCK.finditer(text)} <= SHELL | PYTHON | JSON | SHOWN
    assert all(m["why"].strip() for m in BLOCK.finditer(text) if m["why"] is not None)
    assert len(ran) >= 5 and sum(EXAMPLE_ID in m["code"] for m in ran) == 1


class Readme:
    """The stack the snippets run against, and how they run."""
    def __init__(self, home: Path, work: Path, port: int, nats_port: int, request_id: str):
        self.home, self.work, self.port, self.nats_port, self.request_id = home, work, port, nats_port, request_id

    def env(self) -> dict:
        bin_dir = self.work / "bin"                 # `tokenbus` as an installed console script would be
        bin_dir.mkdir(exist_ok=True)
        script = bin_dir / "tokenbus"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ops.cli "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        env = {k: v for k, v in os.environ.items() if k != "TOKENBUS_HOME"}
        return {**env, "HOME": str(self.home), "PYTHONPATH": str(ROOT), "PATH": f"{bin_dir}:{env['PATH']}"}

    def filled(self, code: str, port: int | None = None, nats_port: int | None = None) -> str:
        code = code.replace(":8000", f":{port or self.port}").replace(":4222", f":{nats_port or self.nats_port}")
        return code.replace(EXAMPLE_ID, self.request_id)

    def run(self, lang: str, code: str, cwd: Path | None = None, env: dict | None = None, port: int | None = None,
            nats_port: int | None = None) -> subprocess.CompletedProcess:
        argv = ["bash", "-e", "-o", "pipefail", "-c"] if lang in SHELL else [sys.executable, "-c"]
        return subprocess.run([*argv, self.filled(code, port, nats_port)], cwd=cwd or self.work,
                              env={**self.env(), **(env or {})}, capture_output=True, text=True, timeout=900)


def served_request(port: int) -> str:
    """The request id of one completion (an HTTP response's id after its `cmpl-`)."""
    body = json.dumps({"model": SERVED, "prompt": "The engine", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["id"].removeprefix("cmpl-")


@pytest.fixture(scope="module")
def readme(tmp_path_factory, smollm2_wheel):
    home, work = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("work")
    wheels = home / ".cache" / "tokenbus" / "wheels"     # the download, done once per machine, is not the point
    wheels.mkdir(parents=True)
    shutil.copy(smollm2_wheel, wheels)
    port, nats_port = free_port(), free_port()
    r = Readme(home, work, port, nats_port, "")
    up = subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--nats-port", str(nats_port)],
                          cwd=ROOT, env=r.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in up.stdout:
            if line.startswith("tokenbus is up"):
                break
        else:
            raise AssertionError(f"tokenbus up did not come up: {up.stderr.read()}")
        assert (home / ".cache" / "tokenbus" / "data" / "logs" / "gateway.log").exists()   # the default home
        r.request_id = served_request(port)
        yield r
    finally:
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize(("lang", "code"), blocks())
def test_readme_block_runs_as_written(readme, lang, code):
    if lang in JSON:
        doc = json.loads(code)
        if all(isinstance(v, dict) and "tenant" in v for v in doc.values()):   # an --api-keys file
            path = readme.work / "keys.json"
            path.write_text(code)
            assert keys.load(str(path))
        return
    if "docker compose" in code:
        run_in_containers(readme, lang, code)
        return
    p = readme.run(lang, code)
    assert p.returncode == 0 and "Traceback" not in p.stderr, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    if readme.request_id in readme.filled(code):      # the log grep follows the request through every service
        assert all(f'"service":"{s}"' in p.stdout for s in ("gateway", "tokenizer", "router", "worker")), p.stdout


def run_in_containers(readme: Readme, lang: str, code: str) -> None:
    """A compose block runs in a checkout of its own (a user's clone: tracked and new files), on ports and under
    a project name of its own, and its stack is taken down and gone whatever the block did."""
    checkout = readme.work / f"checkout-{uuid.uuid4().hex[:8]}"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for f in files:
        if (ROOT / f).is_file():
            (checkout / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, checkout / f)
    port, nats_port = free_port(), free_port()
    stack = Compose(checkout.name, checkout, {"TB_PORT": str(port), "TB_NATS_PORT": str(nats_port),
                                              "TB_PG_PORT": str(free_port())})
    with container_world():
        try:
            p = readme.run(lang, code, cwd=checkout, port=port, nats_port=nats_port,
                           env={k: stack.env[k] for k in ("TB_PORT", "TB_NATS_PORT", "TB_PG_PORT",
                                                          "COMPOSE_PROJECT_NAME")})
            assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
        finally:
            stack.down()
        assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}

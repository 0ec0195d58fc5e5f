"""The first hour of a new user, as one would try it: commands run with no nats-server to answer them,
Ctrl-C while they wait, a stack that cannot start, --version and every --help, `tokenbus logs`, and
`tokenbus up`'s limits reaching the services it starts. Every command runs as a user types it, in a
process of its own."""
import argparse
import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ops.broker import CONNECT_TIMEOUT
from ops.cli import main, parser
from ops.procs import free_port
from ops.status import read_registry
from tests.e2e.conftest import post

TOKENBUS = [sys.executable, "-m", "ops.cli"]
STARTUP = 15.0                     # seconds a command may take to start on a busy 2-core machine


def nats_commands(tmp_path) -> dict[str, list[str]]:
    """Every command that reads the stack through nats-server, without its --nats-url."""
    return {"status": ["status"], "usage": ["usage"], "replay": ["replay"], "inspect": ["inspect", "tb.>"],
            "log export": ["log", "export", str(tmp_path / "out.jsonl")]}


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([*TOKENBUS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


@contextlib.contextmanager
def silent_port():
    """A port that accepts connections and never says a word: something, but not a nats-server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        s.settimeout(60)
        yield s


# -- no nats-server -------------------------------------------------------------------------------

@pytest.mark.serial
@pytest.mark.parametrize("nothing", ["refused", "silent"])
def test_every_nats_command_fails_within_seconds_naming_the_url_it_tried(tmp_path, nothing):
    with silent_port() as silent:
        url = f"nats://127.0.0.1:{silent.getsockname()[1] if nothing == 'silent' else free_port()}"
        began = time.monotonic()
        running = {name: start(*args, "--nats-url", url) for name, args in nats_commands(tmp_path).items()}
        for name, p in running.items():
            out, err = p.communicate(timeout=60)
            assert p.returncode == 1, (name, out, err)
            assert f"no nats-server answered at {url} (" in err, (name, err)
            assert "Traceback" not in err, (name, err)
        assert time.monotonic() - began < CONNECT_TIMEOUT + STARTUP      # all five ran at once


def test_ctrl_c_while_a_command_waits_for_nats_server_exits_130_without_a_traceback(tmp_path):
    with contextlib.ExitStack() as stack:
        ports = {name: stack.enter_context(silent_port()) for name in nats_commands(tmp_path)}
        running = {name: start(*args, "--nats-url", f"nats://127.0.0.1:{ports[name].getsockname()[1]}")
                   for name, args in nats_commands(tmp_path).items()}
        for name, p in running.items():
            conn, _ = ports[name].accept()                # the command is now waiting for nats-server's INFO
            p.send_signal(signal.SIGINT)
            err = p.communicate(timeout=30)[1]
            conn.close()
            assert p.returncode == (0 if name == "inspect" else 130), (name, p.returncode, err)   # inspect: done
            assert "Traceback" not in err, (name, err)


def test_a_ctrl_c_inside_a_callback_is_not_reported_but_other_loop_errors_are(caplog):
    """Ctrl-C can cancel a future inside the callback about to set it (CPython 3.11's
    _sock_connect_cb): the commands' loops drop that InvalidStateError, and only that."""
    from ops.cli import QuietInterruptPolicy

    loop = QuietInterruptPolicy().new_event_loop()
    try:
        loop.call_exception_handler({"message": "Exception in callback _sock_connect_cb",
                                     "exception": asyncio.InvalidStateError("invalid state")})
        assert not caplog.records
        loop.call_exception_handler({"message": "a real fault", "exception": OSError("boom")})
        assert [r.getMessage() for r in caplog.records] == ["a real fault"]
    finally:
        loop.close()


def test_ctrl_c_ends_a_watching_inspect_without_a_traceback(nats_url):
    p = start("inspect", "tb.>", "--nats-url", nats_url)
    assert p.stderr.readline().startswith("inspect: watching tb.>")
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=30)[1]
    assert p.returncode in (0, 130) and "Traceback" not in err, err


# -- a stack that cannot start --------------------------------------------------------------------

def up(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOKENBUS, "up", "--port", str(free_port()), "--data-dir", str(tmp_path / "data"), *args],
                          capture_output=True, text=True, timeout=300)


def own_lines(stderr: str) -> str:
    """What `up` wrote itself, without the quoted log lines (indented), which may hold a child's traceback."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("  "))


@pytest.mark.slow
def test_up_names_the_gateway_and_quotes_its_log_when_its_port_is_in_use(tmp_path, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        p = up(tmp_path, "--model", tiny_model, "--nats-port", str(free_port()), "--port", str(taken.getsockname()[1]))
    assert p.returncode == 1
    assert "the stack did not start: gateway exited with code" in p.stderr and "gateway.log" in p.stderr
    assert "address already in use" in p.stderr and "Traceback" not in own_lines(p.stderr)
    assert "tokenbus: stopping" in p.stdout


@pytest.mark.slow
def test_up_with_a_model_path_that_does_not_exist_says_so_in_one_line_before_starting_anything(tmp_path):
    missing = tmp_path / "no-such-model"
    p = up(tmp_path, "--model", str(missing), "--nats-port", str(free_port()))
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        f"tokenbus: model '{missing}' is neither a checkpoint directory, a .gguf file nor a model name "
        "(smollm2-135m-instruct, tiny, small)"], p.stderr
    assert not (tmp_path / "data" / "logs").exists() or not any((tmp_path / "data" / "logs").iterdir())


def test_up_refuses_a_nats_port_that_something_else_listens_on(tmp_path, tiny_model):
    with silent_port() as taken:
        port = taken.getsockname()[1]
        p = up(tmp_path, "--model", tiny_model, "--nats-port", str(port))
    assert p.returncode == 1 and f"port {port} is in use" in p.stderr and f"--nats-url nats://127.0.0.1:{port}" in \
        p.stderr and "Traceback" not in p.stderr


# -- --version, --help ----------------------------------------------------------------------------

def test_version_is_the_installed_package_s(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tokenbus {importlib.metadata.version('tokenbus')}"


def parsers(p: argparse.ArgumentParser, path: str = "tokenbus"):
    """p and every subparser under it, with the command that reaches it."""
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_option_of_every_command_says_what_it_does_and_its_default():
    checked = 0
    for path, p in parsers(parser()):
        shown = " ".join(p.format_help().split())
        for action in p._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help and len(action.help) > 8, f"{path} {name}: no help"
            if action.default is not None and action.nargs != 0 and "default" not in action.help:
                assert f"(default: {action.default})" in shown, f"{path} {name}: its default is not shown"
            checked += 1
    assert checked > 150


def test_the_help_says_where_tokenbus_keeps_its_files():
    text = " ".join(parser().format_help().split())
    assert "TOKENBUS_HOME" in text and "~/.cache/tokenbus" in text and "$TOKENBUS_HOME/data/logs" in text


# -- tokenbus logs --------------------------------------------------------------------------------

def write_logs(home, **lines: str) -> None:
    logs = home / "data" / "logs"
    logs.mkdir(parents=True)
    for name, text in lines.items():
        (logs / f"{name}.log").write_text(text)


def logs(home, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOKENBUS, "logs", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TOKENBUS_HOME": str(home)})


def test_logs_prints_every_service_in_start_order_or_one_as_it_is(tmp_path):
    write_logs(tmp_path, gateway="g1\ng2\n", w10="x\n", w2="y\n", nats="n\n", router="r\n", tokenizer="t1\nt2")
    every = logs(tmp_path)
    assert every.returncode == 0 and every.stdout.splitlines() == [
        "nats      | n", "tokenizer | t1", "tokenizer | t2", "router    | r", "w2        | y", "w10       | x",
        "gateway   | g1", "gateway   | g2"]
    assert logs(tmp_path, "gateway").stdout == "g1\ng2\n"
    assert logs(tmp_path, "tokenizer", "--tail", "1").stdout == "t2\n"       # a last line without its newline too
    unknown = logs(tmp_path, "worker")
    assert unknown.returncode == 1 and "no log of 'worker'" in unknown.stderr and "w2, w10, gateway" in unknown.stderr


def test_logs_says_so_when_no_stack_has_written_any(tmp_path):
    p = logs(tmp_path)
    assert p.returncode == 1 and p.stderr.strip() == (f"tokenbus: no stack logs in {tmp_path / 'data' / 'logs'} yet: "
                                                      "`tokenbus up` writes them there (another stack's: --data-dir, "
                                                      "or its $TOKENBUS_HOME)")


def test_logs_follow_prints_lines_as_they_are_written_and_ctrl_c_ends_it_quietly(tmp_path):
    write_logs(tmp_path, gateway="older\nold\n")
    p = start("logs", "--follow", "--tail", "1", env={"TOKENBUS_HOME": str(tmp_path)})
    logs_dir = tmp_path / "data" / "logs"
    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        try:
            assert reader.submit(p.stdout.readline).result(timeout=60) == "gateway | old\n"    # now following
            with open(logs_dir / "gateway.log", "a") as f:
                f.write("new line\n")
            assert reader.submit(p.stdout.readline).result(timeout=30) == "gateway | new line\n"
            (logs_dir / "w0.log").write_text("a worker that started since\n")
            assert reader.submit(p.stdout.readline).result(timeout=30) == "w0      | a worker that started since\n"
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
        finally:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in err and "older" not in out


# -- tokenbus up passes its limits on -------------------------------------------------------------

def wait_for_line(p: subprocess.Popen, text: str) -> None:
    for line in p.stdout:
        if text in line:
            return
    raise AssertionError(f"`tokenbus up` ended before printing {text!r}: {p.stderr.read()}")


@pytest.mark.slow
def test_up_passes_its_limits_to_the_gateway_tokenizer_and_workers(tmp_path, tiny_model):
    port, nats_port = free_port(), free_port()
    p = start("up", "--model", tiny_model, "--port", str(port), "--nats-port", str(nats_port), "--data-dir",
              str(tmp_path / "data"), "--served-model-name", "my-model", "--max-tokens", "20", "--max-model-len", "64",
              "--max-num-seqs", "3", "--kv-cache-memory", "2MiB")
    try:
        wait_for_line(p, "tokenbus is up")
        http = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{http}/v1/models", timeout=30) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["my-model"]
        (beat,) = asyncio.run(read_registry(f"nats://127.0.0.1:{nats_port}"))
        config = json.loads((Path(tiny_model) / "config.json").read_text())
        import torch

        from workers.engine.engine import pick_dtype
        size = pick_dtype(None, config["dtype"], torch.device("cpu")).itemsize      # the worker's default dtype
        block_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 16 * size
        assert beat.max_num_seqs == 3 and beat.kv_blocks_total == (2 << 20) // block_bytes
        status, body = post(f"{http}/v1/completions", {"model": "my-model", "prompt": "hi", "max_tokens": 21})
        assert status == 400 and "max_tokens=20" in body["error"]["message"]
        status, body = post(f"{http}/v1/completions", {"model": "my-model", "prompt": list(range(10, 80)),
                                                       "max_tokens": 4})
        assert status == 400 and "max_model_len=64" in body["error"]["message"]
        status, body = post(f"{http}/v1/completions", {"model": "my-model", "prompt": "hi", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "tokenbus: stopping" in out and "Traceback" not in err

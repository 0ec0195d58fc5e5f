"""Times a new user's way to a first answer: a fresh clone of this repository, `make run`'s install
(a virtual environment with tokenbus; pip may use its cache), then `tokenbus up` on an empty
$TOKENBUS_HOME (it downloads and converts the default model) until a plain websocket client has a
whole answer. `make run` itself serves on ports 8000 and 4222; here `tokenbus up` gets free ones.

    python lab/benchmarks/first_answer.py [--repo .] [--dir DIR] [--question "..."] [--json]

Only the standard library and `websockets` (of the interpreter running it) are needed."""
import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import websockets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], cwd: Path, log: Path) -> None:
    with log.open("a") as out:
        if subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"first_answer: {' '.join(cmd)} failed; see {log}")


def start_up(clone: Path, home: Path, log: Path, times: dict, start: float) -> tuple[subprocess.Popen, str]:
    """`tokenbus up` on an empty $TOKENBUS_HOME, once it says it is up; and its websocket URL. Notes
    in `times` when the model is there (up starts the services) and when they are all ready."""
    port = free_port()
    up = subprocess.Popen([str(clone / ".venv" / "bin" / "tokenbus"), "up", "--port", str(port),
                           "--nats-port", str(free_port())], cwd=clone, stdout=subprocess.PIPE,
                          stderr=log.open("a"), text=True, env={**os.environ, "TOKENBUS_HOME": str(home)})
    with log.open("a") as out:
        for line in up.stdout:
            out.write(line)
            if line.startswith("tokenbus: starting"):
                times["model pulled"] = time.monotonic() - start
            if line.strip() == "Ctrl-C stops everything.":
                times["stack up"] = time.monotonic() - start
                return up, f"ws://127.0.0.1:{port}/ws"
    sys.exit(f"first_answer: tokenbus up ended before it was up; see {log}")


async def ask(url: str, question: str) -> str:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "q", "max_tokens": 64, "temperature": 0,
                                  "messages": [{"role": "user", "content": question}]}))
        text = ""
        while (frame := json.loads(await ws.recv()))["type"] == "delta":
            text += frame["text"]
        if frame["type"] != "done":
            sys.exit(f"first_answer: the stack answered {frame}")
        return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=".", help="the repository to clone (its committed HEAD; default: .)")
    p.add_argument("--dir", help="where to clone and keep $TOKENBUS_HOME (default: a new temporary directory)")
    p.add_argument("--question", default="What is the capital of France?")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="tokenbus-first-"))
    clone, home, log = work / "tokenbus", work / "home", work / "first_answer.log"
    work.mkdir(parents=True, exist_ok=True)
    times = {}
    start = time.monotonic()
    run(["git", "clone", "--quiet", str(Path(args.repo).resolve()), str(clone)], work, log)
    times["clone"] = time.monotonic() - start
    run(["make", ".venv/bin/tokenbus"], clone, log)               # what `make run` does before `tokenbus up`
    times["install"] = time.monotonic() - start
    up, url = start_up(clone, home, log, times, start)
    try:
        answer = asyncio.run(ask(url, args.question))
        times["first answer"] = time.monotonic() - start
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    result = {"seconds": times, "question": args.question, "answer": answer, "dir": str(work)}
    if args.json:
        print(json.dumps(result))
        return
    print(f"from a fresh clone of {Path(args.repo).resolve()} (log: {log}):")
    for name, t in times.items():
        print(f"  {name:<13}{t:>7.1f} s")
    print(f"{args.question} -> {answer!r}")


if __name__ == "__main__":
    main()

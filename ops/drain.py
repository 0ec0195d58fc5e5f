"""`tokenbus drain NAME`: asks the process of that name (a worker id, a gateway, router, tokenizer or
recorder id), or every process of that role, to drain: it stops taking new work, finishes what it holds
within its --drain-timeout, hands the rest over and exits (bus/lifecycle.py), as SIGTERM would. Prints
who answered; with --wait, waits until each has gone and prints how many requests it handed over. A
Kubernetes worker's preStop runs it for its own pod (docs/kubernetes.md)."""
import asyncio
import sys
import time

import orjson

import bus
from ops.status import nats_url
from schemas import subjects

ANSWER_SECONDS = 1.0                     # how long the answers of a role's processes are gathered


async def drain(url: str, name: str, wait: bool, timeout: float) -> list[dict]:
    """The processes that answered, each {"name", "role", "drain_timeout"} and, with wait, "handed_over"
    (None: not seen to go within `timeout`)."""
    nc = await bus.connect(url, "tokenbus-drain", role="admin")
    try:
        gone: dict[str, dict] = {}

        async def left(msg) -> None:
            note = orjson.loads(msg.data)
            gone[note["name"]] = note

        sub = await nc.subscribe(subjects.DRAINED_ALL, cb=left)
        inbox, answers = nc.new_inbox(), asyncio.Queue()
        replies = await nc.subscribe(inbox, cb=answers.put)
        await nc.publish(subjects.drain(name), b"", reply=inbox)
        found = []
        deadline = time.monotonic() + ANSWER_SECONDS
        while (left_s := deadline - time.monotonic()) > 0:
            try:
                found.append(orjson.loads((await asyncio.wait_for(answers.get(), left_s)).data))
            except TimeoutError:
                break
        await replies.unsubscribe()
        if wait:
            deadline = time.monotonic() + timeout
            while any(f["name"] not in gone for f in found) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            for f in found:
                f["handed_over"] = gone.get(f["name"], {}).get("handed_over")
        await sub.unsubscribe()
        return found
    finally:
        await nc.close()


def main(args) -> int:
    found = asyncio.run(drain(args.nats_url, subjects.token("name", args.name), args.wait, args.timeout))
    if not found:
        print(f"tokenbus drain: no process named {args.name!r} (nor of that role) answered on "
              f"{subjects.drain(args.name)}", file=sys.stderr)
        return 1
    status = 0
    for f in found:
        line = f"{f['name']} ({f['role']}): draining, within {f['drain_timeout']:g} s"
        if args.wait:
            if f["handed_over"] is None:
                line, status = f"{f['name']} ({f['role']}): still draining after {args.timeout:g} s", 1
            else:
                line = f"{f['name']} ({f['role']}): drained, {f['handed_over']} request(s) handed over"
        print(line)
    return status


def register(sub) -> None:
    d = sub.add_parser("drain", help="a process (by name) or every process of a role stops taking work, finishes "
                       "what it holds within its --drain-timeout, hands the rest over and exits")
    d.add_argument("name", help="a worker id, a service instance's id, or a role: gateway, tokenizer, router, "
                   "recorder, worker")
    nats_url(d)
    d.add_argument("--wait", action="store_true", help="wait until each has gone")
    d.add_argument("--timeout", type=float, default=subjects.DRAIN_TIMEOUT + 30, help="with --wait: seconds")
    d.set_defaults(func=lambda args: sys.exit(main(args)))

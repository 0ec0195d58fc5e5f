"""The whole stack on an authorized TLS bus, as `tokenbus up --bus-creds DIR --tls-*` starts it: every
service connected (as nats-server itself reports) with its own role's nkey over TLS, a request served
end to end, the ops commands a user types doing their jobs with their own seeds, and not one
permissions violation in the server's log: each role's permissions are enough for its job."""
import asyncio
import json
import urllib.request

import pytest

from ops import bus, procs
from ops.cli import parser
from ops.up import Stack
from schemas.credentials import CA_ENV, CREDS_ENV
from tests.e2e.conftest import WORKER_ARGS, collect, connect, send
from tests.ops.pki import make_pki

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVICES = {"gateway": "gateway", "tokenizer": "tokenizer", "router": "router", "worker-w0": "worker",
            "recorder": "recorder"}


@pytest.fixture(scope="module")
def secure_stack(tiny_model, tmp_path_factory):
    """(stack, creds dir, CA, monitoring URL): the stack `tokenbus up --bus-creds DIR --tls-cert --tls-key --tls-ca`
    starts, its nats-server's config with a monitoring port added (where the server says who is connected)."""
    d = tmp_path_factory.mktemp("secure")
    pki, creds, monitor = make_pki(d / "pki"), d / "creds", procs.free_port()
    write_config = bus.write_config

    def with_monitor(path, *args):
        write_config(path, *args)
        with path.open("a") as f:
            f.write(f"http: 127.0.0.1:{monitor}\n")
        return path

    stack = Stack(tiny_model, procs.free_port(), d, nats_port=procs.free_port(), workers=1, worker_args=WORKER_ARGS,
                  bus_creds=creds, tls=bus.Tls(pki.cert, pki.key), tls_ca=pki.ca)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bus, "write_config", with_monitor)
            stack.start()
        stack.wait_ready()
        yield stack, creds, pki.ca, f"http://127.0.0.1:{monitor}"
    finally:
        stack.stop()


def command(*argv: str) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except SystemExit as e:
        return e.code


def test_every_service_does_its_job_with_its_own_credentials_and_no_violation(secure_stack, capsys, monkeypatch,
                                                                                tmp_path):
    stack, creds, ca, monitor = secure_stack

    async def chat():
        async with connect(stack) as ws:
            await send(ws, {"type": "generate", "id": "a", "prompt": "hello", "max_tokens": 6, "ignore_eos": True})
            return (await collect(ws, {"a"}))["a"]

    got = asyncio.run(chat())
    assert got["end"]["type"] == "done" and len(got["token_ids"]) == 6

    with urllib.request.urlopen(f"{monitor}/connz?auth=true", timeout=5) as r:
        conns = {c.get("name"): c for c in json.load(r)["connections"]}
    keys = {role: bus.public_key(seed) for role, seed in bus.seeds(creds).items()}
    for name, role in SERVICES.items():
        assert conns[name]["authorized_user"] == keys[role], name            # its own nkey, as the server says
        assert conns[name]["tls_version"], name

    monkeypatch.setenv(CREDS_ENV, str(creds))                               # a directory: each takes <role>.nk
    monkeypatch.setenv(CA_ENV, str(ca))
    url = stack.nats_url
    capsys.readouterr()
    assert command("status", "--nats-url", url, "--json") == 0
    assert [w["id"] for w in json.loads(capsys.readouterr().out)["workers"]] == ["w0"]
    assert command("usage", "--nats-url", url, "--database", stack.database_url, "--json") == 0
    assert json.loads(capsys.readouterr().out)["total"]["requests"] == 1
    assert command("log", "export", str(tmp_path / "log.jsonl"), "--nats-url", url) == 0
    assert capsys.readouterr().out.startswith("exported 1 records")
    assert command("inspect", "tb.>", "--stream", "TB_RESULTS", "--count", "1", "--json", "--nats-url", url) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["subject"].startswith("tb.done.")
    assert command("replay", "--last", "1", "--json", "--nats-url", url) == 0
    assert json.loads(capsys.readouterr().out)["identical"] == 1

    violations = [line for line in (stack.data_dir / "logs" / "nats.log").read_text().splitlines()
                  if "Violation" in line]
    assert violations == []

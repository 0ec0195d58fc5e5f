"""The bus's roles, enforced by a real nats-server with the config `tokenbus up --bus-auth` writes: each
role's credentials do its job, and the server refuses what lies outside it (the permissions violation
is nats-server's own -ERR, as nats-py hands it to the error callback)."""
import asyncio
import contextlib
import stat
import subprocess

import nats.errors
import pytest
from nats.js import api

import bus as nats_bus
from ops import bus, procs
from schemas import roles, subjects
from schemas.credentials import CREDS_ENV, Credentials, seed_file
from schemas.messages import Usage, encode
from workers import service

VIOLATION = "permissions violation"


class Errors:
    """A log that keeps what the connection's error callback says."""
    def __init__(self):
        self.lines: list[str] = []

    def warning(self, event: str, **kw) -> None:
        self.lines.append(kw.get("error", event))

    def violations(self) -> list[str]:
        return [line for line in self.lines if VIOLATION in line]


def refusal(kind: str, subject: str) -> str:
    """How a refused publish or subscription reads (nats-py lowercases the whole -ERR line)."""
    return f'{VIOLATION} for {kind} to "{subject}"'.lower()


@pytest.fixture
def secured(tmp_path):
    """An authorized nats-server (every role's nkey, its permissions) whose streams admin made: (url, creds)."""
    creds, port = tmp_path / "creds", procs.free_port()
    proc = procs.start_nats(port, tmp_path, tmp_path / "nats.log",
                            config=bus.write_config(tmp_path / "nats.conf", creds, None))
    url = f"nats://127.0.0.1:{port}"

    async def prepare():
        nc = await nats_bus.connect(url, "test-admin", role="admin", credentials=Credentials(creds))
        await nats_bus.ensure_streams(nc.jetstream())
        await nc.close()

    asyncio.run(prepare())
    yield url, Credentials(creds)
    procs.stop([proc])


@contextlib.asynccontextmanager
async def as_role(secured, role: str):
    url, creds = secured
    errors = Errors()
    nc = await nats_bus.connect(url, f"test-{role}", errors, role=role, credentials=creds)
    try:
        yield nc, errors
    finally:
        await nc.close()


async def tried(nc, errors: Errors, subject: str) -> list[str]:
    """Publishes to `subject` (for a JetStream API call, its first step, without waiting for the answer);
    the server's violations since."""
    return await since(errors, nc.publish(subject, b"{}", reply=nc.new_inbox()), nc)


async def subscribed(nc, errors: Errors, subject: str) -> list[str]:
    subs = []

    async def subscribe():
        subs.append(await nc.subscribe(subject))

    found = await since(errors, subscribe(), nc)
    await subs[0].unsubscribe()
    return found


async def since(errors: Errors, act, nc, patience: float = 0.5) -> list[str]:
    """The violations the server reports after `act`: waits for one up to `patience` seconds after a
    round trip (the -ERR comes asynchronously to the error callback)."""
    before = len(errors.violations())
    await act
    await nc.flush()
    deadline = asyncio.get_running_loop().time() + patience
    while len(errors.violations()) == before and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return errors.violations()[before:]


async def stored(secured, stream: str) -> int:
    async with as_role(secured, "admin") as (nc, _):
        return (await nc.jetstream().stream_info(stream)).state.messages


def test_a_worker_publishing_a_request_is_refused_by_the_server_and_nothing_is_stored(secured):
    async def main():
        async with as_role(secured, "worker") as (nc, errors):
            with pytest.raises(nats_bus.NotStored):      # a JetStream publish: no ack ever comes
                await nats_bus.publish(nc.jetstream(), subjects.request_new("acme", "r1"), b"request",
                                       subjects.msg_id("r1"), errors, deadline=0.5)
            assert refusal("publish", "tb.req.new.acme.r1") in errors.violations()[0]
            await nats_bus.publish(nc.jetstream(), subjects.done("acme", "r1"), b"x", subjects.msg_id("r1"), errors)
        assert await stored(secured, subjects.REQUESTS_STREAM) == 0
        assert await stored(secured, subjects.RESULTS_STREAM) == 1    # its own job: a completion record

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_gateway_reading_the_work_queue_is_refused_by_the_server(secured):
    async def main():
        async with as_role(secured, "gateway") as (nc, errors):
            with pytest.raises(nats.errors.TimeoutError):            # the API request never reaches JetStream
                await nc.jetstream(timeout=1).add_consumer(subjects.WORK_STREAM, nats_bus.worker_consumer("w0"))
            assert refusal("publish", "$JS.API.CONSUMER.DURABLE.CREATE.TB_WORK.worker-w0") in errors.violations()[0]
            assert refusal("subscription", "tb.work.>") in (await subscribed(nc, errors, "tb.work.>"))[0]
            await nats_bus.publish(nc.jetstream(), subjects.request_new("acme", "r1"), b"request",
                                   subjects.msg_id("r1"), errors)                      # its own job
        assert await stored(secured, subjects.REQUESTS_STREAM) == 1

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_tokenizer_reading_usage_is_refused_by_the_server(secured):
    async def main():
        async with as_role(secured, "tokenizer") as (nc, errors):
            with pytest.raises(nats.errors.TimeoutError):
                await nc.jetstream(timeout=1).subscribe(subjects.USAGE_SUBJECTS, stream=subjects.USAGE_STREAM,
                                                        ordered_consumer=True)
            assert refusal("publish", "$JS.API.CONSUMER.CREATE.TB_USAGE") in errors.violations()[0]
            assert refusal("subscription", "tb.usage.>") in (await subscribed(nc, errors, "tb.usage.>"))[0]

    asyncio.run(asyncio.wait_for(main(), 30))


def test_only_the_usage_reader_and_admin_may_read_the_metering_log(secured):
    """Every way into TB_USAGE (a consumer of any kind, a pull, a stored message, the usage reader's inbox),
    for every role: refused but to `usage` and `admin`, and to the recorder through its own durable (and a
    stored message: the backlog's age); its live subjects to all but admin (usage reads the stream)."""
    usage = subjects.USAGE_STREAM
    ways = [f"$JS.API.CONSUMER.CREATE.{usage}", f"$JS.API.CONSUMER.CREATE.{usage}.spy.tb.usage.acme",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{usage}.spy", f"$JS.API.CONSUMER.MSG.NEXT.{usage}.spy",
            f"$JS.API.STREAM.MSG.GET.{usage}", f"$JS.API.DIRECT.GET.{usage}"]

    async def main():
        for role in roles.ROLES:
            async with as_role(secured, role) as (nc, errors):
                refused = [w for w in ways if await tried(nc, errors, w)]
                refused += [s for s in ("_INBOX_usage.>", subjects.USAGE_SUBJECTS) if await subscribed(nc, errors, s)]
            expected = {"admin": [], "usage": [ways[2], subjects.USAGE_SUBJECTS],       # it needs no durable
                        "recorder": [*ways[:4], ways[5], "_INBOX_usage.>", subjects.USAGE_SUBJECTS]}  # its own
            assert refused == expected.get(role, [*ways, "_INBOX_usage.>", subjects.USAGE_SUBJECTS]), role

    asyncio.run(asyncio.wait_for(main(), 60))


def test_stream_changes_are_refused_to_every_service_and_left_to_admin(secured):
    changes = [f"$JS.API.STREAM.{op}.{subjects.USAGE_STREAM}" for op in ("UPDATE", "DELETE", "PURGE")]

    async def main():
        for role in roles.ROLES:
            if role == "admin":                  # may (it would delete the stream here)
                continue
            async with as_role(secured, role) as (nc, errors):
                assert [c for c in changes if await tried(nc, errors, c)] == changes, role

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_router_moves_a_departed_workers_queue_and_a_worker_answers_its_snapshot_in_parts(secured):
    """The router's re-route (a consumer of another worker's subject, pulled, acked, deleted) and the
    worker's answers to a request on the requester's inbox: more than one (allow_responses)."""
    async def main():
        async with as_role(secured, "router") as (router, r_errors), as_role(secured, "worker") as (worker, w_errors):
            js = router.jetstream()
            await nats_bus.publish(js, subjects.work("w0", "r1"), b"item", subjects.msg_id("r1"), r_errors)
            name = "reroute-w0-abc"
            await js.add_consumer(subjects.WORK_STREAM, api.ConsumerConfig(
                name=name, filter_subject=nats_bus.work_filter("w0"), ack_policy=api.AckPolicy.EXPLICIT))
            sub = await js.pull_subscribe_bind(stream=subjects.WORK_STREAM, name=name)
            (msg,) = await sub.fetch(1, timeout=5)
            await msg.ack_sync()
            await js.delete_consumer(subjects.WORK_STREAM, name)

            async def answer(req):
                for part in (b"1", b"2", b"3"):
                    await worker.publish(req.reply, part)
            await worker.subscribe(subjects.kv_snapshot("w0"), cb=answer)
            await worker.flush()
            inbox, got = router.new_inbox(), asyncio.Queue()
            await router.subscribe(inbox, cb=got.put)
            await router.publish(subjects.kv_snapshot("w0"), b"", reply=inbox)
            assert [(await asyncio.wait_for(got.get(), 5)).data for _ in range(3)] == [b"1", b"2", b"3"]
            assert r_errors.violations() == [] and w_errors.violations() == []
            assert await tried(worker, w_errors, subjects.work("w0", "r1"))         # but not a work item of its own

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_usage_command_reads_with_its_own_seed_from_the_environment(secured, monkeypatch):
    from ops.usage import read

    url, creds = secured
    monkeypatch.setenv(CREDS_ENV, str(creds.creds))               # a directory: each command takes <role>.nk

    async def main():
        async with as_role(secured, "gateway") as (nc, errors):
            u = Usage("a", "acme", "k1", "tiny", "chat", "stop", 1, 0, 1, {}, 1.0, 2.0)
            await nats_bus.publish(nc.jetstream(), subjects.usage("acme", u.id), encode(u), subjects.msg_id("a"),
                                   errors)
        return await read(url)

    assert [u.id for u in asyncio.run(asyncio.wait_for(main(), 30))] == ["a"]


def test_generated_seeds_are_private_and_kept(tmp_path):
    creds = tmp_path / "bus"
    first = bus.seeds(creds)
    assert stat.S_IMODE(creds.stat().st_mode) == 0o700
    for role in roles.ROLES:
        assert stat.S_IMODE(seed_file(creds, role).stat().st_mode) == 0o600
    assert bus.seeds(creds) == first                     # the second start finds the same keys
    conf = bus.write_config(tmp_path / "nats.conf", creds, None)
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    seed_file(creds, "worker").write_text("not a seed\n")
    with pytest.raises(ValueError, match=r"worker\.nk: not an nkey user seed"):
        bus.seeds(creds)


def test_the_rarer_jobs_of_each_service_are_allowed(secured):
    """What a plain request does not exercise: the gateway asks a worker to resend and reads an end record,
    a worker asks the gateway for a client's progress, dead-letters, writes and deletes registry and suspect
    entries, reads an end record, the router ends a request past its deadline (its end record) and watches
    the registry."""
    async def main():
        async with (as_role(secured, "gateway") as (gw, g_errors), as_role(secured, "worker") as (w, w_errors),
                    as_role(secured, "router") as (router, r_errors)):
            async def answer(msg):
                await msg.respond(b"answer")
            await w.subscribe(subjects.RESEND_ALL, cb=answer)
            await gw.subscribe(subjects.PROGRESS_ALL, cb=answer)
            await w.flush()
            await gw.flush()
            assert (await gw.request(subjects.resend("r1"), b"", timeout=5)).data == b"answer"
            assert (await w.request(subjects.progress("r1"), b"", timeout=5)).data == b"answer"

            await nats_bus.publish(w.jetstream(), subjects.dead("acme", "r1"), b"letter", subjects.msg_id("r1"),
                                   w_errors)
            registry = await nats_bus.registry(w.jetstream())
            await registry.put("w0", b"beat")
            assert (await registry.get("w0")).value == b"beat"
            assert await nats_bus.store_end(w.jetstream(), "acme", "r1", None, b"done", w_errors) is None
            assert await nats_bus.ended(w.jetstream(), "acme", "r1", None) == b"done"
            assert await nats_bus.store_end(router.jetstream(), "acme", "r2", None, b"timeout", r_errors) is None
            assert await nats_bus.ended(gw.jetstream(), "acme", "r2", None) == b"timeout"
            watcher = await (await nats_bus.registry(router.jetstream())).watchall()
            assert (await watcher.updates(5)).key == "w0"
            await watcher.stop()
            assert await (await nats_bus.registry(gw.jetstream())).keys() == ["w0"]
            await registry.delete("w0")
            await (await nats_bus.suspects(w.jetstream())).put("w0", b"r1")
            assert await service.last_suspect(w, "w0") == "r1"             # read and deleted
            assert g_errors.violations() == w_errors.violations() == r_errors.violations() == []

    asyncio.run(asyncio.wait_for(main(), 30))


def test_bus_config_prints_the_blocks_a_server_of_ones_own_includes(tmp_path, capsys):
    from ops.cli import main

    main(["bus-config", "--creds", str(tmp_path / "creds")])
    (tmp_path / "bus.conf").write_text(capsys.readouterr().out)
    assert (tmp_path / "bus.conf").read_text() == bus.config(tmp_path / "creds", None)     # the seeds it made
    (tmp_path / "server.conf").write_text("port: 4222\njetstream: {}\ninclude ./bus.conf\n")
    check = subprocess.run([procs.nats_server_binary(), "-c", str(tmp_path / "server.conf"), "-t"],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and "is valid" in check.stderr + check.stdout, check.stderr


def test_a_server_without_authorization_ignores_the_seeds_a_process_finds(nats_url, tmp_path):
    """Seeds left in $TOKENBUS_HOME/bus by an authorized stack do not stop a later loopback stack."""
    bus.seeds(tmp_path / "creds")

    async def main():
        nc = await nats_bus.connect(nats_url, "test-worker", role="worker", credentials=Credentials(tmp_path / "creds"))
        await nc.publish(subjects.request_new("acme", "r1"), b"anything goes here")
        await nc.flush()
        await nc.close()

    asyncio.run(asyncio.wait_for(main(), 10))

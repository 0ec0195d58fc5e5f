"""The request log's Parquet archive: records read back equal to what was written, once each, by window,
tenant or id, from the partitions that can hold them only; partitions hold only their tenant's hour;
retention by age; any fsspec filesystem. Then the readers: select() and `tokenbus log export` over the
archive and a real nats-server together, and a replay of an archived request on a real stack."""
import asyncio
import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest

import bus
from ops import records
from schemas import subjects
from schemas.messages import Completion, encode
from schemas.sampling import SamplingParams
from services.recorder.archive import Archive

TENANTS = ["acme", "globex", "tenant_9-x"]
START = dt.datetime(2025, 6, 1, 22, 0, tzinfo=dt.UTC).timestamp()   # 50 records 290 s apart: into June 2nd


def sampling(i: int) -> SamplingParams:
    kinds = [SamplingParams(max_tokens=8, temperature=0),
             SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=(1 << 64) - 1 - i, stop=["\n\n"]),
             SamplingParams(max_tokens=32, seed=i, stop_token_ids=[2, 7], logit_bias={"11": -1.5}, min_tokens=3),
             SamplingParams(max_tokens=16, temperature=1.2, regex="[a-z]+", repetition_penalty=1.1, logprobs=2)]
    return kinds[i % len(kinds)]


def completion(i: int, **kw) -> Completion:
    """The i-th of a varied log: three tenants, stop reasons of each type, error ends, empty outputs."""
    error = i % 7 == 3
    fields = {"id": f"req-{i:03d}", "tenant": TENANTS[i % 3], "worker": f"w{i % 2}", "sampling": sampling(i),
              "prompt_token_ids": list(range(i, i + 5 + i % 11)) + [(1 << 31) - 1],
              "output_token_ids": [] if error or i % 10 == 0 else [100 + i, 7, 49151][: 1 + i % 3],
              "finish_reason": "error" if error else ["stop", "length", "abort"][i % 3],
              "stop_reason": [None, 128001, "</s>"][i % 3],
              "usage": {"prompt_tokens": 6 + i % 11, "completion_tokens": i},
              "timing": {} if error else {"queue_ms": 0.1 * i, "ttft_ms": 1 / 3},
              "created": START + 290.0 * i + 0.123456,
              "error_code": "worker_lost" if error else "", "error_message": "w1 stopped: ünïcode" if error else "",
              "ended": START + 290.0 * i + 7.5}
    return Completion(**{**fields, **kw})


LOG = [completion(i) for i in range(50)]


def hour_of(path: Path) -> float:
    name = next(p for p in path.parts if p.startswith("hour="))
    return dt.datetime.strptime(name[5:], "%Y-%m-%dT%H").replace(tzinfo=dt.UTC).timestamp()


def test_records_read_back_equal_to_those_written_and_a_batch_written_twice_reads_once(tmp_path):
    archive = Archive(str(tmp_path / "archive"))
    archive.write(LOG[:30])
    archive.write(LOG[20:])                        # a crash between the write and the ack: LOG[20:30] again
    got = archive.read()
    assert got == LOG                              # dataclass ==: sampling, stop_reason's type, every field
    assert [type(r.stop_reason) for r in got[:3]] == [type(None), int, str]
    assert {r.finish_reason for r in got} == {"stop", "length", "abort", "error"} and got[0].output_token_ids == []
    assert archive.read(request_id="req-001")[0].sampling.seed == (1 << 64) - 2
    assert Archive(str(tmp_path / "nothing-here")).read() == []
    assert not (tmp_path / "nothing-here").exists()          # a reader creates nothing


def test_every_file_holds_only_its_partitions_tenant_and_hour(tmp_path):
    archive = Archive(str(tmp_path))
    written = archive.write(LOG)
    files = sorted(tmp_path.rglob("*"))
    assert {p for p in files if p.is_file()} == {Path(p) for p in written}   # no temporary file is left
    assert len(written) == len({(r.tenant, int((r.created - START) // 3600)) for r in LOG})
    rows = 0
    for path in map(Path, written):
        assert path.parent.parent.parent == tmp_path and path.suffix == ".parquet"
        tenant = path.parent.parent.name.removeprefix("tenant=")
        table = pq.read_table(path)                # the library's own decoder, no schema of ours
        assert set(table["tenant"].to_pylist()) == {tenant}
        assert all(hour_of(path) <= c < hour_of(path) + 3600 for c in table["created"].to_pylist())
        assert table.schema.field("prompt_token_ids").type.value_type == "int32"
        rows += table.num_rows
    assert rows == len(LOG)
    assert "tenant=tenant_9-x" in {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="tenant"):
        archive.write([completion(0, tenant="../etc")])


def test_windows_select_by_time_tenant_and_id_and_open_only_their_partitions(tmp_path):
    archive = Archive(str(tmp_path))
    archive.write(LOG)
    since, until = LOG[13].created, LOG[25].created                      # 23:02:50 to 00:00:50
    assert archive.read(since=since, until=until) == LOG[13:25]           # [since, until)
    assert archive.read(since=LOG[45].created) == LOG[45:]
    assert archive.read(until=LOG[3].created) == LOG[:3]
    assert archive.read(tenant="globex") == [r for r in LOG if r.tenant == "globex"]
    assert archive.read(since, until, tenant="acme") == [r for r in LOG[13:25] if r.tenant == "acme"]
    assert archive.read(request_id="req-033") == [LOG[33]]
    assert archive.read(request_id="req-033", tenant="globex") == []      # req-033 is acme's
    assert archive.read(request_id="nope") == []
    # files that cannot be decoded, in an hour before the window and under another tenant: never opened
    first = dt.datetime.fromtimestamp(LOG[0].created, dt.UTC).strftime("%Y-%m-%dT%H")
    for tenant, hour in (("acme", first), ("initech", "2025-06-02T00")):
        (tmp_path / f"tenant={tenant}" / f"hour={hour}").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"tenant={tenant}" / f"hour={hour}" / "junk.parquet").write_bytes(b"not parquet")
    assert archive.read(since=since, until=until, tenant="acme") == [r for r in LOG[13:25] if r.tenant == "acme"]
    with pytest.raises(Exception):                                         # noqa: B017 (pyarrow's own error)
        archive.read(tenant="initech")


def test_prune_removes_the_hours_older_than_the_age_and_keeps_the_recent(tmp_path):
    archive = Archive(str(tmp_path))
    now = dt.datetime(2025, 6, 10, 12, 30, tzinfo=dt.UTC).timestamp()
    old = [completion(i, created=now - 3 * 86400 + i) for i in range(6)]  # three days ago: 3 tenants, one hour
    recent = [completion(i, created=now - 600 + i) for i in range(100, 103)]
    gone = completion(200, tenant="initech", created=now - 4 * 86400)    # a tenant with old records only
    archive.write(old)
    archive.write(old[:2])                                                # two files in two old partitions
    archive.write([*recent, gone])
    assert archive.prune(2 * 86400, now=now) == 3 + 2 + 1
    assert archive.read() == recent
    assert not (tmp_path / "tenant=initech").exists()                    # emptied: removed
    assert archive.prune(2 * 86400, now=now) == 0
    assert archive.prune(0, now=now + 7200) == 3 and archive.read() == [] and list(tmp_path.iterdir()) == []


def test_an_fsspec_url_holds_an_archive_memory_filesystem():
    name, mem = f"archive-{uuid.uuid4().hex}", fsspec.filesystem("memory")
    try:
        archive = Archive(f"memory://{name}")
        archive.write(LOG[:25])
        archive.write(LOG[20:])
        assert Archive(f"memory://{name}").read() == LOG
        assert archive.read(LOG[5].created, LOG[9].created, tenant="globex") == \
            [r for r in LOG[5:9] if r.tenant == "globex"]
        files = mem.find(f"/{name}")
        assert files and all(p.startswith(f"/{name}/tenant=") and p.endswith(".parquet") for p in files)
        assert archive.prune(0) == len(files) and archive.read() == []
    finally:
        if mem.exists(f"/{name}"):
            mem.rm(f"/{name}", recursive=True)


# -- the readers: the archive and the live stream together ---------------------------------------------------

async def publish(nats_url: str, recs: list[Completion]) -> None:
    nc = await bus.connect(nats_url, "test")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    for rec in recs:
        await js.publish(subjects.done(rec.tenant, rec.id), encode(rec), headers=subjects.msg_id(rec.id))
    await nc.close()


async def select(nats_url: str, **kw) -> list[Completion]:
    nc = await bus.connect(nats_url, "test")
    try:
        return await records.select(nc.jetstream(), **kw)
    finally:
        await nc.close()


def test_select_returns_the_archive_and_the_stream_once_each_in_created_order_and_export_writes_them(nats_url,
                                                                                                       tmp_path):
    now = time.time()
    ok = {"finish_reason": "length", "error_code": "", "error_message": ""}
    archived = [completion(i, created=now - 3 * 86400 + i, **ok) for i in range(4)]   # the bus dropped them
    both = completion(4, created=now - 3 * 86400 + 4, **ok)
    live = [completion(i, created=now - 30 + i, **ok) for i in range(5, 8)]
    hidden = [completion(8, id=f"{records.REPLAY_PREFIX}x", created=now - 86400, **ok),
              completion(9, created=now - 86400, finish_reason="error", error_code="e", error_message="m")]
    archive = Archive(str(tmp_path / "archive"))
    archive.write([*archived, dataclasses.replace(both, worker="archived-copy"), *hidden])
    asyncio.run(publish(nats_url, [both, *live]))

    expected = [*archived, both, *live]
    assert asyncio.run(select(nats_url, archive=archive)) == expected                # the stream's copy of req-004
    assert asyncio.run(select(nats_url, last=6, archive=archive)) == expected[-6:]
    assert asyncio.run(select(nats_url, last=2, archive=archive)) == live[-2:]
    assert asyncio.run(select(nats_url, since=dt.datetime.fromtimestamp(now - 7200, dt.UTC), archive=archive)) == \
        [both, *live]                                                                 # archived long before: left out
    assert asyncio.run(select(nats_url, request_id="req-002", archive=archive)) == [archived[2]]
    assert asyncio.run(select(nats_url, request_id=hidden[1].id, archive=archive)) == [hidden[1]]
    assert asyncio.run(select(nats_url, archive=Archive(str(tmp_path / "missing")))) == [both, *live]

    out = tmp_path / "all.jsonl"
    run = subprocess.run([sys.executable, "-m", "ops.cli", "log", "export", str(out), "--nats-url", nats_url],
                         env={**os.environ, "TB_ARCHIVE": archive.url}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and f"exported {len(expected)} records" in run.stdout, run.stderr
    assert records.loads(out) == expected
    run = subprocess.run([sys.executable, "-m", "ops.cli", "log", "export", str(out), "--last", "3", "--archive",
                          str(tmp_path / "missing"), "--nats-url", nats_url],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and records.loads(out) == [both, *live][-3:], run.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_request_replayed_from_the_archive_alone_is_identical(tiny_model, tmp_path, capsys):
    """A request served by a real stack, archived, then gone from the bus (TB_RESULTS purged): replay finds
    it in the archive and the stack reproduces every token."""
    from ops.cli import parser
    from ops.replay import main as replay
    from tests.e2e.conftest import collect, connect, send, start_stack

    (tmp_path / "stack").mkdir()
    stack = start_stack(tiny_model, tmp_path / "stack", workers=1)
    try:
        async def serve():
            async with connect(stack) as ws:
                await send(ws, {"type": "generate", "id": "c", "prompt_token_ids": [24, 25, 26, 27], "max_tokens": 12,
                                "temperature": 0.9, "ignore_eos": True})
                await collect(ws, {"c"})
            await asyncio.sleep(0.5)
            [rec] = await select(stack.nats_url)
            Archive(str(tmp_path / "archive")).write([rec])
            nc = await bus.connect(stack.nats_url, "test")
            await nc.jetstream().purge_stream(subjects.RESULTS_STREAM)
            await nc.close()
            return rec

        rec = asyncio.run(serve())
        assert asyncio.run(select(stack.nats_url)) == []
        assert len(rec.output_token_ids) == 12 and rec.sampling.seed is not None
        args = parser().parse_args(["replay", "--request-id", rec.id, "--archive", str(tmp_path / "archive"),
                                    "--nats-url", stack.nats_url, "--timeout", "60", "--json"])
        assert replay(args) == 0
        assert json.loads(capsys.readouterr().out) == {"replayed": 1, "identical": 1, "skipped": 0, "diffs": []}
    finally:
        stack.stop()

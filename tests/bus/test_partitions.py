"""A partitioned bus on a real nats-server: its own partition() mapping, from the config `tokenbus up
--bus-partitions 3` writes, puts every record of one request (request, handoff, work item, completion,
usage, dead letter) in the same partition, spreads requests over all of them, and a partition's
consumers see only its own. With roles enforced, each role reaches every partition's streams."""
import asyncio
import contextlib
import dataclasses

import pytest
from nats.js import api

import bus
from bus.log import configure
from ops import bus as ops_bus
from ops import cluster, procs
from schemas import roles, subjects
from schemas.credentials import Credentials

N = 3
LOG = configure("test")
IDS = [f"req-{i}" for i in range(30)]


def test_the_mapping_hashes_the_request_id_and_one_partition_maps_nothing():
    assert subjects.mappings(1) == {}
    mapped = subjects.mappings(N)
    assert set(mapped) == set(subjects.ENTRIES.values())
    assert mapped["tb.work.*.*"] == "tb.work.{{wildcard(1)}}.{{wildcard(2)}}.{{partition(3,2)}}"
    assert [c.name for c in bus.streams(N)][:N] == ["TB_REQUESTS_0", "TB_REQUESTS_1", "TB_REQUESTS_2"]
    assert [c.subjects for c in bus.streams(N)][:N] == [["tb.req.new.*.*.0"], ["tb.req.new.*.*.1"],
                                                        ["tb.req.new.*.*.2"]]
    assert [dataclasses.replace(c, max_bytes=None) for c in bus.streams(1)] == bus.STREAMS   # sized apart


def test_the_partition_count_is_checked(monkeypatch):
    monkeypatch.setenv(subjects.PARTITIONS_ENV, "0")
    with pytest.raises(ValueError, match="TB_BUS_PARTITIONS='0'"):
        subjects.partitions()
    monkeypatch.setenv(subjects.PARTITIONS_ENV, "3")
    assert subjects.parts() == [0, 1, 2]


def test_permissions_name_every_partition_of_a_stream_and_no_whole_one():
    allowed = roles.permissions("router", N)["publish"]["allow"]
    for p in range(N):
        assert f"$JS.API.CONSUMER.DURABLE.CREATE.TB_REQUESTS_{p}.router" in allowed
        assert f"$JS.API.STREAM.CREATE.TB_WORK_{p}" in allowed
    assert not any(".TB_REQUESTS." in a or a.endswith(".TB_REQUESTS") for a in allowed)
    assert roles.permissions("router", 1) == roles.permissions("router")


def publishes(rid: str) -> list[str]:
    return [subjects.request_new("acme", rid), subjects.route("acme", rid), subjects.work("w0", rid),
            subjects.done("acme", rid), subjects.usage("acme", rid), subjects.dead("acme", rid)]


async def partition_of_each(js) -> dict[str, set[int]]:
    """request id -> the partitions its records were stored in, over every stream."""
    where: dict[str, set[int]] = {}
    for p in range(N):
        for base in subjects.STREAM_NAMES:
            stream = subjects.stream(base, p)
            for seq in range(1, (await js.stream_info(stream)).state.last_seq + 1):
                msg = await js.get_msg(stream, seq)
                assert msg.subject.endswith(f".{p}"), msg.subject
                where.setdefault(msg.subject.split(".")[-2], set()).add(p)
    return where


@pytest.fixture
def partitioned(tmp_path):
    port = procs.free_port()
    proc = procs.start_nats(port, tmp_path, tmp_path / "nats.log",
                            config=ops_bus.write_config(tmp_path / "nats.conf", None, None, N))
    yield f"nats://127.0.0.1:{port}"
    procs.stop([proc])


def test_a_request_s_records_stay_in_the_partition_its_id_hashes_to(partitioned):
    async def main():
        nc = await bus.connect(partitioned, "test")
        js = nc.jetstream()
        await bus.ensure_streams(js, N)
        for rid in IDS:
            for subject in publishes(rid):
                ack = await js.publish(subject, rid.encode(), headers=subjects.msg_id(rid))
                assert ack.stream.rsplit("_", 1)[0] in subjects.STREAM_NAMES
        where = await partition_of_each(js)
        assert sorted(where) == sorted(IDS) and all(len(ps) == 1 for ps in where.values())
        counts = [sum(ps == {p} for ps in where.values()) for p in range(N)]
        assert all(counts) and sum(counts) == len(IDS), counts          # every partition has some

        for p in range(N):                        # partition p's router consumer: p's requests, all of them
            mine = {rid for rid, ps in where.items() if ps == {p}}
            stream = subjects.stream(subjects.REQUESTS_STREAM, p)
            await js.add_consumer(stream, bus.router(p))
            sub = await js.pull_subscribe_bind(stream=stream, durable=subjects.ROUTER_DURABLE)
            got = {m.data.decode() for m in await sub.fetch(len(IDS), timeout=1)
                   if not (m.headers or {}).get("Status")} if mine else set()
            assert got == mine
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await nc.close()

    asyncio.run(main())


def test_roles_reach_every_partition_on_an_authorized_partitioned_bus(tmp_path):
    creds, port = tmp_path / "creds", procs.free_port()
    proc = procs.start_nats(port, tmp_path, tmp_path / "nats.log",
                            config=ops_bus.write_config(tmp_path / "nats.conf", creds, None, N))
    url = f"nats://127.0.0.1:{port}"

    async def main():
        admin = await bus.connect(url, "test-admin", role="admin", credentials=Credentials(creds))
        await bus.ensure_streams(admin.jetstream(), N)
        worker = await bus.connect(url, "test-worker", role="worker", credentials=Credentials(creds))
        router = await bus.connect(url, "test-router", role="router", credentials=Credentials(creds))
        try:
            stored = {(await bus.publish(worker.jetstream(), subjects.done("acme", rid), b"x",
                                         subjects.msg_id(rid), LOG)).stream for rid in IDS}
            assert stored == {f"TB_RESULTS_{p}" for p in range(N)}
            for p in range(N):                    # the router's durable on each partition's request log
                await router.jetstream().add_consumer(subjects.stream(subjects.REQUESTS_STREAM, p), bus.router(p))
                await worker.jetstream().add_consumer(subjects.stream(subjects.WORK_STREAM, p),
                                                      bus.worker_consumer("w0", p))
                await router.jetstream().add_consumer(subjects.stream(subjects.WORK_STREAM, p), api.ConsumerConfig(
                    name=f"reroute-w1-{p}", filter_subject=bus.work_filter("w1", p),
                    ack_policy=api.AckPolicy.EXPLICIT, inactive_threshold=5.0))   # moving a departed worker's
        finally:
            for nc in (worker, router, admin):
                await nc.close()

    try:
        asyncio.run(main())
    finally:
        procs.stop([proc])


def test_partitions_are_placed_on_disjoint_servers_where_the_cluster_has_room():
    three, nine = cluster.local_nodes(3, "/unused", port=14222), cluster.local_nodes(9, "/unused", port=15222)
    assert all(cluster.partition_tags(n, three, N) == ["tb-p0", "tb-p1", "tb-p2"] for n in three)
    assert [cluster.partition_tags(n, nine, N) for n in nine] == [[f"tb-p{i // 3}"] for i in range(9)]
    assert cluster.partition_tags(nine[0], nine, 1) == []
    assert "server_tags" not in cluster.config(three[0], three)
    assert [c.placement.tags for c in bus.streams(N)][:N] == [["tb-p0"], ["tb-p1"], ["tb-p2"]]

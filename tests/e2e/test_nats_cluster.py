"""The pipeline on a 3-node nats cluster (R3 streams and buckets): three nats-server processes with their
own stores and routes, each in a network namespace of its own where the machine allows (root, iproute2),
on 127.0.0.1 otherwise. Under load, SIGKILL of the node that leads TB_REQUESTS, or a 10 s partition of
it: every accepted request, those in flight and those sent during the fault, completes with the offline
engine's tokens; TB_REQUESTS and TB_RESULTS hold one record per request id, and so do the usage records
(the recorder's database and what is still on the bus). The time without a leader is printed."""
import asyncio
import concurrent.futures
import json
import threading
import time

import pytest

import bus
from lab.chaos import netns
from lab.chaos.scenarios import logs
from ops import cluster
from ops.procs import free_port
from ops.up import Stack
from schemas import subjects
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, connect, receive, send, started
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(300)]

GREEDY = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
BEFORE, DURING = 8, 4                    # requests in flight at the fault, and sent while it lasts
PARTITION = 10.0
NO_NETNS = netns.available()


@pytest.fixture
def network():
    if NO_NETNS:
        yield None
        return
    net = netns.Network(3).create()
    yield net
    net.delete()


def cluster_stack(model: str, data_dir, network, partitions: int = 1) -> Stack:
    nodes = network.nodes(data_dir) if network else cluster.local_nodes(3, data_dir)
    return started(Stack(model, free_port(), data_dir, workers=1, worker_args=WORKER_ARGS, nats_nodes=nodes,
                         partitions=partitions))


async def leader(stack: Stack, stream: str) -> str | None:
    nc = await bus.connect(stack.nats_url, "test-leader")
    try:
        return await cluster.stream_leader(nc.jetstream(timeout=0.5), stream)
    finally:
        await nc.close()


def leaderless(stack: Stack, stream: str, old: str, timeout: float = 60.0) -> float:
    """Seconds until `stream` has a leader other than `old`, from now."""
    start = time.monotonic()
    while asyncio.run(leader(stack, stream)) in (None, old):
        assert time.monotonic() - start < timeout, f"{stream} had no new leader within {timeout:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - start


def under_load(stack: Stack, fault) -> dict[str, dict]:
    """BEFORE requests; once tokens flow, fault() in this thread (a child dies with the thread that started
    it) while DURING more are sent; every request's frames, tokens from the first on."""
    generating = threading.Event()

    async def load():
        async with connect(stack) as ws:
            for i in range(BEFORE):
                await send(ws, {"type": "generate", "id": f"b{i}", "prompt": f"before the fault {i}", **GREEDY})
            got = {f"b{i}": [] for i in range(BEFORE)}
            first = await receive(ws)
            got[first["id"]] += first["token_ids"]
            generating.set()
            await asyncio.sleep(0.5)
            for i in range(DURING):
                await send(ws, {"type": "generate", "id": f"d{i}", "prompt": f"during the fault {i}", **GREEDY})
                await asyncio.sleep(0.5)
            rest = await collect(ws, set(got) | {f"d{i}" for i in range(DURING)}, timeout=180)
            for i, toks in got.items():
                rest[i]["token_ids"] = toks + rest[i]["token_ids"]
            return rest

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        client = pool.submit(asyncio.run, load())
        assert generating.wait(60), "no token came before the fault"
        fault()
        return client.result(timeout=220)


def check_nothing_lost_nothing_twice(stack: Stack, model: str, got: dict[str, dict]) -> None:
    prompts = {cid: f"{'before' if cid[0] == 'b' else 'during'} the fault {cid[1:]}" for cid in got}
    outs = LLM(model).generate(list(prompts.values()), SamplingParams(**GREEDY))
    for (cid, g), want in zip(got.items(), outs, strict=True):
        assert g["end"]["type"] == "done", (cid, g["end"])
        assert g["token_ids"] == want.token_ids, cid
    stored, recorded, duplicated, metered = asyncio.run(logs(stack.nats_url, BEFORE + DURING,
                                                             partitions=stack.partitions,
                                                             database=stack.database_url))
    assert stored == recorded == metered == BEFORE + DURING and duplicated == 0


def test_sigkill_of_the_stream_leader_under_load_loses_no_request_and_runs_none_twice(tiny_model, tmp_path, network):
    stack = cluster_stack(tiny_model, tmp_path, network)
    try:
        killed = asyncio.run(leader(stack, subjects.REQUESTS_STREAM))
        assert killed in {n.name for n in stack.nats_nodes}
        seconds = {}

        def kill():
            stack.kill(killed)
            seconds["leaderless"] = leaderless(stack, subjects.REQUESTS_STREAM, killed)

        got = under_load(stack, kill)
        where = "in network namespaces" if network else f"on 127.0.0.1 ({NO_NETNS})"
        print(f"\n{killed} (TB_REQUESTS' leader) SIGKILLed {where}: TB_REQUESTS without a leader for "
              f"{seconds['leaderless']:.1f} s")
        check_nothing_lost_nothing_twice(stack, tiny_model, got)
        stack.start_node(killed)                            # it rejoins from its own store and catches up
        cluster.wait_ready(stack.nats_nodes)
    finally:
        stack.stop()


@pytest.mark.skipif(bool(NO_NETNS), reason=str(NO_NETNS))
def test_a_10s_partition_of_the_stream_leader_under_load_loses_no_request_and_runs_none_twice(
        tiny_model, tmp_path, network):
    stack = cluster_stack(tiny_model, tmp_path, network)
    try:
        cut = asyncio.run(leader(stack, subjects.REQUESTS_STREAM))
        node = next(n for n in stack.nats_nodes if n.name == cut)
        seconds = {}

        def partition():
            network.cut(node)
            start = time.monotonic()
            seconds["leaderless"] = leaderless(stack, subjects.REQUESTS_STREAM, cut)
            time.sleep(max(0.0, PARTITION - (time.monotonic() - start)))
            network.heal(node)

        got = under_load(stack, partition)
        print(f"\n{cut} (TB_REQUESTS' leader) cut off for {PARTITION:.0f} s: TB_REQUESTS without a leader for "
              f"{seconds['leaderless']:.1f} s")
        cluster.wait_ready(stack.nats_nodes)          # healed: every node current, one meta leader again
        check_nothing_lost_nothing_twice(stack, tiny_model, got)
        stack.check_alive()
    finally:
        stack.stop()


def routed_by(stack: Stack) -> dict[str, set[str]]:
    """Each router's name -> the request ids it routed, from its log."""
    out = {}
    for name in stack.routers:
        lines = (stack.data_dir / "logs" / f"{name}.log").read_text().splitlines()
        out[name] = {e["request_id"] for e in map(json.loads, filter(None, lines)) if e.get("event") == "routed"}
    return out


async def partitions_of(stack: Stack) -> dict[str, int]:
    """Each request id in the request logs -> its partition."""
    nc = await bus.connect(stack.nats_url, "test-partitions")
    js, out = nc.jetstream(timeout=30), {}          # a cluster that lost a node answers slowly under load
    try:
        for p in subjects.parts(stack.partitions):
            stream = subjects.stream(subjects.REQUESTS_STREAM, p)
            for seq in range(1, (await js.stream_info(stream)).state.last_seq + 1):
                out[(await js.get_msg(stream, seq)).headers[subjects.REQUEST_ID]] = p
    finally:
        await nc.close()
    return out


def test_a_node_of_a_3_partition_cluster_killed_under_load_loses_nothing_and_partitions_hold(
        tiny_model, tmp_path, network):
    """`--bus-partitions 3` on 3 nodes: a router per partition, the node leading partition 0's request log
    SIGKILLed under load; every request completes once with the offline engine's tokens, its records in
    every partition's streams are whole, and each router routed only its own partition's requests."""
    stack = cluster_stack(tiny_model, tmp_path, network, partitions=3)
    try:
        assert set(stack.routers) == {"router0", "router1", "router2"}
        first = subjects.stream(subjects.REQUESTS_STREAM, 0)
        killed = asyncio.run(leader(stack, first))

        def kill():
            stack.kill(killed)
            leaderless(stack, first, killed)

        got = under_load(stack, kill)
        check_nothing_lost_nothing_twice(stack, tiny_model, got)
        where, routed = asyncio.run(partitions_of(stack)), routed_by(stack)
        assert len(where) == BEFORE + DURING
        for name, part in stack.routers.items():
            assert all(where[rid] == part for rid in routed[name]), name
        assert set().union(*routed.values()) == set(where)
        stack.start_node(killed)
        cluster.wait_ready(stack.nats_nodes)
    finally:
        stack.stop()

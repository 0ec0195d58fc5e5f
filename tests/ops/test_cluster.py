"""A nats cluster's pieces, checked against nats-server itself: each node's configuration file passes
`nats-server -t`; three nodes started from them form a cluster with one meta leader; streams and
buckets are made with 3 replicas there and 1 on a single server; a connection given the server list moves
to another server when its own dies; every node reports sync_always; `tokenbus up` refuses a cluster that
cannot survive a failure and an fsync policy nats-server would not take."""
import asyncio
import json
import subprocess
import urllib.request

import pytest
from nats.js import api

import bus as nats_bus
from ops import bus, cli, cluster, procs
from schemas import roles, subjects

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nodes(tmp_path):
    """Three nodes on 127.0.0.1 with their own stores, routes and ports, ready (a meta leader)."""
    nodes = cluster.local_nodes(3, tmp_path)
    children = []
    try:
        children += [cluster.start(n, nodes, tmp_path / f"{n.name}.log") for n in nodes]
        cluster.wait_ready(nodes)
        yield nodes, children
    finally:
        procs.stop(children)


def test_every_node_config_passes_nats_server_t_and_routes_to_the_other_nodes(tmp_path):
    nodes = cluster.local_nodes(3, tmp_path, port=14222)
    assert [(n.port, n.cluster_port, n.http_port) for n in nodes] == [(14222 + i, 16222 + i, 18222 + i)
                                                                     for i in range(3)]
    for node in nodes:
        text = cluster.config(node, nodes)
        path = tmp_path / f"{node.name}.conf"
        path.write_text(text)
        checked = subprocess.run([procs.nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr + checked.stdout
        assert f"server_name: {node.name}" in text and "sync_interval: always" in text
        assert node.route not in text and all(n.route in text for n in nodes if n is not node)
    single = cluster.config(nodes[0], nodes[:1], sync="2m")
    assert "cluster {" not in single and "sync_interval: 2m" in single
    secured = tmp_path / "secured.conf"                  # with the bus's nkey users (tokenbus up --bus-auth)
    secured.write_text(cluster.config(nodes[0], nodes, blocks=bus.config(tmp_path / "seeds", None)))
    checked = subprocess.run([procs.nats_server_binary(), "-t", "-c", str(secured)], capture_output=True, text=True)
    assert checked.returncode == 0 and "authorization" in secured.read_text(), checked.stderr


def test_a_cluster_makes_every_stream_and_bucket_with_3_replicas_spread_over_its_nodes(nodes):
    nodes, _ = nodes

    async def main():
        nc = await nats_bus.connect(cluster.url(nodes), "test-cluster")
        js = nc.jetstream()
        await js.add_stream(api.StreamConfig(name=subjects.DEAD_STREAM, subjects=[subjects.DEAD_SUBJECTS],
                                             max_age=60.0, num_replicas=1))       # made before, as R1
        await nats_bus.ensure_streams(js)
        infos = {name: await js.stream_info(name) for name in roles.ALL_STREAMS}
        await nc.close()
        return infos

    infos = asyncio.run(main())
    for name, info in infos.items():
        expected = 1 if name == subjects.DEAD_STREAM else subjects.REPLICAS    # an existing stream keeps its count
        assert info.config.num_replicas == expected, name
        peers = {info.cluster.leader, *(r.name for r in info.cluster.replicas or [])}
        assert len(peers) == expected and peers <= {n.name for n in nodes}, name
    assert infos[subjects.DEAD_STREAM].config.max_age == subjects.LOG_MAX_AGE     # but takes this build's config


def test_a_single_server_gets_every_stream_and_bucket_with_one_replica(nats_url):
    async def main():
        nc = await nats_bus.connect(nats_url, "test-single")
        js = nc.jetstream()
        await nats_bus.ensure_streams(js)
        await nats_bus.ensure_streams(js)                       # again: nothing changes, nothing fails
        counts = [(await js.stream_info(name)).config.num_replicas for name in roles.ALL_STREAMS]
        await nc.close()
        return counts

    assert asyncio.run(main()) == [1] * (len(nats_bus.STREAMS) + 5)          # and 5 KV buckets


def test_a_connection_given_the_server_list_moves_on_when_its_server_dies_and_stores_again(nodes):
    nodes, children = nodes

    async def main():
        nc = await nats_bus.connect(cluster.url(nodes), "test-failover")
        js = nc.jetstream()
        await nats_bus.ensure_streams(js)
        first = nc.connected_url.port
        children[[n.port for n in nodes].index(first)].kill()
        ack = await nats_bus.publish(js, subjects.dead("t", "r1"), b"x", subjects.msg_id("r1"), _Log())
        assert nc.connected_url.port != first and nc.stats["reconnects"] == 1
        again = await nats_bus.publish(js, subjects.dead("t", "r1"), b"x", subjects.msg_id("r1"), _Log())
        await nc.close()
        return ack, again

    ack, again = asyncio.run(main())
    assert again.duplicate and again.seq == ack.seq          # the retried message id is stored once


def test_an_ops_command_given_a_server_list_reads_the_cluster_when_one_listed_server_does_not_answer(nodes, capsys):
    nodes, _ = nodes
    dead = f"nats://127.0.0.1:{procs.free_port()}"
    cli.main(["status", "--json", "--nats-url", f"{dead},{cluster.url(nodes)}"])      # one answering is enough
    assert json.loads(capsys.readouterr().out)["workers"] == []
    with pytest.raises(SystemExit) as exit:
        cli.main(["status", "--nats-url", f"{dead},{dead}"])
    assert f"no nats-server answered at {dead}" in str(exit.value)


class _Log:
    def warning(self, *_, **__):
        pass


def test_servers_of_splits_a_comma_separated_list_and_refuses_an_empty_one():
    assert nats_bus.servers_of(" nats://a:4222, nats://b:4222,,nats://c:4222 ") == [
        "nats://a:4222", "nats://b:4222", "nats://c:4222"]
    with pytest.raises(ValueError, match="names no server"):
        nats_bus.servers_of(" , ")


def test_every_node_reports_an_fsync_before_every_acknowledgement(nodes):
    nodes, _ = nodes
    for node in nodes:
        with urllib.request.urlopen(f"http://{node.host}:{node.http_port}/varz", timeout=5) as r:
            varz = json.loads(r.read())
        assert varz["jetstream"]["config"]["sync_always"] is True and varz["cluster"]["name"] == cluster.CLUSTER_NAME


@pytest.mark.parametrize("argv, message", [
    (["--nats-cluster", "2"], "at least 3 servers"),
    (["--nats-cluster", "3", "--nats-url", "nats://a:4222"], "give one of them"),
    (["--nats-sync", "sometimes"], "--nats-sync 'sometimes'"),
])
def test_up_refuses_a_cluster_short_of_3_a_cluster_with_nats_url_and_a_bad_sync(argv, message):
    with pytest.raises(SystemExit) as exit:
        cli.main(["up", *argv])
    assert message in str(exit.value)

"""nats-server clusters as local processes: the configuration file of each node, starting a node (on
127.0.0.1 or in a network namespace of its own, lab/chaos/netns.py), waiting for JetStream's meta leader, and
finding which node leads a stream. The same file layout runs on separate hosts (docs/cluster.md)."""
import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ops import procs
from schemas import subjects

CLUSTER_NAME = "tokenbus"
SYNC = "always"                   # fsync before every acknowledgement (docs/cluster.md); "2m" is NATS's default
PING = "2s"                       # a route or client silent for PING × PING_MAX is closed: a cut-off peer is
PING_MAX = 3                      # noticed in seconds, not NATS's default 4 minutes
READY_TIMEOUT = 60.0


@dataclass(slots=True)
class Node:
    """One nats-server: its name in the cluster, where clients, peers and monitoring reach it, its store."""
    name: str
    host: str
    port: int                      # clients
    cluster_port: int              # routes from the other nodes
    http_port: int                 # monitoring: /healthz, /jsz
    store: Path
    netns: str | None = None       # the network namespace it runs in (None: this one)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def route(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"


def local_nodes(n: int, data_dir: Path, port: int | None = None) -> list[Node]:
    """n nodes on 127.0.0.1, each with its own store under data_dir: on port, port + 1, ... for clients,
    2000 and 4000 above for routes and monitoring (4222, 6222, 8222: NATS's own); on free ports without one."""
    def ports(i: int) -> tuple[int, int, int]:
        if port is None:
            return procs.free_port(), procs.free_port(), procs.free_port()
        return port + i, port + 2000 + i, port + 4000 + i
    return [Node(f"tb-{i + 1}", "127.0.0.1", *ports(i), Path(data_dir) / f"nats-{i + 1}") for i in range(n)]


def url(nodes: list[Node]) -> str:
    """The server list every service gets (--nats-url): comma-separated client URLs."""
    return ",".join(n.url for n in nodes)


def partition_tags(node: Node, nodes: list[Node], partitions: int) -> list[str]:
    """The placement tags of `node` on a bus of `partitions` (schemas/subjects.py): where the cluster has
    REPLICAS nodes for each partition, node i serves partition (i // REPLICAS) mod partitions alone, so
    the partitions' writes land on disjoint servers; on a smaller cluster every node serves every one."""
    if partitions == 1:
        return []
    if len(nodes) < partitions * subjects.REPLICAS:
        return [subjects.partition_tag(p) for p in range(partitions)]
    return [subjects.partition_tag(nodes.index(node) // subjects.REPLICAS % partitions)]


def config(node: Node, nodes: list[Node], sync: str = SYNC, listen: str | None = None, blocks: str = "",
           tags: list[str] = ()) -> str:
    """The nats-server configuration file of `node` in a cluster of `nodes` (a single node: no cluster
    block). listen: the address it binds (default node.host; 0.0.0.0 in a namespace or on a host);
    blocks: more top-level blocks (the bus's authorization and tls: ops/bus.py); tags: its server_tags
    (partition_tags())."""
    bind = listen or node.host
    lines = [f"server_name: {node.name}", f"listen: {bind}:{node.port}", f"http: {bind}:{node.http_port}",
             f'ping_interval: "{PING}"', f"ping_max: {PING_MAX}",
             f'jetstream {{\n  store_dir: "{node.store / "jetstream"}"\n  sync_interval: {sync}\n}}',
             *([f"server_tags: {json.dumps(list(tags))}"] if tags else [])]
    if len(nodes) > 1:
        routes = ", ".join(n.route for n in nodes if n is not node)
        lines.append(f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: {bind}:{node.cluster_port}\n"
                     f'  routes: [{routes}]\n  ping_interval: "{PING}"\n  ping_max: {PING_MAX}\n}}')
    return "\n".join(lines) + "\n" + blocks


def start(node: Node, nodes: list[Node], log: Path | None = None, sync: str = SYNC, blocks: str = "",
          partitions: int = 1):
    """Writes the node's configuration beside its store and starts it (inside its namespace, if it has
    one), tagged for its partitions of a partitioned bus; waits until it listens for clients. ValueError
    if something listens on its port already."""
    if procs.listening(node.port, node.host):
        raise ValueError(f"{node.name}: port {node.port} is in use (another `tokenbus up`?): choose another "
                         f"--nats-port")
    node.store.mkdir(parents=True, exist_ok=True)
    path = node.store / "nats-server.conf"
    path.write_text(config(node, nodes, sync, "0.0.0.0" if node.netns else None, blocks,
                           partition_tags(node, nodes, partitions)))
    cmd = [procs.nats_server_binary(), "-c", str(path)]
    if node.netns:
        cmd = ["ip", "netns", "exec", node.netns, *cmd]
    proc = procs.spawn(cmd, log)
    procs.wait_port(node.port, proc, node.name, host=node.host)
    return proc


def healthz(node: Node) -> bool:
    """The node's /healthz: JetStream is up, the meta leader known and its streams current."""
    try:
        with urllib.request.urlopen(f"http://{node.host}:{node.http_port}/healthz", timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def meta_leader(node: Node) -> str | None:
    """The JetStream meta leader as `node` sees it (/jsz), or None."""
    try:
        with urllib.request.urlopen(f"http://{node.host}:{node.http_port}/jsz", timeout=1) as r:
            return (json.loads(r.read()).get("meta_cluster") or {}).get("leader") or None
    except Exception:
        return None


def wait_ready(nodes: list[Node], timeout: float = READY_TIMEOUT) -> None:
    """Until every node answers /healthz and, in a cluster, one meta leader is agreed: only then can streams
    be made."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leaders = {meta_leader(n) for n in nodes} if len(nodes) > 1 else {"-"}
        if all(map(healthz, nodes)) and len(leaders) == 1 and None not in leaders:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the nats cluster was not ready within {timeout:.0f} s (every node's /healthz, one "
                       f"JetStream meta leader)")


async def stream_leader(js, stream: str) -> str | None:
    """The server name of the stream's Raft leader (JetStream stream info `cluster.leader`; a single server
    names itself by its id); None while it has none (the request goes unanswered within js's timeout)."""
    try:
        info = await js.stream_info(stream)
    except Exception:
        return None
    return info.cluster.leader if info.cluster else None

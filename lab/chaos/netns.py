"""Separate network namespaces for the nodes of a local nats cluster, so that one can be cut off with the
host's own tools (`ip link set ... down`) as a network partition would. Root and iproute2 needed.

Layout: a bridge on this host with the first address of a private /24, and per node a namespace whose
eth0 (one end of a veth pair, the other on the bridge) has its own address: the nodes reach each other
and this host reaches them, as hosts on one switch. Names start with "tbc" and a random suffix."""
import contextlib
import ipaddress
import secrets
import subprocess
from pathlib import Path

from ops.cluster import Node

SUBNETS = ipaddress.ip_network("10.231.0.0/16")     # one /24 of it per network, picked at random


def ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    name = f"tbc{secrets.token_hex(3)}"
    try:
        ip("netns", "add", name)
    except (OSError, FileNotFoundError) as e:
        return f"no network namespaces here ({e})"
    ip("netns", "del", name)
    return None


class Network:
    """The bridge and one namespace per node; delete() removes them all."""

    def __init__(self, count: int):
        self.id = secrets.token_hex(3)
        used = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
        free = [s for s in SUBNETS.subnets(new_prefix=24) if f"{s.network_address + 1}/" not in used]
        self.subnet = free[secrets.randbelow(len(free))]
        self.bridge = f"tbc{self.id}br"
        self.spaces = [f"tbc{self.id}n{i}" for i in range(1, count + 1)]

    def address(self, i: int) -> str:
        return str(self.subnet.network_address + 11 + i)

    def create(self) -> "Network":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.subnet.network_address + 1}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.spaces):
                veth = f"tbc{self.id}v{i + 1}"             # eth0's peer, on this host's bridge
                ip("netns", "add", ns)
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                ip("link", "set", veth, "master", self.bridge, "up")
                ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=ns)
                ip("link", "set", "eth0", "up", ns=ns)
                ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.delete()
            raise
        return self

    def nodes(self, data_dir: Path) -> list[Node]:
        """One node per namespace, each on NATS's own ports (4222, 6222, 8222) at its own address."""
        return [Node(f"tb-{i + 1}", self.address(i), 4222, 6222, 8222, Path(data_dir) / f"nats-{i + 1}", ns)
                for i, ns in enumerate(self.spaces)]

    def cut(self, node: Node) -> None:
        """Partitions the node from every peer and client: its only link goes down."""
        ip("link", "set", "eth0", "down", ns=node.netns)

    def heal(self, node: Node) -> None:
        ip("link", "set", "eth0", "up", ns=node.netns)

    def delete(self) -> None:
        """Removes the veth pairs, the namespaces and the bridge (the nodes in them must have exited)."""
        links = [f"tbc{self.id}v{i}" for i in range(1, len(self.spaces) + 1)]
        for args in (*(("link", "del", v) for v in links), *(("netns", "del", ns) for ns in self.spaces),
                     ("link", "del", self.bridge)):
            with contextlib.suppress(OSError):
                ip(*args)

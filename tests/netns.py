"""Several "nodes" on one machine, for Open MPI jobs across nodes without a second machine.

Each node is a network namespace of its own, with its own host name (a UTS namespace per
process started in it: Open MPI names its shared-memory files and session directories after
the host name, and all nodes share /tmp and /dev/shm), joined to the others by a veth pair to
a bridge in a "switch" namespace, on 169.254.77.0/24 (link-local; IPv6 off). The namespaces
hold no other interface but loopback and no route, so no traffic can leave them. mpirun runs
in the first node; it reaches the others through tests/netns_agent.sh as its
``plm_rsh_agent`` (no sshd): the agent enters the node's namespace and starts the daemon
there.

Names carry the creator's pid (``gemmpi-<pid>x<hex>-...``): a cluster left by a killed run
is removed by the next one (its pid is gone), never one another live run still uses.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

PREFIX = "gemmpi-"
SUBNET = "169.254.77"  # link-local, /24: the nodes are .1, .2, ...
IFACE = "gem0"  # each node's one interface (the same name in every namespace)
AGENT = Path(__file__).resolve().parent / "netns_agent.sh"


@dataclass(frozen=True)
class Node:
    netns: str
    hostname: str
    addr: str
    slots: int


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    switch: str  # the namespace holding the bridge
    hostfile: Path  # Open MPI's: each node's host name and slots
    table: Path  # netns_agent.sh's: host name, address, namespace

    def mpirun(self, n: int, options: list[str], program: list[str]) -> list[str]:
        """The command line of an Open MPI job of ``n`` ranks over these nodes, run from
        the first node's namespace (with its host name): ranks fill each node's slots in
        order, MPI and Open MPI's daemons talk over the nodes' own interface only."""
        first = self.nodes[0]
        return ["ip", "netns", "exec", first.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', first.hostname,
                "mpirun", "-n", str(n), "--hostfile", str(self.hostfile),
                # the agent starts every daemon, each stays its agent's child (not daemonized:
                # in the job's session, so that killing the job's session ends them all)
                "--mca", "plm_rsh_agent", str(AGENT), "--mca", "plm_rsh_no_tree_spawn", "1",
                "--mca", "orte_leave_session_attached", "1",
                "--mca", "oob_tcp_if_include", IFACE, "--mca", "btl_tcp_if_include", IFACE,
                *options, *program]

    def env(self) -> dict[str, str]:
        """What the agent needs in mpirun's environment (it inherits it)."""
        return {"GEM_NETNS_TABLE": str(self.table)}


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def _namespaces() -> list[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def remove_stale() -> None:
    """Delete the namespaces of clusters whose creating process is gone (a killed run)."""
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("x", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", name)


def check_available() -> None:
    """Fail (never skip) with what is missing: the suite runs as root with iproute2."""
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CI runs tools/test.sh as root)")
    for tool in ("ip", "unshare", "mpirun"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing; run tools/install.sh (iproute2, util-linux, "
                        "openmpi-bin)")
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.fail(f"`ip netns` does not work here: {res.stderr.strip()}")


def _create(tag: str, slots: list[int], workdir: Path) -> Cluster:
    switch = f"{PREFIX}{tag}-sw"
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    nodes = []
    for i, n_slots in enumerate(slots):
        node = Node(netns=f"{PREFIX}{tag}-{i}", hostname=f"gemnode{i}-{tag}",
                    addr=f"{SUBNET}.{i + 1}", slots=n_slots)
        _ip("netns", "add", node.netns)
        # no IPv6 (not even link-local addresses) on the node's interface
        subprocess.run(["ip", "netns", "exec", node.netns, "sysctl", "-q", "-w",
                        "net.ipv6.conf.all.disable_ipv6=1",
                        "net.ipv6.conf.default.disable_ipv6=1"], check=True,
                       capture_output=True)
        _ip("-n", node.netns, "link", "set", "lo", "up")
        _ip("-n", node.netns, "link", "add", IFACE, "type", "veth", "peer", "name", f"p{i}",
            "netns", switch)
        _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
        _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", IFACE)
        _ip("-n", node.netns, "link", "set", IFACE, "up")
        nodes.append(node)
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"{n.hostname} slots={n.slots}\n" for n in nodes))
    table = workdir / "nodes.table"
    table.write_text("".join(f"{n.hostname} {n.addr} {n.netns}\n" for n in nodes))
    return Cluster(tuple(nodes), switch, hostfile, table)


def _remove(tag: str) -> None:
    for name in _namespaces():
        if name.startswith(f"{PREFIX}{tag}-"):
            _ip("netns", "del", name)


@contextmanager
def cluster(slots: list[int], workdir: Path) -> Iterator[Cluster]:
    """A cluster of ``len(slots)`` nodes with these slots, removed on exit whatever
    happened (the namespaces' interfaces, veth pairs and bridge go with them)."""
    check_available()
    remove_stale()
    tag = f"{os.getpid()}x{secrets.token_hex(2)}"
    try:
        yield _create(tag, slots, workdir)
    finally:
        _remove(tag)

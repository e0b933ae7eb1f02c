"""``dtrain plan --hostfile FILE``: the world and the hardware a hostfile gives the planner.

A hostfile names machines and their slots (:mod:`dtrain.launch.hosts`), so it gives the ranks (every slot) and the
ranks a node (a host's slots; ranks fill hosts in order, as mpiexec places them). What it cannot give is the link
between the machines: that stays the preset's, and the planner says so.

A dtrain cluster's hostfile (``dtrain cluster up``, :mod:`dtrain.launch.cluster`) gives that too: its nodes are
network namespaces of this machine, so::

    inside a node    this machine's calibrated links and compute (the ``this`` preset), with every rank of the
                     world busy on its cores, whichever node it is on (Hardware.cluster)
    between nodes    bandwidth: the link's rate (``--link 100mbit``: 1e8 bits/s / 8 = 12.5 MB/s each way), or on an
                     unshaped cluster the rate a TCP stream reached when ``up`` measured the link;
                     latency: one way, as ``up`` measured it (a one-byte TCP message, node 1 to node 2)

``--inter-bandwidth``, ``--inter-latency``, ``--ranks`` and ``--ranks-per-node`` given on the command line still win.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtrain.errors import UserError
from dtrain.launch import cluster as clusters
from dtrain.launch.hosts import Host, parse_hostfile, total_slots
from dtrain.plan import hardware as hw


@dataclass
class World:
    """What a hostfile gives: its hosts, the ranks and ranks a node, the cluster (if it is one's) and the link
    between nodes (None: the preset's), and a sentence saying where the numbers came from."""

    path: str
    hosts: list[Host]
    ranks: int
    ranks_per_node: int
    cluster: clusters.Cluster | None = None
    inter_bytes_s: float | None = None  # bytes/s each way between nodes: the planner's --inter-bandwidth x 1e9
    inter_latency_s: float | None = None
    source: str = ""


def read(path) -> World:
    """The world and the link that the hostfile ``path`` gives (a refusal in one line if it cannot be read, or names
    a cluster that is not up)."""
    hosts = parse_hostfile(path)
    name = hosts[0].cluster
    if name is None:
        per_node = hosts[0].slots
        uneven = "" if len({h.slots for h in hosts}) == 1 else " (the first host's; their slots differ)"
        return World(str(path), hosts, total_slots(hosts), per_node,
                     source=f"{path}: {len(hosts)} host(s), {total_slots(hosts)} slot(s), {per_node} a node{uneven}; "
                     "the link between machines is the preset's (a hostfile does not say it: --inter-bandwidth, "
                     "--inter-latency)")  # fmt: skip
    record = clusters.load(name)
    if record is None or not record.ready:
        state = "is not up (no record of it)" if record is None else "is half made (dtrain cluster down, then up)"
        raise UserError(f"--hostfile {path} is cluster {name}'s, which {state}: dtrain cluster up --name {name} ... "
                        "makes it")  # fmt: skip
    world = World(str(path), hosts, total_slots(hosts), record.slots, cluster=record)
    nodes = f"cluster {name}: {len(hosts)} node(s) x {record.slots} rank(s)"
    if len(hosts) < 2 or record.latency_us is None:
        world.source = f"{nodes}, no link between nodes to price; inside a node this machine's calibration"
        return world
    if record.link is not None:
        world.inter_bytes_s = clusters.rate_bits_s(record.link) / 8
        rate = f"its {record.link} link ({megabytes(world.inter_bytes_s)}/s each way)"
    elif record.measured_bits_s:
        world.inter_bytes_s = record.measured_bits_s / 8
        rate = f"its unshaped link at the {megabytes(world.inter_bytes_s)}/s a TCP stream reached"
    else:
        raise UserError(f"cluster {name} is unshaped and its link was not measured: --inter-bandwidth GBS gives it")
    world.inter_latency_s = record.latency_us * 1e-6
    world.source = (f"{nodes}; between nodes {rate}, {record.latency_us:g} us one way as measured; inside a node "
                    "this machine's calibration")  # fmt: skip
    return world


def megabytes(bytes_s: float) -> str:
    return f"{bytes_s / 1e6:.3g} MB"


def machine(base: hw.Hardware, world: World) -> hw.Hardware:
    """``base`` (the preset) as the hostfile's world makes it: its ranks a node, and on a cluster its link between
    nodes and its nodes on this machine. A cluster's machine must be this one's (``--machine this``)."""
    if world.cluster is None:
        return dataclasses.replace(base, ranks_per_node=world.ranks_per_node)
    if base.name != hw.THIS:
        raise UserError(f"--hostfile {world.path} is cluster {world.cluster.name}'s, whose nodes are this machine's: "
                        f"plan it on --machine {hw.THIS} (its calibrated numbers), not {base.name}")  # fmt: skip
    inter = base.inter
    if world.inter_bytes_s is not None:
        inter = dataclasses.replace(base.inter, alpha=world.inter_latency_s, beta=1.0 / world.inter_bytes_s)
    nodes = f"{len(world.hosts)} nodes x {world.ranks_per_node}"
    about = f"cluster {world.cluster.name} ({nodes}, network namespaces of {base.about})"
    return dataclasses.replace(base, ranks_per_node=world.ranks_per_node, inter=inter, cluster=world.cluster.name,
                               about=about)  # fmt: skip

"""Two-level all-reduce: cheap links inside a node, few messages on the expensive links between nodes.

A cluster has fast links inside a node (shared memory, NVLink) and slower ones between nodes (the network). A flat
ring over all p ranks pays 2(p-1) network latencies, and each of its steps waits for the slowest link in the ring.
Both variants below do most of their steps inside nodes and only a few across the network::

        node 0                    node 1                    node 2            K = 2 ranks per node,
    [ r0 (leader)  r1 ]       [ r2 (leader)  r3 ]       [ r4 (leader) ]       unequal last node allowed
         ^   |  reduce            ^   |                      ^                for "hierarchical"
         |   v  / bcast           |   v                      |
         +---------------- ring among the leaders -----------+

**"hierarchical"**: (1) binomial-tree reduce of each node's buffers to its leader (local rank 0); (2) ring all-reduce
of the whole buffer among the m leaders; (3) binomial-tree broadcast from each leader to its node. Only the leaders
use the network, with a full n-byte ring all-reduce each.

**"hierarchical_rs"** (Horovod's variant, needs equal node sizes K): (1) ring reduce-scatter inside each node: local
rank i ends owning shard i (1/K of the buffer); (2) ring all-reduce of shard i among the ranks with local rank i, one
per node: K independent inter-node rings, each on n/K bytes, so every rank uses the network and no link carries
more than n/K; (3) ring all-gather inside each node. For p = 4, K = 2 (nodes {0,1}, {2,3})::

    step               rank 0            rank 1            rank 2            rank 3
    (1) intra RS       c1 -> 1           c0 -> 0           c1 -> 3           c0 -> 2       (shards c0 | c1)
    (2) inter ring     c0 <-> 2          c1 <-> 3          c0 <-> 0          c1 <-> 1      (ring of 2: RS + AG)
    (3) intra AG       c0 -> 1           c1 -> 0           c0 -> 3           c1 -> 2

**Cost** (n bytes, m nodes of K ranks; intra-node alpha, beta; inter-node alpha', beta'; L = ceil(log2 K)):
    hierarchical:     ``2L (alpha + n beta) + L n gamma + 2(m-1) alpha' + 2 (m-1)/m n beta' + (m-1)/m n gamma``
    hierarchical_rs:  ``2(K-1) alpha + 2 (K-1)/K n beta + (K-1)/K n gamma
                        + 2(m-1) alpha' + 2 (m-1)/m (n/K) beta' + (m-1)/m (n/K) gamma``
Exact bytes per rank: the sum of what it sends in each phase (tree.py and ring.py give the per-phase counts; for
hierarchical_rs the inter-node ring runs on shard i, ``chunk_bounds(n, K)[i]``).

**Nodes.** By default ``comm.Split_type(COMM_TYPE_SHARED)`` finds the ranks that share memory. On one machine that
is everyone, so ``ranks_per_node=K`` emulates nodes instead: node = rank // K. Splitting a communicator is a
collective call that costs far more than a small all-reduce, so the sub-communicators are made once per
(communicator, K) and cached; :func:`free_communicators` releases them (collectively: every rank must call it).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import numpy as np

from dtrain import kernels
from dtrain.collectives import ring, tree
from dtrain.comm.sim import COMM_TYPE_SHARED, UNDEFINED
from dtrain.comm.trace import TracedComm, untraced


@dataclasses.dataclass
class Topology:
    """A rank's view of the nodes: its node's communicator, the leaders' (None off leaders) and its cross one."""

    node: object  # the ranks of my node, ordered by rank; my local rank is node.Get_rank()
    leaders: object  # local rank 0 of every node (None on the other ranks)
    cross: object  # the ranks with my local rank, one per node, ordered by node
    equal: bool  # every node has the same number of ranks
    node_sizes: tuple | None  # known when nodes are emulated; None when they come from Split_type


# Per thread (simulated ranks are threads): id(base comm) -> (weak reference to it, {ranks_per_node: Topology}).
# Communicators are not hashable, so the key is the id, and the weak reference tells a live communicator from a
# dead one whose id has been reused.
_local = threading.local()


def _cache() -> dict:
    return _local.__dict__.setdefault("topologies", {})


def topology(comm, ranks_per_node=None) -> Topology:
    """The node structure of ``comm`` (cached): emulated nodes of ``ranks_per_node`` ranks, or real ones.

    The cache is keyed by the communicator under any tracer wrapper, so wrapping the same communicator again does
    not split it again; a traced caller gets the cached sub-communicators wrapped in its own tracer.
    """
    base = untraced(comm)
    cache = _cache()
    ref, by_k = cache.get(id(base), (None, None))
    if ref is None or ref() is not base:
        by_k = {}
        cache[id(base)] = (weakref.ref(base), by_k)
    if ranks_per_node not in by_k:
        by_k[ranks_per_node] = _build(base, ranks_per_node)
    topo = by_k[ranks_per_node]
    if isinstance(comm, TracedComm):

        def traced(sub):
            return None if sub is None else TracedComm(sub, comm.tracer)

        topo = dataclasses.replace(topo, node=traced(topo.node), leaders=traced(topo.leaders), cross=traced(topo.cross))
    return topo


def node_sizes(p: int, ranks_per_node: int) -> tuple:
    """The sizes of emulated nodes: ``ranks_per_node`` each, the last one possibly smaller."""
    return tuple(min(ranks_per_node, p - start) for start in range(0, p, ranks_per_node))


def _build(comm, ranks_per_node):
    p, r = comm.Get_size(), comm.Get_rank()
    if ranks_per_node is None:
        node = comm.Split_type(COMM_TYPE_SHARED, key=r)
        sizes = None
        # Are all nodes the same size? Only a collective can tell: all-reduce (size, -size) with max.
        extremes = np.array([node.Get_size(), -node.Get_size()], dtype=np.float64)
        tree.allreduce(comm, extremes, "max")
        equal = extremes[0] == -extremes[1]
    else:
        node = comm.Split(r // ranks_per_node, key=r)
        sizes = node_sizes(p, ranks_per_node)
        equal = len(set(sizes)) == 1
    local = node.Get_rank()
    leaders = comm.Split(0 if local == 0 else UNDEFINED, key=r)
    cross = comm.Split(local, key=r)
    return Topology(node, leaders or None, cross, bool(equal), sizes)


def free_communicators() -> None:
    """Free every cached sub-communicator (a collective call: all ranks must make it, in the same order)."""
    cache = _cache()
    for _, by_k in cache.values():
        for topo in by_k.values():
            for sub in (topo.node, topo.leaders, topo.cross):
                if sub is not None:
                    sub.Free()
    cache.clear()


def allreduce(comm, buf, op="sum", ranks_per_node=None):
    """Tree reduce to each node's leader, ring all-reduce among leaders, tree broadcast inside each node."""
    topo = topology(comm, ranks_per_node)
    inner = "sum" if op == "avg" else op  # divide once, by the world size, not by each level's size
    tree.reduce(topo.node, buf, 0, inner)
    if topo.leaders is not None:
        ring.allreduce(topo.leaders, buf, inner)
        if op == "avg":
            kernels.scale_(buf, 1.0 / comm.Get_size())
    return tree.broadcast(topo.node, buf, 0)


def allreduce_rs(comm, buf, op="sum", ranks_per_node=None):
    """Intra-node reduce-scatter, inter-node all-reduce of each shard, intra-node all-gather (equal nodes only)."""
    topo = topology(comm, ranks_per_node)
    if not topo.equal:
        sizes = f" {list(topo.node_sizes)}" if topo.node_sizes else ""
        raise ValueError(
            f"hierarchical_rs needs nodes of equal size, these are not{sizes}: use 'hierarchical', "
            "which allows a smaller last node"
        )
    inner = "sum" if op == "avg" else op
    shard = ring.reduce_scatter(topo.node, buf, inner)  # my local rank's shard, a view of buf
    ring.allreduce(topo.cross, shard, inner)
    if op == "avg":
        kernels.scale_(shard, 1.0 / comm.Get_size())
    return ring.allgather(topo.node, buf)

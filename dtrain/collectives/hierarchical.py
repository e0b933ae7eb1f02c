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

**Nodes** are a :class:`Topology`, built once by whoever owns the communicator and handed to every call::

    topo = hierarchical.topology(comm, ranks_per_node=2)      # collective: every rank calls it, once
    collectives.allreduce(comm, grads, algorithm="hierarchical", topology=topo)   # as often as you like
    topo.free()                                               # collective too, when done

``topology(comm)`` finds the ranks that share memory (``comm.Split_type(COMM_TYPE_SHARED)``). On one machine that is
everyone, so ``ranks_per_node=K`` emulates nodes instead: node = rank // K, the last node possibly smaller. The
sub-communicators are made with ``Split`` on the communicator given, so a traced communicator gives traced ones (and
a staged one staged ones): the algorithms below never need to know which wrappers exist.
"""

from __future__ import annotations

import dataclasses

from dtrain import kernels
from dtrain.collectives import ring, shm_windows, tree
from dtrain.collectives._checks import check_ranks_per_node
from dtrain.comm.names import COMM_TYPE_SHARED, UNDEFINED


@dataclasses.dataclass(frozen=True)
class Topology:
    """One rank's view of the nodes of ``comm``: its node's communicator, the leaders' (None off leaders), its cross
    one. Build it with :func:`topology`; free its communicators with :meth:`free` (every rank, once)."""

    comm: object  # the communicator it was built on (the whole world of the all-reduce)
    node: object  # the ranks of my node, ordered by rank; my local rank is node.Get_rank()
    leaders: object  # local rank 0 of every node (None on the other ranks)
    cross: object  # the ranks with my local rank, one per node, ordered by node
    node_sizes: tuple  # every node's size, in node order
    ranks_per_node: int | None  # the emulated node size, or None for real nodes

    @property
    def equal(self) -> bool:
        """Every node has the same number of ranks (what hierarchical_rs needs)."""
        return len(set(self.node_sizes)) == 1

    def free(self) -> None:
        """Free the sub-communicators and the shared windows on them (a collective call: every rank of ``comm``)."""
        for sub in (self.node, self.leaders, self.cross):
            if sub is not None:
                shm_windows.release(sub)
                sub.Free()


def node_sizes(p: int, ranks_per_node: int) -> tuple:
    """The sizes of emulated nodes: ``ranks_per_node`` each, the last one possibly smaller."""
    return tuple(min(ranks_per_node, p - start) for start in range(0, p, ranks_per_node))


def topology(comm, ranks_per_node: int | None = None) -> Topology:
    """Split ``comm`` into nodes (a collective call): emulated ones of ``ranks_per_node`` ranks, or the real ones.

    Splitting costs far more than a small all-reduce, so build the topology once and pass it to every call.
    """
    check_ranks_per_node(ranks_per_node)
    p, r = comm.Get_size(), comm.Get_rank()
    if ranks_per_node is None:
        node = comm.Split_type(COMM_TYPE_SHARED, key=r)
        # Every node's size, in the order of its leader's rank: only a collective can tell.
        layout = comm.allgather((node.Get_rank(), node.Get_size()))
        sizes = tuple(size for local, size in layout if local == 0)
    else:
        node = comm.Split(r // ranks_per_node, key=r)
        sizes = node_sizes(p, ranks_per_node)
    local = node.Get_rank()
    leaders = comm.Split(0 if local == 0 else UNDEFINED, key=r)
    cross = comm.Split(local, key=r)
    return Topology(comm, node, leaders or None, cross, sizes, ranks_per_node)


def allreduce(topo: Topology, buf, op="sum"):
    """Tree reduce to each node's leader, ring all-reduce among leaders, tree broadcast inside each node."""
    inner = "sum" if op == "avg" else op  # divide once, by the world size, not by each level's size
    tree.reduce(topo.node, buf, 0, inner)
    if topo.leaders is not None:
        ring.allreduce(topo.leaders, buf, inner)
        if op == "avg":
            kernels.scale_(buf, 1.0 / topo.comm.Get_size())
    return tree.broadcast(topo.node, buf, 0)


def allreduce_rs(topo: Topology, buf, op="sum"):
    """Intra-node reduce-scatter, inter-node all-reduce of each shard, intra-node all-gather (equal nodes only)."""
    if not topo.equal:
        raise ValueError(
            f"hierarchical_rs needs nodes of equal size, these are {list(topo.node_sizes)}: use 'hierarchical', "
            "which allows a smaller last node"
        )
    inner = "sum" if op == "avg" else op
    shard = ring.reduce_scatter(topo.node, buf, inner)  # my local rank's shard, a view of buf
    ring.allreduce(topo.cross, shard, inner)
    if op == "avg":
        kernels.scale_(shard, 1.0 / topo.comm.Get_size())
    return ring.allgather(topo.node, buf)

"""Exercise 2.5 (lesson 2): hierarchical (two-level) all-reduce.

Check it:   dtrain exercises check 2.5 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

from dtrain.collectives import ring, tree  # noqa: F401  (building blocks you may use: see below)


def hierarchical_allreduce(topology, buf):
    """Sum ``buf`` over all ranks, in place, in two levels: inside each node, then across nodes among the leaders.

    Signature: ``hierarchical_allreduce(topology, buf) -> None``. ``topology`` is a
    ``dtrain.collectives.hierarchical.Topology``, this rank's view of the nodes, made by the checker with
    ``hierarchical.topology(comm, ranks_per_node=k)`` (k = 2, then 3; the last node may be smaller). Its
    communicators (each with mpi4py's buffer methods):

    * ``topology.node``: the ranks of this rank's node; ``topology.node.Get_rank()`` is the local rank, and local
      rank 0 is the node's *leader*;
    * ``topology.leaders``: the leaders of all nodes, one per node, in node order (None on a rank that is not a
      leader);
    * ``topology.comm``: the whole world (you should not need it).

    ``buf`` is a 1-D float32 or float64 NumPy array, the same length on every rank.

    Before: rank r holds its own values in ``buf``.
    After:  every rank holds the element-wise sum over *all* ranks in that same ``buf``.

    The algorithm:
    1. inside each node, a binomial-tree reduce of the node's buffers to its leader;
    2. among the leaders only, a ring all-reduce of the whole buffer (the only traffic between nodes);
    3. inside each node, a binomial-tree broadcast of the result from the leader.

    You may build it from dtrain's collectives, imported above: ``tree.reduce(comm, buf, root)``,
    ``tree.broadcast(comm, buf, root)`` and ``ring.allreduce(comm, buf)`` (or your own from exercises 2.1-2.3). The
    checker counts the bytes at each level: between nodes only the m leaders send, 2 (m - 1) n elements in all (a
    ring); inside a node of s ranks, 2 (s - 1) n (a tree reduce, then a tree broadcast).

    Hint: every rank of a node calls the node-level steps; only a rank whose ``topology.leaders`` is not None takes
    part in step 2 (the others go straight on to step 3, where they wait for their leader).
    """
    raise NotImplementedError("exercise 2.5: hierarchical all-reduce — see lessons/02_allreduce.py")

"""Binomial-tree reduce and broadcast: ceil(log2 p) rounds, and all-reduce = reduce + broadcast.

Number the ranks relative to the root, ``v = (rank - root) % p``. In round k (mask = 2^k) every rank whose bit k is
its lowest set bit sends its partial sum to ``v - mask`` and drops out; a rank with bit k clear receives from
``v + mask`` if that rank exists. The partners form a binomial tree (p = 8, root 0)::

                     0                     reduce:     round 1 (mask 1)   1->0  3->2  5->4  7->6
            +--------+--------+                        round 2 (mask 2)   2->0  6->4
            4        2        1                        round 3 (mask 4)   4->0
          +-+-+      |
          6   5      3                     broadcast:  the same edges, reversed and in reverse order
          |                                            round 1  0->4;  round 2  0->2  4->6;
          7                                            round 3  0->1  2->3  4->5  6->7

Any p works: a partner beyond p - 1 is simply missing (p = 6 has no 6 and 7, so 4 has only child 5). For p = 4::

    reduce       round 1: 1 -> 0, 3 -> 2 (0 and 2 add)     round 2: 2 -> 0 (0 adds)
    broadcast    round 1: 0 -> 2                           round 2: 0 -> 1, 2 -> 3

**Cost** (n bytes, p ranks, L = ceil(log2 p)): reduce ``L (alpha + n beta + n gamma)``, broadcast
``L (alpha + n beta)``; all-reduce ``2L alpha + 2L n beta + L n gamma``. Only log p latencies, so trees win for
small messages; but the whole buffer crosses every level, so for large messages the ring's 2 (p-1)/p n beta wins.
Exact bytes sent: in the reduce every rank except the root sends n once; in the broadcast a rank sends n to each of
its children, which are ``v + m`` for the powers of two m below v's lowest set bit (below p for the root) with
``v + m < p``.
"""

from __future__ import annotations

from dtrain import kernels
from dtrain.collectives._chunks import scratch


def reduce(comm, buf, root=0, op="sum"):
    """Reduce every rank's ``buf`` into the root's ``buf`` up a binomial tree.

    Ranks with children accumulate into their own ``buf`` on the way, so afterwards only the root's ``buf`` is
    meaningful (the others hold partial sums).
    """
    p, r = comm.Get_size(), comm.Get_rank()
    v = (r - root) % p
    mask = 1
    while mask < p:
        if v & mask:  # my lowest set bit: hand my partial sum to my parent, and I am done
            comm.Send(buf, dest=(v - mask + root) % p)
            break
        if v + mask < p:  # a child exists in this round: receive its partial sum and add it
            incoming = scratch(buf, buf.size)
            comm.Recv(incoming, source=(v + mask + root) % p)
            kernels.reduce_(buf, incoming, op)
        mask <<= 1
    if v == 0 and op == "avg":
        kernels.scale_(buf, 1.0 / p)
    return buf


def broadcast(comm, buf, root=0):
    """Copy the root's ``buf`` to every rank down a binomial tree."""
    p, r = comm.Get_size(), comm.Get_rank()
    v = (r - root) % p
    mask = 1
    while mask < p:  # find my lowest set bit: my parent is v - mask (the root runs off the end)
        if v & mask:
            comm.Recv(buf, source=(v - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # my children are v + m for the powers of two m below that bit
        if v + mask < p:
            comm.Send(buf, dest=(v + mask + root) % p)
        mask >>= 1
    return buf


def allreduce(comm, buf, op="sum"):
    """Reduce up the tree to rank 0, then broadcast down the same tree."""
    reduce(comm, buf, 0, op)
    return broadcast(comm, buf, 0)

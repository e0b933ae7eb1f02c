"""Exercises 2.2 and 2.3 (lesson 2): binomial-tree broadcast and reduce.

Check them:  dtrain exercises check 2.2 --path ex
             dtrain exercises check 2.3 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np  # noqa: F401  (you will want it)

# The binomial tree rooted at ``root``, on p ranks. Number the ranks relative to the root, v = (rank - root) % p, and
# let lowbit(v) = v & -v be v's lowest set bit. v's parent is v - lowbit(v); v's children are v + m for
# m = lowbit(v) / 2, lowbit(v) / 4, ..., 1 (the root, v = 0: every power of two m < p) with v + m < p. A partner's
# real rank is (v' + root) % p. For p = 8, root 0:
#
#                  0                   reduce:     round 1 (mask 1)   1->0  3->2  5->4  7->6
#         +--------+--------+                      round 2 (mask 2)   2->0  6->4
#         4        2        1                      round 3 (mask 4)   4->0
#       +-+-+      |
#       6   5      3                   broadcast:  the same edges, reversed and in reverse order:
#       |                                          0->4;  then 0->2, 4->6;  then 0->1, 2->3, 4->5, 6->7
#       7
#
# Any p works: a partner beyond p - 1 is simply missing (p = 6 has no 6 and 7, so 4 has only child 5).


def tree_broadcast(comm, buf, root):
    """Copy the root's ``buf`` into every rank's ``buf``, in place, down the binomial tree rooted at ``root``.

    Signature: ``tree_broadcast(comm, buf, root) -> None``. ``comm`` has mpi4py's buffer methods (``Get_rank``,
    ``Get_size``, ``Send``, ``Recv``, ...); a real MPI communicator under mpiexec, a simulated one in the checker's
    first part. ``buf`` is a 1-D float32 or float64 NumPy array, the same length on every rank; ``root`` is a rank.

    Before: the root holds the values to share; every other rank holds values of its own (to be overwritten).
    After:  every rank holds the root's values in ``buf``.

    The algorithm (ceil(log2 p) rounds): a rank other than the root first receives the whole buffer from its parent,
    straight into ``buf``; then every rank sends ``buf`` to each of its children, the farthest (largest m) first.
    Every rank but the root receives exactly one message, so p - 1 messages in all, each the whole buffer: the
    checker counts who sent to whom.

    Hint: find lowbit(v) with a loop ``mask = 1; while mask < p and not v & mask: mask <<= 1`` (for the root it ends
    at the first power of two >= p), receive if v != 0, then ``mask >>= 1`` down to 1, sending to ``v + mask`` when
    it is < p. Always convert back: ``(v + mask + root) % p``.
    """
    raise NotImplementedError("exercise 2.2: tree broadcast — see lessons/02_allreduce.py")


def tree_reduce(comm, buf, root):
    """Sum every rank's ``buf`` into the root's ``buf``, in place, up the binomial tree rooted at ``root``.

    Signature: ``tree_reduce(comm, buf, root) -> None``; ``comm``, ``buf`` and ``root`` as for ``tree_broadcast``.

    Before: rank r holds its own values in ``buf``.
    After:  the root's ``buf`` holds the element-wise sum over all ranks. The other ranks' ``buf`` may hold partial
            sums (they are not checked).

    The algorithm (ceil(log2 p) rounds): for mask = 1, 2, 4, ... while mask < p: if v & mask (mask is v's lowest set
    bit), send ``buf`` (your partial sum) to your parent v - mask and stop; otherwise, if the child v + mask exists
    (< p), receive its partial sum into a scratch array and add it into ``buf``. Every rank but the root sends
    exactly one message, the whole buffer, to its parent: p - 1 in all; the checker counts who sent to whom.

    Hint: the parent's real rank is ``(v - mask + root) % p`` and the child's ``(v + mask + root) % p``: forget the
    ``+ root`` and the sums meet at the wrong rank. ``scratch = np.empty_like(buf)`` once, then
    ``comm.Recv(scratch, source=...)`` and ``buf += scratch``.
    """
    raise NotImplementedError("exercise 2.3: tree reduce — see lessons/02_allreduce.py")

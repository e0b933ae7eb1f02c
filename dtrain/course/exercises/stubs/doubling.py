"""Exercise 2.4 (lesson 2): recursive-doubling all-reduce, for any number of ranks.

Check it:   dtrain exercises check 2.4 --path ex
Train with it, once it passes:
            dtrain launch -n 3 -m dtrain train --paradigm ddp --allreduce ex/doubling.py:doubling_allreduce
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np  # noqa: F401  (you will want it)


def doubling_allreduce(comm, buf):
    """Sum ``buf`` over all ranks of ``comm``, in place, by recursive doubling.

    Signature: ``doubling_allreduce(comm, buf) -> None``. ``comm`` has mpi4py's buffer methods (``Get_rank``,
    ``Get_size``, ``Send``, ``Recv``, ``Sendrecv``, ...). ``buf`` is a 1-D float32 or float64 NumPy array of n >= 1
    elements. p, the number of ranks, is any number >= 1 (not only a power of two).

    Before: rank r holds its own values in ``buf``.
    After:  every rank holds, in that same ``buf``, the element-wise sum of all ranks' values.

    The algorithm, for p a power of two: log2 p steps; at step k (distance d = 2^k = 1, 2, 4, ...) rank v exchanges
    its *whole* buffer with v XOR d, and both add what they received. After the last step everyone has the sum::

        p = 4     step 0 (distance 1)      step 1 (distance 2)
                  0 <-> 1   2 <-> 3        0 <-> 2   1 <-> 3        each holds x0 + x1 + x2 + x3

    Any other p: let p' be the largest power of two <= p and r = p - p'.
    1. Fold: among the first 2r ranks, each odd rank q sends its buffer to q - 1 (which adds it) and then only waits.
    2. The p' ranks left (the even ranks < 2r, then every rank >= 2r) run the algorithm above under new numbers
       0 .. p'-1: rank q is v = q // 2 if q < 2r, else q - r; participant v's real rank is 2 v if v < r, else v + r.
    3. Unfold: each even rank q < 2r sends the finished sum to q + 1, which receives it into ``buf``.
    For p = 6: r = 2; 1 -> 0 and 3 -> 2 fold in; ranks 0, 2, 4, 5 act as 0, 1, 2, 3; 0 -> 1 and 2 -> 3 at the end.

    Messages per rank, each the whole buffer (the checker counts them, and where they go, in this order): log2 p'
    exchanges, plus one for an even rank < 2r (the unfold); an odd rank < 2r sends only one.

    Hint: ``comm.Sendrecv(buf, dest=partner, recvbuf=scratch, source=partner)`` then ``buf += scratch``: both
    partners end with the same sum.
    """
    raise NotImplementedError("exercise 2.4: recursive-doubling all-reduce — see lessons/02_allreduce.py")

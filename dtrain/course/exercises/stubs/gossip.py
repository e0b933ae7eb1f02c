"""Exercise 6.1 (lesson 6): one gossip round.

Check it:   dtrain exercises check 6.1 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np  # noqa: F401  (you will want it)


def gossip_step(comm, flat, neighbours):
    """One gossip (D-PSGD) round, in place: average ``flat`` with the neighbours' ``flat``.

    Signature: ``gossip_step(comm, flat, neighbours) -> None``. ``comm`` has mpi4py's buffer methods (``Get_rank``,
    ``Isend``/``Irecv`` returning requests with ``Wait``, ``Send``, ``Recv``, ...). ``flat`` is a 1-D float64 NumPy
    array (this rank's weights), the same length on every rank. ``neighbours`` is the list of the d distinct ranks
    this rank averages with (possibly empty); the graph is symmetric: if j is in rank r's list, r is in j's.

    Before: rank r holds its own x_r in ``flat``.
    After:  ``flat`` holds x_r / (d + 1) + sum over neighbours j of x_j / (d + 1), each x_j as it was *before* the
            round (so receive the neighbours' vectors into buffers of your own, not into ``flat``).

    Stacking the ranks' vectors as the rows of X, one round is X <- W X with W[r, j] = 1 / (d + 1) for j = r and for
    each neighbour j of r: the *mixing matrix*. With every rank of the same degree (the ring, the torus, the
    exponential graph, a random pairing) W is symmetric and doubly stochastic: every row and every column sums to 1,
    so a round keeps the mean over ranks exactly and only shrinks the spread around it. The checker reads off the
    weights you applied and holds the result against W X.

    Messages: ``flat`` once to each neighbour (d messages), and nothing to anyone else. With no neighbours, send
    nothing and leave ``flat`` as it is.

    Hint: post every receive and every send before waiting on any, so that no rank waits for a neighbour that waits
    for it: ``inbox = [np.empty_like(flat) for _ in neighbours]``, ``reqs = [comm.Irecv(inbox[i], j) for i, j in
    enumerate(neighbours)] + [comm.Isend(flat, j) for j in neighbours]``, then ``for q in reqs: q.Wait()``.
    """
    raise NotImplementedError("exercise 6.1: one gossip round — see lessons/06_gossip.py")

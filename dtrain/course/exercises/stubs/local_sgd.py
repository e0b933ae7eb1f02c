"""Exercise 5.1 (lesson 5): local SGD's averaging step.

Check it:   dtrain exercises check 5.1 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np  # noqa: F401  (you will want it)


def local_sgd_step(comm, flat, step, sync_every):
    """What local SGD does after each of its local optimizer steps: every ``sync_every``-th step, average the weights.

    Signature: ``local_sgd_step(comm, flat, step, sync_every) -> bool``. ``comm`` has mpi4py's buffer methods
    (``Get_rank``, ``Get_size``, ``Send``, ``Recv``, ``Sendrecv``, ...). ``flat`` is a 1-D float64 NumPy array: this
    rank's weights, which its own optimizer steps have moved away from the other ranks'. ``step`` is the number of
    the local step just taken (1, 2, 3, ...) and ``sync_every`` (H >= 1) says how often to average.

    Before: rank r holds its own weights w_r in ``flat``.
    After:  if ``step % sync_every == 0``: every rank holds the mean over ranks, (w_0 + ... + w_{p-1}) / p, in that
            same ``flat`` (so all ranks are equal again), and the function returns True. Otherwise ``flat`` is left as
            it is, nothing at all is sent (that is the point of local SGD: H times less traffic), and it returns False.

    You may use dtrain's collectives for the average: ``from dtrain import collectives`` then
    ``collectives.allreduce(comm, flat, "sum", "ring")`` sums ``flat`` over the ranks in place (or your own
    ``ring_allreduce`` from exercise 2.1). The checker counts the messages of the local steps: there must be none.

    Hint: the mean is the sum divided by ``comm.Get_size()``; write it into ``flat`` itself (``flat /= p``), not into
    a new array.
    """
    raise NotImplementedError("exercise 5.1: local SGD's averaging step — see lessons/05_local_sgd.py")

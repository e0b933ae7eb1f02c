"""Planted bug: the average is the all-reduce's sum, never divided by the number of ranks.

exercise: 5.1
file: local_sgd.py
expect: flat holds the sum over ranks, not the mean: divide by p = 2
"""

from dtrain import collectives


def local_sgd_step(comm, flat, step, sync_every):
    if step % sync_every:
        return False
    collectives.allreduce(comm, flat, "sum", "ring")  # the bug: then flat /= comm.Get_size()
    return True

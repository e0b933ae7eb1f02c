"""Planted bug: partial -> split made with an all-reduce: every rank keeps the whole sum, not its block of it (and
an all-reduce sends twice a reduce-scatter's bytes).

exercise: 14.2
file: spmd.py
expect: it is the whole sum T, what an all-reduce leaves on every rank: partial -> split keeps only this rank's block
"""

import numpy as np

from dtrain import collectives


def redistribute(comm, block, source, target, dim):
    p, r = comm.Get_size(), comm.Get_rank()
    if source == "partial":  # replicated or split: the bug sums everything on every rank either way
        return collectives.allreduce(comm, np.array(block, copy=True))
    buf = np.empty((p, *block.shape))
    buf[r] = block
    collectives.allgather(comm, buf)
    return np.concatenate(list(buf), axis=dim)

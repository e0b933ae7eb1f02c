"""Planted bug: split -> replicated gathers every block and puts them side by side (np.hstack) whatever the
dimension T was split along: right for columns, wrong for rows.

exercise: 14.2
file: spmd.py
expect: it is the 2 blocks joined along dimension 1; T was split along dimension 0
"""

import numpy as np

from dtrain import collectives


def redistribute(comm, block, source, target, dim):
    p, r = comm.Get_size(), comm.Get_rank()
    if source == "partial" and target == "replicated":
        return collectives.allreduce(comm, np.array(block, copy=True))
    if source == "partial":
        parts = np.stack(np.split(block, p, axis=dim))
        return np.array(collectives.reduce_scatter(comm, parts)).reshape(parts.shape[1:])
    buf = np.empty((p, *block.shape))
    buf[r] = block
    collectives.allgather(comm, buf)
    return np.hstack(list(buf))  # the bug: side by side along dimension 1, whatever dim is

"""Planted bug: the k largest entries are chosen from this step's gradient alone, and the residual is never added
in: what earlier steps did not send is never sent.

exercise: 13.1
file: compression.py
expect: values holds flat's entries alone: send residual + flat at those indices
"""

import numpy as np

from dtrain import collectives


def topk_step(comm, flat, residual, k):
    p, r = comm.Get_size(), comm.Get_rank()
    index = np.sort(np.argsort(-np.abs(flat))[:k])  # the bug: residual += flat first, and choose from residual
    values = flat[index].copy()
    pairs = np.zeros(p * 2 * k)
    pairs[r * 2 * k : r * 2 * k + k], pairs[r * 2 * k + k : (r + 1) * 2 * k] = index, values
    collectives.allgather(comm, pairs, "ring")
    flat[:] = 0
    for q in range(p):
        flat[pairs[q * 2 * k : q * 2 * k + k].astype(np.int64)] += pairs[q * 2 * k + k : (q + 1) * 2 * k]
    flat /= p
    return index, values

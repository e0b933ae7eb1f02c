"""Planted bug: top-k without error feedback: the right pairs are sent, but the residual is cleared afterwards, so
what was not sent is lost (``--compress-feedback off``) and small entries never move.

exercise: 13.1
file: compression.py
expect: residual is all zeros: only the k entries sent are zeroed
"""

import numpy as np

from dtrain import collectives


def topk_step(comm, flat, residual, k):
    p, r = comm.Get_size(), comm.Get_rank()
    residual += flat
    index = np.sort(np.argsort(-np.abs(residual))[:k])
    values = residual[index]
    residual[:] = 0  # the bug: only residual[index] = 0; the rest is what the next step owes
    pairs = np.zeros(p * 2 * k)
    pairs[r * 2 * k : r * 2 * k + k], pairs[r * 2 * k + k : (r + 1) * 2 * k] = index, values
    collectives.allgather(comm, pairs, "ring")
    flat[:] = 0
    for q in range(p):
        flat[pairs[q * 2 * k : q * 2 * k + k].astype(np.int64)] += pairs[q * 2 * k + k : (q + 1) * 2 * k]
    flat /= p
    return index, values

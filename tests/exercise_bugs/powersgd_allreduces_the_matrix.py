"""Planted bug: the whole matrix M is all-reduced and factored afterwards on every rank: the right P Q^T, but a b
numbers travel where PowerSGD sends (a + b) r.

exercise: 13.2
file: compression.py
expect: all-reducing the whole matrices sends
"""

import numpy as np

from dtrain import collectives


def powersgd_step(comm, matrices, errors, qs):
    new = []
    for g, m, q in zip(matrices, errors, qs):
        m += g
        mean = collectives.allreduce(comm, m.copy(), op="avg", algorithm="ring")  # the bug: all-reduce M Q instead
        p = np.linalg.qr(mean @ q)[0]
        q = mean.T @ p
        approx = p @ q.T
        g[...] = approx
        m -= approx
        new.append(q)
    return new

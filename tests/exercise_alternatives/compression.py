"""Correct solutions of lesson 13's exercises that are not dtrain's own, which the checks must pass too: top-k's
indices and values in two all-gathers; PowerSGD with an all-reduce per factor and another orthonormal basis for P
(Gram-Schmidt with every column's sign flipped, where dtrain uses np.linalg.qr): the checks compare P Q^T, Q Q^T
and M - P Q^T, which do not depend on the basis.
"""

import numpy as np

from dtrain import collectives


def topk_step(comm, flat, residual, k):
    """Another correct top-k: indices and values in two all-gathers, every rank's pairs added in rank order."""
    p, r = comm.Get_size(), comm.Get_rank()
    residual += flat
    index = np.sort(np.argsort(-np.abs(residual))[:k])
    values = residual[index]
    residual[index] = 0
    indices, vals = np.zeros(p * k), np.zeros(p * k)
    indices[r * k : (r + 1) * k], vals[r * k : (r + 1) * k] = index, values
    collectives.allgather(comm, indices, "ring")
    collectives.allgather(comm, vals, "ring")
    flat[:] = 0
    for q in range(p):
        flat[indices[q * k : (q + 1) * k].astype(np.int64)] += vals[q * k : (q + 1) * k]
    flat /= p
    return index, values


def gram_schmidt(a):
    """Orthonormal columns by modified Gram-Schmidt, with a sign flip of every column (another basis than QR's)."""
    a = a.copy()
    for j in range(a.shape[1]):
        for i in range(j):
            a[:, j] -= (a[:, i] @ a[:, j]) * a[:, i]
        a[:, j] /= -np.linalg.norm(a[:, j])
    return a


def powersgd_step(comm, matrices, errors, qs):
    """Another correct PowerSGD step: one all-reduce per factor, Gram-Schmidt with flipped signs."""
    new = []
    for g, m, q in zip(matrices, errors, qs):
        m += g
        p_ = m @ q
        collectives.allreduce(comm, p_, op="sum", algorithm="ring")
        p_ = gram_schmidt(p_ / comm.Get_size())
        q_ = m.T @ p_
        collectives.allreduce(comm, q_, op="avg", algorithm="ring")
        approx = p_ @ q_.T
        g[...] = approx
        m -= approx
        new.append(q_)
    return new

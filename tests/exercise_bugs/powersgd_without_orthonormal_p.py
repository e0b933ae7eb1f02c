"""Planted bug: P is all-reduced but its columns are never orthonormalised, so P Q^T = P P^T M is not a projection
of M: its scale grows with M's, and the approximation is wrong.

exercise: 13.2
file: compression.py
expect: P's columns must be orthonormal
"""

from dtrain import collectives


def powersgd_step(comm, matrices, errors, qs):
    new = []
    for g, m, q in zip(matrices, errors, qs):
        m += g
        p = m @ q
        collectives.allreduce(comm, p, op="avg", algorithm="ring")  # the bug: then p = np.linalg.qr(p)[0]
        q = m.T @ p
        collectives.allreduce(comm, q, op="avg", algorithm="ring")
        approx = p @ q.T
        g[...] = approx
        m -= approx
        new.append(q)
    return new

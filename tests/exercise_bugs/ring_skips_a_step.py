"""Planted bug: the reduce-scatter stops one step early, so every chunk misses one rank's contribution.

exercise: 2.1
file: ring.py
expect: a ring all-reduce sends
"""

import numpy as np


def ring_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    bounds = [(c[0], c[-1] + 1) if len(c) else (0, 0) for c in np.array_split(np.arange(buf.size), p)]
    right, left = (r + 1) % p, (r - 1) % p
    scratch = np.empty(max(b - a for a, b in bounds), dtype=buf.dtype)
    for s in range(p - 2):  # the bug: p - 1 steps are needed
        a, b = bounds[(r - s) % p]
        c, d = bounds[(r - s - 1) % p]
        comm.Sendrecv(buf[a:b], dest=right, recvbuf=scratch[: d - c], source=left)
        buf[c:d] += scratch[: d - c]
    for s in range(p - 1):
        a, b = bounds[(r - s + 1) % p]
        c, d = bounds[(r - s) % p]
        comm.Sendrecv(buf[a:b], dest=right, recvbuf=buf[c:d], source=left)

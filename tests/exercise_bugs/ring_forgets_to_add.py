"""Planted bug: the reduce-scatter receives the left neighbour's chunk straight into buf, in place of adding it.

exercise: 2.1
file: ring.py
expect: it wrote the chunk over its own values instead of adding it
"""

import numpy as np


def ring_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    bounds = [(c[0], c[-1] + 1) if len(c) else (0, 0) for c in np.array_split(np.arange(buf.size), p)]
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        a, b = bounds[(r - s) % p]
        c, d = bounds[(r - s - 1) % p]
        comm.Sendrecv(buf[a:b].copy(), dest=right, recvbuf=buf[c:d], source=left)  # the bug: buf[c:d] += it
    for s in range(p - 1):
        a, b = bounds[(r - s + 1) % p]
        c, d = bounds[(r - s) % p]
        comm.Sendrecv(buf[a:b].copy(), dest=right, recvbuf=buf[c:d], source=left)

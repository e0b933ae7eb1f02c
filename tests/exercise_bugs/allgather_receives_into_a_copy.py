"""Planted bug: the deadlock fixed with Sendrecv, but the chunk is received into a copy of buf's slice (``.copy()``
makes a new array; a plain slice is a view), which is then dropped: buf never changes outside the rank's own chunk.

exercise: 10.1
file: allgather.py
expect: are not those ranks' chunks
"""

import numpy as np


def ring_allgather(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    edges = np.cumsum([0] + [len(chunk) for chunk in np.array_split(np.arange(buf.size), p)])
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        mine, theirs = (r - s) % p, (r - s - 1) % p
        incoming = buf[edges[theirs] : edges[theirs + 1]].copy()  # the bug: a copy, not a view of buf
        comm.Sendrecv(buf[edges[mine] : edges[mine + 1]], dest=right, recvbuf=incoming, source=left)

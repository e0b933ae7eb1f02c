"""Planted bug: exercise 10.1's own bug, its raise line deleted: every rank Sends before it receives, which works
while a chunk fits under the eager limit and deadlocks, every rank in Send, once it does not.

exercise: 10.1
file: allgather.py
expect: rendezvous: waiting for a matching receive
"""

import numpy as np


def ring_allgather(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    edges = np.cumsum([0] + [len(chunk) for chunk in np.array_split(np.arange(buf.size), p)])
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        mine, theirs = (r - s) % p, (r - s - 1) % p
        comm.Send(buf[edges[mine] : edges[mine + 1]], dest=right)  # the bug: a large Send waits for its receive
        comm.Recv(buf[edges[theirs] : edges[theirs + 1]], source=left)

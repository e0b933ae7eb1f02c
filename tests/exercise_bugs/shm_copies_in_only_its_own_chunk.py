"""Planted bug: each rank copies only its own chunk into its segment (as an all-gather would), so the chunk r that
rank r loads from a peer's segment was never written by anyone.

exercise: 2.6
file: shm.py
expect: rank 0 read rank 1's chunk 0 (buf[0:1]) before anyone wrote it: nothing had been stored there
"""

from dtrain.collectives import chunk_bounds
from dtrain.comm import windows


def shm_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    win = windows.allocate(comm, buf.nbytes)
    segments = [win.view(q, buf.dtype, 0, buf.size) for q in range(p)]
    lo, hi = chunk_bounds(buf.size, p)[r]
    segments[r][lo:hi] = buf[lo:hi]  # the bug: segments[r][...] = buf
    win.fence()
    total = sum(segments[q][lo:hi] for q in range(p))
    for q in range(p):
        segments[q][lo:hi] = total
    win.fence()
    buf[...] = segments[r]
    win.free()

"""Planted bug: comm.Barrier() where the window's fences belong: the ranks wait for each other, but no Win.Sync
makes their stores visible (on a weakly ordered CPU; on simulated ranks, never).

exercise: 2.6
file: shm.py
expect: rank 0 called comm.Barrier() 2 times outside a fence: a barrier orders the ranks, not their memory
"""

from dtrain.collectives import chunk_bounds
from dtrain.comm import windows


def shm_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    win = windows.allocate(comm, buf.nbytes)
    segments = [win.view(q, buf.dtype, 0, buf.size) for q in range(p)]
    segments[r][...] = buf
    comm.Barrier()  # the bug: win.fence()
    lo, hi = chunk_bounds(buf.size, p)[r]
    total = sum(segments[q][lo:hi] for q in range(p))
    for q in range(p):
        segments[q][lo:hi] = total
    comm.Barrier()  # the bug: win.fence()
    buf[...] = segments[r]
    win.free()

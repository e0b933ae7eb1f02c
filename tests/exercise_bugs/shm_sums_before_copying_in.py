"""Planted bug: rank r loads the others' chunk r before copying its own buf in and fencing (its own chunk it takes
from buf): it reads the peers' segments before they have copied in. Both fences are there, one step too late.

exercise: 2.6
file: shm.py
expect: rank 0 read rank 1's chunk 0 (buf[0:1]) before rank 1 had written it and fenced
"""

from dtrain.collectives import chunk_bounds
from dtrain.comm import windows


def shm_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    win = windows.allocate(comm, buf.nbytes)
    segments = [win.view(q, buf.dtype, 0, buf.size) for q in range(p)]
    lo, hi = chunk_bounds(buf.size, p)[r]
    total = buf[lo:hi] + sum(segments[q][lo:hi] for q in range(p) if q != r)  # the bug: before the copy and fence 1
    segments[r][...] = buf
    win.fence()
    for q in range(p):
        segments[q][lo:hi] = total
    win.fence()
    buf[...] = segments[r]
    win.free()

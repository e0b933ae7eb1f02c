"""Planted bug: no fence between copying buf in and loading the others' segments, so rank r sums its chunk from
segments that their owners have written but not yet fenced (one fence in all, after the stores).

exercise: 2.6
file: shm.py
expect: rank 0 read rank 1's chunk 0 (buf[0:1]) before rank 1's fence: rank 1 wrote it before fence 1
"""

from dtrain.collectives import chunk_bounds
from dtrain.comm import windows


def shm_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    win = windows.allocate(comm, buf.nbytes)
    segments = [win.view(q, buf.dtype, 0, buf.size) for q in range(p)]
    segments[r][...] = buf  # the bug: no win.fence() here (fence 1)
    lo, hi = chunk_bounds(buf.size, p)[r]
    total = sum(segments[q][lo:hi] for q in range(p))
    for q in range(p):
        segments[q][lo:hi] = total
    win.fence()
    buf[...] = segments[r]
    win.free()

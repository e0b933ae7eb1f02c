"""Planted bug: no fence between storing the sums into every segment and copying one's own segment out, so a rank
may copy out a chunk before its owner's sum is visible there.

exercise: 2.6
file: shm.py
expect: rank 0 stored into rank 1's segment at chunk 0 (buf[0:1]) after fence 1, and no fence followed
"""

from dtrain.collectives import chunk_bounds
from dtrain.comm import windows


def shm_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    win = windows.allocate(comm, buf.nbytes)
    segments = [win.view(q, buf.dtype, 0, buf.size) for q in range(p)]
    segments[r][...] = buf
    win.fence()
    lo, hi = chunk_bounds(buf.size, p)[r]
    total = sum(segments[q][lo:hi] for q in range(p))
    for q in range(p):
        segments[q][lo:hi] = total
    buf[...] = segments[r]  # the bug: no win.fence() before it (fence 2)
    win.free()

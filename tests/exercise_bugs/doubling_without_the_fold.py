"""Planted bug: recursive doubling with no fold for a non-power-of-two p: a partner v XOR d beyond p - 1 is just
skipped, so some ranks never receive some contributions.

exercise: 2.4
file: doubling.py
expect: p = 3 is not a power of two: the first 2 ranks fold first
"""

import numpy as np


def doubling_allreduce(comm, buf):
    p, v = comm.Get_size(), comm.Get_rank()
    scratch = np.empty_like(buf)
    d = 1
    while d < p:
        if v ^ d < p:  # the bug: ranks whose partner is missing fold into a partner first, and get the sum back after
            comm.Sendrecv(buf, dest=v ^ d, recvbuf=scratch, source=v ^ d)
            buf += scratch
        d <<= 1

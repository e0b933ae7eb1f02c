"""Planted bug: the tree is numbered from rank 0, not from the root (v = rank, parent v - mask without the root added
back), so every partial sum travels to rank 0 whatever the root.

exercise: 2.3
file: tree.py
expect: rank 1 sent to rank 0, but the root sends nothing in a binomial-tree reduce
"""

import numpy as np


def tree_reduce(comm, buf, root):
    p, v = comm.Get_size(), comm.Get_rank()  # the bug: v = (rank - root) % p, and partners (... + root) % p
    scratch = np.empty_like(buf)
    mask = 1
    while mask < p:
        if v & mask:
            comm.Send(buf, dest=v - mask)
            break
        if v + mask < p:
            comm.Recv(scratch, source=v + mask)
            buf += scratch
        mask <<= 1

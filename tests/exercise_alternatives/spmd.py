"""Correct solutions of lesson 14's exercises that are not dtrain's own, which the checks must pass too: the matmul
rule written as C's layout first and the gathers listed B before A, as lists rather than tuples; a redistribution
with no collective of dtrain's, only ``comm.Sendrecv``: a direct exchange (at step s, rank r sends rank r + s the
block that rank keeps, and receives from rank r - s), the all-reduce as that reduce-scatter followed by the gather.
"""

import numpy as np


def matmul_layouts(a, b):
    """Another correct rule: C's rows and columns first, then what J needs."""
    rows, ja = a
    jb, cols = b
    gathers = []
    if rows is not None and rows == cols:  # case 4: C[I_x, K_x] cannot be
        gathers.append(["all-gather", "B", 1, cols])
        cols = None
    if ja == jb:  # case 1 (None) or 3: a partial sum over J's axis
        return [rows, cols], ja, gathers
    for operand, dim, axis in (("B", 0, jb), ("A", 1, ja)):  # case 2
        if axis is not None:
            gathers.append(["all-gather", operand, dim, axis])
    return [rows, cols], None, gathers


def exchange(comm, parts, add):
    """Rank r's part r of every rank's ``parts`` (a list of p arrays of one shape): their sum (``add``), or the list
    of them, block q from rank q (``add`` False), by direct exchange."""
    p, r = comm.Get_size(), comm.Get_rank()
    got = [None] * p
    got[r] = parts[r].copy()
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        received = np.empty_like(parts[to])
        comm.Sendrecv(np.ascontiguousarray(parts[to] if add else parts[r]), dest=to, recvbuf=received, source=frm)
        got[frm] = received
    return sum(got) if add else got


def redistribute(comm, block, source, target, dim):
    p = comm.Get_size()
    if source == "partial" and target == "split":
        return exchange(comm, np.split(block, p, axis=dim), add=True)
    if source == "split":
        return np.concatenate(exchange(comm, [block] * p, add=False), axis=dim)
    mine = exchange(comm, np.split(block, p, axis=0), add=True)  # partial -> replicated: rows summed, then shared
    return np.concatenate(exchange(comm, [mine] * p, add=False), axis=0)

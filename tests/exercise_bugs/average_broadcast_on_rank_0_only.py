"""Planted bug: exercise 10.2's own bug, its raise line deleted: the ranks other than 0 return after the reduce, so
only rank 0 calls the broadcast; rank 0 holds the mean, and nobody receives it.

exercise: 10.2
file: average.py
expect: rank 0 holds the mean and rank
"""

from dtrain import collectives


def average_weights(comm, flat):
    rank, p = comm.Get_rank(), comm.Get_size()
    collectives.reduce(comm, flat, root=0, op="sum")
    if rank != 0:
        return  # the bug: the broadcast below is a collective, every rank must call it
    flat /= p
    collectives.broadcast(comm, flat, root=0)

"""Planted bug: the asymmetry the other way round: only rank 0 calls the reduce ("only rank 0 needs the sum"), so
rank 0 waits for its children's messages while they wait for rank 0's broadcast: a deadlock.

exercise: 10.2
file: average.py
expect: deadlock: every unfinished rank is blocked
"""

from dtrain import collectives


def average_weights(comm, flat):
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank == 0:  # the bug: the reduce is a collective, every rank must call it
        collectives.reduce(comm, flat, root=0, op="sum")
        flat /= p
    collectives.broadcast(comm, flat, root=0)

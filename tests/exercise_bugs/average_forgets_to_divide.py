"""Planted bug: every rank calls both collectives, but nobody divides: every rank ends with the sum, not the mean.

exercise: 10.2
file: average.py
expect: flat holds the sum over ranks, not the mean
"""

from dtrain import collectives


def average_weights(comm, flat):
    collectives.reduce(comm, flat, root=0, op="sum")
    collectives.broadcast(comm, flat, root=0)  # the bug: rank 0 must divide by p first

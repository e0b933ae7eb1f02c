"""Planted bug: the neighbours' weights are added with weight 1/(d + 1) but the rank's own weights are not scaled
down: every row of the matrix sums to 1 + d/(d + 1), and the mean over ranks grows with every round.

exercise: 6.1
file: gossip.py
expect: the round applied a matrix that is not doubly stochastic
"""

import numpy as np


def gossip_step(comm, flat, neighbours):
    inbox = [np.empty_like(flat) for _ in neighbours]
    requests = [comm.Irecv(inbox[i], j) for i, j in enumerate(neighbours)] + [comm.Isend(flat, j) for j in neighbours]
    for request in requests:
        request.Wait()
    for theirs in inbox:
        flat += theirs / (len(neighbours) + 1)  # the bug: flat itself must become flat / (d + 1) first

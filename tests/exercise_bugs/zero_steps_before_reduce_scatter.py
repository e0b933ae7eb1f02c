"""Planted bug: the optimizer steps on this rank's own gradient, before the reduce-scatter has averaged it.

exercise: 9.1
file: zero.py
expect: was not the average of the ranks' gradients: reduce-scatter (average) first, then step
"""

from dtrain import collectives


def zero_step(comm, params, grads, optimizer_step):
    optimizer_step()
    collectives.reduce_scatter(comm, grads, "avg")
    collectives.allgather(comm, params)

"""Planted bug: the whole gradient is all-reduced instead of reduce-scattered: the right weights, twice the bytes.

exercise: 9.1
file: zero.py
expect: an all-reduce of the whole gradient alone sends about twice what the reduce-scatter does
"""

from dtrain import collectives


def zero_step(comm, params, grads, optimizer_step):
    collectives.allreduce(comm, grads, "sum", "ring")
    grads /= comm.Get_size()
    optimizer_step()
    collectives.allgather(comm, params)

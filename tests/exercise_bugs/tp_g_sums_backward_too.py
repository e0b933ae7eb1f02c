"""Planted bug: g sums in forward right, and again in backward, so every gradient before it is p times too large.

exercise: 7.2
file: tensor_parallel.py
expect: g's backward sent
"""

from dtrain.autograd import Tensor


def g(x, group):
    summed = group.allreduce(x.data.copy(), "tp/g-forward")
    return Tensor._make(summed, (x,), lambda grad: (group.allreduce(grad.copy(), "tp/g-forward"),))

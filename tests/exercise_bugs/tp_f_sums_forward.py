"""Planted bug: f all-reduces in forward (as g does) instead of backward, so the block's input is p times too large.

exercise: 7.1
file: tensor_parallel.py
expect: f's forward sent
"""

from dtrain.autograd import Tensor


def f(x, group):
    return Tensor._make(group.allreduce(x.data.copy(), "tp/f-backward"), (x,), lambda grad: (grad,))

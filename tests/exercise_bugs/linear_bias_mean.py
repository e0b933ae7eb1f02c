"""Planted bug: the bias gradient is the mean over the batch instead of the sum.

exercise: 1.2
file: backward.py
expect: grad_bias is the mean over the batch of 4 rows, not the sum
"""


def linear_backward(grad_out, x, weight):
    return grad_out @ weight.T, x.T @ grad_out, grad_out.mean(axis=0)  # the bug: grad_out.sum(axis=0)

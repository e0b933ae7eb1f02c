"""Planted bug: grad_a is a transposed product (a.T @ grad, the rule of grad_b), not grad @ b.T.

exercise: 1.1
file: backward.py
expect: grad_a (dL/dA, shape (3, 3)): element
"""


def matmul_backward(grad, a, b):
    return a.T @ grad, a.T @ grad  # the bug: grad_a is grad @ b.T

"""Exercises 1.1 and 1.2 (lesson 1): backward rules, the chain rule of one operation at a time.

Check them:  dtrain exercises check 1.1 --path ex
             dtrain exercises check 1.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
No ranks here: each check runs in one process, against finite differences (and, for 1.2, the autograd engine's own
gradients of dtrain.nn.Linear).
"""

import numpy as np  # noqa: F401  (you will want it)


def matmul_backward(grad, a, b):
    """The backward rule of ``C = A @ B``: return ``(grad_a, grad_b)``.

    Signature: ``matmul_backward(grad, a, b) -> (grad_a, grad_b)``. ``a`` is a 2-D float64 NumPy array of shape
    (m, k), ``b`` one of shape (k, n), and ``grad`` = dL/dC, of the shape of C = a @ b: (m, n), for some scalar loss
    L. Any of m, k, n may be 1 (a single row, a single column, an outer product).

    Before: ``grad``, ``a`` and ``b`` as above; do not change them.
    After:  return the tuple ``(grad_a, grad_b)``: grad_a = dL/dA, of a's shape (m, k), and grad_b = dL/dB, of b's
            shape (k, n).

    The checker compares them with finite differences of L = sum(grad * (a @ b)): it nudges each element of a (of b)
    by +-h and sees how L moves.

    Hint: write one element of the product, C[i, j] = sum_t A[i, t] B[t, j]. A[i, t] appears in every C[i, j] of
    row i, each time multiplied by B[t, j]; so dL/dA[i, t] = sum_j grad[i, j] B[t, j]. That sum is one matrix
    product of grad with b (transposed or not? the shapes tell you). Do the same for B[t, j].
    """
    raise NotImplementedError("exercise 1.1: the backward of a matrix product — see lessons/01_single_device.py")


def linear_backward(grad_out, x, weight):
    """The backward rule of a linear layer ``y = x @ W + b``: return ``(grad_x, grad_weight, grad_bias)``.

    Signature: ``linear_backward(grad_out, x, weight) -> (grad_x, grad_weight, grad_bias)``. ``x`` is the layer's
    input batch, a float64 array of shape (batch, in); ``weight`` is W, of shape (in, out), as in dtrain.nn.Linear;
    ``grad_out`` = dL/dy, of shape (batch, out). (The bias b itself is not needed: y depends on it, its gradient does
    not.)

    Before: ``grad_out``, ``x`` and ``weight`` as above; do not change them.
    After:  return the tuple ``(grad_x, grad_weight, grad_bias)`` of shapes (batch, in), (in, out) and (out,):
            dL/dx, dL/dW and dL/db.

    The checker compares them with finite differences of L = sum(grad_out * (x @ W + b)), and with the gradients
    that dtrain's autograd engine computes for an nn.Linear with the same weights.

    Hint: y = x @ W + b is two operations. The product's rule is exercise 1.1 (you may call your
    matmul_backward). The add broadcasts b, of shape (out,), to every row of the batch: b takes part in every row of
    y, so its gradient collects the gradient of every row.
    """
    raise NotImplementedError("exercise 1.2: the backward of a linear layer — see lessons/01_single_device.py")

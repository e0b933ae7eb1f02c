"""Checks of lesson 1's backward rules: the learner's gradients against finite differences of a scalar loss, and
against the autograd engine's own gradients of :class:`dtrain.nn.Linear`.

Every check makes the loss ``L = sum(grad * C)`` of the op's output ``C``, so that dL/dC is exactly the ``grad`` the
learner's rule is given, and perturbs each input element by +-h: L is linear in each input, so the central
difference is its derivative up to rounding, whatever the learner computes.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from dtrain.course.exercises.grading import Exercise

EXERCISES = (
    Exercise("1.1", "the backward of a matrix product", "backward.py", "matmul_backward", ("grad", "a", "b"),
             "dtrain.autograd:matmul_backward", "dtrain.course.exercises.checks.autograd:matmul_backward",
             hint="write C[i, j] = sum_t A[i, t] B[t, j] and ask which C's each A[i, t] (each B[t, j]) reaches: "
                  "grad_a has a's shape (m, k), grad_b has b's (k, n); only one product of grad with b (with a) "
                  "has that shape"),
    Exercise("1.2", "the backward of a linear layer", "backward.py", "linear_backward", ("grad_out", "x", "weight"),
             "dtrain.nn:linear_backward", "dtrain.course.exercises.checks.autograd:linear_backward",
             hint="y = x @ W + b is a matrix product (exercise 1.1) and an add that broadcasts b to every row of the "
                  "batch: each row's gradient reaches b, so grad_bias adds them up"),
)  # fmt: skip
H = 1e-3  # the finite differences' step (the losses are linear in each input: any step is exact up to rounding)
RTOL, ATOL = 1e-6, 1e-9


def finite_differences(loss, inputs: list[np.ndarray], h: float = H) -> list[np.ndarray]:
    """dL/d(each input) by central differences, ``(L(x + h e_i) - L(x - h e_i)) / 2h`` for every element i, where
    L = ``loss(*inputs)`` (the inputs are copied first: the caller's arrays are never touched)."""
    inputs = [np.array(v, dtype=np.float64, copy=True) for v in inputs]
    grads = []
    for x in inputs:
        grad = np.empty_like(x)
        for i in np.ndindex(x.shape):
            keep = x[i]
            x[i] = keep + h
            up = loss(*inputs)
            x[i] = keep - h
            down = loss(*inputs)
            x[i] = keep
            grad[i] = (up - down) / (2 * h)
        grads.append(grad)
    return grads


def matmul_loss(grad, a, b) -> float:
    return float(np.sum(grad * (a @ b)))


def linear_loss(grad_out, x, weight, bias) -> float:
    return float(np.sum(grad_out * (x @ weight + bias)))


def returned(grade, result, names: tuple[str, ...]) -> tuple | None:
    """The learner's result as a tuple of ``len(names)`` arrays, or None after a problem that says what came back."""
    if not isinstance(result, tuple | list) or len(result) != len(names):
        got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple | list) else "")
        grade.fail(f"the function returned {got}; it must return a tuple of {len(names)}: ({', '.join(names)})")
        return None
    return tuple(result)


def unchanged(grade, arrays: dict, before: dict) -> None:
    """The inputs are as they were: a backward rule reads them, it must not write into them."""
    for name, array in arrays.items():
        if not np.array_equal(array, before[name]):
            grade.fail(f"{name} changed during the call: a backward rule must not write into its inputs")


MATMUL_SHAPES = (  # (m, k, n): square first (where a transposed product still has the right shape), then the edges
    ((3, 3, 3), "square: 3x3 @ 3x3"),
    ((4, 3, 5), "4x3 @ 3x5"),
    ((1, 4, 3), "one row: 1x4 @ 4x3"),
    ((5, 3, 1), "one column: 5x3 @ 3x1"),
    ((4, 1, 3), "an outer product: 4x1 @ 1x3"),
    ((1, 1, 1), "1x1 @ 1x1"),
    ((7, 6, 2), "7x6 @ 6x2"),
)


def matmul_backward(fn, comm, grade) -> None:
    """``fn(grad, a, b)`` returns (dL/dA, dL/dB) of ``L = sum(grad * (a @ b))``, of the shapes of ``a`` and ``b``,
    equal to the finite differences of L."""
    rng = np.random.default_rng(11)
    for number, ((m, k, n), about) in enumerate(MATMUL_SHAPES, 1):
        a, b, grad = rng.normal(size=(m, k)), rng.normal(size=(k, n)), rng.normal(size=(m, n))
        before = {"a": a.copy(), "b": b.copy(), "grad": grad.copy()}
        with grade.step(number, f"{about}, float64, grad = dL/dC of shape ({m}, {n})", len(MATMUL_SHAPES)):
            result = returned(grade, fn(grad, a, b), ("grad_a", "grad_b"))
            unchanged(grade, {"a": a, "b": b, "grad": grad}, before)
            if result is not None:
                numeric = finite_differences(partial(matmul_loss, before["grad"]), [before["a"], before["b"]])
                for mine, expected, name, what in zip(result, numeric, ("grad_a", "grad_b"), ("dL/dA", "dL/dB")):
                    grade.same(mine, expected, f"{name} ({what}, shape {expected.shape})", RTOL, ATOL)


LINEAR_SHAPES = (  # (batch, in, out): batches of more than one row first (a mean and a sum differ there)
    ((4, 3, 5), "a batch of 4, 3 -> 5 features"),
    ((8, 6, 2), "a batch of 8, 6 -> 2 features"),
    ((5, 1, 1), "a batch of 5, 1 -> 1 feature"),
    ((1, 4, 3), "a batch of one row, 4 -> 3 features"),
    ((3, 7, 4), "a batch of 3, 7 -> 4 features"),
)


def engine_gradients(grad_out: np.ndarray, x: np.ndarray, weight: np.ndarray, bias: np.ndarray):
    """dL/dx, dL/dW, dL/db of ``L = sum(grad_out * Linear(x))`` by dtrain's autograd engine (a Linear layer with
    these weights; the engine composes its matmul's and its add's rules, it does not call linear_backward)."""
    from dtrain.autograd import Tensor
    from dtrain.nn import Linear

    layer = Linear(*weight.shape, np.random.default_rng(0))
    layer.weight.data[...], layer.bias.data[...] = weight, bias
    xt = Tensor(x.copy(), requires_grad=True)
    (layer(xt) * grad_out).sum().backward()
    return xt.grad, layer.weight.grad, layer.bias.grad


def linear_backward(fn, comm, grade) -> None:
    """``fn(grad_out, x, weight)`` returns (dL/dx, dL/dW, dL/db) of ``L = sum(grad_out * (x @ W + b))``: equal to the
    finite differences of L and to the autograd engine's gradients of a Linear layer."""
    rng = np.random.default_rng(12)
    names = ("grad_x", "grad_weight", "grad_bias")
    for number, ((batch, n_in, n_out), about) in enumerate(LINEAR_SHAPES, 1):
        x, weight, bias = rng.normal(size=(batch, n_in)), rng.normal(size=(n_in, n_out)), rng.normal(size=n_out)
        grad_out = rng.normal(size=(batch, n_out))
        before = {"x": x.copy(), "weight": weight.copy(), "grad_out": grad_out.copy()}
        with grade.step(number, f"{about}: x {x.shape}, weight {weight.shape}, grad_out {grad_out.shape}, float64",
                        len(LINEAR_SHAPES)):  # fmt: skip
            result = returned(grade, fn(grad_out, x, weight), names)
            unchanged(grade, {"x": x, "weight": weight, "grad_out": grad_out}, before)
            if result is None:
                continue
            inputs = [before["x"], before["weight"], bias]
            numeric = finite_differences(partial(linear_loss, before["grad_out"]), inputs)
            engine = engine_gradients(before["grad_out"], *inputs)
            for name, mine, expected, by_engine in zip(names, result, numeric, engine, strict=True):
                what = f"{name} (shape {expected.shape}, by finite differences)"
                if grade.same(mine, expected, what, RTOL, ATOL):
                    grade.same(mine, by_engine, f"{name} (by the autograd engine's Linear)", RTOL, ATOL)
            explain_bias(grade, result[2], numeric[2], batch)


def explain_bias(grade, mine, expected: np.ndarray, batch: int) -> None:
    """A note on the usual mistakes with the bias: averaged over the batch, or not reduced over it at all."""
    mine = np.asarray(mine) if mine is not None else None
    if mine is None or batch == 1:
        return
    if mine.shape == expected.shape and np.allclose(mine * batch, expected, RTOL, ATOL):
        grade.note(f"grad_bias is the mean over the batch of {batch} rows, not the sum: b is added to every row, "
                   "so every row's gradient reaches it and they add up (the loss's mean is in grad_out)")  # fmt: skip
    elif mine.shape == (batch, *expected.shape):
        grade.note(f"grad_bias has one row per example: sum grad_out over the batch axis (axis 0) to get b's "
                   f"shape {expected.shape}")  # fmt: skip

"""Checks of lesson 7's operators f and g (Megatron-LM's tensor parallelism), against the unsharded layers.

Each operator is checked alone (f: forward the identity and no message, backward the sum of the gradients over the
ranks; g: forward the sum, backward the identity and no message), then inside a column-then-row block built here:
``Z = g(relu(f(X) A_t + a_t) B_t) + b`` on each rank t, whose output and gradients must be those of the whole layers
``relu(X A + a) B + b`` computed on one rank with NumPy, the backward written out by hand (no autograd).
"""

from __future__ import annotations

import numpy as np

from dtrain.autograd import Tensor
from dtrain.course.exercises.grading import MPI, Exercise
from dtrain.parallel import tensor_parallel
from dtrain.parallel.tensor_parallel import TensorGroup

GROUPS = (1, 2, 3, 4)  # simulated tensor groups
EXERCISES = (
    Exercise("7.1", "Megatron's f (identity forward, all-reduce backward)", "tensor_parallel.py", "f", ("x", "group"),
             "dtrain.parallel.tensor_parallel:f", "dtrain.course.exercises.checks.tensor_parallel:check_f", GROUPS, MPI,
             "Tensor._make(x.data, (x,), backward) where backward(grad) returns a 1-tuple: a summed copy of grad "
             "(group.allreduce(grad.copy(), label)); the forward sends nothing"),
    Exercise("7.2", "Megatron's g (all-reduce forward, identity backward)", "tensor_parallel.py", "g", ("x", "group"),
             "dtrain.parallel.tensor_parallel:g", "dtrain.course.exercises.checks.tensor_parallel:check_g", GROUPS, MPI,
             "Tensor._make(summed, (x,), lambda grad: (grad,)) where summed = group.allreduce(x.data.copy(), label): "
             "the sum happens once, in forward; the backward sends nothing"),
)  # fmt: skip
CASES = 3  # forward, backward, the block
M, K, N, O = 5, 3, 12, 4  # the block: X is M x K, A is K x N (split by columns), B is N x O (split by rows)


def values(rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Small integers that say whose they are (exact sums): rank r, element i holds 100 r + i % 13 + 1."""
    return (100 * rank + np.arange(int(np.prod(shape))) % 13 + 1).astype(np.float64).reshape(shape)


def sent_since(grade, before: tuple[int, int]) -> int:
    return grade.counts()[0] - before[0]


def silent(grade, before, what: str, why: str) -> None:
    """``what`` (f's forward, g's backward) sent no message since ``before``; else a problem that says why it must
    not."""
    sent = sent_since(grade, before)
    if sent:
        grade.fail(f"{what} sent {sent} message(s) from rank {grade.rank}; it must send none: {why}")


def is_tensor(grade, out, name: str) -> bool:
    if isinstance(out, Tensor):
        if not out.requires_grad:
            grade.fail(f"{name}(x, group) returned a Tensor outside the graph (requires_grad False): build it with "
                       "Tensor._make(data, (x,), backward), with x as its parent")  # fmt: skip
        return out.requires_grad
    grade.fail(f"{name}(x, group) returned {type(out).__name__}, expected a Tensor: Tensor._make(data, (x,), backward)")
    return False


def check_f(fn, comm, grade) -> None:
    """f: the identity forward, sending nothing; backward the sum of the gradient over the ranks; then the block."""
    group, p, r = TensorGroup(comm), comm.Get_size(), comm.Get_rank()
    x = Tensor(values(r, (M, K)), requires_grad=True)
    out = None
    with grade.step(1, "forward: x = rank r's own 5 x 3 values (100 r + 1, ...), out = f(x, group)", CASES):
        before = grade.counts()
        out = fn(x, group)
        silent(grade, before, "f's forward", "f is the identity forward (X goes to every rank as it is); its "
               "all-reduce belongs in backward")  # fmt: skip
        if is_tensor(grade, out, "f"):
            grade.same(out.data, values(r, (M, K)), "f(x).data (x itself, unchanged)")
    with grade.step(2, "backward: out.backward(rank r's own values 1000 r + ...), then x.grad", CASES):
        if isinstance(out, Tensor) and out.requires_grad:
            out.backward(values(10 * r, (M, K)))
            expected = sum(values(10 * q, (M, K)) for q in range(p))
            grade.same(x.grad, expected, "x.grad (the sum over the ranks of the gradients given to f(x))")
        own = x.grad is not None and np.array_equal(x.grad, values(10 * r, (M, K)))
        if all(comm.allgather(own)) and grade.problems:  # (every rank: an object all-gather)
            grade.note("x.grad is this rank's own gradient, on every rank: f's backward passed it through; it must "
                       "all-reduce (sum) it over the group")  # fmt: skip
    block(fn, tensor_parallel.g, group, grade, 3, "f")


def check_g(fn, comm, grade) -> None:
    """g: the sum forward; backward the identity, sending nothing; then the block."""
    group, p, r = TensorGroup(comm), comm.Get_size(), comm.Get_rank()
    x = Tensor(values(r, (M, O)), requires_grad=True)
    out = None
    with grade.step(1, "forward: x = rank r's own 5 x 4 values (100 r + 1, ...), out = g(x, group)", CASES):
        out = fn(x, group)
        own = False
        if is_tensor(grade, out, "g"):
            expected = sum(values(q, (M, O)) for q in range(p))
            grade.same(out.data, expected, "g(x).data (the sum of x over the ranks)")
            own = bool(np.array_equal(out.data, values(r, (M, O))))
        if all(comm.allgather(own)) and grade.problems:  # (every rank: an object all-gather)
            grade.note("g(x).data is this rank's own x, on every rank: g's forward passed it through; it must "
                       "all-reduce (sum) it over the group")  # fmt: skip
    with grade.step(2, "backward: out.backward(rank r's own values 1000 r + ...), then x.grad", CASES):
        if isinstance(out, Tensor) and out.requires_grad:
            before = grade.counts()
            out.backward(values(10 * r, (M, O)))
            silent(grade, before, "g's backward", "the gradient of g's output is already the same on every rank; "
                   "summing it again would count it p times")  # fmt: skip
            grade.same(x.grad, values(10 * r, (M, O)), "x.grad (this rank's own gradient, passed through unchanged)")
    block(tensor_parallel.f, fn, group, grade, 3, "g")


def whole_block(X, A, a, B, b, dZ) -> dict:
    """The unsharded block on one rank: Z = relu(X A + a) B + b, and the gradients of sum(Z * dZ), by hand."""
    Y = X @ A + a
    H = np.maximum(Y, 0)
    dH = dZ @ B.T
    dY = dH * (Y > 0)
    return {"Z": H @ B + b, "dX": dY @ A.T, "dA": X.T @ dY, "da": dY.sum(0), "dB": H.T @ dZ, "db": dZ.sum(0)}


def block(f, g, group, grade, number: int, yours: str) -> None:
    """A column-then-row block over the group, built with ``f`` and ``g`` (one of them the learner's), against the
    whole layers: the output on every rank, the input's gradient, and each rank's slices of the weights' gradients."""
    p, r = group.size, group.rank
    rng = np.random.default_rng(7)
    n = N * p  # the hidden width: N columns per rank
    X, A, a, B, b = (rng.standard_normal(s) for s in ((M, K), (K, n), (n,), (n, O), (O,)))
    dZ = rng.standard_normal((M, O))
    whole = whole_block(X, A, a, B, b, dZ)
    cols = slice(r * N, (r + 1) * N)
    x = Tensor(X.copy(), requires_grad=True)
    mine = {"dA": A[:, cols], "da": a[cols], "dB": B[cols], "db": b}
    held = {name: Tensor(array.copy(), requires_grad=True) for name, array in mine.items()}
    about = (f"a column-then-row block with your {yours}: Z = g(relu(f(X) A_t + a_t) B_t) + b, A {K} x {n} split by "
             f"columns, B {n} x {O} by rows, against the unsharded layers")  # fmt: skip
    with grade.step(number, about, CASES):
        z = g((f(x, group) @ held["dA"] + held["da"]).relu() @ held["dB"], group) + held["db"]
        if grade.same(z.data, whole["Z"], "Z on this rank (the whole block's output)", rtol=1e-10, atol=1e-10):
            z.backward(dZ)
            grade.same(x.grad, whole["dX"], "X's gradient (the whole block's dX)", rtol=1e-10, atol=1e-10)
            for name, tensor in held.items():
                part = whole[name][:, cols] if name == "dA" else whole[name][cols] if name != "db" else whole[name]
                grade.same(tensor.grad, part, f"this rank's slice of {name} (the whole block's)", 1e-10, 1e-10)

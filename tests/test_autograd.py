"""The autograd engine against independent oracles.

Every op's backward is compared with **central finite differences in float64** of a plain-NumPy reference of the
same function (never of dtrain's own forward): for an op ``y = f(x1, x2, ...)`` and a random upstream gradient ``R``
of y's shape, ``y.backward(R)`` must give ``d/dxi sum(f(x) * R)`` for every input. The hooks that data-parallel
overlap relies on are checked for timing (each fires once, with its final gradient) and order (last layer first).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dtrain.autograd import Tensor, activation_bytes, no_grad, softmax_cross_entropy, unbroadcast
from dtrain.course.exercises.checks.autograd import finite_differences
from dtrain.nn import MLP

EPS = 1e-6  # central differences in float64: truncation ~EPS^2, rounding ~1e-16 / EPS, both far below the tolerance
RTOL, ATOL = 1e-6, 1e-8


def numeric_grads(fn, arrays):
    """Central finite differences of the scalar ``fn(*arrays)`` with respect to each array (NumPy only)."""
    return finite_differences(fn, arrays, EPS)


def check_op(op, reference, *arrays, seed=0):
    """Forward of ``op`` equals ``reference``; backward equals finite differences of ``sum(reference * R)``."""
    rng = np.random.default_rng(seed)
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = op(*tensors)
    expected = reference(*arrays)
    np.testing.assert_allclose(out.data, expected, rtol=1e-12, atol=1e-12)
    upstream = rng.normal(size=np.shape(expected))
    out.backward(np.asarray(upstream))
    numeric = numeric_grads(lambda *xs: float(np.sum(reference(*xs) * upstream)), [a.copy() for a in arrays])
    for i, (t, g) in enumerate(zip(tensors, numeric)):
        assert t.grad is not None, f"input {i} got no gradient"
        assert t.grad.shape == t.data.shape, f"input {i}: gradient shape {t.grad.shape} != {t.data.shape}"
        np.testing.assert_allclose(t.grad, g, rtol=RTOL, atol=ATOL, err_msg=f"gradient of input {i}")


def rand(*shape, seed=0, low=-1.0, high=1.0):
    return np.random.default_rng(seed).uniform(low, high, size=shape)


def away_from_zero(*shape, seed=0):
    """Values in +-[0.2, 1.5]: finite differences never straddle relu's kink."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.2, 1.5, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def np_log_softmax(x, axis=-1):
    """Textbook log-softmax, without the max shift: only for moderate inputs."""
    return x - np.log(np.sum(np.exp(x), axis=axis, keepdims=True))


def np_cross_entropy(z, labels):
    """Textbook mean cross-entropy: -mean(log(exp(z_y) / sum(exp(z)))), for moderate logits."""
    p = np.exp(z) / np.sum(np.exp(z), axis=1, keepdims=True)
    return -np.mean(np.log(p[np.arange(len(labels)), labels]))


# --------------------------------------------------------------------------------------------- single ops
def test_matmul_both_operands():
    check_op(lambda a, b: a @ b, lambda a, b: a @ b, rand(3, 4, seed=1), rand(4, 5, seed=2))


def test_matmul_one_operand_without_grad():
    a, b = rand(3, 4, seed=1), rand(4, 5, seed=2)
    upstream = rand(3, 5, seed=3)
    for needs in ("a", "b"):
        ta, tb = Tensor(a.copy(), requires_grad=needs == "a"), Tensor(b.copy(), requires_grad=needs == "b")
        (ta @ tb).backward(upstream)
        if needs == "a":
            (g,) = numeric_grads(lambda x: np.sum((x @ b) * upstream), [a.copy()])
            np.testing.assert_allclose(ta.grad, g, rtol=RTOL, atol=ATOL)
            assert tb.grad is None
        else:
            (g,) = numeric_grads(lambda y: np.sum((a @ y) * upstream), [b.copy()])
            np.testing.assert_allclose(tb.grad, g, rtol=RTOL, atol=ATOL)
            assert ta.grad is None


class _TransposeSpy(np.ndarray):
    """An ndarray that records every ``.T`` taken of it: ``g @ W.T`` is how dL/dx would be computed."""

    transposed: list = []  # noqa: RUF012 (shared on purpose: results of ops on a spy are spies too)

    @property
    def T(self):
        _TransposeSpy.transposed.append(self)
        return super().T


def test_no_input_gradient_is_computed_for_an_input_that_needs_none():
    _TransposeSpy.transposed = []
    w_data = rand(4, 5, seed=2).view(_TransposeSpy)
    x, w = Tensor(rand(3, 4, seed=1)), Tensor(w_data, requires_grad=True)
    (x @ w).sum().backward()
    assert x.grad is None
    assert not any(t is w_data for t in _TransposeSpy.transposed), "dL/dx = g @ W.T was computed for x"
    np.testing.assert_allclose(np.asarray(w.grad), x.data.T @ np.ones((3, 5)))


@pytest.mark.parametrize(
    ("shape_a", "shape_b"),
    [((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 4), (1, 4)), ((3, 1), (1, 4)), ((4,), (3, 4)), ((3, 1), (3, 4))],
)
def test_add_sub_mul_with_broadcasting(shape_a, shape_b):
    a, b = rand(*shape_a, seed=1), rand(*shape_b, seed=2)
    check_op(lambda x, y: x + y, lambda x, y: x + y, a, b)
    check_op(lambda x, y: x - y, lambda x, y: x - y, a, b)
    check_op(lambda x, y: x * y, lambda x, y: x * y, a, b)


def test_scalar_operands_on_either_side():
    a = rand(3, 4, seed=1)
    check_op(lambda x: x + 2.5, lambda x: x + 2.5, a)
    check_op(lambda x: 2.5 + x, lambda x: 2.5 + x, a)
    check_op(lambda x: x - 2.5, lambda x: x - 2.5, a)
    check_op(lambda x: 2.5 - x, lambda x: 2.5 - x, a)
    check_op(lambda x: x * -1.5, lambda x: x * -1.5, a)
    check_op(lambda x: -1.5 * x, lambda x: -1.5 * x, a)
    check_op(lambda x: x / 4.0, lambda x: x / 4.0, a)
    check_op(lambda x: -x, lambda x: -x, a)


def test_division_by_a_tensor_is_refused():
    a = Tensor(rand(2, 2), requires_grad=True)
    with pytest.raises(TypeError, match="scalar"):
        a / a


def test_relu_and_tanh():
    x = away_from_zero(4, 5, seed=3)
    check_op(lambda t: t.relu(), lambda v: np.maximum(v, 0), x)
    check_op(lambda t: t.tanh(), np.tanh, rand(4, 5, seed=4, low=-2, high=2))


@pytest.mark.parametrize(("axis", "keepdims"), [(None, False), (0, False), (1, False), (-1, True), (0, True)])
def test_sum_and_mean_2d(axis, keepdims):
    x = rand(3, 4, seed=5)
    check_op(lambda t: t.sum(axis=axis, keepdims=keepdims), lambda v: v.sum(axis=axis, keepdims=keepdims), x)
    check_op(lambda t: t.mean(axis=axis, keepdims=keepdims), lambda v: v.mean(axis=axis, keepdims=keepdims), x)


@pytest.mark.parametrize("axis", [(0, 2), (1,), -2, (0, 1, 2)])
def test_sum_and_mean_3d(axis):
    x = rand(2, 3, 4, seed=6)
    check_op(lambda t: t.sum(axis=axis), lambda v: v.sum(axis=axis), x)
    check_op(lambda t: t.mean(axis=axis), lambda v: v.mean(axis=axis), x)


def test_reshape():
    x = rand(3, 4, seed=7)
    check_op(lambda t: t.reshape(2, 6), lambda v: v.reshape(2, 6), x)
    check_op(lambda t: t.reshape((12,)), lambda v: v.reshape(12), x)
    check_op(lambda t: t.reshape(4, -1), lambda v: v.reshape(4, 3), x)


@pytest.mark.parametrize("axis", [-1, 0])
def test_log_softmax(axis):
    check_op(lambda t: t.log_softmax(axis=axis), lambda v: np_log_softmax(v, axis=axis), rand(4, 5, seed=8, high=3))


def test_softmax_cross_entropy():
    z, labels = rand(6, 5, seed=9, low=-3, high=3), np.array([0, 4, 2, 2, 1, 3])
    check_op(lambda t: softmax_cross_entropy(t, labels), lambda v: np_cross_entropy(v, labels), z)


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    """Logits ~1e3 overflow a naive exp; a per-row shift changes neither the loss nor the gradient."""
    rng = np.random.default_rng(10)
    moderate, labels = rng.normal(size=(5, 4)), np.array([3, 0, 1, 1, 2])
    shift = np.array([[1000.0], [-1000.0], [999.0], [1234.5], [800.0]])
    huge = Tensor(moderate + shift, requires_grad=True)
    with np.errstate(all="raise"):  # no overflow anywhere, not even a warning
        loss = softmax_cross_entropy(huge, labels)
        loss.backward()
    assert np.isfinite(loss.data) and np.all(np.isfinite(huge.grad))
    # the oracle: the textbook formula and finite differences, on the moderate (shifted back) logits
    (g,) = numeric_grads(lambda v: np_cross_entropy(v, labels), [(huge.data - shift).copy()])
    np.testing.assert_allclose(float(loss.data), np_cross_entropy(moderate, labels), rtol=1e-9)
    np.testing.assert_allclose(huge.grad, g, rtol=RTOL, atol=ATOL)

    x = Tensor(moderate + shift, requires_grad=True)
    with np.errstate(all="raise"):
        out = x.log_softmax()
    np.testing.assert_allclose(out.data, np_log_softmax(moderate), atol=1e-10)


@pytest.mark.parametrize(
    "labels",
    [np.zeros((6, 1), dtype=np.int64), np.zeros(5, dtype=np.int64), np.zeros(7, dtype=np.int64), np.int64(0)],
)
def test_softmax_cross_entropy_rejects_labels_of_the_wrong_shape(labels):
    logits = Tensor(rand(6, 3), requires_grad=True)
    with pytest.raises(ValueError, match="labels must have shape"):
        softmax_cross_entropy(logits, labels)


def test_softmax_cross_entropy_rejects_logits_that_are_not_a_matrix():
    with pytest.raises(ValueError, match="logits must be"):
        softmax_cross_entropy(Tensor(rand(6), requires_grad=True), np.zeros(6, dtype=np.int64))


def test_a_composite_graph_against_finite_differences():
    """A two-layer tanh network with bias broadcasting and a reused input, end to end."""
    x, labels = rand(5, 3, seed=11), np.array([0, 1, 1, 0, 1])
    w1, b1, w2, b2 = rand(3, 4, seed=12), rand(4, seed=13), rand(4, 2, seed=14), rand(1, 2, seed=15)

    def reference(x, w1, b1, w2, b2):
        h = np.tanh(x @ w1 + b1)
        return np_cross_entropy(h @ w2 + b2, labels) + 0.1 * np.mean(x * x)

    def op(x, w1, b1, w2, b2):
        h = (x @ w1 + b1).tanh()
        return softmax_cross_entropy(h @ w2 + b2, labels) + (x * x).mean() * 0.1

    check_op(op, reference, x, w1, b1, w2, b2)


# ------------------------------------------------------------------------------------ broadcasting details
def test_bias_gradients_are_summed_over_the_batch():
    h, upstream = rand(6, 3, seed=1), rand(6, 3, seed=2)
    for bias_shape in [(3,), (1, 3)]:
        b = Tensor(np.zeros(bias_shape), requires_grad=True)
        (Tensor(h) + b).backward(upstream)
        assert b.grad.shape == bias_shape
        np.testing.assert_allclose(b.grad.reshape(-1), upstream.sum(axis=0))


def test_column_times_matrix_gradients():
    col, mat, upstream = rand(6, 1, seed=1), rand(6, 3, seed=2), rand(6, 3, seed=3)
    c, m = Tensor(col, requires_grad=True), Tensor(mat, requires_grad=True)
    (c * m).backward(upstream)
    np.testing.assert_allclose(c.grad, (upstream * mat).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(m.grad, upstream * col)


def test_unbroadcast():
    g = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(unbroadcast(g, (2, 3, 4)), g)
    np.testing.assert_array_equal(unbroadcast(g, (4,)), g.sum(axis=(0, 1)))
    np.testing.assert_array_equal(unbroadcast(g, (3, 1)), g.sum(axis=(0, 2))[:, None])
    np.testing.assert_array_equal(unbroadcast(g, (1, 1, 1)), g.sum().reshape(1, 1, 1))
    np.testing.assert_array_equal(unbroadcast(g, ()), g.sum())


# ------------------------------------------------------------------------------------ accumulation and state
def test_gradients_accumulate_across_backward_calls():
    x, w = Tensor(rand(3, 4, seed=1)), Tensor(rand(4, 2, seed=2), requires_grad=True)
    loss = (x @ w).tanh().sum()
    loss.backward()
    first = w.grad.copy()
    buffer = w.grad
    loss.backward()
    np.testing.assert_allclose(w.grad, 2 * first)
    assert w.grad is buffer, "accumulation must be in place (a flat-buffer view has to stay a view)"


def test_a_tensor_used_twice_gets_both_contributions():
    a = rand(3, 3, seed=1)
    check_op(lambda x: x * x, lambda v: v * v, a)
    check_op(lambda x: x + x, lambda v: v + v, a)
    check_op(lambda x: (x @ x).tanh() @ x - x, lambda v: np.tanh(v @ v) @ v - v, a)


@pytest.mark.parametrize(
    ("op", "reference"),
    [
        (lambda x, w: (lambda u: u + u.tanh())(x @ w), lambda x, w: (lambda u: u + np.tanh(u))(x @ w)),
        (lambda x, w: (lambda u: u.tanh() + u)(x @ w), lambda x, w: (lambda u: np.tanh(u) + u)(x @ w)),
        (  # an intermediate used by three later nodes, on paths of different lengths
            lambda x, w: (lambda u: (u.tanh() * u).tanh() @ w.reshape(4, 4) - u * 0.5)(x @ w),
            lambda x, w: (lambda u: np.tanh(np.tanh(u) * u) @ w.reshape(4, 4) - u * 0.5)(x @ w),
        ),
    ],
)
def test_an_intermediate_used_on_several_paths(op, reference):
    """A non-leaf node's gradient is the sum over all its consumers, sent on only once that sum is complete."""
    check_op(op, reference, rand(3, 4, seed=1), rand(4, 4, seed=2))


def test_zero_grad_zeroes_in_place():
    w = Tensor(rand(3, 2), requires_grad=True)
    (w * 3.0).sum().backward()
    buffer = w.grad
    w.zero_grad()
    assert w.grad is buffer
    np.testing.assert_array_equal(w.grad, 0)
    Tensor(rand(2)).zero_grad()  # no gradient yet: nothing to do, no error


def test_no_grad_builds_no_graph_and_restores_the_previous_mode():
    w = Tensor(rand(3, 2), requires_grad=True)
    with no_grad():
        out = (Tensor(rand(4, 3)) @ w).relu().sum()
        with no_grad():
            pass
        inner = w * 2.0
    assert not out.requires_grad and out.is_leaf and out._parents == ()
    assert not inner.requires_grad, "leaving a nested no_grad must not switch gradients back on"
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.backward()
    with pytest.raises(KeyError), no_grad():
        raise KeyError("leaving by an exception restores the mode too")
    assert (w * 2.0).requires_grad


def test_no_grad_in_one_thread_leaves_the_others_building_graphs():
    """The simulator's ranks are threads: one rank evaluating under no_grad must not cut another rank's graph."""
    inside, leave = threading.Event(), threading.Event()

    def evaluating_rank():
        with no_grad():
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=evaluating_rank)
    other.start()
    try:
        assert inside.wait(10)
        w = Tensor(rand(3, 2), requires_grad=True)
        out = (w * 2.0).sum()
        assert out.requires_grad, "no_grad in another thread switched off this thread's graph"
        out.backward()
        np.testing.assert_array_equal(w.grad, 2.0)
    finally:
        leave.set()
        other.join()


def test_a_constant_operand_of_add_or_sub_gets_no_gradient_computed():
    w, c = Tensor(rand(3, 4), requires_grad=True), Tensor(rand(4))
    for op in (lambda: w + c, lambda: c + w, lambda: w - c, lambda: c - w):
        out = op()
        grads = out._backward(np.ones((3, 4)))
        assert [g is None for g in grads] == [p is c for p in out._parents]


def test_backward_on_a_non_scalar_needs_an_explicit_gradient():
    y = Tensor(rand(3, 2), requires_grad=True) * 2.0
    with pytest.raises(RuntimeError, match="scalar"):
        y.backward()


def test_backward_on_a_leaf_seeds_its_gradient():
    w = Tensor(np.array(3.0), requires_grad=True)
    w.backward()
    assert w.grad == 1.0


def test_float32_stays_float32():
    """Every op on float32 tensors keeps float32 (NumPy 2 promotes float32 * np.float64 scalar to float64)."""
    x = Tensor(rand(3, 4).astype(np.float32), requires_grad=True)
    b = Tensor(rand(4).astype(np.float32), requires_grad=True)
    outputs = {
        "matmul": x @ Tensor(rand(4, 2).astype(np.float32)),
        "add": x + b,
        "sub": 1.0 - x,
        "mul": x * b * 3.0,
        "div": x / 3,
        "relu": x.relu(),
        "tanh": x.tanh(),
        "sum": x.sum(axis=0),
        "mean": x.mean(),
        "mean_axis": x.mean(axis=0),
        "mean_axes": x.mean(axis=(0, 1), keepdims=True),
        "log_softmax": x.log_softmax(),
        "cross_entropy": softmax_cross_entropy(x, np.array([0, 1, 2])),
    }
    for name, out in outputs.items():
        assert out.dtype == np.float32, f"{name} gives {out.dtype}"
    sum(o.sum() for o in outputs.values()).backward()
    assert x.grad.dtype == np.float32 and b.grad.dtype == np.float32


@pytest.mark.parametrize(
    "scalar", [np.float64(3.0), np.int64(3), 3.0, 3], ids=["np.float64", "np.int64", "float", "int"]
)
def test_numpy_and_python_scalars_keep_float32(scalar):
    """NumPy 2 promotes float32 * np.float64(3) to float64; the tensor must stay float32, forward and backward."""
    x = Tensor(rand(3, 4).astype(np.float32), requires_grad=True)
    outputs = [x * scalar, scalar * x, x / scalar, x + scalar, scalar - x]
    assert [o.dtype for o in outputs] == [np.float32] * len(outputs)
    sum(o.sum() for o in outputs).backward()
    assert x.grad.dtype == np.float32


# ------------------------------------------------------------------------------------------------- hooks
def _mlp_graph(model, seed=0):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(8, model.sizes[0])), rng.integers(0, model.sizes[-1], size=8)
    return softmax_cross_entropy(model(Tensor(x)), y)


def test_hooks_fire_once_with_the_final_gradient_last_layer_first():
    model = MLP([6, 5, 4, 3], seed=1, dtype=np.float64)
    fired = []  # (name, copy of the gradient at the moment the hook ran)
    for name, p in model.named_parameters():
        p.register_hook(lambda t, name=name: fired.append((name, t.grad.copy())))
    _mlp_graph(model).backward()

    names = [name for name, _ in fired]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()), "each hook exactly once"
    params = dict(model.named_parameters())
    for name, grad_then in fired:
        np.testing.assert_array_equal(grad_then, params[name].grad, err_msg=f"{name} was not final when its hook ran")
        assert np.any(grad_then != 0)
    layer_of = {name: int(name.split(".")[1]) for name in names}  # "layers.4.weight" -> 4
    order = [layer_of[n] for n in names]
    assert order == sorted(order, reverse=True), f"hooks must fire last layer first, got {names}"

    fired.clear()
    model.zero_grad()
    _mlp_graph(model, seed=1).backward()
    assert len(fired) == len(params), "hooks fire again, once each, on the next backward"


def test_hook_of_a_parameter_used_twice_fires_once_after_both_contributions():
    w = Tensor(rand(3, 3, seed=1), requires_grad=True)
    other = Tensor(rand(3, 3, seed=2), requires_grad=True)
    seen = []
    w.register_hook(lambda t: seen.append(t.grad.copy()))
    x = Tensor(rand(4, 3, seed=3))
    loss = ((x @ w).tanh() @ other @ w).sum()  # w's two contributions arrive at different times
    loss.backward()
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], w.grad)
    (g,) = numeric_grads(lambda v: np.sum(np.tanh(x.data @ v) @ other.data @ v), [w.data.copy()])
    np.testing.assert_allclose(seen[0], g, rtol=RTOL, atol=ATOL)


def test_hooks_are_for_leaves_only():
    y = Tensor(rand(2), requires_grad=True) * 2.0
    with pytest.raises(ValueError, match="leaf"):
        y.register_hook(lambda t: None)


def test_mul_by_array_that_broadcasts_the_tensor_sums_its_gradient():
    # a (3,) tensor times a (2, 3) array broadcasts the tensor over rows: its gradient is the column sums
    w = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    a = np.arange(6.0).reshape(2, 3)
    (w * a).sum().backward()
    np.testing.assert_array_equal(w.grad, a.sum(axis=0))


def test_matmul_by_a_plain_array_treats_it_as_a_constant():
    y = Tensor(np.arange(6.0).reshape(3, 2), requires_grad=True)
    (y @ np.ones((2, 5))).sum().backward()  # d/dy sum(y @ B) = B summed over its columns, for every row
    np.testing.assert_array_equal(y.grad, np.full((3, 2), 5.0))


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_activation_bytes_counts_every_intermediate_of_an_mlp_forward(batch):
    """Per Linear+ReLU layer of width h the graph keeps x@W, +b and relu (3 arrays of batch x h); the last layer keeps
    x@W and +b; the loss is one number. In float64: 8 bytes each."""
    model = MLP([64, 32, 16, 10], seed=0, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((batch, 64))
    loss = softmax_cross_entropy(model(Tensor(x)), np.zeros(batch, dtype=np.int64))
    assert activation_bytes(loss) == 8 * (batch * (3 * 32 + 3 * 16 + 2 * 10) + 1)
    with no_grad():  # no graph, nothing kept: only the output itself
        assert activation_bytes(model(Tensor(x))) == 0

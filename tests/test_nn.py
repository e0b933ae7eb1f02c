"""The MLP and its flat buffers: view invariants, state dicts, deterministic init, and a hand-written NumPy oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dtrain.autograd import Tensor, softmax_cross_entropy
from dtrain.nn import MLP, Linear, Module, Parameter
from dtrain.optim import SGD, Adam


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def batch(model, n=7, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, model.sizes[0])), rng.integers(0, model.sizes[-1], size=n)


def loss_of(model, x, y):
    return softmax_cross_entropy(model(Tensor(x)), y)


def assert_views(model):
    """Every p.data / p.grad is a C-contiguous view at exactly its recorded slice of the flat buffers."""
    for name, p in model.named_parameters():
        where = model.param_slices[name]
        for array, flat in ((p.data, model.flat_params), (p.grad, model.flat_grads)):
            assert array.flags.c_contiguous, name
            assert array.dtype == flat.dtype, name
            assert array.size == where.stop - where.start, name
            assert address(array) - address(flat) == where.start * flat.itemsize, f"{name} is not at its slice"


# ------------------------------------------------------------------------------------------------ flat buffers
@pytest.mark.parametrize("sizes", [[64, 128, 10], [5, 3], [4, 7, 6, 2], [3, 1, 1, 3]])
def test_slices_tile_the_flat_buffers_in_parameter_order(sizes):
    model = MLP(sizes, seed=0)
    expected_total = sum(n_in * n_out + n_out for n_in, n_out in itertools.pairwise(sizes))
    assert model.flat_params.shape == model.flat_grads.shape == (expected_total,)
    assert model.num_parameters() == expected_total
    assert model.flat_params.flags.c_contiguous and model.flat_grads.flags.c_contiguous

    names = [name for name, _ in model.named_parameters()]
    linear_indices = range(0, 2 * (len(sizes) - 1), 2)  # Linear, activation, Linear, ...: no activation at the end
    assert names == [f"layers.{i}.{kind}" for i in linear_indices for kind in ("weight", "bias")]
    assert list(model.param_slices) == names
    shapes = [shape for n_in, n_out in itertools.pairwise(sizes) for shape in ((n_in, n_out), (n_out,))]
    offset = 0
    for (name, p), shape in zip(model.named_parameters(), shapes, strict=True):
        assert p.data.shape == p.grad.shape == shape, name
        assert model.param_slices[name] == slice(offset, offset + p.data.size), "a gap or overlap in the buffer"
        offset += p.data.size
    assert offset == expected_total
    assert_views(model)
    model.check_flat_views()


def test_views_share_memory_in_both_directions():
    model = MLP([3, 4, 2], seed=0, dtype=np.float64)
    w = model.layers[2].weight
    where = model.param_slices["layers.2.weight"]
    model.flat_params[where.start] = 123.0
    assert w.data[0, 0] == 123.0
    w.data[-1, -1] = -7.0
    assert model.flat_params[where.stop - 1] == -7.0
    w.grad[...] = 1.0
    assert np.all(model.flat_grads[where] == 1.0)
    assert np.count_nonzero(model.flat_grads) == where.stop - where.start


def test_check_flat_views_catches_a_rebound_parameter():
    model = MLP([3, 4, 2], seed=0)
    bias = model.layers[0].bias
    original = bias.data
    bias.data = bias.data.copy()  # the mistake the rule forbids
    with pytest.raises(AssertionError, match=r"layers\.0\.bias\.data"):
        model.check_flat_views()
    bias.data = original
    model.check_flat_views()

    weight = model.layers[2].weight  # rebinding to a view of the *wrong* part of the buffer is caught too
    weight.data = model.flat_params[: weight.data.size].reshape(weight.data.shape)
    with pytest.raises(AssertionError, match=r"layers\.2\.weight\.data"):
        model.check_flat_views()

    model = MLP([3, 4, 2], seed=0)
    model.layers[0].weight.grad = np.zeros_like(model.layers[0].weight.grad)
    with pytest.raises(AssertionError, match=r"layers\.0\.weight\.grad"):
        model.check_flat_views()


@pytest.mark.parametrize("make_optimizer", [lambda m: SGD(m, lr=0.1, momentum=0.9), lambda m: Adam(m, lr=0.01)])
def test_backward_and_optimizer_step_keep_the_views(make_optimizer):
    model = MLP([5, 6, 3], seed=0)
    params_at, grads_at = address(model.flat_params), address(model.flat_grads)
    optimizer = make_optimizer(model)
    before = model.flat_params.copy()
    for step in range(3):
        model.zero_grad()
        loss_of(model, *batch(model, seed=step)).backward()
        optimizer.step()
        model.check_flat_views()
        assert_views(model)
    assert address(model.flat_params) == params_at and address(model.flat_grads) == grads_at
    assert not np.array_equal(model.flat_params, before)
    # the flat gradient buffer holds exactly the per-parameter gradients, in order
    np.testing.assert_array_equal(model.flat_grads, np.concatenate([p.grad.ravel() for p in model.parameters()]))


def test_zero_grad_zeroes_the_flat_buffer_in_place():
    model = MLP([5, 6, 3], seed=0)
    loss_of(model, *batch(model)).backward()
    assert np.count_nonzero(model.flat_grads) > 0
    buffer = model.flat_grads
    model.zero_grad()
    assert model.flat_grads is buffer
    assert np.count_nonzero(model.flat_grads) == 0
    model.check_flat_views()


def test_gradients_accumulate_without_zero_grad():
    model = MLP([5, 6, 3], seed=0, dtype=np.float64)
    x, y = batch(model)
    loss_of(model, x, y).backward()
    once = model.flat_grads.copy()
    loss_of(model, x, y).backward()
    np.testing.assert_allclose(model.flat_grads, 2 * once, rtol=1e-14)


# ------------------------------------------------------------------------------------------------- state dict
def test_state_dict_round_trip_into_a_model_with_another_seed():
    source, target = MLP([6, 5, 4], seed=0), MLP([6, 5, 4], seed=1)
    assert not np.array_equal(source.flat_params, target.flat_params)
    buffer = target.flat_params
    state = source.state_dict()
    assert list(state) == [name for name, _ in source.named_parameters()]
    target.load_state_dict(state)
    assert target.flat_params.tobytes() == source.flat_params.tobytes()
    assert target.flat_params is buffer
    target.check_flat_views()

    state["layers.0.bias"][...] = 99.0  # the state dict holds copies, not views
    assert not np.any(source.layers[0].bias.data == 99.0)


def test_load_state_dict_casts_to_the_model_dtype():
    m64, m32 = MLP([4, 3, 2], seed=3, dtype=np.float64), MLP([4, 3, 2], seed=0, dtype=np.float32)
    m32.load_state_dict(m64.state_dict())
    assert m32.flat_params.dtype == np.float32
    np.testing.assert_array_equal(m32.flat_params, m64.flat_params.astype(np.float32))


def test_load_state_dict_errors_leave_the_model_untouched():
    model = MLP([4, 3, 2], seed=0)
    before = model.flat_params.copy()
    good = MLP([4, 3, 2], seed=1).state_dict()

    missing = dict(good)
    del missing["layers.2.bias"]
    with pytest.raises(KeyError, match=r"missing \['layers\.2\.bias'\]"):
        model.load_state_dict(missing)

    unexpected = {**good, "layers.4.weight": np.zeros((2, 2))}
    with pytest.raises(KeyError, match=r"unexpected \['layers\.4\.weight'\]"):
        model.load_state_dict(unexpected)

    wrong_shape = {**good, "layers.2.weight": np.zeros((2, 3))}  # the last weight: all others would load first
    with pytest.raises(ValueError, match=r"layers\.2\.weight.*\(2, 3\).*\(3, 2\)"):
        model.load_state_dict(wrong_shape)

    np.testing.assert_array_equal(model.flat_params, before)
    model.check_flat_views()


# ----------------------------------------------------------------------------------------------------- init
def test_initialisation_is_deterministic():
    a, b, c = MLP([8, 6, 4], seed=5), MLP([8, 6, 4], seed=5), MLP([8, 6, 4], seed=6)
    assert a.flat_params.tobytes() == b.flat_params.tobytes()
    assert a.flat_params.tobytes() != c.flat_params.tobytes()
    m64 = MLP([8, 6, 4], seed=5, dtype=np.float64)
    assert m64.flat_params.dtype == np.float64 and a.flat_params.dtype == np.float32
    np.testing.assert_array_equal(a.flat_params, m64.flat_params.astype(np.float32))


def test_initialisation_is_kaiming_uniform_with_zero_biases():
    model = MLP([50, 40, 10], seed=0, dtype=np.float64)
    for layer in (model.layers[0], model.layers[2]):
        bound = np.sqrt(6.0 / layer.in_features)
        w = layer.weight.data
        assert np.all(np.abs(w) <= bound)
        assert np.abs(w).max() > 0.9 * bound  # uses the range, not a much narrower one
        np.testing.assert_allclose(w.std(), bound / np.sqrt(3), rtol=0.1)  # std of U(-a, a) is a / sqrt(3)
        np.testing.assert_array_equal(layer.bias.data, 0)


# ------------------------------------------------------------------------------ hand-written NumPy oracle
def numpy_forward(weights, x, activation):
    """``weights`` = [(W, b), ...]; returns the pre-activations of every layer and the logits."""
    act = {"relu": lambda z: np.maximum(z, 0), "tanh": np.tanh}[activation]
    h, pre = x, []
    for i, (w, b) in enumerate(weights):
        z = h @ w + b
        pre.append((h, z))
        h = act(z) if i < len(weights) - 1 else z
    return pre, h


def numpy_loss_and_grads(weights, x, y, activation):
    """Mean softmax cross-entropy and its gradients, derived by hand."""
    pre, logits = numpy_forward(weights, x, activation)
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.mean(np.log(p[np.arange(n), y]))
    delta = p.copy()
    delta[np.arange(n), y] -= 1
    delta /= n  # dL/dlogits
    grads = []
    for i in reversed(range(len(weights))):
        h_in, _ = pre[i]
        grads.append((h_in.T @ delta, delta.sum(axis=0)))
        if i > 0:
            dh = delta @ weights[i][0].T
            z_prev = pre[i - 1][1]
            delta = dh * (z_prev > 0) if activation == "relu" else dh * (1 - np.tanh(z_prev) ** 2)
    return loss, grads[::-1]


@pytest.mark.parametrize(("sizes", "activation"), [([6, 9, 4], "relu"), ([5, 7, 6, 3], "tanh"), ([4, 3], "relu")])
def test_mlp_matches_a_hand_written_numpy_forward_and_backward(sizes, activation):
    model = MLP(sizes, seed=2, activation=activation, dtype=np.float64)
    x, y = batch(model, n=11, seed=4)
    state = model.state_dict()
    weights = [(state[f"layers.{2 * i}.weight"], state[f"layers.{2 * i}.bias"]) for i in range(len(sizes) - 1)]
    expected_loss, expected_grads = numpy_loss_and_grads(weights, x, y, activation)

    logits = model(Tensor(x))
    np.testing.assert_allclose(logits.data, numpy_forward(weights, x, activation)[1], rtol=1e-12, atol=1e-12)
    loss = softmax_cross_entropy(logits, y)
    loss.backward()
    np.testing.assert_allclose(float(loss.data), expected_loss, rtol=1e-12)
    for i, (gw, gb) in enumerate(expected_grads):
        layer = model.layers[2 * i]
        np.testing.assert_allclose(layer.weight.grad, gw, rtol=1e-10, atol=1e-13, err_msg=f"layer {i} weight")
        np.testing.assert_allclose(layer.bias.grad, gb, rtol=1e-10, atol=1e-13, err_msg=f"layer {i} bias")


def test_float32_model_is_float32_throughout():
    model = MLP([6, 5, 3], seed=0)
    x, y = batch(model)
    logits = model(Tensor(x.astype(np.float32)))
    loss = softmax_cross_entropy(logits, y)
    loss.backward()
    assert logits.dtype == loss.dtype == model.flat_grads.dtype == np.float32
    model.check_flat_views()


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    ("sizes", "kwargs", "match"),
    [
        ([64], {}, "at least"),
        ([], {}, "at least"),
        ([64, 0, 10], {}, ">= 1"),
        ([64, -3], {}, ">= 1"),
        ([64, 10], {"activation": "sigmoid"}, "unknown activation"),
    ],
)
def test_bad_mlp_arguments_raise(sizes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MLP(sizes, **kwargs)


def test_module_plumbing():
    class Custom(Module):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.first = Linear(3, 2, rng)
            self.blocks = [Linear(2, 2, rng), Linear(2, 1, rng)]
            self.scale = Parameter(np.ones(1))

    model = Custom()
    names = [name for name, _ in model.named_parameters()]
    assert names == [
        "first.weight",
        "first.bias",
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
        "scale",
    ]
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(TypeError, match="forward"):
        model(Tensor(np.ones((1, 3))))
    model.flatten_(dtype=np.float64)
    assert model.flat_params.size == 3 * 2 + 2 + 2 * 2 + 2 + 2 * 1 + 1 + 1
    model.check_flat_views()
    assert repr(MLP([3, 4, 2], seed=0)) == "MLP([Linear(3, 4), ReLU(), Linear(4, 2)])"

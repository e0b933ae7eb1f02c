"""SGD and Adam against a per-parameter reference written here from the formulas, and against PyTorch if present."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dtrain.nn import MLP
from dtrain.optim import SGD, Adam, make_optimizer

SIZES = [5, 4, 3]
STEPS = 6


def gradient_sequence(model, steps=STEPS, seed=0):
    """Per step, a name -> gradient dict (fixed random numbers: the optimizer does not care where they came from)."""
    rng = np.random.default_rng(seed)
    return [{name: rng.normal(size=p.data.shape) for name, p in model.named_parameters()} for _ in range(steps)]


def run_dtrain(make, grads, model):
    optimizer = make(model)
    for step_grads in grads:
        for name, p in model.named_parameters():
            p.grad[...] = step_grads[name]
        optimizer.step()
    return optimizer


class ReferenceSGD:
    """Textbook SGD, one parameter at a time: g = grad + wd*w; v = g (first step) or mu*v + g; w -= lr*v."""

    def __init__(self, weights, lr, momentum=0.0, weight_decay=0.0):
        self.w, self.lr, self.mu, self.wd = {k: v.copy() for k, v in weights.items()}, lr, momentum, weight_decay
        self.v = {}

    def step(self, grads):
        for name, w in self.w.items():
            g = grads[name] + self.wd * w
            if self.mu:
                self.v[name] = g.copy() if name not in self.v else self.mu * self.v[name] + g
                g = self.v[name]
            self.w[name] = w - self.lr * g


class ReferenceAdam:
    """Textbook Adam (Kingma & Ba, algorithm 1) with L2 weight decay added to the gradient."""

    def __init__(self, weights, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.w = {k: v.copy() for k, v in weights.items()}
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = {k: np.zeros_like(v) for k, v in weights.items()}
        self.v = {k: np.zeros_like(v) for k, v in weights.items()}
        self.t = 0

    def step(self, grads):
        self.t += 1
        for name, w in self.w.items():
            g = grads[name] + self.wd * w
            self.m[name] = self.b1 * self.m[name] + (1 - self.b1) * g
            self.v[name] = self.b2 * self.v[name] + (1 - self.b2) * g**2
            m_hat = self.m[name] / (1 - self.b1**self.t)
            v_hat = self.v[name] / (1 - self.b2**self.t)
            self.w[name] = w - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


CASES = {
    "sgd": ({"lr": 0.1}, SGD, ReferenceSGD),
    "sgd-momentum": ({"lr": 0.1, "momentum": 0.9}, SGD, ReferenceSGD),
    "sgd-momentum-wd": ({"lr": 0.05, "momentum": 0.8, "weight_decay": 0.01}, SGD, ReferenceSGD),
    "sgd-wd": ({"lr": 0.1, "weight_decay": 0.1}, SGD, ReferenceSGD),
    "adam": ({"lr": 0.01}, Adam, ReferenceAdam),
    "adam-wd": ({"lr": 0.01, "weight_decay": 0.05}, Adam, ReferenceAdam),
    "adam-betas": ({"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6}, Adam, ReferenceAdam),
}


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_matches_the_per_parameter_reference(case):
    kwargs, cls, reference_cls = CASES[case]
    model = MLP(SIZES, seed=0, dtype=np.float64)
    reference = reference_cls(model.state_dict(), **kwargs)
    grads = gradient_sequence(model)
    run_dtrain(lambda m: cls(m, **kwargs), grads, model)
    for step_grads in grads:
        reference.step(step_grads)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, reference.w[name], rtol=1e-12, atol=1e-14, err_msg=name)
    assert not np.allclose(model.flat_params, MLP(SIZES, seed=0, dtype=np.float64).flat_params)


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_matches_pytorch(case):
    torch = pytest.importorskip("torch")
    kwargs, cls, _ = CASES[case]
    model = MLP(SIZES, seed=0, dtype=np.float64)
    names = [name for name, _ in model.named_parameters()]
    tensors = [torch.tensor(p.data.copy(), dtype=torch.float64, requires_grad=True) for p in model.parameters()]
    torch_cls = {SGD: torch.optim.SGD, Adam: torch.optim.Adam}[cls]
    torch_optimizer = torch_cls(tensors, **kwargs)
    grads = gradient_sequence(model, seed=1)
    run_dtrain(lambda m: cls(m, **kwargs), grads, model)
    for step_grads in grads:
        for name, t in zip(names, tensors):
            t.grad = torch.tensor(step_grads[name], dtype=torch.float64)
        torch_optimizer.step()
    for name, p, t in zip(names, model.parameters(), tensors):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("case", ["sgd-momentum-wd", "adam-wd"])
def test_step_updates_the_flat_buffers_in_place_and_leaves_gradients_alone(case):
    kwargs, cls, _ = CASES[case]
    model = MLP(SIZES, seed=0)
    params, grads = model.flat_params, model.flat_grads
    address = params.__array_interface__["data"][0]
    optimizer = cls(model, **kwargs)
    assert optimizer.params is params and optimizer.grads is grads
    grads[...] = np.random.default_rng(0).normal(size=grads.shape)
    grads_before, params_before = grads.copy(), params.copy()
    optimizer.step()
    assert model.flat_params is params and params.__array_interface__["data"][0] == address
    assert params.dtype == np.float32
    assert not np.array_equal(params, params_before)
    np.testing.assert_array_equal(grads, grads_before)  # weight decay must not be added into the user's gradient
    model.check_flat_views()


def test_optimizer_over_explicit_buffers():
    params, grads = np.ones(4), np.array([1.0, -2.0, 0.0, 4.0])
    SGD(params=params, grads=grads, lr=0.5).step()
    np.testing.assert_array_equal(params, [0.5, 2.0, 1.0, -1.0])


@pytest.mark.parametrize("case", ["sgd-momentum", "sgd-momentum-wd", "adam", "adam-wd"])
def test_state_dict_round_trip_continues_identically(case):
    kwargs, cls, _ = CASES[case]
    grads = gradient_sequence(MLP(SIZES, seed=0), steps=6, seed=2)
    model = MLP(SIZES, seed=0, dtype=np.float64)
    optimizer = run_dtrain(lambda m: cls(m, **kwargs), grads[:3], model)

    state = optimizer.state_dict()
    assert state["steps"] == 3
    resumed_model = MLP(SIZES, seed=9, dtype=np.float64)
    resumed_model.load_state_dict(model.state_dict())
    resumed = cls(resumed_model, **{**kwargs, "lr": 123.0})  # lr comes back from the state too
    resumed.load_state_dict(state)
    assert resumed.lr == kwargs["lr"] and resumed.steps == 3

    for step_grads in grads[3:]:
        for m in (model, resumed_model):
            for name, p in m.named_parameters():
                p.grad[...] = step_grads[name]
        optimizer.step()
        resumed.step()
    assert resumed_model.flat_params.tobytes() == model.flat_params.tobytes()

    buffers = [k for k, v in state.items() if isinstance(v, np.ndarray)]
    assert buffers, "the optimizer state must include its moment buffers"
    for key in buffers:  # the state holds copies
        state[key][...] = np.nan
    optimizer.step()
    assert np.all(np.isfinite(model.flat_params))


def test_state_dict_without_state_resumes_plain_sgd():
    model = MLP(SIZES, seed=0, dtype=np.float64)
    state = SGD(model, lr=0.1).state_dict()
    assert state == {"steps": 0, "lr": 0.1}


@pytest.mark.parametrize("lr", [0, -1e-3, math.nan, math.inf])
@pytest.mark.parametrize("cls", [SGD, Adam])
def test_bad_learning_rates_raise(cls, lr):
    with pytest.raises(ValueError, match="learning rate"):
        cls(MLP(SIZES, seed=0), lr=lr)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: SGD(m, lr=0.1, momentum=-0.1), "momentum"),
        (lambda m: SGD(m, lr=0.1, momentum=1.0), "momentum"),
        (lambda m: SGD(m, lr=0.1, weight_decay=-1e-4), "weight decay"),
        (lambda m: SGD(m, lr=0.1, weight_decay=math.nan), "weight decay"),
        (lambda m: Adam(m, lr=0.1, weight_decay=math.inf), "weight decay"),
        (lambda m: Adam(m, lr=0.1, betas=(1.0, 0.999)), "betas"),
        (lambda m: Adam(m, lr=0.1, betas=(0.9, -0.1)), "betas"),
        (lambda m: Adam(m, lr=0.1, weight_decay=-1e-4), "weight decay"),
        (lambda m: SGD(lr=0.1), "give a model"),
        (lambda m: SGD(params=np.zeros(3), grads=np.zeros(4), lr=0.1), "equal 1-D"),
        (lambda m: make_optimizer("foo", m, 0.1), "unknown optimizer 'foo'"),
    ],
)
def test_bad_optimizer_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make(MLP(SIZES, seed=0))


def test_make_optimizer():
    model = MLP(SIZES, seed=0)
    sgd = make_optimizer("sgd", model, 0.2, momentum=0.5, weight_decay=0.1)
    assert isinstance(sgd, SGD) and (sgd.lr, sgd.momentum, sgd.weight_decay) == (0.2, 0.5, 0.1)
    adam = make_optimizer("adam", model, 0.01, weight_decay=0.1)
    assert isinstance(adam, Adam) and (adam.lr, adam.weight_decay) == (0.01, 0.1)


@pytest.mark.parametrize("eps", [0.0, -1e-8, float("nan"), float("inf")])
def test_adam_refuses_a_bad_eps(eps):
    model = MLP([3, 2], seed=0)
    with pytest.raises(ValueError, match="eps"):
        Adam(model, lr=1e-3, eps=eps)

"""Layers, the MLP, and the flat buffers that every distributed paradigm communicates.

**One flat buffer for all parameters, one for all gradients.** After construction, the model owns two contiguous
1-D arrays, ``flat_params`` and ``flat_grads``, and every parameter's ``.data`` and ``.grad`` are *views* into them::

    flat_params: [ W0 (in0*out0) | b0 (out0) | W1 (out0*out1) | b1 (out1) | ... ]
                   ^ layer0.weight.data is flat_params[0:in0*out0].reshape(in0, out0)

So an all-reduce of *all* gradients is one call on ``flat_grads`` (no packing or copying), a DDP bucket is a slice
of it, an optimizer step is a few vector operations on the whole model, and a checkpoint is one array. The price is
a rule: nobody may *rebind* ``p.data`` or ``p.grad``; write into them (``p.data[...] = x``) instead.
:meth:`Module.check_flat_views` verifies the rule.

**Layers are a plain list run in order** (:class:`Sequential`), so later lessons can cut ``model.layers`` into
pipeline stages, or replace one ``Linear`` by a sharded one, without rewriting the model.

**Deterministic initialisation.** All initial values are drawn on the host from ``numpy.random.default_rng(seed)``
in float64, then cast: the same seed gives the same model on every rank, on CPU or GPU, in float32 or float64.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict

import numpy as np

from dtrain.autograd import Tensor, matmul_backward, unbroadcast
from dtrain.backend import DEFAULT_DTYPE, array_module, to_device, to_host
from dtrain.layout import spans


class Parameter(Tensor):
    """A leaf tensor that requires a gradient and belongs to a module."""

    __slots__ = ()

    def __init__(self, data, name: str = ""):
        super().__init__(data, requires_grad=True, name=name)


class Module:
    """Base class: a module has named parameters and submodules, and a ``forward``."""

    def __call__(self, *args):
        return self.forward(*args)

    def forward(self, *args):
        raise TypeError(f"{type(self).__name__} must define forward()")

    def named_parameters(self, prefix: str = ""):
        """``(name, Parameter)`` pairs in a fixed order: this module's own, then each submodule's in turn."""
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value.named_parameters(f"{prefix}{name}.")
            elif isinstance(value, list | tuple):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield from item.named_parameters(f"{prefix}{name}.{i}.")

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.data.size for p in self.parameters())

    def zero_grad(self) -> None:
        if getattr(self, "flat_grads", None) is not None:
            self.flat_grads[...] = 0  # one memset for the whole model
        else:
            for p in self.parameters():
                p.zero_grad()

    # ------------------------------------------------------------ flat buffers
    def flatten_(self, xp=np, dtype=DEFAULT_DTYPE) -> None:
        """Move every parameter into one contiguous buffer and give each a gradient view into another.

        Called once, after all parameters exist. Parameter order is :meth:`named_parameters` order.
        """
        params = self.parameters()
        total = sum(p.data.size for p in params)
        self.flat_params = xp.empty(total, dtype=dtype)
        self.flat_grads = xp.zeros(total, dtype=dtype)
        self.param_slices: OrderedDict[str, slice] = OrderedDict()
        for (name, p), (offset, n) in zip(self.named_parameters(), spans(p.data.size for p in params)):
            shape = p.data.shape
            view = self.flat_params[offset : offset + n]
            view[...] = to_device(p.data, xp).ravel()  # (a parameter may be on the host or already on the GPU)
            p.data = view.reshape(shape)
            p.grad = self.flat_grads[offset : offset + n].reshape(shape)
            self.param_slices[name] = slice(offset, offset + n)

    def move_flat_grads(self, flat) -> None:
        """Make ``flat`` (an array of the same size and dtype, say one in memory other ranks can read) the gradient
        buffer: the gradients are copied into it and every ``.grad`` becomes a view into it. Call it before an
        optimizer takes the buffers."""
        self.flat_grads = _moved(self.flat_grads, flat)
        for where, p in zip(self.param_slices.values(), self.parameters()):
            p.grad = flat[where].reshape(p.data.shape)

    def move_flat_params(self, flat) -> None:
        """:meth:`move_flat_grads` for the parameters: ``flat`` becomes ``flat_params``, every ``.data`` a view."""
        self.flat_params = _moved(self.flat_params, flat)
        for where, p in zip(self.param_slices.values(), self.parameters()):
            p.data = flat[where].reshape(p.data.shape)

    def check_flat_views(self) -> None:
        """Raise if any parameter's data or grad is no longer a view into the flat buffers (someone rebound it)."""
        for name, p in self.named_parameters():
            where = self.param_slices[name]
            if p.data.base is None or not _same_memory(p.data, self.flat_params[where]):
                raise AssertionError(f"{name}.data is no longer a view into flat_params (was it reassigned?)")
            if p.grad is None or not _same_memory(p.grad, self.flat_grads[where]):
                raise AssertionError(f"{name}.grad is no longer a view into flat_grads (was it reassigned?)")

    # -------------------------------------------------------------- state dict
    def state_dict(self) -> OrderedDict[str, np.ndarray]:
        """Name → host (NumPy) copy of each parameter."""
        return OrderedDict((name, to_host(p.data).copy()) for name, p in self.named_parameters())

    def load_state_dict(self, state: dict) -> None:
        """Copy values into the existing parameters (in place: the flat-buffer views survive)."""
        own = OrderedDict(self.named_parameters())
        missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
        if missing or unexpected:
            raise KeyError(
                f"state dict does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        values = {name: np.asarray(to_host(state[name])) for name in own}
        for name, p in own.items():  # check everything first: a failed load leaves the model untouched
            if values[name].shape != p.data.shape:
                raise ValueError(f"{name}: state has shape {values[name].shape}, model has {p.data.shape}")
        for name, p in own.items():
            p.data[...] = to_device(values[name].astype(p.data.dtype, copy=False), array_module(p.data))


class Linear(Module):
    """``y = x @ W + b`` with ``W`` of shape (in_features, out_features).

    Weights are He/Kaiming-uniform (bound sqrt(6 / fan_in), right for ReLU networks), biases zero.
    """

    def __init__(self, in_features: int, out_features: int, rng: np.random.Generator):
        bound = math.sqrt(6.0 / in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(rng.uniform(-bound, bound, size=(in_features, out_features)), "weight")
        self.bias = Parameter(np.zeros(out_features), "bias")

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias

    def __repr__(self):
        return f"Linear({self.in_features}, {self.out_features})"


def linear_backward(grad_out, x, weight):
    """The backward rule of :class:`Linear`, ``y = x @ W + b``: from ``grad_out`` = dL/dy of shape (batch, out), the
    input ``x`` (batch, in) and the weight ``W`` (in, out), return ``(grad_x, grad_weight, grad_bias)`` =
    ``(grad_out @ W.T, x.T @ grad_out, grad_out summed over the batch)``. The engine never calls this: it composes
    the same rule from its two ops, the matmul's (:func:`dtrain.autograd.matmul_backward`) and the broadcast add's
    (the bias was added to every row, so its gradient sums the rows: :func:`dtrain.autograd.unbroadcast`)."""
    grad_x, grad_weight = matmul_backward(grad_out, x, weight)
    return grad_x, grad_weight, unbroadcast(grad_out, grad_out.shape[1:])


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()

    def __repr__(self):
        return "ReLU()"


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()

    def __repr__(self):
        return "Tanh()"


class Sequential(Module):
    """Layers run in order; ``self.layers`` is a plain list that can be sliced into pipeline stages."""

    def __init__(self, layers: list[Module]):
        self.layers = list(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def __repr__(self):
        inner = ", ".join(repr(layer) for layer in self.layers)
        return f"{type(self).__name__}([{inner}])"


ACTIVATIONS = {"relu": ReLU, "tanh": Tanh}


class MLP(Sequential):
    """A multi-layer perceptron: ``sizes = [inputs, hidden..., outputs]``, activation between Linear layers.

    >>> model = MLP([64, 128, 10], seed=0)     # 64 -> 128 -> ReLU -> 10
    >>> model.flat_params.size == 64 * 128 + 128 + 128 * 10 + 10
    True
    """

    def __init__(self, sizes, seed: int = 0, activation: str = "relu", xp=np, dtype=DEFAULT_DTYPE):
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"MLP sizes must be at least [inputs, outputs], all >= 1, got {sizes}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        rng = np.random.default_rng(seed)
        layers: list[Module] = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            layers.append(Linear(n_in, n_out, rng))
            if i < len(sizes) - 2:
                layers.append(ACTIVATIONS[activation]())
        super().__init__(layers)
        self.sizes = sizes
        self.flatten_(xp=xp, dtype=dtype)


def _moved(old, new):
    """``new`` holding ``old``'s values, after checking that it can stand in for it."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(f"a flat buffer must be {old.shape} {old.dtype}, not {new.shape} {new.dtype}")
    new[...] = old
    return new


def _same_memory(a, b) -> bool:
    """True when ``a`` and ``b`` cover exactly the same memory (same start and size)."""
    return a.size == b.size and _address(a) == _address(b)


def _address(a) -> int:
    if hasattr(a, "__array_interface__"):
        return a.__array_interface__["data"][0]
    return a.data.ptr  # CuPy

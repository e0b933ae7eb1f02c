"""Optimizers that update a model's flat parameter buffer in place.

Because every parameter is a view into ``model.flat_params`` and every gradient a view into ``model.flat_grads``
(see :mod:`dtrain.nn`), an optimizer step is a handful of whole-model vector operations, with no loop over layers.
The update rules follow PyTorch's ``torch.optim.SGD`` and ``torch.optim.Adam`` (L2 weight decay added to the
gradient), so results can be compared with it.

SGD with momentum ``mu``, weight decay ``wd``, learning rate ``lr``::

    g = grad + wd * w
    v = g                   (first step)        v = mu * v + g     (later steps)
    w = w - lr * v

Adam with ``beta1``, ``beta2``, ``eps`` at step ``t``::

    g = grad + wd * w
    m = beta1 * m + (1 - beta1) * g            v = beta2 * v + (1 - beta2) * g^2
    w = w - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

Optimizer state (momentum, Adam moments) is flat too: one array per kind, the size of the model. A sharded
optimizer (ZeRO-style) later only has to keep a slice of it.
"""

from __future__ import annotations

import abc
import math

import numpy as np

from dtrain.backend import array_module, to_device, to_host


class Optimizer(abc.ABC):
    """Holds the flat parameter and gradient buffers of a model (or any two equal 1-D arrays)."""

    def __init__(self, model=None, *, params=None, grads=None, lr: float):
        if model is not None:
            params, grads = model.flat_params, model.flat_grads
        if params is None or grads is None:
            raise ValueError("give a model (with flat buffers) or both params= and grads=")
        if params.shape != grads.shape or params.ndim != 1:
            raise ValueError(f"params and grads must be equal 1-D buffers, got {params.shape} and {grads.shape}")
        if not lr > 0 or not math.isfinite(lr):
            raise ValueError(f"the learning rate must be a positive number, got {lr}")
        self.params, self.grads, self.lr = params, grads, float(lr)
        self.xp = array_module(params)
        self.steps = 0

    @abc.abstractmethod
    def step(self) -> None:
        """Update ``params`` in place from ``grads``."""

    def state_dict(self) -> dict:
        state = {"steps": self.steps, "lr": self.lr}
        state.update({name: to_host(buf).copy() for name, buf in self._buffers().items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.lr = int(state["steps"]), float(state["lr"])
        for name, buf in self._buffers().items():
            buf[...] = to_device(state[name], self.xp)

    def _buffers(self) -> dict:
        return {}


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum and L2 weight decay."""

    def __init__(self, model=None, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **buffers):
        super().__init__(model, lr=lr, **buffers)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 0 <= weight_decay < math.inf:  # also refuses NaN
            raise ValueError(f"weight decay must be a finite number >= 0, got {weight_decay}")
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.velocity = self.xp.zeros_like(self.params) if momentum else None
        self._scratch = self.xp.empty_like(self.params)

    def step(self) -> None:
        xp, w, g = self.xp, self.params, self.grads
        if self.weight_decay:
            g = xp.add(g, self.weight_decay * w, out=self._scratch)  # keep the user's gradient untouched
        if self.velocity is not None:
            if self.steps == 0:
                self.velocity[...] = g
            else:
                self.velocity *= self.momentum
                self.velocity += g
            g = self.velocity
        w -= xp.multiply(g, self.lr, out=self._scratch)
        self.steps += 1

    def _buffers(self) -> dict:
        return {"velocity": self.velocity} if self.velocity is not None else {}


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with bias correction and optional L2 weight decay."""

    def __init__(
        self,
        model=None,
        *,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **buffers,
    ):
        super().__init__(model, lr=lr, **buffers)
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"Adam betas must be in [0, 1), got {betas}")
        if not 0 <= weight_decay < math.inf:  # also refuses NaN
            raise ValueError(f"weight decay must be a finite number >= 0, got {weight_decay}")
        if not 0 < eps < math.inf:
            raise ValueError(f"Adam's eps must be a small positive number (1e-8 is usual), got {eps}")
        self.beta1, self.beta2, self.eps, self.weight_decay = (
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
        )
        self.m = self.xp.zeros_like(self.params)
        self.v = self.xp.zeros_like(self.params)
        self._scratch = self.xp.empty_like(self.params)

    def step(self) -> None:
        xp, w, g, tmp = self.xp, self.params, self.grads, self._scratch
        if self.weight_decay:
            g = xp.add(g, self.weight_decay * w, out=tmp)
        self.steps += 1
        self.m *= self.beta1
        self.m += (1 - self.beta1) * g
        self.v *= self.beta2
        self.v += (1 - self.beta2) * (g * g)
        bias1 = 1 - self.beta1**self.steps
        bias2 = 1 - self.beta2**self.steps
        # w -= lr/bias1 * m / (sqrt(v)/sqrt(bias2) + eps), written to reuse one scratch buffer
        xp.sqrt(self.v, out=tmp)
        tmp *= 1.0 / math.sqrt(bias2)
        tmp += self.eps
        xp.divide(self.m, tmp, out=tmp)
        tmp *= self.lr / bias1
        w -= tmp

    def _buffers(self) -> dict:
        return {"m": self.m, "v": self.v}


OPTIMIZERS = {"sgd": SGD, "adam": Adam}


class FlatBuffers:
    """What an optimizer steps: a flat parameter buffer and its gradient, a whole model's or a slice of them (a
    parameter server's shard, a ZeRO rank's chunk of a layer)."""

    def __init__(self, params, grads):
        self.flat_params, self.flat_grads = params, grads


def state_bytes(optimizer) -> int:
    """The bytes of the optimizer's flat buffers (its state that grows with the parameters)."""
    return sum(v.nbytes for v in optimizer.state_dict().values() if isinstance(v, np.ndarray))


def buffer_names(name: str, momentum: float) -> list[str]:
    """The flat buffers as large as the parameters that the optimizer keeps, by the names its ``state_dict`` gives
    them, sorted: SGD's velocity (with momentum), Adam's two moments. A resume checks a checkpoint against them."""
    return {"sgd": ["velocity"] if momentum else [], "adam": ["m", "v"]}[name]


def buffers_per_parameter(name: str, momentum: float) -> int:
    """How many flat buffers as large as the parameters the optimizer keeps (the cost functions count optimizer
    state with it)."""
    return len(buffer_names(name, momentum))


def make_optimizer(name: str, model, lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> Optimizer:
    """The optimizer called ``name`` ("sgd" or "adam") over ``model``'s flat buffers."""
    if name == "sgd":
        return SGD(model, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return Adam(model, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")

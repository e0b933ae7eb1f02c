"""A reverse-mode automatic differentiation engine over NumPy/CuPy arrays.

A :class:`Tensor` wraps an array (``.data``) and, when it takes part in a computation that needs gradients,
remembers the tensors it was made from (its *parents*) and how to send a gradient back to them (its ``_backward``
function). ``loss.backward()`` then walks this graph once, from the loss to the leaves, in reverse topological
order, and applies the chain rule at every node::

      x ──┐
          @ ── h ── + ── z ── relu ── a ── ... ── loss
      W ──┘         │
      b ────────────┘

    forward:  each op computes its output and records a closure over what its backward will need
    backward: loss.grad = 1; for each node, latest first: parents' grads += local Jacobian^T · node's grad

Three details matter for what comes later in dtrain:

* **Broadcasting.** ``h + b`` adds a bias of shape ``(n,)`` to every row of ``h`` of shape ``(batch, n)``. The
  gradient flowing back to ``b`` has shape ``(batch, n)`` and must be summed over the broadcast axis
  (:func:`unbroadcast`), otherwise shapes (or worse, values) are wrong.
* **Gradients accumulate** into a leaf's ``.grad`` (``+=``, in place), so a parameter used twice gets the sum, and
  a parameter whose ``.grad`` is a view into a flat buffer (see :mod:`dtrain.nn`) stays a view.
* **Gradient-ready hooks.** :meth:`Tensor.register_hook` on a leaf runs a function the moment that leaf's gradient
  for this backward pass is *complete*: when every node that used the leaf has sent its contribution. Data-parallel
  training uses it to start all-reducing the last layer's gradients while backward is still busy with earlier
  layers (overlap of communication with computation, as PyTorch DDP does). The engine knows when a gradient is
  complete because, before walking the graph, it counts how many contributions each tensor will receive.

Gradients are computed only along paths that lead to a tensor with ``requires_grad=True``: the input batch needs
no gradient, so ``x @ W`` never computes ``dL/dx`` (the first layer's most expensive product).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from dtrain.backend import array_module

# The grad mode belongs to a thread, as in PyTorch: the simulator's ranks (dtrain.comm.sim) are threads, and one
# rank evaluating under no_grad must not switch off the graph of another rank that is in the middle of a forward.
_mode = threading.local()


def is_grad_enabled() -> bool:
    return getattr(_mode, "enabled", True)


class no_grad:
    """Context manager that builds no graph (evaluation, optimizer updates), in the current thread."""

    def __enter__(self):
        self._previous, _mode.enabled = is_grad_enabled(), False

    def __exit__(self, *exc):
        _mode.enabled = self._previous


class Tensor:
    """An array with an optional gradient and the recipe to compute it."""

    __slots__ = ("_backward", "_hooks", "_parents", "data", "grad", "name", "requires_grad")

    def __init__(self, data, requires_grad: bool = False, name: str = ""):
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad
        self.name = name
        self._parents: tuple[Tensor, ...] = ()
        self._backward: Callable | None = None  # maps this node's grad to one gradient per parent
        self._hooks: list[Callable[[Tensor], None]] = []

    # ----------------------------------------------------------------- basics
    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def is_leaf(self) -> bool:
        return self._backward is None

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{grad})"

    def zero_grad(self) -> None:
        """Zero the gradient in place (keeps a view into a flat gradient buffer a view)."""
        if self.grad is not None:
            self.grad[...] = 0

    def register_hook(self, hook: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
        """Call ``hook(self)`` as soon as this leaf's gradient is complete during each ``backward``."""
        if not self.is_leaf:
            raise ValueError("hooks are for leaf tensors (parameters); this tensor is the output of an op")
        self._hooks.append(hook)
        return hook

    def detach(self) -> Tensor:
        return Tensor(self.data)

    # ---------------------------------------------------------- graph building
    @staticmethod
    def _make(data, parents: tuple[Tensor, ...], backward: Callable) -> Tensor:
        """The output of an op: it joins the graph only if some parent needs a gradient."""
        out = Tensor(data)
        if is_grad_enabled() and any(p.requires_grad for p in parents):
            out.requires_grad = True
            out._parents = parents
            out._backward = backward
        return out

    # ------------------------------------------------------------- operations
    def __matmul__(self, other) -> Tensor:
        other = _as_tensor(other, self)  # a plain array is a constant: no gradient flows to it
        a, b = self.data, other.data

        def backward(g):  # skipped (None) for a parent that needs no gradient
            return matmul_backward(g, a, b, need_a=self.requires_grad, need_b=other.requires_grad)

        return Tensor._make(a @ b, (self, other), backward)

    def __add__(self, other) -> Tensor:
        other = _as_tensor(other, self)
        return Tensor._make(
            self.data + other.data,
            (self, other),
            lambda g: (_summed_back(g, self), _summed_back(g, other)),
        )

    __radd__ = __add__

    def __sub__(self, other) -> Tensor:
        other = _as_tensor(other, self)

        def backward(g):
            gb = _summed_back(g, other)
            return _summed_back(g, self), (None if gb is None else -gb)

        return Tensor._make(self.data - other.data, (self, other), backward)

    def __rsub__(self, other) -> Tensor:
        return _as_tensor(other, self) - self

    def __neg__(self) -> Tensor:
        return Tensor._make(-self.data, (self,), lambda g: (-g,))

    def __mul__(self, other) -> Tensor:
        if not isinstance(other, Tensor):
            if np.ndim(other) == 0:  # a Python or NumPy scalar: no broadcasting bookkeeping needed
                # As a Python float it keeps self's dtype: NumPy 2 turns float32 * np.float64(2) into float64.
                other = float(other)
                return Tensor._make(self.data * other, (self,), lambda g: (g * other,))
            other = _as_tensor(other, self)  # an array may broadcast self: its gradient must be summed back
        a, b = self.data, other.data
        return Tensor._make(
            a * b,
            (self, other),
            lambda g: (
                unbroadcast(g * b, a.shape) if self.requires_grad else None,
                unbroadcast(g * a, b.shape) if other.requires_grad else None,
            ),
        )

    __rmul__ = __mul__

    def __truediv__(self, scalar) -> Tensor:
        if isinstance(scalar, Tensor):
            raise TypeError("division is by a scalar only (that is all an MLP and its loss need)")
        return self * (1.0 / scalar)

    def relu(self) -> Tensor:
        x = self.data
        return Tensor._make(array_module(x).maximum(x, 0), (self,), lambda g: (g * (x > 0),))

    def tanh(self) -> Tensor:
        y = array_module(self.data).tanh(self.data)
        return Tensor._make(y, (self,), lambda g: (g * (1 - y * y),))

    def sum(self, axis=None, keepdims: bool = False) -> Tensor:
        xp, shape = array_module(self.data), self.shape

        def backward(g):
            if axis is not None and not keepdims:  # put the summed axes back so g broadcasts to the input
                g = xp.expand_dims(g, axis)
            return (xp.broadcast_to(g, shape),)

        return Tensor._make(self.data.sum(axis=axis, keepdims=keepdims), (self,), backward)

    def mean(self, axis=None, keepdims: bool = False) -> Tensor:
        count = self.data.size if axis is None else int(np.prod([self.shape[a] for a in np.atleast_1d(axis)]))
        return self.sum(axis=axis, keepdims=keepdims) * (1.0 / count)

    def reshape(self, *shape) -> Tensor:
        original = self.shape
        return Tensor._make(self.data.reshape(*shape), (self,), lambda g: (g.reshape(original),))

    def log_softmax(self, axis: int = -1) -> Tensor:
        """``x - logsumexp(x)``, computed after subtracting the row maximum so ``exp`` cannot overflow."""
        xp, x = array_module(self.data), self.data
        shifted = x - x.max(axis=axis, keepdims=True)
        out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))

        def backward(g):
            # d log_softmax: g - softmax * sum(g)
            return (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),)

        return Tensor._make(out, (self,), backward)

    # ------------------------------------------------------------- backward
    def backward(self, grad=None) -> None:
        """Send gradients from this tensor to every leaf that requires one, accumulating into ``leaf.grad``."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad (no parameter in its graph)")
        xp = array_module(self.data)
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError("backward() without a gradient needs a scalar (one-element) tensor")
            grad = xp.ones_like(self.data)

        order = self._topological_order()
        # How many gradient contributions each node will receive: a leaf's gradient is complete, and its
        # hooks may fire, when this count reaches zero.
        pending = {}
        for node in order:
            for parent in node._parents:
                if parent.requires_grad:
                    pending[id(parent)] = pending.get(id(parent), 0) + 1

        grads = {id(self): grad}  # gradients of non-leaf nodes, dropped as soon as they have been used
        for node in reversed(order):
            g = grads.pop(id(node), None)
            if node.is_leaf:
                continue  # leaves were accumulated as their contributions arrived
            for parent, parent_grad in zip(node._parents, node._backward(g)):
                if not parent.requires_grad:
                    continue
                if parent.is_leaf:
                    if parent_grad is not None:
                        _accumulate(parent, parent_grad)
                    pending[id(parent)] -= 1
                    if pending[id(parent)] == 0:
                        for hook in parent._hooks:
                            hook(parent)
                elif parent_grad is None:
                    continue
                elif id(parent) in grads:
                    grads[id(parent)] = grads[id(parent)] + parent_grad
                else:
                    grads[id(parent)] = parent_grad
        if self.is_leaf:  # backward() on a leaf itself: its gradient is the seed
            _accumulate(self, grad)
            for hook in self._hooks:
                hook(self)

    def _topological_order(self) -> list[Tensor]:
        """Nodes that need a gradient, each after all of its parents (iterative DFS: deep graphs don't recurse)."""
        order, visited, stack = [], set(), [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in visited:
                continue
            visited.add(id(node))
            stack.append((node, True))
            stack.extend((p, False) for p in node._parents if p.requires_grad and id(p) not in visited)
        return order


def matmul_backward(grad, a, b, need_a: bool = True, need_b: bool = True):
    """The backward rule of ``C = A @ B``: from ``grad`` = dL/dC (shape (m, n)), with ``a`` of shape (m, k) and ``b``
    of shape (k, n), return ``(grad_a, grad_b)`` = (dL/dA, dL/dB) = ``(grad @ b.T, a.T @ grad)``, of the shapes of
    ``a`` and ``b``. Each C[i, j] = sum_t A[i, t] B[t, j], so A[i, t] reaches the loss through row i of C, weighted by
    row t of B, and B[t, j] through column j of C, weighted by column t of A. ``need_a``/``need_b`` False: that
    gradient is not computed (None), as the engine does for an input that needs none (the batch of a first layer)."""
    grad_a = grad @ b.T if need_a else None
    grad_b = a.T @ grad if need_b else None
    return grad_a, grad_b


def softmax_cross_entropy(logits: Tensor, labels) -> Tensor:
    """Mean cross-entropy of integer ``labels`` under ``softmax(logits)``, fused into one numerically stable op.

    Forward: ``loss = mean_i(logsumexp(z_i) - z_i[y_i])`` with the row maximum subtracted before ``exp``.
    Backward: ``dL/dz = (softmax(z) - onehot(y)) / batch``, one subtraction instead of the chain
    log_softmax → pick → mean, which is both faster and exact.
    """
    xp, z = array_module(logits.data), logits.data
    if z.ndim != 2:
        raise ValueError(f"logits must be (batch, classes), got shape {z.shape}")
    labels = xp.asarray(labels)
    if labels.shape != (z.shape[0],):
        raise ValueError(f"labels must have shape ({z.shape[0]},) to match the logits, got {labels.shape}")
    batch = z.shape[0]
    rows = xp.arange(batch)
    shifted = z - z.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    sum_exp = exp.sum(axis=1, keepdims=True)
    loss = (xp.log(sum_exp[:, 0]) - shifted[rows, labels]).mean()

    def backward(g):
        dz = exp / sum_exp
        dz[rows, labels] -= 1
        dz *= g / batch
        return (dz,)

    return Tensor._make(xp.asarray(loss, dtype=z.dtype), (logits,), backward)


def activation_bytes(output: Tensor) -> int:
    """Bytes of the intermediate results that ``output``'s graph keeps alive until its backward: the ``data`` of every
    non-leaf tensor in it, ``output`` included. This is a forward pass's *activation memory*, the part of training
    memory that grows with the batch (parameters, gradients and optimizer state do not). Not counted: the input batch,
    and the few arrays an op's backward closure makes for itself (softmax's probabilities). Each array counts once: an
    op that hands its input on as its output (tensor parallelism's ``f``, an all-reduce made in place) keeps nothing
    new, and an array a leaf holds (a pipeline stage's received input) is not an intermediate result."""
    order = output._topological_order()
    leaves = {id(node.data) for node in order if node.is_leaf}
    kept = {id(node.data): node.data.nbytes for node in order  # (an array released already is kept by nobody)
            if not node.is_leaf and node.data is not None and id(node.data) not in leaves}  # fmt: skip
    return sum(kept.values())


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes along which an input of ``shape`` was broadcast, returning that shape."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(i + extra for i, n in enumerate(shape) if n == 1 and grad.shape[i + extra] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape)


def _summed_back(grad, parent: Tensor):
    """``grad`` summed to ``parent``'s shape, or None when ``parent`` needs no gradient (nothing is computed)."""
    return unbroadcast(grad, parent.shape) if parent.requires_grad else None


def _as_tensor(value, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value
    return Tensor(array_module(like.data).asarray(value, dtype=like.dtype))


def _accumulate(leaf: Tensor, grad) -> None:
    """``leaf.grad += grad`` in place, so a gradient that is a view into a flat buffer stays one."""
    if leaf.grad is None:
        leaf.grad = array_module(grad).array(grad, dtype=leaf.dtype, copy=True)
    else:
        leaf.grad += grad

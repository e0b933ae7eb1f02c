"""Exercises 7.1 and 7.2 (lesson 7): Megatron-LM's two conjugate operators, f and g, as autograd ops.

Check them: dtrain exercises check 7.1 --path ex
            dtrain exercises check 7.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).

A column-then-row block of tensor parallelism (lessons/07_tensor_parallel.py draws it) on rank t of a group of T::

    X ──f──> X A_t ── relu ── H_t ── H_t B_t ──g──> sum_t H_t B_t ── + b ── Z   (Z the same on every rank)

needs exactly one all-reduce forward (in g: the sum of the T partial products) and one backward (in f: the input's
gradient ``dX = sum_t dY_t A_t^T`` is a sum of T partial products too).

Both build their output with ``Tensor._make(data, parents, backward)`` from dtrain/autograd.py: ``data`` is the
output's array, ``parents`` the tuple ``(x,)``, and ``backward(grad)`` receives the gradient of the output (an array
of its shape) and returns a tuple with one gradient per parent: ``(gradient_for_x,)``.

The sum over the group: ``group.allreduce(array, label)`` sums ``array`` (a C-contiguous NumPy array of this rank's
own) over the ranks of the group *in place* and returns it (``label`` names the traffic in a trace: pass
"tp/f-backward" or "tp/g-forward"). It calls ``dtrain.collectives.allreduce(group.comm, array, "sum")``; you may
call that yourself. ``group.comm`` is the communicator, ``group.size`` T, ``group.rank`` t.
"""

from dtrain.autograd import Tensor  # noqa: F401  (you will want it)


def f(x, group):
    """Megatron's f: the identity forward, an all-reduce (sum) of the gradient backward.

    Signature: ``f(x, group) -> Tensor``. ``x`` is a :class:`dtrain.autograd.Tensor` (the block's input, the same on
    every rank of the group); ``group`` is a :class:`dtrain.parallel.tensor_parallel.TensorGroup` (see above).

    Forward:  return a new Tensor whose data is ``x.data`` as it is, with ``x`` as its parent. Send nothing.
    Backward: rank t receives the gradient of its own copy of the output (``dY_t A_t^T``, different on every rank);
              x's gradient is the sum of them over the group, the same on every rank.

    Hint: the ``grad`` that backward receives may be used elsewhere in the graph: sum a copy of it (``grad.copy()``),
    not the array itself.
    """
    raise NotImplementedError("exercise 7.1: Megatron's f — see lessons/07_tensor_parallel.py")


def g(x, group):
    """Megatron's g: an all-reduce (sum) forward, the identity backward.

    Signature: ``g(x, group) -> Tensor``. ``x`` is a :class:`dtrain.autograd.Tensor`: this rank's partial product
    (``H_t B_t``), different on every rank; ``group`` is a :class:`dtrain.parallel.tensor_parallel.TensorGroup`.

    Forward:  return a new Tensor whose data is the sum of ``x.data`` over the group (the same on every rank), with
              ``x`` as its parent.
    Backward: the gradient of the output is already the same on every rank (everything after g is computed alike
              on all of them): pass it to x unchanged. Send nothing.

    Hint: sum a copy (``x.data.copy()``) if you want to keep ``x.data`` as it was; the backward is one line.
    """
    raise NotImplementedError("exercise 7.2: Megatron's g — see lessons/07_tensor_parallel.py")

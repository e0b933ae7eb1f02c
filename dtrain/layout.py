"""Where an MLP's parameters live in its one flat buffer: the layout every paradigm and every cost function reads.

A dtrain model keeps all its parameters in one contiguous buffer (``model.flat_params``, made by
:meth:`dtrain.nn.Module.flatten_`), layer after layer, each layer's weight (inputs x outputs, row-major) and then its
bias; the gradients (``model.flat_grads``) and the optimizer's buffers follow the same layout::

    sizes = [784, 128, 10]
    flat    [ W0: 784 x 128 = 100,352 | b0: 128 | W1: 128 x 10 = 1,280 | b1: 10 ]       101,770 numbers
    offset    0                         100,352   100,480                 101,760

Everything here comes from the widths alone (no model, no ranks), so the cost functions can lay out a model that is
never built. A paradigm's slice of the buffer (a server's shard, a ZeRO rank's chunk of a layer, a DDP bucket, a
pipeline stage's region) is cut from these offsets.
"""

from __future__ import annotations

import itertools


def spans(counts) -> list[tuple[int, int]]:
    """``(offset, count)`` of each of ``counts`` laid end to end from 0."""
    counts = list(counts)
    return list(zip(itertools.accumulate(counts, initial=0), counts))


def parameter_shapes(sizes) -> list[tuple[int, ...]]:
    """The shape of every parameter of an MLP of widths ``sizes``, in flat-buffer order: (a, b) weights, (b,) biases."""
    return [shape for a, b in itertools.pairwise(sizes) for shape in ((a, b), (b,))]


def parameter_spans(sizes) -> list[tuple[int, int]]:
    """``(offset, count)`` of every parameter of an MLP of widths ``sizes``, in flat-buffer order (W0, b0, W1, ...)."""
    return spans(count for a, b in itertools.pairwise(sizes) for count in (a * b, b))


def layer_sizes(sizes) -> list[int]:
    """The parameters of each Linear layer (its weight and its bias)."""
    return [a * b + b for a, b in itertools.pairwise(sizes)]


def layer_starts(sizes) -> list[int]:
    """Where each layer's parameters start, and (last) the total: layer l is ``flat[starts[l]:starts[l + 1]]``."""
    return list(itertools.accumulate(layer_sizes(sizes), initial=0))


def parameter_count(sizes) -> int:
    """Parameters of an MLP with layer widths ``sizes`` (weights and biases)."""
    return sum(layer_sizes(sizes))

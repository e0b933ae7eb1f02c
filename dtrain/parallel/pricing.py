"""The price of a step: the sizing and timing arithmetic that several paradigms' cost functions share.

Each paradigm prices itself, in the last section of its own file ("the price"): ``costs()`` (the bytes each rank
sends per step and holds, held against the tracer's counts by the tests), ``step_time()`` (seconds on some hardware,
:mod:`dtrain.plan.hardware`) and ``activations()``. What more than one of them needs lives here, once:

* :func:`replica_compute`: the seconds of a whole replica's forward, backward and update on its slice of the batch;
* :func:`activation_elements`: what one micro-batch through some Linear layers keeps for backward;
* :func:`local_parameters`, :func:`activations_sent`: what a rank of a tensor group holds, and the activations its
  group all-reduces (tensor parallelism's, and a pipeline stage's that is tensor-parallel);
* :func:`group_allreduce_bytes`: the bytes a rank sends in all-reduces over a group, the algorithm as the front door
  would choose it;
* :func:`bucket_counts`: the elements of each of ddp's gradient buckets (post-local SGD's warm-up steps too).

Nothing here runs a collective or holds a model: plain numbers from the layers' sizes, the world and the flags.
"""

from __future__ import annotations

import itertools

from dtrain.backend import itemsize
from dtrain.collectives import costmodel
from dtrain.layout import parameter_count, parameter_spans
from dtrain.optim import buffers_per_parameter
from dtrain.parallel.buckets import bucket_bytes, plan_buckets
from dtrain.parallel.placement import split


def replica_compute(kind, sizes, world: int, config, hardware, updated: float | None = None) -> float:
    """Seconds of a whole replica's forward and backward on the slice of the batch the paradigm ``kind`` gives a
    rank (in --accumulate micro-batches), and an update of ``updated`` parameters (default: all of them), on
    ``hardware`` with ``world`` ranks busy."""
    rows, k = config.batch_size // kind.shard_of(0, world, config)[1], config.accumulate
    n, b = parameter_count(sizes) if updated is None else updated, itemsize(config.dtype)
    update = hardware.update_time(n, b, buffers_per_parameter(config.optimizer, config.momentum))
    return hardware.slowdown(world) * (k * hardware.layers_time(list(itertools.pairwise(sizes)), rows // k, b)
                                       + update)  # fmt: skip


def activation_elements(sizes, first: int, stop: int, rows: int, tp: int) -> int:
    """The intermediate results one forward of ``rows`` samples through Linear layers [first, stop) keeps for its
    backward (as :func:`dtrain.autograd.activation_bytes` counts them), in elements: per layer the product and the
    bias added (a column layer's are 1/tp as wide; f and the in-place g keep nothing new), the activation after it
    but the model's last, and the loss after the last layer."""
    last = len(sizes) - 2
    elements = 0
    for j, kind in zip(range(first, stop), split(stop - first)):
        width = sizes[j + 1] // tp if kind == "column" else sizes[j + 1]
        elements += rows * width * (2 if j == last else 3)
    return elements + (1 if stop == last + 1 else 0)


def local_parameters(sizes, tp: int, first: int = 0, stop: int | None = None) -> int:
    """Parameters one rank of a tensor group of ``tp`` holds of Linear layers [first, stop) of an MLP ``sizes``."""
    stop = len(sizes) - 1 if stop is None else stop
    held = {"column": lambda i, o: (i * o + o) // tp, "row": lambda i, o: i * o // tp + o,
            "replicated": lambda i, o: i * o + o}  # fmt: skip
    return sum(held[kind](sizes[j], sizes[j + 1]) for j, kind in zip(range(first, stop), split(stop - first)))


def activations_sent(sizes, first: int, stop: int, rows: int) -> tuple[list[int], list[int]]:
    """The elements of each all-reduce a tensor group makes on a micro-batch of ``rows`` through Linear layers
    [first, stop): (g's in forward, f's in backward). Backward skips f when the block's input is the data batch."""
    forward, backward = [], []
    for j, kind in zip(range(first, stop), split(stop - first)):
        if kind == "row":
            forward.append(rows * sizes[j + 1])
        elif kind == "column" and j > 0:
            backward.append(rows * sizes[j])
    return forward, backward


def group_allreduce_bytes(algorithm: str, counts, itemsize: int, size: int, rank: int, ranks_per_node=None) -> int:
    """Bytes ``rank`` sends in all-reduces of ``counts`` elements on a group of ``size`` (the front door's choice of
    algorithm for "auto", per size, as the cost model makes it; ``ranks_per_node``: the hierarchical ones' nodes)."""
    if size == 1:
        return 0
    total = 0
    for count in counts:
        chosen = costmodel.choose(count * itemsize, size) if algorithm == "auto" else algorithm
        total += costmodel.bytes_sent(chosen, count, itemsize, size, rank, ranks_per_node)
    return total


def bucket_counts(sizes, config) -> list[int]:
    """The elements of each gradient bucket of an MLP ``sizes`` under ``--bucket-mb`` (:func:`plan_buckets` on the
    parameters' places in the flat buffer), in the order they are all-reduced."""
    b = itemsize(config.dtype)
    plan = plan_buckets([(offset, n, b) for offset, n in parameter_spans(sizes)], bucket_bytes(config))
    return [stop - start for start, stop, _ in plan]

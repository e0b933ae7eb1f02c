"""Where a pipeline cuts a model: contiguous stages of Linear layers, balanced by parameter count.

Every micro-batch passes through every stage, so a pipeline moves at the pace of its slowest stage, and the cut
should make the largest stage as small as it can be. For a Linear layer of a x b weights, forward costs about
2 rows a b floating-point operations and backward 4 rows a b, so a stage's compute is proportional to its parameters
(up to the biases and the element-wise work): :func:`cut` finds, by dynamic programming over the layers, the
contiguous cut whose largest stage holds the fewest parameters::

    784-512-256-256-128-64-10 on 3 stages     layer 0: 401,920   1: 131,328   2: 65,792   3: 32,896   4: 8,256   5: 650
    cut [0, 1, 2, 6]                          stage 0: layer 0 (401,920)  1: layer 1 (131,328)  2: layers 2-5 (107,594)

(The first layer is over half the model: no cut makes a stage smaller than it.) Interleaving cuts into equal numbers
of units instead, Megatron's rule. With tensor parallelism a unit is a column-then-row *pair* of layers
(:func:`units`), so that every stage holds layers its tensor group can split.

:func:`check_cut` refuses a cut that cannot be made (with the flags that would make it), :func:`describe` prints
it; :func:`costs_per_rank` is the pipeline's cost as code: what each stage of the cut sends and holds, from the
schedule; :func:`step_time` its time on some hardware (tensor parallelism's too: a pipeline of one stage)::

    a micro-batch on pipeline rank q   t_q = its chunks' forward and backward on rows/M rows, their tensor group's
                                             all-reduces, and the activations and gradients it sends on
    a step                             M max_q t_q               every micro-batch at the slowest rank's pace
                                     + (sum_q t_q - max_q t_q)/V  the bubble: filling and draining the pipeline
                                     + the dp all-reduce of a stage's gradients and the update
"""

from __future__ import annotations

import itertools

from dtrain.backend import itemsize
from dtrain.errors import ConfigError
from dtrain.layout import layer_starts, parameter_count
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import schedules
from dtrain.parallel.placement import split
from dtrain.parallel.pricing import activation_elements, activations_sent, group_allreduce_bytes, local_parameters


def cut(sizes, stages: int, equal: bool = False, tp: int = 1) -> list[int]:
    """Boundaries ``[0, b_1, ..., L]`` of ``stages`` contiguous stages of the L Linear layers of an MLP ``sizes``:
    the cut whose largest stage (in parameters) is smallest, or (``equal``) as many units each. A unit is a layer, or
    with tensor parallelism (``tp`` > 1) a column-then-row pair (the last pair takes a layer left over)."""
    allowed = units(len(sizes) - 1, tp)  # the layer boundaries a cut may fall on
    prefix = layer_starts(sizes)
    weights = [prefix[b] - prefix[a] for a, b in itertools.pairwise(allowed)]
    n = len(weights)
    if equal:
        return [allowed[k * n // stages] for k in range(stages + 1)]
    total = list(itertools.accumulate(weights, initial=0))
    # best[k][j]: the smallest possible largest stage when units [0, j) make k stages; split[k][j]: where it cuts
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    split = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                load = max(best[k - 1][i], total[j] - total[i])
                if load < best[k][j]:
                    best[k][j], split[k][j] = load, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(split[k][bounds[-1]])
    return [allowed[u] for u in reversed(bounds)]


def units(layers: int, tp: int = 1) -> list[int]:
    """The boundaries between the units a pipeline cuts into: every layer, or with tensor parallelism every
    column-then-row pair of ``placement.split``, the last pair taking a leftover layer (5 layers: 0, 2, 5; one
    layer has no pair: [0], no unit at all)."""
    if tp == 1:
        return list(range(layers + 1))
    return [*range(0, layers - 1, 2), layers] if layers >= 2 else [0]


def hidden_for(count: int, tp: int, hidden) -> str:
    """The ``--hidden`` flag of a model with ``count`` units (:func:`units`), its widths those of ``hidden``'s first
    (64 when there is none): what a refusal suggests when a pipeline has more stages than the model has units."""
    layers = count if tp == 1 else 2 * count
    width = hidden[0] if hidden else 64
    return spelled([width] * (layers - 1))


def spelled(hidden) -> str:
    """``--hidden`` as a person reads it: every width, or, for many equal ones, how many of which."""
    if len(hidden) > 6 and len(set(hidden)) == 1:
        return f"--hidden {hidden[0]},{hidden[0]},...,{hidden[0]} ({len(hidden)} layers of {hidden[0]})"
    return f"--hidden {','.join(map(str, hidden)) or 'none'}"


def check_cut(hidden, shape, schedule: str, m: int, v: int) -> None:
    """A :class:`ConfigError` unless an MLP with ``hidden`` layers can be cut into ``shape.pp`` x ``v`` stages (each
    with a unit of its own; interleaved: as many units each) for ``schedule`` with ``m`` micro-batches."""
    layers, stages = len(hidden) + 1, shape.pp * v
    available = len(units(layers, shape.tp)) - 1
    what = f"{layers} Linear layers" if shape.tp == 1 else (
        f"{available} column-then-row pair(s) of Linear layers to split over --tp {shape.tp} (with tensor "
        "parallelism a pipeline cuts between pairs, so that every stage has layers to split)")  # fmt: skip
    given = spelled(hidden)
    if schedule == "interleaved":
        if v < 2 or shape.pp < 2:
            raise ConfigError(f"--schedule interleaved needs --virtual-stages >= 2 and --pp >= 2, got {v} and "
                              f"{shape.pp}")  # fmt: skip
        if available % stages:
            raise ConfigError(f"--pp {shape.pp} x --virtual-stages {v} = {stages} chunks do not divide the "
                              f"{what} ({given}): interleaving gives every chunk the same number; give "
                              f"{hidden_for(-(-available // stages) * stages, shape.tp, hidden)} or another "
                              "--virtual-stages")  # fmt: skip
        if m % shape.pp:
            raise ConfigError(f"--schedule interleaved needs --microbatches a multiple of --pp {shape.pp}, got {m}")
    elif v != 1:
        raise ConfigError(f"--virtual-stages {v} is for --schedule interleaved, not {schedule}")
    if stages > available:
        fewer = "--pp" if v == 1 else "--pp or --virtual-stages"
        raise ConfigError(f"{stages} pipeline stages but the model has {what} ({given}): every stage needs one; "
                          f"give {hidden_for(stages, shape.tp, hidden)}, or a smaller {fewer}")  # fmt: skip


# --- the cost as code: what each stage of the cut sends and holds ---------------------------------------------------
def costs_per_rank(sizes, world: int, shape, schedule: str, M: int, V: int, config) -> dict:
    """``Pipeline.costs``: per rank (lists), bytes sent per step, the bytes held of parameters, gradients and
    optimizer state, and the peak bytes of activations kept for backward (from the schedule)."""
    b, P = itemsize(config.dtype), shape.pp
    stages, rows = P * V, config.batch_size // (shape.dp * M)
    bounds = cut(sizes, stages, equal=schedule == "interleaved", tp=shape.tp)
    program = schedules.build(schedule, P, M, V)
    buffers = buffers_per_parameter(config.optimizer, config.momentum)

    def kept(v):  # one micro-batch's activations on stage v: its received input and its intermediate results
        first, stop = bounds[v], bounds[v + 1]
        received = rows * sizes[first] if v > 0 else 0
        return (received + activation_elements(sizes, first, stop, rows, shape.tp)) * b

    costs = {"sent_per_step": [], "parameters": [], "gradients": [], "optimizer": [], "activations": []}
    for rank in range(world):
        at = shape.coordinates(rank)
        mine = [v for v in range(stages) if v % P == at["pp"]]
        n = sum(local_parameters(sizes, shape.tp, bounds[v], bounds[v + 1]) for v in mine)
        sent = group_allreduce_bytes(config.allreduce, [n], b, shape.dp, at["dp"])
        for v in mine:
            first, stop = bounds[v], bounds[v + 1]
            sent += M * rows * sizes[stop] * b if v < stages - 1 else 0  # activations to the next stage
            sent += M * rows * sizes[first] * b if v > 0 else 0  # their gradients to the previous one
            forward, backward = activations_sent(sizes, first, stop, rows)
            sent += M * group_allreduce_bytes(config.allreduce, forward + backward, b, shape.tp, at["tp"])
        costs["sent_per_step"].append(sent)
        for kind, count in (("parameters", n), ("gradients", n), ("optimizer", buffers * n)):
            costs[kind].append(count * b)
        costs["activations"].append(schedules.in_flight(program[at["pp"]], kept))
    return costs


def step_time(sizes, world: int, shape, schedule: str, M: int, V: int, config, hardware) -> dict:
    """Seconds of one step of the replica the slowest pipeline rank is on: compute, communication and the bubble
    (the module docstring's formula); ``hardware``: :class:`dtrain.plan.hardware.Hardware`."""
    b, P, slow = itemsize(config.dtype), shape.pp, hardware.slowdown(world)
    stages, rows = P * V, config.batch_size // (shape.dp * M)
    bounds = cut(sizes, stages, equal=schedule == "interleaved", tp=shape.tp)
    tensor_group = [shape.rank_of(tp=t) for t in range(shape.tp)]
    per_rank = []  # (compute, communication) of one micro-batch on pipeline rank q
    for q in range(P):
        compute = send = 0.0
        for v in range(q, stages, P):
            first, stop = bounds[v], bounds[v + 1]
            shard = {"column": lambda a, c: (a, c // shape.tp), "row": lambda a, c: (a // shape.tp, c),
                     "replicated": lambda a, c: (a, c)}  # fmt: skip  # (a layer's local shape, by how it is split)
            layers = [shard[kind](sizes[j], sizes[j + 1]) for j, kind in zip(range(first, stop), split(stop - first))]
            compute += slow * hardware.layers_time(layers, rows, b)
            forward, backward = activations_sent(sizes, first, stop, rows)
            if shape.tp > 1:
                send += sum(hardware.allreduce(config.allreduce, n * b, tensor_group, world)
                            for n in forward + backward)  # fmt: skip
            here, after = shape.rank_of(pp=q), shape.rank_of(pp=(q + 1) % P)
            send += hardware.message(rows * sizes[stop] * b, here, after, world) if v < stages - 1 else 0.0
            send += hardware.message(rows * sizes[first] * b, here, shape.rank_of(pp=(q - 1) % P), world) if v else 0.0
        per_rank.append((compute, send))
    slowest = max(range(P), key=lambda q: sum(per_rank[q]))
    compute, send = per_rank[slowest]
    n = max(sum(local_parameters(sizes, shape.tp, bounds[v], bounds[v + 1]) for v in range(q, stages, P))
            for q in range(P))  # fmt: skip
    replicas = [shape.rank_of(dp=d, pp=slowest) for d in range(shape.dp)]
    update = slow * hardware.update_time(n, b, buffers_per_parameter(config.optimizer, config.momentum))
    data = hardware.allreduce(config.allreduce, n * b, replicas, world) if shape.dp > 1 else 0.0
    bubble = (sum(map(sum, per_rank)) - compute - send) / V
    return {"compute": M * compute + update, "communication": M * send + data, "bubble": bubble}


def describe(sizes, bounds, P: int, tp: int, schedule: str, M: int, V: int, rows: int) -> str:
    """The cut ``bounds`` of an MLP ``sizes`` over ``P`` pipeline ranks (``V`` chunks each, ``tp`` tensor ranks a
    stage) and the schedule of ``M`` micro-batches of ``rows``, as a pipeline prints them at the start."""
    parts = []
    for v in range(len(bounds) - 1):
        a, b = bounds[v], bounds[v + 1]
        widths, n = "-".join(map(str, sizes[a : b + 1])), parameter_count(sizes[a : b + 1])
        how = f" ({', '.join(split(b - a))} over {tp} tensor ranks)" if tp > 1 else ""
        parts.append(f"  stage {v} (pipeline rank {v % P}): layers {a}-{b - 1}, {widths}, {n:,} parameters{how}")
    rule = "equal layers per chunk" if V > 1 else "balanced by parameter count"
    head = (f"pipeline: {len(bounds) - 1} stages ({rule}), schedule {schedule}, {M} micro-batches of {rows}; bubble "
            f"(P-1)/(VM+P-1) = {schedules.bubble_formula(P, M, V):.3f}")  # fmt: skip
    return "\n".join([head, *parts])

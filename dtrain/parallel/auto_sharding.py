"""Auto-sharding in miniature (``--sharding auto``): try every valid layout, price each, keep the cheapest.

Alpa and XLA's auto-sharding choose a layout per tensor by solving an integer program over the graph's costs. An MLP
of a few layers on a mesh of one or two axes is small enough to search exhaustively: the batch split over one axis
or whole; every weight whole, split by rows, by columns, or both (over two axes), its bias following its columns.
Each candidate the rules accept (its dimensions divide) is run dry (shardings.dry_run: its collectives, its blocks,
its activations) and priced with the planner's model of this machine (:class:`dtrain.plan.hardware.Hardware`, the
step time ``dtrain plan`` prints for spmd); the cheapest that fits a rank's memory wins, and :func:`why` says what it
beat the runner-up by. Every rank runs the same search on the same numbers, so every rank finds the same layout.
"""

from __future__ import annotations

import functools
import itertools
import types

from dtrain import terminal
from dtrain.backend import itemsize
from dtrain.errors import ConfigError
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import mesh, shardings
from dtrain.parallel.layouts import spec

LIMIT = 3000  # layouts a search may price (a dry run each, about 3 ms): 3 layers on a mesh of two axes is 1,029


def candidates(sizes, axes) -> list[tuple[str, ...]]:
    """Every layout of the model as ``--shard`` words: the input's rows, then each weight's two dims (and bias)."""
    one = [None, *axes]
    weights = [(r, c) for r in one for c in one if r is None or r != c]
    inputs = [(r, None) for r in one]
    count = len(inputs) * len(weights) ** (len(sizes) - 1)
    if count > LIMIT:
        raise ConfigError(f"--sharding auto searches every layout, and this model on the mesh {','.join(axes)} has "
                          f"{count:,} ({len(weights)} per weight, {len(sizes) - 1} weights): more than the {LIMIT:,} "
                          "it prices; give --sharding dp, megatron, dp-megatron or fsdp, or --shard")  # fmt: skip
    found = []
    for rows, *laid in itertools.product(inputs, *[weights] * (len(sizes) - 1)):
        words = [f"input={spec(rows)}"]
        for j, dims in enumerate(laid, start=1):
            words += [f"w{j}={spec(dims)}", f"b{j}={spec(dims[1:])}"]
        found.append(tuple(words))
    return found


@functools.lru_cache(maxsize=64)
def ranking(sizes, world: int, mesh_text, batch: int, accumulate: int, dtype="float32", optimizer="sgd",
            momentum=0.9) -> list[tuple[float, tuple, dict]]:  # fmt: skip
    """(seconds per step, --shard words, step_time's parts) of every valid layout that fits, cheapest first."""
    from dtrain.plan.hardware import Hardware  # (the planner's model of this machine: its one upward reference)

    hardware, shape = Hardware.this(), mesh.parse(mesh_text, world)
    priced_as = types.SimpleNamespace(dtype=dtype, optimizer=optimizer, momentum=momentum, allreduce="auto")
    state = 2 + buffers_per_parameter(optimizer, momentum)  # (parameters, gradients, the optimizer's buffers)
    priced = []
    for words in candidates(sizes, shape.names):
        try:
            program = shardings.dry_run(sizes, world, mesh_text, words, "none", batch, accumulate, dtype)
        except ConfigError:  # a dimension its axis does not divide
            continue
        if state * program.parameters * itemsize(dtype) + program.activations > hardware.per_rank_memory(world):
            continue
        parts = shardings.step_time(program, world, priced_as, hardware)
        priced.append((parts["compute"] + parts["communication"], words, parts))
    if not priced:
        raise ConfigError(f"--sharding auto: no layout of this model divides over the mesh {shape} and fits")
    return sorted(priced, key=lambda item: item[0])


def choose(sizes, world: int, mesh_text, batch: int, accumulate: int, *priced_as) -> tuple[str, ...]:
    """The cheapest layout, as --shard words (every tensor named); ``priced_as``: dtype, optimizer, momentum."""
    return ranking(sizes, world, mesh_text, batch, accumulate, *priced_as)[0][1]


def why(sizes, world: int, mesh_text, batch: int, accumulate: int, *priced_as) -> str:
    """Which layout won, against the runner-up, in the planner's seconds."""
    ranked = ranking(sizes, world, mesh_text, batch, accumulate, *priced_as)
    best, words, parts = ranked[0]
    text = (f"--sharding auto priced {len(ranked)} valid layouts and chose {' '.join(words)}: "
            f"{best * 1e3:.2f} ms a step on the planner's model ({parts['compute'] * 1e3:.2f} computing, "
            f"{parts['communication'] * 1e3:.2f} communicating)")  # fmt: skip
    if all(w.endswith(("=_,_", "=_")) for w in words):
        text += "; it splits nothing: on this model every rank computing the whole step beats any communication"
    rivals = [r for r in ranked[1:] if r[0] != best]  # (the next price: layouts that tie, mirror images, are skipped)
    if rivals:
        second, other, theirs = rivals[0]
        text += (f"; the runner-up, {' '.join(other)}, {second * 1e3:.2f} ms ({theirs['compute'] * 1e3:.2f} "
                 f"computing, {theirs['communication'] * 1e3:.2f} communicating)")  # fmt: skip
    return terminal.paragraph(text + ".")

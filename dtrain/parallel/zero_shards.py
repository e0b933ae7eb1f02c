"""The bookkeeping under ZeRO (:mod:`dtrain.parallel.zero`): which chunk of each layer a rank owns, and what it holds.

A layer's parameters are one slice of the flat buffer (its weight, rows x cols, then its cols biases); ZeRO cuts that
slice into N chunks with :func:`dtrain.collectives.chunk_bounds`, the very cut the reduce-scatter and the all-gather
make, so rank r's chunk of a layer is exactly what a reduce-scatter of the layer's gradient leaves on rank r::

    flat buffer   [ W0 b0 ............ | W1 b1 ...... | W2 b2 ]      three layers (Units)
    N = 3 chunks  [ r0   | r1   | r2   | r0 | r1 | r2 | r0|r1|r2]   rank r owns chunk r of every layer

:class:`Ledger` counts the bytes a rank holds of each kind as it allocates and frees them: the accounting that
``Zero.costs`` (:func:`costs_per_rank`, the cost as code) is held against (not the process's RSS, which also counts
Python, NumPy and MPI); :func:`paper_formula` is the ZeRO paper's table, for comparison; :func:`communication_time`
prices a step's collectives for the planner.
"""

from __future__ import annotations

import dataclasses
import itertools

from dtrain.backend import itemsize
from dtrain.collectives import chunk_bounds, costmodel
from dtrain.errors import ConfigError
from dtrain.layout import layer_starts
from dtrain.optim import buffers_per_parameter

KINDS = ("parameters", "gradients", "optimizer")
PAIRS = {"ring": ("ring", "ring"), "rabenseifner": ("rabenseifner", "doubling"), "shm": ("shm", "shm")}  # (RS, AG)


@dataclasses.dataclass(frozen=True)
class Unit:
    """Layer ``index``'s parameters: ``flat[start:start + size]`` (a rows x cols weight, then cols biases), and this
    rank's chunk of them, ``[lo, hi)`` relative to ``start``."""

    index: int
    start: int
    rows: int
    cols: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.rows * self.cols + self.cols

    @property
    def whole(self) -> slice:
        return slice(self.start, self.start + self.size)

    @property
    def own(self) -> slice:
        return slice(self.start + self.lo, self.start + self.hi)

    def weight(self, flat):
        """The weight matrix in ``flat``, one layer's parameters (or gradients)."""
        return flat[: self.rows * self.cols].reshape(self.rows, self.cols)

    def bias(self, flat):
        return flat[self.rows * self.cols :]


def units_of(sizes, rank: int, world: int) -> list[Unit]:
    """The layers of an MLP with widths ``sizes``, in flat-buffer order, each with ``rank``'s chunk of ``world``."""
    units = []
    for index, ((rows, cols), start) in enumerate(zip(itertools.pairwise(sizes), layer_starts(sizes))):
        lo, hi = chunk_bounds(rows * cols + cols, world)[rank]
        units.append(Unit(index, start, rows, cols, lo, hi))
    return units


class Ledger:
    """The bytes this rank holds for training, by kind (:data:`KINDS`): now, at the peak, and (after
    :meth:`start_recording`) after every change, for drawing a step's memory over time."""

    def __init__(self):
        self.now = dict.fromkeys(KINDS, 0)
        self.peak = dict.fromkeys(KINDS, 0)
        self.history = None  # [(what happened, {kind: bytes held after it}), ...] while recording

    def hold(self, kind: str, nbytes: int, what: str = "") -> None:
        self.now[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.now[kind])
        self._record(what or f"+{kind}")

    def free(self, kind: str, nbytes: int, what: str = "") -> None:
        self.now[kind] -= nbytes
        self._record(what or f"-{kind}")

    def start_recording(self) -> None:
        self.history = [("start", dict(self.now))]

    def _record(self, what: str) -> None:
        if self.history is not None:
            self.history.append((what, dict(self.now)))


class UnitOptimizers:
    """One optimizer per layer, each over this rank's chunk of it (the update is elementwise: chunk by chunk it is
    exactly the update of the whole buffer)."""

    def __init__(self, parts):
        self.parts = parts

    def step(self) -> None:
        for part in self.parts:
            part.step()


def collective_pair(name: str, world: int) -> tuple[str, str]:
    """The (reduce-scatter, all-gather) algorithms that ``--allreduce name`` picks on ``world`` ranks. "auto": halving
    and doubling on a power-of-two N (log2 N steps each where the ring takes N - 1, for the same bytes), else the
    ring."""
    if name == "auto":
        name = "rabenseifner" if world > 1 and not world & (world - 1) else "ring"
    if name not in PAIRS:
        raise ConfigError(
            f"--allreduce {name} has no reduce-scatter/all-gather pair for zero: choose auto, ring, "
            "rabenseifner (recursive halving, then recursive doubling) or shm (shared memory, one node)"
        )
    if name == "rabenseifner" and world & (world - 1):
        raise ConfigError(f"--allreduce rabenseifner needs a power-of-two number of ranks, not {world}: use ring")
    return PAIRS[name]


# --- the cost as code ----------------------------------------------------------------------------------------------
def costs_per_rank(sizes, world: int, stage: int, pair: tuple[str, str], config) -> dict:
    """``Zero.costs``: per rank (lists), bytes sent per step and the peak bytes held of each kind (the table in
    zero.py's docstring); ``pair``: the (reduce-scatter, all-gather) algorithms."""
    b = itemsize(config.dtype)
    (rs, ag), a = pair, config.accumulate
    buffers = buffers_per_parameter(config.optimizer, config.momentum)
    layers = [u.size for u in units_of(sizes, 0, world)]
    n, largest = sum(layers), max(layers)
    bounds = [chunk_bounds(size, world) for size in layers]  # (once: per rank it would cost N times as much)

    def sent(collective, algorithm, rank):
        return sum(costmodel.bytes_sent(algorithm, size, b, world, rank, collective=collective) for size in layers)

    costs = {"sent_per_step": [], **{kind: [] for kind in KINDS}}
    for rank in range(world):
        scatter, gather = sent("reduce_scatter", rs, rank), sent("allgather", ag, rank)
        s = sum(hi - lo for lo, hi in (layer[rank] for layer in bounds))  # this rank's chunks
        per_step = {1: scatter + gather, 2: a * scatter + gather, 3: a * (scatter + 2 * gather)}
        costs["sent_per_step"].append(per_step[stage])
        costs["parameters"].append((n if stage < 3 else s + largest) * b)
        costs["gradients"].append((n if stage == 1 else s + largest) * b)
        costs["optimizer"].append(buffers * s * b)
    return costs


def paper_formula(n: int, world: int, stage: int, itemsize: int, buffers: int) -> dict:
    """The ZeRO paper's bytes per rank by kind, in dtrain's terms: ``n`` parameters of ``itemsize`` bytes, ``buffers``
    optimizer buffers (k), ``stage`` 0 for ddp. No layer in flight, chunks of n/N.

    The paper's formulas (mixed-precision Adam, a model of Psi parameters) are ``(2+2+K) Psi`` bytes for ddp, then
    ``2 Psi + 2 Psi + K Psi / N``, ``2 Psi + (2+K) Psi / N`` and ``(2+2+K) Psi / N``, with K = 12 (an fp32 master copy
    of the weights and Adam's two moments). dtrain trains in one precision of b bytes (4 in float32) and keeps no
    master copy, so Psi parameters cost Psi b for the weights, Psi b for the gradients and K = k b per parameter for
    the optimizer: ``(2+k) Psi b`` for ddp, ``2 Psi b + k Psi b / N``, ``Psi b + (1+k) Psi b / N`` and
    ``(2+k) Psi b / N``.
    """

    def state(sharded_from: int) -> float:  # the optimizer state is sharded from stage 1, gradients 2, parameters 3
        return n * itemsize / world if stage >= sharded_from else n * itemsize

    return {"parameters": state(3), "gradients": state(2), "optimizer": buffers * state(1)}


def communication_time(sizes, world: int, stage: int, pair: tuple[str, str], config, hardware) -> float:
    """``Zero.step_time``'s communication: each layer's reduce-scatter and all-gather, as often as the stage makes
    them (the table in zero.py's docstring), priced on ``hardware``."""
    b, a = itemsize(config.dtype), config.accumulate
    layers = [u.size * b for u in units_of(sizes, 0, world)]

    def each(collective, algorithm):
        return sum(hardware.collective(collective, algorithm, n, range(world), world) for n in layers)

    scatter, gather = each("reduce_scatter", pair[0]), each("allgather", pair[1])
    return {1: scatter + gather, 2: a * scatter + gather, 3: a * (scatter + 2 * gather)}[stage]

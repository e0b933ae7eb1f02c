"""The bookkeeping under ZeRO (:mod:`dtrain.parallel.zero`): which chunk of each layer a rank owns, and what it holds.

A layer's parameters are one slice of the flat buffer (its weight, rows x cols, then its cols biases); ZeRO cuts that
slice into N chunks with :func:`dtrain.collectives.chunk_bounds`, the very cut the reduce-scatter and the all-gather
make, so rank r's chunk of a layer is exactly what a reduce-scatter of the layer's gradient leaves on rank r::

    flat buffer   [ W0 b0 ............ | W1 b1 ...... | W2 b2 ]      three layers (Units)
    N = 3 chunks  [ r0   | r1   | r2   | r0 | r1 | r2 | r0|r1|r2]   rank r owns chunk r of every layer

:class:`Ledger` counts the bytes a rank holds of each kind as it allocates and frees them: the accounting that
``Zero.costs`` is held against (not the process's RSS, which also counts Python, NumPy and MPI).
"""

from __future__ import annotations

import dataclasses
import itertools

from dtrain.collectives import chunk_bounds

KINDS = ("parameters", "gradients", "optimizer")


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
    units, start = [], 0
    for index, (rows, cols) in enumerate(itertools.pairwise(sizes)):
        lo, hi = chunk_bounds(rows * cols + cols, world)[rank]
        units.append(Unit(index, start, rows, cols, lo, hi))
        start += rows * cols + cols
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

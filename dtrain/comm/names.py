"""MPI's constants and reduction ops, shared by every kind of communicator (real, simulated, wrapped).

Code written with ``from dtrain.comm.names import ANY_SOURCE, IN_PLACE, SUM`` runs on ``mpi4py`` communicators and on
the simulator alike: when mpi4py imports, these *are* mpi4py's objects (so ``MPI.ANY_SOURCE`` and ``ANY_SOURCE`` are
interchangeable); without it, they are stand-ins with MPICH's values, so the simulator works on a machine with no MPI.

``OPS`` pairs each reduction op with the NumPy ufunc that applies it to buffers and the Python function that applies
it to objects; :func:`op_entry` finds an op's entry (mpi4py's ``Op`` objects cannot be hashed, so it is a list
searched by identity, not a dict).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

try:
    from mpi4py import MPI
except ImportError:  # the simulator, and everything written against these names, works without MPI installed
    MPI = None


class _Constant:
    """A named stand-in for an mpi4py constant object (``IN_PLACE``, ``SUM``) when mpi4py is not installed."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


if MPI is not None:
    ANY_SOURCE, ANY_TAG, PROC_NULL, UNDEFINED = MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.PROC_NULL, MPI.UNDEFINED
    COMM_TYPE_SHARED = MPI.COMM_TYPE_SHARED
    IN_PLACE, SUM, MAX, MIN, PROD = MPI.IN_PLACE, MPI.SUM, MPI.MAX, MPI.MIN, MPI.PROD
else:  # MPICH's values, so printed numbers look the same
    ANY_SOURCE, ANY_TAG, PROC_NULL, UNDEFINED = -2, -1, -1, -32766
    COMM_TYPE_SHARED = 1
    IN_PLACE, SUM, MAX, MIN, PROD = (_Constant(n) for n in ("IN_PLACE", "SUM", "MAX", "MIN", "PROD"))


class OpEntry(NamedTuple):
    op: object  # the op object (mpi4py's, or a stand-in)
    ufunc: np.ufunc  # applies it to buffers
    function: object  # applies it to two Python objects
    name: str


OPS = [
    OpEntry(SUM, np.add, operator.add, "SUM"),
    OpEntry(MAX, np.maximum, max, "MAX"),
    OpEntry(MIN, np.minimum, min, "MIN"),
    OpEntry(PROD, np.multiply, operator.mul, "PROD"),
]


def op_entry(op) -> OpEntry | None:
    """The entry of ``op`` in :data:`OPS`, or None for an op not listed there."""
    for entry in OPS:
        if op is entry.op:
            return entry
    return None


def show_source(source: int) -> str:
    return "ANY_SOURCE" if source == ANY_SOURCE else str(source)


def show_tag(tag: int) -> str:
    return "ANY_TAG" if tag == ANY_TAG else str(tag)

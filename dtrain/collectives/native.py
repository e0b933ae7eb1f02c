"""MPI's own collectives behind the same signatures as ours: the baseline every algorithm is measured against.

``algorithm="mpi"`` calls these: one call into the MPI library (``Allreduce``, ``Reduce``, ``Bcast``), which picks
its own algorithm in C (MPICH: recursive doubling for small messages, Rabenseifner or a ring for large ones). The
tracer sees one call with the logical volume handed in and out, not MPI's internal messages. MPI has no "avg": it
sums, and the average is the sum times 1/p, the same rounding as ours.
"""

from __future__ import annotations

from dtrain import kernels
from dtrain.comm.names import IN_PLACE, MAX, SUM

_MPI_OPS = {"sum": SUM, "avg": SUM, "max": MAX}


def allreduce(comm, buf, op="sum"):
    comm.Allreduce(IN_PLACE, buf, op=_MPI_OPS[op])
    if op == "avg":
        kernels.scale_(buf, 1.0 / comm.Get_size())
    return buf


def reduce(comm, buf, root=0, op="sum"):
    if comm.Get_rank() == root:
        comm.Reduce(IN_PLACE, buf, op=_MPI_OPS[op], root=root)
        if op == "avg":
            kernels.scale_(buf, 1.0 / comm.Get_size())
    else:
        comm.Reduce(buf, None, op=_MPI_OPS[op], root=root)
    return buf


def broadcast(comm, buf, root=0):
    comm.Bcast(buf, root=root)
    return buf

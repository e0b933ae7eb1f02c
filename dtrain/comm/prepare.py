"""The one communicator a run uses, prepared in one place: the world, GPU staging, the tracer, the watchdog.

A training run (and anything else that wants the same) calls :func:`prepare` once and from then on holds a single
communicator; it never asks whether MPI is there, whether buffers live on a GPU, or whether it is being traced::

    comm = prepare(device="gpu", timeout=300)
    layers(comm)   # [WatchedComm, TracedComm, StagedComm, <mpi4py.MPI.Intracomm>]   (outermost first)

The layers, from the inside out:

1. **The world.** The communicator given, else ``MPI.COMM_WORLD`` (one rank under plain ``python``, N under
   ``mpiexec -n N``), else, when mpi4py cannot be imported at all, a simulated world of one rank
   (:func:`dtrain.comm.sim.solo`): training on one process needs no MPI.
2. **GPU staging** (:mod:`dtrain.comm.staging`), for ``device="gpu"``: device buffers go to MPI as they are when it
   is CUDA-aware (after the GPU stream is synchronised), else through pinned host memory. Innermost, so the layers
   above see the algorithm's own buffers and count its bytes, not the staging copies (which it counts itself).
3. **The tracer** (:mod:`dtrain.comm.trace`): bytes, messages and time per operation, for metrics.json and the
   Chrome trace. ``comm.tracer`` reaches it through the layer above.
4. **The watchdog** (:mod:`dtrain.comm.watchdog`), when a timeout is in force: arms the process's monitor and notes
   the peer and tag of every point-to-point call, so a stalled rank's report says whom it was waiting for.

Sub-communicators split from the result (a rank grid's rows, a node's ranks) come back with the same layers.
"""

from __future__ import annotations

from dtrain.comm import watchdog
from dtrain.comm.staging import StagedComm
from dtrain.comm.trace import TracedComm, Tracer
from dtrain.comm.wrapper import layers

__all__ = ["layers", "prepare", "world"]


def world():
    """``MPI.COMM_WORLD``, or a simulated one-rank world when mpi4py cannot be imported."""
    try:
        from mpi4py import MPI
    except ImportError:
        from dtrain.comm import sim

        return sim.solo()
    return MPI.COMM_WORLD


def prepare(comm=None, *, device: str = "cpu", tracer: Tracer | None = None, timeout=None, gpu=None, events=True):
    """The communicator a run uses: ``comm`` (default :func:`world`) with the layers the module docstring lists.

    ``device``: "cpu" or "gpu" (staging). ``tracer``: count into this one (default: a new one for this rank, keeping
    a timeline of every call if ``events``).
    ``timeout``: seconds for the watchdog (0 disarms it; None keeps what is in force, from ``DTRAIN_TIMEOUT`` or an
    earlier call). ``gpu``: the staging's device adapter (default CuPy; tests pass a stand-in).
    """
    comm = world() if comm is None else comm
    if device == "gpu":
        comm = StagedComm(comm, device=gpu)
    comm = TracedComm(comm, tracer if tracer is not None else Tracer(comm.Get_rank(), keep_events=events))
    if timeout is not None:
        watchdog.configure(timeout)
    if watchdog.timeout():
        comm = watchdog.WatchedComm(comm)
    return comm

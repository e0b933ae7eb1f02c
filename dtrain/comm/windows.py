"""Shared-memory windows: memory that every rank of one node reads and writes directly (MPI-3 RMA).

``allocate(comm, nbytes)`` is a collective over ``comm``, whose ranks must share one machine's memory (a node, from
``Split_type(COMM_TYPE_SHARED)``, or any group of ranks inside one). Every rank gets a :class:`SharedWindow`:
``segments[q]`` is rank q's ``nbytes`` as a NumPy byte array *in this rank's address space*, so rank r can read and
write rank q's segment with plain loads and stores, no message at all::

    one node's shared memory (MPI_Win_allocate_shared: contiguous by default)
    [ segment of rank 0 | segment of rank 1 | segment of rank 2 | segment of rank 3 ]
      ^ mapped into every rank's process: segments[q] is the same bytes in each of them

**Ordering.** Plain stores are not messages: nothing tells rank q that rank r has written. MPI's *unified* memory
model (``Win.Get_attr(WIN_MODEL)``: what MPICH and Open MPI give shared windows) says a store becomes visible to
the others after a memory barrier, and the standard's recipe for "I wrote, now you may read" is::

    Win.Sync()       my stores are complete and visible (a memory barrier; on x86 nearly free, on ARM a real fence)
    comm.Barrier()   every rank has done so (and nobody goes on before everyone has)
    Win.Sync()       my later loads see what the others stored before the barrier

:meth:`SharedWindow.fence` is exactly that. The window is kept in a passive-target epoch from allocation to
:meth:`SharedWindow.free` (``Lock_all``/``Unlock_all``), which ``Win.Sync`` needs.

**A barrier in shared memory.** ``comm.Barrier()`` is a collective of messages; when ranks outnumber cores, MPICH's
waits yield the core and a barrier took 470 us on 4 ranks of this 2-core machine (2.3 us on 2 ranks). The ranks of a
window can meet in the window itself: :class:`FlagBarrier` gives each rank a counter; to pass barrier number e a rank
stores e into its own counter and waits until every rank's counter has reached e (yielding the core while it waits,
``sched_yield``). Counters only grow, so a rank that has already gone on to barrier e + 1 still lets the others pass
e. With ``Win.Sync`` before the store and after the wait it is a fence: 6.7 us on 4 ranks, 0.7 us on 2
(docs/benchmarks.md, section 3).

**On simulated ranks** (:mod:`dtrain.comm.sim`: threads of one process) a window is one NumPy array per rank, made
once by the last rank to arrive, and ``fence`` is the barrier alone (the world's lock orders the threads' memory).
So the same algorithm runs on both, and a notebook can step through it.

**Freeing.** ``free`` is collective (every rank calls it). A job that ends otherwise (an exception and ``Abort``, a
signal, the watchdog) cannot free collectively, and MPICH's file for the window stays in /dev/shm: ``dtrain launch``
removes the files its job made and no process maps any more (:func:`dtrain.launch.processes.free_shared_memory`).
"""

from __future__ import annotations

import os

import numpy as np

from dtrain.comm.names import MPI
from dtrain.comm.wrapper import innermost

ALIGN = 64  # bytes: every segment starts on a cache line (and so is aligned for any dtype)


class SharedWindow:
    """This rank's handle on a shared window: every rank's segment (``segments``), ``fence``, ``free``."""

    def __init__(self, comm, nbytes: int, segments: list, win=None):
        self.comm, self.nbytes, self.segments, self._win = comm, nbytes, segments, win
        self.rank = comm.Get_rank()
        self.freed = False

    def view(self, rank: int, dtype, offset: int = 0, count: int | None = None) -> np.ndarray:
        """Rank ``rank``'s segment as ``count`` elements of ``dtype`` from byte ``offset`` (default: all of it)."""
        dtype = np.dtype(dtype)
        count = (self.nbytes - offset) // dtype.itemsize if count is None else count
        return self.segments[rank][offset : offset + count * dtype.itemsize].view(dtype)

    def sync(self) -> None:
        """``Win.Sync``: a memory barrier for this window's memory (nothing to do on simulated ranks)."""
        if self._win is not None:
            self._win.Sync()

    def fence(self) -> None:
        """Everything stored before it, by any rank, is visible to every rank after it (``Sync``, barrier, ``Sync``)."""
        if self._win is not None:
            self._win.Sync()
        self.comm.Barrier()
        if self._win is not None:
            self._win.Sync()

    def free(self) -> None:
        """Release the window (a collective: every rank calls it once). The segments must not be used afterwards."""
        if self.freed:
            return
        self.freed = True
        self.segments = []
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()


def _check_room(nbytes: int) -> None:
    """MPICH maps windows from files in /dev/shm: a window larger than its free space would end the job with SIGBUS
    at the first touch of a page, long after allocation. Say so now instead."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:  # no /dev/shm (not Linux): nothing to check
        return
    if nbytes > stats.f_bavail * stats.f_frsize:
        free = stats.f_bavail * stats.f_frsize
        raise RuntimeError(
            f"a shared window of {nbytes:,} bytes does not fit in /dev/shm ({free:,} bytes free; a "
            "container's default is 64 MiB: raise it, e.g. docker --shm-size), or use --allreduce ring"
        )


def fence(comm, shared: tuple) -> None:
    """:meth:`SharedWindow.fence` for several windows on ``comm`` at once: each synced, one barrier, each synced."""
    for window in shared:
        if window._win is not None:
            window._win.Sync()
    comm.Barrier()
    for window in shared:
        if window._win is not None:
            window._win.Sync()


class FlagBarrier:
    """A fence in shared memory for the ranks of ``shared`` (see the module docstring): one int64 counter per rank, at
    byte ``offset`` of its segment. Real processes only: simulated ranks are threads, whose waits the simulator must
    see (they use :func:`fence`)."""

    def __init__(self, shared: SharedWindow, offset: int):
        self.counters = [shared.view(q, np.int64, offset, 1) for q in range(len(shared.segments))]
        self.mine, self.passed = self.counters[shared.rank], 0

    def fence(self, shared: tuple, waiting=None) -> None:
        """Every store before it, by any rank, into any of the windows ``shared``, is visible to every rank after it.
        ``waiting(q)`` is told the rank waited for, now and then (for the watchdog's report)."""
        self.passed += 1
        for window in shared:
            window.sync()  # my stores are done before my counter says so
        self.mine[0] = self.passed
        shared[0].sync()
        for q, counter in enumerate(self.counters):
            spins = 0
            while counter[0] < self.passed:
                os.sched_yield()
                spins += 1
                if waiting is not None and spins % 4096 == 0:
                    waiting(q)
        for window in shared:
            window.sync()  # my loads from here on see what the others stored before their counters moved


def allocate(comm, nbytes: int) -> SharedWindow:
    """A window of ``nbytes`` per rank (rounded up to ``ALIGN``) over ``comm``'s ranks, which share one memory; a
    collective. ``comm`` may be wrapped (tracer, watchdog): the window is allocated on the communicator inside, and
    ``fence``'s barrier goes through the wrappers (so the tracer and the watchdog see it)."""
    nbytes = max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN)
    inner = innermost(comm)
    if hasattr(inner, "Allocate_shared"):  # a simulated communicator: one array per rank, made once
        return SharedWindow(comm, nbytes, inner.Allocate_shared(nbytes))
    _check_room(nbytes * inner.Get_size())
    win = MPI.Win.Allocate_shared(nbytes, 1, comm=inner)
    if win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:  # (the fence above is the unified model's recipe)
        win.Free()
        raise RuntimeError("this MPI's shared windows are not in the unified memory model: use --allreduce ring")
    win.Lock_all(MPI.MODE_NOCHECK)  # the passive-target epoch Win.Sync needs, until free(); nobody locks exclusively
    segments = []
    for rank in range(inner.Get_size()):  # (each rank's own size: MPI lets ranks ask for different ones)
        memory, _ = win.Shared_query(rank)
        segments.append(np.frombuffer(memory, dtype=np.uint8))
    return SharedWindow(comm, nbytes, segments, win)

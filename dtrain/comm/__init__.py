"""The communication layer: the world of ranks and the small mpi4py subset algorithms are written against.

Algorithms above this package call only ``Get_rank``, ``Get_size``, ``Send``, ``Recv``, ``Sendrecv``,
``Isend``/``Irecv`` (and :func:`waitall` on the requests), ``Barrier``, and ``Split``/``Split_type``/``Free`` on a
communicator; exchanges go through :func:`sendrecv`, so how a rank waits is decided here, once. (The collectives'
debug mode also uses the object ``allgather``, and their "mpi" baseline MPI's own ``Allreduce``/``Reduce``/``Bcast``.)

Which file does what:

============== ==========================================================================================
``names``       MPI's constants and ops (``ANY_SOURCE``, ``IN_PLACE``, ``SUM`` ...), shared by every communicator
``mpi``         inside a rank: the real world under ``mpiexec``; a failing rank ends the job, saying so once
``launcher``    outside the ranks: ``mpiexec`` with the machine's settings; the job stopped whole (Ctrl-C, timeout)
``flavours``    which MPI an ``mpiexec`` belongs to (MPICH, Open MPI), and each one's spelling of a job's needs
``hosts``       hostfiles and ``--hosts`` lists: read, checked against ``-n``, handed to ``mpiexec``
``where``       ``-m dtrain.launch.where``: which machine, node and cores every rank landed on
``sim``         a simulated world of N ranks as threads, with exact deadlock detection (notebooks, fast tests)
``simcomm``     the simulated world's communicator: mpi4py's buffer API over shared queues
``wrapper``     the base of every communicator wrapper (calls as records, wrapped sub-communicators, innermost)
``trace``       a wrapper counting bytes, messages and time per operation; the Chrome/Perfetto trace
``windows``     shared-memory windows (MPI-3): every rank of a node reads and writes the others' segments
``staging``     a wrapper staging GPU buffers through pinned host memory for an MPI that is not CUDA-aware
``cuda_aware``  asks the MPI library whether it takes GPU buffers
``watchdog``    ends a job whose rank has waited too long, with a report of what it waited for
``prepare``     the one communicator a run uses: world, staging, tracer and watchdog in one call
============== ==========================================================================================

So one algorithm runs unchanged on a real ``mpi4py.MPI.Comm``, on a simulated one, and on either wrapped.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from dtrain.comm.names import ANY_SOURCE, ANY_TAG
from dtrain.comm.wrapper import innermost

WAIT_MODES = ("auto", "block", "poll")
POLL_SLEEP_S = 5e-6  # asked for; Linux's timer slack (~50 us) makes the real sleep longer


def waitall(requests) -> None:
    """Wait for every request in ``requests``, whichever kind of communicator made them.

    mpi4py's ``MPI.Request.Waitall`` is a class method that only accepts real MPI requests, so algorithms call this
    instead. Requests of the simulator are waited one by one through their own ``Wait`` (which keeps its deadlock
    detection exact). Requests backed by real MPI (bare, or wrapped by the tracer or by GPU staging, which keep the
    wrapped request as ``.request``) are waited in one of two ways (:func:`wait_mode`):

    * **block**: MPICH spins (or, with ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``, calls ``sched_yield``) until the messages
      arrive: the fastest wait when every rank has a core of its own.
    * **poll**: ``Test`` and a short sleep until done. With more ranks than cores, a rank that is waiting must really
      give its core to the peer it waits for; ``sched_yield`` alone barely does (the scheduler hands the core
      straight back), so the peer that would send the message is not running. Measured in docs/benchmarks.md.
    """
    requests = list(requests)
    if not requests:
        return
    MPI = sys.modules.get("mpi4py.MPI")  # not loaded: these cannot be MPI requests (the simulator needs no MPI)
    if MPI is None or not all(isinstance(innermost(r), MPI.Request) for r in requests):
        for request in requests:
            request.Wait()
    elif wait_mode() == "poll":
        pending = requests
        while pending:
            pending = [r for r in pending if not r.Test()]  # a wrapper's Test does its own bookkeeping when done
            if pending:
                time.sleep(POLL_SLEEP_S)
    elif all(isinstance(r, MPI.Request) for r in requests):
        MPI.Request.Waitall(requests)  # one call: MPI progresses them together
    else:
        for request in requests:
            request.Wait()


def probe(comm, status, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> None:
    """Wait until a message from ``source`` with ``tag`` can be received; ``status`` says its source, tag and size.

    ``Probe``, except on real MPI with more ranks than cores, where it is ``Iprobe`` and a short sleep, for the
    reason :func:`waitall` gives (a server that spins in ``Probe`` takes the core its workers compute on).
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and isinstance(innermost(comm), MPI.Comm) and wait_mode() == "poll":
        while not comm.Iprobe(source, tag, status):
            time.sleep(POLL_SLEEP_S)
    else:
        comm.Probe(source, tag, status)


def new_status(comm):
    """An empty status for a receive or a probe on ``comm`` to fill in: the simulator's, or mpi4py's."""
    make = getattr(innermost(comm), "new_status", None)
    if make is not None:
        return make()
    from mpi4py import MPI

    return MPI.Status()


def sendrecv(comm, sendbuf, dest, recvbuf, source) -> None:
    """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``.

    With blocking waits this is ``comm.Sendrecv`` (one call into MPI). When ranks outnumber cores it is ``Irecv`` +
    ``Isend`` + :func:`waitall`, so exchange-heavy algorithms (ring, recursive doubling) poll and sleep while they
    wait; the receive is posted first, so the peer's message has somewhere to land at once.
    """
    if wait_mode() == "poll":
        waitall([comm.Irecv(recvbuf, source=source), comm.Isend(sendbuf, dest=dest)])
    else:
        comm.Sendrecv(sendbuf, dest=dest, recvbuf=recvbuf, source=source)


def ranks_on_this_node() -> int:
    """How many ranks of this job share this machine, as the process manager told us (1 outside ``mpiexec``).

    MPICH's Hydra sets ``MPI_LOCALNRANKS``, Open MPI ``OMPI_COMM_WORLD_LOCAL_SIZE``, and Slurm's ``srun`` the tasks of
    every node of the step (``SLURM_STEP_TASKS_PER_NODE``, e.g. ``4(x2),3``) and this node's index: no communication.
    """
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    per_node = slurm_tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = os.environ.get("SLURM_STEP_NODEID", os.environ.get("SLURM_NODEID", "0"))
    if per_node and node.isdigit() and int(node) < len(per_node):
        return per_node[int(node)]
    return 1


def slurm_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed list of tasks per node, expanded: ``"4(x2),3"`` -> ``[4, 4, 3]`` (``[]`` if unreadable)."""
    counts = []
    for part in filter(None, text.split(",")):
        count, _, repeat = part.partition("(x")
        if not count.isdigit() or (repeat and not repeat.rstrip(")").isdigit()):
            return []
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.cache
def wait_mode() -> str:
    """``DTRAIN_WAIT`` (block, poll) if set, else poll exactly when this node has more ranks than cores."""
    mode = os.environ.get("DTRAIN_WAIT", "auto")
    if mode not in WAIT_MODES:
        raise ValueError(f"DTRAIN_WAIT={mode!r} is not one of: {', '.join(WAIT_MODES)}")
    if mode == "auto":
        return "poll" if ranks_on_this_node() > usable_cores() else "block"
    return mode

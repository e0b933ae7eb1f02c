"""The real world of ranks: MPI under ``mpiexec``, fail-fast on errors, and a launcher that sets the machine up.

Three things a learner trips over in their first MPI hour are handled here once:

1. **A crash on one rank hangs the others.** Rank 2 raises, rank 0 waits forever in ``Recv`` for a message rank 2
   will never send. :func:`install_excepthook` makes an uncaught exception print that rank's traceback and then call
   ``MPI.COMM_WORLD.Abort``, which ends every rank of the job at once. (``python -m mpi4py script.py`` does the same;
   the launcher below runs scripts that way.)
2. **More ranks than cores crawl.** MPICH waits for messages by busy-polling; with 4 ranks on 2 cores the waiting
   ranks steal the CPU from the working ones. ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` makes waiters yield (which alone
   barely helps: the scheduler hands a yielding waiter its core straight back, so dtrain's own waits also sleep
   between polls, see :func:`dtrain.comm.waitall`). Likewise each rank must use one BLAS/Numba thread, or 4 ranks x
   2 threads fight over 2 cores.
3. **The wrong ``mpiexec``.** An ``mpiexec`` from another MPI on PATH starts N independent singletons, each of size
   1. :func:`mpiexec_path` takes the one installed beside this Python (the ``mpich`` wheel puts it there).

``python -m dtrain launch -n 4 lessons/02_allreduce.py`` uses all three.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from dtrain.comm import usable_cores

# Output a rank writes goes to mpiexec through a pipe; an Abort can end the job before mpiexec has read the last
# lines (suspected in rare test failures where no rank's message arrived). A rank about to end the job waits this
# long first: nothing else is left to do, and a fifth of a second is nothing next to a lost error message.
FORWARD_S = 0.2

# One thread per rank for every threaded library a rank may load: BLAS (OpenBLAS, MKL), OpenMP, Numba.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def world():
    """``MPI.COMM_WORLD`` (importing mpi4py initialises MPI; a plain ``python`` run is a world of one rank)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def rank(comm=None) -> int:
    return (comm or world()).Get_rank()


def size(comm=None) -> int:
    return (comm or world()).Get_size()


def print0(*args, comm=None, **kwargs) -> None:
    """``print`` on rank 0 only (flushed, so lines are not lost when another rank aborts the job)."""
    if rank(comm) == 0:
        print(*args, **kwargs, flush=True)


def refuse_arguments(message: str, comm=None) -> None:
    """Exit every rank with status 2 after writing ``message`` (bad arguments, found the same way on every rank).

    Every rank writes it, not only rank 0: under ``python -m mpi4py`` a non-zero exit aborts the whole job, so the
    first rank to leave can kill rank 0 before rank 0 has printed anything. Whichever rank leaves first has said why.
    """
    several = (comm or world()).Get_size() > 1
    sys.stdout.flush()
    sys.stderr.write((f"[rank {rank(comm)}] {message}" if several else message) + "\n")
    sys.stderr.flush()
    if several:
        time.sleep(FORWARD_S)  # let mpiexec forward the line before the first exit aborts the job
    raise SystemExit(2)


def install_excepthook() -> None:
    """Make an uncaught exception on any rank print its traceback and abort the whole job.

    In a world of one rank nothing can hang, so the usual Python behaviour is kept. Otherwise the traceback is
    prefixed with the rank (so a learner sees *which* rank failed) and ``Abort`` tears every rank down.
    """
    comm = world()
    if comm.Get_size() == 1:
        return

    def abort_on_exception(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[rank {comm.Get_rank()}] uncaught exception, aborting all ranks:\n{text}")
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(FORWARD_S)
        comm.Abort(1)

    sys.excepthook = abort_on_exception


def mpiexec_path() -> Path:
    """The ``mpiexec`` that belongs to this Python's environment, else the first on PATH; an error if neither."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return local
    found = shutil.which("mpiexec")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "no mpiexec found beside this Python or on PATH: install dtrain into a virtualenv "
        "(pip install -e .), which brings the mpich wheel and its mpiexec"
    )


def launch_env(nranks: int, base: dict | None = None) -> dict:
    """The environment for ``nranks`` ranks on this machine: one thread each, yielding waits when oversubscribed.

    Values already set by the user win (``setdefault``), so ``OMP_NUM_THREADS=4 dtrain launch ...`` still works.
    """
    env = dict(os.environ if base is None else base)
    for name in THREAD_VARIABLES:
        env.setdefault(name, "1")
    if nranks > usable_cores():  # the same test as dtrain.comm.wait_mode's, so both agree on 'oversubscribed'
        env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return env


def mpiexec_command(nranks: int, target: list[str]) -> list[str]:
    """The command line that runs ``target`` (a script and its args, or ``-m module ...``) on ``nranks`` ranks.

    The target runs under ``python -m mpi4py``, so an uncaught exception on any rank aborts the whole job.
    """
    if nranks < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {nranks}")
    if not target:
        raise ValueError("nothing to launch: give a script path or -m module")
    return [str(mpiexec_path()), "-n", str(nranks), sys.executable, "-m", "mpi4py", *target]


def launch(nranks: int, target: list[str], timeout: float | None = None, capture: bool = False, **kwargs):
    """Run ``target`` on ``nranks`` ranks and return the ``subprocess.CompletedProcess``.

    ``timeout`` (seconds) kills the whole job if it has not finished, so a bug is a failure, not a hang: mpiexec and
    every rank run in their own process group, and the group is killed (killing mpiexec alone can orphan ranks).
    """
    cmd = mpiexec_command(nranks, target)
    env = launch_env(nranks, kwargs.pop("env", None))
    pipe = subprocess.PIPE if capture else None
    with subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

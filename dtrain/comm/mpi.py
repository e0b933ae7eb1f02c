"""Inside a rank: the real world of ranks under ``mpiexec``, and how a rank that fails ends the job, saying so once.

(Starting and stopping a job from outside is :mod:`dtrain.launch.launcher`'s.)

A crash on one rank hangs the others: rank 2 raises, rank 0 waits forever in ``Recv`` for a message rank 2 will never
send. So a rank that fails must end the job, and say why, once, not once per rank:

* **A mistake every rank finds** (a bad flag, checked before any message) ends every rank with the mistake's status
  and one line from rank 0, through ``MPI_Finalize``: there is no one left to abort.
* **An error only some ranks see** ends the job through ``MPI_Abort``, with the traceback or message of the ranks
  that saw it, each naming its rank.

:func:`end_job` tells the two apart (every failing rank asks whether all ranks are failing), and
:func:`install_excepthook` routes uncaught exceptions through it; ``python -m dtrain.comm.run`` (what the launcher
runs on every rank) installs it before the program starts. (``python -m mpi4py`` aborts on any exception too, but
prints every rank's traceback.)
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from dtrain.errors import EXIT_USER_ERROR

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
# How long a failing rank waits to learn whether every rank is failing too (end_job). Ranks that find the same bad
# flag find it within milliseconds of each other, even four to a core; a rank that fails alone pays this before the
# Abort.
AGREE_S = 2.0
FINALIZE_S = 10.0  # the most that leaving through MPI_Finalize may take once every rank has agreed
_channel = None  # the world's duplicate on which failing ranks ask each other (install_excepthook sets it up)

# Output a rank writes goes to mpiexec through a pipe; an Abort can end the job before mpiexec has read the last
# lines (suspected in rare test failures where no rank's message arrived). A rank about to end the job waits this
# long first: nothing else is left to do, and a fifth of a second is nothing next to a lost error message.
FORWARD_S = 0.2


def world():
    """``MPI.COMM_WORLD`` (importing mpi4py initialises MPI; a plain ``python`` run is a world of one rank)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def rank(comm=None) -> int:
    return (comm or world()).Get_rank()


def size(comm=None) -> int:
    return (comm or world()).Get_size()


def launched_size() -> int:
    """How many ranks the process manager says it started (MPICH's ``PMI_SIZE``, Open MPI's ``OMPI_COMM_WORLD_SIZE``),
    read from the environment without starting MPI; 1 when none says."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def print0(*args, comm=None, **kwargs) -> None:
    """``print`` on rank 0 only (flushed, so lines are not lost when another rank aborts the job)."""
    if rank(comm) == 0:
        print(*args, **kwargs, flush=True)


def refuse_arguments(message: str) -> None:
    """Leave with status 2 after ``message``: bad arguments, which every rank finds the same way. Said once."""
    sys.stdout.flush()
    end_job(message, EXIT_USER_ERROR)
    raise SystemExit(EXIT_USER_ERROR)


def install_excepthook() -> None:
    """Make an uncaught exception on any rank end the whole job, saying once what happened (see :func:`end_job`).

    Call it on every rank at the start, before any communication: it sets up the channel that :func:`end_job` asks
    on (a duplicate of the world, a collective call). In a world of one rank nothing can hang, so the usual Python
    behaviour is kept. Ctrl-C (KeyboardInterrupt) ends a rank quietly: whoever sent it stops the job.
    """
    global _channel
    comm = world()
    if comm.Get_size() == 1:
        return
    if _channel is None:
        _channel = comm.Dup()

    def end_on_exception(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            leave_interrupted()
            return
        while tb is not None and _is_runner(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # the runner's frames (runpy, dtrain.comm.run, mpi4py's): in every traceback, none yours
        text = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n")
        same = "".join(traceback.format_exception_only(exc_type, exc))  # ranks that raised this raised the same
        end_job(text, 1, template="uncaught exception{who}, ending the job:\n{message}", everyone=" on every rank",
                key=same)  # fmt: skip

    sys.excepthook = end_on_exception


def end_job(message: str, status: int, template: str = "{message}", everyone: str = "", key: str | None = None) -> None:
    """Say why this rank fails, once for the whole job, and leave the job in the way that fits.

    Two kinds of failure need two ends:

    * **Every rank fails** (a bad flag, checked the same way everywhere; a checkpoint rank 0 read and broadcast;
      a collective that debug mode found mismatched on all ranks). Nothing is left to abort: rank 0 writes each
      different message once, naming the ranks when they differ, and every rank leaves through ``MPI_Finalize``;
      the caller then exits with ``status``.
    * **Some ranks fail** and the others wait for them forever. This rank writes its message, naming itself, and
      calls ``MPI_Abort``, which ends every rank of the job.

    Which one it is, a rank cannot know alone, so it asks: a non-blocking barrier on a channel of its own (set up by
    :func:`install_excepthook`), which completes only if every rank gets here within :data:`AGREE_S` seconds. (A
    blocking one would hang when a rank is not failing; one on the world would be mismatched with a collective a
    rank may be blocked in.) Ranks that arrive just as the first one's time runs out may answer differently: the
    job then ends through ``MPI_Abort``, still promptly, with MPI's banner. ``template`` places the ranks and the
    message: ``{who}`` is empty when every rank says the same (``everyone`` then), else `` (rank 1)`` or
    `` (ranks 0, 2)``. Ranks whose ``key`` (default: the message) is the same say the same thing: the message of
    the first of them is shown.
    """
    sys.stdout.flush()
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        _write(template.format(who="", message=message))  # alone: nothing to agree on, nothing to abort
        return
    comm = MPI.COMM_WORLD
    if _channel is not None and _everyone_failing(_channel):
        # Every rank is here, so what follows completes at once; should MPI_Finalize wait on something a rank left
        # pending, the job still ends, with the same status.
        deadline = threading.Timer(FINALIZE_S, os._exit, args=(status,))
        deadline.daemon = True  # (it must not keep the process alive once it has left)
        deadline.start()
        said = _channel.gather((message if key is None else key, message), root=0)
        if _channel.Get_rank() == 0:
            groups: dict[str, list[int]] = {}
            for r, (same, _) in enumerate(said):
                groups.setdefault(same, []).append(r)
            for ranks in groups.values():
                who = everyone if len(groups) == 1 else f" ({_ranks_named(ranks)})"
                _write(template.format(who=who, message=said[ranks[0]][1]))
        _channel.Barrier()  # rank 0 has written before any rank leaves
        MPI.Finalize()
        return
    _write(template.format(who=f" (rank {comm.Get_rank()})", message=message))
    time.sleep(FORWARD_S)  # mpiexec forwards the line before the Abort ends the job
    comm.Abort(status)


def leave_interrupted() -> None:
    """Ctrl-C reached this rank of several (the launcher or mpiexec passes it to every rank): leave at once, with
    130, quietly. In a world of one rank (or before MPI starts) it returns, and the caller says what it likes.

    No ``MPI_Abort`` and no traceback: whoever sent the signal is stopping the job, and four ranks' tracebacks would
    hide the one line that says so. (``os._exit``: a normal exit would pass through the runner's handling of a
    failed program, which asks the other ranks.)
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _everyone_failing(channel) -> bool:
    request = channel.Ibarrier()
    deadline = time.monotonic() + AGREE_S
    while not request.Test():
        if time.monotonic() > deadline:
            return False  # (the barrier stays pending: the Abort that follows ends every rank anyway)
        time.sleep(0.005)
    return True


def _is_runner(filename: str) -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    return "runpy" in filename or f"{os.sep}mpi4py{os.sep}" in filename or filename == os.path.join(here, "run.py")


def _ranks_named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _write(text: str) -> None:
    if not text:
        return
    sys.stderr.write(text + "\n")
    sys.stderr.flush()

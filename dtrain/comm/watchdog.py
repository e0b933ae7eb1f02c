"""The watchdog: a rank that has waited too long in a collective says what it waits for, and ends the job.

**The problem.** One rank of a job never reaches an all-reduce: it crashed without taking the job down, it is still
in a long evaluation, it called a different collective, or its ``if rank == 0`` branch skipped the call. Every other
rank now waits inside ``Sendrecv`` or ``MPI_Allreduce`` for a message that will never come, and the job hangs,
silently, until someone notices hours later. PyTorch's collective timeout and Horovod's stall inspector answer this the
way this module does: give every wait a time limit, and when a rank exceeds it, print who waits for whom and end the
job with an error status. A hang becomes a failure with a diagnosis.

**Why a monitor thread.** The obvious idea, a deadline checked inside the waits, only works for waits that are loops
we wrote: dtrain's polling ``waitall`` could look at the clock between two ``Test`` calls. But a rank just as often
waits inside *one* blocking MPI call (``Sendrecv`` with blocking waits, MPI's own ``Allreduce`` for
``algorithm="mpi"``, a user's ``comm.Recv`` on a plain ``MPI.COMM_WORLD``), and a blocking C call cannot be
interrupted from Python: no Python code of that thread runs until MPI returns. So another thread does the watching.
Each thread that waits (the main thread under ``mpiexec``; every rank's thread in the simulator) owns one *record*: the
stack of waits it has open and a count of its waits. The waits only write to their record; they never read the clock,
take a lock or talk to the monitor::

    thread of rank 0                          monitor thread (one per process, a daemon)
    ----------------                          ------------------------------------------
    token = begin(comm, "allreduce/ring")     every tick (S/5, between 0.05 and 1 s), for each record:
        calls += 1; push the wait                 a wait open, with the call number of the last tick?
    ...  blocked inside MPI_Sendrecv  ...         open for S seconds now?  -> report, then Abort
    end(token)      pop the wait

The monitor sees a wait that has not moved: the same call number open tick after tick. mpi4py releases Python's lock
(the GIL) while it is inside MPI, so the monitor runs while the main thread is blocked in ``MPI_Allreduce``; and since
mpi4py asks MPI for ``MPI_THREAD_MULTIPLE`` by default, the monitor may call ``MPI_Abort`` from its own thread, which
ends every rank of the job. Where the thread level is lower, or ``Abort`` has not ended the process within
:data:`ABORT_GRACE_S` seconds, the process ends itself with ``os._exit`` and ``mpiexec`` then ends the other ranks.
Because the watching happens outside the waits, it works whatever communicator a wait was handed (a plain
``MPI.COMM_WORLD``, a simulated one, any stack of wrappers) and around any blocking call.

**Finding the peer for free.** Whom is the rank waiting for? Writing it down at every exchange would cost every
exchange something. Instead the monitor does what a debugger (or ``py-spy``) does: ``sys._current_frames()`` gives
the Python stack of the waiting thread, and in it the innermost call of :func:`dtrain.comm.sendrecv` (whose local
variables hold ``source`` and ``dest``), of :class:`WatchedComm`'s ``Send``/``Recv``, or of whatever handles a
call's record in :mod:`dtrain.comm.wrapper` (``forward``, a wrapper's or the simulator's ``p2p``: peer and tag).
The same stack says *where* the rank waits: file, line and function. (A bare ``MPI.COMM_WORLD.Recv`` leaves no
Python frame to read: there the peer named in :func:`watching` is all the report knows.)

**What is watched.** Every collective of :mod:`dtrain.collectives` is one wait, named ``"<collective>/<algorithm>"``
(``allreduce/ring``, ``allreduce/mpi``). A paradigm wraps its own waits in :func:`watching` with a sentence a person
can read (``"parameter server: waiting for a gradient from worker 3"``), around *each* wait, not around a whole loop:
the limit is on one wait. Waits nest (a paradigm's wait around a collective; MPI's ``Allreduce`` inside
``allreduce/mpi``): only the outermost counts as a call, and the report shows the whole stack. :func:`note` adds a
detail to the innermost wait by hand. :class:`WatchedComm`, the outermost layer that
:func:`dtrain.comm.prepare.prepare` adds when a timeout is in force, makes the blocking calls made on it waits: MPI's
own collectives, the pickled-object ones, and a ``Send`` or ``Recv`` made outside any other wait (a pipeline stage's
bare ``comm.Recv`` is watched too, named with its peer and tag).

**The report.** The first rank to reach the limit writes it on stderr, flushed, and ends the job, e.g. (each entry
is one line)::

    dtrain watchdog: rank 0 of 3 (host node7, pid 4242) has waited 300.4 s in allreduce/ring (call #7)
        > Sendrecv from rank 2, to rank 1; one wait may last at most DTRAIN_TIMEOUT=300 s: aborting the job (exit ...)
    dtrain watchdog: rank 0 is at dtrain/collectives/ring.py:72 in reduce_scatter < ... < train.py:88 in step
    dtrain watchdog: rank 0 waits for rank 2: look at what rank 2 is doing (...). To wait longer set ...

It names the rank that waits, the operation and its call number (the n-th wait of this rank), the innermost peer and
tag known (in the ranks of the wait's communicator, with the world rank added for a sub-communicator) and where in
the code the rank waits. (Ranks that began waiting at the same moment may report too before the abort reaches them:
at most one report per process.) **To debug a hang**, start from the rank the report names: its traceback or last
output shows whether it crashed, is still computing, or called something else. It may itself be waiting for another
rank (a ring passes a stall along: rank 0 waits for 2, which waits for 1), so follow the chain to the rank that is
not in the collective at all. A rank inside one of MPI's own collectives knows no peer; then compare what each rank
printed last, or run with ``DTRAIN_DEBUG=1``, which makes the collectives compare their calls across ranks first.

**Arming it.** Off by default in library calls (:func:`begin` then returns at once). It is armed by

* ``DTRAIN_TIMEOUT=S`` in the environment (seconds; unset, empty or ``0``: off), read on first use;
* ``dtrain train --timeout S`` and ``dtrain launch --timeout S``, which default to a generous 300 s that a slow
  step on a busy machine never reaches; ``--timeout 0`` turns it off;
* :func:`configure` from code (``configure(None)`` or ``configure(0)`` disarms), which overrides the environment.

In the simulator (:mod:`dtrain.comm.sim`), where every rank is a thread of one process, a rank that waits too long
reports the same way and calls the simulated ``Abort``: the run raises :class:`~dtrain.comm.sim.SimAbort`. (The
simulator finds deadlocks by itself, exactly and at once; its watchdog is for a rank that never comes because it is
busy or asleep in Python code.) The monitor stays on, so a later run in the same process is watched too.

**Cost.** Disarmed, :func:`begin` tests a global and returns (about 50 ns) and :func:`end` tests its argument
(about 10 ns). Armed, a :func:`begin` + :func:`end` pair costs about 0.2 us (a thread-local lookup, a counter, a tuple
pushed and popped) and a :func:`note` about 0.1 us; nothing reads the clock or takes a lock, and finding the peer
costs nothing until a report is written. A collective makes one pair however many messages it sends, so a 4 KiB
all-reduce between two processes on one machine (7 to 13 us with ring, tree or recursive doubling) is 1 to 3%
slower armed, and a large one not measurably. :class:`WatchedComm` passes the calls a collective makes many times
straight to the communicator below; its ``Send`` and ``Recv`` cost about 0.3 us each. The monitor wakes at most
once a second for a long timeout and looks at a handful of records.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import socket
import sys
import threading
import time

from dtrain.comm.mpi import FORWARD_S
from dtrain.comm.names import ANY_SOURCE, ANY_TAG, PROC_NULL
from dtrain.comm.wrapper import Collective, CommWrapper, PointToPoint, forward, innermost
from dtrain.errors import ConfigError

__all__ = [
    "ABORT_GRACE_S", "ENV_VAR", "EXIT_CODE", "WatchedComm", "begin", "configure", "end", "note",
    "parse_timeout", "timeout", "watching",
]  # fmt: skip

ENV_VAR = "DTRAIN_TIMEOUT"
EXIT_CODE = 14  # the number of SIGALRM: the alarm clock went off. (Not 124, which `timeout` uses for its own kills.)
ABORT_GRACE_S = 5.0  # if MPI_Abort has not ended the process after this long, os._exit does
MIN_TICK_S, MAX_TICK_S = 0.05, 1.0

_UNREAD = object()  # the environment variable has not been read yet, and configure() was never called
_timeout = _UNREAD  # seconds, None (off) or _UNREAD: the one global the hot path looks at
_setup_lock = threading.Lock()  # first read of the environment, starting the monitor, the list of records
_wakeup = threading.Event()  # configure() wakes the monitor, so it picks up the new timeout at once
_monitor: threading.Thread | None = None
_records: list = []  # one _Record per thread that has waited while armed (the monitor drops dead threads')
_local = threading.local()
_ending = False  # this process is ending an MPI job: never a second report
_P2P_TO = ("Send", "Isend", "Ssend")  # point-to-point calls whose peer is the destination
_P2P = (*_P2P_TO, "Recv", "Irecv", "Sendrecv")
_RECORD_HANDLERS = ("forward", "p2p", "collective")  # functions whose local `call` is the record of a call


def parse_timeout(text) -> float | None:
    """Seconds from a setting (``DTRAIN_TIMEOUT``, ``--timeout``): a number > 0, or None for off (unset, "", 0)."""
    if text is None:
        return None
    text = str(text).strip()
    if text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ConfigError(
            f"{ENV_VAR}={text!r} is not a timeout: give the seconds a rank may wait in one collective before the job "
            "is ended (a number > 0), or 0 to turn the watchdog off"
        )
    return value or None


def configure(timeout: float | None) -> None:
    """Arm the watchdog with ``timeout`` seconds, or disarm it (None or 0). Overrides ``DTRAIN_TIMEOUT``."""
    global _timeout
    value = parse_timeout(timeout)
    with _setup_lock:
        _timeout = value
        if value is not None:
            _start_monitor()
    _wakeup.set()


def timeout() -> float | None:
    """The timeout in force in seconds, or None when disarmed (reads ``DTRAIN_TIMEOUT`` on first use)."""
    global _timeout
    if _timeout is _UNREAD:
        with _setup_lock:
            if _timeout is _UNREAD:
                value = parse_timeout(os.environ.get(ENV_VAR))  # a bad value raises here, and again next time
                _timeout = value
                if value is not None:
                    _start_monitor()
    return _timeout


# --- the hot path: what the waits do ----------------------------------------------------------------------------
class _Record:
    """One thread's waits. The thread writes ``stack``, ``calls`` and ``note``; the monitor the other three."""

    __slots__ = ("calls", "note", "quiet", "seen", "since", "stack", "thread")

    def __init__(self):
        self.stack = []  # the open waits, outermost first: (what, comm, peer, tag)
        self.calls = 0  # outermost waits begun by this thread
        self.note = None  # (the wait it belongs to, call, peer, tag, dest): the last note()
        self.thread = threading.current_thread()
        self.seen, self.since, self.quiet = -1, 0.0, -1  # call seen open and since when; call already reported


def _new_record() -> _Record:
    record = _local.record = _Record()
    with _setup_lock:
        _records.append(record)
    return record


def begin(comm, what: str, peer=None, tag=None):
    """Open a wait on ``comm`` named ``what``; return the token for :func:`end` (None at once when disarmed)."""
    if _timeout is None or (_timeout is _UNREAD and timeout() is None):
        return None
    try:
        record = _local.record
    except AttributeError:
        record = _new_record()
    stack = record.stack
    if not stack:
        record.calls += 1
    stack.append((what, comm, peer, tag))
    return record


def end(token) -> None:
    """Close the wait that :func:`begin` opened (``token`` None: nothing to do)."""
    if token is not None and token.stack:
        token.stack.pop()


def note(call: str, peer=None, tag=None, dest=None) -> None:
    """Say what this thread's innermost open wait is doing now: ``call`` with ``peer`` (and ``tag``).

    ``peer`` is the rank it receives from (the destination, for a ``Send``), ``dest`` the rank a ``Sendrecv`` sends
    to. Nothing happens when disarmed or when no wait is open.
    """
    if _timeout is None:
        return
    try:
        record = _local.record
    except AttributeError:
        return
    if record.stack:
        record.note = (record.stack[-1], call, peer, tag, dest)


@contextlib.contextmanager
def watching(comm, what: str, peer=None, tag=None):
    """:func:`begin`/:func:`end` as a block: ``with watching(comm, "pipeline: activations from stage 1", peer=1):``."""
    token = begin(comm, what, peer, tag)
    try:
        yield
    finally:
        end(token)


# --- the monitor ------------------------------------------------------------------------------------------------
def _tick(limit: float) -> float:
    return min(MAX_TICK_S, max(MIN_TICK_S, limit / 5))


def _start_monitor() -> None:
    """Start the monitor thread, once per process (called under ``_setup_lock``)."""
    global _monitor
    if _monitor is None or not _monitor.is_alive():
        _monitor = threading.Thread(target=_watch, name="dtrain-watchdog", daemon=True)
        _monitor.start()


def _watch() -> None:
    while True:
        limit = _timeout
        if limit is None or limit is _UNREAD:
            _wakeup.wait()  # disarmed: sleep until configure() arms it again
        if _wakeup.wait(0 if limit is None or limit is _UNREAD else _tick(limit)):
            _wakeup.clear()  # (re)configured: every open wait is timed afresh from the next tick
            with _setup_lock:
                for record in _records:
                    record.seen = -1
            continue
        try:
            _check(limit, time.monotonic())
        except Exception as exc:  # a bug here must not end the monitor silently
            _write(f"dtrain watchdog: internal error while checking waits: {type(exc).__name__}: {exc}\n")


def _check(limit: float, now: float) -> None:
    """One tick: report a wait whose call number has been open for ``limit`` seconds."""
    with _setup_lock:
        _records[:] = [r for r in _records if r.thread.is_alive()]
        records = list(_records)
    for record in records:
        stack, call = list(record.stack), record.calls  # a snapshot (copying a list is atomic under the GIL)
        if not stack:
            record.seen = -1
        elif call != record.seen:
            record.seen, record.since = call, now
        elif call != record.quiet and now - record.since >= limit and not _ending:
            _fire(record, stack, call, now - record.since, limit)


def _fire(record: _Record, stack: list, call: int, waited: float, limit: float) -> None:
    global _ending
    comm = innermost(stack[0][1])
    MPI = sys.modules.get("mpi4py.MPI")
    real = MPI is not None and isinstance(comm, MPI.Comm)
    if real:
        _ending = True
        atexit.register(_exit_later)  # the rank's own work may end before the Abort: it must not leave with 0
    else:  # the simulator: one report per run (its other stalled ranks are quieted), and later runs are watched
        job = getattr(comm, "_world", comm)
        with _setup_lock:
            others = list(_records)
        for other in others:
            waits = list(other.stack)
            if waits and getattr(innermost(waits[0][1]), "_world", None) is job:
                other.quiet = other.calls
        record.quiet = call
    _write(_report(record, stack, call, waited, limit, MPI if real else None))
    if real:
        _end_job(MPI)  # does not return
    try:
        comm.Abort(EXIT_CODE)
    except BaseException:  # the simulator's Abort unwinds the calling thread: this one goes on watching
        pass


def _end_job(MPI) -> None:
    """End the whole MPI job from the monitor thread: MPI_Abort if MPI allows it, else (or if it hangs) os._exit."""
    threading.Thread(target=_exit_later, name="dtrain-watchdog-exit", daemon=True).start()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    time.sleep(FORWARD_S)  # mpiexec forwards the report before the Abort ends the job (as mpi.end_job waits)
    with contextlib.suppress(Exception):
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            MPI.COMM_WORLD.Abort(EXIT_CODE)
    os._exit(EXIT_CODE)


def _exit_later() -> None:
    time.sleep(ABORT_GRACE_S)
    os._exit(EXIT_CODE)


def _write(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(text)
        sys.stderr.flush()


# --- the report -------------------------------------------------------------------------------------------------
def _report(record: _Record, stack: list, call: int, waited: float, limit: float, MPI) -> str:
    """The three lines: who waits how long in what (and for whom); where in the code; what to do."""
    me, short = _whoami(innermost(stack[0][1]), MPI)
    noted = record.note
    entries = []  # (comm, what, peer, tag, dest, extra), outermost first
    for depth, frame in enumerate(stack):
        what, comm, peer, tag = frame
        entries.append([comm, what, peer, tag, None, f"call #{call}" if depth == 0 else None])
        if noted is not None and noted[0] is frame:
            entries.append([comm, *noted[1:], None])
    frames = _python_stack(record.thread)
    found = _exchange(frames)
    if found is not None:  # the exchange in progress: completes the same call's entry from WatchedComm, or is added
        if entries[-1][1] == found[1]:
            entries[-1][:5] = found
        else:
            entries.append([*found, None])
    parts, waits_for = [], None
    for comm, what, peer, tag, dest, extra in entries:
        text, who = _describe(innermost(comm), what, peer, tag, dest, MPI, extra)
        parts.append(text)
        waits_for = who or waits_for
    lines = [
        f"dtrain watchdog: {me} has waited {waited:.1f} s in {' > '.join(parts)}; one wait may last at most "
        f"{ENV_VAR}={limit:g} s: aborting the job (exit status {EXIT_CODE})"
    ]
    where = _where(frames)
    if where:
        lines.append(f"dtrain watchdog: {short} is at {where}")
    if waits_for is not None:
        culprit = waits_for.split(" (")[0]
        hint = (
            f"dtrain watchdog: {short} waits for {waits_for}: look at what {culprit} is doing (its own watchdog "
            "report, a traceback, its last output, a different call number)."
        )
    else:
        hint = (
            f"dtrain watchdog: {short} waits for the other ranks of {stack[-1][0]}: look for the rank that is not in "
            "this call (a crash, a longer computation, a different collective or call number)."
        )
    lines.append(hint + f" To wait longer set {ENV_VAR}=S or --timeout S; 0 turns the watchdog off.")
    return "\n".join(lines) + "\n"


def _describe(comm, what, peer, tag, dest, MPI, extra=None) -> tuple:
    """``Recv from rank 1 (tag 7)`` or ``allreduce/ring (call #3, peer rank 1)``, and the peer's name if any."""
    who = None if peer is None or peer == PROC_NULL else _rank_name(comm, peer, MPI)
    extras = [extra] if extra else []
    if what in _P2P:
        text = str(what) + (f" {'to' if what in _P2P_TO else 'from'} {who}" if who else "")
        if dest is not None and dest != PROC_NULL:
            text += f", to {_rank_name(comm, dest, MPI)}"
    else:
        text = str(what)
        if who:
            extras.append(f"peer {who}")
    if tag is not None and tag != ANY_TAG:
        extras.append(f"tag {tag}")
    return (f"{text} ({', '.join(extras)})" if extras else text), who


def _rank_name(comm, peer, MPI) -> str:
    """``rank 2``; ``any rank``; on a sub-communicator ``rank 1 (world rank 5)``."""
    if peer == ANY_SOURCE:
        return "any rank"
    world = None
    with contextlib.suppress(Exception):
        if MPI is None:
            if getattr(comm, "name", "world") != "world":
                world = comm._group[peer]
        elif MPI.Query_thread() >= MPI.THREAD_MULTIPLE and comm != MPI.COMM_WORLD:
            group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
            world = MPI.Group.Translate_ranks(group, [peer], world_group)[0]
            group.Free()
            world_group.Free()
    return f"rank {peer}" + (f" (world rank {world})" if world is not None and world != peer else "")


def _whoami(comm, MPI) -> tuple:
    """``rank 1 of 3 (host h, pid p)`` in the MPI world, ``simulated rank 1 of 3`` in the simulator; and ``rank 1``."""
    if MPI is None:
        world = getattr(comm, "_world", None)
        if world is not None and hasattr(comm, "_world_rank"):
            return f"simulated rank {comm._world_rank} of {world.nranks}", f"rank {comm._world_rank}"
        try:
            rank, size = comm.Get_rank(), comm.Get_size()
        except Exception:
            return "a rank", "it"
        return f"rank {rank} of {size}", f"rank {rank}"
    rank, size = _env_int("PMI_RANK", "OMPI_COMM_WORLD_RANK"), _env_int("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
    if rank is None or size is None:  # not started by Hydra or Open MPI's launcher: ask MPI
        try:
            rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        except Exception:
            rank, size = "?", "?"
    return f"rank {rank} of {size} (host {socket.gethostname()}, pid {os.getpid()})", f"rank {rank}"


def _env_int(*names):
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _python_stack(thread) -> list:
    """The waiting thread's Python frames, innermost first (what a debugger sees)."""
    frame = sys._current_frames().get(thread.ident)
    frames = []
    while frame is not None and len(frames) < 200:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _exchange(frames: list):
    """The innermost exchange in progress on that stack: (comm, call, peer, tag, dest), or None.

    Read from the local variables of :func:`dtrain.comm.sendrecv`, of :class:`WatchedComm`'s ``Send``/``Recv``, or
    of whatever handles a call's record (:mod:`dtrain.comm.wrapper`): ``forward``, or the ``p2p``/``collective`` of
    a wrapper or of the simulator's communicator.
    """
    package = sys.modules.get("dtrain.comm")
    sendrecv = getattr(getattr(package, "sendrecv", None), "__code__", None)
    for frame in frames:
        code = frame.f_code
        try:
            if code is sendrecv:
                found = frame.f_locals
                return found["comm"], "Sendrecv", found["source"], None, found["dest"]
            if code in _WATCHED_P2P:
                found = frame.f_locals
                name = code.co_name
                if name == "Send":
                    return found["self"].comm, name, found["dest"], found["tag"], None
                return found["self"].comm, name, found["source"], found["tag"], None
            if code.co_name in _RECORD_HANDLERS:
                found = frame.f_locals
                call = found.get("call")
                if not isinstance(call, (PointToPoint, Collective)):
                    continue
                comm = found["comm"] if code.co_name == "forward" else found["self"]
                if isinstance(call, Collective):
                    return comm, call.name, None, None, None
                peer, tag = (call.source, call.recvtag) if call.receives else (call.dest, call.sendtag)
                return comm, call.name, peer, tag, call.dest if call.name == "Sendrecv" else None
        except (KeyError, AttributeError):
            continue
    return None


# the folder holding the dtrain package, so dtrain's own files show as dtrain/... wherever it is installed
_PACKAGE_HOME = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).replace(os.sep, "/")


def _where(frames: list, count: int = 3) -> str:
    """``dtrain/collectives/ring.py:68 in reduce_scatter < script.py:9 in <module>``: the innermost frames that
    are not the communication layer's own plumbing (dtrain/comm, threading, runpy)."""
    shown = []
    for frame in frames:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/dtrain/comm/" in path or path.startswith("<frozen") or path.endswith(("/threading.py", "/contextlib.py")):
            continue
        short = (
            path[len(_PACKAGE_HOME) + 1 :] if path.startswith(_PACKAGE_HOME + "/dtrain/") else path.rsplit("/", 1)[-1]
        )
        shown.append(f"{short}:{frame.f_lineno} in {frame.f_code.co_name}")
        if len(shown) == count:
            break
    return " < ".join(shown)


# --- the wrapper ------------------------------------------------------------------------------------------------
class WatchedComm(CommWrapper):
    """A communicator on which blocking calls are watched waits.

    A ``Send`` or ``Recv`` made outside any other wait is a wait of its own, named with the rank it sends to or
    receives from and the tag: a paradigm's bare ``comm.Recv`` is watched too. Inside a wait (the exchanges of a
    collective) it opens nothing: the call shows on the Python stack that the monitor reads. MPI's own
    ``Barrier``/``Allreduce``/``Reduce``/``Bcast``, the pickled-object ``gather``, ``allgather``, ``bcast``,
    ``allreduce``, ``barrier``, and the collective ``Split``/``Split_type``/``Dup`` are waits (nested in an open one).
    Sub-communicators come back watched (:meth:`CommWrapper.sibling`).

    The calls a collective makes many times (``Sendrecv``, ``Isend``, ``Irecv``, ``Get_rank``, ``Get_size``) are
    the communicator's own methods, bound at construction: they cost nothing here, and their wait is the
    collective's. That is also why ``Send``/``Recv`` override mpi4py's signatures rather than
    :meth:`CommWrapper.p2p`: making a record of each call would cost about a microsecond, a tenth of a small
    all-reduce.
    """

    def __init__(self, comm):
        super().__init__(comm)  # (which binds Get_rank and Get_size)
        self.Sendrecv, self.Isend, self.Irecv = comm.Sendrecv, comm.Isend, comm.Irecv

    @property
    def tracer(self):  # asked on every collective: not an AttributeError raised through __getattr__ when absent
        return getattr(self.comm, "tracer", None)

    # --- point to point: a wait of its own outside any other wait -------------------------------------------------
    def Send(self, buf, dest: int, tag: int = 0) -> None:
        record = getattr(_local, "record", None)  # (inline: this runs on every exchange of a tree all-reduce)
        if _timeout is None or (record is not None and record.stack):
            return self.comm.Send(buf, dest, tag)
        token = begin(self.comm, "Send", dest, tag)
        try:
            self.comm.Send(buf, dest, tag)
        finally:
            end(token)

    def Recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> None:
        record = getattr(_local, "record", None)  # (inline: this runs on every exchange of a tree all-reduce)
        if _timeout is None or (record is not None and record.stack):
            return self.comm.Recv(buf, source, tag, status)
        token = begin(self.comm, "Recv", source, tag)
        try:
            self.comm.Recv(buf, source, tag, status)
        finally:
            end(token)

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> bool:
        """Waiting for any message (a server's loop) is a wait like a receive."""
        if _timeout is None:
            return self.comm.Probe(source, tag, status)
        token = begin(self.comm, "Probe", source, tag)
        try:
            return self.comm.Probe(source, tag, status)
        finally:
            end(token)

    # --- collectives: always a wait -------------------------------------------------------------------------------
    def collective(self, call):
        token = begin(self.comm, call.name)
        try:
            return forward(self.comm, call)
        finally:
            end(token)

    def _watched(self, name: str, call, *args, **kwargs):
        token = begin(self.comm, name)
        try:
            return call(*args, **kwargs)
        finally:
            end(token)

    def gather(self, obj, root: int = 0):
        return self._watched("gather", self.comm.gather, obj, root)

    def allgather(self, obj):
        return self._watched("allgather", self.comm.allgather, obj)

    def bcast(self, obj, root: int = 0):
        return self._watched("bcast", self.comm.bcast, obj, root)

    def allreduce(self, obj, *args, **kwargs):
        return self._watched("allreduce", self.comm.allreduce, obj, *args, **kwargs)

    def barrier(self):
        return self._watched("barrier", self.comm.barrier)

    def Split(self, color: int = 0, key: int = 0):
        return self._watched("Split", super().Split, color, key)

    def Split_type(self, split_type: int, key: int = 0, *args, **kwargs):
        return self._watched("Split_type", super().Split_type, split_type, key, *args, **kwargs)

    def Dup(self, *args, **kwargs):
        return self._watched("Dup", super().Dup, *args, **kwargs)


_WATCHED_P2P = (WatchedComm.Send.__code__, WatchedComm.Recv.__code__)

"""A simulated world of N ranks in one process: MPI's message semantics on threads, with exact deadlock detection.

What it is for:

* a notebook runs a ring all-reduce on 8 ranks and prints every message, step by step (``record=True``);
* unit tests run a collective on 2, 3, 5 or 8 ranks in milliseconds, without ``mpiexec``;
* a hang becomes an exception that says what every rank is waiting for.

Each rank is a thread running ``fn(comm, *args)``. ``comm`` is a :class:`SimComm` whose methods have the names and
signatures of mpi4py's buffer API (``Send``, ``Recv``, ``Sendrecv``, ``Isend``, ``Irecv``, ``Barrier``, ``Split`` ...),
so an algorithm written for ``MPI.COMM_WORLD`` runs here unchanged. The constants ``ANY_SOURCE``, ``ANY_TAG``,
``PROC_NULL``, ``IN_PLACE``, ``SUM``, ``MAX`` are mpi4py's own objects whenever mpi4py imports, so code written with
``MPI.ANY_SOURCE`` works on both.


**How deadlock detection decides.** All shared state (queues, collective meeting points, rank states) lives under
one lock. A rank that must wait records *what* it waits for, as a predicate over that state and a description, and
sleeps on its own condition variable. The predicates can only become true when some rank runs and changes the
state. So when the last running rank blocks or finishes, and no blocked rank's predicate holds, nothing can ever
change again: that is a deadlock, decided exactly, with no timers. Every rank is then woken and unwound, and
:meth:`SimWorld.run` raises :class:`SimDeadlock` naming each rank's state. A rank that loops forever in Python (or
polls ``Test()`` forever) is not blocked, so it is caught by the wall-clock ``timeout`` instead.


If ``fn`` raises on any rank, the others are woken out of their waits and ended (at their next communication call, if
they are computing), and ``run`` raises :class:`SimRankError` naming the rank, chained to the original exception.


What a message does on its way, eager and rendezvous sends, and the collectives: :mod:`dtrain.comm.simcomm`.

Example::

    import numpy as np
    from dtrain.comm import sim

    def exchange(comm):
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        out, got = np.full(4, comm.rank, dtype=np.float32), np.empty(4, dtype=np.float32)
        comm.Sendrecv(out, dest=right, recvbuf=got, source=left)
        return float(got[0])

    sim.run(4, exchange)                    # [3.0, 0.0, 1.0, 2.0]

    world = sim.SimWorld(4, record=True)
    world.run(exchange)
    for event in world.events:              # "#0 send rank 0 -> rank 1 tag=0 16 bytes (world)" ...
        print(event)
"""

from __future__ import annotations

import dataclasses
import threading

from dtrain.comm.names import ANY_SOURCE, ANY_TAG
from dtrain.comm.simcomm import (
    DEFAULT_EAGER_LIMIT,
    SimAbort,
    SimComm,
    SimCommError,
    SimDeadlock,
    SimError,
    SimRankError,
    SimRequest,
    SimStatus,
    SimTimeout,
    _Message,
    _Stopped,
)

__all__ = [
    "DEFAULT_EAGER_LIMIT", "SimAbort", "SimComm", "SimCommError", "SimDeadlock", "SimError", "SimEvent",
    "SimRankError", "SimRequest", "SimStatus", "SimTimeout", "SimWorld", "run", "solo",
]  # fmt: skip


_thread = threading.local()  # in a rank's thread: (its world, the run it belongs to)


@dataclasses.dataclass(frozen=True)
class SimEvent:
    """One entry of the log a ``SimWorld(record=True)`` keeps: ``rank`` sent to or received from ``peer``.

    ``seq`` orders all events of a run; ranks are world ranks (also on sub-communicators), ``comm`` names the
    communicator. A "recv" event is logged when the message is matched to a receive.
    """

    seq: int
    kind: str
    rank: int
    peer: int
    tag: int
    nbytes: int
    comm: str

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return (
            f"#{self.seq} {self.kind} rank {self.rank} {arrow} rank {self.peer} tag={self.tag} "
            f"{self.nbytes} bytes ({self.comm})"
        )


@dataclasses.dataclass(eq=False)
class _RankState:
    cond: threading.Condition
    state: str = "running"  # running, blocked, finished, failed, stopped
    ready: object = None  # while blocked: a function of the shared state, true once the wait can end
    describe: object = None  # while blocked: a string, or a function giving one, for deadlock reports


class SimWorld:
    """A world of ``nranks`` simulated ranks. ``run(fn, *args, **kwargs)`` runs ``fn(comm, ...)`` on each.

    ``eager_limit``: the largest message (bytes) a ``Send`` delivers without waiting for the receiver.
    ``timeout``: seconds a run may take before :class:`SimTimeout` (``None``: no limit).
    ``record``: keep the log of sends and receives of the last run in ``events``; ``verbose``: print it as it
    happens. ``cuda_aware``: its communicators take CuPy arrays as they are (see :class:`SimComm`).
    """

    def __init__(
        self,
        nranks: int,
        eager_limit: int = DEFAULT_EAGER_LIMIT,
        timeout: float | None = 60.0,
        record: bool = False,
        verbose: bool = False,
        cuda_aware: bool = False,
    ):
        if nranks < 1:
            raise ValueError(f"a world needs at least one rank, got {nranks}")
        self.nranks, self.eager_limit, self.timeout = nranks, eager_limit, timeout
        self.record, self.verbose, self.cuda_aware = record, verbose, cuda_aware
        self.events: list[SimEvent] = []
        self._lock = threading.Lock()
        self._running = False
        self._solo = False  # see solo()

    # --- running -------------------------------------------------------------------------------------------
    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(comm, *args, **kwargs)`` on every rank; return the results in rank order.

        Raises :class:`SimRankError` if ``fn`` raised on a rank, :class:`SimDeadlock`, :class:`SimTimeout` or
        :class:`SimAbort`.
        """
        with self._lock:
            if self._running:
                raise SimError("this SimWorld is already running; create another SimWorld for a nested run")
            self._running = True
            self._reset()
        threads = [
            threading.Thread(target=self._rank_main, args=(r, fn, args, kwargs), name=f"sim-rank-{r}", daemon=True)
            for r in range(self.nranks)
        ]
        try:
            for thread in threads:
                thread.start()
            # Every rank done, or the run ended early (a failure, a deadlock, an abort): a rank busy in Python code
            # (asleep, looping) is then left behind, and stopped at its next communication call.
            self._ended.wait(self.timeout)
            if self._stop is not None:
                for thread in threads:  # ranks waiting in a communication call unwind at once
                    thread.join(0.5)
            elif not self._ended.is_set():
                with self._lock:
                    report = self._report(f"timeout: the run did not finish within {self.timeout} s")
                self._stop_all(SimTimeout(report))
                for thread in threads:  # ranks waiting in a communication call unwind at once
                    thread.join(0.5)
        except BaseException:  # Ctrl-C in a notebook: do not leave rank threads asleep forever
            self._stop_all(SimError("the run was interrupted"))
            raise
        finally:
            with self._lock:
                self._running = False
        error = self._stop
        if isinstance(error, SimRankError):
            raise error from error.exception
        if error is not None:
            raise error
        return self._results

    def _reset(self) -> None:
        """Fresh state for a run (called under the lock)."""
        self.events = []
        self._ranks = [_RankState(threading.Condition(self._lock)) for _ in range(self.nranks)]
        self._unexpected = [[] for _ in range(self.nranks)]  # per destination: messages not yet received
        self._posted = [[] for _ in range(self.nranks)]  # per destination: receives not yet matched
        self._slots = {}  # (context, n) -> _Slot of a collective in progress
        self._contexts = 1  # context 0 is the world
        self._results = [None] * self.nranks
        self._seq = 0  # numbers the events, also when they are only printed
        self._stop = None  # the error that ends the run early, once there is one
        self._ended = threading.Event()  # set when every rank is done or the run is stopped
        self._run_id = getattr(self, "_run_id", 0) + 1  # a rank thread left behind by an earlier run is not of this one

    def _rank_main(self, rank: int, fn, args, kwargs) -> None:
        _thread.run = (self, self._run_id)
        comm = SimComm(self, 0, tuple(range(self.nranks)), rank, "world")
        state, results = self._ranks[rank], self._results  # this run's (a later run gets new ones)
        try:
            results[rank] = fn(comm, *args, **kwargs)
        except _Stopped:
            self._done(state, "stopped")
            return
        except BaseException as exc:  # anything, KeyboardInterrupt included, must end the other ranks too
            self._done(state, "failed")
            self._stop_all(SimRankError(rank, exc))
            return
        self._done(state, "finished")

    def _done(self, state: _RankState, how: str) -> None:
        with self._lock:
            state.state = how
            if _thread.run[1] != self._run_id:  # a rank left behind by an earlier run: nothing of this run's to do
                return
            if how == "finished":  # a rank finishing can leave the others waiting forever: the last chance to see it
                self._check_deadlock()
            if all(s.state in ("finished", "failed", "stopped") for s in self._ranks):
                self._ended.set()

    def _stop_all(self, error: SimError) -> None:
        """End the run with ``error`` (the first reason wins) and wake every rank so it unwinds."""
        with self._lock:
            if self._stop is None:
                self._stop = error
            for r in range(self.nranks):
                self._wake(r)
            self._ended.set()

    # --- waiting (all called with the lock held) -----------------------------------------------------------
    def _stopped(self) -> BaseException:
        """What a rank raises once the run is over: :class:`_Stopped` unwinds a rank's thread. A solo world has no
        thread to unwind, so its caller gets the error itself, and the world is usable again."""
        if self._solo:
            error, self._stop = self._stop, None
            return error
        return _Stopped()

    def _check_running(self) -> None:
        mine = getattr(_thread, "run", None)
        if mine is not None and mine[0] is self and mine[1] != self._run_id:  # left behind by an earlier run
            raise _Stopped()
        if self._stop is not None:
            raise self._stopped()
        if not self._running:
            raise SimError("this communicator belongs to a SimWorld run that has ended")

    def _wake(self, world_rank: int) -> None:
        self._ranks[world_rank].cond.notify_all()

    def _wait_until(self, world_rank: int, ready, describe) -> None:
        """Block rank ``world_rank`` until ``ready()``; detect a deadlock when it is the last to block."""
        self._check_running()
        if ready():
            return
        state = self._ranks[world_rank]
        state.state, state.ready, state.describe = "blocked", ready, describe
        try:
            self._check_deadlock()
            while True:
                if self._stop is not None:
                    raise self._stopped()
                if ready():
                    return
                state.cond.wait()
        finally:
            state.state, state.ready, state.describe = "running", None, None

    def _check_deadlock(self) -> None:
        """Deadlock: no rank is running and no blocked rank's wait is satisfied.

        Waits are only ever satisfied by a running rank, and a satisfied wait stays satisfied, so checking when a
        rank blocks or finishes (the moments the set of running ranks shrinks) is enough and never wrong.
        """
        alive = [s for s in self._ranks if s.state in ("running", "blocked")]
        if self._stop is not None or not alive:
            return
        if all(s.state == "blocked" and not s.ready() for s in alive):
            self._stop = SimDeadlock(
                self._report("deadlock: every unfinished rank is blocked and none of them can ever proceed")
            )
            for r in range(self.nranks):
                self._wake(r)
            self._ended.set()

    def _report(self, headline: str) -> str:
        """The headline, each rank's state, and messages that were sent but never received."""
        lines = [headline]
        for rank, s in enumerate(self._ranks):
            if s.state == "blocked":
                text = s.describe() if callable(s.describe) else s.describe
            elif s.state == "running":
                text = "running (in Python code, not in a communication call)"
            else:
                text = s.state
            lines.append(f"  rank {rank}: {text}")
        pending = [(dest, m) for dest, queue in enumerate(self._unexpected) for m in queue]
        if pending:
            lines.append("  messages waiting for a receive (check tags and sources):")
            for dest, m in pending[:10]:
                comm = m.send_request._comm
                lines.append(
                    f"    rank {comm._world_rank} -> rank {dest}: tag={m.tag}, {m.data.nbytes} bytes ({comm.name})"
                )
            if len(pending) > 10:
                lines.append(f"    ... and {len(pending) - 10} more")
        return "\n".join(lines)

    # --- matching (called with the lock held) --------------------------------------------------------------
    def _new_context(self) -> int:
        self._contexts += 1
        return self._contexts - 1

    @staticmethod
    def _matches(request: SimRequest, message: _Message) -> bool:
        return (
            request._comm._context == message.context
            and request._source in (ANY_SOURCE, message.source)
            and request._tag in (ANY_TAG, message.tag)
        )

    def _deliver(self, dest: int, message: _Message) -> None:
        """A message arrives at world rank ``dest``: give it to the oldest posted receive that fits, or queue it."""
        for i, request in enumerate(self._posted[dest]):
            if self._matches(request, message):
                del self._posted[dest][i]
                self._match(request, message)
                return
        self._unexpected[dest].append(message)
        self._wake(dest)  # a rank blocked in Probe waits for a queued message, not for a receive to match

    def _post_receive(self, dest: int, request: SimRequest) -> None:
        """A receive is posted at world rank ``dest``: take the oldest queued message that fits, or wait for one."""
        for i, message in enumerate(self._unexpected[dest]):
            if self._matches(request, message):
                del self._unexpected[dest][i]
                self._match(request, message)
                return
        self._posted[dest].append(request)

    def _match(self, request: SimRequest, message: _Message) -> None:
        comm = request._comm
        request._message, request._matched = message, True
        message.send_request._matched = True  # a rendezvous send may now return
        sender = comm._group[message.source]
        self._record("recv", comm._world_rank, sender, message.tag, message.data.nbytes, comm.name)
        self._wake(comm._world_rank)
        self._wake(sender)

    def _record(self, kind: str, rank: int, peer: int, tag: int, nbytes: int, comm: str) -> None:
        if not (self.record or self.verbose):
            return
        event = SimEvent(self._seq, kind, rank, peer, tag, nbytes, comm)
        self._seq += 1
        if self.record:
            self.events.append(event)
        if self.verbose:
            print(event, flush=True)


def solo() -> SimComm:
    """The world communicator of a one-rank world that needs no ``run``: what a process without MPI trains on.

    There is no thread to schedule: collectives complete at once (there is nobody to wait for), a message to
    oneself is delivered as usual, and a receive that nothing can satisfy raises :class:`SimDeadlock` at once.
    """
    world = SimWorld(1, timeout=None)
    world._solo = True
    with world._lock:
        world._reset()
        world._running = True
    return SimComm(world, 0, (0,), 0, "world")


def run(nranks: int, fn, *args, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``nranks`` simulated ranks with default settings; return the results."""
    return SimWorld(nranks).run(fn, *args, **kwargs)

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

**How a message travels.** ``Send`` copies the buffer (a snapshot: the sender may overwrite its array at once) and
posts it to the destination. Matching follows MPI: a receive takes the *oldest* message on the same communicator
whose source and tag fit (``ANY_SOURCE``/``ANY_TAG`` fit anything), so two messages from one sender with one tag
never overtake each other. A message that arrives before its receive waits in the destination's queue of unexpected
messages; a receive posted before its message waits in the queue of posted receives. Messages on different
communicators (``Split``, ``Dup``) never match each other. The receiver copies the message into its buffer; a
message larger than the buffer is an error (MPI's ``MPI_ERR_TRUNCATE``), and so is a dtype that differs from the
buffer's (MPI would silently reinterpret the bytes). A larger buffer is fine, as in MPI.

**Eager and rendezvous.** Real MPI sends a small message at once ("eager") and returns, but holds a large one until
the receiver has posted a matching receive ("rendezvous"), because it has nowhere to buffer megabytes. The simulator
does the same with ``eager_limit`` (64 KiB by default): a larger ``Send`` blocks until it is matched. So the classic
bug, both ranks ``Send`` a big buffer to each other before either receives, deadlocks here as it does under
``mpiexec`` — while the same code with small buffers works in both, which is why the bug survives small tests.
``Isend`` never blocks (its ``Wait`` does, for a large message), and ``Sendrecv`` never deadlocks pairwise.

**How deadlock detection decides.** All shared state (queues, collective meeting points, rank states) lives under
one lock. A rank that must wait records *what* it waits for, as a predicate over that state and a description, and
sleeps on its own condition variable. The predicates can only become true when some rank runs and changes the
state. So when the last running rank blocks or finishes, and no blocked rank's predicate holds, nothing can ever
change again: that is a deadlock, decided exactly, with no timers. Every rank is then woken and unwound, and
:meth:`SimWorld.run` raises :class:`SimDeadlock` naming each rank's state. A rank that loops forever in Python (or
polls ``Test()`` forever) is not blocked, so it is caught by the wall-clock ``timeout`` instead.

**Collectives.** ``Barrier``, ``Split``, ``Dup`` and the stand-ins for MPI's own collectives (``Allreduce``,
``Bcast``, ``Reduce``, and the pickled-object ``bcast``, ``gather``, ``allgather``, ``allreduce``) meet at a shared
slot: each rank's n-th collective call on a communicator meets every other rank's n-th call there, the last rank to
arrive combines the contributions (reductions in rank order, with NumPy), and everyone leaves with the result. They
are the simple, obviously right baseline the hand-written algorithms are compared with. Ranks whose n-th calls
differ (one calls ``Barrier``, another ``Bcast``) get an error instead of MPI's hang.

If ``fn`` raises on any rank, the others are woken out of their waits and ended (at their next communication call, if
they are computing), and ``run`` raises :class:`SimRankError` naming the rank, chained to the original exception.

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
import functools
import operator
import pickle
import threading
import time

import numpy as np

try:
    from mpi4py import MPI
except ImportError:  # the simulator works without MPI installed
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

# Each reduction op: (op object, NumPy ufunc for buffers, Python function for pickled objects, name).
# mpi4py's Op objects cannot be hashed, so this is a list searched by identity rather than a dict.
_OPS = [
    (SUM, np.add, operator.add, "SUM"),
    (MAX, np.maximum, max, "MAX"),
    (MIN, np.minimum, min, "MIN"),
    (PROD, np.multiply, operator.mul, "PROD"),
]

DEFAULT_EAGER_LIMIT = 64 * 1024


class SimError(RuntimeError):
    """Base class of everything the simulator raises."""


class SimCommError(SimError):
    """A communication call that MPI would reject: truncation, dtype mismatch, bad rank, mismatched collectives."""


class SimDeadlock(SimError):
    """Every rank still running is blocked, and no rank can ever unblock another. The message lists each rank."""


class SimTimeout(SimError):
    """The run did not finish within the world's wall-clock ``timeout``. The message lists each rank."""


class SimAbort(SimError):
    """A rank called ``Abort``."""

    def __init__(self, rank: int, errorcode: int):
        super().__init__(f"rank {rank} called Abort(errorcode={errorcode})")
        self.rank, self.errorcode = rank, errorcode


class SimRankError(SimError):
    """``fn`` raised on a rank; ``exception`` (also the ``__cause__``) is the original."""

    def __init__(self, rank: int, exception: BaseException):
        super().__init__(f"rank {rank} raised {type(exception).__name__}: {exception}")
        self.rank, self.exception = rank, exception


class _Stopped(BaseException):
    """Unwinds a rank's thread once the run is over (another rank failed, deadlock, abort, timeout).

    A ``BaseException``, so that a user's ``except Exception`` cannot swallow it and keep the rank alive.
    """


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


class SimStatus:
    """What a receive fills in: ``Get_source()``, ``Get_tag()``, ``Get_count()`` (bytes unless given a datatype).

    Receives also accept a real ``mpi4py.MPI.Status`` and fill it the same way.
    """

    def __init__(self):
        self.source, self.tag, self.nbytes = ANY_SOURCE, ANY_TAG, 0

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag

    def Get_count(self, datatype=None) -> int:
        if datatype is None:
            return self.nbytes
        size = datatype.Get_size() if hasattr(datatype, "Get_size") else np.dtype(datatype).itemsize
        return self.nbytes // size


def _fill_status(status, source: int, tag: int, nbytes: int) -> None:
    if status is None:
        return
    status.source, status.tag = source, tag
    if isinstance(status, SimStatus):
        status.nbytes = nbytes
    else:  # an mpi4py Status: its count is set through a datatype
        status.Set_elements(MPI.BYTE, nbytes)


def _flat_array(buf, call: str, writable: bool):
    """The 1-D array (in memory order, a view) that a buffer argument describes.

    Accepts what mpi4py accepts for the common cases: an array, ``[array, datatype]`` and ``[array, count,
    datatype]`` (the first ``count`` elements; the datatype is assumed to match the array's). ``None`` is an empty
    buffer. The array must be contiguous, as for mpi4py, so a strided slice fails here as it would under MPI.
    """
    count = None
    if isinstance(buf, (list, tuple)):
        if not 1 <= len(buf) <= 3:
            raise TypeError(f"{call}: a buffer list is [array], [array, datatype] or [array, count, datatype]")
        if len(buf) == 3:
            count = int(buf[1])
        buf = buf[0]
    if buf is None:
        return np.empty(0, dtype=np.uint8)
    if not isinstance(buf, np.ndarray):
        hint = " (move CuPy arrays to the host first)" if type(buf).__module__.startswith("cupy") else ""
        raise TypeError(f"{call}: the simulator communicates NumPy arrays, got {type(buf).__name__}{hint}")
    if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
        raise BufferError(f"{call}: the array is not contiguous (a strided slice?); MPI needs contiguous buffers")
    if writable and not buf.flags.writeable:
        raise BufferError(f"{call}: the receive buffer is read-only")
    flat = buf.ravel(order="K")  # a view, since the array is contiguous
    if count is not None:
        if not 0 <= count <= flat.size:
            raise SimCommError(f"{call}: count {count} does not fit an array of {flat.size} elements")
        flat = flat[:count]
    return flat


def _op_entry(op, call: str):
    for entry in _OPS:
        if op is entry[0]:
            return entry
    raise SimCommError(f"{call}: unsupported reduction op {op!r}; the simulator knows SUM, MAX, MIN and PROD")


def _show_source(source: int) -> str:
    return "ANY_SOURCE" if source == ANY_SOURCE else str(source)


def _show_tag(tag: int) -> str:
    return "ANY_TAG" if tag == ANY_TAG else str(tag)


@dataclasses.dataclass(eq=False)
class _Message:
    context: int  # which communicator: messages on different communicators never match
    source: int  # the sender's rank in that communicator
    tag: int
    data: np.ndarray  # the snapshot, 1-D
    send_request: SimRequest  # completes when the message is matched (rendezvous) or at once (eager)


@dataclasses.dataclass(eq=False)
class _Slot:
    """Where the ranks of a communicator meet for one collective call (their n-th collective on it)."""

    signature: tuple  # (call, root, op ...): every rank must make the same call
    values: list
    arrived: int = 0
    departed: int = 0
    result: object = None


@dataclasses.dataclass(eq=False)
class _RankState:
    cond: threading.Condition
    state: str = "running"  # running, blocked, finished, failed, stopped
    ready: object = None  # while blocked: a function of the shared state, true once the wait can end
    describe: object = None  # while blocked: a string, or a function giving one, for deadlock reports


class SimRequest:
    """The request of an ``Isend``/``Irecv``: ``Wait(status=None)`` blocks until done, ``Test()`` asks.

    A receive's data is copied into the buffer when ``Wait`` (or a successful ``Test``) completes it, in the
    receiving rank's own thread; size and dtype errors are raised there, as MPI reports them on completion.
    """

    def __init__(self, comm: SimComm, kind: str, what: str, buffer=None, source=None, tag=None):
        self._comm, self._kind, self._what = comm, kind, what
        self._buffer, self._source, self._tag = buffer, source, tag  # receives only
        self._matched = False  # send: the message was delivered; receive: a message was attached
        self._message = None
        self._finished = False

    def _complete(self) -> bool:
        return self._matched

    def _block(self, describe: str) -> None:
        world = self._comm._world
        with world._lock:
            world._wait_until(self._comm._world_rank, self._complete, describe)

    def _finish(self, status) -> None:
        """Copy a matched message into the receive buffer (once) and fill ``status``."""
        if self._finished or self._kind != "recv":
            self._finished = True
            return
        self._finished = True
        message = self._message
        if message is None:  # a receive from PROC_NULL: MPI reports an empty message from PROC_NULL
            _fill_status(status, PROC_NULL, ANY_TAG, 0)
            return
        data, buf, comm = message.data, self._buffer, self._comm
        where = f"rank {comm.rank} received from rank {message.source} (tag {message.tag}, {comm.name})"
        if data.size and data.dtype != buf.dtype:
            raise SimCommError(
                f"dtype mismatch: {where}: the message holds {data.dtype}, the receive buffer is {buf.dtype} "
                "(MPI would reinterpret the bytes silently)"
            )
        if data.size > buf.size:
            raise SimCommError(
                f"message truncated (MPI_ERR_TRUNCATE): {where}: {data.size} elements ({data.nbytes} bytes) "
                f"into a buffer of {buf.size} elements"
            )
        buf[: data.size] = data
        _fill_status(status, message.source, message.tag, data.nbytes)

    def Wait(self, status=None) -> bool:
        self._block(f"Wait({self._what})")
        self._finish(status)
        return True

    def Test(self, status=None) -> bool:
        world = self._comm._world
        with world._lock:
            world._check_running()
            done = self._complete()
        if done:
            self._finish(status)
        return done


class SimComm:
    """One rank's view of a simulated communicator, with mpi4py's method names and signatures.

    ``name`` says which communicator it is ("world", "world.split(1)", "world.dup" ...).
    """

    def __init__(self, world: SimWorld, context: int, group: tuple, rank: int, name: str):
        self._world = world
        self._context = context  # shared by every rank's SimComm of this communicator
        self._group = group  # world rank of each rank of this communicator
        self._rank, self._size = rank, len(group)
        self._world_rank = group[rank]
        self._collectives = 0  # how many collectives this rank has called on it: they meet in that order
        self._freed = False
        self.name = name

    def __repr__(self) -> str:
        return f"<SimComm {self.name} rank {self._rank} of {self._size}>"

    # --- who am I -------------------------------------------------------------------------------------------
    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def Get_name(self) -> str:
        return self.name

    # --- point to point ------------------------------------------------------------------------------------
    def _where(self) -> str:
        """Appended to descriptions of calls on a sub-communicator, whose ranks are not world ranks."""
        return "" if self.name == "world" else f" on {self.name}"

    def _check_peer(self, peer: int, call: str, role: str, wildcard: int | None = None) -> None:
        if self._freed:
            raise SimCommError(f"{call}: the communicator {self.name} has been freed")
        if peer == PROC_NULL or (wildcard is not None and peer == wildcard):
            return
        if not 0 <= peer < self._size:
            raise SimCommError(f"{call}: {role}={peer} is not a rank of {self.name} (size {self._size})")

    def _isend(self, buf, dest: int, tag: int, call: str) -> SimRequest:
        self._check_peer(dest, call, "dest")
        if tag < 0:
            raise SimCommError(f"{call}: tag must be >= 0, got {tag}")
        data = _flat_array(buf, call, writable=False)
        rendezvous = data.nbytes > self._world.eager_limit
        note = ", rendezvous: waiting for a matching receive" if rendezvous else ""
        what = f"{call}(dest={dest}, tag={tag}, {data.nbytes} bytes{note}){self._where()}"
        request = SimRequest(self, "send", what)
        if dest == PROC_NULL:
            request._matched = True
            return request
        message = _Message(self._context, self._rank, tag, data.copy(), request)  # the snapshot, outside the lock
        world = self._world
        with world._lock:
            world._check_running()
            request._matched = not rendezvous
            world._record("send", self._world_rank, self._group[dest], tag, data.nbytes, self.name)
            world._deliver(self._group[dest], message)
        return request

    def _irecv(self, buf, source: int, tag: int, call: str) -> SimRequest:
        self._check_peer(source, call, "source", wildcard=ANY_SOURCE)
        if tag < 0 and tag != ANY_TAG:
            raise SimCommError(f"{call}: tag must be >= 0 or ANY_TAG, got {tag}")
        buffer = _flat_array(buf, call, writable=True)
        what = f"{call}(source={_show_source(source)}, tag={_show_tag(tag)}){self._where()}"
        request = SimRequest(self, "recv", what, buffer, source, tag)
        if source == PROC_NULL:
            request._matched = True
            return request
        world = self._world
        with world._lock:
            world._check_running()
            world._post_receive(self._world_rank, request)
        return request

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        request = self._isend(buf, dest, tag, "Send")
        request._block(request._what)

    def Recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> None:
        request = self._irecv(buf, source, tag, "Recv")
        request._block(request._what)
        request._finish(status)

    def Isend(self, buf, dest: int, tag: int = 0) -> SimRequest:
        return self._isend(buf, dest, tag, "Isend")

    def Irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> SimRequest:
        return self._irecv(buf, source, tag, "Irecv")

    def Sendrecv(
        self,
        sendbuf,
        dest: int,
        sendtag: int = 0,
        recvbuf=None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status=None,
    ) -> None:
        # Both halves are posted before either is waited for: that is why Sendrecv cannot deadlock pairwise.
        send = self._isend(sendbuf, dest, sendtag, "Sendrecv")
        recv = self._irecv(recvbuf, source, recvtag, "Sendrecv")
        recv._block(
            f"Sendrecv(dest={dest}, sendtag={sendtag}, source={_show_source(source)}, "
            f"recvtag={_show_tag(recvtag)}){self._where()}: waiting to receive"
        )
        recv._finish(status)
        send._block(send._what)

    # --- collectives ---------------------------------------------------------------------------------------
    def _collective(self, signature: tuple, value=None, combine=None):
        """Meet every rank of this communicator in its next collective call; return (all values, combined).

        Each rank counts its own collective calls on this communicator, and the n-th calls of all ranks meet in
        one slot. ``combine(values)`` runs once, under the lock, in the last rank to arrive. A rank whose n-th
        call differs from the others' (Barrier against Bcast, another root) is an error MPI would hang on.
        """
        if self._freed:
            raise SimCommError(f"{signature[0]}: the communicator {self.name} has been freed")
        world = self._world
        key = (self._context, self._collectives)
        self._collectives += 1
        with world._lock:
            world._check_running()
            slot = world._slots.get(key)
            if slot is None:
                slot = world._slots[key] = _Slot(signature, [None] * self._size)
            elif slot.signature != signature:
                first = next(r for r, v in enumerate(slot.values) if v is not None)
                raise SimCommError(
                    f"collective mismatch on {self.name}: rank {self._rank} called {_call_text(signature)} while "
                    f"rank {first} called {_call_text(slot.signature)}; every rank must make the same "
                    "collective calls in the same order"
                )
            slot.values[self._rank] = (value,)  # wrapped, so a None value still counts as "arrived"
            slot.arrived += 1
            if slot.arrived == self._size:
                slot.result = combine([v[0] for v in slot.values]) if combine else None
                for member in self._group:
                    world._wake(member)

            def waiting_for():
                missing = [r for r, v in enumerate(slot.values) if v is None]
                return f"{_call_text(signature)}{self._where()}: waiting for rank(s) {missing} to call it"

            world._wait_until(self._world_rank, lambda: slot.arrived == self._size, waiting_for)
            slot.departed += 1
            if slot.departed == self._size:
                del world._slots[key]
            return [v[0] for v in slot.values], slot.result

    def Barrier(self) -> None:
        self._collective(("Barrier",))

    def barrier(self) -> None:
        self.Barrier()

    def Allreduce(self, sendbuf, recvbuf, op=SUM) -> None:
        """MPI's own all-reduce, simulated the obvious way: every rank's buffer summed in rank order by NumPy."""
        _, ufunc, _, opname = _op_entry(op, "Allreduce")
        recv = _flat_array(recvbuf, "Allreduce", writable=True)
        send = recv if sendbuf is IN_PLACE else _flat_array(sendbuf, "Allreduce", writable=False)
        _, result = self._collective(("Allreduce", opname), send.copy(), _reducer(ufunc, "Allreduce"))
        _copy_result(result, recv, "Allreduce")

    def Reduce(self, sendbuf, recvbuf, op=SUM, root: int = 0) -> None:
        _, ufunc, _, opname = _op_entry(op, "Reduce")
        self._check_peer(root, "Reduce", "root")
        recv = _flat_array(recvbuf, "Reduce", writable=True) if self._rank == root else None
        send = recv if sendbuf is IN_PLACE else _flat_array(sendbuf, "Reduce", writable=False)
        _, result = self._collective(("Reduce", opname, root), send.copy(), _reducer(ufunc, "Reduce"))
        if self._rank == root:
            _copy_result(result, recv, "Reduce")

    def Bcast(self, buf, root: int = 0) -> None:
        self._check_peer(root, "Bcast", "root")
        flat = _flat_array(buf, "Bcast", writable=self._rank != root)
        values, _ = self._collective(("Bcast", root), flat.copy() if self._rank == root else None)
        if self._rank != root:
            _copy_result(values[root], flat, "Bcast")

    # Lowercase methods communicate Python objects, pickled as mpi4py does (so an unpicklable object fails here too).
    def bcast(self, obj, root: int = 0):
        self._check_peer(root, "bcast", "root")
        values, _ = self._collective(("bcast", root), pickle.dumps(obj) if self._rank == root else None)
        return obj if self._rank == root else pickle.loads(values[root])

    def gather(self, obj, root: int = 0):
        self._check_peer(root, "gather", "root")
        values, _ = self._collective(("gather", root), pickle.dumps(obj))
        return [pickle.loads(v) for v in values] if self._rank == root else None

    def allgather(self, obj) -> list:
        values, _ = self._collective(("allgather",), pickle.dumps(obj))
        return [pickle.loads(v) for v in values]

    def allreduce(self, obj, op=SUM):
        _, _, function, opname = _op_entry(op, "allreduce")
        values, _ = self._collective(("allreduce", opname), pickle.dumps(obj))
        return functools.reduce(function, [pickle.loads(v) for v in values])

    # --- communicators -------------------------------------------------------------------------------------
    def _split(self, color: int, key: int, call: str, name: str):
        world = self._world

        def new_contexts(values):  # one fresh context per colour, chosen once for everyone
            colours = dict.fromkeys(c for c, _ in values if c != UNDEFINED)  # each colour once, in rank order
            return {c: world._new_context() for c in colours}

        values, contexts = self._collective((call,), (color, key), new_contexts)
        if color == UNDEFINED:
            return None  # MPI returns COMM_NULL, which is falsy like None
        # The new ranks are ordered by key, ties broken by the old rank (MPI's rule).
        members = sorted((k, r) for r, (c, k) in enumerate(values) if c == color)
        old_ranks = [r for _, r in members]
        group = tuple(self._group[r] for r in old_ranks)
        return SimComm(world, contexts[color], group, old_ranks.index(self._rank), name)

    def Split(self, color: int = 0, key: int = 0):
        """Collective: ranks passing the same ``color`` form a new communicator, ordered by ``key``."""
        return self._split(color, key, "Split", f"{self.name}.split({color})")

    def Split_type(self, split_type: int, key: int = 0, info=None):
        """Split by node: every simulated rank lives on the one node, so all land in one communicator."""
        color = UNDEFINED if split_type == UNDEFINED else 0
        return self._split(color, key, "Split_type", f"{self.name}.node")

    def Dup(self):
        return self._split(0, self._rank, "Dup", f"{self.name}.dup")

    def Free(self) -> None:
        if self.name == "world":
            raise SimCommError("Free: the world communicator cannot be freed")
        self._freed = True

    def Abort(self, errorcode: int = 1):
        """End the whole run, as ``MPI_Abort`` ends the job: ``run`` raises :class:`SimAbort`."""
        self._world._stop_all(SimAbort(self._world_rank, errorcode))
        raise _Stopped


def _call_text(signature: tuple) -> str:
    call, *details = signature
    return f"{call}({', '.join(map(str, details))})"


def _reducer(ufunc, call: str):
    """``combine`` for a reduction collective: check every rank sent the same shape, then fold in rank order."""

    def combine(values):
        first = values[0]
        for rank, value in enumerate(values):
            if value.size != first.size or value.dtype != first.dtype:
                raise SimCommError(
                    f"{call}: rank {rank} passed {value.size} {value.dtype} elements, rank 0 passed "
                    f"{first.size} {first.dtype}; every rank must pass the same count and dtype"
                )
        total = first.copy()
        for value in values[1:]:
            ufunc(total, value, out=total)
        return total

    return combine


def _copy_result(result: np.ndarray, dest: np.ndarray, call: str) -> None:
    if result.size != dest.size or result.dtype != dest.dtype:
        raise SimCommError(
            f"{call}: the buffer holds {dest.size} {dest.dtype} elements but the result has {result.size} "
            f"{result.dtype}; every rank must pass the same count and dtype"
        )
    dest[:] = result


class SimWorld:
    """A world of ``nranks`` simulated ranks. ``run(fn, *args, **kwargs)`` runs ``fn(comm, ...)`` on each.

    ``eager_limit``: the largest message (bytes) a ``Send`` delivers without waiting for the receiver.
    ``timeout``: seconds a run may take before :class:`SimTimeout` (``None``: no limit).
    ``record``: keep the log of sends and receives of the last run in ``events``; ``verbose``: print it as it
    happens.
    """

    def __init__(
        self,
        nranks: int,
        eager_limit: int = DEFAULT_EAGER_LIMIT,
        timeout: float | None = 60.0,
        record: bool = False,
        verbose: bool = False,
    ):
        if nranks < 1:
            raise ValueError(f"a world needs at least one rank, got {nranks}")
        self.nranks, self.eager_limit, self.timeout = nranks, eager_limit, timeout
        self.record, self.verbose = record, verbose
        self.events: list[SimEvent] = []
        self._lock = threading.Lock()
        self._running = False

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
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            for thread in threads:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in threads):
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

    def _rank_main(self, rank: int, fn, args, kwargs) -> None:
        comm = SimComm(self, 0, tuple(range(self.nranks)), rank, "world")
        state = self._ranks[rank]
        try:
            self._results[rank] = fn(comm, *args, **kwargs)
        except _Stopped:
            with self._lock:
                state.state = "stopped"
            return
        except BaseException as exc:  # anything, KeyboardInterrupt included, must end the other ranks too
            with self._lock:
                state.state = "failed"
            self._stop_all(SimRankError(rank, exc))
            return
        with self._lock:
            state.state = "finished"
            # A rank finishing can leave the others waiting for it forever: the last chance to see it.
            self._check_deadlock()

    def _stop_all(self, error: SimError) -> None:
        """End the run with ``error`` (the first reason wins) and wake every rank so it unwinds."""
        with self._lock:
            if self._stop is None:
                self._stop = error
            for r in range(self.nranks):
                self._wake(r)

    # --- waiting (all called with the lock held) -----------------------------------------------------------
    def _check_running(self) -> None:
        if self._stop is not None:
            raise _Stopped
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
                    raise _Stopped
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


def run(nranks: int, fn, *args, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``nranks`` simulated ranks with default settings; return the results."""
    return SimWorld(nranks).run(fn, *args, **kwargs)

"""The communicator of a simulated world: mpi4py's buffer API over queues that threads share (:mod:`dtrain.comm.sim`).

A :class:`SimComm` is one rank's view of a communicator of a :class:`~dtrain.comm.sim.SimWorld`. Its methods have the
names and signatures of mpi4py's (``Send``, ``Recv``, ``Sendrecv``, ``Isend``, ``Irecv``, ``Barrier``, ``Split`` ...),
and the constants are those of :mod:`dtrain.comm.names` (mpi4py's own objects whenever mpi4py imports), so an
algorithm written for ``MPI.COMM_WORLD`` runs here unchanged. All shared state belongs to the world and is touched
only under its lock; this file says what each call does to that state, :mod:`dtrain.comm.sim` how ranks wait.

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


**Collectives.** ``Barrier``, ``Split``, ``Dup`` and the stand-ins for MPI's own collectives (``Allreduce``,
``Bcast``, ``Reduce``, and the pickled-object ``bcast``, ``gather``, ``allgather``, ``allreduce``) meet at a shared
slot: each rank's n-th collective call on a communicator meets every other rank's n-th call there, the last rank to
arrive combines the contributions (reductions in rank order, with NumPy), and everyone leaves with the result. They
are the simple, obviously right baseline the hand-written algorithms are compared with. Ranks whose n-th calls
differ (one calls ``Barrier``, another ``Bcast``) get an error instead of MPI's hang.

"""

from __future__ import annotations

import dataclasses
import functools
import pickle

import numpy as np

from dtrain.comm.names import (
    ANY_SOURCE,
    ANY_TAG,
    IN_PLACE,
    MPI,
    PROC_NULL,
    SUM,
    UNDEFINED,
    op_entry,
    show_source,
    show_tag,
)
from dtrain.comm.wrapper import CallRecords, Collective, PointToPoint

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


def _flat_array(buf, call: str, writable: bool, device_arrays: bool = False):
    """The 1-D array (in memory order, a view) that a buffer argument describes.

    Accepts what mpi4py accepts for the common cases: an array, ``[array, datatype]`` and ``[array, count,
    datatype]`` (the first ``count`` elements; the datatype is assumed to match the array's). ``None`` is an empty
    buffer. The array must be contiguous, as for mpi4py, so a strided slice fails here as it would under MPI.
    ``device_arrays``: CuPy arrays are accepted too (a CUDA-aware world: they are copied GPU to GPU).
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
    on_device = device_arrays and type(buf).__module__.startswith("cupy")
    if not isinstance(buf, np.ndarray) and not on_device:
        hint = ""
        if type(buf).__module__.startswith("cupy"):
            hint = " (move CuPy arrays to the host first, or make the world with SimWorld(cuda_aware=True))"
        raise TypeError(f"{call}: the simulator communicates NumPy arrays, got {type(buf).__name__}{hint}")
    if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
        raise BufferError(f"{call}: the array is not contiguous (a strided slice?); MPI needs contiguous buffers")
    if writable and not on_device and not buf.flags.writeable:
        raise BufferError(f"{call}: the receive buffer is read-only")
    flat = buf.ravel(order="C" if buf.flags.c_contiguous else "F")  # a view, since the array is contiguous
    if count is not None:
        if not 0 <= count <= flat.size:
            raise SimCommError(f"{call}: count {count} does not fit an array of {flat.size} elements")
        flat = flat[:count]
    return flat


def _op_entry(op, call: str):
    entry = op_entry(op)
    if entry is not None:
        return entry
    raise SimCommError(f"{call}: unsupported reduction op {op!r}; the simulator knows SUM, MAX, MIN and PROD")


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


class SimComm(CallRecords):
    """One rank's view of a simulated communicator, with mpi4py's method names and signatures.

    ``cuda_aware``: its world's (``SimWorld(cuda_aware=...)``, False by default): False, it communicates NumPy arrays
    only, as an MPI without CUDA would; True, CuPy arrays too, copied on the GPU, as a CUDA-aware MPI moves them over
    NVLink (GPU staging reads this, to decide whether to stage).

    ``name`` says which communicator it is ("world", "world.split(1)", "world.dup" ...).
    """

    def __init__(self, world, context: int, group: tuple, rank: int, name: str):
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

    @property
    def cuda_aware(self) -> bool:
        return getattr(self._world, "cuda_aware", False)

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
        data = _flat_array(buf, call, writable=False, device_arrays=self.cuda_aware)
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
        buffer = _flat_array(buf, call, writable=True, device_arrays=self.cuda_aware)
        what = f"{call}(source={show_source(source)}, tag={show_tag(tag)}){self._where()}"
        request = SimRequest(self, "recv", what, buffer, source, tag)
        if source == PROC_NULL:
            request._matched = True
            return request
        world = self._world
        with world._lock:
            world._check_running()
            world._post_receive(self._world_rank, request)
        return request

    @staticmethod
    def new_status() -> SimStatus:
        return SimStatus()

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> bool:
        """Wait until a message that a receive from ``source`` with ``tag`` would match has arrived; leave it queued
        and describe it in ``status`` (source, tag, bytes), so the receive can pick the right buffer."""
        self._check_peer(source, "Probe", "source", wildcard=ANY_SOURCE)
        if source == PROC_NULL:
            _fill_status(status, PROC_NULL, ANY_TAG, 0)
            return True
        probe = SimRequest(self, "recv", "Probe", None, source, tag)  # matched like a receive, never posted
        world, found = self._world, []

        def arrived() -> bool:
            found[:] = [m for m in world._unexpected[self._world_rank] if world._matches(probe, m)][:1]
            return bool(found)

        with world._lock:
            world._wait_until(
                self._world_rank, arrived, f"Probe(source={show_source(source)}, tag={show_tag(tag)}){self._where()}"
            )
        _fill_status(status, found[0].source, found[0].tag, found[0].data.nbytes)
        return True

    def p2p(self, call: PointToPoint):
        """Send, Recv, Sendrecv, Isend, Irecv: post the halves the call has, then wait unless it is non-blocking.

        Both halves of a Sendrecv are posted before either is waited for: that is why it cannot deadlock pairwise.
        """
        name = call.name
        send = self._isend(call.sendbuf, call.dest, call.sendtag, name) if call.sends else None
        recv = self._irecv(call.recvbuf, call.source, call.recvtag, name) if call.receives else None
        if name in ("Isend", "Irecv"):
            return send if send is not None else recv
        if recv is not None:
            if send is None:
                recv._block(recv._what)
            else:
                recv._block(
                    f"Sendrecv(dest={call.dest}, sendtag={call.sendtag}, source={show_source(call.source)}, "
                    f"recvtag={show_tag(call.recvtag)}){self._where()}: waiting to receive"
                )
            recv._finish(call.status)
        if send is not None:
            send._block(send._what)
        return None

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

    def collective(self, call: Collective) -> None:
        """MPI's own collectives, simulated the obvious way (reductions: all ranks' buffers in rank order, by NumPy)."""
        name, root = call.name, call.root
        if name == "Barrier":
            self._collective(("Barrier",))
            return
        if root is not None:
            self._check_peer(root, name, "root")
        if name == "Bcast":
            flat = _flat_array(call.recvbuf, "Bcast", writable=self._rank != root, device_arrays=self.cuda_aware)
            values, _ = self._collective(("Bcast", root), flat.copy() if self._rank == root else None)
            if self._rank != root:
                _copy_result(values[root], flat, "Bcast")
            return
        # Allreduce, Reduce: only Reduce's non-root ranks have no result to receive
        _, ufunc, _, opname = _op_entry(call.op, name)
        receives = name == "Allreduce" or self._rank == root
        recv = _flat_array(call.recvbuf, name, writable=True, device_arrays=self.cuda_aware) if receives else None
        send = recv if call.sendbuf is IN_PLACE else _flat_array(call.sendbuf, name, False, self.cuda_aware)
        signature = ("Allreduce", opname) if name == "Allreduce" else ("Reduce", opname, root)
        _, result = self._collective(signature, send.copy(), _reducer(ufunc, name))
        if receives:
            _copy_result(result, recv, name)

    def barrier(self) -> None:
        self.Barrier()

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

    def Allocate_shared(self, nbytes: int) -> list:
        """Collective: a shared window of ``nbytes`` on this rank (:mod:`dtrain.comm.windows`). Simulated ranks share
        one process, so the window is one zeroed byte array per rank, made once by the last rank to arrive."""
        _, segments = self._collective(("Allocate_shared",), nbytes, lambda sizes: [
            np.zeros(size, dtype=np.uint8) for size in sizes])  # fmt: skip  # (each rank's own size, as in MPI)
        return segments

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
        if self._freed:  # (MPI: the handle is COMM_NULL after the first Free, and freeing it is an error)
            raise SimCommError(f"Free: the communicator {self.name} has been freed already")
        self._freed = True

    def Abort(self, errorcode: int = 1):
        """End the whole run, as ``MPI_Abort`` ends the job: ``run`` raises :class:`SimAbort`."""
        self._world._stop_all(SimAbort(self._world_rank, errorcode))
        with self._world._lock:
            raise self._world._stopped()


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

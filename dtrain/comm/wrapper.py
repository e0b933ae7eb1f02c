"""The one base of every communicator wrapper: a wrapper sees each call as a record and decides what to do with it.

dtrain stacks communicators: the tracer counts what passes through, GPU staging swaps device buffers for host ones,
the watchdog notes who a rank is waiting for. Each is a :class:`CommWrapper` around the communicator below it, and
they nest in any order over a real ``mpi4py`` communicator or a simulated one::

    WatchedComm( TracedComm( StagedComm( MPI.COMM_WORLD ) ) )        (what dtrain.comm.prepare builds)

**Calls become records.** :class:`CallRecords` spells mpi4py's signatures once (for the wrappers and for the
simulator's communicator alike). Each point-to-point call (``Send``, ``Recv``,
``Sendrecv``, ``Isend``, ``Irecv``) becomes a :class:`PointToPoint` record and goes to :meth:`CommWrapper.p2p`; each
of MPI's own blocking collectives (``Barrier``, ``Allreduce``, ``Reduce``, ``Bcast``) becomes a :class:`Collective`
and goes to :meth:`CommWrapper.collective`. A wrapper overrides those two methods: it may look at the record (the
tracer counts its bytes), change it (staging puts host buffers in it) and hands it on with :func:`forward`, which
makes the call on the communicator below. Everything else (``Get_rank``, the pickled-object methods ``gather``,
``bcast`` ...) is forwarded untouched by ``__getattr__``.

**Sub-communicators come back wrapped.** ``Split``, ``Split_type`` and ``Dup`` of a wrapper return the same kind of
wrapper around the new communicator (:meth:`CommWrapper.sibling`), so the node communicators of a hierarchical
all-reduce are traced, staged and watched like the world they came from. ``None``/``COMM_NULL`` pass through. A
wrapper remembers what was made from it: :meth:`CommWrapper.free_made` frees all of it, newest first (the driver does
at the end of a run, so a paradigm need not free its sub-communicators itself), and ``Free`` of a wrapper frees what
was made from it first, once.

**Requests.** ``Isend``/``Irecv`` return whatever the wrapped communicator returned; a wrapper that must act when a
request completes (staging copies received data up; the tracer times the wait) returns a :class:`RequestWrapper`.

:func:`innermost` reaches through any number of wrappers to the communicator or request underneath; nothing above
``dtrain/comm/`` needs to know which wrappers exist.
"""

from __future__ import annotations

import dataclasses

from dtrain.comm.names import ANY_SOURCE, ANY_TAG, SUM


@dataclasses.dataclass(slots=True)
class PointToPoint:
    """One point-to-point call: ``name`` is Send, Recv, Sendrecv, Isend or Irecv; unused fields stay None."""

    name: str
    sendbuf: object = None
    dest: int | None = None
    sendtag: int = 0
    recvbuf: object = None
    source: int | None = None
    recvtag: int | None = None
    status: object = None

    @property
    def sends(self) -> bool:
        return self.dest is not None

    @property
    def receives(self) -> bool:
        return self.source is not None


@dataclasses.dataclass(slots=True)
class Collective:
    """One call of MPI's own collectives: ``name`` is Barrier, Allreduce, Reduce or Bcast."""

    name: str
    sendbuf: object = None  # Allreduce, Reduce (IN_PLACE allowed)
    recvbuf: object = None  # Allreduce, Reduce; Bcast's buffer
    op: object = None
    root: int | None = None


def forward(comm, call):
    """Make ``call`` (a :class:`PointToPoint` or :class:`Collective` record) on ``comm``; return what it returns."""
    name = call.name
    if name == "Sendrecv":
        return comm.Sendrecv(
            call.sendbuf, call.dest, call.sendtag, call.recvbuf, call.source, call.recvtag, call.status
        )
    if name == "Isend":
        return comm.Isend(call.sendbuf, call.dest, call.sendtag)
    if name == "Irecv":
        return comm.Irecv(call.recvbuf, call.source, call.recvtag)
    if name == "Send":
        return comm.Send(call.sendbuf, call.dest, call.sendtag)
    if name == "Recv":
        return comm.Recv(call.recvbuf, call.source, call.recvtag, call.status)
    if name == "Allreduce":
        return comm.Allreduce(call.sendbuf, call.recvbuf, call.op)
    if name == "Reduce":
        return comm.Reduce(call.sendbuf, call.recvbuf, call.op, call.root)
    if name == "Bcast":
        return comm.Bcast(call.recvbuf, call.root)
    if name == "Barrier":
        return comm.Barrier()
    raise ValueError(f"forward: unknown call {name!r}")


class CallRecords:
    """mpi4py's buffer API, spelled once: each call becomes a record handed to :meth:`p2p` or :meth:`collective`.

    The base of every wrapper, and of the simulator's communicator, which implements the two methods natively.
    """

    def p2p(self, call: PointToPoint):
        raise TypeError(f"{type(self).__name__} does not handle point-to-point calls")

    def collective(self, call: Collective):
        raise TypeError(f"{type(self).__name__} does not handle MPI's collectives")

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        self.p2p(PointToPoint("Send", sendbuf=buf, dest=dest, sendtag=tag))

    def Recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> None:
        self.p2p(PointToPoint("Recv", recvbuf=buf, source=source, recvtag=tag, status=status))

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
        self.p2p(PointToPoint("Sendrecv", sendbuf, dest, sendtag, recvbuf, source, recvtag, status))

    def Isend(self, buf, dest: int, tag: int = 0):
        return self.p2p(PointToPoint("Isend", sendbuf=buf, dest=dest, sendtag=tag))

    def Irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG):
        return self.p2p(PointToPoint("Irecv", recvbuf=buf, source=source, recvtag=tag))

    def Barrier(self) -> None:
        self.collective(Collective("Barrier"))

    def Allreduce(self, sendbuf, recvbuf, op=SUM) -> None:
        self.collective(Collective("Allreduce", sendbuf, recvbuf, op))

    def Reduce(self, sendbuf, recvbuf, op=SUM, root: int = 0) -> None:
        self.collective(Collective("Reduce", sendbuf, recvbuf, op, root))

    def Bcast(self, buf, root: int = 0) -> None:
        self.collective(Collective("Bcast", recvbuf=buf, root=root))


class CommWrapper(CallRecords):
    """A communicator around ``comm``. Subclasses override :meth:`p2p`, :meth:`collective` and :meth:`sibling`."""

    def __init__(self, comm):
        self.comm = comm
        self.made: list[CommWrapper] = []  # sub-communicators made from this one, oldest first
        self.freed = False
        # asked on every collective call: bound once here rather than looked up through __getattr__ each time
        for name in ("Get_rank", "Get_size"):
            if hasattr(comm, name):  # (a stand-in communicator in a test may lack one)
                setattr(self, name, getattr(comm, name))

    def __getattr__(self, name):
        if name == "comm":  # not yet set (copying, unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.comm, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.comm!r})"

    def p2p(self, call: PointToPoint):
        """Handle one point-to-point call (by default: pass it on unchanged)."""
        return forward(self.comm, call)

    def collective(self, call: Collective):
        """Handle one of MPI's own collectives (by default: pass it on unchanged)."""
        return forward(self.comm, call)

    def sibling(self, comm):
        """The same kind of wrapper, sharing this one's state, around a sub-communicator ``comm``."""
        return type(self)(comm)

    # --- sub-communicators come back wrapped, and are remembered until freed ---------------------------------
    def _sub(self, comm):
        if not comm:  # None / COMM_NULL (falsy) pass through
            return comm
        sub = self.sibling(comm)
        self.made = [*(made for made in self.made if not made.freed), sub]  # (those freed already are forgotten)
        return sub

    def free_made(self) -> None:
        """Free every communicator made from this one and not yet freed (and what was made from those), newest
        first. A collective over each of them, like ``Free``: every rank that made one calls it."""
        while self.made:
            self.made.pop().Free()

    def Free(self) -> None:
        """Free what was made from this communicator, then the communicator (a second call does nothing)."""
        if not self.freed:
            self.free_made()
            self.freed = True
            self.comm.Free()

    def Split(self, color: int = 0, key: int = 0):
        return self._sub(self.comm.Split(color, key))

    def Split_type(self, split_type: int, key: int = 0, *args, **kwargs):
        return self._sub(self.comm.Split_type(split_type, key, *args, **kwargs))

    def Dup(self, *args, **kwargs):
        return self._sub(self.comm.Dup(*args, **kwargs))


class RequestWrapper:
    """A request around ``request``: :meth:`completed` runs once, when ``Wait`` or a successful ``Test`` finishes it."""

    def __init__(self, request):
        self.request = request

    def __getattr__(self, name):
        if name == "request":  # not yet set (copying, unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.request, name)

    def completed(self) -> None:
        """Called once the request has completed (override)."""

    def Wait(self, status=None):
        result = self.request.Wait(status)
        self.completed()
        return result

    def Test(self, status=None):
        done = self.request.Test(status)
        if done:
            self.completed()
        return done


def innermost(obj):
    """The communicator (or request) under any number of :class:`CommWrapper` (:class:`RequestWrapper`) layers."""
    while True:
        if isinstance(obj, CommWrapper):
            obj = obj.comm
        elif isinstance(obj, RequestWrapper):
            obj = obj.request
        else:
            return obj


def layers(comm) -> list:
    """The wrappers around ``comm``, outermost first, then the communicator itself (for a lesson to print)."""
    chain = [comm]
    while isinstance(chain[-1], CommWrapper):
        chain.append(chain[-1].comm)
    return chain

"""Counting what an algorithm communicates: bytes, messages and time per rank and per operation, and a timeline.

Wrap any communicator, simulated or real, and run the algorithm on the wrapper::

    tracer = Tracer()
    tcomm = TracedComm(comm, tracer)               # comm: a SimComm or an mpi4py MPI.Comm
    with tracer.operation("allreduce/ring", nbytes=buf.nbytes):
        ring.allreduce(tcomm, buf)
    tracer.summary()["operations"]["allreduce/ring"]["bytes_sent"]

**What is counted.** Point-to-point calls, each as the algorithm made it: ``Send``, ``Isend`` and the send half of
``Sendrecv`` add one message and the buffer's size to what this rank sent; ``Recv``, ``Irecv`` and the receive half
of ``Sendrecv`` add one message and the *receive buffer's* size to what it received (algorithms size receive buffers
exactly, so that is what arrives). ``Isend``/``Irecv`` are counted when posted; the time their ``Wait`` blocks is
counted too. A peer of ``PROC_NULL`` counts nothing. Sub-communicators made by ``Split``, ``Split_type`` and ``Dup``
are traced by the same tracer, so the inner rings of a hierarchical all-reduce are counted. MPI's own collectives
(``Allreduce``, ``Bcast``, ``Reduce``) count one call with the data handed in and out (``Allreduce``: the buffer
sent and received; ``Bcast``: sent by the root, received by the others; ``Reduce``: sent by all, received by the
root): MPI's internal messages are invisible from here, so these are the *logical* volumes, not the wire's.
Object methods (``gather``, ``allgather``, ``bcast``, ``allreduce``) pass through uncounted: they carry metrics and
debug checks, not the algorithm's traffic. ``Barrier`` counts time only. A shared-memory collective sends no message:
its loads from and stores into other ranks' memory, and its copies in and out of the window, are *copies*
(:meth:`Tracer.record_copy`: ``copies``, ``bytes_copied``), which a message between two ranks of one machine also is,
twice (MPI copies it into shared memory and out again), where the tracer cannot see it.

**Why bytes sent per rank.** The latency-bandwidth model prices an algorithm by the bytes each rank puts on the wire
(the ring sends ``2 (p-1)/p n`` for an n-byte buffer, whatever p is), and the busiest rank sets the pace. So the
count to compare with the model is ``bytes_sent`` of each rank; the received bytes mirror it across the world.

**Operations.** ``with tracer.operation(name):`` labels the traffic inside. Operations nest, and the traffic goes to
the *outermost* label (a hierarchical all-reduce's inner ring counts as hierarchical); the trace still shows the
nested spans. Traffic outside any operation is filed under "other". Per operation, :meth:`Tracer.summary` gives
``calls`` (times entered), the four counts, ``time_s`` (wall time inside the ``with`` blocks), ``comm_time_s``
(of which inside communication calls) and ``payload_bytes`` (the ``nbytes`` given). For "other", ``calls`` counts
communication calls and ``time_s`` is their time.

**A trace.** ``tracer.events`` are Chrome "complete" events (microseconds, one clock for all ranks of a machine).
Gather them to rank 0 with :func:`gather_events` and write them with :func:`write_chrome_trace`; open the file at
https://ui.perfetto.dev (or chrome://tracing): one row per rank, operations as spans with their calls inside, each
call's peer, tag and bytes in its details.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

from dtrain import terminal
from dtrain.comm.names import IN_PLACE, PROC_NULL
from dtrain.comm.wrapper import Collective, CommWrapper, PointToPoint, RequestWrapper, forward

OTHER = "other"
EVALUATION = "evaluation"  # traffic for measuring (a paradigm's evaluation of its replicas), not for training
CHECKPOINT = "checkpoint"  # traffic for a checkpoint (state gathered or averaged to be written), not for training
NOT_TRAINING = (EVALUATION, CHECKPOINT)

# Timestamps are wall-clock microseconds (so ranks in different processes share an origin) read through
# perf_counter (so they resolve microseconds). write_chrome_trace shifts them to start at zero.
_WALL_OFFSET = time.time() - time.perf_counter()


def _now_us() -> float:
    return (time.perf_counter() + _WALL_OFFSET) * 1e6


def message_bytes(buf) -> int:
    """The bytes a buffer argument describes: an array's ``nbytes``; ``[array, count, datatype]``: count elements."""
    if buf is None or buf is IN_PLACE:
        return 0
    if isinstance(buf, (list, tuple)):
        array = buf[0]
        if len(buf) == 3:
            return int(buf[1]) * array.itemsize
        return message_bytes(array)
    return int(buf.nbytes)


@dataclasses.dataclass
class OperationStats:
    """The counts of one operation label on one rank."""

    calls: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    time_s: float = 0.0
    comm_time_s: float = 0.0
    payload_bytes: int = 0
    copies: int = 0  # copies from or into another rank's memory (shared windows): a message without a message
    bytes_copied: int = 0


def labelled(comm, name: str, nbytes: int | None = None, resumed: bool = False):
    """``with labelled(comm, "allreduce/ring", nbytes=buf.nbytes):`` labels the traffic inside as
    :meth:`Tracer.operation` does, when ``comm`` is traced; on a bare communicator it does nothing."""
    tracer = getattr(comm, "tracer", None)
    return contextlib.nullcontext() if tracer is None else tracer.operation(name, nbytes=nbytes, resumed=resumed)


class Tracer:
    """One rank's record of its communication: counts per operation (``summary``) and timeline ``events``.

    Use one tracer per rank (simulated ranks are threads, each with its own). ``rank`` is filled in by the first
    :class:`TracedComm` made with it. ``keep_events=False`` keeps the counts but no timeline (a long training run
    that writes no trace would otherwise hold an event for every message it ever sent).
    """

    def __init__(self, rank: int | None = None, keep_events: bool = True):
        self.rank = rank
        self.keep_events = keep_events
        self.stats: dict[str, OperationStats] = {}
        self.events: list[dict] = []
        self._stack: list[str] = []  # open operations, outermost first

    @property
    def label(self) -> str:
        """Where traffic goes now: the outermost open operation, or "other"."""
        return self._stack[0] if self._stack else OTHER

    def _stats(self, label: str) -> OperationStats:
        if label not in self.stats:
            self.stats[label] = OperationStats()
        return self.stats[label]

    @contextlib.contextmanager
    def operation(self, name: str, nbytes: int | None = None, resumed: bool = False):
        """Label the traffic inside the ``with`` block (``nbytes``: the payload, e.g. the buffer all-reduced).

        ``resumed``: the block continues an operation already counted (a later step of a non-blocking collective):
        its traffic and time count, but not as another call.
        """
        outermost = not self._stack
        self._stack.append(name)
        start = _now_us()
        try:
            yield self
        finally:
            end = _now_us()
            self._stack.pop()
            if outermost:
                stats = self._stats(name)
                stats.calls += 0 if resumed else 1
                stats.time_s += (end - start) / 1e6
                stats.payload_bytes += nbytes or 0
            if self.keep_events:
                args = {} if nbytes is None else {"nbytes": nbytes}
                self.events.append(
                    {"name": name, "cat": "operation", "ph": "X", "ts": start, "dur": end - start, "args": args}
                )

    def span(self, name: str, start_s: float, end_s: float, **args) -> None:
        """Put a span that is not a communication call on the timeline (backward, a collective in flight), from
        ``time.perf_counter()`` readings; it counts nothing."""
        if not self.keep_events:
            return
        ts = (start_s + _WALL_OFFSET) * 1e6
        self.events.append(
            {"name": name, "cat": "span", "ph": "X", "ts": ts, "dur": (end_s - start_s) * 1e6, "args": args}
        )

    def record_call(self, name: str, start: float, sent: tuple = (0, 0), received: tuple = (0, 0), **args):
        """Count one communication call that began at ``start`` (from ``_now_us``) and has just returned.

        ``sent`` and ``received`` are (messages, bytes). ``args`` (peer, tag ...) go into the trace event.
        """
        end = _now_us()
        label = self.label
        stats = self._stats(label)
        seconds = (end - start) / 1e6
        if label == OTHER:  # no enclosing block: the calls themselves are what happened
            stats.calls += 1
            stats.time_s += seconds
        stats.comm_time_s += seconds
        stats.messages_sent += sent[0]
        stats.bytes_sent += sent[1]
        stats.messages_received += received[0]
        stats.bytes_received += received[1]
        if not self.keep_events:
            return
        if sent[1]:
            args["bytes_sent"] = sent[1]
        if received[1]:
            args["bytes_received"] = received[1]
        self.events.append({"name": name, "cat": label, "ph": "X", "ts": start, "dur": end - start, "args": args})

    now = staticmethod(_now_us)  # the clock ``record_call`` and ``record_copy`` take their ``start`` from

    def record_copy(self, name: str, start: float, nbytes: int, **args) -> None:
        """Count one copy of ``nbytes`` (a shared-memory collective's loads from, or stores into, other ranks' memory,
        or its copy in and out of the window) that began at ``start`` (from ``_now_us``) and has just finished."""
        end, label = _now_us(), self.label
        stats = self._stats(label)
        if label == OTHER:  # no enclosing block: the copies themselves are what happened (as record_call)
            stats.calls += 1
            stats.time_s += (end - start) / 1e6
        stats.copies += 1
        stats.bytes_copied += nbytes
        stats.comm_time_s += (end - start) / 1e6
        if self.keep_events:
            args["bytes_copied"] = nbytes
            self.events.append({"name": name, "cat": label, "ph": "X", "ts": start, "dur": end - start,
                                "args": args})  # fmt: skip

    def summary(self) -> dict:
        """This rank's counts as plain JSON data: ``{"rank", "operations": {label: {...}}, "totals": {...}}``."""
        operations = {label: dataclasses.asdict(stats) for label, stats in self.stats.items()}
        totals = {field.name: 0 for field in dataclasses.fields(OperationStats)}
        for counts in operations.values():
            for key, value in counts.items():
                totals[key] += value
        return {"rank": self.rank, "operations": operations, "totals": totals}

    def reset(self) -> None:
        """Forget all counts and events (say, after warm-up iterations)."""
        self.stats.clear()
        self.events.clear()


def _peer_counts(peer: int, nbytes: int) -> tuple:
    return (0, 0) if peer == PROC_NULL else (1, nbytes)


class TracedRequest(RequestWrapper):
    """A request from a traced ``Isend``/``Irecv``: the time its ``Wait`` (or successful ``Test``) takes is counted."""

    def __init__(self, request, tracer: Tracer, call: str, **args):
        super().__init__(request)
        self._tracer, self._call, self._args = tracer, call, args

    def Wait(self, status=None):
        start = _now_us()
        result = self.request.Wait(status)
        self._tracer.record_call(f"Wait({self._call})", start, **self._args)
        return result

    def Test(self, status=None):
        start = _now_us()
        done = self.request.Test(status)
        if done:  # a polling loop would otherwise flood the timeline with empty Tests
            self._tracer.record_call(f"Test({self._call})", start, **self._args)
        return done


class TracedComm(CommWrapper):
    """A communicator that counts its traffic into ``tracer``; everything not counted is forwarded to ``comm``."""

    def __init__(self, comm, tracer: Tracer | None = None):
        super().__init__(comm)
        self.tracer = tracer if tracer is not None else Tracer()
        if self.tracer.rank is None:
            self.tracer.rank = comm.Get_rank()

    def sibling(self, comm):
        """A sub-communicator is traced by the same tracer."""
        return TracedComm(comm, self.tracer)

    def p2p(self, call: PointToPoint):
        start = _now_us()
        result = forward(self.comm, call)
        sent = _peer_counts(call.dest, message_bytes(call.sendbuf)) if call.sends else (0, 0)
        received = _peer_counts(call.source, message_bytes(call.recvbuf)) if call.receives else (0, 0)
        if call.sends and call.receives:
            args = {"dest": call.dest, "source": call.source, "sendtag": call.sendtag, "recvtag": call.recvtag}
        elif call.sends:
            args = {"peer": call.dest, "tag": call.sendtag}
        else:
            args = {"peer": call.source, "tag": call.recvtag}
        self.tracer.record_call(call.name, start, sent=sent, received=received, **args)
        if call.name in ("Isend", "Irecv"):
            return TracedRequest(result, self.tracer, call.name, **args)
        return result

    def collective(self, call: Collective):
        """MPI's own collectives: the logical volumes handed in and out (see the module docstring)."""
        start = _now_us()
        forward(self.comm, call)
        sent = received = (0, 0)
        args = {} if call.root is None else {"root": call.root}
        if call.name == "Allreduce":
            sent = received = (1, message_bytes(call.recvbuf))
        elif call.name == "Bcast":
            if self.comm.Get_rank() == call.root:
                sent = (1, message_bytes(call.recvbuf))
            else:
                received = (1, message_bytes(call.recvbuf))
        elif call.name == "Reduce":
            nbytes = message_bytes(call.recvbuf if call.sendbuf is IN_PLACE else call.sendbuf)
            sent = (1, nbytes)
            received = (1, nbytes) if self.comm.Get_rank() == call.root else (0, 0)
        self.tracer.record_call(call.name, start, sent=sent, received=received, **args)


def gather_summaries(tracer: Tracer, comm) -> list | None:
    """Every rank's ``summary()`` as a list on rank 0 (``None`` elsewhere); object methods are not counted."""
    return comm.gather(tracer.summary(), root=0)


def gather_events(tracer: Tracer, comm) -> list | None:
    """Every rank's trace events as a list of lists on rank 0 (``None`` elsewhere), for :func:`write_chrome_trace`."""
    return comm.gather(tracer.events, root=0)


def write_chrome_trace(path, events_per_rank: list) -> None:
    """Write one Chrome/Perfetto JSON trace with a row ("process") per rank: ``events_per_rank[r]`` is rank r's.

    Time is shifted so the earliest event starts at zero; the file's folder is made if need be (as metrics.json's:
    a run must not train for an hour and then fail to write); "-" is standard output. Open the file at
    https://ui.perfetto.dev.
    """
    starts = [event["ts"] for events in events_per_rank for event in events]
    origin = min(starts) if starts else 0.0
    trace = []
    for rank, events in enumerate(events_per_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        # Enclosing spans first (earlier start, then longer), the order viewers nest them in.
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            trace.append({**event, "ts": round(event["ts"] - origin, 3), "pid": rank, "tid": 0})
    terminal.write_output(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))  # ("-": stdout)

"""DDP's gradient buckets: cut the flat gradient into buckets, and all-reduce each one as soon as it is complete.

PyTorch calls this part of DDP its *reducer*. :func:`plan_buckets` cuts the flat buffer into contiguous slices in
reverse parameter order (backward makes the last layer's gradient first). :class:`Buckets` runs one step's averaging::

    arm()          before the last micro-batch's backward: every bucket waits for all its parameters again
    ready(i)       parameter i's gradient is complete (a hook inside backward): start every complete bucket, in
                   order, and advance every bucket in flight as far as its messages have arrived
    finish()       after backward: start the buckets not started (no overlap, or parameters the loss did not use),
                   wait for all of them

*In flight without a thread.* A bucket's ring is a non-blocking collective: a generator
(:func:`dtrain.collectives.ring.allreduce_steps`) that posts one step's ``Isend``/``Irecv`` and yields their requests;
advancing it tests those requests and, once they are done, posts the next step. That is how ``MPI_Iallreduce``
progresses in an MPI library without a progress thread: a bucket moves only while its rank calls into it. Other
algorithms run blocking, each bucket as soon as it is complete.

The timing (``timing``: backward, exposed communication, time in flight and the part of it hidden behind backward)
is added up in :meth:`Buckets.account`, out of the algorithm's way, and the same spans go on the trace's timeline.
:func:`gradient_buckets` makes a model's reducer from the flags (``--bucket-mb``: :func:`bucket_bytes`;
``--allreduce``: :func:`allreduce_algorithm`): ddp's, and post-local SGD's for its first steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator

from dtrain import collectives
from dtrain.backend import array_module
from dtrain.collectives import costmodel, ring, shm
from dtrain.comm import waitall, watchdog
from dtrain.comm.trace import labelled
from dtrain.layout import spans

NONBLOCKING = {"ring": ring.allreduce_steps}  # algorithms with a step-by-step (non-blocking) form


def plan_buckets(parameters, bucket_bytes: int) -> list[tuple[int, int, list[int]]]:
    """Cut a flat buffer into buckets in reverse parameter order: ``[(start, stop, parameter indices), ...]``.

    ``parameters`` are (offset, size, itemsize) of each parameter in flat-buffer order. Walking from the last
    parameter back, a bucket closes once it holds at least ``bucket_bytes`` (0: one bucket for everything). Each
    bucket is one contiguous slice, so it is all-reduced in place with no packing.
    """
    buckets, members, stop, nbytes = [], [], None, 0
    for index in reversed(range(len(parameters))):
        offset, size, itemsize = parameters[index]
        stop = offset + size if stop is None else stop
        members.append(index)
        nbytes += size * itemsize
        if bucket_bytes and nbytes >= bucket_bytes:
            buckets.append((offset, stop, members))
            members, stop, nbytes = [], None, 0
    if members:
        buckets.append((parameters[members[-1]][0], stop, members))
    return buckets


MAX_BUCKET_BYTES = 1 << 62  # more than any model: a larger --bucket-mb is one bucket of everything


def bucket_bytes(config) -> int:
    """``--bucket-mb`` in bytes; by default 1 MiB buckets when overlapping (they exist to start early), else one
    bucket: after backward, one all-reduce of everything costs the fewest latencies."""
    mb = config.bucket_mb if config.bucket_mb is not None else (1.0 if config.overlap else 0.0)
    return int(min(mb * (1 << 20), MAX_BUCKET_BYTES))  # (--bucket-mb 1e308: one bucket, not an infinite size)


def allreduce_algorithm(config, world: int, nbytes: int, comm=None) -> str:
    """``--allreduce``, with "auto" resolved for all-reduces of up to ``nbytes`` (the largest bucket): the ring when
    overlapping (the one non-blocking algorithm here), shared memory where ``comm``'s ranks share a real node and
    calibrate.py measured it faster from this size on (zero copy: the caller puts the buffer in a window when it gets
    "shm"), else the cost model's choice."""
    if config.allreduce != "auto":
        return config.allreduce
    if config.overlap and world > 1:
        return "ring"
    if comm is not None and world > 1 and config.device == "cpu" and costmodel.shm_pays(comm, nbytes, world,
                                                                                         zero_copy=True):  # fmt: skip
        return "shm"
    return costmodel.choose(nbytes, world)


def shared_gradients(comm, model, config, topology=None) -> str:
    """The all-reduce ``model``'s gradients will get (:func:`allreduce_algorithm`, for the largest bucket); when it
    is a shared-memory one, the flat gradient moves into a window on the ranks that share it first (``comm``, or
    the topology's node), so that it is reduced in place, zero copy. Call it before the optimizer takes the
    buffers; the driver frees the window at the end of the run (``shm_windows.release_mine``)."""
    algorithm = allreduce_algorithm(config, comm.Get_size(), _plan(model, config)[1], comm)
    if algorithm in shm.ALGORITHMS and comm.Get_size() > 1:
        node = topology.node if algorithm == "hierarchical_shm" else comm
        model.move_flat_grads(shm.buffer(node, model.flat_grads.size, model.flat_grads.dtype))
    return algorithm


def buckets_to_start(missing: list[int], started: int, bucket: int) -> list[int]:
    """A parameter of bucket ``bucket`` is ready: count it off in ``missing`` (each bucket's parameters still to come;
    changed in place) and return the buckets that may start now, in order. Buckets start strictly in order 0, 1, 2,
    ... (buckets 0 .. ``started`` - 1 have), each once all its parameters are ready: every rank then starts the same
    collectives in the same order, whatever order its hooks fire in."""
    missing[bucket] -= 1
    now = []
    while started + len(now) < len(missing) and missing[started + len(now)] == 0:
        now.append(started + len(now))
    return now


@dataclasses.dataclass
class InFlight:
    """A bucket whose non-blocking all-reduce has started: its state machine and the requests it waits on."""

    bucket: int
    steps: Generator  # yields each step's requests; ends when the all-reduce is done
    requests: list
    started: float
    finished: float | None = None


class Buckets:
    """The averaging of one flat gradient ``flat`` cut by ``plan`` (from :func:`plan_buckets`), over ``comm``."""

    def __init__(self, comm, flat, plan, algorithm: str, topology=None):
        self.comm, self.algorithm, self.topology = comm, algorithm, topology
        self.slices = [flat[start:stop] for start, stop, _ in plan]
        self.bucket_of = {index: b for b, (_, _, members) in enumerate(plan) for index in members}
        self.sizes = [len(members) for _, _, members in plan]
        # each bucket in flight receives into a scratch chunk of its own (a blocking algorithm needs none)
        world = comm.Get_size()
        chunks = [-(-b.size // world) for b in self.slices] if algorithm in NONBLOCKING else []
        self.scratch = [array_module(flat).empty(n, dtype=flat.dtype) for n in chunks]
        self.timing = {"backward_s": 0.0, "exposed_comm_s": 0.0, "in_flight_s": 0.0, "hidden_s": 0.0}
        self.armed, self.missing, self.started, self.in_flight, self.backward_start = False, [], 0, [], 0.0

    def arm(self) -> None:
        """Before the backward whose gradients are final: every bucket waits for all its parameters again."""
        self.armed = True
        self.missing = list(self.sizes)  # parameters each bucket still waits for
        self.started = 0  # buckets start in order: 0, 1, ... on every rank
        self.in_flight: list[InFlight] = []
        self.backward_start = time.perf_counter()

    def ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is complete: start every complete bucket, in order; advance the rest."""
        if not self.armed:
            return
        for b in buckets_to_start(self.missing, self.started, self.bucket_of[index]):
            self.start(b)
        if self.in_flight:
            with self.label():  # the tests and waits count as the all-reduce's time, not as "other"
                self.advance(block=False)

    def finish(self) -> None:
        """Start every bucket not started yet, in order, and wait for all: every rank holds the average."""
        backward_end = time.perf_counter()
        while self.started < len(self.slices):
            self.start(self.started)
        if self.in_flight:
            with self.label():
                self.advance(block=True)
        self.armed = False
        self.account(backward_end)

    def start(self, b: int) -> None:
        self.started = b + 1
        steps = NONBLOCKING.get(self.algorithm)
        if steps is None:  # a blocking algorithm: the whole all-reduce, now (in flight, none of it hidden)
            started = time.perf_counter()
            collectives.allreduce(self.comm, self.slices[b], "avg", self.algorithm, topology=self.topology)
            self.timing["in_flight_s"] += time.perf_counter() - started
            return
        generator = steps(self.comm, self.slices[b], "avg", tag=b, work=self.scratch[b])
        started = time.perf_counter()
        with self.label(self.slices[b].nbytes):
            self.in_flight.append(InFlight(b, generator, next(generator, None) or [], started))

    def label(self, nbytes=None):
        """The tracer's label for a bucket's traffic (its first step counts the call; the later steps resume it)."""
        return labelled(self.comm, f"allreduce/{self.algorithm}", nbytes, resumed=nbytes is None)

    def advance(self, block: bool) -> None:
        """Advance every bucket in flight as far as its messages have arrived (``block``: to the end)."""
        for flight in self.in_flight:
            while flight.finished is None:
                if block:
                    with watchdog.watching(self.comm, f"ddp: bucket {flight.bucket} all-reduce/{self.algorithm}"):
                        waitall(flight.requests)
                    flight.requests = []
                else:
                    flight.requests = [r for r in flight.requests if not r.Test()]
                    if flight.requests:
                        break
                requests = next(flight.steps, None)
                if requests is None:
                    flight.finished = time.perf_counter()
                else:
                    flight.requests = requests

    def account(self, backward_end: float) -> None:
        """Add this step's times to ``timing`` and its spans to the trace's timeline (backward beside each bucket)."""
        t, tracer = self.timing, getattr(self.comm, "tracer", None)
        t["backward_s"] += backward_end - self.backward_start
        t["exposed_comm_s"] += time.perf_counter() - backward_end
        if tracer is not None:
            tracer.span("backward", self.backward_start, backward_end)
        for flight in self.in_flight:
            t["in_flight_s"] += flight.finished - flight.started
            t["hidden_s"] += max(0.0, min(flight.finished, backward_end) - flight.started)
            if tracer is not None:
                tracer.span(f"bucket {flight.bucket} in flight", flight.started, flight.finished)


def gradient_buckets(comm, model, config, topology=None) -> Buckets:
    """The reducer of ``model``'s flat gradient over ``comm``: buckets of ``--bucket-mb`` in reverse parameter order,
    all-reduced with ``--allreduce`` (chosen for the largest bucket); ``topology``: the hierarchical all-reduces'
    nodes."""
    plan, biggest = _plan(model, config)
    algorithm = allreduce_algorithm(config, comm.Get_size(), biggest, comm)
    return Buckets(comm, model.flat_grads, plan, algorithm, topology)


def _plan(model, config):
    """The buckets of ``model``'s flat gradient (:func:`plan_buckets`) and the largest one's bytes."""
    flat = model.flat_grads
    layout = [(offset, n, flat.itemsize) for offset, n in spans(p.grad.size for p in model.parameters())]
    plan = plan_buckets(layout, bucket_bytes(config))
    return plan, max(stop - start for start, stop, _ in plan) * flat.itemsize

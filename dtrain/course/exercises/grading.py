"""What a check is made of: cases, comparisons that name the first wrong element, and the traffic an algorithm sends.

A check is a function ``check(fn, comm, grade)`` that every rank runs (``comm`` is None for an exercise that needs no
ranks). It calls the learner's ``fn`` in numbered cases (K of N) and compares what each rank holds afterwards with
what it must hold::

    for case, n in enumerate((1, 5, 1000), 1):
        buf = rank_values(rank, n)
        with grade.step(case, f"{p} ranks, {n} float64 elements", cases=3):
            fn(comm, buf)
            grade.same(buf, expected, "buf after the call (the sum over all ranks)")
            grade.traffic(messages=2 * (p - 1), total_bytes=..., algorithm="a ring all-reduce")

A case is the checker's, not the algorithm's: the algorithm's own steps (a ring's reduce-scatter step s) happen
inside one call of ``fn``. Where a check knows them, it hands ``fn`` a :class:`StepLog` (:meth:`Grade.log`), which
counts this rank's sends and receives in the case and names the algorithm's step of each, so that an exception
raised inside ``fn`` (a receive into a buffer too small) and a deadlock can say "ring step 0 of the reduce-scatter"
beside the case, and keeps what was sent, for the check to find the first step that went wrong.

At the end of each case the ranks compare verdicts (an object all-gather), so they all leave a failing check at the
same case and say the same thing: the first failing rank, the case, the first wrong element with its expected and
actual values, and the traffic this rank sent when it differs from the algorithm's. A failing comparison does not stop
its rank early: every rank always makes the same calls, so a wrong answer on one rank never turns into a hang. A note
(:meth:`Grade.note`) explains a failure: a check adds one only when what it says is so (a buffer untouched on every
rank, not one that merely holds the same numbers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import numpy as np

from dtrain.comm.wrapper import CommWrapper, RequestWrapper, forward

LESSONS = {
    1: "lessons/01_single_device.py",
    2: "lessons/02_allreduce.py",
    3: "lessons/03_data_parallel.py",
    4: "lessons/04_parameter_server.py",
    5: "lessons/05_local_sgd.py",
    6: "lessons/06_gossip.py",
    7: "lessons/07_tensor_parallel.py",
    8: "lessons/08_pipeline_parallel.py",
    9: "lessons/09_zero.py",
    10: "lessons/10_debugging.py",
    13: "lessons/13_compression.py",
    14: "lessons/14_spmd.py",
}
RINGS = (1, 2, 3, 4, 5, 8)  # simulated world sizes for a collective: one rank, powers of two and others
MPI = (2, 3, 4)  # under mpiexec: small, and a non-power-of-two


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One exercise: the function a learner writes, where, and how it is graded."""

    id: str  # "2.1": lesson 2, first exercise
    title: str
    file: str  # the learner's file, in their folder (a copy of stubs/<file> to begin with)
    function: str  # the function the learner writes in it
    parameters: tuple[str, ...]  # its documented signature (the checker calls it with these, in this order)
    reference: str  # "module:function": dtrain's own implementation, graded by the same check
    check: str  # "module:function" of the check, called check(fn, comm, grade) on every rank (comm None: no ranks)
    sim_ranks: tuple[int, ...] = ()  # simulated world sizes; () = the exercise needs no ranks (one process)
    mpi_ranks: tuple[int, ...] = ()  # rank counts under mpiexec, a non-power-of-two among them
    hint: str = ""  # shown under the first failure

    @property
    def lesson(self) -> int:
        return int(self.id.split(".")[0])

    @property
    def lesson_script(self) -> str:
        return LESSONS[self.lesson]

    def load_check(self):
        return resolve(self.check)

    def load_reference(self):
        return resolve(self.reference)


def resolve(spec: str):
    """``"package.module:name"`` -> the object."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def rank_values(rank: int, n: int, dtype=np.float64) -> np.ndarray:
    """Rank ``rank``'s buffer before a collective: integers that say whose they are (rank r, element i: 100 r + i % 97,
    plus one so that no rank holds zeros)."""
    return (100 * rank + np.arange(n) % 97 + 1).astype(dtype)


def plural(count: int, word: str) -> str:
    """``"1 rank"``, ``"3 ranks"``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def place(rank: int | None = None, case: int | None = None, cases: int | None = None, about: str = "",
          phase: str | None = None) -> str:  # fmt: skip
    """Where a check stopped, in words, to lead a message: ``"rank 1, case 2 of 8 (2 ranks, 1 float64 element); ring
    step 0 of the reduce-scatter: "`` ("" when nothing is known). ``phase``: the algorithm's own step, if known."""
    where = []
    if rank is not None:
        where.append(f"rank {rank}")
    if case is not None:
        where.append(f"case {case}" + (f" of {cases}" if cases else "") + (f" ({about})" if about else ""))
    said = ", ".join(where)
    if phase:
        said += ("; " if said else "") + phase
    return said + ": " if said else ""


class Wrong(Exception):
    """A check failed: ``rank`` (None: no ranks), ``case`` (1-based, of ``cases``; what it is: ``about``) and what
    was wrong, in words."""

    def __init__(self, text: str, rank: int | None = None, case: int | None = None, about: str = "",
                 cases: int | None = None):  # fmt: skip
        super().__init__(text)
        self.text, self.rank, self.case, self.about, self.cases = text, rank, case, about, cases

    def describe(self) -> str:
        return place(self.rank, self.case, self.cases, self.about) + self.text


class StepLog(CommWrapper):
    """The communicator a check hands the learner's function, when it knows the algorithm's steps: it counts this
    rank's sends and receives in the case (the k-th receive, or the k-th send of a call that only sends, is the
    algorithm's step k: ``name_step(k)`` says it in words, or None) and, with ``keep``, copies every message sent,
    ``(dest, data)`` in ``sent``. ``now`` is the count of the call in progress (or the last one made); a request's
    ``Wait`` makes its own call's count the one in progress. Sub-communicators are passed through unlogged."""

    def __init__(self, comm, name_step=None, keep: bool = False):
        super().__init__(comm)
        self.name_step, self.keep = name_step, keep
        self.reset()

    def reset(self) -> None:
        """A new case: no calls yet."""
        self.sent: list[tuple[int, np.ndarray | None]] = []
        self.sends = self.receives = 0
        self.now: int | None = None

    def p2p(self, call):
        index = None
        if call.receives:
            index, self.receives = self.receives, self.receives + 1
        if call.sends:
            index = self.sends if index is None else index
            self.sends += 1
            if self.keep:
                self.sent.append((int(call.dest), copied(call.sendbuf)))
        self.now = index
        result = forward(self.comm, call)
        if call.name in ("Isend", "Irecv"):
            return StepRequest(result, self, index)
        return result

    def sibling(self, comm):
        return comm

    def phase(self) -> str | None:
        """The algorithm's step of the call in progress (or the last one), in words; None if not known."""
        if self.now is None or self.name_step is None:
            return None
        return self.name_step(self.now)


class StepRequest(RequestWrapper):
    """A request of a :class:`StepLog`: waiting on it is its own step of the algorithm."""

    def __init__(self, request, log: StepLog, index: int | None):
        super().__init__(request)
        self.log, self.index = log, index

    def Wait(self, status=None):
        self.log.now = self.index
        return self.request.Wait(status)

    def Test(self, status=None):
        self.log.now = self.index
        return self.request.Test(status)


def copied(buf) -> np.ndarray | None:
    """A flat copy of a send buffer (an array, or mpi4py's ``[array, datatype]``), or None if it is neither."""
    if isinstance(buf, (list, tuple)) and buf:
        buf = buf[0]
    try:
        return np.array(buf, copy=True).reshape(-1)
    except (TypeError, ValueError):
        return None


def ring_steps(p: int, phases: tuple[str, ...] = ("reduce-scatter", "all-gather")):
    """The names of a ring's steps, by this rank's count of receives (or sends): p - 1 steps of each phase, each
    phase's numbered from 0 as the exercises number them: "ring step 0 of the reduce-scatter", ..."""

    def name(index: int) -> str | None:
        for phase in phases:
            if index < p - 1:
                return f"ring step {index} of the {phase}"
            index -= p - 1
        return None

    return name


class Grade:
    """One rank's view of a check in progress (see the module docstring)."""

    def __init__(self, comm=None, started=None):
        self.comm = comm
        self.started = started  # called with this Grade as each case starts (to say where a run that hangs was)
        self.rank = comm.Get_rank() if comm is not None else None
        self.size = comm.Get_size() if comm is not None else 1
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.sent = (0, 0)
        self.current: tuple[int | None, str, int | None] = (None, "", None)  # (case, what it is, of how many)
        self.logs: list[StepLog] = []

    def counts(self) -> tuple[int, int]:
        """(messages, bytes) this rank has sent so far, as the tracer under ``comm`` counted them."""
        tracer = getattr(self.comm, "tracer", None)
        if tracer is None:
            return 0, 0
        totals = tracer.summary()["totals"]
        return totals["messages_sent"], totals["bytes_sent"]

    def log(self, comm, name_step=None, keep: bool = False) -> StepLog:
        """A :class:`StepLog` around ``comm`` for the learner's function, emptied at the start of every case; its
        step is the one :meth:`phase` names."""
        log = StepLog(comm, name_step, keep)
        self.logs.append(log)
        return log

    def phase(self) -> str | None:
        """The algorithm's step this rank is in (or was last in) within the case, where a log knows it; else None."""
        for log in self.logs:
            said = log.phase()
            if said:
                return said
        return None

    def where(self) -> str:
        """``"case 2 of 8 (what it is); ring step 0 of the reduce-scatter: "``: the case this rank is in (or was last
        in) and its algorithm's step, where known; "" before the first case."""
        case, about, cases = self.current
        if case is None:
            return ""
        return place(None, case, cases, about, self.phase())

    @contextlib.contextmanager
    def step(self, number: int, about: str = "", cases: int | None = None):
        """Case ``number`` (of ``cases``): the ranks compare verdicts when it ends, and all raise :class:`Wrong` if
        any failed."""
        self.problems, self.notes, self.current = [], [], (number, about, cases)
        for log in self.logs:
            log.reset()
        if self.started is not None:
            self.started(self)
        self.sent = self.counts()
        yield self
        mine = "\n".join(self.problems + (self.notes if self.problems else [])) or None
        everyone = self.comm.allgather(mine) if self.comm is not None else [mine]
        for rank, problem in enumerate(everyone):
            if problem is not None:
                raise Wrong(problem, rank if self.comm is not None else None, number, about, cases)

    def fail(self, text: str) -> None:
        """Record a problem on this rank (the case fails when it ends)."""
        self.problems.append(text)

    def note(self, text: str) -> None:
        """A detail shown only if this rank's case fails (what it sent, what it held before): say only what is so."""
        self.notes.append(text)

    def same(self, actual, expected, what: str, rtol: float = 1e-12, atol: float = 1e-12) -> bool:
        """``actual`` equals ``expected`` (to ``rtol``/``atol``; exactly for integers); else a problem that names the
        first wrong element. Returns whether it did."""
        expected = np.asarray(expected)
        if actual is None:
            self.fail(f"{what} is None; expected an array of shape {expected.shape}")
            return False
        actual = np.asarray(actual)
        if actual.shape != expected.shape:
            self.fail(f"{what} has shape {actual.shape}, expected {expected.shape}")
            return False
        if np.issubdtype(expected.dtype, np.floating):
            wrong = ~np.isclose(actual, expected, rtol=rtol, atol=atol)
        else:
            wrong = actual != expected
        if not wrong.any():
            return True
        first = tuple(int(i) for i in np.argwhere(wrong)[0])
        index = first[0] if len(first) == 1 else first
        self.fail(f"{what}: element {index} is {actual[first].item()!r}, expected {expected[first].item()!r} "
                  f"({int(wrong.sum())} of {wrong.size} elements wrong)")  # fmt: skip
        return False

    def equal(self, actual, expected, what: str) -> bool:
        """Plain values (numbers, lists, tuples) compare equal; else a problem that shows both."""
        if actual == expected:
            return True
        self.fail(f"{what} is {actual!r}, expected {expected!r}")
        return False

    def traffic(self, messages: int, total_bytes: int | None = None, algorithm: str = "the algorithm",
                strict: bool = True) -> None:  # fmt: skip
        """This rank sent ``messages`` messages in this case, and all ranks together ``total_bytes`` (when given).
        A different count is a problem (``strict``: a correct result by another algorithm is not this exercise), or
        else a note that explains a wrong result."""
        sent_messages, sent_bytes = (now - before for now, before in zip(self.counts(), self.sent))
        say = self.fail if strict else self.note
        if sent_messages != messages:
            say(f"rank {self.rank} sent {sent_messages} messages in this case; {algorithm} sends {messages}")
        if total_bytes is not None and self.comm is not None:
            everyone = sum(self.comm.allgather(sent_bytes))
            if everyone != total_bytes and self.rank == 0:
                say(f"all ranks together sent {everyone} bytes in this case; {algorithm} sends {total_bytes}")

"""What a check is made of: steps, comparisons that name the first wrong element, and the traffic an algorithm sends.

A check is a function ``check(fn, comm, grade)`` that every rank runs (``comm`` is None for an exercise that needs no
ranks). It calls the learner's ``fn`` in numbered steps and compares what each rank holds afterwards with what it
must hold::

    for step, n in enumerate((1, 5, 1000), 1):
        buf = rank_values(rank, n)
        with grade.step(step, f"{n} float64 elements, rank r's own values"):
            fn(comm, buf)
            grade.same(buf, expected, "buf after the call (the sum over all ranks)")
            grade.traffic(messages=2 * (p - 1), total_bytes=..., algorithm="a ring all-reduce")

At the end of each step the ranks compare verdicts (an object all-gather), so they all leave a failing check at the
same step and say the same thing: the first failing rank, the step, the first wrong element with its expected and
actual values, and the traffic this rank sent when it differs from the algorithm's. A failing comparison does not stop
its rank early: every rank always makes the same calls, so a wrong answer on one rank never turns into a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import numpy as np

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


class Wrong(Exception):
    """A check failed: ``rank`` (None: no ranks), ``step`` (1-based) and what was wrong, in words."""

    def __init__(self, text: str, rank: int | None = None, step: int | None = None, about: str = ""):
        super().__init__(text)
        self.text, self.rank, self.step, self.about = text, rank, step, about

    def describe(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.step is not None:
            where.append(f"step {self.step}" + (f" ({self.about})" if self.about else ""))
        return (", ".join(where) + ": " if where else "") + self.text


class Grade:
    """One rank's view of a check in progress (see the module docstring)."""

    def __init__(self, comm=None):
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else None
        self.size = comm.Get_size() if comm is not None else 1
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.sent = (0, 0)
        self.current = (None, "")

    def counts(self) -> tuple[int, int]:
        """(messages, bytes) this rank has sent so far, as the tracer under ``comm`` counted them."""
        tracer = getattr(self.comm, "tracer", None)
        if tracer is None:
            return 0, 0
        totals = tracer.summary()["totals"]
        return totals["messages_sent"], totals["bytes_sent"]

    @contextlib.contextmanager
    def step(self, number: int, about: str = ""):
        """A numbered step: the ranks compare verdicts when it ends, and all raise :class:`Wrong` if any failed."""
        self.problems, self.notes, self.current = [], [], (number, about)
        self.sent = self.counts()
        yield self
        mine = "\n".join(self.problems + (self.notes if self.problems else [])) or None
        everyone = self.comm.allgather(mine) if self.comm is not None else [mine]
        for rank, problem in enumerate(everyone):
            if problem is not None:
                raise Wrong(problem, rank if self.comm is not None else None, number, about)

    def fail(self, text: str) -> None:
        """Record a problem on this rank (the step fails when it ends)."""
        self.problems.append(text)

    def note(self, text: str) -> None:
        """A detail shown only if this rank's step fails (what it sent, what it held before)."""
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
        """This rank sent ``messages`` messages in this step, and all ranks together ``total_bytes`` (when given).
        A different count is a problem (``strict``: a correct result by another algorithm is not this exercise), or
        else a note that explains a wrong result."""
        sent_messages, sent_bytes = (now - before for now, before in zip(self.counts(), self.sent))
        say = self.fail if strict else self.note
        if sent_messages != messages:
            say(f"rank {self.rank} sent {sent_messages} messages in this step; {algorithm} sends {messages}")
        if total_bytes is not None and self.comm is not None:
            everyone = sum(self.comm.allgather(sent_bytes))
            if everyone != total_bytes and self.rank == 0:
                say(f"all ranks together sent {everyone} bytes in this step; {algorithm} sends {total_bytes}")

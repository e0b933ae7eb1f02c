"""The course's exercises: write one function of dtrain yourself, and let a checker grade it.

Every exercise is one function with a documented signature that dtrain itself implements (its *reference*), e.g.
``ring_allreduce(comm, buf)`` (reference: :func:`dtrain.collectives.ring.allreduce`). The learner works in a folder
of their own::

    dtrain exercises init ex              # copy the stubs into ex/ (an existing file is never overwritten)
    dtrain exercises list --path ex       # every exercise: its lesson, its file, not started / failing / passing
    dtrain exercises check 2.1 --path ex  # grade ex/ring.py's ring_allreduce
    dtrain exercises check all --path ex  # the whole course's progress

Each stub raises ``NotImplementedError("exercise 2.1: ...")`` and its docstring states the task, the signature, what
each rank holds before and after, and a hint. ``check`` runs the exercise's check, the very function that
tests/test_exercises.py runs on the reference: first on simulated ranks (fast; a deadlock is reported with what every
rank waits for), then under ``mpiexec`` with several rank counts, a non-power-of-two among them, each with a time
limit so that a wrong exercise can never hang the checker. A failure names the rank, the step, and the first wrong
element with its expected and actual values.

Which file does what::

    __init__.py   the catalogue (this file): every exercise, its lesson, its file and function, its reference
    grading.py    what checks are made of: numbered steps, comparisons that name the first wrong element, traffic
    checks/       the checks, one module per subject (they are the reference's tests too)
    stubs/        the files ``init`` copies for the learner
    run.py        one part of a check in a process of its own: on simulated ranks, or as one rank under mpiexec
    checker.py    ``dtrain exercises ...``: init, list, check (parts in order, time limits, the report, progress)
"""

from __future__ import annotations

import dataclasses
import importlib

from dtrain.errors import UserError


@dataclasses.dataclass(frozen=True)
class Exercise:
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
}
RINGS = (1, 2, 3, 4, 5, 8)  # simulated world sizes for a collective: one rank, powers of two and others
MPI = (2, 3, 4)  # under mpiexec: small, and a non-power-of-two

EXERCISES = (
    Exercise("2.1", "ring all-reduce", "ring.py", "ring_allreduce", ("comm", "buf"),
             "dtrain.collectives.ring:allreduce", "dtrain.exercises.checks.collectives:ring_allreduce", RINGS, MPI,
             "a reduce-scatter (p - 1 steps: send a chunk to the right, add the chunk from the left into yours) "
             "then an all-gather (p - 1 steps: pass the finished chunks on); lessons/02_allreduce.py draws it"),
)  # fmt: skip

BY_ID = {exercise.id: exercise for exercise in EXERCISES}


def get(exercise_id: str) -> Exercise:
    """The exercise ``exercise_id`` ("2.1"), or a :class:`UserError` that lists them."""
    if exercise_id not in BY_ID:
        raise UserError(f"there is no exercise {exercise_id!r}: choose one of {', '.join(BY_ID)} (or all); "
                        "`dtrain exercises list` shows them")  # fmt: skip
    return BY_ID[exercise_id]


def resolve(spec: str):
    """``"package.module:name"`` -> the object."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)

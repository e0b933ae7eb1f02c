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
limit so that a wrong exercise can never hang the checker. A failure names the rank, the checker's case ("case 2 of
8", and what the case is), where the check knows them the algorithm's own step ("ring step 0 of the
reduce-scatter"), and the first wrong element with its expected and actual values.

Which file does what::

    __init__.py   the catalogue (this file): every exercise of every subject, in the course's order
    grading.py    what an exercise is (its lesson, file, function, reference, check), and what checks are made
                  of: numbered cases, comparisons that name the first wrong element, the traffic an algorithm
                  sends, the log that names an algorithm's steps
    checks/       one module per subject: its exercises (EXERCISES) and the checks that grade them (the
                  reference's tests too)
    stubs/        the files ``init`` copies for the learner
    run.py        one part of a check in a process of its own: on simulated ranks, or as one rank under mpiexec
    checker.py    ``dtrain exercises ...``: init, list, check (parts in order, time limits, the report, progress)
"""

from __future__ import annotations

import functools
import importlib

from dtrain.course.exercises.grading import Exercise
from dtrain.errors import UserError

# The subjects, in the course's order: each is a module of checks/ that lists its exercises (``EXERCISES``) beside
# the checks that grade them.
SUBJECTS = (
    "autograd",
    "collectives",
    "data_parallel",
    "parameter_server",
    "decentralized",
    "tensor_parallel",
    "pipeline",
    "zero",
    "debugging",
    "compression",
    "spmd",
)


@functools.cache
def catalogue() -> tuple[Exercise, ...]:
    """Every exercise, in the course's order (lesson, then number)."""
    checks = [importlib.import_module(f"dtrain.course.exercises.checks.{subject}") for subject in SUBJECTS]
    found = [e for check in checks for e in check.EXERCISES]
    return tuple(sorted(found, key=lambda e: tuple(int(part) for part in e.id.split("."))))


def get(exercise_id: str) -> Exercise:
    """The exercise ``exercise_id`` ("2.1"), or a :class:`UserError` that lists them."""
    by_id = {exercise.id: exercise for exercise in catalogue()}
    if exercise_id not in by_id:
        raise UserError(f"there is no exercise {exercise_id!r}: choose one of {', '.join(by_id)} (or all); "
                        "`dtrain exercises list` shows them")  # fmt: skip
    return by_id[exercise_id]

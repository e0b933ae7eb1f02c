"""One part of a check, in a process of its own: ``python -m dtrain.exercises.run sim|mpi ID FILE RESULT [RANKS]``.

The checker (:mod:`dtrain.exercises.checker`) starts this with a time limit, so that nothing a learner writes (an
endless loop, a receive that nothing matches) can hang it:

* ``sim``: the check on simulated ranks, for each world size in RANKS (comma-separated; none for an exercise that
  needs no ranks), in this one process; it stops at the first size that fails. A deadlock is the simulator's report
  of what every rank waits for.
* ``mpi``: run by every rank of ``mpiexec -n P``: the check on the real world, traced (messages are counted) and
  watched (a wait longer than ``$DTRAIN_TIMEOUT`` ends the job with a report).

Each writes what happened as JSON to RESULT (``mpi``: RESULT is a folder; rank 0 writes ``result.json``, and a rank
whose call of the learner's function raised writes ``rank-R.json`` before the job ends).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dtrain import exercises
from dtrain.errors import UserError
from dtrain.exercises.grading import Grade, Wrong
from dtrain.loading import load_function, where

SIM_TIMEOUT_S = 30.0  # a simulated world that runs this long is looping, not computing


def outcome(status: str, message: str = "", **extra) -> dict:
    return {"status": status, "message": message, **extra}


def load(exercise, path: Path):
    return load_function(path, exercise.function, exercise.parameters, who=f"exercise {exercise.id}: ")


def raised(exercise, exc: BaseException, path: Path, rank: int | None) -> dict:
    """What an exception from the learner's function means: the stub not yet replaced, or a bug, said with the line
    of the learner's file it came from."""
    who = f"rank {rank} " if rank is not None else ""
    if isinstance(exc, NotImplementedError) and str(exc).startswith(f"exercise {exercise.id}"):
        return outcome("not started", f"{exercise.function} still raises NotImplementedError: write it in {path}")
    return outcome("error", f"{who}raised {type(exc).__name__}: {exc}{where(exc, path)}", rank=rank)


def run_sim(exercise, path: Path, sizes: list[int]) -> dict:
    from dtrain.comm import sim
    from dtrain.comm.trace import TracedComm, Tracer

    fn = load(exercise, path)
    check = exercise.load_check()
    if not sizes:  # one process, no ranks
        try:
            check(fn, None, Grade(None))
        except Wrong as wrong:
            return outcome("fail", wrong.describe())
        except Exception as exc:
            return raised(exercise, exc, path, None)
        return outcome("pass")

    grades = {}  # rank -> its Grade, which knows the step in progress (for a deadlock's report)

    def rank_main(comm):
        traced = TracedComm(comm, Tracer(comm.Get_rank(), keep_events=False))
        grades[comm.Get_rank()] = grade = Grade(traced)
        check(fn, traced, grade)

    for p in sizes:
        grades.clear()
        try:
            sim.SimWorld(p, timeout=SIM_TIMEOUT_S).run(rank_main)
        except sim.SimRankError as failed:
            if isinstance(failed.exception, Wrong):
                return outcome("fail", failed.exception.describe(), ranks=p)
            return {**raised(exercise, failed.exception, path, failed.rank), "ranks": p}
        except sim.SimDeadlock as deadlock:
            return outcome("deadlock", during(grades) + str(deadlock), ranks=p)
        except sim.SimTimeout as timeout:
            return outcome("timeout", during(grades) + str(timeout), ranks=p)
    return outcome("pass")


def during(grades: dict) -> str:
    """``"in step 3 (what it does): "``, the step rank 0 was in when the run stopped ("" before the first step)."""
    grade = grades.get(0)
    number, about = grade.current if grade is not None else (None, "")
    if number is None:
        return ""
    return f"in step {number}" + (f" ({about})" if about else "") + ": "


def run_mpi(exercise, path: Path, folder: Path) -> None:
    from dtrain.comm import mpi
    from dtrain.comm.prepare import prepare

    world = mpi.world()
    rank = world.Get_rank()
    try:
        fn = load(exercise, path)
    except UserError as exc:  # every rank finds the same: rank 0 says it
        if rank == 0:
            write(folder / "result.json", outcome("error", str(exc)))
        return
    comm = prepare(world)  # traced, and watched when $DTRAIN_TIMEOUT is set
    try:
        exercise.load_check()(fn, comm, Grade(comm))
    except Wrong as wrong:  # every rank raises it, at the same step
        if rank == 0:
            write(folder / "result.json", outcome("fail", wrong.describe()))
        return
    except Exception as exc:  # this rank alone, maybe: say so, then end the job (the others may be waiting for us)
        write(folder / f"rank-{rank}.json", raised(exercise, exc, path, rank))
        raise
    if rank == 0:
        write(folder / "result.json", outcome("pass"))


def write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def main(argv: list[str]) -> None:
    mode, exercise_id, path, result, *rest = argv
    exercise = exercises.get(exercise_id)
    if mode == "sim":
        sizes = [int(n) for n in rest[0].split(",")] if rest and rest[0] else []
        try:
            data = run_sim(exercise, Path(path), sizes)
        except UserError as exc:
            data = outcome("error", str(exc))
        write(Path(result), data)
    else:
        run_mpi(exercise, Path(path), Path(result))


if __name__ == "__main__":
    main(sys.argv[1:])

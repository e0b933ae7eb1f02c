"""One part of a check, in a process of its own:
``python -m dtrain.course.exercises.run sim|mpi ID FILE RESULT [RANKS]``.

The checker (:mod:`dtrain.course.exercises.checker`) starts this with a time limit, so that nothing a learner writes (an
endless loop, a receive that nothing matches) can hang it:

* ``sim``: the check on simulated ranks, for each world size in RANKS (comma-separated; none for an exercise that
  needs no ranks), in this one process; it stops at the first size that fails. A deadlock is the simulator's report
  of what every rank waits for.
* ``mpi``: run by every rank of ``mpiexec -n P``: the check on the real world, traced (messages are counted) and
  watched (a wait longer than ``$DTRAIN_TIMEOUT`` ends the job with a report).

Each writes what happened as JSON to RESULT (``mpi``: RESULT is a folder; rank 0 writes ``result.json``, and a rank
whose call of the learner's function raised writes ``rank-R.json`` before the job ends; rank 0 keeps the case in
progress in ``case.json``, for the report of a job that hangs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dtrain.course import exercises
from dtrain.course.exercises.grading import Grade, Wrong, place
from dtrain.errors import UserError
from dtrain.loading import load_function, where

SIM_TIMEOUT_S = 30.0  # a simulated world that runs this long is looping, not computing


def outcome(status: str, message: str = "", **extra) -> dict:
    return {"status": status, "message": message, **extra}


def load(exercise, path: Path):
    return load_function(path, exercise.function, exercise.parameters, who=f"exercise {exercise.id}: ")


def raised(exercise, exc: BaseException, path: Path, rank: int | None, grade: Grade | None = None) -> dict:
    """What an exception from the learner's function means: the stub not yet replaced, or a bug, said with the rank,
    the case and the algorithm's step it came in (where known, from ``grade``) and the line of the learner's file."""
    if isinstance(exc, NotImplementedError) and str(exc).startswith(f"exercise {exercise.id}"):
        return outcome("not started", f"{exercise.function} still raises NotImplementedError: write it in {path}")
    who = f"rank {rank}" if rank is not None else ""
    at = grade.where() if grade is not None else ""
    lead = f"{who}, {at}" if who and at else f"{who} " if who else at
    text = f"{lead}raised {type(exc).__name__}: {exc}{where(exc, path)}"
    if _truncated(exc):
        text += "\na message larger than the buffer that receives it: a receive's buffer must hold the whole message"
    return outcome("error", text, rank=rank)


def _truncated(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI's error class MPI_ERR_TRUNCATE (mpi4py's), or the simulator's error of that name."""
    error_class = getattr(exc, "Get_error_class", None)
    if error_class is not None:
        from mpi4py import MPI

        return error_class() == MPI.ERR_TRUNCATE
    return "(MPI_ERR_TRUNCATE)" in str(exc)  # (dtrain.comm.simcomm names the class it stands for)


def run_sim(exercise, path: Path, sizes: list[int]) -> dict:
    from dtrain.comm import sim
    from dtrain.comm.trace import TracedComm, Tracer

    fn = load(exercise, path)
    check = exercise.load_check()
    if not sizes:  # one process, no ranks
        grade = Grade(None)
        try:
            check(fn, None, grade)
        except Wrong as wrong:
            return outcome("fail", wrong.describe())
        except Exception as exc:
            return raised(exercise, exc, path, None, grade)
        return outcome("pass")

    grades = {}  # rank -> its Grade, which knows the case and the algorithm's step in progress (for a report)

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
            return {**raised(exercise, failed.exception, path, failed.rank, grades.get(failed.rank)), "ranks": p}
        except sim.SimDeadlock as deadlock:
            return outcome("deadlock", during(grades) + str(deadlock), ranks=p)
        except sim.SimTimeout as timeout:
            return outcome("timeout", during(grades) + str(timeout), ranks=p)
    return outcome("pass")


def during(grades: dict) -> str:
    """``"in case 3 of 8 (what it is): "``, the case rank 0 was in when the run stopped ("" before the first case),
    then each rank's algorithm step where known (``"; every rank in ring step 0 of the all-gather"``, ``"; the
    algorithm's steps: rank 0 in ring step 0 of the reduce-scatter, rank 1 in none"``)."""
    grade = grades.get(0)
    case, about, cases = grade.current if grade is not None else (None, "", None)
    if case is None:
        return ""
    said = place(None, case, cases, about)[:-2]
    phases = {rank: g.phase() for rank, g in sorted(grades.items())}
    if any(phases.values()):
        if len(set(phases.values())) == 1:
            said += f"; every rank in {phases[0]}"
        else:
            said += "; the algorithm's steps: " + ", ".join(f"rank {rank} in {phase or 'none'}"
                                                            for rank, phase in phases.items())  # fmt: skip
    return f"in {said}:\n"


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
    # rank 0 notes each case as it starts: if the job hangs and is ended, the checker can say in which case
    grade = Grade(comm, started=(lambda g: write(folder / "case.json", {"where": g.where()})) if rank == 0 else None)
    try:
        exercise.load_check()(fn, comm, grade)
    except Wrong as wrong:  # every rank raises it, at the same case
        if rank == 0:
            write(folder / "result.json", outcome("fail", wrong.describe()))
        return
    except Exception as exc:  # this rank alone, maybe: say so, then end the job (the others may be waiting for us)
        write(folder / f"rank-{rank}.json", raised(exercise, exc, path, rank, grade))
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

"""Checks of lesson 8's pipeline schedules: the learner writes each stage's order of forwards and backwards, and the
check holds it to the rules a schedule must keep, without MPI.

The rules (those :func:`dtrain.parallel.schedules.check` and :func:`~dtrain.parallel.schedules.simulate` hold every
schedule to): every stage runs every micro-batch's forward once and then its backward once; with the messages added
(a receive before each computation whose input another stage makes, a send after each one whose output another stage
needs), the sends and receives match one to one and the stages run to the end without a deadlock. Then what makes
the schedule itself: its bubble (the idle fraction of the simulated step) equals the formula (P - 1) / (M + P - 1),
and 1F1B holds at most P - s micro-batches' activations on stage s, GPipe all M.
"""

from __future__ import annotations

from dtrain.course.exercises.grading import Exercise
from dtrain.parallel import schedules
from dtrain.parallel.instructions import Compute, Instruction

EXERCISES = (
    Exercise("8.1", "the 1F1B schedule", "schedules.py", "one_f_one_b", ("stages", "microbatches"),
             "dtrain.parallel.schedules:one_f_one_b_order", "dtrain.course.exercises.checks.pipeline:one_f_one_b",
             hint="stage s: P - s - 1 forwards first (warm-up, at most M), then pairs (the next forward, the oldest "
                  "backward) while forwards are left, then the backwards left; lessons/08_pipeline_parallel.py and "
                  "schedules.py's docstring draw it"),
    Exercise("8.2", "the GPipe schedule", "schedules.py", "gpipe", ("stages", "microbatches"),
             "dtrain.parallel.schedules:gpipe_order", "dtrain.course.exercises.checks.pipeline:gpipe",
             hint="every stage: the M forwards, micro-batch 0 first, then the M backwards in the same order"),
)  # fmt: skip
SIZES = ((1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (5, 3), (4, 2))  # (P, M), M < P among them
TIMES = ((1.0, 2.0), (1.0, 1.0))  # (forward, backward) seconds of the simulation


def word(ins) -> str:
    return f"the {ins.op} of micro-batch {ins.micro}"


def orders(grade, result, stages: int) -> list[list[Compute]] | None:
    """The learner's schedule as each stage's list of Forward/Backward records (sends and receives, if any, are
    left out: the check adds its own), or None after a problem that says what came back."""
    if not isinstance(result, list | tuple) or len(result) != stages:
        got = f"{len(result)} lists" if isinstance(result, list | tuple) else f"a {type(result).__name__}"
        grade.fail(f"the schedule is {got}; it must be a list of {stages} lists, one per stage")
        return None
    programs = []
    for s, program in enumerate(result):
        if not isinstance(program, list | tuple):
            grade.fail(f"stage {s}'s program is a {type(program).__name__}, not a list of Forward/Backward records")
            return None
        strange = [ins for ins in program if not isinstance(ins, Instruction)]
        if strange:
            grade.fail(f"stage {s}'s program holds {strange[0]!r}: write Forward(stage, micro) and "
                       "Backward(stage, micro) records (from dtrain.parallel.instructions)")  # fmt: skip
            return None
        programs.append([ins for ins in program if isinstance(ins, Compute)])
    return programs


def stage_rules(grade, programs, microbatches: int) -> bool:
    """Every stage runs each micro-batch's forward once, then its backward once, all of them, its own stage only.
    The first broken rule is a problem that names the stage, the micro-batch and the place; returns whether none."""
    for s, program in enumerate(programs):
        done = {"forward": set(), "backward": set()}
        for position, ins in enumerate(program, 1):
            where = f"stage {s}, instruction {position} of its program ({type(ins).__name__}({ins.stage}, {ins.micro}))"
            if ins.stage != s:
                grade.fail(f"{where}: a computation of stage {ins.stage} in stage {s}'s program")
                return False
            if not 0 <= ins.micro < microbatches:
                grade.fail(f"{where}: there is no micro-batch {ins.micro} (there are {microbatches}: 0 .. "
                           f"{microbatches - 1})")  # fmt: skip
                return False
            if ins.micro in done[ins.op]:
                grade.fail(f"{where}: stage {s} runs {word(ins)} a second time")
                return False
            if ins.op == "backward" and ins.micro not in done["forward"]:
                grade.fail(f"{where}: stage {s} runs the backward of micro-batch {ins.micro} before its forward (a "
                           "backward needs the activations its forward keeps)")  # fmt: skip
                return False
            done[ins.op].add(ins.micro)
        for op, seen in done.items():
            left = sorted(set(range(microbatches)) - seen)
            if left:
                grade.fail(f"stage {s} never runs the {op} of micro-batch {left[0]} (every stage runs every "
                           "micro-batch's forward and backward once)")  # fmt: skip
                return False
    return True


def runs(grade, programs, stages: int, microbatches: int) -> list | None:
    """With the messages added, the schedule keeps ``schedules.check``'s rules and runs without a deadlock: returns
    each (forward, backward) time's simulated timeline, or None after a problem."""
    schedule = schedules.with_messages(programs, stages)
    try:
        schedules.check(schedule, microbatches)
    except ValueError as broken:
        grade.fail(f"the schedule breaks a rule: {broken}")
        return None
    timelines = []
    for forward_s, backward_s in TIMES:
        try:
            timelines.append(schedules.simulate(schedule, forward_s, backward_s))
        except RuntimeError as stuck:
            grade.fail(f"with its sends and receives added, {stuck}")
            return None
    return timelines


def same_bubble(grade, timelines, stages: int, microbatches: int) -> None:
    expected = schedules.bubble_formula(stages, microbatches)
    for (forward_s, backward_s), timeline in zip(TIMES, timelines, strict=True):
        found = schedules.bubble(timeline)
        if abs(found - expected) > 1e-9:
            grade.fail(f"with forwards of {forward_s:g} s and backwards of {backward_s:g} s the stages idle "
                       f"{found:.4f} of the step; a pipeline's bubble is (P - 1) / (M + P - 1) = {expected:.4f}: some "
                       "stage waits longer than it must")  # fmt: skip
            grade.note("the simulated step, a line per stage (F3/B3: micro-batch 3's forward/backward, ..: idle):")
            for s, line in enumerate(schedules.text(timeline, stages)):
                grade.note(f"  stage {s}  {line}")
            return


def schedule_check(fn, grade, limit, what: str) -> None:
    """The common cases: for each (P, M), the stage rules, the messages and the simulation, the bubble, and each
    stage's activations in flight against ``limit(P, M, s)``."""
    for number, (stages, microbatches) in enumerate(SIZES, 1):
        with grade.step(number, f"{stages} stage(s), {microbatches} micro-batch(es)", len(SIZES)):
            programs = orders(grade, fn(stages, microbatches), stages)
            if programs is None or not stage_rules(grade, programs, microbatches):
                continue
            timelines = runs(grade, programs, stages, microbatches)
            if timelines is None:
                continue
            for s, program in enumerate(programs):
                held, most = schedules.in_flight(program), limit(stages, microbatches, s)
                if held != most:
                    grade.fail(f"stage {s} holds {held} micro-batches' activations at once (forwards whose backward "
                               f"has not run); {what} holds {most} there")  # fmt: skip
                    break
            same_bubble(grade, timelines, stages, microbatches)


def one_f_one_b(fn, comm, grade) -> None:
    """``fn(P, M)`` returns each stage's order of Forward/Backward records: every rule of a schedule, no deadlock, the
    bubble of the formula, and at most P - s micro-batches in flight on stage s (exactly min(M, P - s))."""
    schedule_check(fn, grade, lambda stages, microbatches, s: min(microbatches, stages - s),
                   "1F1B starts a backward as soon as it can: it")  # fmt: skip


def gpipe(fn, comm, grade) -> None:
    """``fn(P, M)`` returns each stage's order of Forward/Backward records: every rule of a schedule, no deadlock, the
    bubble of the formula, and all M micro-batches in flight on every stage (all forwards before any backward)."""
    schedule_check(fn, grade, lambda stages, microbatches, s: microbatches,
                   "GPipe runs every forward before any backward: it")  # fmt: skip

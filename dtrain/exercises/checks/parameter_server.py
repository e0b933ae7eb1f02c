"""Checks of lesson 4's parameter servers: the stale-synchronous gate (no ranks), and a worker's push and pull.

The gate is held against hand-worked cases (bound 0 is lockstep, None asynchronous) and against its definition on
random clocks: worker w may be answered when it is at most ``bound`` steps ahead of *every* running worker.
"""

from __future__ import annotations

import random

from dtrain.exercises.grading import Exercise

EXERCISES = (
    Exercise("4.2", "the stale-synchronous gate", "parameter_server.py", "stale_synchronous_ready",
             ("waiting", "clock", "running", "bound"), "dtrain.parallel.ps_server:stale_synchronous_ready",
             "dtrain.exercises.checks.parameter_server:stale_synchronous_ready",
             hint="the slowest running worker sets the pace: answer w when clock[w] - min(its clock) <= bound; "
                  "bound None answers everyone"),
)  # fmt: skip

# (waiting, clock, running, bound, expected, what the case is about): worked by hand
GATE_CASES = (
    ([0, 1], [3, 3, 2], [0, 1, 2], 0, [], "bound 0 (lockstep): workers 0 and 1 wait for worker 2, a step behind"),
    ([0, 1, 2], [3, 3, 3], [0, 1, 2], 0, [0, 1, 2], "bound 0: everyone at step 3, all are answered"),
    ([2, 0], [3, 3, 3], [0, 1, 2], 0, [2, 0], "bound 0: the answer keeps the order of waiting"),
    ([0, 1], [9, 4, 0], [0, 1, 2], None, [0, 1], "bound None (asynchronous): everyone is answered at once"),
    ([0, 1], [5, 4, 3], [0, 1, 2], 1, [1], "bound 1: worker 1 is one step ahead of the slowest, worker 0 two"),
    ([0, 1], [5, 4, 3], [0, 1, 2], 2, [0, 1], "bound 2: worker 0 is exactly two steps ahead: answered"),
    ([0], [5, 4, 1], [0, 1], 1, [0], "worker 2 has finished (not running): the slowest running is worker 1"),
    ([1], [5, 4, 1], [1, 2], 2, [], "worker 0 is not running; worker 1 is three steps ahead of worker 2"),
    ([0, 3], [2, 6, 6, 2], [0, 1, 2, 3], 0, [0, 3], "bound 0: the slowest are answered, whoever runs ahead"),
    ([], [1, 2], [0, 1], 0, [], "no worker waiting: no answer"),
    ([0, 1], [1, 2], [], 1, [0], "no worker running: the slowest counts as at step 0"),
)


def gate_oracle(waiting, clock, running, bound) -> list[int]:
    """Worker w may go on when no running worker is more than ``bound`` steps behind it (or at step 0, if none is)."""
    behind = [clock[v] for v in running] or [0]
    return [w for w in waiting if bound is None or all(clock[w] - c <= bound for c in behind)]


def random_gate_cases(count: int, seed: int = 4):
    rng = random.Random(seed)
    for _ in range(count):
        workers = rng.randint(1, 6)
        clock = [rng.randint(0, 8) for _ in range(workers)]
        running = sorted(rng.sample(range(workers), rng.randint(0, workers)))
        waiting = rng.sample(range(workers), rng.randint(0, workers))
        yield waiting, clock, running, rng.choice((None, 0, 1, 2, 3))


def stale_synchronous_ready(fn, comm, grade) -> None:
    """``fn(waiting, clock, running, bound)``: the hand-worked cases, then 500 random ones against the definition;
    its arguments are left as they were."""
    cases = [(*case[:4], case[4], case[5]) for case in GATE_CASES]
    cases += [(*case, gate_oracle(*case), "random clocks") for case in random_gate_cases(500)]
    for number, (waiting, clock, running, bound, expected, about) in enumerate(cases, 1):
        call = f"stale_synchronous_ready(waiting={waiting}, clock={clock}, running={running}, bound={bound})"
        with grade.step(number, about):
            arguments = (list(waiting), list(clock), list(running), bound)
            got = fn(*arguments)
            got = list(got) if isinstance(got, (list, tuple)) else got
            if not grade.equal(got, expected, call):
                slowest = min((clock[v] for v in running), default=0)
                grade.note(f"the slowest running worker is at step {slowest}: a waiting worker w is answered when "
                           f"clock[w] - {slowest} <= bound (any, if bound is None), in waiting's order")  # fmt: skip
            grade.equal(arguments[:3], (waiting, clock, running), "waiting, clock, running after the call")

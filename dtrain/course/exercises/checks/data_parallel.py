"""Checks of lesson 3's gradient buckets (DDP's reducer): when a bucket may start, and how the flat gradient is cut.

Both run in one process: they are the decisions DDP takes on every rank alike, graded against oracles written from
their rules (replay the readiness order: a bucket starts once it and every bucket before it are complete; the plan's
properties: contiguous slices in reverse parameter order, each closing once it holds enough bytes).
"""

from __future__ import annotations

import numpy as np

from dtrain.course.exercises.grading import Exercise

EXERCISES = (
    Exercise("3.1", "which gradient buckets may start", "buckets.py", "buckets_to_start",
             ("missing", "started", "bucket"), "dtrain.parallel.buckets:buckets_to_start",
             "dtrain.course.exercises.checks.data_parallel:buckets_to_start",
             hint="count the parameter off (missing[bucket] -= 1), then walk from bucket `started` on and stop at the "
                  "first bucket that still waits for a parameter: every rank must start the same all-reduces in the "
                  "same order, or their messages cross"),
    Exercise("3.2", "cutting the flat gradient into buckets", "buckets.py", "plan_buckets",
             ("parameters", "bucket_bytes"), "dtrain.parallel.buckets:plan_buckets",
             "dtrain.course.exercises.checks.data_parallel:plan_buckets",
             hint="walk the parameters from the last one back (backward makes the last layer's gradient first), "
                  "add each to the open bucket, and close the bucket as soon as it holds >= bucket_bytes bytes"),
)  # fmt: skip


# --- 3.1: buckets_to_start ------------------------------------------------------------------------------------------
def may_start(complete: list[bool], started: int) -> list[int]:
    """The oracle: the buckets from ``started`` on that every earlier bucket's completeness lets start now."""
    now = []
    while started + len(now) < len(complete) and complete[started + len(now)]:
        now.append(started + len(now))
    return now


def why_wrong(returned, expected: list[int], missing: list[int], started: int) -> str:
    """What is wrong with the buckets ``returned`` (the oracle says ``expected``), in words."""
    for b in returned:
        if not isinstance(b, int | np.integer) or not 0 <= b < len(missing):
            return f"{b!r} is not a bucket number (0 .. {len(missing) - 1})"
        if b < started:
            return f"bucket {b} had already started: each bucket starts exactly once"
        if b not in expected and missing[b] > 0:
            return f"bucket {b} still waits for {missing[b]} parameter(s): it cannot start yet"
        if b not in expected:
            first = started + len(expected)
            return (f"bucket {b} is complete, but starting it now is out of order: bucket {first} has not started "
                    f"(it still waits for {missing[first]} parameter(s)); buckets start strictly in order 0, 1, 2, "
                    "... on every rank")  # fmt: skip
    if list(returned) != sorted(returned):
        return f"the buckets must come in order: {sorted(returned)}, not {list(returned)}"
    left_out = [b for b in expected if b not in returned]
    if left_out:
        return (f"bucket {left_out[0]} may start now (it and every bucket before it are complete), but was not "
                "returned")  # fmt: skip
    return "the buckets returned are not the ones that may start"


def replay(fn, grade, sizes: list[int], order: list[int]) -> None:
    """Call ``fn`` for each parameter of ``order`` becoming ready (``sizes``: each bucket's parameter count) and
    compare every call with the oracle; stop at the first wrong call."""
    bucket_of = [b for b, n in enumerate(sizes) for _ in range(n)]
    missing, oracle, started, all_started = list(sizes), list(sizes), 0, []
    for k, index in enumerate(order):
        bucket = bucket_of[index]
        oracle[bucket] -= 1
        expected = may_start([n == 0 for n in oracle], started)
        before = list(missing)
        returned = fn(missing, started, bucket)
        where = (f"buckets of {sizes} parameters, parameters ready in the order {order[: k + 1]}"
                 f"{' ...' if k + 1 < len(order) else ''}: the call for parameter {index} (bucket {bucket}) with "
                 f"missing={before}, started={started}")  # fmt: skip
        if not isinstance(returned, list | tuple):
            grade.fail(f"{where} returned a {type(returned).__name__}; it must return a list of bucket numbers")
            return
        if list(missing) != oracle:
            grade.fail(f"{where} left missing={list(missing)}, expected {oracle} (count the ready parameter off "
                       "its own bucket, in place)")  # fmt: skip
            return
        if list(returned) != expected:
            grade.fail(f"{where} returned {list(returned)}, expected {expected}: "
                       f"{why_wrong(returned, expected, missing, started)}")  # fmt: skip
            return
        started += len(expected)
        all_started += expected
    if all_started != list(range(len(sizes))):  # (the oracle's calls together start each bucket once, in order)
        grade.fail(f"buckets of {sizes} parameters: started {all_started} in all")


def buckets_to_start(fn, comm, grade) -> None:
    """``fn(missing, started, bucket)`` counts the ready parameter off ``missing`` and returns the buckets that may
    start, so that over a whole backward every bucket starts exactly once, in order 0, 1, 2, ..., as soon as it and
    every bucket before it are complete: hand-made cases, then random plans and random readiness orders."""
    hand = (
        ("one bucket of 3 parameters", [3], [2, 1, 0]),
        ("3 buckets, ready in backward's order (the last parameter first)", [2, 1, 2], [0, 1, 2, 3, 4]),
        ("3 buckets, the last bucket complete first", [2, 1, 2], [3, 4, 2, 0, 1]),
        ("4 buckets of 1, ready in reverse", [1, 1, 1, 1], [3, 2, 1, 0]),
    )
    randoms = ((3, 2), (5, 3), (8, 4))
    cases = len(hand) + len(randoms)
    for number, (about, sizes, order) in enumerate(hand, 1):
        with grade.step(number, about, cases):
            replay(fn, grade, sizes, order)
    rng = np.random.default_rng(31)
    for number, (buckets, params) in enumerate(randoms, len(hand) + 1):
        with grade.step(number, f"200 random plans of up to {buckets} buckets of up to {params} parameters, random "
                        "readiness orders", cases):  # fmt: skip
            for _ in range(200):
                sizes = [int(n) for n in rng.integers(1, params + 1, size=int(rng.integers(1, buckets + 1)))]
                replay(fn, grade, sizes, [int(i) for i in rng.permutation(sum(sizes))])
                if grade.problems:
                    break


# --- 3.2: plan_buckets ----------------------------------------------------------------------------------------------
def layout(sizes: list[int], itemsize: int) -> list[tuple[int, int, int]]:
    """(offset, size, itemsize) of parameters of ``sizes`` elements laid end to end in a flat buffer."""
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(int)
    return [(int(o), int(n), itemsize) for o, n in zip(offsets, sizes, strict=True)]


def normalized(grade, plan) -> list[tuple[int, int, list[int]]] | None:
    """The learner's plan as [(start, stop, [indices])], or None after a problem that says what came back."""
    try:
        return [(int(start), int(stop), [int(i) for i in members]) for start, stop, members in plan]
    except (TypeError, ValueError):
        grade.fail(f"plan_buckets returned {plan!r}: it must return a list of (start, stop, parameter indices)")
        return None


def properties(grade, plan, parameters, bucket_bytes: int) -> None:
    """The plan's rules (which fix it entirely), each with its own message; stops at the first broken one."""
    n = len(parameters)
    total = parameters[-1][0] + parameters[-1][1]
    what = f"{n} parameters of {[size for _, size, _ in parameters]} elements, bucket_bytes={bucket_bytes}"
    order = [i for _, _, members in plan for i in members]
    if order != list(reversed(range(n))):
        grade.fail(f"{what}: the buckets' parameters, one after another, are {order}; expected every parameter "
                   f"once in reverse order {list(reversed(range(n)))} (backward makes the last layer's gradient "
                   "first)")  # fmt: skip
        return
    if bucket_bytes == 0 and len(plan) != 1:
        grade.fail(f"{what}: {len(plan)} buckets; bucket_bytes=0 means one bucket for everything")
        return
    stop = total
    for b, (start, end, members) in enumerate(plan):
        if not members:
            grade.fail(f"{what}: bucket {b} holds no parameter")
            return
        first, last = parameters[members[0]], parameters[members[-1]]
        if (start, end) != (last[0], first[0] + first[1]) or end != stop:
            grade.fail(f"{what}: bucket {b} = flat[{start}:{end}] with parameters {members}; expected flat"
                       f"[{last[0]}:{first[0] + first[1]}], the slice its parameters cover, right below the bucket "
                       f"before it (which starts at {stop})")  # fmt: skip
            return
        stop = start
        nbytes = [parameters[i][1] * parameters[i][2] for i in members]
        if sum(nbytes) - nbytes[-1] >= bucket_bytes > 0:
            grade.fail(f"{what}: bucket {b} holds {sum(nbytes)} bytes, but it held {sum(nbytes) - nbytes[-1]} "
                       f">= {bucket_bytes} before its last parameter {members[-1]}: it should have closed")  # fmt: skip
            return
        if b < len(plan) - 1 and sum(nbytes) < bucket_bytes:
            grade.fail(f"{what}: bucket {b} closed with {sum(nbytes)} bytes < bucket_bytes={bucket_bytes} (only the "
                       "last bucket may hold less)")  # fmt: skip
            return
    if stop != 0:
        grade.fail(f"{what}: the buckets cover flat[{stop}:{total}], not the whole buffer flat[0:{total}]")


def plan_buckets(fn, comm, grade) -> None:
    """``fn(parameters, bucket_bytes)`` cuts the flat buffer into contiguous buckets in reverse parameter order, each
    closing once it holds >= bucket_bytes bytes (0: one bucket): hand-computed plans, then the rules on random
    layouts."""
    mlp = layout([64 * 128, 128, 128 * 10, 10], 4)  # MLP([64, 128, 10]) in float32: W0, b0, W1, b1
    hand = (
        (mlp, 4096, [(8320, 9610, [3, 2]), (0, 8320, [1, 0])], "MLP([64, 128, 10]) in float32, 4096-byte buckets"),
        (mlp, 0, [(0, 9610, [3, 2, 1, 0])], "the same, bucket_bytes=0: one bucket"),
        (mlp, 1, [(9600, 9610, [3]), (8320, 9600, [2]), (8192, 8320, [1]), (0, 8192, [0])],
         "the same, 1-byte buckets: a bucket per parameter"),
        (mlp, 10**9, [(0, 9610, [3, 2, 1, 0])], "the same, buckets larger than the model: one bucket"),
        (layout([3, 5, 2], 8), 40, [(3, 10, [2, 1]), (0, 3, [0])], "3 float64 parameters, 40-byte buckets"),
    )  # fmt: skip
    itemsizes = (4, 8, 2)
    cases = len(hand) + len(itemsizes)
    for number, (parameters, bucket_bytes, expected, about) in enumerate(hand, 1):
        with grade.step(number, f"{about}: parameters (offset, size, itemsize) = {parameters}", cases):
            plan = normalized(grade, fn(parameters, bucket_bytes))
            if plan is not None:
                properties(grade, plan, parameters, bucket_bytes)
                if grade.problems:
                    grade.note(f"plan_buckets(parameters, {bucket_bytes}) returned {plan}; expected {expected}")
                else:
                    grade.equal(plan, expected, f"plan_buckets(parameters, {bucket_bytes})")
    rng = np.random.default_rng(32)
    for number, itemsize in enumerate(itemsizes, len(hand) + 1):
        with grade.step(number, f"100 random layouts of 1 to 8 parameters, itemsize {itemsize}, random bucket_bytes",
                        cases):  # fmt: skip
            for _ in range(100):
                parameters = layout([int(s) for s in rng.integers(1, 50, size=int(rng.integers(1, 9)))], itemsize)
                bucket_bytes = int(rng.choice([0, 1, *rng.integers(2, 60 * itemsize, size=3)]))
                plan = normalized(grade, fn(list(parameters), bucket_bytes))
                if plan is not None:
                    properties(grade, plan, parameters, bucket_bytes)
                if grade.problems:
                    break

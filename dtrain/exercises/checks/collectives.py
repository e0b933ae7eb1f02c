"""Checks of lesson 2's collectives: the learner's function against the sum over ranks, and the algorithm's traffic.

Every rank starts from values of its own that are small integers (exact in float32 and float64), so the sum over the
ranks is exact whatever order an algorithm adds in, and a result either is the sum or is wrong.
"""

from __future__ import annotations

import numpy as np

from dtrain.exercises.grading import MPI, RINGS, Exercise

EXERCISES = (
    Exercise("2.1", "ring all-reduce", "ring.py", "ring_allreduce", ("comm", "buf"),
             "dtrain.collectives.ring:allreduce", "dtrain.exercises.checks.collectives:ring_allreduce", RINGS, MPI,
             "a reduce-scatter (p - 1 steps: send a chunk to the right, add the chunk from the left into yours) "
             "then an all-gather (p - 1 steps: pass the finished chunks on); lessons/02_allreduce.py draws it"),
)  # fmt: skip
DTYPES = (np.float64, np.float32)


def rank_values(rank: int, n: int, dtype=np.float64) -> np.ndarray:
    """Rank ``rank``'s buffer before a collective: integers that say whose they are (rank r, element i: 100 r + i % 97,
    plus one so that no rank holds zeros)."""
    return (100 * rank + np.arange(n) % 97 + 1).astype(dtype)


def sizes(p: int) -> tuple[int, ...]:
    """Buffer lengths: fewer elements than ranks, one per rank minus one, exactly p, uneven chunks, a large one."""
    return tuple(dict.fromkeys((1, max(p - 1, 1), p, 7 * p + 3, 1000)))


def unchanged(grade, buf, before, what: str) -> None:
    """A note for a failing step whose buffer is still what the rank started with: the result goes into ``buf``."""
    if np.array_equal(buf, before):
        grade.note(f"{what} still holds this rank's own values: the result must be written into it, in place "
                   "(buf[a:b] += ..., comm.Recv(buf[a:b], ...)), not returned as a new array")  # fmt: skip


def ring_allreduce(fn, comm, grade) -> None:
    """``fn(comm, buf)`` leaves the sum over all ranks in every rank's ``buf``, sending 2(p - 1) messages per rank and
    2(p - 1) n elements over all ranks (each chunk once around the ring to be reduced, once to be shared)."""
    p, r = comm.Get_size(), comm.Get_rank()
    step = 0
    for dtype in DTYPES:
        for n in sizes(p):
            step += 1
            buf = rank_values(r, n, dtype)
            before = buf.copy()
            expected = sum(rank_values(q, n, dtype) for q in range(p))
            with grade.step(step, f"{p} ranks, {n} {np.dtype(dtype).name} elements, rank r holds 100 r + 1, 100 r + 2, "
                            "..."):  # fmt: skip
                fn(comm, buf)
                if not grade.same(buf, expected, "buf after the call (the sum over all ranks)"):
                    unchanged(grade, buf, before, "buf")
                # (with empty chunks a ring may rightly skip their messages: then the count only explains a failure)
                grade.traffic(2 * (p - 1), 2 * (p - 1) * buf.nbytes, "a ring all-reduce", strict=n >= p)

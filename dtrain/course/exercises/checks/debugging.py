"""Checks of lesson 10 (debugging): find the bug in a given program.

Each stub is a short distributed function with a bug in it, the kind that reaches real programs because it passes
the test its author ran: a ring all-gather whose ranks all Send before they Receive (fine on small buffers, a deadlock
once a message is above the eager limit), and an average through rank 0 that only rank 0 finishes (its author looked
at rank 0's weights). The learner deletes the stub's raise line, runs the check, reads the report (the simulator's
account of what every rank waits for, or the first wrong element and on which rank) and fixes the function.

The checks hold the result against the answer computed here from every rank's values, on buffers from one element
to well above the eager limit (a large Send waits for its receive, on the simulator as under MPI), on 1 to 8 ranks.
"""

from __future__ import annotations

import numpy as np

from dtrain.collectives import chunk_bounds
from dtrain.course.exercises.checks.collectives import elements
from dtrain.course.exercises.grading import MPI, RINGS, Exercise, plural, rank_values, ring_steps

EXERCISES = (
    Exercise("10.1", "find the deadlock in a ring all-gather", "allgather.py", "ring_allgather", ("comm", "buf"),
             "dtrain.collectives.ring:allgather", "dtrain.course.exercises.checks.debugging:ring_allgather", RINGS, MPI,
             "every rank Sends before it receives; a Send larger than the eager limit waits until its receive is "
             "posted, so each rank waits for its right neighbour, which waits for its own: exchange with one "
             "comm.Sendrecv(sendbuf, dest=right, recvbuf=..., source=left) per step (or Irecv, Isend, then Wait both)"),
    Exercise("10.2", "find the asymmetric collective in an average through rank 0", "average.py", "average_weights",
             ("comm", "flat"), "dtrain.parallel.replicas:average_weights",
             "dtrain.course.exercises.checks.debugging:average_weights", (1, 2, 3, 4, 5), MPI,
             "a collective is a call that every rank makes: a broadcast that only rank 0 reaches sends the mean to "
             "ranks that never receive it. Every rank must call collectives.broadcast(comm, flat, root=0); only the "
             "division is rank 0's alone"),
)  # fmt: skip
LARGE = 20_000  # elements of float64 per chunk: 160 KB, above the simulator's eager limit (64 KiB) and MPICH's


def gathered(p: int, n: int, dtype) -> np.ndarray:
    """What every rank's buffer holds after an all-gather: chunk q (``chunk_bounds``) of rank q's values."""
    out = np.empty(n, dtype=dtype)
    for q, (a, b) in enumerate(chunk_bounds(n, p)):
        out[a:b] = rank_values(q, n, dtype)[a:b]
    return out


def ring_allgather(fn, comm, grade) -> None:
    """``fn(comm, buf)``, with rank r's own values in chunk r of ``buf`` and -1 elsewhere, leaves chunk q of rank q
    in every rank's ``buf`` for every q, sending p - 1 messages per rank, (p - 1) n elements over all ranks (each
    chunk to every other rank once). The last buffers' chunks are above the eager limit: there a Send waits for its
    receive."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    lengths = (1, p, 7 * p + 3, 1000, LARGE * p + 3)
    cases = [(np.float64, n) for n in lengths] + [(np.float32, 7 * p + 3), (np.float32, LARGE * p + 1)]
    log = grade.log(comm, ring_steps(p, ("all-gather",)))  # (a deadlock or a raise names the ring's step)
    for number, (dtype, n) in enumerate(cases, 1):
        expected = gathered(p, n, dtype)
        a, b = chunk_bounds(n, p)[r]
        buf = np.full(n, -1, dtype=dtype)
        buf[a:b] = expected[a:b]
        chunk_bytes = (b - a) * np.dtype(dtype).itemsize
        with grade.step(number, f"{ranks}, {elements(n, dtype)}; rank r's chunk r holds its values, the rest -1; "
                        f"this rank's chunk: {chunk_bytes:,} bytes", len(cases)):  # fmt: skip
            fn(log, buf)
            if not grade.same(buf, expected, "buf after the call (chunk q of rank q, for every q)"):
                cut = chunk_bounds(n, p)
                wrong = [q for q, (c, d) in enumerate(cut) if not np.array_equal(buf[c:d], expected[c:d])]
                grade.note(f"rank {r}'s chunks {wrong} are not those ranks' chunks (chunk q comes from rank q: at "
                           "ring step s rank r sends chunk (r - s) % p to the right and receives chunk (r - s - 1) % p "
                           "from the left)")  # fmt: skip
            grade.traffic(p - 1, (p - 1) * buf.nbytes, "a ring all-gather", strict=n >= p)


def average_weights(fn, comm, grade) -> None:
    """``fn(comm, flat)`` leaves the mean over the ranks of every rank's ``flat`` in every rank's ``flat``. The
    learner's function gets a communicator of its own (a duplicate), so that a collective only some ranks make can
    never be matched by the check's own comparisons: it hangs, and the simulator says so."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    mine = comm.Dup()
    lengths = (1, 10, 1000, LARGE)
    for number, n in enumerate(lengths, 1):
        values = [rank_values(q, n) for q in range(p)]
        mean = sum(values) / p
        flat = values[r].copy()
        with grade.step(number, f"{ranks}, {elements(n, np.float64)}; rank r's flat holds 100 r + 1, 100 r + 2, ...",
                        len(lengths)):  # fmt: skip
            fn(mine, flat)
            right = grade.same(flat, mean, "flat after the call (the mean over all ranks)")
            everyone = comm.allgather((right, bool(np.array_equal(flat, values[r]))))
            if not right:
                if everyone[0][0] and r != 0:
                    grade.note(f"rank 0 holds the mean and rank {r} does not: did every rank take part in sending "
                               "it back? A collective is a call that every rank makes")  # fmt: skip
                elif np.allclose(flat, p * mean):
                    grade.note(f"flat holds the sum over ranks, not the mean: divide by p = {p}")
                elif all(kept for _, kept in everyone):
                    grade.note("flat still holds this rank's own values, on every rank: the function wrote nothing "
                               "into it; the mean must be written into flat itself, in place (flat[...] = ..., "
                               "collectives.broadcast(comm, flat, root=0)), not into a new array")  # fmt: skip
    mine.Free()

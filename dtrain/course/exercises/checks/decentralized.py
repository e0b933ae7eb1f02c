"""Checks of lessons 5 and 6 (decentralized training): local SGD's averaging step and one gossip round.

Both are checked against what the ranks' weights must become, computed here from every rank's values: the mean over
the ranks (local SGD) or the mixing matrix applied to the stacked vectors, X <- W X (gossip; W from the topology,
:func:`dtrain.parallel.gossip.mixing_matrix`). A gossip round's vectors start with one-hot entries (rank r's first p
elements are e_r), so the first p elements afterwards *are* the row of W that rank applied, and a failure can say
which weights were used, and whether they sum to 1 by rows and by columns.
"""

from __future__ import annotations

import numpy as np

from dtrain.course.exercises.checks.traffic import Recorder
from dtrain.course.exercises.grading import MPI, Exercise, plural, rank_values
from dtrain.parallel import gossip

EXERCISES = (
    Exercise("5.1", "local SGD's averaging step", "local_sgd.py", "local_sgd_step",
             ("comm", "flat", "step", "sync_every"), "dtrain.parallel.local_sgd:local_sgd_step",
             "dtrain.course.exercises.checks.decentralized:local_sgd_step", (1, 2, 3, 4, 5), MPI,
             "if step % sync_every == 0: all-reduce flat (the sum over ranks, e.g. "
             "dtrain.collectives.allreduce(comm, flat, 'sum', 'ring')), divide by p, return True; else send nothing "
             "and return False"),
    Exercise("6.1", "one gossip round", "gossip.py", "gossip_step", ("comm", "flat", "neighbours"),
             "dtrain.parallel.gossip:gossip_step", "dtrain.course.exercises.checks.decentralized:gossip_step",
             (2, 3, 4, 5, 6, 8), MPI,
             "Irecv each neighbour's flat into a buffer of its own, Isend flat to each neighbour, wait for all; then "
             "flat = (flat + the received ones) / (d + 1), d = len(neighbours)"),
)  # fmt: skip


def topologies(p: int) -> list[tuple[str, int]]:
    """(topology, step) pairs to try on p ranks: the fixed graphs (a torus where p = a b, a, b >= 2) and two rounds
    of random pairings."""
    fixed = ["ring", "exponential"] + (["torus"] if any(p % a == 0 for a in range(2, int(p**0.5) + 1)) else [])
    return [(t, 0) for t in fixed] + [("random", 0), ("random", 1)]


def gossip_step(fn, comm, grade) -> None:
    """``fn(comm, flat, neighbours)`` on every rank leaves row r of W X in rank r's ``flat`` (X: the ranks' vectors
    stacked; W: the topology's mixing matrix), keeps the mean over ranks, and sends ``flat`` once to each neighbour
    and to no one else."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    recorder = Recorder(comm)
    number, lengths = 0, (1, 100)
    cases = len(topologies(p)) * len(lengths)
    for topology, round_ in topologies(p):
        for n in lengths:
            number += 1
            x = np.stack([np.concatenate([np.eye(p)[q], rank_values(q, n)]) for q in range(p)])
            w = gossip.mixing_matrix(topology, p, round_)
            around = gossip.neighbours(topology, p, r, round_)
            flat = x[r].copy()
            with grade.step(number, f"{ranks}, topology {topology} (round {round_}); rank r's flat: one-hot e_r "
                            f"(p elements), then {plural(n, 'value')} 100 r + 1, 100 r + 2, ...", cases):  # fmt: skip
                grade.note(f"rank {r}'s neighbours: {around}")
                fn(recorder, flat, around)
                sent = recorder.take()
                y = np.stack(comm.allgather(flat.copy()))
                if grade.same(y.mean(axis=0), x.mean(axis=0), "the mean over ranks of flat after the round (a "
                              "gossip round keeps it)"):  # fmt: skip
                    grade.same(flat, w[r] @ x, f"flat after the round (row {r} of W X: 1/{len(around) + 1} of rank "
                               f"{r}'s own and of each neighbour's)")  # fmt: skip
                if grade.problems:
                    applied(grade, y[:, :p], w)
                dests = sorted(dest for dest, _ in sent)
                if dests != sorted(around):
                    grade.fail(f"rank {r} sent to ranks {dests}; one gossip round sends flat once to each neighbour, "
                               f"{sorted(around)}, and to no one else")  # fmt: skip
                elif any(nbytes != flat.nbytes for _, nbytes in sent):
                    grade.fail(f"rank {r} sent messages of {[b for _, b in sent]} bytes; each neighbour gets the whole "
                               f"flat ({flat.nbytes} bytes)")  # fmt: skip


def applied(grade, used: np.ndarray, w: np.ndarray) -> None:
    """A note on the weights the round used (``used``: row q = rank q's first p elements afterwards, its row of the
    matrix it applied), against the mixing matrix ``w``."""
    rows, columns = used.sum(axis=1), used.sum(axis=0)
    words = np.round(used, 4).tolist()
    if np.allclose(rows, 1) and np.allclose(columns, 1):
        grade.note(f"the round applied the matrix {words} (doubly stochastic, but not the topology's W: "
                   f"{np.round(w, 4).tolist()})")  # fmt: skip
        return
    grade.note(f"the round applied a matrix that is not doubly stochastic: its rows sum to {np.round(rows, 4).tolist()}"
               f" and its columns to {np.round(columns, 4).tolist()}; rows must sum to 1 (a weighted average) and "
               f"columns too (the mean over ranks stays put). Each rank gives 1/(d + 1) to itself and to each of "
               f"its d neighbours. Applied: {words}")  # fmt: skip


SYNC_EVERY = (1, 3, 4)


def local_update(rank: int, step: int, n: int) -> np.ndarray:
    """What rank ``rank``'s own optimizer step ``step`` adds to its weights in the check (different on every rank)."""
    return (rank + 1) * step + np.arange(n) % 5 - 2.0


def local_sgd_step(fn, comm, grade) -> None:
    """Several runs of local steps (rank-specific updates to ``flat``), each followed by ``fn(comm, flat, step,
    sync_every)``: at steps with step % sync_every == 0 every rank's ``flat`` must become the mean over ranks and fn
    return True; at the others ``flat`` must stay as it is, fn return False, and nothing be sent."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    n, number = 23, 0
    cases = sum(2 * sync_every + 1 for sync_every in SYNC_EVERY)
    for sync_every in SYNC_EVERY:
        weights = np.stack([rank_values(q, n) for q in range(p)])  # every rank's flat, as the check expects it
        flat = weights[r].copy()
        for step in range(1, 2 * sync_every + 2):
            number += 1
            weights += np.stack([local_update(q, step, n) for q in range(p)])
            flat += local_update(r, step, n)
            due = step % sync_every == 0
            with grade.step(number, f"{ranks}, sync_every {sync_every}, after local step {step} (rank-specific "
                            "weights)", cases):  # fmt: skip
                before = flat.copy()
                returned = fn(comm, flat, step, sync_every)
                if due:
                    weights[:] = weights.mean(axis=0)
                    what = f"flat after step {step} (a multiple of sync_every: the mean over ranks)"
                else:
                    what = f"flat after step {step} (not a multiple of sync_every: unchanged)"
                kept = comm.allgather(bool(np.array_equal(flat, before)))  # (every rank: an object all-gather)
                if not grade.same(flat, weights[r], what):
                    explain(grade, flat, before, weights[r], p, due, all(kept))
                grade.equal(returned, due, f"what local_sgd_step returned after step {step}")
                if not due:
                    grade.traffic(0, 0, "a local step (no average)")
            flat[...] = weights[r]  # (after a failure, go on from what it should have been)


def explain(grade, flat, before, mean, p: int, due: bool, kept_everywhere: bool) -> None:
    """A note that names the mistake where it is known: the sum instead of the mean, no average on a step that is
    due (flat as it was, on every rank), an average on a step that is not."""
    if due and np.allclose(flat, p * mean):
        grade.note(f"flat holds the sum over ranks, not the mean: divide by p = {p}")
    elif due and kept_everywhere:
        grade.note("flat still holds this rank's own weights, on every rank: nothing was averaged, though step % "
                   "sync_every == 0 here; the mean must be written into flat itself, in place (flat[...] = ..., "
                   "flat /= p), not into a new array")  # fmt: skip
    elif not due and not np.array_equal(flat, before):
        grade.note("flat changed on a step that is not a multiple of sync_every: average only when "
                   "step % sync_every == 0 (step counts from 1)")  # fmt: skip

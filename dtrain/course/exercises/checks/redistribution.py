"""Checks of exercise 14.2 (lesson 14): one redistribution on one mesh axis, against NumPy on the whole tensor.

Every rank gets its block of a 2-D float64 tensor T of M x N = 2p x 3p, laid out on the axis as the case's source
says: "partial" (rank r holds a whole M x N matrix P_r, small integers that say whose they are; T is their sum) or
"split" along a dimension (T[i, j] = N i + j + 1, so that every element says where it lies; rank r holds block r).
What it returns must be its block of T laid out as the target says, element for element, and all ranks together may
send no more than a ring's reduce-scatter or all-gather does. Where a wrong block is a known mistake (the whole sum
where a block of it was wanted, blocks joined along the other dimension, a flat chunk taken for a block of columns),
a note says which.
"""

from __future__ import annotations

import numpy as np

from dtrain.course.exercises.grading import plural, rank_values

CASES = (  # (source, target, dim, the collective it takes)
    ("partial", "replicated", None, "an all-reduce"),
    ("partial", "split", 0, "a reduce-scatter"),
    ("partial", "split", 1, "a reduce-scatter"),
    ("split", "replicated", 0, "an all-gather"),
    ("split", "replicated", 1, "an all-gather"),
)
WORDS = {0: "rows", 1: "columns"}


def blocks(array: np.ndarray, p: int, dim: int) -> list[np.ndarray]:
    """``array``'s p blocks along ``dim``, each C-contiguous."""
    return [np.ascontiguousarray(b) for b in np.split(array, p, axis=dim)]


def check_redistribute(fn, comm, grade) -> None:
    """``fn(comm, block, source, target, dim)`` in the five cases of :data:`CASES`: the block returned on every rank,
    and the bytes sent by a reduce-scatter or an all-gather."""
    p, r = comm.Get_size(), comm.Get_rank()
    m, n = 2 * p, 3 * p
    for number, (source, target, dim, collective) in enumerate(CASES, 1):
        if source == "partial":
            shares = [rank_values(q, m * n).reshape(m, n) for q in range(p)]
            whole, given = sum(shares), shares[r].copy()
            held = f"rank r holds a whole {m} x {n} P_r = 100 r + 1, 100 r + 2, ... row by row; T is their sum"
        else:
            whole = np.arange(1.0, m * n + 1).reshape(m, n)
            given = blocks(whole, p, dim)[r]
            held = f"T[i, j] = {n} i + j + 1; rank r holds block r of T along dim {dim} (its {WORDS[dim]})"
        expected = whole if target == "replicated" else blocks(whole, p, dim)[r]
        frm = "partial" if source == "partial" else f"split along dim {dim}"
        to = "replicated" if target == "replicated" else f"split along dim {dim}"
        about = f"{plural(p, 'rank')}, T {m} x {n}: {frm} -> {to}, {collective}; {held}"
        with grade.step(number, about, len(CASES)):
            before, untouched = grade.counts(), given.copy()
            out = fn(comm, given, source, target, dim)
            sent = grade.counts()[1] - before[1]
            what = "the block returned (T, whole)" if target == "replicated" else (
                f"the block returned (block {r} of T along dim {dim})")  # fmt: skip
            if not grade.same(out, expected, what):
                diagnose(grade, out, given, untouched, whole, (source, target, dim), p, r)
            if collective != "an all-reduce":
                bounded(grade, comm, sent, (p - 1) * m * n * 8, collective)


def bounded(grade, comm, sent: int, most: int, collective: str) -> None:
    """All ranks together sent at most ``most`` bytes in this case (every rank makes the same call)."""
    everyone = sum(comm.allgather(sent))
    if everyone > most and grade.rank == 0:
        grade.fail(f"all ranks together sent {everyone} bytes in this case; {collective} sends at most {most} (p - 1 "
                   "times the tensor's bytes, a ring's): an all-reduce followed by a slice sends twice that, and a "
                   "redistribution sends the least it can")  # fmt: skip


def diagnose(grade, out, given, untouched, whole, case, p: int, r: int) -> None:
    """A note on a wrong block that is a known mistake (only when it is so)."""
    source, target, dim = case
    if out is None:
        if target == "replicated" and np.array_equal(given, whole):
            grade.note("the answer is in block itself, but the function returned None: return the new block")
        return
    out = np.asarray(out)

    def equals(array) -> bool:
        return out.shape == np.shape(array) and bool(np.allclose(out, array, rtol=1e-12, atol=1e-12))

    other = None if dim is None else 1 - dim
    if equals(untouched):
        grade.note("it is this rank's own block, as it was given: nothing came from the other ranks")
    elif source == "partial" and target == "split" and equals(whole):
        grade.note(f"it is the whole sum T, what an all-reduce leaves on every rank: partial -> split keeps only this "
                   f"rank's block of the sum, block {r} along dim {dim}: a reduce-scatter (which also sends half the "
                   "bytes)")  # fmt: skip
    elif source == "partial" and equals(whole / p):
        grade.note(f"it is the mean of the {p} ranks' blocks, not their sum: a partial sum is made whole by summing")
    elif source == "partial" and target == "split" and equals(blocks(untouched, p, dim)[r]):
        grade.note(f"it is block {r} of this rank's own P_r, not of the sum: the blocks were cut but not summed")
    elif source == "partial" and target == "split" and equals(blocks(whole, p, other)[r]):
        grade.note(f"it is block {r} of the sum along dim {other} ({WORDS[other]}), not along dim {dim} "
                   f"({WORDS[dim]})")  # fmt: skip
    elif source == "partial" and target == "split" and equals(whole.reshape(p, -1)[r].reshape(np.shape(out))):
        grade.note(f"it is chunk {r} of the sum's flat buffer (row after row), in the block's shape: the collectives "
                   f"cut a buffer as flat, and a block of {WORDS[dim]} is not a flat chunk: make the blocks along dim "
                   f"{dim} the flat chunks first (np.stack(np.split(block, p, axis={dim})))")  # fmt: skip
    elif source == "split" and equals(np.concatenate(blocks(whole, p, dim), axis=other)):
        grade.note(f"it is the {p} blocks joined along dimension {other}; T was split along dimension {dim} (its "
                   f"{WORDS[dim]}: rank q holds block q of them): join them along dimension {dim}")  # fmt: skip
    elif source == "split" and equals(np.stack(blocks(whole, p, dim)).reshape(whole.shape)):
        grade.note(f"it is the gathered buffer (block after block, as the all-gather leaves it) reshaped to "
                   f"{whole.shape[0]} x {whole.shape[1]}: a block of {WORDS[dim]} is not a run of rows: put the "
                   f"blocks side by side along dimension {dim} (np.concatenate(list(buf), axis={dim}))")  # fmt: skip

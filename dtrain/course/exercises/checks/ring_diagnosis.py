"""What went wrong in a learner's ring all-reduce (exercise 2.1), read off every rank's messages: the first ring step
whose messages differ from a ring's, and how (a chunk written over the rank's own values, not added, not passed on).
Said only when the messages follow the ring's shape, so that the diagnosis is the diagnosis."""

from __future__ import annotations

import numpy as np

from dtrain.course.exercises.grading import rank_values


def ring_went_wrong(everyone, rank: int, buf, at_the_end: bool = True) -> str | None:
    """The ring step that first went wrong, from every rank's messages (``everyone[q]``: rank q's ``(dest, data)``,
    in order) held against the exercise's ring, and (``at_the_end``) from this rank's ``buf`` at the end; None where
    the messages do not say (not the ring's 2 (p - 1) messages to the right, or not its chunk order from step 0 on).

    At reduce-scatter step s rank q sends chunk (q - s) % p, the sum of ranks q - s .. q; at all-gather step s chunk
    (q - s + 1) % p, the whole sum. A message is made from the one received the step before: so the first wrong
    message (earliest step, then lowest rank) names the step whose receive-and-add (or receive) went wrong."""
    p, n, dtype = len(everyone), buf.size, buf.dtype
    if p < 2:
        return None
    bounds = [(int(c[0]), int(c[-1]) + 1) if len(c) else (0, 0) for c in np.array_split(np.arange(n), p)]
    own = [rank_values(q, n, dtype) for q in range(p)]
    total = sum(own)

    def ring(q: int, k: int) -> tuple[int, np.ndarray]:
        """Chunk and contents of rank q's k-th message in the exercise's ring."""
        if k < p - 1:
            c = (q - k) % p
            return c, sum(own[(q - j) % p] for j in range(k + 1))[slice(*bounds[c])]
        c = (q - (k - p + 1) + 1) % p
        return c, total[slice(*bounds[c])]

    def right(q: int, k: int) -> bool:
        data, want = everyone[q][k][1], ring(q, k)[1]
        return data.shape == want.shape and bool(np.array_equal(data, want))

    for q, sent in enumerate(everyone):
        if len(sent) != 2 * (p - 1) or any(dest != (q + 1) % p or data is None for dest, data in sent):
            return None
    if not all(right(q, 0) for q in range(p)):
        return None
    show = lambda x: repr(x.item())  # noqa: E731
    for k in range(1, 2 * (p - 1)):
        for q in range(p):
            if right(q, k):
                continue
            left, (c, want), data = (q - 1) % p, ring(q, k), everyone[q][k][1]
            a, b = bounds[c]
            seen = f"ring step {k} of the reduce-scatter" if k < p - 1 else f"ring step {k - p + 1} of the all-gather"
            if data.shape != want.shape:
                return (f"{seen}: rank {q} sent {data.size} elements; the ring sends chunk {c} there (buf[{a}:{b}], "
                        f"{b - a} elements)")  # fmt: skip
            i = int(np.flatnonzero(data != want)[0])
            if k <= p - 1:  # the chunk was made by the add of the reduce-scatter's step k - 1
                got, mine = everyone[left][k - 1][1], own[q][a:b]
                how = ("it wrote the chunk over its own values instead of adding it" if np.array_equal(data, got)
                       else "it did not add the chunk: it passed its own values on" if np.array_equal(data, mine)
                       else "what it made of the two is not their sum")  # fmt: skip
                return (f"ring step {k - 1} of the reduce-scatter: rank {q} received chunk {c} from rank {left}, to "
                        f"add into its own (buf[{a}:{b}] += the chunk received); {how}: at {seen} it sent element "
                        f"{a + i} as {show(data[i])}, expected {show(want[i])} = {show(got[i])} received + "
                        f"{show(mine[i])} its own")  # fmt: skip
            s = k - p  # an all-gather step s + 1 passes on the chunk received at step s
            why = (": its own values went on (receive the chunk straight into buf[a:b])"
                   if np.array_equal(data, own[q][a:b]) else "")  # fmt: skip
            return (f"ring step {s} of the all-gather: rank {q} received the finished chunk {c} from rank {left} "
                    f"but did not pass it on: at {seen} it sent element {a + i} as {show(data[i])}, expected "
                    f"{show(want[i])}{why}")  # fmt: skip
    if not at_the_end or buf.shape != total.shape:
        return None
    wrong = np.flatnonzero(buf != total)
    if not wrong.size:
        return None
    e = int(wrong[0])
    c = next(q for q, (a, b) in enumerate(bounds) if a <= e < b)
    a, b = bounds[c]
    at = f"element {e} is {show(buf[e])}, expected {show(total[e])}"
    if c == (rank + 1) % p:
        return (f"ring step {p - 2} of the reduce-scatter: rank {rank} made chunk {c}'s sum and passed it on at ring "
                f"step 0 of the all-gather, but its own buf[{a}:{b}] does not hold it at the end ({at}): add into buf "
                "itself")  # fmt: skip
    return (f"ring step {(rank - c) % p} of the all-gather: rank {rank} received the finished chunk {c} from rank "
            f"{(rank - 1) % p}, but buf[{a}:{b}] does not hold it at the end ({at}): receive it straight into "
            f"buf[{a}:{b}]")  # fmt: skip

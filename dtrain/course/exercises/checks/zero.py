"""Checks of lesson 9's ZeRO step: against plain SGD on the average gradient in one process, and its traffic.

Every rank starts from the same weights and a gradient of its own; the check's ``optimizer_step`` is SGD over the
rank's chunk (``np.array_split``'s cut, the collectives' ``chunk_bounds``) and notes whether the chunk of the gradient
is already the average when it is called. Afterwards every rank must hold the weights that one SGD step with the
average of all ranks' gradients gives, having sent what a ring reduce-scatter and a ring all-gather send
(:mod:`dtrain.collectives.costmodel`): an all-reduce in place of the reduce-scatter gives the right weights with
twice the bytes.
"""

from __future__ import annotations

import numpy as np

from dtrain.collectives import costmodel
from dtrain.course.exercises.grading import MPI, RINGS, Exercise, plural

EXERCISES = (
    Exercise("9.1", "the ZeRO step (reduce-scatter, update a chunk, all-gather)", "zero.py", "zero_step",
             ("comm", "params", "grads", "optimizer_step"), "dtrain.parallel.zero:zero_step",
             "dtrain.course.exercises.checks.zero:zero_step", RINGS, MPI,
             "collectives.reduce_scatter(comm, grads, \"avg\") leaves this rank's chunk of the average in grads; "
             "then optimizer_step(); then collectives.allgather(comm, params)"),
)  # fmt: skip
LR = 0.5


def weights(n: int) -> np.ndarray:
    """The weights every rank starts from (the same everywhere)."""
    return np.linspace(-1.0, 1.0, n)


def gradient(rank: int, n: int) -> np.ndarray:
    """Rank r's gradient: small integers that say whose they are (100 r + i % 97 + 1)."""
    return (100 * rank + np.arange(n) % 97 + 1).astype(np.float64)


def ring_traffic(n: int, p: int, r: int) -> tuple[int, int]:
    """(messages, bytes) rank r sends in a ring reduce-scatter and a ring all-gather of n float64 elements."""
    pair = (("ring", "reduce_scatter"), ("ring", "allgather"))
    messages = sum(costmodel.messages_sent(a, n, 8, p, r, collective=c) for a, c in pair)
    return messages, sum(costmodel.bytes_sent(a, n, 8, p, r, collective=c) for a, c in pair)


def zero_step(fn, comm, grade) -> None:
    """``fn(comm, params, grads, optimizer_step)`` on buffers of p to 1000 elements: the new weights on every rank,
    the average in this rank's chunk of ``grads``, one call of ``optimizer_step`` after the reduce-scatter, and the
    traffic of a reduce-scatter and an all-gather."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    lengths = tuple(dict.fromkeys((p, 7 * p + 3, 1000)))
    for number, n in enumerate(lengths, 1):
        lo, hi = (lambda c: (int(c[0]), int(c[-1]) + 1))(np.array_split(np.arange(n), p)[r])
        average = sum(gradient(q, n) for q in range(p)) / p
        params, grads = weights(n), gradient(r, n)
        calls = []

        def optimizer_step(params=params, grads=grads, average=average, lo=lo, hi=hi, calls=calls):
            """SGD over this rank's chunk [lo, hi), as dtrain's optimizer over its views of the chunk does."""
            calls.append(np.allclose(grads[lo:hi], average[lo:hi], rtol=1e-12, atol=1e-12))
            params[lo:hi] -= LR * grads[lo:hi]

        about = (f"{ranks}, {plural(n, 'float64 element')}; rank r's chunk is np.array_split(range({n}), {p})[r]; SGD, "
                 f"lr {LR}")  # fmt: skip
        with grade.step(number, about, len(lengths)):
            before = grade.counts()
            fn(comm, params, grads, optimizer_step)
            messages, sent = (now - then for now, then in zip(grade.counts(), before))
            if len(calls) != 1:
                grade.fail(f"optimizer_step was called {len(calls)} times on rank {r}; it must be called once, after "
                           "the reduce-scatter (it updates this rank's chunk of params)")  # fmt: skip
            elif not calls[0]:
                grade.fail(f"when optimizer_step was called on rank {r}, grads[{lo}:{hi}] was not the average of the "
                           "ranks' gradients: reduce-scatter (average) first, then step")  # fmt: skip
            grade.same(params, weights(n) - LR * average, "params after the call (one SGD step with the average "
                       "gradient, on every rank)")  # fmt: skip
            grade.same(grads[lo:hi], average[lo:hi], f"grads[{lo}:{hi}], this rank's chunk (the ranks' average)")
            expected = ring_traffic(n, p, r)
            if (messages, sent) != expected:
                grade.fail(f"rank {r} sent {sent} bytes in {messages} messages; a ring reduce-scatter and a ring "
                           f"all-gather of {n} elements send {expected[1]} bytes in {expected[0]} (an all-reduce "
                           "of the whole gradient alone sends about twice what the reduce-scatter does)")  # fmt: skip

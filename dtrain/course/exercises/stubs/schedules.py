"""Exercises 8.1 and 8.2 (lesson 8): pipeline schedules, as data.

Check them:  dtrain exercises check 8.1 --path ex
             dtrain exercises check 8.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
No ranks here: the checker adds each computation's sends and receives itself, then holds your schedule to the rules
(dtrain.parallel.schedules.check), runs it on a simulated clock (schedules.simulate: no deadlock), and measures its
bubble and the activations each stage keeps.
"""

from dtrain.parallel.instructions import Backward, Forward  # noqa: F401  (the records you write)


def one_f_one_b(stages, microbatches):
    """The 1F1B schedule: each stage's order of forwards and backwards.

    Signature: ``one_f_one_b(stages, microbatches) -> list[list[Forward | Backward]]``. A model is cut into
    ``stages`` = P consecutive stages (stage s on pipeline rank s), and a step trains on ``microbatches`` = M
    micro-batches (P >= 1, M >= 1; M may be smaller than P). ``Forward(s, i)`` is stage s's forward of micro-batch
    i, ``Backward(s, i)`` its backward.

    Return a list of P lists: list s holds stage s's computations in the order it runs them, each micro-batch's
    forward and backward exactly once, every backward after its forward. Write only Forward and Backward records:
    the receive before each computation whose input comes from a neighbour (an activation from stage s - 1, a
    gradient from stage s + 1) and the send after it are added for you (schedules.with_messages).

    1F1B ("one forward, one backward") starts each micro-batch's backward as early as it can, so that stage s never
    holds more than P - s micro-batches' activations (forwards whose backward has not run yet):

    1. warm-up: the first min(P - s - 1, M) forwards;
    2. steady state: while forwards are left, the next forward, then the backward of the oldest micro-batch in flight;
    3. cool-down: the backwards left, oldest first.

    The checker also runs your schedule on a simulated clock: its bubble (the fraction of the step the stages idle)
    must be GPipe's, (P - 1) / (M + P - 1); 1F1B saves memory, not time.

    Hint: for P = 4, M = 4, stage 0 runs F0 F1 F2 F3 B0 B1 B2 B3 and stage 3 runs F0 B0 F1 B1 F2 B2 F3 B3
    (lessons/08_pipeline_parallel.py and dtrain/parallel/schedules.py draw the whole timeline).
    """
    raise NotImplementedError("exercise 8.1: the 1F1B schedule — see lessons/08_pipeline_parallel.py")


def gpipe(stages, microbatches):
    """The GPipe schedule: each stage's order of forwards and backwards.

    Signature: ``gpipe(stages, microbatches) -> list[list[Forward | Backward]]``, with ``stages`` = P,
    ``microbatches`` = M, ``Forward(s, i)`` and ``Backward(s, i)`` as in :func:`one_f_one_b` above, and the same
    result: P lists, list s holding stage s's computations in order (the messages are added for you).

    GPipe: every stage runs all M forwards (micro-batch 0 first), then all M backwards, in the same order. Every
    stage then holds all M micro-batches' activations at its peak, and idles (P - 1) / (M + P - 1) of the step: the
    checker measures both.

    Hint: the same two loops on every stage; only the stage number in the records differs.
    """
    raise NotImplementedError("exercise 8.2: the GPipe schedule — see lessons/08_pipeline_parallel.py")

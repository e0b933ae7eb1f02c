"""Exercise 9.1 (lesson 9): the ZeRO step, stages 1 and 2: reduce-scatter the gradient, update your chunk, all-gather.

Check it:   dtrain exercises check 9.1 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

from dtrain import collectives  # noqa: F401  (reduce_scatter and allgather: see the hint)


def zero_step(comm, params, grads, optimizer_step):
    """One ZeRO update after backward: each rank steps the optimizer on its own chunk only, and shares the result.

    Signature: ``zero_step(comm, params, grads, optimizer_step) -> None``. ``comm`` is the data-parallel
    communicator (p ranks). ``params`` and ``grads`` are 1-D float64 NumPy arrays of n elements (n >= p): the whole
    weights and this rank's whole gradient. They are cut into p chunks, ``np.array_split`` style (the first n % p
    chunks one element longer); rank r owns chunk r. ``optimizer_step()`` (no arguments) is rank r's optimizer, whose
    state covers chunk r only (that is ZeRO's saving): it updates ``params``'s chunk r from ``grads``'s chunk r.

    Before: every rank holds the same ``params``; rank r holds its own gradient in ``grads``.
    After:  chunk r of ``grads`` holds the average of all ranks' gradients (chunk r); ``optimizer_step`` has been
            called once, after that; and every rank holds, in ``params``, the weights after the step: every
            chunk, each updated by its owner.

    The traffic is a reduce-scatter and an all-gather, the two halves of a ring all-reduce: the checker counts the
    bytes, so an all-reduce of the whole gradient (right weights, twice the bytes) does not pass.

    Hint: ``collectives.reduce_scatter(comm, grads, "avg")`` leaves rank r's chunk of the average in ``grads`` (in
    place; the other chunks hold partial sums); ``collectives.allgather(comm, params)`` gives every rank every
    rank's chunk r of ``params``, in place. Three lines; dtrain's stage 1 runs them once per layer.
    """
    raise NotImplementedError("exercise 9.1: the ZeRO step — see lessons/09_zero.py")

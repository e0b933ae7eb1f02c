"""Exercises 3.1 and 3.2 (lesson 3): DDP's gradient buckets, the decisions of PyTorch's reducer.

Check them:  dtrain exercises check 3.1 --path ex
             dtrain exercises check 3.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
Both run in one process: they are the decisions every rank takes alike (dtrain/parallel/buckets.py takes them).
"""


def buckets_to_start(missing, started, bucket):
    """A parameter's gradient is ready: count it off, and say which buckets may start their all-reduce now.

    Signature: ``buckets_to_start(missing, started, bucket) -> list[int]``. The flat gradient is cut into buckets
    0, 1, ..., len(missing) - 1. ``missing`` is a list of ints, ``missing[b]`` the number of bucket b's parameters
    whose gradient is not ready yet; ``started`` (an int) says that buckets 0 .. started - 1 have already started;
    ``bucket`` is the bucket of the parameter that has just become ready.

    Before: ``missing[bucket] >= 1``, and ``missing[b] == 0`` for every b < ``started``.
    After:  ``missing[bucket]`` is one less (change the list in place), and the function returns the buckets that
            start now, in increasing order: ``[started, started + 1, ...]`` for as long as each of them is complete
            (``missing[b] == 0``); ``[]`` if bucket ``started`` still waits for a parameter.

    Buckets start strictly in order 0, 1, 2, ..., each once all its parameters are ready. Backward makes gradients
    in an order that may differ between ranks (a hook fires when a gradient is complete), but every rank must start
    the same collectives in the same order, or their messages cross: a complete bucket waits for the buckets before
    it. The caller then sets ``started`` to one past the last bucket returned.

    Hint: a ``while`` loop from ``started`` on, that stops at the first bucket with a parameter missing (or at the
    end of the list).
    """
    raise NotImplementedError("exercise 3.1: which gradient buckets may start — see lessons/03_data_parallel.py")


def plan_buckets(parameters, bucket_bytes):
    """Cut a flat gradient buffer into buckets in reverse parameter order.

    Signature: ``plan_buckets(parameters, bucket_bytes) -> list[tuple[int, int, list[int]]]``. ``parameters`` is a
    list of ``(offset, size, itemsize)``, one per parameter in flat-buffer order: the parameter occupies elements
    ``offset .. offset + size - 1`` of the flat buffer, each of ``itemsize`` bytes, and the parameters lie end to end
    (the first at offset 0). ``bucket_bytes`` is an int >= 0.

    Before: nothing is cut.
    After:  return the buckets ``[(start, stop, indices), ...]``, in the order they are filled: walking from the last
            parameter back to the first, add each parameter's index to the open bucket; close the bucket as soon
            as it holds at least ``bucket_bytes`` bytes (0: never: one bucket for everything); whatever is left at
            the end is the last bucket. A bucket's ``indices`` are in the order they were added (decreasing), and
            ``flat[start:stop]`` is exactly the elements of its parameters: one contiguous slice, so a bucket is
            all-reduced in place, with no packing.

    Example: three parameters of 3, 5 and 2 float64 elements (``[(0, 3, 8), (3, 5, 8), (8, 2, 8)]``) and 40-byte
    buckets give ``[(3, 10, [2, 1]), (0, 3, [0])]``: the last parameter (16 bytes) leaves the bucket open, the middle
    one (40 more) closes it.

    Hint: keep the open bucket's indices, its stop and its byte count; a bucket's start is the offset of the
    parameter that was added to it last.
    """
    raise NotImplementedError("exercise 3.2: cutting the flat gradient into buckets — see lessons/03_data_parallel.py")

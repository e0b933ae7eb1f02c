"""Exercise 2.6 (lesson 2): shared-memory all-reduce, on a window, with its two fences.

Check it:   dtrain exercises check 2.6 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np  # noqa: F401  (you will want it)

from dtrain.collectives import chunk_bounds  # noqa: F401  (chunk_bounds(n, p)[r]: rank r's chunk, (start, stop))
from dtrain.comm import windows  # noqa: F401  (windows.allocate(comm, nbytes): a shared window, see below)


def shm_allreduce(comm, buf):
    """Sum ``buf`` over all ranks of ``comm``, in place, through shared memory: no message at all.

    Signature: ``shm_allreduce(comm, buf) -> None``. Every rank of ``comm`` lives on one node, so they can map one
    another's memory (a real MPI communicator under mpiexec, a simulated one in the checker's first part). ``buf``
    is a 1-D float32 or float64 NumPy array of n elements, n >= 1 (it may be smaller than the number of ranks p),
    the same n on every rank.

    Before: rank r holds its own values in ``buf``.
    After:  every rank holds, in that same ``buf``, the element-wise sum of all ranks' values.

    The window: ``win = windows.allocate(comm, buf.nbytes)`` (a collective: every rank calls it) gives each rank a
    *segment* of at least ``buf.nbytes`` bytes, and maps every segment into every rank:
    ``win.view(q, buf.dtype, 0, buf.size)`` is rank q's segment as n elements like ``buf``, which this rank can load
    from and store into with plain NumPy (``a[...] = b``, ``a + b``). ``win.fence()`` is a fence (a collective);
    ``win.free()`` releases the window (a collective, once you are done).

    The algorithm (rank r of p; ``lo, hi = chunk_bounds(n, p)[r]`` is rank r's chunk, and rank r alone sums it):

    1. copy ``buf`` into your own segment (``win.view(r, ...)[...] = buf``);
    2. fence 1;
    3. sum your chunk over every rank's segment: ``total = sum of win.view(q, ...)[lo:hi] for every q`` (your own
       included: from your segment, or from ``buf``);
    4. store ``total`` into chunk [lo:hi] of *every* rank's segment (yours too);
    5. fence 2;
    6. copy your segment back into ``buf`` (every chunk now holds its sum, stored there by the rank that owns it);
    7. ``win.free()``.

    Why two fences. A store into shared memory is not a message: nothing tells the other ranks that it happened,
    and a CPU may keep it in its store buffer, or the reader may load an older value, unless both sides synchronise.
    ``fence()`` is ``Win.Sync`` (my stores are done and visible), a ``Barrier`` (everyone has got here), ``Win.Sync``
    (my later loads see what the others stored before the barrier). So:

    * fence 1 (after step 1, before step 3): every rank has copied its whole ``buf`` in before anyone loads from
      its segment. Without it, rank r may sum a peer's chunk before that peer has copied its values in;
    * fence 2 (after step 4, before step 6): every rank has stored its sum into every segment before anyone copies
      its segment out (and before anyone frees the window or writes to it again). Without it, rank r may copy out a
      chunk before its owner has stored the sum there.

    A ``comm.Barrier()`` alone orders the ranks, not their memory: use ``win.fence()``. No rank sends a message:
    the checker counts them. On simulated ranks the checker shows no rank another's stores before a fence that
    follows them, so a missing or misplaced fence fails there every time, with the rank and the chunk it read too
    early (under mpiexec it might pass by luck, and fail on another machine).

    Hint: ``dtrain.collectives.shm.allreduce`` does the same (with every call announced in a control window, to
    catch mismatched calls); read it only once yours passes.
    """
    raise NotImplementedError("exercise 2.6: shared-memory all-reduce — see lessons/02_allreduce.py")

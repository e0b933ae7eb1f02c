"""Exercise 2.1 (lesson 2): ring all-reduce.

Check it:   dtrain exercises check 2.1 --path ex
Train with it, once it passes:
            dtrain launch -n 4 -m dtrain train --paradigm ddp --allreduce ex/ring.py:ring_allreduce
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np  # noqa: F401  (you will want it)


def ring_allreduce(comm, buf):
    """Sum ``buf`` over all ranks of ``comm``, in place, with the ring algorithm.

    Signature: ``ring_allreduce(comm, buf) -> None``. ``comm`` has mpi4py's buffer methods (``Get_rank``,
    ``Get_size``, ``Send``, ``Recv``, ``Sendrecv``, ``Isend``/``Irecv``); it is a real MPI communicator under
    mpiexec, a simulated one in the checker's first part. ``buf`` is a 1-D float32 or float64 NumPy array of n
    elements, n >= 1 (it may be smaller than the number of ranks p).

    Before: rank r holds its own values in ``buf``.
    After:  every rank holds, in that same ``buf``, the element-wise sum of all ranks' values.

    The algorithm: cut ``buf`` into p chunks (``np.array_split(np.arange(n), p)`` gives their index ranges; the first
    n % p chunks are one element longer). Rank r sends to right = (r + 1) % p and receives from left = (r - 1) % p.

    1. Reduce-scatter, p - 1 steps: at step s, send chunk (r - s) % p to the right, receive chunk (r - s - 1) % p
       from the left and add it into your own copy of that chunk. Afterwards rank r holds the full sum of chunk
       (r + 1) % p.
    2. All-gather, p - 1 steps: at step s, send chunk (r - s + 1) % p to the right and receive chunk (r - s) % p from
       the left straight into ``buf``.

    Each rank sends 2 (p - 1) messages, each about n / p elements: the checker counts them.

    Hint: ``comm.Sendrecv(sendbuf, dest=right, recvbuf=scratch, source=left)`` sends and receives in one call, so no
    rank waits for another forever; receive into a scratch array, then add. A slice of ``buf`` is a view: receiving
    or adding into ``buf[a:b]`` changes ``buf``.
    """
    raise NotImplementedError("exercise 2.1: ring all-reduce — see lessons/02_allreduce.py")

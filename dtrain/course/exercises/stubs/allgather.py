"""Exercise 10.1 (lesson 10): find the bug in a ring all-gather.

Check it:   dtrain exercises check 10.1 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np


def ring_allgather(comm, buf):
    """Rank r contributes chunk r of ``buf``; afterwards every rank holds every rank's chunk. This one has a bug.

    Signature: ``ring_allgather(comm, buf) -> None``. ``comm`` has mpi4py's buffer methods (``Get_rank``,
    ``Get_size``, ``Send``, ``Recv``, ``Sendrecv``, ``Isend``/``Irecv``); it is a real MPI communicator under
    mpiexec, a simulated one in the checker's first part. ``buf`` is a 1-D float32 or float64 NumPy array of n
    elements, n >= 1, cut into p chunks: ``np.array_split(np.arange(n), p)`` gives their index ranges (the first
    n % p chunks are one element longer; with n < p some are empty).

    Before: chunk r of rank r's ``buf`` holds rank r's values; the rest of its ``buf`` holds anything.
    After:  chunk q of every rank's ``buf`` holds rank q's chunk q, for every q.

    The algorithm, the second half of a ring all-reduce (lesson 2): rank r sends to right = (r + 1) % p and receives
    from left = (r - 1) % p. At step s = 0 .. p - 2 it sends chunk (r - s) % p, which it holds, and receives chunk
    (r - s - 1) % p straight into ``buf``. p - 1 messages per rank, each one chunk.

    The code below does exactly that, and its author tested it: 4 ranks, 100 elements, right on every rank. Delete
    the raise line, run the check, and read its report: which step fails, how large the chunks are there, and what
    every rank is waiting for. Then fix the bug (it takes a line or two) and check again. Lesson 10's section 2 shows
    the same bug in two lines.

    Hint, once you have read the report: an MPI Send of a small message returns at once (it is copied, "eager"), but
    a Send of a large one waits until the receiver has posted the matching receive ("rendezvous").
    """
    raise NotImplementedError("exercise 10.1: delete this line, run the check, read its report, fix the bug below")
    p, r = comm.Get_size(), comm.Get_rank()
    edges = np.cumsum([0] + [len(chunk) for chunk in np.array_split(np.arange(buf.size), p)])
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        mine, theirs = (r - s) % p, (r - s - 1) % p
        comm.Send(buf[edges[mine] : edges[mine + 1]], dest=right)
        comm.Recv(buf[edges[theirs] : edges[theirs + 1]], source=left)

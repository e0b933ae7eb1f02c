"""Exercise 10.2 (lesson 10): find the bug in an average through rank 0.

Check it:   dtrain exercises check 10.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

from dtrain import collectives


def average_weights(comm, flat):
    """Replace every rank's ``flat`` by the mean over the ranks, in place, through rank 0. This one has a bug.

    Signature: ``average_weights(comm, flat) -> None``. ``comm`` has mpi4py's buffer methods and works with
    ``dtrain.collectives`` (a real MPI communicator under mpiexec, a simulated one in the checker's first part).
    ``flat`` is a 1-D float64 NumPy array: this rank's weights, the same length on every rank.

    Before: rank r holds its own weights w_r in ``flat``.
    After:  every rank holds the mean (w_0 + ... + w_{p-1}) / p in that same ``flat``.

    This is local SGD's average with ``--average-via master`` (lesson 5): the weights are summed on rank 0 (a
    reduce), rank 0 divides, and rank 0 sends the mean back to every rank (a broadcast). Its author ran it on 4
    ranks, printed the weights on rank 0 (the rank that prints), and they were right.

    Delete the raise line, run the check, and read its report: which rank is wrong, and what it holds. Then fix the
    bug (a line or two) and check again. Lesson 10's section 1 shows what this kind of bug does in a real job, and
    what DTRAIN_DEBUG=1 says about it.

    Hint, once you have read the report: which ranks call each collective below?
    """
    raise NotImplementedError("exercise 10.2: delete this line, run the check, read its report, fix the bug below")
    rank, p = comm.Get_rank(), comm.Get_size()
    collectives.reduce(comm, flat, root=0, op="sum")  # the sum over the ranks, on rank 0
    if rank != 0:
        return  # the others have sent their weights: rank 0 does the rest
    flat /= p
    collectives.broadcast(comm, flat, root=0)  # the mean, from rank 0 to every rank

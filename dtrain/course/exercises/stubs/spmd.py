"""Exercises 14.1 and 14.2 (lesson 14): sharding as the program: the matmul rule on layouts, and one redistribution.

Check them:  dtrain exercises check 14.1 --path ex
             dtrain exercises check 14.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
14.1 is arithmetic on layouts: no arrays and no ranks, the checker calls it in one process. 14.2 moves a rank's block
of a tensor: it runs on simulated ranks, then under mpiexec. dtrain's own answers: dtrain/parallel/layouts.py (the
rules, ``matmul`` and ``moves``) and dtrain/parallel/sharded.py (``Program.collective``, a move made on a block).

The notation (GSPMD's, JAX's PartitionSpec): ``A[I_x, J]`` is a matrix whose rows (I) are split over mesh axis x and
whose columns (J) every rank holds whole. A layout is one entry per dimension: the mesh axis that splits it, or None.
"""

import numpy as np  # noqa: F401  (np.split, np.concatenate, np.stack, np.ascontiguousarray)

from dtrain import collectives  # noqa: F401  (allreduce, reduce_scatter, allgather: see 14.2)


def matmul_layouts(a, b):
    """The matmul propagation rule: from the layouts of A and B, the layout of C = A @ B and what must be sent first.

    Signature: ``matmul_layouts(a, b) -> (dims, partial, collectives)``. A is m x k (rows I, columns J), B is k x n
    (rows J, columns K): J is the contracting dimension, A's dimension 1 and B's dimension 0. The mesh has two axes,
    "x" and "y". ``a`` is A's layout, a tuple of two entries (rows, columns), each "x", "y" or None (whole on every
    rank); no axis splits both dimensions of one matrix. ``("x", None)`` is A[I_x, J]. ``b`` is B's, the same way.

    Return a tuple of three:

    * ``dims``: C's layout, a tuple (the axis that splits C's rows, the one that splits its columns), each "x", "y"
      or None;
    * ``partial``: the mesh axis over which C is a *partial sum* (every rank of that axis holds an m x n block
      that is only its share: C is their sum), or None when C is whole;
    * ``collectives``: what must be sent before the local multiply, a list (any order) of
      ``("all-gather", operand, dim, axis)``: ``operand`` "A" or "B", ``dim`` the dimension of that operand that is
      gathered (0 its rows, 1 its columns), ``axis`` the mesh axis it was split over; [] when nothing is sent.

    The four cases (C's rows take A's rows' layout, C's columns B's columns', after the gathers):

    1. J whole in both: each rank multiplies its blocks; nothing is sent.
    2. J split in one operand only (or over a different axis in each): all-gather the J of each operand whose J
       is split, then case 1.
    3. J split over the same axis in both: each rank multiplies its own blocks and nothing is sent; the product of
       two blocks covers only that rank's share of J, so C is a partial sum over that axis.
    4. After the above, if one axis would split both of C's dimensions (A's rows and B's columns on the same axis):
       C[I_x, K_x] is no block at all, so also all-gather B's columns (B's dimension 1) over that axis.

    Examples::

        matmul_layouts(("x", None), (None, "y")) == (("x", "y"), None, [])                              # case 1
        matmul_layouts((None, "x"), (None, None)) == ((None, None), None, [("all-gather", "A", 1, "x")])  # case 2
        matmul_layouts((None, "y"), ("y", "x")) == ((None, "x"), "y", [])                               # case 3

    The checker tries every pair of valid layouts on the mesh (7 for A, 7 for B: 49 cases) against dtrain's rule.

    Hint: name the four entries first, ``(i, ja), (jb, k) = a, b``; decide J (case 2 or 3), then C's two
    dimensions (case 4). lessons/14_spmd.py draws the four cases with their costs.
    """
    raise NotImplementedError("exercise 14.1: the matmul propagation rule — see lessons/14_spmd.py")


def redistribute(comm, block, source, target, dim):
    """One redistribution on one mesh axis: this rank's block of a tensor, from one layout on the axis to another.

    Signature: ``redistribute(comm, block, source, target, dim) -> the new block`` (a NumPy array). ``comm`` is the
    communicator of one mesh axis: p ranks, this rank's coordinate on the axis is ``comm.Get_rank()``. T is a 2-D
    float64 tensor of M x N, M and N divisible by p. ``source`` and ``target`` are its layout on the axis, one of
    "partial", "replicated" or "split" (``dim`` says which dimension, 0 or 1, is split; None when neither is).
    ``block`` is this rank's block of T laid out as ``source`` (a C-contiguous float64 array); return this rank's
    block of T laid out as ``target``:

        source     target        block given                        block returned               the collective
        partial    replicated    P_r, M x N; T = the sum of the P_r  T, M x N                     all-reduce
        partial    split         P_r, M x N                         block r of T along dim       reduce-scatter
        split      replicated    block r of T along dim             T, M x N                     all-gather

    Block r of T along dim 0 is rows [r M/p, (r + 1) M/p) (M/p x N); along dim 1, columns [r N/p, (r + 1) N/p)
    (M x N/p).

    With dtrain's collectives: ``collectives.allreduce(comm, buf)`` sums ``buf`` over the ranks in place;
    ``collectives.reduce_scatter(comm, buf)`` leaves chunk r of the sum in chunk r of ``buf`` and returns it (a
    view), ``collectives.allgather(comm, buf)`` fills every chunk of ``buf`` from the rank that owns it, in place.
    They see ``buf`` as flat (a C-contiguous array of any shape, cut into p equal chunks): a block of rows is a flat
    chunk, a block of columns is not. Or write it with ``comm.Send``/``Recv``/``Sendrecv``.

    The checker compares every rank's block with NumPy's on the whole tensor and counts the bytes: a reduce-scatter
    or an all-gather may send, all ranks together, at most (p - 1) M N elements (what a ring sends); an all-reduce
    followed by a slice sends twice that, and does not pass.

    Hint: ``np.ascontiguousarray(np.stack(np.split(x, p, axis=dim)))`` is a (p, ...) array whose flat chunk q is
    block q along ``dim``; ``np.concatenate(list(blocks), axis=dim)`` puts p blocks back side by side.
    """
    raise NotImplementedError("exercise 14.2: one redistribution on a mesh axis — see lessons/14_spmd.py")

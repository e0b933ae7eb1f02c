"""Exercises 13.1 and 13.2 (lesson 13): gradient compression with error feedback: top-k, and one PowerSGD step.

Check them:  dtrain exercises check 13.1 --path ex
             dtrain exercises check 13.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

import numpy as np  # noqa: F401  (you will want it)

from dtrain import collectives  # noqa: F401  (allgather and allreduce: see the hints)


def topk_step(comm, flat, residual, k):
    """One top-k step with error feedback: send only the k largest entries, keep the rest for later.

    Signature: ``topk_step(comm, flat, residual, k) -> (index, values)``. ``comm`` has mpi4py's buffer methods
    (``Get_rank``, ``Get_size``, ``Send``, ``Recv``, ``Sendrecv``, ...). ``flat`` is this rank's gradient, a 1-D
    float64 NumPy array of n elements (the same n on every rank). ``residual`` (n float64 elements) is this rank's
    own: what its earlier steps did not send. ``1 <= k <= n``.

    Before: rank r holds its gradient g_r in ``flat`` and its residual e_r in ``residual``.
    After:  with m_r = e_r + g_r (what rank r owes) and idx_r the indices of m_r's k entries of largest magnitude,
            in ascending order:
            * the function returns ``(idx_r, m_r[idx_r])``: k integer indices and their (signed) values;
            * ``residual`` holds m_r with those k entries zeroed: exactly what was not sent (error feedback: it is
              added to the next step's gradient, so small entries are sent too, eventually);
            * ``flat`` holds, on every rank bit for bit, the average over ranks of every rank's pairs:
              (1/p) x sum over ranks q of the n-vector with m_q[idx_q] at idx_q and zeros elsewhere.

    Ranks choose different indices, so the pairs cannot be added on the way as an all-reduce adds dense chunks:
    every rank receives every rank's pairs (an all-gather) and adds them up itself. The checker counts the bytes:
    one ring all-gather of p x 2k float64 numbers (each rank's k indices and k values), not the dense gradient.

    Hint: ``residual += flat``; ``index = np.sort(np.argsort(-np.abs(residual))[:k])``; ``values =
    residual[index]`` (a copy); ``residual[index] = 0``. Then a buffer ``pairs = np.empty(p * 2 * k)`` whose slice
    ``[r * 2k, (r + 1) * 2k)`` is yours: your indices (as float64: integers below 2^53 are exact) then your values;
    ``collectives.allgather(comm, pairs, "ring")`` fills in the others' slices. Then ``flat[:] = 0`` and for q = 0,
    1, ..., p - 1 (the same order on every rank): ``flat[index_q] += values_q``; finally ``flat /= p``.
    """
    raise NotImplementedError("exercise 13.1: the top-k step with error feedback — see lessons/13_compression.py")


def powersgd_step(comm, matrices, errors, qs):
    """One PowerSGD step: each gradient matrix as a rank-r product P Q^T, one power-iteration step, error feedback.

    Signature: ``powersgd_step(comm, matrices, errors, qs) -> list of new Qs``. ``comm`` as in 13.1.
    ``matrices`` is a list of this rank's weight-matrix gradients G_i (2-D float64 arrays, a_i x b_i, the same shapes
    on every rank); ``errors`` the list of this rank's errors E_i (same shapes: what earlier steps did not send);
    ``qs`` the list of the Q_i (b_i x r), the same on every rank (the previous step's: a warm start).

    Before: rank r holds its G_i in ``matrices[i]`` and its E_i in ``errors[i]``; every rank the same ``qs``.
    After:  for each matrix, with M = G_i + E_i (this rank's):
                P = M Q_i (a_i x r), averaged over the ranks, then its columns orthonormalised
                Q = M^T P (b_i x r), averaged over the ranks
            ``matrices[i]`` holds P Q^T (the same on every rank: the approximate average gradient);
            ``errors[i]`` holds M - P Q^T (what was not sent: this rank's own); and the function returns the list
            of the new Q's (the next step's warm start).

    Two all-reduces of the factors, (a + b) r numbers, instead of one of the a b numbers of the matrix: the checker
    counts the bytes (ring all-reduces of the P's and the Q's; one per matrix or all laid end to end, either way).
    It compares what does not depend on the orthonormal basis you choose for P's columns (P Q^T, Q Q^T, M - P Q^T),
    and reads P back from what you leave to see that its columns are orthonormal.

    Hint: for each i: ``M = errors[i]; M += matrices[i]`` (M, kept in the error's buffer); ``P = M @ qs[i]``;
    ``collectives.allreduce(comm, P, op="avg", algorithm="ring")`` (in place; a product is a fresh C-contiguous
    array); ``P = np.linalg.qr(P)[0]`` (orthonormalise the *averaged* P, so every rank gets the same bits); ``Q = M.T
    @ P``, all-reduced the same way; ``approx = P @ Q.T``; ``matrices[i][...] = approx``; ``M -= approx``. Return
    the list of the Q's.
    """
    raise NotImplementedError("exercise 13.2: one PowerSGD step — see lessons/13_compression.py")

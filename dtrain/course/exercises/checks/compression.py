"""Checks of lesson 13 (gradient compression): the top-k step with error feedback, and one PowerSGD step.

Both are held against an oracle written here in plain NumPy from every rank's inputs (the check knows them all:
they come from seeds), never against dtrain's own implementation:

* top-k: each rank's pairs (the k largest |residual + flat|, in ascending index order, and their signed values);
  the dense average of every rank's pairs in ``flat``, the same bits on every rank; error feedback's invariant,
  "what was not sent is exactly what the residual holds" (residual after + the pairs sent = residual before + flat);
  and the bytes of one all-gather of p x 2k numbers around the ring.
* PowerSGD: what a step leaves does not depend on the orthonormal basis chosen for P's columns (np.linalg.qr's
  signs, Gram-Schmidt's), so the check compares what is basis-free: P Q^T against the oracle's, Q Q^T, and the new
  error M - P Q^T; P itself is read back from the result, P = (P Q^T) Q (Q^T Q)^-1, and must have orthonormal
  columns. Every rank the same bits; the bytes of ring all-reduces of the P's and the Q's (not of the matrices).

Each step starts from the oracle's state (residual, errors, Q), so one wrong step does not make every later one wrong.
"""

from __future__ import annotations

import numpy as np

from dtrain.course.exercises.grading import MPI, RINGS, Exercise, plural

EXERCISES = (
    Exercise("13.1", "the top-k step with error feedback", "compression.py", "topk_step",
             ("comm", "flat", "residual", "k"), "dtrain.parallel.compression:topk_step",
             "dtrain.course.exercises.checks.compression:topk_step", RINGS, MPI,
             "residual += flat; index = np.sort(np.argsort(-np.abs(residual))[:k]); values = residual[index]; "
             "residual[index] = 0; put index (as float64) and values in your slice of a p x 2k buffer, "
             "collectives.allgather(comm, pairs, 'ring'); then flat[:] = 0 and add every rank's values at its "
             "indices, rank 0 first; flat /= p; return index, values"),
    Exercise("13.2", "one PowerSGD step (power iteration, error feedback)", "compression.py", "powersgd_step",
             ("comm", "matrices", "errors", "qs"), "dtrain.parallel.compression:powersgd_step",
             "dtrain.course.exercises.checks.compression:powersgd_step", (1, 2, 3, 4, 5), MPI,
             "for each matrix: M = errors[i]; M += matrices[i]; P = M @ qs[i], all-reduced (op='avg', "
             "algorithm='ring'); P = np.linalg.qr(P)[0]; Q = M.T @ P, all-reduced; matrices[i][...] = P @ Q.T; "
             "M -= P @ Q.T; return the list of the Q's"),
)  # fmt: skip


def allgather_bytes(p: int, k: int) -> int:
    """Bytes all ranks together send in a ring all-gather of p x 2k float64 numbers: each rank's 2k travel p - 1
    hops."""
    return p * (p - 1) * 2 * k * 8


def allreduce_bytes(p: int, count: int) -> int:
    """Bytes all ranks together send in ring all-reduces of ``count`` float64 numbers in all (however they are cut
    into all-reduces): every number travels p - 1 hops to be reduced and p - 1 to be shared."""
    return 2 * (p - 1) * count * 8


def sent_in_all(comm, grade, expected: int, algorithm: str, more: str = "") -> None:
    """All ranks together sent ``expected`` bytes in this case (counted by the tracer under ``comm``); else a problem
    that names the algorithm."""
    mine = grade.counts()[1] - grade.sent[1]
    everyone = sum(comm.allgather(mine))
    if everyone != expected and grade.rank == 0:
        text = f"all ranks together sent {everyone} bytes in this case; {algorithm} sends {expected}{more}"
        if everyone == 0 and expected:
            text += (" (nothing was counted: the checker counts dtrain's collectives and comm's Send/Recv/Sendrecv, "
                     "not mpi4py's object methods such as comm.allgather, nor MPI's own Allgather)")  # fmt: skip
        grade.fail(text)


def same_everywhere(comm, grade, arrays: list, names: list[str], why: str) -> None:
    """Every rank holds ``arrays`` bit for bit as rank 0 does; else a problem on each rank that differs (unless it
    has a problem already: bits matter once the numbers are right). Every rank must call it (an object all-gather)."""
    theirs = comm.allgather([np.array(a, copy=True) for a in arrays])[0]
    if grade.problems:
        return
    for mine, first, name in zip(arrays, theirs, names):
        mine = np.asarray(mine)
        if mine.shape == first.shape and not np.array_equal(mine, first):
            wrong = np.argwhere(mine != first)[0]
            at = tuple(int(i) for i in wrong)
            where = at[0] if len(at) == 1 else at
            grade.fail(f"{name} on rank {grade.rank} is not rank 0's, bit for bit: element {where} is "
                       f"{mine[at].item()!r} here, {first[at].item()!r} on rank 0 ({why})")  # fmt: skip


# --- 13.1: top-k with error feedback --------------------------------------------------------------------------------
TOPK_CASES = ((1, 1), (10, 1), (10, 3), (100, 10), (100, 100), (1000, 7))  # (n, k)
TOPK_STEPS = 2  # steps of each case, the residual carried from one to the next


def gradient(rank: int, step: int, n: int) -> np.ndarray:
    """Rank ``rank``'s gradient at ``step`` of a case: normal numbers from a seed of its own (no two of the same
    magnitude)."""
    return np.random.default_rng([13, rank, step, n]).standard_normal(n)


def top(m: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k entries of largest |m|, ascending (the check's data has no ties at the k-th place)."""
    order = np.argsort(-np.abs(m), kind="stable")
    if k < m.size and abs(m[order[k - 1]]) == abs(m[order[k]]):
        raise AssertionError("the check's own data has a tie at the k-th magnitude: change its seed")
    return np.sort(order[:k])


def topk_step(fn, comm, grade) -> None:
    """``fn(comm, flat, residual, k)`` on every rank, over steps of several (n, k) (k = n among them): the pairs it
    returns, the average left in ``flat`` (the same bits on every rank), the residual's invariant and the bytes of a
    ring all-gather of the p x 2k pairs."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    number = 0
    for n, k in TOPK_CASES:
        # what earlier steps did not send: small, different on every rank, nonzero from the first step
        residuals = [0.25 * np.random.default_rng([31, q, n]).standard_normal(n) for q in range(p)]
        for step in range(1, TOPK_STEPS + 1):
            number += 1
            flats = [gradient(q, step, n) for q in range(p)]
            owed = [residuals[q] + flats[q] for q in range(p)]  # the oracle: every rank's residual + flat
            index = [top(m, k) for m in owed]
            values = [m[i] for m, i in zip(owed, index)]
            total = np.zeros(n)
            for i, v in zip(index, values):
                total[i] += v
            average = total / p
            left = [m.copy() for m in owed]
            for m, i in zip(left, index):
                m[i] = 0
            flat, residual = flats[r].copy(), residuals[r].copy()
            about = (f"{ranks}, n = {n}, k = {k}, step {step}; rank r's flat: normal numbers of its own, its "
                     "residual: what earlier steps did not send")  # fmt: skip
            with grade.step(number, about, len(TOPK_CASES) * TOPK_STEPS):
                returned = fn(comm, flat, residual, k)
                pairs = judge_pairs(grade, returned, index[r], values[r], flats[r], n, k)
                if pairs is not None:  # error feedback's invariant, with the pairs this rank said it sent
                    back = np.array(residual, dtype=np.float64, copy=True)
                    back[pairs[0]] += pairs[1]
                    if not grade.same(back, owed[r], "residual after the call + the pairs sent (they must make "
                                      "residual before + flat: what was not sent is exactly what the residual "
                                      "holds)"):  # fmt: skip
                        feedback(grade, residual, residuals[r], left[r], pairs)
                what = (f"flat after the call (the average over ranks of every rank's pairs: each rank's k values "
                        f"at its indices, zeros elsewhere, divided by p = {p})")  # fmt: skip
                if not grade.same(flat, average, what):
                    dense(grade, flat, total, index[r], values[r], p)
                same_everywhere(comm, grade, [flat], ["flat"], "add the ranks' pairs in the same order on every "
                                "rank, rank 0's first, so that every replica takes the same step")  # fmt: skip
                sent_in_all(comm, grade, allgather_bytes(p, k), f"a ring all-gather of the p x 2k = {2 * p * k} "
                            "numbers (each rank's k indices and k values)", ", collectives.allgather(comm, pairs, "
                            "'ring')")  # fmt: skip
            residuals = left  # the next step starts from the oracle's residual


def judge_pairs(grade, returned, index, values, flat, n: int, k: int):
    """This rank's returned (index, values) against the oracle's; the pairs as arrays when they can be used to check
    the residual (k integer indices in range), else None."""
    if not isinstance(returned, (tuple, list)) or len(returned) != 2:
        grade.fail(f"topk_step returned {type(returned).__name__} {returned!r:.60}; it must return (index, values), "
                   "the k indices this rank sent, ascending, and their values")  # fmt: skip
        return None
    mine, theirs = (np.asarray(a) for a in returned)
    if not grade.same(mine, index, f"index, the first of what topk_step returned (the k = {k} entries of largest "
                      "|residual + flat|, in ascending order)"):  # fmt: skip
        if mine.shape == index.shape and np.array_equal(np.sort(mine), index):
            grade.note("index holds the right entries, not in ascending order: np.sort it")
        elif mine.shape == index.shape and np.array_equal(np.sort(mine), top(flat, k)):
            grade.note("index holds the k largest |flat|: add flat into residual first and choose from the "
                       "residual (error feedback: what earlier steps did not send competes with this step's "
                       "gradient)")  # fmt: skip
    elif not grade.same(theirs, values, "values, the second of what topk_step returned (residual + flat at those "
                        "indices, with their signs)"):  # fmt: skip
        if theirs.shape == values.shape and np.allclose(theirs, np.abs(values)):
            grade.note("values holds magnitudes: send the signed values, residual[index]")
        elif theirs.shape == values.shape and np.allclose(theirs, flat[index]):
            grade.note("values holds flat's entries alone: send residual + flat at those indices")
    if mine.shape != (k,) or theirs.shape != (k,):
        return None
    if not np.issubdtype(mine.dtype, np.integer):
        grade.fail(f"index has dtype {mine.dtype}: return the indices as integers (np.argsort's int64)")
        return None
    if mine.min() < 0 or mine.max() >= n or len(set(mine.tolist())) != k:
        return None
    return mine, theirs.astype(np.float64)


def feedback(grade, residual, before, left, pairs) -> None:
    """A note that names the likely mistake in what the residual holds after a step."""
    residual = np.asarray(residual)
    if residual.shape != left.shape:
        return
    if np.array_equal(residual, before):
        grade.note("residual is unchanged: add flat into it (residual += flat), then zero the k entries you sent")
    elif not residual.any():
        grade.note("residual is all zeros: only the k entries sent are zeroed; the rest stays for the next step "
                   "(error feedback)")  # fmt: skip
    elif np.allclose(residual[pairs[0]], pairs[1]):
        grade.note("residual still holds the entries you sent: zero them (residual[index] = 0), or they are sent "
                   "again next step")  # fmt: skip


def dense(grade, flat, total, index, values, p: int) -> None:
    """A note that names the likely mistake in ``flat``'s average."""
    flat = np.asarray(flat)
    if flat.shape != total.shape:
        return
    mine = np.zeros_like(total)
    mine[index] = values
    if p > 1 and np.allclose(flat, total):
        grade.note(f"flat holds the sum of the ranks' pairs, not the average: divide by p = {p}")
    elif p > 1 and (np.allclose(flat, mine / p) or np.allclose(flat, mine)):
        grade.note("flat holds this rank's own pairs only: all-gather every rank's, and add them all")


# --- 13.2: one PowerSGD step ----------------------------------------------------------------------------------------
POWERSGD_CASES = (((6, 4),), ((8, 5), (3, 7), (10, 6)), ((5, 3), (4, 4)))  # the weight matrices' shapes
POWERSGD_RANKS = (1, 2, 3)  # r, by case: the last is full rank for the 5 x 3 matrix
POWERSGD_STEPS = 2
TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}  # (a QR and two products of all-reduced numbers: rounding, amplified)


def powersgd_step(fn, comm, grade) -> None:
    """``fn(comm, matrices, errors, qs)`` on every rank, over steps of several lists of matrices and ranks r: P Q^T in
    each matrix (the oracle's, the same bits on every rank), P orthonormal, Q Q^T, each error M - P Q^T, and the bytes
    of ring all-reduces of the P's and the Q's."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    number = 0
    for case, (shapes, rank) in enumerate(zip(POWERSGD_CASES, POWERSGD_RANKS)):
        qs = [np.random.default_rng([2019, case, i]).standard_normal((b, rank)) for i, (_, b) in enumerate(shapes)]
        errors = [[0.1 * np.random.default_rng([7, q, case, i]).standard_normal(s) for i, s in enumerate(shapes)]
                  for q in range(p)]  # fmt: skip
        for step in range(1, POWERSGD_STEPS + 1):
            number += 1
            grads = [[np.random.default_rng([13, q, case, step, i]).standard_normal(s) for i, s in enumerate(shapes)]
                     for q in range(p)]  # fmt: skip
            ms = [[g + e for g, e in zip(grads[q], errors[q])] for q in range(p)]  # the oracle
            approx, new_qs = [], []
            for i in range(len(shapes)):
                mean = sum(ms[q][i] for q in range(p)) / p
                p_ = np.linalg.qr(mean @ qs[i])[0]
                q_ = mean.T @ p_
                approx.append(p_ @ q_.T)
                new_qs.append(q_)
            new_errors = [[m - a for m, a in zip(ms[q], approx)] for q in range(p)]
            matrices = [g.copy() for g in grads[r]]
            mine = [e.copy() for e in errors[r]]
            sides = ", ".join(f"{a}x{b}" for a, b in shapes)
            about = (f"{ranks}, matrices {sides}, r = {rank}, step {step}; rank r's gradients and errors: normal "
                     "numbers of its own; Q: the same on every rank")  # fmt: skip
            with grade.step(number, about, len(POWERSGD_CASES) * POWERSGD_STEPS):
                returned = fn(comm, matrices, mine, [q.copy() for q in qs])
                got = judge_qs(grade, returned, shapes, rank)
                for i in range(len(shapes)):
                    judge_matrix(grade, i, matrices[i], None if got is None else got[i], approx[i], new_qs[i],
                                 mine[i], new_errors[r][i], ms[r][i], errors[r][i], grads[r][i])  # fmt: skip
                held = matrices + list(got or ())
                names = [f"matrices[{i}]" for i in range(len(shapes))] + [f"qs[{i}]" for i in range(len(got or ()))]
                same_everywhere(comm, grade, held, names, "every rank must take the same step: orthonormalise the "
                                "all-reduced P, the same on every rank, not each rank's own")  # fmt: skip
                factors = sum((a + b) * rank for a, b in shapes)
                whole = allreduce_bytes(p, sum(a * b for a, b in shapes))
                ring = (f"all-reducing the P's ({sum(a for a, _ in shapes) * rank} numbers) and the Q's "
                        f"({sum(b for _, b in shapes) * rank}) around the ring (collectives.allreduce(comm, x, "
                        "op='avg', algorithm='ring'))")  # fmt: skip
                sent_in_all(comm, grade, allreduce_bytes(p, factors), ring, f"; all-reducing the whole matrices "
                            f"sends {whole}: PowerSGD sends only the factors")  # fmt: skip
            errors, qs = new_errors, new_qs  # the next step starts from the oracle's state


def judge_qs(grade, returned, shapes, rank: int):
    """The returned Qs as float64 arrays, one b x r per matrix, or None (and a problem) if they are not."""
    if not isinstance(returned, (tuple, list)) or len(returned) != len(shapes):
        grade.fail(f"powersgd_step returned {type(returned).__name__} {returned!r:.60}; it must return the new Qs, a "
                   f"list of {len(shapes)} arrays (one per matrix, b x r)")  # fmt: skip
        return None
    got = [np.asarray(q, dtype=np.float64) for q in returned]
    for i, ((_, b), q) in enumerate(zip(shapes, got)):
        if q.shape != (b, rank):
            grade.fail(f"qs[{i}] returned has shape {q.shape}; matrix {i}'s Q is b x r = {(b, rank)} (Q = M^T P)")
            return None
    return got


def judge_matrix(grade, i: int, matrix, q, approx, oracle_q, error, new_error, m, old_error, g) -> None:
    """Matrix ``i`` after the step: the approximation, P's orthonormal columns, Q Q^T and the new error."""
    matrix, error = np.asarray(matrix), np.asarray(error)
    if q is not None and matrix.shape == approx.shape:
        gram = q.T @ q
        if np.linalg.matrix_rank(gram) == gram.shape[0]:
            recovered = np.linalg.solve(gram, (matrix @ q).T).T  # P = (P Q^T) Q (Q^T Q)^-1
            grade.same(recovered.T @ recovered, np.eye(q.shape[1]), f"P^T P of matrix {i}'s P (read back from "
                       f"matrices[{i}] = P Q^T and the returned Q: P = matrices[{i}] Q (Q^T Q)^-1); P's columns must "
                       "be orthonormal: np.linalg.qr(P)[0] after P's all-reduce", **TOLERANCE)  # fmt: skip
    grade.same(matrix, approx, f"matrices[{i}] after the call (P Q^T: the rank-r approximation of the average over "
               "ranks of M = G + E)", **TOLERANCE)  # fmt: skip
    if q is not None:
        grade.same(q @ q.T, oracle_q @ oracle_q.T, f"Q Q^T of the returned qs[{i}] (Q = M^T P averaged over ranks; "
                   "Q Q^T does not depend on the basis chosen for P's columns)", **TOLERANCE)  # fmt: skip
    if not grade.same(error, new_error, f"errors[{i}] after the call (M - P Q^T: this rank's M = G + E, less what "
                      "was sent)", **TOLERANCE) and error.shape == new_error.shape:  # fmt: skip
        if np.allclose(error, old_error):
            grade.note(f"errors[{i}] is unchanged: it must become M - P Q^T (errors[i] += matrices[i] first, then "
                       "subtract P Q^T)")  # fmt: skip
        elif not error.any():
            grade.note(f"errors[{i}] is all zeros: keep what was not sent, M - P Q^T (error feedback)")
        elif np.allclose(error, m):
            grade.note(f"errors[{i}] holds M: subtract what was sent, P Q^T")
        elif np.allclose(error, g - approx):
            grade.note(f"errors[{i}] is G - P Q^T: M = G + E (add the old error into the gradient first)")

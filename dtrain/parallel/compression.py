"""Gradient compression for data parallelism (``ddp --compress``): send fewer bytes per step.

Data parallelism all-reduces the whole gradient every step: 2 (p-1)/p x n bytes a rank, whatever the network. When
the network is slow, the two answers dtrain teaches elsewhere are to send less often (local SGD) and to overlap. This
is the third: send a smaller version of the gradient. PyTorch DDP ships it as communication hooks
(``fp16_compress_hook``, ``powerSGD_hook``), Horovod as ``Compression.fp16``. Every rank compresses its own gradient,
the ranks exchange the compressed forms, and every rank ends with the same approximate average::

    rank r:  g_r ---compress---> c_r ---exchange (all-reduce or all-gather)---> every c ---decompress, average---> g~

**Half precision** (``fp16``, ``bf16``): each element travels in 2 bytes instead of 4, so the ring all-reduce sends
half the bytes; the sums are made in float32 (each rank decodes what it receives, adds, and encodes what it passes
on). fp16 keeps 10 bits of mantissa but only 5 of exponent: magnitudes under 6e-8 flush to zero (a small gradient
*underflows*, which is why fp16 training scales the loss up first), and the largest is 65504: the partial sums travel
unscaled here, so a sum over p ranks overflows at 65504, where PyTorch's hook, which divides by p before it casts,
would overflow only at p x 65504 (and underflow p times sooner). bf16 keeps float32's 8 exponent bits and 7 of
mantissa: coarser (3 significant digits), but nothing a float32 can hold underflows, so it needs no loss scaling.
NumPy has no bfloat16: here a bf16 number is the upper 16 bits of a float32, rounded to nearest even (what hardware
does); it travels as 2 bytes, exactly as a real bf16 would.

**Top-k with error feedback** (``topk``, ``--compress-ratio k/n``): each rank sends only the k entries of largest
magnitude, as (index, value) pairs; what it did not send is not thrown away but kept in a *residual* and added to the
next step's gradient, so every coordinate is eventually sent (without this, small coordinates would never move: the
lesson measures it). Different ranks choose different indices, so the pairs cannot be summed on the way as an
all-reduce sums dense chunks: they are *all-gathered* (every rank receives every rank's k pairs) and summed into a
dense gradient at each rank::

    residual += g;  idx = k largest |residual|;  send (idx, residual[idx]);  residual[idx] = 0
    g~ = (1/p) x sum over ranks q of scatter(idx_q, values_q)       (the same on every rank)

That step is :func:`topk_step` (the course's exercise 13.1); the class :class:`TopK` keeps the residual and calls it.

**PowerSGD** (``powersgd``, ``--powersgd-rank r``; Vogels, Karimireddy and Jaggi, 2019): a weight matrix's gradient
M (a x b) is close to low rank, so send a rank-r factorisation of it. One step of power iteration, warm-started from
the previous step's Q, and error feedback as top-k's::

    M = G + E                    (E: what earlier steps did not send)
    P = M Q          (a x r)     all-reduce P (average), orthonormalise its columns
    Q = M^T P        (b x r)     all-reduce Q (average)
    G~ = P Q^T;  E = M - G~      (every rank the same G~)

Two all-reduces, of a r and of b r numbers, instead of one of a b; the biases, vectors, are all-reduced uncompressed. At
full rank (r = min(a, b)) P Q^T is the averaged M itself, to rounding: PowerSGD is then plain ddp. That step, over
all the weight matrices at once, is :func:`powersgd_step` (exercise 13.2); the class :class:`PowerSGD` keeps E and Q,
calls it, and all-reduces the vectors.

**Cost per step** (p ranks, n gradient elements of s bytes; every exchange is dtrain's ring, whose exact bytes per
rank are :func:`dtrain.collectives.costmodel.bytes_sent`'s): fp16/bf16, a ring all-reduce of n elements of 2 bytes;
top-k, a ring all-gather of p x 2k elements of s bytes (an index and a value each), (p-1) 2k s a rank, p k / n of
ddp's bytes; PowerSGD, ring all-reduces of sum (a_i + b_i) r and of the biases' elements. State a rank holds beside
ddp's: top-k's residual (n s), PowerSGD's E (each matrix, a b s) and Q (b r s).
"""

from __future__ import annotations

import math

import numpy as np

from dtrain import collectives
from dtrain.backend import array_module, itemsize
from dtrain.collectives import costmodel, ring
from dtrain.collectives._chunks import bounds_for
from dtrain.comm import sendrecv
from dtrain.layout import parameter_shapes


def make(config, comm, grads):
    """The compressor ``config.compress`` names for this rank's gradients ``grads`` (views into the flat gradient,
    in parameter order), or None for "none"."""
    kinds = {"fp16": HalfPrecision, "bf16": HalfPrecision, "topk": TopK, "powersgd": PowerSGD}
    return kinds[config.compress](config, comm, grads) if config.compress != "none" else None


# --- half precision ------------------------------------------------------------------------------------------------
def encode_fp16(x, xp):
    return x.astype(np.float16).view(np.uint16)


def decode_fp16(code, xp):
    return code.view(np.float16).astype(np.float32)


def encode_bf16(x, xp):
    """The upper 16 bits of float32, rounded to nearest, ties to even (as bf16 hardware rounds)."""
    bits = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def decode_bf16(code, xp):
    return (code.astype(np.uint32) << np.uint32(16)).view(np.float32)


class HalfPrecision:
    """fp16 or bf16: dtrain's ring all-reduce with every message 2 bytes an element, sums in float32."""

    def __init__(self, config, comm, grads):
        self.comm, self.name = comm, config.compress
        self.encode, self.decode = (encode_fp16, decode_fp16) if self.name == "fp16" else (encode_bf16, decode_bf16)

    def state_bytes(self) -> int:
        return 0

    def exchange(self, flat) -> None:
        """Replace ``flat`` (this rank's gradient) by the average over ranks, every message in 2 bytes an element."""
        comm, xp = self.comm, array_module(flat)
        p, r = comm.Get_size(), comm.Get_rank()
        work = flat.astype(np.float32)  # (the sums' precision, whatever the gradient's dtype)
        if p > 1:
            cut = bounds_for(work.size, p)
            right, left = (r + 1) % p, (r - 1) % p
            incoming = xp.empty(cut[0][1], dtype=np.uint16)  # chunk 0 is the longest
            for s in range(p - 1):  # reduce-scatter, as dtrain's ring: rank r ends owning chunk r
                (a, b), (c, d) = cut[(r - s - 1) % p], cut[(r - s - 2) % p]
                sendrecv(comm, self.encode(work[a:b], xp), right, incoming[: d - c], left)
                work[c:d] += self.decode(incoming[: d - c], xp)
            codes = xp.empty(work.size, dtype=np.uint16)  # every chunk as it travels: the same bits on every rank
            a, b = cut[r]
            codes[a:b] = self.encode(work[a:b], xp)
            ring.allgather(comm, codes)  # (the ring's own all-gather: it only moves bytes, whatever their type)
            work = self.decode(codes, xp)
        else:
            work = self.decode(self.encode(work, xp), xp)
        flat[...] = work * np.float32(1.0 / p)


# --- top-k with error feedback -------------------------------------------------------------------------------------
def topk_step(comm, flat, residual, k: int):
    """One top-k step with error feedback (exercise 13.1): add ``flat`` to ``residual``, send the k entries of
    largest magnitude to every rank as (index, value) pairs, zero them in ``residual``, and leave in ``flat`` the
    average over ranks of every rank's pairs (scattered into zeros). Returns this rank's ``(index, values)``, the
    indices in ascending order. ``residual`` is this rank's own (flat's size and dtype) and afterwards holds exactly
    what was not sent; ``flat`` ends the same on every rank."""
    xp, n = array_module(flat), flat.size
    p, r = comm.Get_size(), comm.Get_rank()
    residual += flat  # what this rank owes: its gradient and everything it has not sent yet
    index = xp.argpartition(xp.abs(residual), n - k)[n - k :] if k < n else xp.arange(n)
    index = xp.sort(index)  # (a canonical order: the pairs then travel and sum in index order)
    values = residual[index]  # (a copy: fancy indexing)
    residual[index] = 0  # sent: what remains is exactly what was not
    # an index and a value per pair, both of flat's item size; the indices travel as the bits of unsigned
    # integers in a buffer of flat's dtype (the collectives move floats; nothing adds them on the way)
    whole = np.dtype(f"u{flat.itemsize}")
    pairs = xp.empty(p * 2 * k, dtype=flat.dtype)
    mine = pairs[r * 2 * k : (r + 1) * 2 * k]
    mine[:k] = index.astype(whole).view(flat.dtype)
    mine[k:] = values
    if p > 1:
        collectives.allgather(comm, pairs, "ring")
    total = xp.zeros(n, dtype=flat.dtype)
    for q in range(p):  # every rank sums the same pairs in the same order: the same result everywhere
        chunk = pairs[q * 2 * k : (q + 1) * 2 * k]
        total[chunk[:k].view(whole).astype(np.int64)] += chunk[k:]
    flat[...] = total * flat.dtype.type(1.0 / p)
    return index, values


class TopK:
    """Each rank's k largest entries of gradient + residual, all-gathered as (index, value) pairs; the rest kept."""

    def __init__(self, config, comm, grads):
        self.comm = comm
        n = sum(g.size for g in grads)
        xp, dtype = array_module(grads[0]), grads[0].dtype
        self.k = self.k_of(n, config.compress_ratio)
        self.feedback = config.compress_feedback == "on"
        self.residual = xp.zeros(n, dtype=dtype)
        self.last_sent = None  # (indices, values) this rank sent last step: the error-feedback invariant's evidence

    @staticmethod
    def k_of(n: int, ratio: float) -> int:
        return max(1, min(n, math.ceil(ratio * n)))

    def state_bytes(self) -> int:
        return int(self.residual.nbytes)

    def exchange(self, flat) -> None:
        self.last_sent = topk_step(self.comm, flat, self.residual, self.k)
        if not self.feedback:  # (what was not sent is lost)
            self.residual[...] = 0


# --- PowerSGD ------------------------------------------------------------------------------------------------------
def powersgd_step(comm, matrices, errors, qs) -> list:
    """One PowerSGD step with error feedback (exercise 13.2) over this rank's weight matrices' gradients
    ``matrices`` (each a x b), with this rank's ``errors`` (E, each a x b) and the ``qs`` (each b x r, the same on
    every rank): M = G + E; P = M Q, all-reduced (average) and orthonormalised; Q = M^T P, all-reduced; then each
    matrix holds P Q^T (the same on every rank) and each error M - P Q^T. Returns the new Qs (next step's warm start).
    The Ps of all the matrices travel in one ring all-reduce, laid end to end, and the Qs in another."""
    xp = array_module(matrices[0])
    ms = []
    for g, e in zip(matrices, errors):
        e += g  # M = G + E, kept in E's buffer
        ms.append(e)
    ps = allreduced(comm, [m @ q for m, q in zip(ms, qs)], xp)
    ps = [xp.linalg.qr(p_)[0] for p_ in ps]  # orthonormal columns, the same on every rank
    qs = allreduced(comm, [m.T @ p_ for m, p_ in zip(ms, ps)], xp)
    for g, e, p_, q in zip(matrices, ms, ps, qs):
        approx = p_ @ q.T
        g[...] = approx
        e -= approx  # what was not sent
    return qs


def allreduced(comm, arrays, xp) -> list:
    """The average over ranks of each array, in one ring all-reduce of them all, laid end to end."""
    joined = xp.concatenate([a.ravel() for a in arrays])
    if comm.Get_size() > 1:
        collectives.allreduce(comm, joined, op="avg", algorithm="ring")
    out, offset = [], 0
    for a in arrays:
        out.append(joined[offset : offset + a.size].reshape(a.shape))
        offset += a.size
    return out


class PowerSGD:
    """Each weight matrix's gradient as a rank-r product P Q^T, one power-iteration step a step, error feedback."""

    SEED = 2019  # the initial Q, the same on every rank

    def __init__(self, config, comm, grads):
        self.comm, self.r = comm, config.powersgd_rank
        self.feedback = config.compress_feedback == "on"
        xp, dtype = array_module(grads[0]), grads[0].dtype
        self.matrices = [g for g in grads if g.ndim == 2]
        self.vectors = [g for g in grads if g.ndim != 2]
        rng = np.random.default_rng(self.SEED)
        self.errors = [xp.zeros(g.shape, dtype=dtype) for g in self.matrices]
        self.qs = [xp.asarray(rng.standard_normal((g.shape[1], self.r)).astype(dtype)) for g in self.matrices]

    @staticmethod
    def counts(shapes, r: int) -> tuple[int, int, int]:
        """Elements of the P all-reduce, of the Q all-reduce, and of the vectors' all-reduce."""
        matrices = [s for s in shapes if len(s) == 2]
        vectors = sum(math.prod(s) for s in shapes if len(s) != 2)
        return sum(a * r for a, _ in matrices), sum(b * r for _, b in matrices), vectors

    def state_bytes(self) -> int:
        return int(sum(e.nbytes for e in self.errors) + sum(q.nbytes for q in self.qs))

    def exchange(self, flat) -> None:
        comm, xp = self.comm, array_module(flat)
        self.qs = powersgd_step(comm, self.matrices, self.errors, self.qs)
        if not self.feedback:  # (what was not sent is lost)
            for e in self.errors:
                e[...] = 0
        if self.vectors:  # the biases, uncompressed
            for v, average in zip(self.vectors, allreduced(comm, self.vectors, xp)):
                v[...] = average


# === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
def exchanges(config, shapes) -> list[tuple[str, int, int]]:
    """The collectives a step of ``config.compress`` makes, each as (collective, elements, bytes an element), all on
    dtrain's ring: what :func:`bytes_sent` counts and the planner prices."""
    b, n = itemsize(config.dtype), sum(math.prod(s) for s in shapes)
    if config.compress in ("fp16", "bf16"):
        return [("allreduce", n, 2)]
    if config.compress == "topk":
        return [("allgather", 2 * TopK.k_of(n, config.compress_ratio), b)]  # per rank; p x that in all
    return [("allreduce", count, b) for count in PowerSGD.counts(shapes, config.powersgd_rank) if count]


def bytes_sent(config, shapes, world: int, rank: int) -> int:
    """Bytes ``rank`` sends per step with ``config.compress`` (exact: what the tracer counts)."""
    total = 0
    for collective, count, b in exchanges(config, shapes):
        whole = world * count if collective == "allgather" else count  # (an all-gather's buffer: every rank's part)
        total += costmodel.bytes_sent("ring", whole, b, world, rank, collective=collective)
    return total


def state_bytes(config, shapes) -> int:
    """Bytes of state a rank keeps for ``config.compress`` beside ddp's (residual, error, Q)."""
    b = itemsize(config.dtype)
    if config.compress == "topk":
        return sum(math.prod(s) for s in shapes) * b
    if config.compress == "powersgd":
        r = config.powersgd_rank
        return sum((s[0] * s[1] + s[1] * r) * b for s in shapes if len(s) == 2)
    return 0


def exchange_time(config, sizes, world: int, hardware) -> float:
    """Seconds of a step's exchanges on ``hardware`` (:class:`dtrain.plan.hardware.Hardware`): the ring's formulas
    at the compressed sizes (:func:`exchanges`); the compressors' own arithmetic is not priced."""
    ranks = range(world)
    return sum(hardware.allreduce("ring", count * b, ranks, world) if collective == "allreduce" else
               hardware.collective(collective, "ring", world * count * b, ranks, world)
               for collective, count, b in exchanges(config, parameter_shapes(sizes)))  # fmt: skip

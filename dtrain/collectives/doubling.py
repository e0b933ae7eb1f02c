"""Recursive doubling and Rabenseifner's all-reduce: partners at distance 1, 2, 4, ... (log2 p steps).

**Recursive doubling** (latency-optimal). At step k rank v exchanges its *whole* buffer with ``v XOR 2^k`` and both
add. After log2 p steps every rank has summed every buffer::

    p = 4     step 0 (distance 1)      step 1 (distance 2)
              0 <-> 1   2 <-> 3        0 <-> 2   1 <-> 3        each holds x0+x1+x2+x3

**Rabenseifner** (bandwidth-optimal with log p latency) = recursive *halving* reduce-scatter + recursive doubling
all-gather. Cut the buffer into p chunks. The halving starts at the largest distance: each pair splits its current
range of chunks in two, the lower rank keeps and reduces the lower half, the upper rank the upper half, and each
sends the half it gives away. Rank v ends owning chunk v fully reduced. The all-gather then runs the steps backwards,
each pair swapping the ranges they own, so the ranges double::

    p = 4                 rank 0           rank 1           rank 2           rank 3
    halve, distance 2     keeps c0 c1      keeps c0 c1      keeps c2 c3      keeps c2 c3
                          sends c2 c3 ->2  sends c2 c3 ->3  sends c0 c1 ->0  sends c0 c1 ->1
    halve, distance 1     keeps c0,        keeps c1,        keeps c2,        keeps c3,
                          sends c1 ->1     sends c0 ->0     sends c3 ->3     sends c2 ->2
    gather, distance 1    sends c0 ->1     sends c1 ->0     sends c2 ->3     sends c3 ->2
    gather, distance 2    sends c0 c1 ->2  sends c0 c1 ->3  sends c2 c3 ->0  sends c2 c3 ->1

**Non-power-of-two p.** Let p' = 2^floor(log2 p) and r = p - p'. Before the algorithm, the first 2r ranks pair up:
each odd one sends its whole buffer to the even one below it, which adds it, and sits out. The remaining p' ranks
(the evens among the first 2r, then everyone from 2r on) run the algorithm under new numbers 0 .. p'-1. At the end
each even rank < 2r sends the result back to its odd partner. For p = 6: r = 2, 1 -> 0 and 3 -> 2 fold in, ranks
0, 2, 4, 5 act as 0, 1, 2, 3, and 0 -> 1 and 2 -> 3 return the result.

**Cost** (n bytes, L = log2 p'; +fix-up ``2 (alpha + n beta) + n gamma`` when p is not a power of two):
    recursive doubling:  ``L alpha + L n beta + L n gamma``
    Rabenseifner:        ``2L alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma``
Exact bytes sent: an odd folding rank sends n; recursive doubling sends L n (+ n on an even rank < 2r); Rabenseifner
sends, per halving step, the size of the half it gives away and, per gathering step, the size of the range it owns
(chunks of the n-element buffer cut into p' pieces, ``chunk_offsets(n, p')``), + n on an even rank < 2r.
"""

from __future__ import annotations

from dtrain import kernels
from dtrain.collectives._chunks import offsets_for, scratch
from dtrain.comm import sendrecv


def _layout(p):
    """``(p2, r)``: the power of two p' <= p that runs the algorithm and the number r of ranks folded away."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def _new_rank(rank, r):
    """This rank's number among the p' participants, or None for an odd rank < 2r that folded away."""
    if rank < 2 * r:
        return None if rank % 2 else rank // 2
    return rank - r


def _real_rank(v, r):
    """The communicator rank of participant ``v`` (inverse of ``_new_rank``)."""
    return 2 * v if v < r else v + r


def _fold(comm, buf, op, rank, r):
    """The first 2r ranks pair up: odd sends its buffer to even, even adds it. Returns the new rank (or None)."""
    v = _new_rank(rank, r)
    if rank < 2 * r:
        if v is None:
            comm.Send(buf, dest=rank - 1)
        else:
            incoming = scratch(buf, buf.size)
            comm.Recv(incoming, source=rank + 1)
            kernels.reduce_(buf, incoming, op)
    return v


def _unfold(comm, buf, rank, r):
    """Each even rank < 2r gives the finished result to the odd rank that folded into it."""
    if rank < 2 * r:
        if rank % 2:
            comm.Recv(buf, source=rank - 1)
        else:
            comm.Send(buf, dest=rank + 1)


def allreduce(comm, buf, op="sum"):
    """Recursive-doubling all-reduce: log2 p' exchanges of the whole buffer (plus the non-power-of-two fix-up)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    p2, r = _layout(p)
    v = _fold(comm, buf, op, rank, r) if r else rank  # (r = 0: p is a power of two, no fix-up, v = rank)
    if v is not None:
        # buf and one scratch buffer take turns: each step receives into the one not being sent and reduces into
        # the one that just *arrived*, which is sent next (writing into the buffer the partner has just read costs
        # cache-line invalidations on its core). The last step reduces into buf, where the result must end anyway:
        # whichever of the two it received into, the other one is the scratch buffer.
        mine, incoming = buf, scratch(buf, buf.size)
        work = incoming
        distance = 1
        while distance < p2:
            partner = _real_rank(v ^ distance, r) if r else v ^ distance
            sendrecv(comm, mine, partner, incoming, partner)
            distance <<= 1
            if distance < p2:
                kernels.reduce_(incoming, mine, op)  # theirs + mine == mine + theirs: partners end bit-identical
                mine, incoming = incoming, mine
            elif op == "avg":  # the last step: divide while adding, one pass over memory
                kernels.sum_scale_(buf, [buf, work], 1.0 / p)
            else:
                kernels.reduce_(buf, work, op)
    if r:
        _unfold(comm, buf, rank, r)
    return buf


def _halving(comm, buf, op, v, p2, r, offsets):
    """Recursive-halving reduce-scatter among the p2 participants: participant v ends owning chunk v."""
    lo, hi = 0, p2  # the range of chunks this rank is still responsible for
    distance = p2 // 2
    while distance >= 1:
        partner = _real_rank(v ^ distance, r)
        mid = lo + distance
        (keep_lo, keep_hi), (give_lo, give_hi) = ((mid, hi), (lo, mid)) if v & distance else ((lo, mid), (mid, hi))
        a, b = offsets[keep_lo], offsets[keep_hi]
        incoming = scratch(buf, b - a)
        sendrecv(comm, buf[offsets[give_lo] : offsets[give_hi]], partner, incoming, partner)
        kernels.reduce_(buf[a:b], incoming, op)
        lo, hi = keep_lo, keep_hi
        distance //= 2


def _gathering(comm, buf, v, p2, r, offsets):
    """Recursive-doubling all-gather among the p2 participants: participant v starts owning chunk v."""
    lo, hi = v, v + 1
    distance = 1
    while distance < p2:
        partner = _real_rank(v ^ distance, r)
        their_lo, their_hi = (lo - distance, lo) if v & distance else (hi, hi + distance)
        sendrecv(comm, buf[offsets[lo] : offsets[hi]], partner, buf[offsets[their_lo] : offsets[their_hi]], partner)
        lo, hi = min(lo, their_lo), max(hi, their_hi)
        distance <<= 1


def rabenseifner(comm, buf, op="sum"):
    """Rabenseifner's all-reduce: recursive-halving reduce-scatter, then recursive-doubling all-gather."""
    p, rank = comm.Get_size(), comm.Get_rank()
    p2, r = _layout(p)
    v = _fold(comm, buf, op, rank, r)
    if v is not None:
        cut = offsets_for(buf.size, p2)
        _halving(comm, buf, op, v, p2, r, cut)
        if op == "avg":  # only my chunk is final here: scaling it costs 1/p' of a pass over the buffer
            kernels.scale_(buf[cut[v] : cut[v + 1]], 1.0 / p)
        _gathering(comm, buf, v, p2, r, cut)
    _unfold(comm, buf, rank, r)
    return buf


def reduce_scatter(comm, buf, op="sum"):
    """Recursive-halving reduce-scatter (p a power of two): rank r ends owning chunk r, returned as a view."""
    p, rank = comm.Get_size(), comm.Get_rank()
    if p & (p - 1):
        raise ValueError(f"recursive halving needs a power-of-two number of ranks, not {p}: use the ring")
    cut = offsets_for(buf.size, p)
    _halving(comm, buf, op, rank, p, 0, cut)
    mine = buf[cut[rank] : cut[rank + 1]]
    if op == "avg":
        kernels.scale_(mine, 1.0 / p)
    return mine


def allgather(comm, buf):
    """Recursive-doubling all-gather (p a power of two): rank r contributes chunk r."""
    p, rank = comm.Get_size(), comm.Get_rank()
    if p & (p - 1):
        raise ValueError(f"recursive doubling all-gather needs a power-of-two number of ranks, not {p}: use the ring")
    _gathering(comm, buf, rank, p, 0, offsets_for(buf.size, p))
    return buf

"""Shared memory inside one node: every rank reads the others' buffers in place, no message at all.

Between two ranks of one machine a "message" is a memory copy: MPI copies the sender's buffer into a shared segment
and the receiver copies it out again (unless it has a single-copy path, Linux's CMA or XPMEM). So the ring copies
each of its ``2 (p-1)/p n`` bytes twice, and each step waits for a message's latency. Here the buffers
themselves live in an MPI-3 shared window (:mod:`dtrain.comm.windows`), mapped into every rank's process, and rank r
sums *its* chunk straight out of everyone's buffer and stores the sum straight into everyone's buffer::

    p = 3          chunk 0      chunk 1      chunk 2          fence 1: every buffer is complete
    rank 0 buf   [ g0 c0  ]   [ g0 c1  ]   [ g0 c2  ]         rank r: load chunk r of every buffer, sum it
    rank 1 buf   [ g1 c0  ]   [ g1 c1  ]   [ g1 c2  ]                 (in its own copy of the chunk), then
    rank 2 buf   [ g2 c0  ]   [ g2 c1  ]   [ g2 c2  ]                 store the sum into chunk r of every buffer
                   rank 0       rank 1       rank 2           fence 2: every sum is stored
                   sums c0      sums c1      sums c2

**allreduce** is exactly that; **reduce_scatter** stops after the sum (rank r's chunk r, as the ring's); **allgather**
loads every other rank's chunk q into its own buffer. Chunks are ``chunk_bounds(n, p)``'s, so the shards match the
ring's, and each rank sums in a fixed order (its own chunk first, then the others in rank order): the same bits on
every run (and, to the rounding of a different order of additions, the ring's).

**Why two fences.** Stores into shared memory are not messages: nothing tells the others that they happened. Fence 1
(:meth:`~dtrain.comm.windows.SharedWindow.fence`: ``Win.Sync``, barrier, ``Win.Sync``) makes sure every rank has
written its whole gradient before anyone loads it; fence 2 makes sure every sum has been stored before anyone leaves
(and, with it, that nobody overwrites its buffer, say with the next step's backward, while another rank still loads
from it). Without ``Win.Sync`` the barrier alone orders the ranks but not their memory on a weakly ordered CPU (ARM,
POWER): a rank could see the barrier and still load a stale value. Each fence is two memory barriers and one
``Barrier``: its latency is this algorithm's alpha, and with more ranks than cores it dominates small buffers.

**Zero copy, or copy-in.** When ``buf`` lies in a window on this very communicator (:func:`buffer` allocated it: ddp's
flat gradients, ZeRO's, local SGD's weights) the algorithm works on it in place. Any other buffer is copied into a
scratch window first (every chunk the others load: all but this rank's own, which it sums where it is) and the
others' sums copied back out: ``2 (n - c_r)`` more bytes copied per rank (what MPI's shared-memory path pays for
every message). Every rank must make the same call on the same place of its window (the same offset and size), as a
symmetric allocation gives; each call announces itself in a control window and every rank reads every rank's
announcement after fence 1 (shm_windows.py), so a mismatch is an error on every rank, never a hang or a wrong sum.

**hierarchical_shm** (NCCL's and Horovod's hierarchical all-reduce, with shared memory inside nodes): (1) inside each
node, rank r sums chunk r and stores the sum into the node leader's buffer; (2) the leaders run the ring between
nodes; (3) every rank of a node copies the leader's result. Only leaders send messages; four fences (one more
between each phase and the next, so that no rank loads what is not yet written or overwrites what is still read).

**Cost** (n bytes, p ranks of one node, chunk c_r of rank r; phi: one fence; delta: seconds per byte copied between
ranks' memory; gamma: per byte reduced)::

    allreduce        2 phi + 2 (p-1) c_r delta + (p-1) c_r gamma       (loads (p-1) c_r, stores (p-1) c_r)
      copy-in        + 2 (n - c_r) delta                                (buf into the window and back out)
    reduce_scatter   2 phi + (p-1) c_r delta + (p-1) c_r gamma     (+ (n - c_r) delta copy-in)
    allgather        2 phi + (n - c_r) delta                       (+ c_r delta copy-in)

against the ring's ``2 (p-1) (alpha + ...)``: two barriers instead of 2(p-1) message latencies, and each byte
copied once instead of twice. The exact counts are :func:`bytes_copied`, which the tracer's ``bytes_copied`` matches.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dtrain import kernels
from dtrain.collectives import ring, shm_windows
from dtrain.collectives._chunks import offsets_for
from dtrain.collectives.shm_windows import OPS, buffer, check_one_node, holds, real_node, release, share_model

__all__ = ["allgather", "allreduce", "buffer", "bytes_copied", "check_one_node", "hierarchical_allreduce", "holds",
           "predict_time", "real_node", "reduce_scatter", "release", "share_model"]  # fmt: skip

ALGORITHMS = ("shm", "hierarchical_shm")  # the all-reduces that work on shared windows
CODES = {"allreduce": 1, "reduce_scatter": 2, "allgather": 3, "hierarchical_shm": 4}
NAMES = {code: name for name, code in CODES.items()}


# --- the algorithms -------------------------------------------------------------------------------------------


def allreduce(comm, buf, op="sum"):
    """Sum (avg, max) ``buf`` over ``comm``'s ranks, one node, through shared memory; returns ``buf``."""
    return _collective(comm, buf, op, "allreduce")


def reduce_scatter(comm, buf, op="sum"):
    """Rank r's chunk r of ``buf`` becomes the reduction; returns it (a view of ``buf``)."""
    return _collective(comm, buf, op, "reduce_scatter")


def allgather(comm, buf):
    """Rank r contributes chunk r of ``buf``; afterwards every rank holds every chunk. Returns ``buf``."""
    return _collective(comm, buf, "sum", "allgather")


def hierarchical_allreduce(topo, buf, op="sum"):
    """Shared memory inside each node (a reduce to its leader), the ring between the leaders, the leader's result
    copied by its node."""
    node, inner = topo.node, "sum" if op == "avg" else op  # divide once, by the world's size
    at = _enter(node, buf, "hierarchical_shm", op)
    leader, lo, hi = at.views[0], at.lo, at.hi
    _sum_chunk(node, at.mine[lo:hi], [at.views[q][lo:hi] for q, _ in _others(buf.size, len(at.views), node.Get_rank())],
               inner, 1.0)  # fmt: skip
    if node.Get_rank():  # my chunk's sum into the leader's buffer
        _copy(node, leader[lo:hi], at.mine[lo:hi], "store into the leader")
    shm_windows.fence(node, at.synced, "fence 2 (every chunk's sum is in its leader's buffer)")
    if topo.leaders is not None:
        ring.allreduce(topo.leaders, leader, inner)
        if op == "avg":
            kernels.scale_(leader, 1.0 / topo.comm.Get_size())
    shm_windows.fence(node, at.synced, "fence 3 (every leader holds the result)")
    if node.Get_rank() or at.copied_in:
        _copy(node, buf, leader, "load from the leader")
    shm_windows.fence(node, at.synced, "fence 4 (every rank has loaded its leader's result)")
    return buf


def _collective(comm, buf, op, collective):
    if comm.Get_size() == 1:
        return buf
    at = _enter(comm, buf, collective, op)
    r, p, lo, hi = comm.Get_rank(), comm.Get_size(), at.lo, at.hi
    if collective == "allgather":
        for q, (qlo, qhi) in _others(buf.size, p, r):
            _copy(comm, at.mine[qlo:qhi], at.views[q][qlo:qhi], "load from a peer")
    else:
        others = [at.views[q][lo:hi] for q, _ in _others(buf.size, p, r)]
        stores = others if collective == "allreduce" else []  # (the sum, stored into every rank's chunk r)
        _sum_chunk(comm, at.mine[lo:hi], others, op, 1.0 / p if op == "avg" else 1.0, stores)
    shm_windows.fence(comm, at.synced, "fence 2 (every rank has loaded and stored)")
    if at.copied_in and collective == "allreduce":  # the others' chunks, summed by their owners, out of my segment
        for _, (qlo, qhi) in _others(buf.size, p, r):
            _copy(comm, buf[qlo:qhi], at.views[r][qlo:qhi], "copy out of the window")
    return buf[lo:hi] if collective == "reduce_scatter" else buf


class Entered(NamedTuple):
    """Where a call works, once every rank has entered it (:func:`_enter`)."""

    synced: tuple  # the windows its fences sync: the control window, the data's
    views: list  # every rank's data in the window, as arrays of buf's dtype (views[q]: rank q's)
    mine: np.ndarray  # where this rank's own data is: its view, or buf itself when copied in (a leader: its view)
    lo: int  # this rank's chunk: [lo, hi)
    hi: int
    copied_in: bool  # buf is not in a window: copied into the scratch (and, for an all-reduce, back out)


def _enter(comm, buf, collective, op) -> Entered:
    """The first half of every call: announce it (shm_windows.py), copy ``buf`` into the scratch unless it lies in a
    window, fence 1, agree with every rank (growing the scratch together if it was too small)."""
    if type(buf) is not np.ndarray:
        raise ValueError(f"{collective}/shm works on host memory, not a {type(buf).__name__}: stage it, or use ring")
    check_one_node(comm)  # (hierarchical_shm: its node, which must be one real node)
    r, p = comm.Get_rank(), comm.Get_size()
    lo, hi = offsets_for(buf.size, p)[r : r + 2]
    call, window = shm_windows.announce(comm, buf, CODES[collective], OPS.index(op))
    copied_in = not call.zero_copy
    if copied_in and window is not None:
        _copy_in(comm, window, buf, collective, lo, hi)
    control = shm_windows.state(comm).control
    synced = (control,) if window is None else (control, window.shared)
    shm_windows.fence(comm, synced, "fence 1 (every rank's data is written)")
    if shm_windows.agree(comm, call, f"{collective}/shm", NAMES):  # the scratch was too small somewhere: all grow it
        window = shm_windows.grow(comm, buf.nbytes)
        _copy_in(comm, window, buf, collective, lo, hi)
        shm_windows.fence(comm, (control, window.shared), "fence 1 again (the grown scratch is written)")
    views = [window.segment(q, buf.dtype, call.offset, buf.size) for q in range(p)]
    mine = views[r] if not copied_in or (collective == "hierarchical_shm" and r == 0) else buf
    return Entered((control, window.shared), views, mine, lo, hi, copied_in)


def _copy_in(comm, window, buf, collective, lo, hi):
    """What the others will load from my segment: every chunk but mine (allgather: mine alone; a node's leader in
    hierarchical_shm: everything, since the ring between leaders runs on it)."""
    r, mine = comm.Get_rank(), window.segment(comm.Get_rank(), buf.dtype, 0, buf.size)
    if collective == "allgather":
        _copy(comm, mine[lo:hi], buf[lo:hi], "copy into the window")
    elif collective == "hierarchical_shm" and r == 0:
        _copy(comm, mine, buf, "copy into the window")
    else:
        for _, (qlo, qhi) in _others(buf.size, comm.Get_size(), r):
            _copy(comm, mine[qlo:qhi], buf[qlo:qhi], "copy into the window")


def _others(n, p, r):
    """(q, q's chunk bounds) for every rank q but r, in rank order."""
    offsets = offsets_for(n, p)
    return [(q, offsets[q : q + 2]) for q in range(p) if q != r]


def _sum_chunk(comm, mine, others, op, factor, stores=()):
    """``mine`` (my chunk of my own data) reduced with the same chunk of the others', in rank order, in place; the
    result then stored into every array of ``stores``."""
    start = _clock(comm)
    if op == "max":
        for other in others:
            kernels.max_(mine, other)
    else:
        kernels.sum_scale_(mine, [mine, *others], factor)
    for store in stores:  # (a pass of its own: a loop that also stored would store into what it loads, losing SIMD)
        store[...] = mine
    what = "load from the peers, reduce" + (" and store into them" if stores else "")
    _record(comm, start, what, sum(o.nbytes for o in others) + sum(s.nbytes for s in stores))


def _copy(comm, dst, src, what):
    start = _clock(comm)
    dst[...] = src
    _record(comm, start, what, src.nbytes)


def _clock(comm):
    tracer = getattr(comm, "tracer", None)
    return None if tracer is None else tracer.now()


def _record(comm, start, what, nbytes):
    if start is not None and nbytes:
        comm.tracer.record_copy(what, start, nbytes)


# === the price: bytes copied per rank (what the tracer counts) and the time, from a machine's constants =========


def bytes_copied(collective, count, itemsize, p, rank, copy_in=False) -> int:
    """Exact bytes ``rank`` copies from or into other ranks' memory (and, with ``copy_in``, into and out of the
    window) in one call on ``count`` elements: the cost table of the module docstring."""
    if collective == "hierarchical_shm" and p == 1:  # a node of one rank: its leader copies in and out, or nothing
        return 2 * count * itemsize if copy_in else 0
    if p == 1 or count == 0:
        return 0
    offsets = offsets_for(count, p)
    c = offsets[rank + 1] - offsets[rank]
    if collective == "allreduce":
        elements = 2 * (p - 1) * c + (2 * (count - c) if copy_in else 0)
    elif collective == "reduce_scatter":
        elements = (p - 1) * c + (count - c if copy_in else 0)
    elif collective == "allgather":
        elements = count - c + (c if copy_in else 0)
    elif collective == "hierarchical_shm":  # p: the node's ranks, rank: the local rank (0: the leader)
        elements = (p - 1) * c + (c + count if rank else 0)
        elements += (count - c if rank else 2 * count) if copy_in else 0
    else:
        raise ValueError(f"no copy model for {collective}")
    return elements * itemsize


def predict_time(collective, nbytes, p, machine, copy_in=False) -> float:
    """Predicted seconds for one call on ``nbytes`` (the cost table above, from ``machine``'s fence, copy and gamma):
    the busiest rank's (rank 0: its chunk is the longest). "hierarchical_shm" is its part inside one node of ``p``
    ranks (four fences; the ring between the leaders is priced by the cost model)."""
    if p == 1 or nbytes == 0:
        return 0.0
    chunk = -(-nbytes // p)
    reduced = 0 if collective == "allgather" else (p - 1) * chunk  # (loads the reduction makes: gamma, not a copy)
    if collective == "hierarchical_shm":  # (the busiest: a rank that is not the leader, which also loads its result)
        copied = max(bytes_copied(collective, nbytes, 1, p, rank, copy_in) for rank in (0, 1)) - reduced
        return 4 * machine.fence + copied * machine.copy + reduced * machine.gamma
    copied = bytes_copied(collective, nbytes, 1, p, 0, copy_in) - reduced
    return 2 * machine.fence + copied * machine.copy + reduced * machine.gamma

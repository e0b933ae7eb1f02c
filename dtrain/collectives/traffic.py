"""Exact traffic: the messages and bytes each rank sends in one collective call, for every algorithm of the table.

``traffic``/``bytes_sent``/``messages_sent`` are *exact* per rank, uneven chunks and non-power-of-two fix-ups
included, for what ``dtrain.collectives`` makes each rank send (and ``dtrain.comm.trace`` counts); a buffer of 0
elements sends nothing. For "mpi" they are the logical volume the tracer sees (MPI's own messages are invisible): the
buffer, once. Shared memory ("shm") sends no message at all: its copies are :func:`dtrain.collectives.shm.bytes_copied`.
Each phase below returns (messages, elements) sent by rank r; an algorithm's traffic is the sum of its phases.
"""

from __future__ import annotations

import functools

from dtrain.collectives._chunks import chunk_offsets as _chunk_offsets


@functools.lru_cache(maxsize=4096)
def chunk_offsets(count: int, p: int) -> tuple:
    """The collectives' cut (:func:`dtrain.collectives.chunk_offsets`), remembered: the traffic of every rank of a
    big world reads the same offsets (the planner asks for hundreds of ranks at once)."""
    return tuple(_chunk_offsets(count, p))


def _ring_rs(count, p, r):
    """Ring reduce-scatter: one message per step, every chunk but chunk r."""
    off = chunk_offsets(count, p)
    chunks = [c for c in range(p) if c != r] if p > 1 else []
    return len(chunks), sum(off[c + 1] - off[c] for c in chunks)


def _ring_ag(count, p, r):
    """Ring all-gather: one message per step, every chunk but chunk r + 1."""
    off = chunk_offsets(count, p)
    chunks = [c for c in range(p) if c != (r + 1) % p] if p > 1 else []
    return len(chunks), sum(off[c + 1] - off[c] for c in chunks)


def _tree_reduce(count, p, r, root):
    return (1, count) if (r - root) % p else (0, 0)


def _tree_bcast(count, p, r, root):
    v = (r - root) % p
    low = v & -v if v else 1 << max(p - 1, 0).bit_length()  # the root may send to every power of two below p
    children = sum(1 for k in range(low.bit_length() - 1) if v + (1 << k) < p)
    return children, children * count


def _naive_reduce(count, p, r, root):
    return (0, 0) if r == root else (1, count)


def _naive_bcast(count, p, r, root):
    return (p - 1, (p - 1) * count) if r == root else (0, 0)


def _fold(count, p, r):
    """The non-power-of-two fix-up: (its traffic, this rank's participant number or None, p').

    Among the first 2r ranks each odd one sends its buffer once, each even one sends the result back once.
    """
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    if r < 2 * extra:
        return (1, count), (None if r % 2 else r // 2), p2
    return (0, 0), r - extra, p2


def _doubling(count, p, r):
    fix, v, p2 = _fold(count, p, r)
    if v is None:
        return fix
    steps = p2.bit_length() - 1
    return _add(fix, (steps, steps * count))


def _halving(count, p2, v):
    """Recursive halving: at each step, the half of my current range of chunks that I give away."""
    off = chunk_offsets(count, p2)
    messages = elements = 0
    lo, hi, d = 0, p2, p2 // 2
    while d >= 1:
        mid = lo + d
        (lo, hi), give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        messages, elements, d = messages + 1, elements + off[give[1]] - off[give[0]], d // 2
    return messages, elements


def _gathering(count, p2, v):
    """Recursive doubling all-gather: at each step, the range of chunks I own (1, 2, 4 ... chunks)."""
    off = chunk_offsets(count, p2)
    messages = elements = 0
    lo, hi, d = v, v + 1, 1
    while d < p2:
        messages, elements = messages + 1, elements + off[hi] - off[lo]
        (lo, hi), d = ((lo - d, hi) if v & d else (lo, hi + d)), 2 * d
    return messages, elements


def _rabenseifner(count, p, r):
    fix, v, p2 = _fold(count, p, r)
    if v is None:
        return fix
    return _add(fix, _add(_halving(count, p2, v), _gathering(count, p2, v)))


def _hierarchical(count, p, r, k, variant):
    """Sum of the phases, each priced on its sub-communicator (no ``ranks_per_node``: one node of p ranks)."""
    k = p if k is None else min(k, p)
    node, local = divmod(r, k)
    size = min(k, p - node * k)  # my node's size (the last node may be smaller)
    m = -(-p // k)  # number of nodes
    if variant != "hierarchical_rs":  # (hierarchical_shm: only the leaders' ring sends messages)
        phases = [_tree_reduce(count, size, local, 0), _tree_bcast(count, size, local, 0)]
        phases = phases if variant == "hierarchical" else []
        if local == 0:
            phases += [_ring_rs(count, m, node), _ring_ag(count, m, node)]
    else:
        off = chunk_offsets(count, size)
        shard = off[local + 1] - off[local]
        phases = [_ring_rs(count, size, local), _ring_ag(count, size, local)]
        phases += [_ring_rs(shard, m, node), _ring_ag(shard, m, node)]
    return functools.reduce(_add, phases, (0, 0))


def _add(a, b):
    return a[0] + b[0], a[1] + b[1]


def traffic(algorithm, count, itemsize, p, rank, ranks_per_node=None, *, collective="allreduce", root=0):
    """``(messages, bytes)`` sent by ``rank`` in one call of ``collective`` with ``algorithm`` (see module doc)."""
    if count == 0:
        return 0, 0
    if algorithm == "mpi":
        sends = collective in ("allreduce", "reduce") or rank == root
        return (1, count * itemsize) if sends else (0, 0)
    c, r = count, rank
    none = lambda: (0, 0)  # noqa: E731 (shared memory: no message)
    phases = {
        "allreduce": {
            "ring": lambda: _add(_ring_rs(c, p, r), _ring_ag(c, p, r)),
            "tree": lambda: _add(_tree_reduce(c, p, r, 0), _tree_bcast(c, p, r, 0)),
            "naive": lambda: _add(_naive_reduce(c, p, r, 0), _naive_bcast(c, p, r, 0)),
            "doubling": lambda: _doubling(c, p, r),
            "rabenseifner": lambda: _rabenseifner(c, p, r),
            "hierarchical": lambda: _hierarchical(c, p, r, ranks_per_node, algorithm),
            "hierarchical_rs": lambda: _hierarchical(c, p, r, ranks_per_node, algorithm),
            "hierarchical_shm": lambda: _hierarchical(c, p, r, ranks_per_node, algorithm),
            "shm": none,
        },
        "reduce": {"tree": lambda: _tree_reduce(c, p, r, root), "naive": lambda: _naive_reduce(c, p, r, root)},
        "broadcast": {"tree": lambda: _tree_bcast(c, p, r, root), "naive": lambda: _naive_bcast(c, p, r, root)},
        "reduce_scatter": {"ring": lambda: _ring_rs(c, p, r), "rabenseifner": lambda: _halving(c, p, r), "shm": none},
        "allgather": {"ring": lambda: _ring_ag(c, p, r), "doubling": lambda: _gathering(c, p, r), "shm": none},
        "alltoall": {"pairwise": lambda: _ring_rs(c, p, r)},  # the same count: every chunk but chunk r, once each
    }
    if algorithm not in phases.get(collective, {}):
        raise ValueError(f"no traffic model for {collective} with algorithm {algorithm!r}")
    messages, elements = phases[collective][algorithm]()
    return messages, elements * itemsize


def bytes_sent(algorithm, count, itemsize, p, rank, ranks_per_node=None, *, collective="allreduce", root=0) -> int:
    """Exact bytes ``rank`` sends in one ``collective`` of ``count`` elements of ``itemsize`` bytes on ``p`` ranks."""
    return traffic(algorithm, count, itemsize, p, rank, ranks_per_node, collective=collective, root=root)[1]


def messages_sent(algorithm, count, itemsize, p, rank, ranks_per_node=None, *, collective="allreduce", root=0) -> int:
    """Exact number of messages ``rank`` sends (zero-length ones included) in one call, as ``bytes_sent``."""
    return traffic(algorithm, count, itemsize, p, rank, ranks_per_node, collective=collective, root=root)[0]

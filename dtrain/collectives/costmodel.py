"""The alpha-beta-gamma cost model: what each collective should cost, and exactly what each rank sends.

A message of m bytes costs ``alpha + m beta`` (alpha: latency, seconds; beta: seconds per byte, 1 / bandwidth) and
reducing m bytes costs ``m gamma``. An algorithm's time is the sum over its sequential steps of the slowest rank's
step. For an n-byte all-reduce on p ranks (L = ceil(log2 p), p' = 2^floor(log2 p), f = 1 if p != p' else 0)::

    naive          2(p-1) alpha + 2(p-1) n beta          + (p-1) n gamma
    tree           2L alpha     + 2L n beta              + L n gamma
    ring           2(p-1) alpha + 2(p-1)/p n beta        + (p-1)/p n gamma
    doubling       log2(p') (alpha + n beta + n gamma)                              + f (2 alpha + 2 n beta + n gamma)
    rabenseifner   2 log2(p') alpha + 2(p'-1)/p' n beta  + (p'-1)/p' n gamma        + f (2 alpha + 2 n beta + n gamma)
    hierarchical   see hierarchical.py (intra-node terms with ``machine``, inter-node with ``inter``)
    mpi            the best of doubling, rabenseifner and ring (what an MPI library chooses between)
    auto           whichever :func:`choose` picks

Small messages are latency-bound (doubling: log p alphas), large ones bandwidth-bound (ring, Rabenseifner: the
2(p-1)/p n beta that no all-reduce can beat); :func:`choose`, used by ``algorithm="auto"``, takes the cheapest.
The all-to-all ("pairwise", alltoall.py; n % p == 0) sends every chunk but its own, p - 1 messages of n/p bytes,
and reduces nothing: ``(p-1) alpha + (p-1)/p n beta`` (:func:`alltoall_time`; ``collective="alltoall"`` below).

``bytes_sent``/``messages_sent`` are *exact* per rank, uneven chunks and non-power-of-two fix-ups included, for
what ``dtrain.collectives`` makes each rank send (and ``dtrain.comm.trace`` counts); a buffer of 0 elements sends
nothing. For "mpi" they are the logical volume the tracer sees (MPI's own messages are invisible): the buffer, once.

The machine's constants come from ``calibration.json`` next to this file when present, else the defaults below.
The file shipped with dtrain was measured on the reference machine of docs/benchmarks.md (2 cores); on yours, run
``python scripts/calibrate.py`` first, or ``auto`` chooses by another machine's numbers.
``scripts/calibrate.py`` writes it: ``{"alpha": s, "beta": s/byte, "gamma": s/byte, "by_ranks": {"4": {...}}}``.
The top-level constants are one pair of ranks playing ping-pong on an idle machine; ``by_ranks[p]`` are measured
with all p ranks exchanging at once, which is what an all-reduce step does. They differ when ranks share cores or a
memory bus: 4 ranks on 2 cores each get half a core, so every message waits for its peer to be scheduled and every
copy runs at half speed. :meth:`Machine.load` with ``p`` takes the measurement of the nearest rank count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from dtrain.collectives._chunks import chunk_offsets as _chunk_offsets

CALIBRATION = Path(__file__).with_name("calibration.json")
ALLREDUCE_ALGORITHMS = (
    "ring", "tree", "naive", "doubling", "rabenseifner", "hierarchical", "hierarchical_rs", "mpi"
)  # fmt: skip
CANDIDATES = ("doubling", "rabenseifner", "ring", "tree")  # what choose() picks from (in this order on ties)


@dataclasses.dataclass(frozen=True)
class Machine:
    """alpha: seconds per message; beta: seconds per byte sent; gamma: seconds per byte reduced.

    The defaults are rough numbers for two MPI processes on one modern machine, driven from Python: ~10 us per
    message (mostly mpi4py and interpreter overhead), ~5 GB/s copies, ~5 GB/s reductions.
    """

    alpha: float = 1e-5
    beta: float = 2e-10
    gamma: float = 2e-10

    @classmethod
    def load(cls, path=CALIBRATION, p: int | None = None) -> Machine:
        """The calibrated machine if ``path`` exists (for ``p`` ranks: the nearest measured rank count), else the
        defaults."""
        path = Path(path)
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        by_ranks = {int(k): v for k, v in data.get("by_ranks", {}).items()}
        if p is not None and by_ranks:
            data = by_ranks[min(by_ranks, key=lambda measured: (abs(measured - p), measured))]
        return cls(**{f.name: float(data[f.name]) for f in dataclasses.fields(cls) if f.name in data})


@functools.cache
def default_machine(p: int | None = None) -> Machine:
    """The calibrated machine for ``p`` ranks, read once per process."""
    return Machine.load(p=p)


# --- exact traffic: (messages, elements) sent by one rank in one phase -----------------------------------------
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
    if variant == "hierarchical":
        phases = [_tree_reduce(count, size, local, 0), _tree_bcast(count, size, local, 0)]
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
    phases = {
        "allreduce": {
            "ring": lambda: _add(_ring_rs(c, p, r), _ring_ag(c, p, r)),
            "tree": lambda: _add(_tree_reduce(c, p, r, 0), _tree_bcast(c, p, r, 0)),
            "naive": lambda: _add(_naive_reduce(c, p, r, 0), _naive_bcast(c, p, r, 0)),
            "doubling": lambda: _doubling(c, p, r),
            "rabenseifner": lambda: _rabenseifner(c, p, r),
            "hierarchical": lambda: _hierarchical(c, p, r, ranks_per_node, algorithm),
            "hierarchical_rs": lambda: _hierarchical(c, p, r, ranks_per_node, algorithm),
        },
        "reduce": {"tree": lambda: _tree_reduce(c, p, r, root), "naive": lambda: _naive_reduce(c, p, r, root)},
        "broadcast": {"tree": lambda: _tree_bcast(c, p, r, root), "naive": lambda: _naive_bcast(c, p, r, root)},
        "reduce_scatter": {"ring": lambda: _ring_rs(c, p, r), "rabenseifner": lambda: _halving(c, p, r)},
        "allgather": {"ring": lambda: _ring_ag(c, p, r), "doubling": lambda: _gathering(c, p, r)},
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


# --- predicted time -----------------------------------------------------------------------------------------------


def _time(steps, sent, reduced, machine):
    return steps * machine.alpha + sent * machine.beta + reduced * machine.gamma


def predict_time(algorithm, nbytes, p, machine=None, ranks_per_node=None, inter=None) -> float:
    """Predicted seconds for an ``nbytes`` all-reduce on ``p`` ranks (formulas in the module docstring).

    ``machine`` defaults to the one calibrated for ``p`` ranks, the constants ``auto`` chooses by. ``inter`` prices
    the links between nodes for the hierarchical algorithms (default: the same ``machine``).
    """
    m = machine or default_machine(p)
    n = float(nbytes)
    if p == 1 or nbytes == 0:
        return 0.0
    L = math.ceil(math.log2(p))
    p2 = 1 << (p.bit_length() - 1)
    k2 = p2.bit_length() - 1
    fix = _time(2, 2 * n, n, m) if p != p2 else 0.0
    if algorithm == "naive":
        return _time(2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n, m)
    if algorithm == "tree":
        return _time(2 * L, 2 * L * n, L * n, m)
    if algorithm == "ring":
        return _time(2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n, m)
    if algorithm == "doubling":
        return _time(k2, k2 * n, k2 * n, m) + fix
    if algorithm == "rabenseifner":
        return _time(2 * k2, 2 * (p2 - 1) / p2 * n, (p2 - 1) / p2 * n, m) + fix
    if algorithm == "mpi":
        return min(predict_time(a, nbytes, p, m) for a in ("doubling", "rabenseifner", "ring"))
    if algorithm == "auto":
        return predict_time(choose(nbytes, p, m), nbytes, p, m)
    if algorithm in ("hierarchical", "hierarchical_rs"):
        k = p if ranks_per_node is None else min(ranks_per_node, p)
        nodes, outer = -(-p // k), inter or m
        if algorithm == "hierarchical":
            lk = math.ceil(math.log2(k)) if k > 1 else 0
            inside = _time(2 * lk, 2 * lk * n, lk * n, m)
            return inside + (predict_time("ring", nbytes, nodes, outer) if nodes > 1 else 0.0)
        inside = _time(2 * (k - 1), 2 * (k - 1) / k * n, (k - 1) / k * n, m)
        return inside + (predict_time("ring", nbytes / k, nodes, outer) if nodes > 1 else 0.0)
    raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(ALLREDUCE_ALGORITHMS)}")


def alltoall_time(nbytes, p, machine=None) -> float:
    """Predicted seconds for an ``nbytes`` pairwise all-to-all on ``p`` ranks: ``(p-1) alpha + (p-1)/p n beta``."""
    m = machine or default_machine(p)
    return _time(p - 1, (p - 1) / p * nbytes, 0, m) if nbytes else 0.0


def choose(nbytes, p, machine=None) -> str:
    """The cheapest of ``CANDIDATES`` for an ``nbytes`` all-reduce on ``p`` ranks (the first on ties)."""
    if machine is None:
        return _choose_calibrated(nbytes, p)  # called on every "auto" all-reduce: remember the answers
    return min(CANDIDATES, key=lambda a: predict_time(a, nbytes, p, machine))


@functools.lru_cache(maxsize=4096)
def _choose_calibrated(nbytes, p) -> str:
    return choose(nbytes, p, default_machine(p))

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
    shm            2 phi + 2 (p-1)/p n delta + (p-1)/p n gamma: no message; two fences (phi) and copies (delta,
                   seconds per byte copied between ranks' memory), see shm.py; hierarchical_shm: shm + leaders' ring
    mpi            the best of doubling, rabenseifner and ring (what an MPI library chooses between)
    auto           whichever :func:`choose` picks

Small messages are latency-bound (doubling: log p alphas), large ones bandwidth-bound (ring, Rabenseifner: the
2(p-1)/p n beta that no all-reduce can beat); :func:`choose`, used by ``algorithm="auto"``, takes the cheapest.
The all-to-all ("pairwise", alltoall.py; n % p == 0) sends every chunk but its own, p - 1 messages of n/p bytes,
and reduces nothing: ``(p-1) alpha + (p-1)/p n beta`` (:func:`alltoall_time`; ``collective="alltoall"`` below).

Exact bytes and messages per rank: traffic.py (``bytes_sent``, ``messages_sent``, re-exported here).

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

from dtrain.collectives import shm
from dtrain.collectives.traffic import bytes_sent, chunk_offsets, messages_sent, traffic  # noqa: F401 (the API)

CALIBRATION = Path(__file__).with_name("calibration.json")
ALLREDUCE_ALGORITHMS = ("ring", "tree", "naive", "doubling", "rabenseifner", "hierarchical", "hierarchical_rs",
                        "shm", "hierarchical_shm", "mpi")  # fmt: skip
CANDIDATES = ("doubling", "rabenseifner", "ring", "tree")  # what choose() picks from (in this order on ties)


@dataclasses.dataclass(frozen=True)
class Machine:
    """alpha: seconds per message; beta: per byte sent; gamma: per byte reduced; fence: seconds per shared-memory
    fence (shm.py); copy: per byte copied from or into another rank's memory. The defaults are rough numbers for
    two processes on one machine, driven from Python: ~10 us per message, ~5 GB/s copies and reductions."""

    alpha: float = 1e-5
    beta: float = 2e-10
    gamma: float = 2e-10
    fence: float = 2e-5
    copy: float = 2e-10

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
    if algorithm == "shm":
        return shm.predict_time("allreduce", nbytes, p, m)
    if algorithm in ("hierarchical", "hierarchical_rs", "hierarchical_shm"):
        k = p if ranks_per_node is None else min(ranks_per_node, p)
        nodes, outer = -(-p // k), inter or m
        if algorithm == "hierarchical_shm":
            inside = shm.predict_time("hierarchical_shm", nbytes, k, m)
            return inside + (predict_time("ring", nbytes, nodes, outer) if nodes > 1 else 0.0)
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


def shm_threshold(p: int, zero_copy: bool = False) -> int | None:
    """The all-reduce size from which scripts/calibrate.py measured shm faster than "auto"'s message algorithm on
    ``p`` ranks of this machine, copying in or (``zero_copy``) on a buffer already in a window (None: not measured
    for ``p``, or never faster): where "auto" takes shared memory."""
    return _shm_thresholds("shm_zero_copy_from_bytes" if zero_copy else "shm_from_bytes").get(p)


@functools.cache
def _shm_thresholds(key: str) -> dict:
    data = json.loads(CALIBRATION.read_text()) if CALIBRATION.exists() else {}
    return {int(k): int(v[key]) for k, v in data.get("by_ranks", {}).items() if v.get(key) is not None}


def shm_pays(comm, nbytes, p, host=True, zero_copy=False) -> bool:
    """ "auto" takes shared memory for an ``nbytes`` all-reduce of ``host`` memory (``zero_copy``: already in a
    window) when scripts/calibrate.py measured it faster from that size on for ``p`` ranks, and ``comm``'s ranks are
    real processes on one node (never simulated ones). The same answer on every rank: the first time,
    ``shm.real_node`` asks them all (a collective)."""
    threshold = shm_threshold(p, zero_copy)
    return host and threshold is not None and nbytes >= threshold and shm.real_node(comm)

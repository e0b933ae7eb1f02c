"""Collectives: all-reduce and its relatives, one algorithm per file, behind one checked front door.

    algorithm         file              steps           bytes sent per rank (n-byte buffer)   good for
    naive             naive.py          2(p-1) at root  root (p-1) n, others n                 seeing why not
    tree              tree.py           2 ceil(log2 p)  n up (not the root) + n per child      small messages
    ring              ring.py           2(p-1)          2 (p-1)/p n                            large messages
    doubling          doubling.py       log2 p          n log2 p                               small messages
    rabenseifner      doubling.py       2 log2 p        2 (p-1)/p n                            large, power-of-2 p
    hierarchical      hierarchical.py   tree+ring+tree  leaders: ring on n                     nodes, small n
    hierarchical_rs   hierarchical.py   ring x 3        2 (K-1)/K n + ring on n/K              nodes, large n
    shm               shm.py            2 fences        none: copies 2 (p-1)/p n (shared memory) one node, any n
    hierarchical_shm  shm.py            shm+ring+shm    leaders: ring on n                     nodes, shm inside
    mpi               native.py         (MPI's own)     (MPI's own)                            the baseline
    auto              costmodel.py picks by message size and p (shm: only from calibrate.py's measured size on)
    FILE.py:FUNCTION  yours.py          your own fn(comm, buf) that sums in place (a course exercise, say)
    pairwise          alltoall.py       p-1             (p-1)/p n, all-to-all (n % p == 0)     experts, heads

Which file does what: this one is the front door (the six collectives, the table, one path through it);
_checks.py checks arguments (and, in debug mode, that ranks make the same call); _chunks.py cuts a buffer into p
chunks; the algorithms are in the table's files (shm_windows.py: the windows shm.py works on); costmodel.py predicts
time ("auto"'s choice), traffic.py counts exact bytes and messages per rank; calibration.json: this machine's numbers.

Everything works in place on one C-contiguous float32/float64 array (any shape; it is treated as flat)::

    from dtrain import collectives
    collectives.allreduce(comm, grads, op="avg", algorithm="ring")     # returns grads, now averaged
    shard = collectives.reduce_scatter(comm, grads)                    # rank r's chunk r, a view of grads
    collectives.allgather(comm, grads)                                 # chunk r from rank r, to everyone
    collectives.alltoall(comm, tokens)                                 # chunk j to rank j, in place; n % p == 0
    topo = hierarchical.topology(comm, ranks_per_node=2)               # nodes: built once, handed to every call
    collectives.allreduce(comm, grads, algorithm="hierarchical", topology=topo)
    grads = shm.buffer(comm, n, np.float32)        # in a shared window: "shm" then sums it in place, zero copy

``comm`` is an ``mpi4py`` communicator, a simulated one (``dtrain.comm.sim``) or either wrapped (tracer, GPU
staging, watchdog); with the tracer each call is labelled ``"<collective>/<algorithm>"``. Ops are "sum", "avg"
(sum / p) and "max". Chunks follow ``chunk_bounds(n, p)``: the first n % p chunks are one element longer.

**One path for every collective.** :data:`TABLE` lists each algorithm's function and what it needs (a power-of-two
p, nodes, nodes of equal size, n % p == 0). ``_run`` (1) checks the call on every rank before anything is sent,
(2) in debug mode (``DTRAIN_DEBUG=1`` or ``set_debug(True)``) compares every rank's call first, so a mismatch raises
``CollectiveMismatchError`` on every rank instead of hanging, (3) picks the algorithm ("auto": the cost model's
choice), (4) tells the watchdog what this rank is in, labels the traffic for the tracer and runs the algorithm. It
costs about a microsecond: nothing made per call, "auto" remembered per size (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from dtrain.collectives import _checks, costmodel, doubling, hierarchical, naive, native, ring, shm, tree, yours
from dtrain.collectives import alltoall as pairwise  # the module (the name alltoall is the collective, below)
from dtrain.collectives._checks import CollectiveMismatchError, debug_enabled, set_debug
from dtrain.collectives._chunks import chunk_bounds, chunk_offsets
from dtrain.comm import watchdog
from dtrain.comm.wrapper import innermost

__all__ = [
    "ALGORITHMS", "OPS", "TABLE", "CollectiveMismatchError", "allgather", "allreduce", "alltoall", "broadcast",
    "chunk_bounds", "chunk_offsets", "debug_enabled", "reduce", "reduce_scatter", "set_debug",
]  # fmt: skip

OPS, AUTO = ("sum", "avg", "max"), "auto"


class Algorithm(NamedTuple):
    """One way to run a collective: its function and what it needs. ``label`` is "<collective>/<algorithm>"."""

    run: Callable  # run(comm, flat_buffer, *the collective's own arguments: (op,), (root, op), (root,) or ())
    power_of_two: bool = False  # p must be a power of two
    nodes: bool = False  # runs on a hierarchical.Topology (passed in place of comm), not on the communicator
    equal_nodes: bool = False  # ... whose nodes all have the same number of ranks
    label: str = ""
    even_chunks: bool = False  # the buffer must cut into p chunks of equal size (n % p == 0)


def _collective(name, **algorithms) -> dict:
    """``{algorithm name: Algorithm}`` for the collective ``name``, each entry labelled with both names."""
    return {algorithm: entry._replace(label=f"{name}/{algorithm}") for algorithm, entry in algorithms.items()}


TABLE = {
    "allreduce": _collective(
        "allreduce",
        ring=Algorithm(ring.allreduce),
        tree=Algorithm(tree.allreduce),
        naive=Algorithm(naive.allreduce),
        doubling=Algorithm(doubling.allreduce),
        rabenseifner=Algorithm(doubling.rabenseifner),
        hierarchical=Algorithm(hierarchical.allreduce, nodes=True),
        hierarchical_rs=Algorithm(hierarchical.allreduce_rs, nodes=True, equal_nodes=True),
        shm=Algorithm(shm.allreduce),
        hierarchical_shm=Algorithm(shm.hierarchical_allreduce, nodes=True),
        mpi=Algorithm(native.allreduce),
    ),
    "reduce": _collective(
        "reduce", tree=Algorithm(tree.reduce), naive=Algorithm(naive.reduce), mpi=Algorithm(native.reduce)
    ),
    "broadcast": _collective(
        "broadcast", tree=Algorithm(tree.broadcast), naive=Algorithm(naive.broadcast), mpi=Algorithm(native.broadcast)
    ),
    "reduce_scatter": _collective(
        "reduce_scatter",
        ring=Algorithm(ring.reduce_scatter),
        rabenseifner=Algorithm(doubling.reduce_scatter, power_of_two=True),
        shm=Algorithm(shm.reduce_scatter),
    ),
    "allgather": _collective(
        "allgather",
        ring=Algorithm(ring.allgather),
        doubling=Algorithm(doubling.allgather, power_of_two=True),
        shm=Algorithm(shm.allgather),
    ),
    "alltoall": _collective("alltoall", pairwise=Algorithm(pairwise.alltoall, even_chunks=True)),
}
CHOOSE = {"allreduce": costmodel.choose}  # what algorithm="auto" means, for the collectives that have it
CHOICES = {name: ((AUTO,) if name in CHOOSE else ()) + tuple(table) for name, table in TABLE.items()}

ALGORITHMS, REDUCE_ALGORITHMS = CHOICES["allreduce"], CHOICES["reduce"]  # (reduce's: also broadcast's)
REDUCE_SCATTER_ALGORITHMS, ALLGATHER_ALGORITHMS = CHOICES["reduce_scatter"], CHOICES["allgather"]
ALLTOALL_ALGORITHMS = CHOICES["alltoall"]


# --- the six collectives --------------------------------------------------------------------------------------
# Each passes the algorithm's own arguments after the buffer as a tuple (the cheapest call), op and root by name.


def allreduce(comm, buf, op="sum", algorithm="auto", *, topology=None, ranks_per_node=None):
    """Reduce ``buf`` over all ranks of ``comm`` in place with ``op``; every rank gets the result. Returns ``buf``.

    The hierarchical algorithms run on a ``topology`` (``hierarchical.topology(comm, ranks_per_node)``): build it
    once and pass it to every call. Without one, the call builds one for itself (emulated nodes of
    ``ranks_per_node`` ranks, else the real nodes) and frees it afterwards: three ``Split`` calls, slow.
    """
    _run("allreduce", comm, buf, algorithm, (op,), op=op, topology=topology, ranks_per_node=ranks_per_node)
    return buf


def reduce(comm, buf, root=0, op="sum", algorithm="tree"):
    """Reduce every rank's ``buf`` into ``buf`` on ``root`` (other ranks' buffers may hold partial results)."""
    _run("reduce", comm, buf, algorithm, (root, op), op=op, root=root)
    return buf


def broadcast(comm, buf, root=0, algorithm="tree"):
    """Copy ``buf`` from ``root`` into every rank's ``buf``. Returns ``buf``."""
    _run("broadcast", comm, buf, algorithm, (root,), root=root)
    return buf


def reduce_scatter(comm, buf, op="sum", algorithm="ring"):
    """Reduce ``buf`` so that rank r owns chunk r (``chunk_bounds``) of the result; return it, a view of ``buf``.

    The rest of ``buf`` holds partial results afterwards. "rabenseifner" (recursive halving) needs p a power of 2.
    """
    return _run("reduce_scatter", comm, buf, algorithm, (op,), op=op)


def allgather(comm, buf, algorithm="ring"):
    """Rank r contributes chunk r of ``buf`` (``chunk_bounds``); afterwards all hold every chunk. Returns ``buf``.

    "doubling" (recursive doubling) needs p a power of 2.
    """
    _run("allgather", comm, buf, algorithm, ())
    return buf


def alltoall(comm, buf, algorithm="pairwise"):
    """Rank r sends chunk j of ``buf`` to rank j; afterwards chunk j holds rank j's chunk r. Returns ``buf``.

    The chunks must be of equal size: ``buf.size % p == 0``, else a ValueError on every rank before any message.
    """
    _run("alltoall", comm, buf, algorithm, ())
    return buf


# --- the one path ---------------------------------------------------------------------------------------------


_NONE = object()  # "this collective has no such argument" (None is a wrong value the checks must catch)


def _run(collective, comm, buf, algorithm, args, op=_NONE, root=_NONE, topology=None, ranks_per_node=None):
    """Check, agree (debug mode), pick, watch, label and run ``collective``; return what the algorithm returns (for
    an empty buffer: its flat view, untouched). ``args`` go to the algorithm after the buffer."""
    entry = error = None
    try:
        entry = _pick(collective, comm, buf, algorithm, op, root, topology, ranks_per_node)
    except (TypeError, ValueError) as exc:  # raised below, after the ranks have compared calls in debug mode
        error = exc
    if _checks.debug_enabled():
        _agree(collective, comm, buf, entry, op, root, topology, ranks_per_node, error)
    if error is not None:
        raise error
    flat = buf if buf.ndim == 1 else buf.reshape(-1)
    if not flat.size:
        return flat
    token = watchdog.begin(comm, entry.label)
    target = comm
    try:
        if entry.nodes:  # the algorithm runs on the nodes; without a topology, on one built for this call only
            target = topology if topology is not None else hierarchical.topology(comm, ranks_per_node)
        tracer = getattr(comm, "tracer", None)  # a TracedComm, or any wrapper around one (they forward attributes)
        if tracer is None:
            return entry.run(target, flat, *args)
        with tracer.operation(entry.label, nbytes=flat.nbytes):
            return entry.run(target, flat, *args)
    finally:
        if target is not comm and target is not topology:
            target.free()
        watchdog.end(token)


def _pick(collective, comm, buf, algorithm, op, root, topology, ranks_per_node) -> Algorithm:
    """Check the call on this rank alone (nothing is sent) and return the table's entry for the algorithm to run."""
    # The common buffer passes one inline test (a function call costs as much as the test); the rest, and CuPy
    # arrays, get the detailed checks, whose errors say what is wrong.
    if not (type(buf) is np.ndarray and buf.dtype.type in _checks.FLOAT_TYPES and buf.flags.carray):
        _checks.check_buffer(buf)
    if op is not _NONE and op not in OPS:
        _checks.check_choice("op", op, OPS)
    p = comm.Get_size()
    if root is not _NONE:
        _checks.check_root(root, p)
    try:  # a name in the table
        entry = TABLE[collective].get(algorithm)
    except TypeError:  # unhashable: not a name at all
        entry = None
    if entry is None and algorithm == AUTO and collective == "allreduce":  # shared memory (asked on every rank and
        host = type(buf) is np.ndarray  # call: it may ask the ranks), else the cost model's choice, remembered
        shared = costmodel.shm_pays(comm, buf.nbytes, p, host)
        entry = TABLE[collective]["shm"] if shared else _chosen.get((collective, algorithm, buf.nbytes, p))
    if entry is None and collective == "allreduce" and yours.is_spec(algorithm):  # FILE.py:FUNCTION, your own
        run, label = yours.entry(algorithm)
        entry = Algorithm(run, label=label)
    if entry is None:
        entry = _choose(collective, algorithm, buf.nbytes, p)
    if entry.power_of_two and p & (p - 1):
        raise ValueError(f"algorithm {algorithm!r} needs a power-of-two number of ranks, not {p}: use 'ring'")
    if entry.even_chunks and buf.size % p:
        _checks.check_even_chunks(buf.size, p, entry.label)
    if topology is not None or ranks_per_node is not None:
        _check_nodes(entry, comm, p, topology, ranks_per_node)
    return entry


_chosen: dict = {}  # (collective, "auto", nbytes, p) -> the entry "auto" picked: the cost model is asked once


def _choose(collective, algorithm, nbytes, p) -> Algorithm:
    """ "auto" met for the first time at this size and p: ask the cost model, remember its answer. Any other name
    that is not in the table is an error that lists the choices."""
    if algorithm != AUTO or collective not in CHOOSE:
        _checks.check_choice("algorithm", algorithm, CHOICES[collective])
    if len(_chosen) > 4096:  # a sweep over many sizes: start again rather than grow without end
        _chosen.clear()
    entry = _chosen[collective, algorithm, nbytes, p] = TABLE[collective][CHOOSE[collective](nbytes, p)]
    return entry


def _check_nodes(entry, comm, p, topology, ranks_per_node) -> None:
    if topology is not None and ranks_per_node is not None:
        raise ValueError("give a topology or ranks_per_node, not both (the topology knows its ranks per node)")
    _checks.check_ranks_per_node(ranks_per_node)
    if not entry.nodes:
        return
    if topology is not None:
        if innermost(topology.comm) is not innermost(comm):
            raise ValueError("this topology was built on another communicator: use hierarchical.topology(comm)")
        sizes = topology.node_sizes
    else:
        sizes = hierarchical.node_sizes(p, ranks_per_node)
    if entry.equal_nodes and len(set(sizes)) > 1:
        raise ValueError(
            f"{entry.label} needs nodes of equal size, {p} ranks in nodes of {list(sizes)} are not: use "
            "'hierarchical', which allows a smaller last node"
        )


def _agree(collective, comm, buf, entry, op, root, topology, ranks_per_node, error) -> None:
    """Debug mode: every rank's call must be the same one (see _checks.py), or every rank raises the same error."""
    seq = _checks.next_sequence(comm)
    algorithm = None if entry is None else entry.label.partition("/")[2]
    nodes = entry is not None and entry.nodes
    if topology is not None:
        ranks_per_node = topology.ranks_per_node
    made = ("given" if topology is not None else "per call") if nodes else None
    op, root = (None if value is _NONE else value for value in (op, root))
    mine = _checks.signature(collective, algorithm, op, buf, root, seq, error, ranks_per_node, made)
    try:
        _checks.agree(comm, mine)
    except CollectiveMismatchError as mismatch:
        raise mismatch from error

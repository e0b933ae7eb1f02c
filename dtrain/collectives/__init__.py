"""Collectives: all-reduce and its relatives, one algorithm per file, behind one checked front door.

    algorithm         file              steps           bytes sent per rank (n-byte buffer)   good for
    naive             naive.py          2(p-1) at root  root (p-1) n, others n                 seeing why not
    tree              tree.py           2 ceil(log2 p)  n up (not the root) + n per child      small messages
    ring              ring.py           2(p-1)          2 (p-1)/p n                            large messages
    doubling          doubling.py       log2 p          n log2 p                               small messages
    rabenseifner      doubling.py       2 log2 p        2 (p-1)/p n                            large, power-of-2 p
    hierarchical      hierarchical.py   tree+ring+tree  leaders: ring on n                     nodes, small n
    hierarchical_rs   hierarchical.py   ring x 3        2 (K-1)/K n + ring on n/K              nodes, large n
    mpi               (MPI's own)       ?               ?                                      the baseline
    auto              costmodel.py picks by message size and p

Everything works in place on one C-contiguous float32/float64 array (any shape; it is treated as flat)::

    from dtrain import collectives
    collectives.allreduce(comm, grads, op="avg", algorithm="ring")     # returns grads, now averaged
    shard = collectives.reduce_scatter(comm, grads)                    # rank r's chunk r, a view of grads
    collectives.allgather(comm, grads)                                 # chunk r from rank r, to everyone

``comm`` is an ``mpi4py`` communicator, a simulated one (``dtrain.comm.sim``) or either wrapped by the tracer
(``dtrain.comm.trace.TracedComm``); with the tracer each call is labelled ``"<collective>/<algorithm>"``. Ops are
"sum", "avg" (sum / p) and "max". Chunks follow ``chunk_bounds(n, p)``: the first n % p chunks are one element longer.

Arguments are checked on every rank before anything is sent (see _checks.py); with ``DTRAIN_DEBUG=1`` (or
``set_debug(True)``) the ranks also compare their calls first, so a mismatch raises ``CollectiveMismatchError`` on
every rank instead of hanging.
"""

from __future__ import annotations

import contextlib

from dtrain import kernels
from dtrain.collectives import _checks, costmodel, doubling, hierarchical, naive, ring, tree
from dtrain.collectives._checks import CollectiveMismatchError, debug_enabled, set_debug
from dtrain.collectives._chunks import chunk_bounds, chunk_offsets
from dtrain.comm.sim import IN_PLACE, MAX, SUM

__all__ = [
    "ALGORITHMS", "OPS", "CollectiveMismatchError", "allgather", "allreduce", "broadcast", "chunk_bounds",
    "chunk_offsets", "debug_enabled", "reduce", "reduce_scatter", "set_debug",
]  # fmt: skip

OPS = ("sum", "avg", "max")
ALGORITHMS = ("auto", "ring", "tree", "naive", "doubling", "rabenseifner", "hierarchical", "hierarchical_rs", "mpi")
REDUCE_ALGORITHMS = ("tree", "naive", "mpi")  # also broadcast's
REDUCE_SCATTER_ALGORITHMS = ("ring", "rabenseifner")
ALLGATHER_ALGORITHMS = ("ring", "doubling")
_MPI_OPS = {"sum": SUM, "avg": SUM, "max": MAX}


def _begin(comm, collective, buf, op, root, check, ranks_per_node=None):
    """Run ``check()`` (which returns the algorithm to use); in debug mode compare every rank's call first."""
    seq = _checks.next_sequence(comm)
    error, algorithm = None, None
    try:
        algorithm = check()
    except (TypeError, ValueError) as exc:
        error = exc
    if _checks.debug_enabled():
        try:
            _checks.agree(comm, _checks.signature(collective, algorithm, op, buf, root, seq, error, ranks_per_node))
        except CollectiveMismatchError as mismatch:
            raise mismatch from error
    if error is not None:
        raise error
    return algorithm


def _traced(comm, label, buf):
    """Label the traffic inside for the tracer, when ``comm`` is traced."""
    tracer = getattr(comm, "tracer", None)  # a TracedComm, or a wrapper around one (GPU staging forwards it)
    if tracer is not None:
        return tracer.operation(label, nbytes=buf.nbytes)
    return contextlib.nullcontext()


def _power_of_two(algorithm, p):
    if p & (p - 1):
        raise ValueError(f"algorithm {algorithm!r} needs a power-of-two number of ranks, not {p}: use 'ring'")


def _check_nodes(algorithm, p, ranks_per_node):
    if ranks_per_node is None:
        return
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}")
    sizes = hierarchical.node_sizes(p, ranks_per_node)
    if algorithm == "hierarchical_rs" and len(set(sizes)) > 1:
        raise ValueError(
            f"hierarchical_rs needs nodes of equal size, {p} ranks with ranks_per_node={ranks_per_node} gives "
            f"{list(sizes)}: use 'hierarchical', which allows a smaller last node"
        )


def _mpi_allreduce(comm, buf, op):
    comm.Allreduce(IN_PLACE, buf, op=_MPI_OPS[op])
    if op == "avg":
        kernels.scale_(buf, 1.0 / comm.Get_size())
    return buf


def _mpi_reduce(comm, buf, root, op):
    if comm.Get_rank() == root:
        comm.Reduce(IN_PLACE, buf, op=_MPI_OPS[op], root=root)
        if op == "avg":
            kernels.scale_(buf, 1.0 / comm.Get_size())
    else:
        comm.Reduce(buf, None, op=_MPI_OPS[op], root=root)
    return buf


def _mpi_broadcast(comm, buf, root):
    comm.Bcast(buf, root=root)
    return buf


_ALLREDUCE = {
    "ring": lambda comm, buf, op, k: ring.allreduce(comm, buf, op),
    "tree": lambda comm, buf, op, k: tree.allreduce(comm, buf, op),
    "naive": lambda comm, buf, op, k: naive.allreduce(comm, buf, op),
    "doubling": lambda comm, buf, op, k: doubling.allreduce(comm, buf, op),
    "rabenseifner": lambda comm, buf, op, k: doubling.rabenseifner(comm, buf, op),
    "hierarchical": lambda comm, buf, op, k: hierarchical.allreduce(comm, buf, op, k),
    "hierarchical_rs": lambda comm, buf, op, k: hierarchical.allreduce_rs(comm, buf, op, k),
    "mpi": lambda comm, buf, op, k: _mpi_allreduce(comm, buf, op),
}
_REDUCE = {"tree": tree.reduce, "naive": naive.reduce, "mpi": _mpi_reduce}
_BROADCAST = {"tree": tree.broadcast, "naive": naive.broadcast, "mpi": _mpi_broadcast}


def allreduce(comm, buf, op="sum", algorithm="auto", *, ranks_per_node=None):
    """Reduce ``buf`` over all ranks of ``comm`` in place with ``op``; every rank gets the result. Returns ``buf``.

    ``ranks_per_node`` emulates nodes of that many ranks for the hierarchical algorithms (default: real nodes).
    """
    p = comm.Get_size()

    def check():
        _checks.check_buffer(buf)
        _checks.check_choice("op", op, OPS)
        _checks.check_choice("algorithm", algorithm, ALGORITHMS)
        _check_nodes(algorithm, p, ranks_per_node)
        return costmodel.choose(buf.nbytes, p) if algorithm == "auto" else algorithm

    name = _begin(comm, "allreduce", buf, op, None, check, ranks_per_node)
    flat = buf.reshape(-1)
    if flat.size:
        if name.startswith("hierarchical"):  # make (or find) the node communicators outside the traced span
            hierarchical.topology(comm, ranks_per_node)
        with _traced(comm, f"allreduce/{name}", buf):
            _ALLREDUCE[name](comm, flat, op, ranks_per_node)
    return buf


def reduce(comm, buf, root=0, op="sum", algorithm="tree"):
    """Reduce every rank's ``buf`` into ``buf`` on ``root`` (other ranks' buffers may hold partial results)."""

    def check():
        _checks.check_buffer(buf)
        _checks.check_choice("op", op, OPS)
        _checks.check_choice("algorithm", algorithm, REDUCE_ALGORITHMS)
        _checks.check_root(root, comm.Get_size())
        return algorithm

    _begin(comm, "reduce", buf, op, root, check)
    flat = buf.reshape(-1)
    if flat.size:
        with _traced(comm, f"reduce/{algorithm}", buf):
            _REDUCE[algorithm](comm, flat, root, op)
    return buf


def broadcast(comm, buf, root=0, algorithm="tree"):
    """Copy ``buf`` from ``root`` into every rank's ``buf``. Returns ``buf``."""

    def check():
        _checks.check_buffer(buf)
        _checks.check_choice("algorithm", algorithm, REDUCE_ALGORITHMS)
        _checks.check_root(root, comm.Get_size())
        return algorithm

    _begin(comm, "broadcast", buf, None, root, check)
    flat = buf.reshape(-1)
    if flat.size:
        with _traced(comm, f"broadcast/{algorithm}", buf):
            _BROADCAST[algorithm](comm, flat, root)
    return buf


def reduce_scatter(comm, buf, op="sum", algorithm="ring"):
    """Reduce ``buf`` so that rank r owns chunk r (``chunk_bounds``) of the result; return it, a view of ``buf``.

    The rest of ``buf`` holds partial results afterwards. "rabenseifner" (recursive halving) needs p a power of 2.
    """
    p = comm.Get_size()

    def check():
        _checks.check_buffer(buf)
        _checks.check_choice("op", op, OPS)
        _checks.check_choice("algorithm", algorithm, REDUCE_SCATTER_ALGORITHMS)
        if algorithm == "rabenseifner":
            _power_of_two(algorithm, p)
        return algorithm

    _begin(comm, "reduce_scatter", buf, op, None, check)
    flat = buf.reshape(-1)
    if not flat.size:
        return flat
    with _traced(comm, f"reduce_scatter/{algorithm}", buf):
        if algorithm == "ring":
            return ring.reduce_scatter(comm, flat, op)
        return doubling.reduce_scatter(comm, flat, op)


def allgather(comm, buf, algorithm="ring"):
    """Rank r contributes chunk r of ``buf`` (``chunk_bounds``); afterwards all hold every chunk. Returns ``buf``.

    "doubling" (recursive doubling) needs p a power of 2.
    """
    p = comm.Get_size()

    def check():
        _checks.check_buffer(buf)
        _checks.check_choice("algorithm", algorithm, ALLGATHER_ALGORITHMS)
        if algorithm == "doubling":
            _power_of_two(algorithm, p)
        return algorithm

    _begin(comm, "allgather", buf, None, None, check)
    flat = buf.reshape(-1)
    if flat.size:
        with _traced(comm, f"allgather/{algorithm}", buf):
            (ring.allgather if algorithm == "ring" else doubling.allgather)(comm, flat)
    return buf

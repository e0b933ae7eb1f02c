"""Argument checks and the debug mode that turns a mismatched collective into an error instead of a hang.

**Checks.** Every public collective checks its arguments on each rank before sending anything: a buffer that is not
a C-contiguous writable array of a supported dtype, an unknown op or algorithm (the error lists the choices), a root
that is not a rank, an all-to-all buffer that does not cut into p equal chunks. When all ranks make the same
mistake, all ranks raise the same error and nothing hangs.

**Debug mode** catches what one rank cannot see alone: rank 0 passes 10 elements and rank 1 passes 11, or rank 2
calls ``broadcast`` while the others call ``allreduce``. Without it the ranks wait for messages that never come (or
worse, silently combine the wrong bytes). With ``DTRAIN_DEBUG=1`` in the environment, or ``set_debug(True)``, every
collective first gathers each rank's *signature*: (collective, algorithm, op, node layout, count, dtype, root,
sequence number of this call on this communicator, and any argument error). If they are not all equal, every rank
raises the same :class:`CollectiveMismatchError`, whose message lists every rank's signature. The price is one small
object all-gather per collective, which is why it is off by default. Calls are numbered only while debug mode is on
(so switch it on at the same point on every rank, as ``DTRAIN_DEBUG`` does).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

import numpy as np

from dtrain.comm.wrapper import innermost

DTYPES = ("float32", "float64")
FLOAT_TYPES = (np.float32, np.float64)
_ENV_VAR = "DTRAIN_DEBUG"

_debug = None  # None: follow the DTRAIN_DEBUG environment variable


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with different arguments (debug mode); ``signatures[r]`` is rank r's call."""

    def __init__(self, message: str, signatures: list):
        super().__init__(message)
        self.signatures = signatures


def set_debug(enabled: bool | None) -> None:
    """Switch debug mode on or off for this process (``None``: follow ``DTRAIN_DEBUG`` again)."""
    global _debug
    _debug = enabled


# Every collective asks whether debug mode is on. os.environ.get raises and catches a KeyError inside when the
# variable is unset (0.7 us, a fifth of the front door's whole cost); the dict os.environ keeps of its encoded names
# answers "unset" in 30 ns, and it is the same dict os.environ[...] = and monkeypatch.setenv write to.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(_ENV_VAR) if isinstance(_ENV_DATA, dict) else None


def debug_enabled() -> bool:
    if _debug is not None:
        return _debug
    if _ENV_KEY is not None and _ENV_KEY not in _ENV_DATA:
        return False
    return os.environ.get(_ENV_VAR, "") not in ("", "0")


def check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(map(str, choices))}")


def check_buffer(buf) -> None:
    """A C-contiguous, writable NumPy (or CuPy) array of a supported dtype, or an error that says what is wrong.

    (The front door first tests the common case inline: a NumPy array of a supported dtype whose flags say
    C-contiguous, aligned and writeable, ``flags.carray``. Only anything else comes here.)
    """
    if not (hasattr(buf, "dtype") and hasattr(buf, "flags") and hasattr(buf, "reshape")):
        raise TypeError(f"the buffer must be a NumPy (or CuPy) array, not {type(buf).__name__}")
    if buf.dtype.type not in FLOAT_TYPES:
        raise TypeError(f"unsupported dtype {buf.dtype}: collectives work on {' or '.join(DTYPES)} buffers")
    if not buf.flags.c_contiguous:
        raise ValueError(
            "the buffer is not C-contiguous (a strided slice or a transpose?): collectives send slices of one "
            "flat buffer; pass np.ascontiguousarray(buf) and copy the result back"
        )
    if not getattr(buf.flags, "writeable", True):  # (CuPy arrays are always writable and have no such flag)
        raise ValueError("the buffer is read-only: collectives write their result into it (pass a copy)")


def check_root(root, p: int) -> None:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < p:
        raise ValueError(f"root must be a rank of the communicator, an int in [0, {p}), got {root!r}")


def check_even_chunks(n: int, p: int, label: str) -> None:
    """``n`` elements cut into ``p`` chunks of equal size (all-to-all: what rank j sends to rank r, rank j's chunk r,
    lands in rank r's chunk j, so the two must be as long), or an error that says how to pad."""
    if n % p:
        raise ValueError(
            f"{label} needs a buffer that divides evenly into p = {p} chunks, and {n} elements do not "
            f"({n} % {p} = {n % p}): pad it to {-(-n // p) * p} elements"
        )


def check_ranks_per_node(ranks_per_node) -> None:
    if ranks_per_node is None:
        return
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}")


# Per-communicator call counters, per thread (simulated ranks are threads): id(comm) -> [weak reference, count].
# Communicators are not hashable; the weak reference tells a live one from a dead one whose id was reused. Only
# debug mode numbers calls, so this costs nothing otherwise.
_local = threading.local()


def next_sequence(comm) -> int:
    """How many collectives this rank has started on ``comm`` (in debug mode) before this one."""
    comm = innermost(comm)  # a wrapper and the communicator it wraps are one communicator: one count
    counters = _local.__dict__.setdefault("sequence", {})
    entry = counters.get(id(comm))
    if entry is None or entry[0]() is not comm:
        entry = counters[id(comm)] = [weakref.ref(comm), 0]
    count = entry[1]
    entry[1] = count + 1
    return count


def signature(collective, algorithm, op, buf, root, seq, error, ranks_per_node=None, topology=None) -> dict:
    """What this rank is about to do, in a form every rank can compare.

    ``ranks_per_node`` and ``topology`` describe the nodes of a hierarchical algorithm: the emulated node size, and
    whether a topology was handed in ("given") or is built for this call ("per call", a collective call itself).
    """
    return {
        "collective": collective,
        "algorithm": algorithm,
        "op": op,
        "ranks_per_node": ranks_per_node,
        "topology": topology,
        "count": int(getattr(buf, "size", -1)),
        "dtype": str(getattr(buf, "dtype", type(buf).__name__)),
        "root": root,
        "seq": seq,
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }


def agree(comm, mine: dict) -> None:
    """Gather every rank's signature; if they differ, raise the same CollectiveMismatchError on every rank.

    (If they agree, argument errors included, each rank goes on to raise its own argument error, if any.) The
    report names where each rank made its call, the one line of each rank's traceback that matters.
    """
    signatures = comm.allgather({**mine, "where": _call_site()})
    fields = [k for k in mine if k != "error"]
    if all(isinstance(s, dict) and all(s.get(k) == signatures[0].get(k) for k in mine) for s in signatures):
        return
    lines = ["the ranks are not making the same collective call (seq: calls made before on this communicator):"]
    for rank, sig in enumerate(signatures):
        if not isinstance(sig, dict):  # the rank is in some other object collective (a stray comm.allgather?)
            lines.append(f"  rank {rank}: not a collective's signature: {sig!r}")
            continue
        text = ", ".join(f"{k}={sig[k]!r}" for k in fields)
        lines.append(f"  rank {rank}: {text}  at {sig['where']}" + (f"  <- {sig['error']}" if sig["error"] else ""))
    dicts = [s for s in signatures if isinstance(s, dict)]
    bad = [k for k in fields if len({repr(s[k]) for s in dicts}) > 1]
    if bad:
        lines.append(f"  differing: {', '.join(bad)}")
    raise CollectiveMismatchError("\n".join(lines), signatures)


_INSIDE = tuple(os.path.join(os.path.dirname(os.path.dirname(__file__)), folder) for folder in ("collectives", "comm"))


def _call_site() -> str:
    """``file:line in function`` of the program's call: the first frame outside dtrain's collectives and comm."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"

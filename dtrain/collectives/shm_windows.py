"""The windows shm.py's collectives run on: a paradigm's buffers (zero copy) and each communicator's scratch.

:func:`buffer` puts an array in a new window on a communicator, whose ranks share one node: a paradigm's flat
gradients or weights, so that shm.py's collectives sum them where they lie. Any other buffer reaches a collective
through the communicator's *scratch* window (copy-in), which grows when a larger buffer comes. The windows are kept
per communicator (:func:`windows_of`, found again by address: :func:`place`) until :func:`release` frees them, which
every rank calls, before freeing the communicator; :func:`share_model` and :func:`unshare_model` move a model's flat
buffers into windows and back (nothing may point into a freed window). Every segment starts with ``HEADER`` bytes
where each call announces itself (shm.py compares them). :func:`check_one_node` asks once per communicator whether its
ranks share a node (a collective); :func:`real_node` says where "auto" may take shared memory (never simulated ranks).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dtrain.comm import windows
from dtrain.comm.names import COMM_TYPE_SHARED
from dtrain.comm.wrapper import innermost

HEADER = windows.ALIGN  # bytes at the start of every segment: the call's (number, collective, offset, count)


@dataclasses.dataclass
class Window:
    """A window on one communicator: a paradigm's buffer (``zero_copy``) or the scratch of the copy-in path."""

    shared: windows.SharedWindow
    comm: object  # the communicator it was allocated on (its ranks are the window's)
    zero_copy: bool
    calls: int = 0

    def segment(self, rank: int, dtype, offset: int, count: int) -> np.ndarray:
        return self.shared.view(rank, dtype, HEADER + offset, count)


_windows: dict[int, list] = {}  # id(the innermost communicator) -> [its Windows]
_nodes: dict[int, tuple] = {}  # id(the innermost communicator) -> (it, whether its ranks share one node)


def buffer(comm, count: int, dtype) -> np.ndarray:
    """A zeroed ``count``-element array of ``dtype`` in a new window on ``comm`` (a collective: every rank calls it
    with the same count): this rank's segment, which the others can read. Collectives on ``comm`` take it in place."""
    check_one_node(comm, "a shared buffer")
    window = _allocate(comm, count * np.dtype(dtype).itemsize, zero_copy=True)
    view = window.segment(window.shared.rank, dtype, 0, count)
    view[...] = 0
    return view


def holds(comm, array) -> bool:
    """Whether ``array`` lies in one of this rank's zero-copy windows on ``comm``."""
    return type(array) is np.ndarray and _find(comm, array) is not None


def release(comm) -> None:
    """Free every window on ``comm`` (a collective: every rank calls it, before freeing ``comm``)."""
    for window in _windows.pop(id(innermost(comm)), []):
        window.shared.free()


def share_model(comm, model, grads: bool = True) -> None:
    """``model``'s flat parameters (and gradients) moved into windows on ``comm`` (a collective): zero copy."""
    model.move_flat_params(buffer(comm, model.flat_params.size, model.flat_params.dtype))
    if grads:
        model.move_flat_grads(buffer(comm, model.flat_grads.size, model.flat_grads.dtype))


def unshare_model(comm, model) -> None:
    """Every flat buffer of ``model`` that lies in a window on ``comm`` moved back into this process's memory, then
    the windows freed (a collective): nothing may point into a freed window."""
    if holds(comm, model.flat_params):
        model.move_flat_params(model.flat_params.copy())
    if holds(comm, model.flat_grads):
        model.move_flat_grads(model.flat_grads.copy())
    release(comm)


def _allocate(comm, nbytes: int, zero_copy: bool) -> Window:
    window = Window(windows.allocate(comm, HEADER + nbytes), comm, zero_copy)
    _windows.setdefault(id(innermost(comm)), []).append(window)
    return window


def _find(comm, buf):
    """(the zero-copy window on ``comm`` that holds ``buf``, its byte offset there), or None."""
    rank, address = comm.Get_rank(), buf.__array_interface__["data"][0]
    for window in _windows.get(id(innermost(comm)), ()):
        if window.zero_copy:
            start = window.shared.segments[rank].__array_interface__["data"][0] + HEADER
            if start <= address and address + buf.nbytes <= start + window.shared.nbytes - HEADER:
                return window, address - start
    return None


def place(comm, buf):
    """Where ``buf``'s data lives in a window on ``comm``: (window, byte offset, whether it is copied in)."""
    found = _find(comm, buf)
    if found is not None:
        return (*found, False)
    scratch = next((w for w in _windows.get(id(innermost(comm)), ()) if not w.zero_copy), None)
    if scratch is None or scratch.shared.nbytes - HEADER < buf.nbytes:  # (every rank alike: the same nbytes)
        if scratch is not None:
            _windows[id(innermost(comm))].remove(scratch)
            scratch.shared.free()
        scratch = _allocate(comm, buf.nbytes, zero_copy=False)
    return scratch, 0, True


def check_one_node(comm, what: str = "--allreduce shm") -> None:
    """Every rank of ``comm`` shares one node's memory (asked once per communicator: a collective), else ValueError."""
    inner = innermost(comm)
    known = _nodes.get(id(inner))
    if known is None:
        simulated = hasattr(inner, "Allocate_shared")  # simulated ranks are threads of one process
        node = None if simulated else inner.Split_type(COMM_TYPE_SHARED, key=inner.Get_rank())
        known = _nodes[id(inner)] = (inner, simulated or node.Get_size() == inner.Get_size())
        if node is not None:
            node.Free()
    if not known[1]:
        raise ValueError(f"{what} needs every rank on one node; these ranks span several: use hierarchical_shm")


def real_node(comm) -> bool:
    """Whether ``comm``'s ranks are real processes (not simulated) sharing one node: where ``auto`` may pick shm."""
    inner = innermost(comm)
    if hasattr(inner, "Allocate_shared"):
        return False
    try:
        check_one_node(comm)
    except ValueError:
        return False
    return True

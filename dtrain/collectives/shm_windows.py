"""The windows shm.py's collectives run on: a paradigm's buffers (zero copy), each communicator's scratch (copy-in)
and its control block, where every call announces itself.

:func:`buffer` puts an array in a new window on a communicator whose ranks share one node: a paradigm's flat
gradients or weights, so that shm.py's collectives sum them where they lie. Any other buffer reaches a collective
through the communicator's *scratch* window (copy-in), which grows when a larger buffer comes. The windows are kept
per communicator, in the order they were made (the same on every rank), until :func:`release` frees them, which every
rank calls before freeing the communicator, or :func:`release_mine`, which the driver calls once the run is over
and nothing reads the buffers in them any more (a view into a freed window is a crash, not an error).

**Agree before acting.** Allocating or growing a window is a collective: a rank that did it alone while the others
waited in a fence would hang the job. So no rank allocates on its own during a call. Each writes its :class:`Call`
(call number, collective, zero copy or not, which window, offset, elements, item size, whether its buffer fits the
scratch) into its slot of the communicator's *control* window (:func:`announce`), and after the first fence every
rank reads every slot (:func:`agree`): different calls are a ValueError on every rank, and a scratch too small for
the call is grown by every rank together (:func:`grow`). :func:`check_one_node` asks once per communicator whether
its ranks share a node (a collective); :func:`real_node` says where "auto" may take shared memory (never on simulated
ranks).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

import numpy as np

from dtrain.comm import watchdog, windows
from dtrain.comm.names import COMM_TYPE_SHARED
from dtrain.comm.wrapper import innermost


@dataclasses.dataclass
class Window:
    """A window on one communicator: a paradigm's buffer (``zero_copy``) or the scratch of the copy-in path."""

    shared: windows.SharedWindow
    zero_copy: bool

    def segment(self, rank: int, dtype, offset: int, count: int) -> np.ndarray:
        return self.shared.view(rank, dtype, offset, count)


class Call(NamedTuple):
    """What a rank is about to do, written into the control window before fence 1 and compared after it."""

    number: int  # this communicator's shm calls so far, this one included
    collective: int  # shm.py's CODES
    op: int  # 0 sum, 1 avg, 2 max
    zero_copy: int  # 1: in a window of its own (``window``: its place in the list), 0: copied into the scratch
    window: int
    offset: int  # bytes from the start of the window's segment
    count: int
    itemsize: int
    fits: int  # copy-in: whether the buffer fits the scratch as it is (if not, every rank grows it after fence 1)

    def differs(self, other) -> bool:
        return self._replace(fits=0) != other._replace(fits=0)  # (whether it fits may differ: all then grow)

    def text(self, names: dict) -> str:
        where = f"window {self.window} at byte {self.offset}" if self.zero_copy else "a buffer of its own (copy-in)"
        what = f"{names.get(self.collective, self.collective)} ({OPS[self.op] if self.op < len(OPS) else self.op})"
        return f"(call {self.number}: {what} of {self.count} x {self.itemsize} bytes, {where})"


OPS = ("sum", "avg", "max")


@dataclasses.dataclass
class Communicator:
    """The shared-memory state of one communicator: its control window, its windows, its calls so far."""

    comm: object  # the innermost communicator, kept so that its id is not reused while this lives
    control: windows.SharedWindow
    owner: int  # the thread that made it (a rank: simulated ranks are threads of one process)
    barrier: windows.FlagBarrier | None  # the fences' barrier in the control window (None: simulated, comm.Barrier)
    windows: list = dataclasses.field(default_factory=list)
    calls: int = 0

    @property
    def scratch(self) -> Window | None:
        return next((w for w in self.windows if not w.zero_copy), None)


_state: dict[int, Communicator] = {}  # id(the innermost communicator) -> its state
_nodes: dict[int, tuple] = {}  # id(the innermost communicator) -> (it, whether its ranks share one node)


def fence(comm, shared: tuple, what: str) -> None:
    """A fence over ``comm``'s ranks for the windows ``shared`` (the control window first): in shared memory between
    processes (:class:`~dtrain.comm.windows.FlagBarrier`), with ``comm.Barrier`` between simulated ranks. ``what``
    names it for the watchdog."""
    barrier = state(comm).barrier
    watchdog.note(f"Barrier, {what}")
    if barrier is None:
        windows.fence(comm, shared)
    else:
        barrier.fence(shared, lambda q: watchdog.note(f"{what}: waiting for rank {q} (a counter in shared memory)"))


def state(comm) -> Communicator:
    """``comm``'s windows; its control window is made (a collective) by the first shm call or buffer on it."""
    inner = innermost(comm)
    found = _state.get(id(inner))
    if found is None:
        control = windows.allocate(comm, (len(Call._fields) + 1) * 8)  # (a call, then the barrier's counter)
        barrier = None if hasattr(inner, "Allocate_shared") else windows.FlagBarrier(control, len(Call._fields) * 8)
        found = _state[id(inner)] = Communicator(inner, control, threading.get_ident(), barrier)
    return found


# --- a paradigm's buffers, and freeing ---------------------------------------------------------------------------


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
    """Free every window on ``comm`` (a collective: every rank calls it, before freeing ``comm``); harmless twice."""
    _free(_state.pop(id(innermost(comm)), None))


def release_mine() -> None:
    """Free every window this rank made, on any communicator (a collective: every rank calls it, at the end of a
    run, in the same order: the order the windows were made in)."""
    me = threading.get_ident()
    for key in [key for key, found in _state.items() if found.owner == me]:
        _free(_state.pop(key))


def _free(found) -> None:
    if found is not None:
        for window in found.windows:
            window.shared.free()
        found.control.free()


def share_model(comm, model, grads: bool = True) -> None:
    """``model``'s flat parameters (and gradients) moved into windows on ``comm`` (a collective): zero copy."""
    model.move_flat_params(buffer(comm, model.flat_params.size, model.flat_params.dtype))
    if grads:
        model.move_flat_grads(buffer(comm, model.flat_grads.size, model.flat_grads.dtype))


def _allocate(comm, nbytes: int, zero_copy: bool) -> Window:
    window = Window(windows.allocate(comm, nbytes), zero_copy)
    state(comm).windows.append(window)
    return window


def _find(comm, buf):
    """(index of the zero-copy window on ``comm`` that holds ``buf``, the window, ``buf``'s byte offset), or None."""
    found = _state.get(id(innermost(comm)))
    if found is None:
        return None
    rank, address = comm.Get_rank(), buf.__array_interface__["data"][0]
    for index, window in enumerate(found.windows):
        if window.zero_copy:
            start = window.shared.segments[rank].__array_interface__["data"][0]
            if start <= address and address + buf.nbytes <= start + window.shared.nbytes:
                return index, window, address - start
    return None


# --- one call: announce, agree, grow -------------------------------------------------------------------------------


def announce(comm, buf, collective: int, op: int):
    """Before fence 1: this rank's :class:`Call`, written into its control slot. Returns (the call, the window its
    data is or will be copied in, or None when the scratch must grow first)."""
    here = state(comm)
    here.calls += 1
    found = _find(comm, buf)
    if found is not None:
        index, window, offset = found
        call = Call(here.calls, collective, op, 1, index, offset, buf.size, buf.itemsize, 1)
    else:
        window = here.scratch
        if window is not None and window.shared.nbytes < buf.nbytes:
            window = None
        call = Call(here.calls, collective, op, 0, -1, 0, buf.size, buf.itemsize, int(window is not None))
    here.control.view(comm.Get_rank(), np.int64, 0, len(call))[:] = call
    return call, window


def agree(comm, call: Call, label: str, names: dict) -> bool:
    """After fence 1: every rank's call read back; a ValueError on every rank if they differ. Returns whether the
    scratch is too small for this call on some rank (then every rank grows it now: :func:`grow`)."""
    here, r = state(comm), comm.Get_rank()
    calls = [Call(*map(int, here.control.view(q, np.int64, 0, len(call)))) for q in range(comm.Get_size())]
    for q, theirs in enumerate(calls):
        if theirs.differs(call):
            raise ValueError(
                f"{label}: rank {r} called {call.text(names)} but rank {q} called {theirs.text(names)}: every rank "
                "must make the same call, on the same place of the same window (or every rank on a buffer of its own)"
            )
    return not all(theirs.fits for theirs in calls)


def grow(comm, nbytes: int) -> Window:
    """Every rank together: the scratch replaced by one of ``nbytes`` (after :func:`agree` said so)."""
    here = state(comm)
    old = here.scratch
    if old is not None:
        here.windows.remove(old)
        old.shared.free()
    return _allocate(comm, nbytes, zero_copy=False)


# --- which ranks share a node ----------------------------------------------------------------------------------


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

"""Where a model-parallel rank's parameters live in the whole model's flat buffer, and how to gather that buffer.

Under tensor and pipeline parallelism (tensor_parallel.py, pipeline.py) no rank holds the whole model: it holds a
*local* model, whose own flat buffer (``local.flat_params``, as for any dtrain model) is made of parts of the whole
model's parameters. A :class:`Piece` records where one local parameter came from: the whole parameter's place in
the whole flat buffer, its shape, and the slices of it this rank holds::

    whole flat buffer  [ W0 (64 x 128) | b0 (128) | W1 (128 x 128) | b1 (128) | W2 (128 x 10) | b2 ]
    tp rank 1 of 2     W0[:, 64:128]     b0[64:128] W1[64:128, :]     b1 (all)   W2 (all)        b2 (all)
                       column-parallel              row-parallel                 replicated

:func:`take` copies a rank's pieces out of a whole buffer (building the local model from the seeded whole model, and
resuming from any paradigm's checkpoint); :func:`put` writes them back (gathering). :func:`gather` rebuilds the
whole buffer on every rank of a replica: an all-gather of the local buffers within the tensor group (each rank then
places every peer's pieces), then, with a pipeline, one broadcast per stage of its contiguous region of the buffer.
The same pieces serve the optimizer's buffers (momentum, Adam's moments), which follow the parameters' layout.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dtrain import collectives
from dtrain.backend import array_module, to_host
from dtrain.comm.trace import labelled


def split(layers: int) -> list[str]:
    """How ``layers`` consecutive Linear layers are split over a tensor group (tensor_parallel.py): column then row,
    in pairs; one left over is replicated."""
    return ["column", "row"] * (layers // 2) + ["replicated"] * (layers % 2)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One local parameter: ``whole[start : start + prod(shape)].reshape(shape)[index]``."""

    start: int
    shape: tuple
    index: tuple

    @property
    def size(self) -> int:
        return math.prod(len(range(*s.indices(n))) for s, n in zip(self.index, self.shape))

    @property
    def whole(self) -> bool:
        """True when this rank holds the whole parameter (a replicated one)."""
        return self.size == math.prod(self.shape)

    def view(self, flat):
        return flat[self.start : self.start + math.prod(self.shape)].reshape(self.shape)[self.index]


def pieces_of(full_model, layer_index: int, index: dict) -> list[Piece]:
    """The pieces of layer ``layer_index`` of ``full_model`` (an MLP) that ``index`` names: ``{"weight": (rows,
    cols), "bias": (cols,)}``, in the layer's parameter order."""
    pieces = []
    for name in ("weight", "bias"):
        where = full_model.param_slices[f"layers.{layer_index}.{name}"]
        shape = getattr(full_model.layers[layer_index], name).data.shape
        pieces.append(Piece(where.start, shape, index[name]))
    return pieces


def take(whole_flat, pieces, out) -> None:
    """Copy the ``pieces`` of ``whole_flat`` into the local flat buffer ``out``, one after another."""
    offset = 0
    for piece in pieces:
        out[offset : offset + piece.size] = piece.view(whole_flat).ravel()
        offset += piece.size
    if offset != out.size:
        raise ValueError(f"the pieces cover {offset} elements, the local buffer has {out.size}")


def put(local_flat, pieces, whole_flat) -> None:
    """Write the local flat buffer's ``pieces`` into their places in ``whole_flat`` (the inverse of :func:`take`)."""
    offset = 0
    for piece in pieces:
        piece.view(whole_flat)[...] = local_flat[offset : offset + piece.size].reshape(piece.view(whole_flat).shape)
        offset += piece.size


def gather(local_flat, total: int, tp_comm, peer_pieces, regions=(), pp_comm=None, label="checkpoint"):
    """The whole flat buffer (``total`` elements) on every rank of one replica, from each rank's ``local_flat``.

    ``peer_pieces[t]``: the pieces of tensor rank t (every rank of the tensor group holds a local buffer of the same
    size). ``regions``: with a pipeline, ``(owner, start, stop)`` for each stage: the pipeline rank ``owner`` holds
    ``whole[start:stop]`` once the tensor group has gathered, and broadcasts it over ``pp_comm``. The traffic is
    labelled ``label`` for the tracer (not training's).
    """
    xp, t = array_module(local_flat), tp_comm.Get_size()
    whole = xp.zeros(total, dtype=local_flat.dtype)
    m = local_flat.size
    with labelled(tp_comm, label):
        packed = xp.empty(t * m, dtype=local_flat.dtype)  # chunk r of an all-gather over t ranks: tensor rank r's
        packed[tp_comm.Get_rank() * m : (tp_comm.Get_rank() + 1) * m] = local_flat
        if t > 1:
            collectives.allgather(tp_comm, packed)
        for rank, pieces in enumerate(peer_pieces):
            put(packed[rank * m : (rank + 1) * m], pieces, whole)
        for owner, start, stop in regions:
            collectives.broadcast(pp_comm, whole[start:stop], root=owner)
    return whole


class Held:
    """What a rank holds of a whole model, as pieces (:class:`Piece`): its local ``model`` (flat buffers) and
    ``optimizer`` over it, and ``gather``, the collective that rebuilds a whole flat buffer from every rank's local
    one. The whole model's parameters, its optimizer's whole state and resuming from either come from here: a
    checkpoint of a sharded paradigm is the flat format every paradigm writes and reads."""

    def __init__(self, model, optimizer, pieces, gather):
        self.model, self.optimizer, self.pieces, self.gather = model, optimizer, pieces, gather

    def parameters(self):
        return self.gather(self.model.flat_params)

    def optimizer_state(self) -> dict:
        """As one optimizer over the whole flat buffer would hold it: every buffer gathered (numbers as they are)."""
        xp, state = array_module(self.model.flat_params), self.optimizer.state_dict()
        return {k: to_host(self.gather(xp.asarray(v))) if isinstance(v, np.ndarray) else v for k, v in state.items()}

    def load(self, flat, optimizer_state: dict) -> None:
        """This rank's pieces of a whole flat buffer and of a whole optimizer state."""
        take(flat, self.pieces, self.model.flat_params)
        local = {}
        for key, value in optimizer_state.items():
            if isinstance(value, np.ndarray):
                local[key] = np.empty(self.model.flat_params.size, dtype=value.dtype)
                take(value, self.pieces, local[key])
            else:
                local[key] = value
        self.optimizer.load_state_dict(local)

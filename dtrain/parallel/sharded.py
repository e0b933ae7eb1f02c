"""Sharded tensors: a rank's block of a tensor and its layout, computed with by the autograd engine, and the
collectives that the layout rules (layouts.py) call for, run over the mesh's axes and recorded.

A :class:`Sharded` holds an autograd :class:`~dtrain.autograd.Tensor` (this rank's block) and a
:class:`~dtrain.parallel.layouts.Layout`. Each op below (:meth:`Program.matmul`, :meth:`Program.bias_add`,
:meth:`Program.relu`, :meth:`Program.cross_entropy`) asks its rule for the operands' layouts, moves each
operand there (:meth:`Program.redistribute`: one autograd op per move, whose backward is the move's conjugate), and
computes on the local blocks. Backward runs through the same engine; the only bookkeeping it needs is the layout of
each gradient, which every op's backward writes on its operands (``grad_layout``) before their own backward runs
(the engine goes from the loss to the leaves, so a consumer always runs before its producer):

* an op gets its output's gradient whole (partial sums over an axis are all-reduced first: Megatron's f), except a
  move, which passes partial sums through (an all-gather's conjugate is then a reduce-scatter: FSDP's);
* a parameter's gradient may stay partial: the update phase makes it whole, all parameters with the same needs in
  one collective (spmd.py).

Every collective goes through :meth:`Program.collective`, which runs it on the axis's communicator with dtrain's
own algorithms (:mod:`dtrain.collectives`), labels its traffic for the tracer with ``where`` and records ``(kind,
axis, elements, phase, where)``. With no communicators (a *dry run*: ``Program(comms=None)``) it only makes arrays
of the right shapes: the same program, run once on one process, lists every decision, which is how ``--explain``
and ``costs()`` know them without a second derivation.
"""

from __future__ import annotations

import functools
import itertools

from dtrain import collectives
from dtrain.autograd import Tensor, softmax_cross_entropy
from dtrain.backend import array_module
from dtrain.comm.trace import labelled
from dtrain.parallel import layouts
from dtrain.parallel.layouts import Layout, Move


class Sharded:
    """This rank's block of a tensor of global ``shape``, laid out as ``layout``. An op makes its output's Sharded
    before its autograd tensor (``tensor`` None until then), because the op's backward needs the output's
    ``grad_layout``, which the next op writes there."""

    __slots__ = ("grad_layout", "layout", "name", "regather", "shape", "tensor")

    def __init__(self, tensor: Tensor | None, layout: Layout, shape, name: str):
        self.tensor, self.layout, self.shape, self.name = tensor, layout, tuple(shape), name
        self.grad_layout: Layout | None = None  # written by the op that uses it, in backward
        self.regather = None  # a parameter gathered for use: how to gather it again once released (FSDP)

    @property
    def data(self):
        if self.tensor.data is None:  # a gathered weight released after its use in forward: gathered again
            return self.regather()
        return self.tensor.data

    def release(self, regather) -> None:
        """Drop this block's array (a weight gathered for one matmul: FSDP's resharding); ``regather()`` makes it
        again when backward needs it."""
        self.tensor.data, self.regather = None, regather


def blocks_first(array, dim: int, p: int):
    """``array`` with dimension ``dim`` cut into ``p`` blocks, block b first: a new contiguous (p, ...) array whose
    chunk b (of the flat buffer) is block b, as the collectives cut buffers."""
    xp = array_module(array)
    shape = array.shape
    split = (*shape[:dim], p, shape[dim] // p, *shape[dim + 1 :])
    return xp.array(xp.moveaxis(array.reshape(split), dim, 0), order="C", copy=True)  # (a copy, even for dim 0)


def blocks_joined(blocks, dim: int):
    """The inverse of :func:`blocks_first`: a (p, ...) array of blocks put side by side along ``dim``."""
    xp = array_module(blocks)
    moved = xp.moveaxis(blocks, 0, dim)  # (..., p, n, ...)
    shape = moved.shape
    return xp.ascontiguousarray(moved.reshape((*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2 :])))


class Program:
    """The ops of a sharded program on one rank of a mesh: ``sizes`` (axis -> size), ``coordinates`` (axis -> this
    rank's), ``comms`` (axis -> communicator; None: a dry run). ``record`` lists the collectives, ``plan`` every op
    with its layouts, in the order they were made."""

    def __init__(self, sizes: dict, coordinates: dict, comms=None, algorithm: str = "auto"):
        self.sizes, self.coordinates, self.comms, self.algorithm = sizes, coordinates, comms, algorithm
        self.record: list[dict] = []
        self.plan: list[dict] = []
        self.phase = "forward"  # what the collectives made now are recorded as: forward, backward or update
        # a dry run's (shardings.dry_run): the mesh, what forward keeps for backward, this rank's parameters
        self.shape, self.activations, self.parameters = None, 0, 0

    def end_forward(self) -> None:
        """Forward is over: what follows is backward's."""
        self.phase = "backward"

    # --- collectives ----------------------------------------------------------------------------------------
    def collective(self, move: Move, array, where: str, spent: bool = False):
        """Make ``move`` on this rank's block ``array`` (an array of its own is returned); collectives are run on
        the axis's communicator and recorded. ``spent``: nobody reads ``array`` afterwards, so an all-reduce may sum
        into it (a partial sum once made whole, a gradient once passed on), as tp's g and f do."""
        xp, p = array_module(array), self.sizes[move.axis]
        if move.kind == "slice":
            mine = self.coordinates[move.axis]
            return xp.ascontiguousarray(blocks_first(array, move.dim, p)[mine])
        if move.kind == "scale":
            return array * (1.0 / p)
        comm = None if self.comms is None else self.comms[move.axis]
        if move.kind == "all-reduce":
            own = spent and array.flags.c_contiguous and array.base is None
            return self.allreduce(array if own else xp.array(array, copy=True, order="C"), move, where)
        if move.kind == "reduce-scatter":
            blocks = blocks_first(array, move.dim, p)
            if comm is not None:
                with labelled(comm, where):
                    collectives.reduce_scatter(comm, blocks, move.op)
            result = xp.ascontiguousarray(blocks[self.coordinates[move.axis]])
        elif move.kind == "all-gather":
            blocks = xp.empty((p, *array.shape), dtype=array.dtype)
            blocks[self.coordinates[move.axis]] = array
            if comm is not None:
                with labelled(comm, where):
                    collectives.allgather(comm, blocks)
            else:
                blocks[...] = array  # (a dry run: the right shape)
            result = blocks_joined(blocks, move.dim)
        elif move.kind == "all-to-all":
            blocks = blocks_first(array, move.to_dim, p)  # block j of the dimension it will split: for rank j
            if comm is not None:
                with labelled(comm, where):
                    collectives.alltoall(comm, blocks)
            result = blocks_joined(blocks, move.dim)  # block j now: rank j's rows of my block
        else:
            raise ValueError(f"no move {move.kind!r}")
        self._recorded(move, result, where)
        return result

    def allreduce(self, buf, move: Move, where: str):
        """``move`` (an all-reduce) in place on ``buf``, recorded."""
        comm = None if self.comms is None else self.comms[move.axis]
        if comm is not None:
            with labelled(comm, where):
                collectives.allreduce(comm, buf, move.op, self.algorithm)
        self._recorded(move, buf, where)
        return buf

    def _recorded(self, move: Move, result, where: str) -> None:
        """One collective of the list (metrics.json's collectives_per_step): its result's size on this rank."""
        if self.sizes[move.axis] > 1:
            self.record.append({"kind": move.kind, "axis": move.axis, "elements": int(result.size),
                                "phase": self.phase, "where": where})  # fmt: skip

    def update(self, flat, slices: dict, groups) -> None:
        """The update phase: the parameters' gradients made whole in place in ``flat`` (the local flat gradient
        buffer; ``slices``: each parameter's), one collective per move for each group of parameters that needs the
        same moves (``groups``: shardings.update_moves): one buffer when they lie side by side, else packed."""
        self.phase = "update"
        for steps, names in groups:
            parts = [slices[name] for name in names]
            together = all(a.stop == b.start for a, b in itertools.pairwise(parts))
            buf = flat[parts[0].start : parts[-1].stop] if together else array_module(flat).concatenate(
                [flat[part] for part in parts])  # fmt: skip
            where = "update: " + " ".join(names)
            for move in steps:
                if move.kind == "all-reduce":
                    self.allreduce(buf, move, where)
                elif move.kind == "scale":  # a gradient unaveraged over an axis no sum crossed: the mean, locally
                    buf *= 1.0 / self.sizes[move.axis]
                else:
                    raise ValueError(f"the update makes gradients whole in place: no {move.kind}")
            if not together:
                offset = 0
                for part in parts:
                    flat[part] = buf[offset : offset + part.stop - part.start]
                    offset += part.stop - part.start

    def redistribute(self, x: Sharded, target: Layout, where: str) -> Sharded:
        """``x`` moved to ``target``'s dims (whole), one autograd op per move; each move's backward is its conjugate,
        made on the gradient in the layout the op after it left there."""
        label = f"{where} ({x.name})"  # (where in the graph, and which tensor moves)
        for move in layouts.moves(x.layout, target):
            x = self._move(x, move, label)
        return x

    def _move(self, x: Sharded, move: Move, where: str) -> Sharded:
        out = Sharded(None, move.after(x.layout), x.shape, x.name)

        def backward(grad):
            back = move.conjugate(out.grad_layout)
            x.grad_layout = out.grad_layout if back is None else back.after(out.grad_layout)
            return (grad if back is None else self.collective(back, grad, where, spent=True),)

        spent = move.kind == "all-reduce"  # (a partial sum is read by nothing but the move that makes it whole)
        out.tensor = Tensor._make(self.collective(move, x.data, where, spent), (x.tensor,), backward)
        return out

    def whole_gradient(self, out: Sharded, grad, where: str):
        """The gradient of ``out`` made whole (an op that is not a move needs it so), and its layout."""
        layout = out.grad_layout if out.grad_layout is not None else out.layout.whole
        for move in layouts.made_whole(layout):
            grad = self.collective(move, grad, where, spent=True)
            layout = move.after(layout)
        return grad, layout

    # --- the ops --------------------------------------------------------------------------------------------
    def note(self, op: str, where: str, inputs, output: Sharded, case: str = "") -> None:
        self.plan.append({"op": op, "where": where, "case": case, "output": f"{output.name}{output.layout}",
                          "inputs": [f"{x.name}{x.layout}" for x in inputs]})  # fmt: skip

    def matmul(self, a: Sharded, b: Sharded, where: str, name: str, reshard: bool = False) -> Sharded:
        """``a @ b`` by the matmul rule. ``reshard``: b (a parameter), if gathered here, is released as soon as it
        has been used and gathered again in backward if backward needs it, as FSDP and ZeRO-3 do."""
        la, lb, lout, case = layouts.matmul(a.layout, b.layout)
        a2, b2 = self.redistribute(a, la, where), self.redistribute(b, lb, where)
        out = Sharded(None, lout, (a.shape[0], b.shape[1]), name)

        def backward(grad):
            grad, layout = self.whole_gradient(out, grad, where)
            rows, cols = a2.layout.dims[0], b2.layout.dims[1]
            ga = gb = None
            if a2.tensor.requires_grad:  # dA = dC B^T: a sum over C's columns
                ga = grad @ b2.data.T
                a2.grad_layout = self._contracted(a2.layout, layout, cols)
            if b2.tensor.requires_grad:  # dB = A^T dC: a sum over C's rows
                gb = a2.data.T @ grad
                b2.grad_layout = self._contracted(b2.layout, layout, rows)
            return gb, ga

        # (B first among the parents: the engine then runs B's moves' backward right after this op's, so a weight
        # gathered here has its gradient reduce-scattered layer by layer, as FSDP frees it, not at backward's end)
        out.tensor = Tensor._make(a2.data @ b2.data, (b2.tensor, a2.tensor), backward)
        self.note("matmul", where, (a, b), out, case)
        self.plan[-1]["local"] = (*a2.data.shape, b2.data.shape[1])  # (m, k, n) this rank multiplies
        if b2 is not b and reshard:
            b2.release(lambda: self.gather_again(b, lb, where))
        return out

    def gather_again(self, param: Sharded, target: Layout, where: str):
        """``param`` gathered again (backward's gather of a released parameter)."""
        data = param.data
        for move in layouts.moves(param.layout, target):
            data = self.collective(move, data, f"{where} ({param.name})")  # (as redistribute labels it)
        return data

    @staticmethod
    @functools.cache  # (pure, and asked again every step: remembered)
    def _contracted(operand: Layout, grad: Layout, axis) -> Layout:
        """The layout of an operand's gradient: the operand's dims, partial over ``axis`` (the contracted dimension's,
        a mean where the gradient is unaveraged over it), unaveraged as the gradient is, but over that axis."""
        if axis is None:
            return Layout(operand.dims, (), grad.unaveraged)
        rest = tuple(a for a in grad.unaveraged if a != axis)
        return Layout(operand.dims, (), rest).plus_partial(axis, layouts.reduction_op(axis, grad.unaveraged))

    def bias_add(self, h: Sharded, b: Sharded, where: str, name: str) -> Sharded:
        lh, lb, lout = layouts.bias_add(h.layout, b.layout)
        h2, b2 = self.redistribute(h, lh, where), self.redistribute(b, lb, where)
        out = Sharded(None, lout, h.shape, name)

        def backward(grad):
            grad, layout = self.whole_gradient(out, grad, where)
            h2.grad_layout = layout
            if b2.tensor.requires_grad:
                b2.grad_layout = self._contracted(b2.layout, layout, layout.dims[0])
            return grad, (grad.sum(axis=0) if b2.tensor.requires_grad else None)

        out.tensor = Tensor._make(h2.data + b2.data, (h2.tensor, b2.tensor), backward)
        self.note("bias add", where, (h, b), out)
        return out

    def relu(self, x: Sharded, where: str, name: str) -> Sharded:
        """``max(x, 0)`` elementwise, on a whole ``x`` (a partial sum is made first: relu of a sum is not the sum of
        relus); its gradient, made whole first too, is masked where x was not positive."""
        lx, lout = layouts.elementwise(x.layout)
        x2 = self.redistribute(x, lx, where)
        data = x2.data
        out = Sharded(None, lout, x.shape, name)

        def backward(grad):
            grad, layout = self.whole_gradient(out, grad, where)
            x2.grad_layout = layout
            return (grad * (data > 0),)

        out.tensor = Tensor._make(array_module(data).maximum(data, 0), (x2.tensor,), backward)
        self.note("relu", where, (x,), out)
        return out

    def cross_entropy(self, logits: Sharded, labels, labels_axis, where: str) -> Sharded:
        """The mean cross-entropy of ``labels`` (this rank's rows: those of ``labels_axis``, as the input's)."""
        lz, lloss = layouts.cross_entropy(logits.layout, logits.shape[0], self.sizes)
        z = self.redistribute(logits, lz, where)
        rows_axis = lz.dims[0]
        if rows_axis != labels_axis:  # whole labels (and rows), whose rows the all-to-all split: this rank's block
            assert labels_axis is None, "the rules never gather a batch's rows"
            labels = blocks_first(labels, 0, self.sizes[rows_axis])[self.coordinates[rows_axis]]
        out = Sharded(softmax_cross_entropy(z.tensor, labels), lloss, (), "loss")
        # backward starts from each rank's own mean over its rows: a gradient unaveraged over their axis
        z.grad_layout = Layout(z.layout.dims, (), () if rows_axis is None else (rows_axis,))
        self.note("cross-entropy", where, (logits,), out)
        return out

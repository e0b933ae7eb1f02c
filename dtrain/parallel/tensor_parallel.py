"""Tensor parallelism (Megatron-LM): every layer's matrices are split over T ranks, which compute one layer together.

**The derivation.** A Linear layer computes ``Y = X A`` (X: m x k activations, A: k x n weights). Split A by
*columns* over T ranks, ``A = [A_1 | ... | A_T]``: then ``Y = [X A_1 | ... | X A_T]``, so rank t computes its block
of columns ``Y_t = X A_t`` from the whole X, sending nothing. An elementwise activation keeps the blocks apart,
``relu(Y) = [relu(Y_1) | ... | relu(Y_T)]``. Split the next layer's B by *rows*, ``B = [B_1; ...; B_T]``: then
``Z = relu(Y) B = sum_t relu(Y_t) B_t``, each term computed on its own rank from what it already holds, and one
all-reduce of the partial products gives every rank Z::

              column-parallel A (k x n/T each)         row-parallel B (n/T x o each)
    X ──f──┬── X A_1 ── relu ── Y_1 ──────────────── Y_1 B_1 ──┐
      (m x k)   ...                                             ├── g ── + b ── Z  (m x o, on every rank)
           └── X A_T ── relu ── Y_T ──────────────── Y_T B_T ──┘  (all-reduce: the sum of T partial products)

Backward runs the same picture from right to left. dZ is on every rank; ``dB_t = Y_t^T dZ`` and ``dY_t = dZ B_t^T``
are local, so is ``dA_t = X^T dY_t``; but ``dX = sum_t dY_t A_t^T`` is again a sum of T partial products: one
all-reduce. So a column-then-row block needs **exactly one all-reduce forward and one backward**, made by two
conjugate operators:

    f:  forward the identity (X goes to every rank as it is),  backward an all-reduce of the gradient (dX)
    g:  forward an all-reduce (the partial products),          backward the identity (dZ is already everywhere)

Each is an autograd op of its own (:func:`f`, :func:`g`). The column layer's bias splits with its columns; the row
layer's bias is added *once*, after g (T copies added before the sum would count it T times), so every rank holds
it whole and computes the same gradient for it. The first block's f never all-reduces: its input is the data batch,
which needs no gradient (the autograd skips it).

**This MLP.** Linear layers are paired in order, column then row; a layer left over at the end (the 10-way output
layer after two hidden layers) is **replicated**: every rank of the group holds it whole and computes the same thing
(it is small, and splitting it would need an all-reduce or a gather of the logits for nothing). A column layer's
width must divide by T (``--hidden`` 127 on ``--tp 2`` is refused with a clear error); Megatron refuses too, and
unequal shards would make the slowest rank set the pace. Every rank starts from slices of the same seeded whole
matrices (:mod:`~dtrain.parallel.placement`), so ``tp`` follows ``single`` step for step; only the order of the sums
in g and f differs (~1e-16 per step in float64). The whole model is gathered for the weights digest and checkpoints.

**Cost per step** (b bytes per number; T tensor ranks; micro-batches of m = B / (D a) samples, D = dp replicas,
a = ``--accumulate``; block j maps width i_j -> h_j -> o_j; n_T = this rank's parameters; ring all-reduce)::

    tensor group   a * sum_j [ 2 (T-1)/T m o_j b  (g, forward)  +  2 (T-1)/T m i_j b  (f, backward; not block 1) ]
    dp group       2 (D-1)/D n_T b                 (the local gradients, once per step)
    memory         n_T = sum_j (i_j h_j + h_j + h_j o_j) / T + o_j  (+ replicated layers whole):  about 1/T of a replica

Tensor parallelism pays in activations sent (proportional to the batch) for parameters saved (proportional to the
model), on every layer, on the critical path: so it lives inside one node, on the fastest links. Exact figures per
rank: :meth:`TensorParallel.costs` (the cost model's bytes for whatever ``--allreduce`` picks at each size).
"""

from __future__ import annotations

from dtrain import collectives, terminal
from dtrain.autograd import Tensor
from dtrain.backend import array_module, itemsize
from dtrain.comm.trace import labelled
from dtrain.errors import ConfigError
from dtrain.nn import Linear, Module, Parameter, Sequential
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import register, stages
from dtrain.parallel.flags import ALLREDUCE
from dtrain.parallel.grid import DP, TP
from dtrain.parallel.model_parallel import ModelParallel
from dtrain.parallel.placement import pieces_of, split
from dtrain.parallel.pricing import activation_elements, activations_sent, group_allreduce_bytes, local_parameters

KINDS = ("column", "row", "replicated")
F_LABEL, G_LABEL = "tp/f-backward", "tp/g-forward"  # the tracer's labels for the two operators' all-reduces


class TensorGroup:
    """The ranks that split each layer: their communicator, and the all-reduce they share (``--allreduce``)."""

    def __init__(self, comm, algorithm: str = "auto"):
        self.comm, self.algorithm = comm, algorithm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allreduce(self, array, label: str):
        """Sum ``array`` (C-contiguous, this rank's own) over the group in place, traffic labelled ``label``."""
        if self.size == 1:
            return array
        with labelled(self.comm, label):
            return collectives.allreduce(self.comm, array, "sum", self.algorithm)


def f(x: Tensor, group: TensorGroup) -> Tensor:
    """Identity forward; backward, the all-reduce (sum) of the gradient over the group: ``dX = sum_t dX_t``."""
    return Tensor._make(x.data, (x,), lambda grad: (group.allreduce(array_module(grad).array(grad), F_LABEL),))


def g(x: Tensor, group: TensorGroup) -> Tensor:
    """Forward, the all-reduce (sum) of this rank's partial product over the group; backward the identity."""
    return Tensor._make(group.allreduce(x.data, G_LABEL), (x,), lambda grad: (grad,))


class _Sliced(Module):
    """This rank's part of Linear layer ``index`` of the whole model: ``self.index`` names the slices it holds."""

    kind = "replicated"

    def __init__(self, whole, index: int, group: TensorGroup):
        layer = whole.layers[index]
        self.in_features, self.out_features, self.group = layer.in_features, layer.out_features, group
        rows, cols = self.slices(layer.in_features, layer.out_features, group.rank, group.size)
        self.index = {"weight": (rows, cols), "bias": (cols if self.kind == "column" else slice(None),)}
        # (sliced where the whole layer lives: a GPU model's slices stay on the GPU, used as they are or flattened)
        self.weight = Parameter(layer.weight.data[rows, cols].copy(), "weight")
        self.bias = Parameter(layer.bias.data[self.index["bias"]].copy(), "bias")
        self.pieces = pieces_of(whole, index, self.index)  # where they live in the whole flat buffer

    @staticmethod
    def slices(n_in, n_out, rank, size):
        return slice(None), slice(None)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias

    def __repr__(self):
        shape = "x".join(map(str, self.weight.data.shape))
        return f"{type(self).__name__}({self.in_features}, {self.out_features}; holds {shape})"


class ColumnParallelLinear(_Sliced):
    """Holds columns [t n/T, (t+1) n/T) of the weight and of the bias; its output is that block of columns."""

    kind = "column"

    @staticmethod
    def slices(n_in, n_out, rank, size):
        width = n_out // size
        return slice(None), slice(rank * width, (rank + 1) * width)

    def forward(self, x: Tensor) -> Tensor:
        return f(x, self.group) @ self.weight + self.bias


class RowParallelLinear(_Sliced):
    """Holds rows [t k/T, (t+1) k/T) of the weight (its input is that block of columns) and the whole bias."""

    kind = "row"

    @staticmethod
    def slices(n_in, n_out, rank, size):
        height = n_in // size
        return slice(rank * height, (rank + 1) * height), slice(None)

    def forward(self, x: Tensor) -> Tensor:
        return g(x @ self.weight, self.group) + self.bias


LAYERS = {"column": ColumnParallelLinear, "row": RowParallelLinear, "replicated": _Sliced}


def check_splittable(sizes, tp: int, first: int = 0, stop: int | None = None) -> None:
    """A ConfigError unless ``tp`` divides the width between each column/row pair of Linear layers [first, stop)."""
    stop = len(sizes) - 1 if stop is None else stop
    for offset, kind in enumerate(split(stop - first)):
        layer = first + offset
        if kind == "column" and sizes[layer + 1] % tp:
            raise ConfigError(
                f"--tp {tp} does not divide the width {sizes[layer + 1]} between layers {layer} and {layer + 1} (split "
                f"by columns, then by rows): choose a --tp that divides it, or --hidden widths divisible by {tp}"
            )


def shard(whole, first: int, stop: int, group: TensorGroup) -> tuple[list[Module], list]:
    """This rank's part of Linear layers [first, stop) of ``whole`` (an MLP), with the activations after them, and
    its pieces of the whole flat buffer (in the modules' parameter order). A width the group does not divide is a
    ConfigError (its last columns would be dropped)."""
    check_splittable(whole.sizes, group.size, first, stop)
    linear = [i for i, layer in enumerate(whole.layers) if isinstance(layer, Linear)]
    modules = []
    for number, kind in zip(range(first, stop), split(stop - first)):
        position = linear[number]
        modules.append(LAYERS[kind](whole, position, group))
        after = whole.layers[position + 1 : linear[number + 1] if number + 1 < len(linear) else None]
        modules.extend(after)  # the activation (no parameters: shared with the whole model, harmlessly)
    return modules, [piece for module in modules for piece in getattr(module, "pieces", ())]


def flattened(modules, whole) -> Sequential:
    """``modules`` as one local model whose parameters live in flat buffers of their own, like ``whole``'s."""
    local = Sequential(modules)
    local.flatten_(xp=array_module(whole.flat_params), dtype=whole.flat_params.dtype)
    return local


@register
class TensorParallel(ModelParallel):
    name = "tp"
    summary = "tensor parallel: pairs of Linear layers split by columns, then rows, over --tp ranks"
    order = 7  # where it comes in listings (--help, the planner): the course teaches it then
    flags = (DP, TP, ALLREDUCE)
    fill = "tp"

    @classmethod
    def check(cls, config, world: int) -> None:
        super().check(config, world)
        shape = cls.shape_of(config, world)
        if shape.tp > 1 and not config.hidden:
            raise ConfigError(f"--tp {shape.tp} splits pairs of Linear layers (by columns, then by rows), but a model "
                              "with no hidden layer (--hidden none) has one: give it a hidden layer")  # fmt: skip
        check_splittable([1, *config.hidden, 1], shape.tp)  # the hidden widths decide (the data's widths never split)

    def build(self, make_model, make_optimizer) -> None:
        whole = make_model()  # the whole model, from the seed: identical on every rank (then dropped)
        self.group = TensorGroup(self.grid.tp_comm, self.config.allreduce)
        modules, pieces = shard(whole, 0, len(whole.sizes) - 1, self.group)
        self.sizes = list(whole.sizes)
        self.adopt(flattened(modules, whole), pieces, whole.flat_params.size, make_optimizer)
        if self.rank == 0 and not self.config.quiet:
            print(terminal.wrapped(self.describe()), flush=True)

    def describe(self) -> str:
        """How each Linear layer is split over the tensor group, and what one rank holds of it."""
        t, lines = self.shape.tp, [f"tensor parallel over {self.shape.tp} rank(s): each rank holds"]
        for j, kind in enumerate(split(len(self.sizes) - 1)):
            rows, cols = self.sizes[j], self.sizes[j + 1]
            part = {"column": f"{cols // t} of its {cols} columns", "row": f"{rows // t} of its {rows} rows, the bias "
                    "whole", "replicated": "all of it"}[kind]  # fmt: skip
            lines.append(f"  layer {j} ({rows} -> {cols}), {kind}: {part}")
        return "\n".join(lines)

    def finish(self) -> dict:
        return {**super().finish(), "layers": split(len(self.sizes) - 1)}

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per rank (lists): bytes sent per step (tensor group and dp group) and the bytes it holds of each kind."""
        shape, b = cls.shape_of(config, world), itemsize(config.dtype)
        rows = config.batch_size // (shape.dp * config.accumulate)
        forward, backward = activations_sent(sizes, 0, len(sizes) - 1, rows)
        n = local_parameters(sizes, shape.tp)
        buffers = buffers_per_parameter(config.optimizer, config.momentum)
        sent = []
        for rank in range(world):
            at = shape.coordinates(rank)
            tensor = group_allreduce_bytes(config.allreduce, forward + backward, b, shape.tp, at["tp"])
            data = group_allreduce_bytes(config.allreduce, [n], b, shape.dp, at["dp"])
            sent.append(config.accumulate * tensor + data)
        return {"sent_per_step": sent, "parameters": n * b, "gradients": n * b, "optimizer": buffers * n * b}

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        return [(f"tp{t}" + (f" x dp{world // t}" if t < world else ""), {"tp": t, "dp": world // t}, world)
                for t in range(2, world + 1) if world % t == 0]  # fmt: skip

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """A pipeline's of one stage (:func:`stages.step_time`): the --accumulate micro-batches through the whole
        model, the tensor group's all-reduces in each, the dp all-reduce and the update."""
        shape = cls.shape_of(config, world)
        return stages.step_time(sizes, world, shape, "gpipe", config.accumulate, 1, config, hardware)

    @classmethod
    def activations(cls, sizes, world: int, config) -> int:
        rows = config.batch_size // (cls.shape_of(config, world).dp * config.accumulate)
        tp = cls.shape_of(config, world).tp
        return activation_elements(sizes, 0, len(sizes) - 1, rows, tp) * itemsize(config.dtype)

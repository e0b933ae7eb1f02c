"""Layouts: how each tensor is split over a device mesh, and the rules that derive the communication from them.

**The notation** (GSPMD's, JAX's ``PartitionSpec``, "How to Scale Your Model"'s): ``A[I_x, J]`` is a matrix whose
rows are split over mesh axis ``x`` and whose columns every rank holds whole. On ``--mesh x=2,y=2`` a rank holds
``A[I_x, J_y]`` as a block of I/2 x J/2; a dimension its axis does not divide is refused. A layout is one entry per
dimension, an axis or ``_`` (replicated), written as the command line takes it: ``x,_`` or ``_,y``. One more state:
a **partial sum** over an axis, ``[_,_] partial(y)``: every rank of a y group holds a matrix of the full shape, and
the tensor is their *sum* (what multiplying two blocks of a split contracting dimension leaves). A gradient may also
be **unaveraged** over an axis: each rank computed it from the mean loss of its own rows (ddp's convention), so it is
|axis| times its share until a sum over that axis becomes a mean (an all-reduce "avg", as ddp's is).

**The rules** say, for one op, what layout each operand must have and what the output then has; what it takes to
get an operand there is a **redistribution** (:func:`moves`), the least communication between two layouts::

    partial(a)       -> replicated           all-reduce over a
    partial(a)       -> dimension d over a   reduce-scatter over a (the sum, each rank keeping its block)
    d over a         -> replicated           all-gather over a
    d over a         -> d2 over a            all-to-all over a (every rank sends each peer the block it will own)
    replicated       -> d over a             a local slice: nothing sent

``C[I, K] = A[I, J] @ B[J, K]``, with J the contracting dimension, has four cases::

    1  J whole in both                      A[I_x, J] B[J, K_y] -> C[I_x, K_y]      nothing sent
    2  J split in one operand               A[I, J_x] B[J, K]   -> all-gather A over x first, then case 1 (the
                                                                   other way, slicing B's rows locally into case 3
                                                                   and a partial sum, can send less: GSPMD weighs
                                                                   both; this rule always gathers)
    3  J split over the same axis in both   A[I, J_x] B[J_x, K] -> C[I, K] partial(x): each rank multiplies its
                                                                   blocks; the sum is made when it is needed
    4  one axis would split both of C's     A[I_x, J] B[J, K_x] -> all-gather B over x first (C[I_x, K_x] cannot be)
       dimensions

A bias added to rows, an elementwise activation and the loss need whole values (a partial sum is made whole, as
Megatron's g does); the bias takes the rows' column layout (gathered if split otherwise, sliced if whole); the loss
needs each row's classes on one rank. Everything here is arithmetic on layouts: no arrays, no ranks.
"""

from __future__ import annotations

import dataclasses
import functools

from dtrain.errors import ConfigError

REPLICATED = "_"
KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
)  # the collectives; "slice" and "scale" send nothing


@dataclasses.dataclass(frozen=True)
class Layout:
    """For every dimension, the mesh axis that splits it (None: whole on every rank); ``partial``: ((axis, op), ...)
    the tensor is a sum ("sum") or mean ("avg") over; ``unaveraged``: gradients only (see the module's docstring)."""

    dims: tuple
    partial: tuple = ()
    unaveraged: tuple = ()

    @property
    def whole(self) -> Layout:
        """This layout with every partial sum made (the dims unchanged)."""
        return Layout(self.dims, (), self.unaveraged)

    def split(self, dim: int, axis) -> Layout:
        dims = list(self.dims)
        dims[dim] = axis
        return dataclasses.replace(self, dims=tuple(dims))

    def without_partial(self, axis: str) -> Layout:
        return dataclasses.replace(self, partial=tuple(p for p in self.partial if p[0] != axis))

    def plus_partial(self, axis, op: str) -> Layout:
        if axis is None:
            return self
        return dataclasses.replace(self, partial=tuple(sorted({*self.partial, (axis, op)})))

    def local_shape(self, shape, sizes: dict) -> tuple:
        """The block of a tensor of global ``shape`` one rank holds (``sizes``: the mesh's axis sizes)."""
        return tuple(n if a is None else n // sizes[a] for n, a in zip(shape, self.dims))

    def block(self, shape, sizes: dict, coordinates: dict) -> tuple:
        """The slices of a tensor of global ``shape`` that the rank at ``coordinates`` holds."""
        return tuple(slice(None) if a is None else slice(coordinates[a] * (n // sizes[a]),
                     (coordinates[a] + 1) * (n // sizes[a])) for n, a in zip(shape, self.dims))  # fmt: skip

    def __str__(self) -> str:
        return self.text

    @functools.cached_property
    def text(self) -> str:  # (made once: the program notes every op's layouts, every step)
        text = "[" + ",".join(REPLICATED if a is None else a for a in self.dims) + "]"
        for axis, op in self.partial:
            text += f" partial {op}({axis})"
        return text


def spec(dims) -> str:
    """The command line's words for ``dims``: ``x,_``."""
    return ",".join(REPLICATED if a is None else a for a in dims)


def replicated(ndim: int) -> Layout:
    return Layout((None,) * ndim)


def parse(tensor: str, text: str, ndim: int, axes) -> Layout:
    """``--shard TENSOR=SPEC``'s SPEC for a tensor of ``ndim`` dimensions on a mesh with ``axes``, or a ConfigError."""
    entries = [part.strip() for part in text.split(",")]
    if len(entries) != ndim:
        raise ConfigError(f"--shard {tensor}={text}: {tensor} has {ndim} dimension(s), so the spec needs {ndim} "
                          f"entr{'y' if ndim == 1 else 'ies'} (an axis or {REPLICATED}), e.g. {tensor}="
                          f"{spec((None,) * ndim)}")  # fmt: skip
    dims = tuple(None if e == REPLICATED else e for e in entries)
    for axis in dims:
        if axis is not None and axis not in axes:
            raise ConfigError(f"--shard {tensor}={text}: the mesh has no axis {axis!r} (its axes: "
                              f"{', '.join(axes)}; {REPLICATED} for a dimension kept whole)")  # fmt: skip
    used = [a for a in dims if a is not None]
    if len(set(used)) < len(used):
        twice = next(a for a in used if used.count(a) > 1)
        raise ConfigError(f"--shard {tensor}={text}: axis {twice} splits two dimensions of one tensor; a rank's block "
                          "would then be no block at all: use each axis once per tensor")  # fmt: skip
    return Layout(dims)


def check_divides(tensor: str, shape, layout: Layout, sizes: dict, what: str = "") -> None:
    """A ConfigError unless every split dimension of a tensor of ``shape`` divides by its axis's size."""
    for d, (n, axis) in enumerate(zip(shape, layout.dims)):
        if axis is not None and n % sizes[axis]:
            raise ConfigError(f"{tensor} laid out as [{spec(layout.dims)}]: its dimension {d} ({n}{what}) does not "
                              f"divide by the {sizes[axis]} ranks of axis {axis}: ranks would hold unequal blocks; "
                              "choose another layout or sizes that divide")  # fmt: skip


def reduction_op(axis, unaveraged) -> str:
    """The op that makes a partial sum over ``axis`` whole: a mean when the values are unaveraged over it."""
    return "avg" if axis in unaveraged else "sum"


# --- redistribution: the least communication between two layouts -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Move:
    """One step of a redistribution: ``kind`` over ``axis``; ``dim`` the dimension gathered, scattered or sliced
    (all-to-all: the one it leaves, ``to_dim`` the one it splits); ``op`` a reduction's."""

    kind: str
    axis: str
    dim: int | None = None
    to_dim: int | None = None
    op: str = "sum"

    def after(self, layout: Layout) -> Layout:
        """The layout a tensor has once this move is made."""
        if self.kind == "all-reduce":
            return layout.without_partial(self.axis)
        if self.kind == "reduce-scatter":
            return layout.without_partial(self.axis).split(self.dim, self.axis)
        if self.kind == "all-gather":
            return layout.split(self.dim, None)
        if self.kind == "all-to-all":
            return layout.split(self.dim, None).split(self.to_dim, self.axis)
        if self.kind == "slice":
            return layout.split(self.dim, self.axis)
        if self.kind == "scale":  # a gradient unaveraged over axis, divided by its size locally
            return dataclasses.replace(layout, unaveraged=tuple(a for a in layout.unaveraged if a != self.axis))
        raise ValueError(f"no move {self.kind!r}")

    def conjugate(self, grad: Layout) -> Move | None:
        """The move a gradient of layout ``grad`` (the output's) takes back in backward: all-gather's is a
        reduce-scatter of a partial gradient (else a slice), reduce-scatter's and slice's an all-gather, all-to-all's
        the all-to-all back, all-reduce's another all-reduce only if the gradient is itself partial (else none)."""
        partial = dict(grad.partial)
        if self.kind == "all-gather":
            if self.axis in partial:
                return Move("reduce-scatter", self.axis, self.dim, op=partial[self.axis])
            return Move("slice", self.axis, self.dim)
        if self.kind in ("reduce-scatter", "slice"):
            return Move("all-gather", self.axis, self.dim)
        if self.kind == "all-to-all":
            return Move("all-to-all", self.axis, self.to_dim, self.dim)
        if self.kind == "all-reduce":
            return Move("all-reduce", self.axis, op=partial[self.axis]) if self.axis in partial else None
        raise ValueError(f"no conjugate of {self.kind!r}")

    def __str__(self) -> str:
        dims = {"all-to-all": f" dim {self.dim}->{self.to_dim}"}.get(self.kind, "" if self.dim is None else
                                                                     f" dim {self.dim}")  # fmt: skip
        op = f" {self.op}" if self.kind in ("all-reduce", "reduce-scatter") else ""
        return f"{self.kind}({self.axis}){dims}{op}"


def moves(source: Layout, target: Layout) -> list[Move]:
    """The moves from ``source`` to ``target``'s dims, whole (the target's partial sums are ignored: a target is
    never partial), fewest bytes first: partial sums made (scattered where the target splits a dimension that is
    whole here), then dimensions gathered or exchanged, then slices (free)."""
    return list(_moves(source, target))


@functools.cache  # (pure, and asked again every step: remembered)
def _moves(source: Layout, target: Layout) -> tuple[Move, ...]:
    steps, now = [], source
    for axis, op in source.partial:
        dims = [d for d, a in enumerate(target.dims) if a == axis and now.dims[d] is None and axis not in now.dims]
        steps.append(Move("reduce-scatter", axis, dims[0], op=op) if dims else Move("all-reduce", axis, op=op))
        now = steps[-1].after(now)
    for d, axis in enumerate(now.dims):
        if axis is not None and target.dims[d] != axis:
            swap = [e for e, a in enumerate(target.dims) if a == axis and now.dims[e] is None]
            steps.append(Move("all-to-all", axis, d, swap[0]) if swap else Move("all-gather", axis, d))
            now = steps[-1].after(now)
    for d, axis in enumerate(target.dims):
        if axis is not None and now.dims[d] is None:
            steps.append(Move("slice", axis, d))
            now = steps[-1].after(now)
    return tuple(steps)


def made_whole(grad: Layout) -> list[Move]:
    """A gradient's partial sums made (all-reduces), before an op that needs a whole gradient uses it."""
    return [Move("all-reduce", axis, op=op) for axis, op in grad.partial]


# --- the rules: what each op needs of its operands, and what it gives -----------------------------------------


@functools.cache
def matmul(a: Layout, b: Layout) -> tuple[Layout, Layout, Layout, str]:
    """``C = A @ B``: (A's layout to use, B's, C's, which of the four cases). Operands are made whole first."""
    a, b = a.whole, b.whole
    ka, kb = a.dims[1], b.dims[0]
    if ka == kb:
        case = "1: J whole in both, nothing sent" if ka is None else f"3: J split over {ka} in both: partial({ka})"
    else:  # 2: the operand whose J is split is gathered (both, if two axes split it)
        a, b = (a if ka is None else a.split(1, None)), (b if kb is None else b.split(0, None))
        which = "A" if kb is None else "B" if ka is None else None
        case = f"2: J split in {which} only: all-gather it" if which else "2: J split over two axes: all-gather both"
    if a.dims[0] is not None and a.dims[0] == b.dims[1]:  # 4: C's two dims on one axis: gather B's columns
        b = b.split(1, None)
        case = f"4: axis {a.dims[0]} would split both of C's dims: all-gather B's columns, then " + case
    out = Layout((a.dims[0], b.dims[1])).plus_partial(a.dims[1], "sum")
    return a, b, out, case


@functools.cache
def bias_add(h: Layout, bias: Layout) -> tuple[Layout, Layout, Layout]:
    """``h + b`` (b added to every row): (h's layout to use, b's, the output's). A partial h is made whole, by a
    reduce-scatter onto its columns when the bias is split over that axis, else an all-reduce; the bias then takes
    h's column layout."""
    dims = list(h.dims)
    for axis, _op in h.partial:
        if bias.dims[0] == axis and dims[1] is None and axis not in dims:
            dims[1] = axis
    whole = Layout(tuple(dims))
    return whole, Layout((whole.dims[1],)), whole


@functools.cache
def elementwise(x: Layout) -> tuple[Layout, Layout]:
    """An activation: (the input's layout to use: whole, the output's: the same)."""
    return x.whole, x.whole


def cross_entropy(logits: Layout, rows: int, sizes: dict) -> tuple[Layout, Layout]:
    """The mean cross-entropy over the batch: (the logits' layout to use, the loss's). Each row's classes must be on
    one rank: split classes are exchanged for split rows (all-to-all) when the rows are whole and divide, else
    gathered. Rows split over an axis leave each rank the mean of its rows: the loss is then a mean over it."""
    z = logits.whole
    rows_axis, classes_axis = z.dims
    if classes_axis is not None:
        swap = rows_axis is None and rows % sizes[classes_axis] == 0
        z = Layout((classes_axis, None)) if swap else Layout((rows_axis, None))
    loss = Layout(()).plus_partial(z.dims[0], "avg")
    return z, loss

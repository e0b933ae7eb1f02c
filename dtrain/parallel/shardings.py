"""The MLP as a sharded program: its tensors' names and shapes, the named shardings, and the program itself.

The tensors a learner lays out: ``input`` (the batch: rows x features), and for Linear layer j = 1..L its weight
``wj`` (inputs x outputs, layout.py's W(j-1)) and bias ``bj``. :func:`layouts_of` reads ``--mesh``, ``--sharding``
and every ``--shard TENSOR=SPEC`` into one layout per tensor (a tensor not named is replicated), checked before any
communication. The presets, on a mesh whose first axis is ``d`` and last ``m``::

    dp           input[B_d, F]                                       everything else replicated
    megatron     w1[_, H_m] b1[H_m] w2[H_m, _]  (each column-then-row pair of layers; a layer left over, and the
                                                 row layer's bias, replicated)
    dp-megatron  both: data over d, the model over m (a mesh of two axes)
    fsdp         input[B_d, F], every weight's rows over d (gathered before use, resharded after), biases replicated
    auto         the cheapest valid layout on the planner's model (auto_sharding.py: it becomes --shard words)

:func:`forward` is the model's code, the same for every layout: the ops of sharded.py decide what each layout
needs. :func:`dry_run` runs it on one process with no communicators, for the decisions alone (``--explain``, the
costs, the planner, the search of ``--sharding auto``); :func:`step_time` prices them on the planner's hardware.
"""

from __future__ import annotations

import functools

import numpy as np

from dtrain.autograd import Tensor, activation_bytes
from dtrain.backend import DTYPES, itemsize
from dtrain.collectives import costmodel
from dtrain.errors import ConfigError
from dtrain.layout import parameter_spans
from dtrain.nn import Module, Parameter
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import layouts, mesh, placement
from dtrain.parallel.layouts import Layout
from dtrain.parallel.sharded import Program, Sharded

PRESETS = ("none", "dp", "megatron", "dp-megatron", "fsdp", "auto")


def tensors(sizes, batch: int) -> dict[str, tuple]:
    """Every tensor a layout may name, with its global shape: ``input``, then ``w1``, ``b1``, ... in layer order."""
    shapes = {"input": (batch, sizes[0])}
    for j in range(1, len(sizes)):
        shapes[f"w{j}"], shapes[f"b{j}"] = (sizes[j - 1], sizes[j]), (sizes[j],)
    return shapes


def preset(name: str, axes, layers: int) -> dict[str, tuple]:
    """The dims of each tensor a named sharding splits (the others are replicated), on a mesh with ``axes``."""
    first, last = axes[0], axes[-1]
    if name == "dp-megatron" and len(axes) != 2:
        raise ConfigError(f"--sharding dp-megatron puts data on the mesh's first axis and the model on its second, "
                          f"but the mesh has {len(axes)} ({', '.join(axes)}): give --mesh x=D,y=M")  # fmt: skip
    dims = {}
    if name in ("dp", "fsdp", "dp-megatron"):
        dims["input"] = (first, None)
    if name in ("megatron", "dp-megatron"):
        for j in range(1, layers, 2):  # pairs (j, j+1): column, then row
            dims[f"w{j}"], dims[f"b{j}"], dims[f"w{j + 1}"] = (None, last), (last,), (last, None)
    if name == "fsdp":
        for j in range(1, layers + 1):
            dims[f"w{j}"] = (first, None)
    return dims


def sharding_of(config) -> str:
    """``--sharding``, or its default: dp, or none when ``--shard`` names tensors itself."""
    return config.sharding or ("none" if config.shard else "dp")


def from_words(words) -> dict[str, tuple]:
    """``--shard`` words as dims by tensor: ``("w1=_,y",)`` -> ``{"w1": (None, "y")}``."""
    return {w.partition("=")[0]: tuple(None if a == "_" else a for a in w.partition("=")[2].split(",")) for w in words}


@functools.lru_cache(maxsize=4096)
def layouts_of(sizes, world, mesh_text, shards, sharding, batch, accumulate) -> dict[str, Layout]:
    """One layout per tensor of the MLP ``sizes`` from the flags: the preset ``sharding``, then each of ``shards``
    (--shard's words); a ConfigError, before any communication, for any that cannot be."""
    shape = mesh.parse(mesh_text, world)
    shapes = tensors(sizes, batch)
    chosen = preset(sharding, shape.names, len(sizes) - 1)  # ("auto" comes here as the --shard words it chose)
    result = {name: Layout(chosen.get(name, (None,) * len(s))) for name, s in shapes.items()}
    named = [given.partition("=")[0] for given in shards]
    twice = sorted({t for t in named if named.count(t) > 1})
    if twice:
        raise ConfigError(f"--shard names {', '.join(twice)} more than once: give one layout per tensor")
    for given in shards:
        tensor, equals, text = given.partition("=")
        if not equals or tensor not in shapes:
            listing = ", ".join(shapes)
            raise ConfigError(f"--shard {given}: {tensor!r} is not a tensor of this model; give TENSOR=SPEC with "
                              f"TENSOR one of {listing}")  # fmt: skip
        result[tensor] = layouts.parse(tensor, text, len(shapes[tensor]), shape.names)
    sizes_of = dict(shape.axes)
    for name, layout in result.items():
        what = " rows: the global batch" if name == "input" else ""
        layouts.check_divides(name, shapes[name], layout, sizes_of, what)
    rows_axis = result["input"].dims[0]
    rows = batch // (sizes_of[rows_axis] if rows_axis else 1)
    if rows % accumulate:
        raise ConfigError(f"--accumulate {accumulate} must divide each rank's rows of the batch ({rows})")
    return result


# --- the program ------------------------------------------------------------------------------------------------


def parameters(sizes):
    """The parameters' names in the flat buffer's order (layout.py): w1, b1, w2, b2, ..."""
    return [name for j in range(1, len(sizes)) for name in (f"w{j}", f"b{j}")]


def forward(program: Program, params: dict[str, Sharded], x, labels, input_layout: Layout, rows: int) -> Sharded:
    """The MLP's forward and loss on this rank's block ``x`` of a micro-batch of ``rows`` rows (its rows: those of
    ``input_layout``'s rows' axis): the same code for every layout. A weight gathered for its matmul is released
    after forward and gathered again in backward, if backward needs it (resharding, as FSDP and ZeRO-3 do)."""
    h = Sharded(Tensor(x), Layout((input_layout.dims[0], None)), (rows, params["w1"].shape[0]), "input")
    h = program.redistribute(h, input_layout, "input: its columns' block")  # (split features: a slice)
    layers = len(params) // 2
    for j in range(1, layers + 1):
        where = f"layer {j}"
        h = program.matmul(h, params[f"w{j}"], f"{where}: x @ w{j}", f"z{j}", reshard=True)
        h = program.bias_add(h, params[f"b{j}"], f"{where}: + b{j}", f"h{j}")
        if j < layers:
            h = program.relu(h, f"{where}: relu", f"a{j}")
    return program.cross_entropy(h, labels, input_layout.dims[0], "loss")


def local_model(
    laid: dict[str, Layout],
    sizes,
    batch: int,
    axis_sizes: dict,
    coordinates: dict,
    xp=np,
    dtype=DTYPES["float32"],
    whole=None,
):
    """This rank's parameters: a model whose flat buffers hold each parameter's block (layout.py's order), the
    blocks cut from the flat buffer ``whole`` (zeros without one), and their :class:`Sharded` views by name; the
    :class:`~dtrain.parallel.placement.Piece` of the whole flat buffer each one is."""
    local, params, pieces = Module(), {}, []
    for (name, shape), (start, _n) in zip(list(tensors(sizes, batch).items())[1:], parameter_spans(sizes)):
        pieces.append(placement.Piece(start, shape, laid[name].block(shape, axis_sizes, coordinates)))
        block = pieces[-1].view(whole) if whole is not None else np.zeros(laid[name].local_shape(shape, axis_sizes))
        setattr(local, name, Parameter(xp.array(block, dtype=dtype, copy=True), name))
    local.flatten_(xp=xp, dtype=dtype)
    for name, p in local.named_parameters():
        params[name] = Sharded(p, laid[name], tensors(sizes, batch)[name], name)
    return local, params, pieces


@functools.lru_cache(maxsize=4096)
def dry_run(sizes, world, mesh_text, shards, sharding, batch, accumulate, dtype="float32") -> Program:
    """One optimizer step of the program on rank 0 with no communication: its plan and its collectives (forward,
    backward and the update's), arrays of the right shapes only. ``activations``: what forward keeps for backward."""
    laid = layouts_of(sizes, world, mesh_text, shards, sharding, batch, accumulate)
    shape = mesh.parse(mesh_text, world)
    axis_sizes = dict(shape.axes)
    program = Program(axis_sizes, shape.coordinates(0))
    program.shape = shape
    local, params, _pieces = local_model(laid, sizes, batch, axis_sizes, program.coordinates, dtype=DTYPES[dtype])
    rows_axis = laid["input"].dims[0]
    rows = batch // accumulate
    local_rows = rows // (axis_sizes[rows_axis] if rows_axis else 1)
    x = np.zeros((local_rows, sizes[0]), DTYPES[dtype])
    for _ in range(accumulate):
        program.phase = "forward"
        loss = forward(program, params, x, np.zeros(local_rows, np.int64), laid["input"], rows)
        program.activations = activation_bytes(loss.tensor)  # (the weights gathered and released: not kept)
        program.end_forward()
        loss.tensor.backward()
    program.update(local.flat_grads, local.param_slices, update_moves(params))
    program.parameters = local.flat_params.size
    return program


def update_moves(params: dict[str, Sharded]) -> list[tuple[tuple, list[str]]]:
    """What the update phase makes of the parameters' gradients, grouped: (moves, the parameters that need exactly
    these) in parameter order; each group is one collective per move."""
    groups: dict[tuple, list[str]] = {}
    for name, p in params.items():
        grad = p.grad_layout or p.layout
        steps = layouts.moves(grad, p.layout)
        steps += [layouts.Move("scale", axis) for axis in grad.unaveraged]  # (divided by the axis's size locally)
        if steps:
            groups.setdefault(tuple(steps), []).append(name)
    return list(groups.items())


def copies(collective: dict, p: int) -> float:
    """How many times sharded.py copies a collective's result on one rank to lay its blocks out and back: an
    all-reduce none (it sums in place), a reduce-scatter its p blocks and the one kept, an all-gather its own block
    and the joined whole, an all-to-all its blocks out and in."""
    return {"all-reduce": 0.0, "reduce-scatter": p + 1.0, "all-gather": 1.0 + 1.0 / p, "all-to-all": 2.0}[
        collective["kind"]]  # fmt: skip


def step_time(program, world: int, config, hardware) -> dict:
    """Predicted seconds of one step on ``hardware``: the local matmuls of the dry run and the update of this rank's
    blocks (compute), then every collective of the list on its axis's group of ranks, with the copies that lay its
    blocks out (a read and a write of each, at the memory's bandwidth: :func:`copies`) (communication)."""
    b = itemsize(config.dtype)
    shape = program.shape
    compute = sum(hardware.layers_time([(k, n)], m, b) for m, k, n in
                  (e["local"] for e in program.plan if "local" in e))  # fmt: skip
    update = hardware.update_time(program.parameters, b, buffers_per_parameter(config.optimizer, config.momentum))
    communication = 0.0
    for c in program.record:
        group, nbytes = shape.groups(c["axis"])[0], c["elements"] * b
        communication += hardware.slowdown(world) * 2 * copies(c, len(group)) * nbytes / hardware.memory_bandwidth
        if c["kind"] == "all-reduce":
            communication += hardware.allreduce(config.allreduce, nbytes, group, world)
        elif c["kind"] == "reduce-scatter":
            communication += hardware.collective("reduce_scatter", "ring", nbytes * len(group), group, world)
        elif c["kind"] == "all-gather":
            communication += hardware.collective("allgather", "ring", nbytes, group, world)
        else:
            communication += costmodel.alltoall_time(nbytes, len(group), hardware.link(group, world))
    return {"compute": hardware.slowdown(world) * (compute + update), "communication": communication, "bubble": 0.0}

"""spmd (issue 37) against oracles that do not share its code: the layout rules written out by hand, NumPy on the
global arrays, one process's training, ddp's weights, the collectives a production SPMD partitioner inserts (derived
below), the tracer, tp's and zero's cost functions, the checkpoint format and the command line.

The layers of the test, from the bottom: the rules (layouts.py, pure arithmetic on layouts); the mesh (coordinates,
groups, and the sub-communicators on simulated ranks); one redistribution made by sharded.Program on 2 and 4
simulated ranks, forward and backward, against the global array; whole training runs against single and ddp; the
bytes; checkpoints; what the command line refuses and what --explain prints.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import train_util
from mpi_util import assert_fits
from test_data_parallel import STEPS, config, for_model, model_of, relative, run

from dtrain import config as train_config
from dtrain.autograd import Tensor
from dtrain.collectives import chunk_bounds, costmodel
from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.data import steps_per_epoch
from dtrain.errors import ConfigError
from dtrain.parallel import layouts, shardings
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.layouts import Layout, Move
from dtrain.parallel.mesh import Mesh, MeshShape
from dtrain.parallel.mesh import parse as parse_mesh
from dtrain.parallel.pricing import group_allreduce_bytes
from dtrain.parallel.sharded import Program, Sharded
from dtrain.parallel.spmd import SPMD
from dtrain.parallel.tensor_parallel import TensorParallel
from dtrain.parallel.zero import Zero

SIZES = [64, 32, 32, 10]  # three layers: megatron pairs 1-2 and leaves 3 whole; 32 splits by 2 and 4, 10 by 2
BIG = (784, 512, 512, 10)  # the issue's MLP, for dry runs and costs only (no training)
FAST = dict(hidden=(32, 32), batch_size=48, progress=False, quiet=True, timeout=0, dtype="float64")
_ = None  # a dimension kept whole, as the command line writes it


def spmd(sizes=SIZES, **overrides) -> TrainConfig:
    """An spmd config of test_data_parallel's (float64, batch 24, lr 0.1, momentum 0.9) for the model ``sizes``."""
    return for_model("spmd", sizes, **overrides)


def big(**overrides) -> TrainConfig:
    """The issue's 784-512-512-10 MLP at global batch 64 (float32: 4 bytes an element)."""
    return TrainConfig(dataset="synthetic", features=784, classes=10, hidden=(512, 512), batch_size=64, **overrides)


def partial(dims, *axes, op="sum") -> Layout:
    """``dims``, a partial sum (or mean) over ``axes``."""
    return Layout(tuple(dims), tuple((axis, op) for axis in axes))


def L(*dims) -> Layout:
    return Layout(tuple(dims))


# --- 1. the rules: pure arithmetic on layouts -------------------------------------------------------------------

x, y = "x", "y"

MATMUL = {
    # case 1: the contracting dimension J whole in both: each rank multiplies its blocks, nothing is sent
    "1: A[I_x,J] B[J,K_y]": ((L(x, _), L(_, y)), (L(x, _), L(_, y), L(x, y)), "1"),
    "1: A[I,J] B[J,K]": ((L(_, _), L(_, _)), (L(_, _), L(_, _), L(_, _)), "1"),
    # case 2: J split in one operand only: that operand is gathered (its J made whole), then case 1
    "2: A[I,J_x] B[J,K]": ((L(_, x), L(_, _)), (L(_, _), L(_, _), L(_, _)), "2"),
    "2: A[I_y,J] B[J_x,K]": ((L(y, _), L(x, _)), (L(y, _), L(_, _), L(y, _)), "2"),
    "2: A[I,J_x] B[J_y,K]": ((L(_, x), L(y, _)), (L(_, _), L(_, _), L(_, _)), "2"),  # two axes: both gathered
    # case 3: J split over the same axis in both: local products, a partial sum over that axis
    "3: A[I,J_x] B[J_x,K]": ((L(_, x), L(x, _)), (L(_, x), L(x, _), partial((_, _), x)), "3"),
    "3: A[I_y,J_x] B[J_x,K]": ((L(y, x), L(x, _)), (L(y, x), L(x, _), partial((y, _), x)), "3"),
    # case 4: one axis would split both of C's dims: B's columns gathered first
    "4: A[I_x,J] B[J,K_x]": ((L(x, _), L(_, x)), (L(x, _), L(_, _), L(x, _)), "4"),
    "4+3: A[I_x,J_y] B[J_y,K_x]": ((L(x, y), L(y, x)), (L(x, y), L(y, _), partial((x, _), y)), "4"),
}


@pytest.mark.parametrize("name", list(MATMUL))
def test_matmul_rule_gives_each_cases_operands_and_output(name):
    (a, b), expected, case = MATMUL[name]
    *used, text = layouts.matmul(a, b)
    assert tuple(used) == expected
    assert text.startswith(case + ":")


def test_matmul_makes_partial_operands_whole_first():
    """A partial operand is summed before a matmul uses it (its dims unchanged): the rule sees A[I,J_x]."""
    a, b, c, case = layouts.matmul(partial((_, x), y), L(x, _))
    assert (a, b, c) == (L(_, x), L(x, _), partial((_, _), x))
    assert case.startswith("3:")


MOVES = {
    "partial -> replicated: all-reduce": (partial((_, _), x), L(_, _), [Move("all-reduce", x)]),
    "partial mean -> replicated: all-reduce avg": (
        partial((_, _), x, op="avg"),
        L(_, _),
        [Move("all-reduce", x, op="avg")],
    ),
    "partial -> sharded: reduce-scatter": (partial((_, _), x), L(_, x), [Move("reduce-scatter", x, 1)]),
    "partial over y -> y splits the columns": (partial((x, _), y), L(x, y), [Move("reduce-scatter", y, 1)]),
    "sharded -> replicated: all-gather (dim 0)": (L(x, _), L(_, _), [Move("all-gather", x, 0)]),
    "sharded -> replicated: all-gather (dim 1)": (L(_, y), L(_, _), [Move("all-gather", y, 1)]),
    "dim 0 -> dim 1: all-to-all": (L(x, _), L(_, x), [Move("all-to-all", x, 0, 1)]),
    "dim 1 -> dim 0: all-to-all": (L(_, x), L(x, _), [Move("all-to-all", x, 1, 0)]),
    "replicated -> sharded: slice": (L(_, _), L(x, _), [Move("slice", x, 0)]),
    "already there: nothing": (L(x, y), L(x, y), []),
    "two partial sums: the one the target splits is scattered": (
        partial((_, _), x, y),
        L(x, _),
        [Move("reduce-scatter", x, 0), Move("all-reduce", y)],
    ),
    "another axis: gather, then slice": (L(x, _), L(y, _), [Move("all-gather", x, 0), Move("slice", y, 0)]),
}


@pytest.mark.parametrize("name", list(MOVES))
def test_moves_are_the_least_communication_between_two_layouts(name):
    source, target, expected = MOVES[name]
    steps = layouts.moves(source, target)
    assert steps == expected
    now = source
    for move in steps:  # and made one after another they arrive at the target, whole
        now = move.after(now)
    assert now.dims == target.dims and now.partial == ()


CONJUGATES = [
    # (the move, the gradient's layout in backward: the move's output's, the move backward)
    (Move("all-gather", x, 0), L(_, _), Move("slice", x, 0)),  # a whole gradient: each rank keeps its rows
    (Move("all-gather", x, 0), partial((_, _), x), Move("reduce-scatter", x, 0)),  # FSDP's reduce-scatter
    (Move("all-gather", x, 1), partial((_, _), x, op="avg"), Move("reduce-scatter", x, 1, op="avg")),
    (Move("reduce-scatter", x, 1), L(_, x), Move("all-gather", x, 1)),
    (Move("slice", y, 0), L(y, _), Move("all-gather", y, 0)),
    (Move("all-to-all", x, 0, 1), L(_, x), Move("all-to-all", x, 1, 0)),
    (Move("all-reduce", x), L(_, _), None),  # Megatron's g: the identity backward
    (Move("all-reduce", x), partial((_, _), x), Move("all-reduce", x)),  # f's sum, when the gradient is partial
]


@pytest.mark.parametrize(("move", "grad", "expected"), CONJUGATES, ids=[f"{m} | {g}" for m, g, _ in CONJUGATES])
def test_each_moves_conjugate_is_the_collective_backward_makes(move, grad, expected):
    assert move.conjugate(grad) == expected


def test_a_move_that_is_not_one_has_no_conjugate():
    with pytest.raises(ValueError, match="no conjugate of 'scale'"):
        Move("scale", x).conjugate(L(_, _))


def test_bias_add_elementwise_and_the_loss_rules():
    # a partial h whose bias is split over the same axis: the sum is scattered onto the columns (reduce-scatter)
    assert layouts.bias_add(partial((_, _), x), L(x)) == (L(_, x), L(x), L(_, x))
    # a partial h, a whole bias: the sum made whole (all-reduce); the bias takes h's column layout
    assert layouts.bias_add(partial((y, _), x), L(_)) == (L(y, _), L(_), L(y, _))
    assert layouts.bias_add(L(_, x), L(_)) == (L(_, x), L(x), L(_, x))  # a whole bias is sliced
    assert layouts.elementwise(partial((x, _), y)) == (L(x, _), L(x, _))
    # the loss needs each row's classes on one rank: split classes exchanged for split rows when they divide
    assert layouts.cross_entropy(L(_, x), 48, {x: 2}) == (L(x, _), partial((), x, op="avg"))
    assert layouts.cross_entropy(L(_, x), 3, {x: 2}) == (L(_, _), L())  # 3 rows do not divide: gathered
    assert layouts.cross_entropy(L(y, x), 48, {x: 2, y: 2}) == (L(y, _), partial((), y, op="avg"))


@pytest.mark.parametrize(
    ("text", "ndim", "message"),
    [
        ("x", 2, r"--shard w1=x: w1 has 2 dimension\(s\), so the spec needs 2 entries"),
        ("_,z", 2, "--shard w1=_,z: the mesh has no axis 'z' \\(its axes: x, y"),
        ("x,x", 2, "--shard w1=x,x: axis x splits two dimensions of one tensor"),
        ("x,_,_", 2, "needs 2 entries"),
    ],
)
def test_a_spec_that_cannot_be_is_one_clear_error(text, ndim, message):
    with pytest.raises(ConfigError, match=message):
        layouts.parse("w1", text, ndim, ("x", "y"))


def test_a_spec_parses_to_its_layout_and_local_shape():
    layout = layouts.parse("w1", "_, y", 2, ("x", "y"))
    assert layout == L(_, y) and str(layout) == "[_,y]"
    assert layout.local_shape((64, 32), {"x": 2, "y": 4}) == (64, 8)
    assert layouts.parse("b1", "y", 1, ("x", "y")) == L(y)
    with pytest.raises(ConfigError, match=r"its dimension 1 \(30\) does not divide by the 4 ranks of axis x"):
        layouts.check_divides("w1", (64, 30), L(_, x), {"x": 4})


def test_a_shard_overrides_its_preset_for_that_tensor_only():
    laid = SPMD.layouts_of(SIZES, 2, spmd(sharding="megatron", shard=("w3=_,x", "b3=x")))
    assert {name: layout.dims for name, layout in laid.items()} == {
        "input": (_, _), "w1": (_, x), "b1": (x,), "w2": (x, _), "b2": (_,), "w3": (_, x), "b3": (x,)}  # fmt: skip
    assert all(layout.partial == () for layout in laid.values())


def test_the_presets_are_the_issues_layouts():
    assert shardings.preset("dp", ("x", "y"), 3) == {"input": (x, _)}
    # megatron: each column-then-row pair over the last axis; a layer left over, and the row layer's bias, whole
    assert shardings.preset("megatron", ("d", "m"), 3) == {"w1": (_, "m"), "b1": ("m",), "w2": ("m", _)}
    assert shardings.preset("megatron", ("m",), 4) == {"w1": (_, "m"), "b1": ("m",), "w2": ("m", _),
                                                       "w3": (_, "m"), "b3": ("m",), "w4": ("m", _)}  # fmt: skip
    assert shardings.preset("dp-megatron", ("d", "m"), 3) == {"input": ("d", _), "w1": (_, "m"), "b1": ("m",),
                                                              "w2": ("m", _)}  # fmt: skip
    assert shardings.preset("fsdp", ("x", "y"), 3) == {"input": (x, _), "w1": (x, _), "w2": (x, _), "w3": (x, _)}


# --- 2. the mesh ------------------------------------------------------------------------------------------------


def test_the_last_axis_varies_fastest():
    """x=2,y=2 puts ranks 0 and 1 in one y group, as the docstring's picture; on three axes the coordinates are
    NumPy's C-order (last fastest) unravelling of the rank."""
    shape = parse_mesh("x=2,y=2", 4)
    assert [shape.coordinates(r) for r in range(4)] == [{x: 0, y: 0}, {x: 0, y: 1}, {x: 1, y: 0}, {x: 1, y: 1}]
    assert shape.groups(y) == [[0, 1], [2, 3]]
    assert shape.groups(x) == [[0, 2], [1, 3]]
    three = MeshShape((("a", 2), ("b", 3), ("c", 2)))
    for rank in range(12):
        at = three.coordinates(rank)
        assert tuple(at.values()) == tuple(int(i) for i in np.unravel_index(rank, (2, 3, 2)))
        assert three.rank_of(**at) == rank
    for axis in ("a", "b", "c"):  # a group: the ranks that share every other coordinate, in coordinate order
        expected = {}
        for rank in range(12):
            at = three.coordinates(rank)
            expected.setdefault(tuple(v for k, v in at.items() if k != axis), []).append(rank)
        assert sorted(three.groups(axis)) == sorted(expected.values())


@pytest.mark.parametrize(
    ("text", "world", "message"),
    [
        ("x=4", 2, "--mesh x=4 has 4 ranks, but 2 were launched: the mesh must cover the world exactly"),
        ("x=2,y=2", 2, "--mesh x=2,y=2 has 2 x 2 = 4 ranks, but 2 were launched"),
        ("x2", 2, "each axis is NAME=SIZE"),
        ("x=0", 2, "each axis is NAME=SIZE"),
        ("X=2", 2, "each axis is NAME=SIZE"),
        ("x=1,x=2", 2, "--mesh x=1,x=2 names the axis x twice"),
    ],
)
def test_a_bad_mesh_is_one_clear_error(text, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_mesh(text, world)


def test_no_mesh_is_one_axis_x_of_the_world():
    assert parse_mesh(None, 3) == MeshShape((("x", 3),))
    assert parse_mesh("x=2,y=3", None).size == 6  # explaining on one process: whatever the mesh covers


@pytest.mark.parametrize("text", ["x=2,y=2", "x=4", "x=2,y=3", "a=2,b=1,c=2", "x=3,y=2"])
def test_each_axis_communicator_holds_the_ranks_its_group_names(text):
    shape = parse_mesh(text, None)

    def fn(comm):
        mesh = Mesh(comm, shape)
        found = {axis: (c.Get_rank(), c.Get_size(), c.allgather(comm.Get_rank())) for axis, c in mesh.comms.items()}
        mesh.free()
        return mesh.coordinates, found

    for rank, (at, found) in enumerate(sim.run(shape.size, fn)):
        assert at == shape.coordinates(rank)
        for axis, (place, size, members) in found.items():
            assert place == at[axis] and size == shape.size_of(axis)  # a rank's place in its group: its coordinate
            assert members in shape.groups(axis) and rank in members


def test_a_mesh_that_does_not_cover_the_world_is_refused_by_mesh_too():
    with pytest.raises(sim.SimRankError, match="a mesh of 4 ranks cannot cover a world of 2"):
        sim.run(2, lambda comm: Mesh(comm, MeshShape((("x", 4),))))


# --- 3. one redistribution on simulated ranks, forward and backward, against the global array -----------------

GLOBAL = (8, 12)  # every dimension splits by 2 and by 4


def index_of(dims, shape, sizes, at):
    """The block of a tensor of ``shape`` laid out with ``dims`` that the rank at coordinates ``at`` holds."""
    return tuple(slice(None) if a is None else slice(at[a] * (n // sizes[a]), (at[a] + 1) * (n // sizes[a]))
                 for n, a in zip(shape, dims))  # fmt: skip


def scatter(value, layout: Layout, shape: MeshShape, rng) -> list:
    """Every rank's block of the global ``value`` laid out as ``layout``: for a partial sum over axes, random parts
    (one per coordinate on those axes) that sum to ``value``; a block of the part each rank's coordinates pick."""
    sizes, axes = dict(shape.axes), [a for a, _ in layout.partial]
    keys = list(itertools.product(*(range(sizes[a]) for a in axes)))
    parts = {key: rng.standard_normal(value.shape) for key in keys[:-1]}
    parts[keys[-1]] = value - sum(parts.values(), np.zeros_like(value))
    blocks = []
    for rank in range(shape.size):
        at = shape.coordinates(rank)
        blocks.append(parts[tuple(at[a] for a in axes)][index_of(layout.dims, value.shape, sizes, at)].copy())
    return blocks


def assemble(blocks, layout: Layout, shape: MeshShape, global_shape):
    """The global tensor the ranks' ``blocks`` are, laid out as ``layout``: ranks that differ only on axes the layout
    does not use must hold the same block (checked); blocks placed; parts of a partial sum added (a mean divided)."""
    sizes = dict(shape.axes)
    used = [a for a in shape.names if a in layout.dims or a in dict(layout.partial)]
    total, seen = np.zeros(global_shape), {}
    for rank, block in enumerate(blocks):
        at = shape.coordinates(rank)
        key = tuple(at[a] for a in used)
        if key in seen:
            assert np.array_equal(block, seen[key]), f"rank {rank}'s block differs from its replica's"
            continue
        seen[key] = block
        total[index_of(layout.dims, global_shape, sizes, at)] += block
    for axis, op in layout.partial:
        total /= sizes[axis] if op == "avg" else 1
    return total


SUM_X = partial((_, _), x)  # [_,_] partial(x): every rank a whole matrix, the tensor their sum over x
ROWS_X_SUM_Y = partial((x, _), y)  # [x,_] partial(y)
AG, RS, AR, A2A = "all-gather", "reduce-scatter", "all-reduce", "all-to-all"

# (mesh, source, target, the gradient's layout (the target's dims, maybe partial), forward kinds, backward kinds)
REDISTRIBUTIONS = {
    "all-reduce": ("x=2", SUM_X, L(_, _), L(_, _), [AR], []),
    "all-reduce, a partial gradient": ("x=4", SUM_X, L(_, _), SUM_X, [AR], [AR]),
    "reduce-scatter dim 0": ("x=2", SUM_X, L(x, _), L(x, _), [RS], [AG]),
    "reduce-scatter dim 1": ("x=4", SUM_X, L(_, x), L(_, x), [RS], [AG]),
    "all-gather dim 0": ("x=4", L(x, _), L(_, _), L(_, _), [AG], []),
    "all-gather dim 1, a partial gradient": ("x=2", L(_, x), L(_, _), SUM_X, [AG], [RS]),
    "all-gather dim 0, a partial gradient": ("x=4", L(x, _), L(_, _), SUM_X, [AG], [RS]),
    "all-to-all dim 0 -> 1": ("x=2", L(x, _), L(_, x), L(_, x), [A2A], [A2A]),
    "all-to-all dim 1 -> 0": ("x=4", L(_, x), L(x, _), L(x, _), [A2A], [A2A]),
    "slice dim 0": ("x=4", L(_, _), L(x, _), L(x, _), [], [AG]),
    "slice dim 1": ("x=2", L(_, _), L(_, x), L(_, x), [], [AG]),
    # on a 2 x 2 mesh: each collective inside the groups of its axis only
    "2x2: all-reduce over y of x's rows": ("x=2,y=2", ROWS_X_SUM_Y, L(x, _), L(x, _), [AR], []),
    "2x2: reduce-scatter over y": ("x=2,y=2", ROWS_X_SUM_Y, L(x, y), L(x, y), [RS], [AG]),
    "2x2: all-gather over y, a partial gradient": ("x=2,y=2", L(x, y), L(x, _), ROWS_X_SUM_Y, [AG], [RS]),
    "2x2: all-to-all over y": ("x=2,y=2", L(_, y), L(y, _), L(y, _), [A2A], [A2A]),
    "2x2: slice over y": ("x=2,y=2", L(x, _), L(x, y), L(x, y), [], [AG]),
    "2x2: [x,y] -> [y,x]": ("x=2,y=2", L(x, y), L(y, x), L(y, x), [AG, A2A], [AG, A2A]),  # (and slices)
}


@pytest.mark.parametrize("name", list(REDISTRIBUTIONS))
def test_a_redistribution_on_simulated_ranks_is_numpys_on_the_global_array(name):
    """Forward: the ranks' blocks after the moves are the same global array in the target layout. Backward (through
    the autograd engine, each move's conjugate): the blocks of the source's gradient are the global gradient G in
    the source's layout, whatever the gradient's own layout (partial sums included). The collectives recorded are
    the expected kinds over the expected axis, each with its result's size on a rank."""
    text, source, target, grad_layout, forward_kinds, backward_kinds = REDISTRIBUTIONS[name]
    shape = parse_mesh(text, None)
    rng = np.random.default_rng(len(name))
    value, grad = rng.standard_normal(GLOBAL), rng.standard_normal(GLOBAL)
    blocks, grads = scatter(value, source, shape, rng), scatter(grad, grad_layout, shape, rng)
    axes = {m.axis for m in layouts.moves(source, target)}

    def fn(comm):
        mesh = Mesh(comm, shape)
        program = Program(dict(shape.axes), mesh.coordinates, mesh.comms, "ring")
        rank = comm.Get_rank()
        mine = Sharded(Tensor(blocks[rank].copy(), requires_grad=True), source, GLOBAL, "t")
        out = program.redistribute(mine, target, "here")
        forward = out.tensor.data.copy()
        out.grad_layout = grad_layout  # (what the op after it writes, in backward)
        program.end_forward()
        out.tensor.backward(grads[rank].copy())
        return forward, out.layout, mine.tensor.grad, mine.grad_layout, program.record

    results = sim.run(shape.size, fn)
    outs, layouts_out, back, back_layouts, records = zip(*results)
    assert all(layout.dims == target.dims and layout.partial == () for layout in layouts_out)
    assert np.allclose(assemble(outs, target, shape, GLOBAL), value, rtol=1e-13, atol=1e-13)
    assert all(layout.dims == source.dims and layout.partial == () for layout in back_layouts)
    assert np.allclose(assemble(back, L(*source.dims), shape, GLOBAL), grad, rtol=1e-13, atol=1e-13)
    for rank, record in enumerate(records):
        assert [c["kind"] for c in record if c["phase"] == "forward"] == forward_kinds
        assert [c["kind"] for c in record if c["phase"] == "backward"] == backward_kinds
        assert {c["axis"] for c in record} <= axes and {c["where"] for c in record} <= {"here (t)"}
        if len(forward_kinds) == 1:
            assert record[0]["elements"] == outs[rank].size
        if len(backward_kinds) == 1:
            assert record[-1]["elements"] == back[rank].size


def test_an_all_reduce_of_a_partial_mean_averages():
    shape = parse_mesh("x=4", None)
    rng = np.random.default_rng(3)
    parts = rng.standard_normal((4, *GLOBAL))

    def fn(comm):
        mesh = Mesh(comm, shape)
        program = Program({"x": 4}, mesh.coordinates, mesh.comms)
        return program.collective(Move("all-reduce", x, op="avg"), parts[comm.Get_rank()], "here")

    for out in sim.run(4, fn):
        assert np.allclose(out, parts.mean(axis=0), rtol=1e-13, atol=1e-15)


# --- 4. training: single's trajectory ---------------------------------------------------------------------------

LAYOUTS = {
    "dp on 2": (2, dict(sharding="dp")),
    "dp on 4": (4, dict(sharding="dp")),
    "megatron on 2": (2, dict(sharding="megatron")),
    "megatron on 4": (4, dict(sharding="megatron")),
    "fsdp on 2": (2, dict(sharding="fsdp")),
    "fsdp on 4": (4, dict(sharding="fsdp")),
    "dp-megatron x=2,y=2": (4, dict(sharding="dp-megatron", mesh="x=2,y=2")),
    "w3 by columns on 2 (all-to-all)": (2, dict(shard=("w3=_,x", "b3=x"))),
    "auto on 4": (4, dict(sharding="auto")),  # (whichever layout the planner's model picks on this machine)
}


@pytest.fixture(scope="module")
def single_run():
    return train_util.on_sim(1, FAST, paradigm="single", epochs=2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_follows_single_in_float64(name, single_run):
    """Each epoch's global train loss and test loss are single's to 1e-10 relative (only the order of summation
    differs: ~1e-16 per step). A loss not averaged over the batch's axis, or a gradient summed twice, is ~1e-2."""
    p, flags = LAYOUTS[name]
    metrics = train_util.on_sim(p, FAST, paradigm="spmd", epochs=2, **flags)
    for ours, theirs in zip(metrics["epochs"], single_run["epochs"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-10)
        assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-10)
    assert metrics["final"]["test_loss"] == pytest.approx(single_run["final"]["test_loss"], rel=1e-10)
    if "all-to-all" in name:  # the layout did what it is here for: classes exchanged for rows before the loss
        listed = metrics["communication"]["per_rank"][0]["paradigm"]["collectives_per_step"]
        kinds = [(c["kind"], c["phase"]) for c in listed if c["where"] == "loss (h3)"]
        assert kinds == [("all-to-all", "forward"), ("all-to-all", "backward")]


@pytest.fixture(scope="module")
def single_params(data64):
    return sim.run(1, run, config(paradigm="single"), data64, model_of(SIZES))[0][0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_holds_singles_parameters_after_three_steps(name, data64, single_params):
    """The parameters themselves (gathered from the blocks), after 3 steps with the same global batch, to 1e-12."""
    p, flags = LAYOUTS[name]
    results = sim.run(p, run, spmd(**flags), data64, model_of(SIZES))
    for params, _, _ in results:
        assert relative(params, single_params) < 1e-12


def test_float32_within_the_rounding_bound():
    # float32: per step every gradient element differs from single's by the rounding of a different order of
    # summation (partial products summed over a mesh axis, rows summed per rank then over ranks): a few eps32
    # (1.2e-7) times the log of the number of terms, ~1e-6 relative at most. Over one epoch of 29 steps the losses
    # drift by at most ~29e-6; they are observed at ~1e-7. A lost 1/p or a bias added twice moves them by ~1e-2.
    base = {**FAST, "dtype": "float32", "epochs": 1}
    single = train_util.on_sim(1, base, paradigm="single")
    for p, flags in ((4, dict(sharding="dp-megatron", mesh="x=2,y=2")), (2, dict(shard=("w3=_,x", "b3=x")))):
        metrics = train_util.on_sim(p, base, paradigm="spmd", **flags)
        assert metrics["final"]["train_loss"] == pytest.approx(single["final"]["train_loss"], rel=5e-5)
        assert metrics["final"]["test_loss"] == pytest.approx(single["final"]["test_loss"], rel=5e-5)


# --- 5. data parallelism is batch sharding: ddp's weights to the bit -------------------------------------------


@pytest.mark.parametrize("algorithm", ["ring", "auto", "tree"])
@pytest.mark.parametrize("p", [2, 4])
def test_dp_is_ddp_bit_for_bit(p, algorithm):
    """One fused all-reduce (a mean) of the whole flat gradient, with ddp's algorithm and one bucket: the same
    arithmetic in the same order, so the same bits."""
    ours = train_util.on_sim(p, FAST, paradigm="spmd", sharding="dp", allreduce=algorithm, epochs=1)
    theirs = train_util.on_sim(p, FAST, paradigm="ddp", allreduce=algorithm, bucket_mb=0.0, epochs=1)
    assert ours["weights_sha256"] == theirs["weights_sha256"]


COMMON = ["--hidden", "32,32", "--epochs", "1", "--batch-size", "48", "--no-progress", "--quiet"]


@pytest.mark.mpi
def test_under_mpiexec_dp_is_ddp_bit_for_bit(tmp_path):
    common = [*COMMON, "--allreduce", "ring"]
    ours = train_util.train_cli(tmp_path / "spmd", 2, *common, "--paradigm", "spmd", "--sharding", "dp")
    theirs = train_util.train_cli(tmp_path / "ddp", 2, *common, "--paradigm", "ddp", "--bucket-mb", "0")
    assert ours["world_size"] == theirs["world_size"] == 2
    assert ours["weights_sha256"] == theirs["weights_sha256"]


@pytest.mark.mpi
def test_under_mpiexec_dp_megatron_follows_single(tmp_path):
    """Real ranks on a 2 x 2 mesh, float64: single's losses to rounding, and every rank's traced bytes costs()'."""
    metrics = train_util.follows_single(tmp_path, 4, [*COMMON, "--dtype", "float64"], "--paradigm", "spmd",
                                        "--sharding", "dp-megatron", "--mesh", "x=2,y=2")  # fmt: skip
    steps = steps_per_epoch(metrics["dataset"]["train_samples"], 48)
    for rank, mine in enumerate(metrics["communication"]["per_rank"]):
        sent = sum(ops["bytes_sent"] for label, ops in mine["operations"].items()
                   if label not in ("evaluation", "checkpoint"))  # fmt: skip
        assert sent == steps * metrics["costs"]["sent_per_step"][rank]
    assert metrics["communication"]["per_rank"][0]["paradigm"]["mesh"] == "x=2,y=2"


# --- 6. the bytes: what a production SPMD partitioner inserts ---------------------------------------------------

W = {1: 784 * 512, 2: 512 * 512, 3: 512 * 10}  # the weights' elements: 401,408, 262,144, 5,120
B = {1: 512, 2: 512, 3: 10}
N = sum(W.values()) + sum(B.values())  # 669,706 parameters


def collectives(sharding, mesh, **overrides):
    program = SPMD.plan_of(BIG, 4, big(paradigm="spmd", sharding=sharding, mesh=mesh, **overrides))
    return [(c["phase"], c["kind"], c["axis"], c["elements"]) for c in program.record]


def test_dp_is_one_all_reduce_of_every_gradient():
    # input[B_x, F], every weight whole. Forward: every matmul is case 1 (J whole), nothing sent; each rank's loss
    # is the mean of its 16 rows. Backward: dW = A^T dZ contracts the rows, which are split over x, so every
    # parameter's gradient is a partial sum over x; XLA all-reduces each (its combiner fuses them into one):
    # 784*512 + 512 + 512*512 + 512 + 512*10 + 10 = 669,706 elements, in the update phase. Nothing else.
    assert collectives("dp", "x=4") == [("update", "all-reduce", "x", 669_706)]
    assert N == 669_706


def test_megatron_is_one_forward_all_reduce_of_the_activations():
    # w1[F, H_x] b1[H_x] w2[H_x, H] (b2, w3, b3 whole), input whole. Forward: x @ w1 is case 1 (J = F whole):
    # z1[_, x], its bias and relu local; a1[_, x] @ w2[x, _] is case 3: a partial sum over x, which + b2 (whole)
    # needs whole: one all-reduce of 64 x 512 = 32,768 (Megatron's g); layer 3 is whole on every rank. Backward:
    # dZ2 is whole, so dA1 = dZ2 w2^T comes out [_, x] and dW2 = A1^T dZ2 [x, _] with nothing sent; dW1 = X^T dZ1
    # is [_, x]; dX is never needed (the input is data), so f's backward all-reduce is not inserted; every
    # gradient of a whole parameter is computed whole on every rank from whole values: no update collective.
    assert collectives("megatron", "x=4") == [("forward", "all-reduce", "x", 64 * 512)]


def test_dp_megatron_is_megatrons_all_reduce_over_y_and_dps_over_x():
    # input[B_x, F], the model over y as above: the forward all-reduce over y is of a rank's 32 rows: 32 x 512 =
    # 16,384. Backward as megatron's (nothing sent over y); every gradient contracts the rows split over x, so the
    # update all-reduces over x the parameters a rank holds: 784*256 + 256 + 256*512 + 512 + 512*10 + 10 = 337,674.
    assert collectives("dp-megatron", "x=2,y=2") == [("forward", "all-reduce", "y", 32 * 512),
                                                     ("update", "all-reduce", "x", 337_674)]  # fmt: skip
    assert 784 * 256 + 256 + 256 * 512 + 512 + 512 * 10 + 10 == 337_674


def test_fsdp_gathers_each_weight_before_use_and_reduce_scatters_its_gradient():
    # input[B_x, F], every weight's rows over x, biases whole. Forward: A[x,_] @ W[x,_] is case 2 (J split in W
    # only): all-gather W over x (the whole W on each rank), released after forward. Backward: dA = dZ W^T needs W
    # again, for layers 3 and 2 (not 1: the input needs no gradient): gathered again; dW = A^T dZ contracts the rows
    # split over x: a partial sum over x, reduce-scattered back onto W's rows (the all-gather's conjugate): W/4 per
    # rank. The biases' gradients are partial sums too: one all-reduce of 512 + 512 + 10 = 1,034 in the update.
    expected = [("forward", "all-gather", "x", W[j]) for j in (1, 2, 3)]
    expected += [("backward", "all-gather", "x", W[j]) for j in (3, 2)]
    expected += [("backward", "reduce-scatter", "x", W[j] // 4) for j in (1, 2, 3)]
    expected += [("update", "all-reduce", "x", 1_034)]
    found = collectives("fsdp", "x=4")
    assert sorted(found) == sorted(expected)
    assert found[:3] == expected[:3]  # each weight gathered before its use, in layer order
    assert [c for c in found if c[0] == "backward" and c[1] == "all-gather"] == expected[3:5]  # last layer first


@pytest.mark.parametrize("algorithm", ["ring", "auto", "tree"])
def test_megatron_sends_tps_bytes_and_dp_megatron_tps_with_data_parallelism(algorithm):
    for sharding, mesh, flags in (("megatron", "x=4", dict(tp=4)), ("dp-megatron", "x=2,y=2", dict(dp=2, tp=2))):
        ours = SPMD.costs(BIG, 4, big(paradigm="spmd", sharding=sharding, mesh=mesh, allreduce=algorithm))
        theirs = TensorParallel.costs(BIG, 4, big(paradigm="tp", allreduce=algorithm, **flags))
        assert ours == theirs, sharding


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_dp_costs_are_ddps_with_one_bucket(algorithm):
    ours = SPMD.costs(BIG, 4, big(paradigm="spmd", sharding="dp", allreduce=algorithm))
    theirs = DataParallel.costs(BIG, 4, big(paradigm="ddp", allreduce=algorithm, bucket_mb=0.0))
    assert ours == theirs


def test_fsdp_against_zero_stage_3():
    """What was found, on 4 ranks with the ring (exact bytes from the collectives' own cost model, costmodel):

    * fsdp sends an all-gather of every weight forward, again for every weight but the first backward, a
      reduce-scatter of every weight's gradient, and one all-reduce of the biases (whole on every rank); zero
      stage 3 gathers every layer (weight and bias, cut into uneven chunks of its flat buffer) forward and backward,
      the first layer too, and reduce-scatters each: 3 (N-1)/N of all parameters, where fsdp's weights need
      (N-1)/N (3 W - W1). So fsdp sends less than 3 (N-1)/N of the weights' bytes, and zero 3 that of all the
      parameters' bytes (to the rounding of its chunks).
    * fsdp holds W/N of every weight's rows and every bias whole, the same on every rank; zero 3 holds uneven
      chunks of each layer (ranks differ by an element) and, in its peak, the largest layer in flight, which
      fsdp's costs do not count (they are the blocks a rank keeps between steps).
    """
    b, p = 4, 4
    fsdp = SPMD.costs(BIG, p, big(paradigm="spmd", sharding="fsdp", mesh="x=4", allreduce="ring"))
    zero = Zero.costs(BIG, p, big(paradigm="zero", zero_stage=3, allreduce="ring"))

    def gather(n, r):
        return costmodel.bytes_sent("ring", n, b, p, r, collective="allgather")

    def scatter(n, r):
        return costmodel.bytes_sent("ring", n, b, p, r, collective="reduce_scatter")

    layer = {j: W[j] + B[j] for j in W}
    for r in range(p):
        weights = sum(gather(W[j], r) + scatter(W[j], r) for j in W) + gather(W[2], r) + gather(W[3], r)
        assert weights == 3 * (3 * sum(W.values()) - W[1])  # (N-1)/N b = 3 bytes an element: every W divides
        assert fsdp["sent_per_step"][r] == weights + costmodel.bytes_sent("ring", sum(B.values()), b, p, r)
        assert zero["sent_per_step"][r] == sum(2 * gather(n, r) + scatter(n, r) for n in layer.values())
        assert fsdp["sent_per_step"][r] <= 3 * (p - 1) / p * sum(W.values()) * b
        assert zero["sent_per_step"][r] == pytest.approx(3 * (p - 1) / p * N * b, abs=4 * b * len(layer))
    blocks = sum(W.values()) // p + sum(B.values())
    assert fsdp["parameters"] == fsdp["gradients"] == fsdp["optimizer"] == blocks * b == 672_808
    chunks = [sum(hi - lo for lo, hi in (chunk_bounds(n, p)[r] for n in layer.values())) for r in range(p)]
    assert zero["optimizer"] == [c * b for c in chunks] and len(set(chunks)) > 1  # uneven: ranks differ
    assert zero["parameters"] == [(c + max(layer.values())) * b for c in chunks]  # + the largest layer in flight


# --- 7. the tracer against costs() -------------------------------------------------------------------------------

TRACED = {
    "dp on 4, ring": (4, dict(sharding="dp", allreduce="ring")),
    "dp on 2, auto": (2, dict(sharding="dp")),
    "megatron on 4, tree": (4, dict(sharding="megatron", allreduce="tree")),
    "fsdp on 4": (4, dict(sharding="fsdp")),
    "fsdp on 4, accumulate 2": (4, dict(sharding="fsdp", accumulate=2, allreduce="ring")),
    "dp-megatron x=2,y=2": (4, dict(sharding="dp-megatron", mesh="x=2,y=2")),
    "dp-megatron x=2,y=2, accumulate 2": (4, dict(sharding="dp-megatron", mesh="x=2,y=2", accumulate=2)),
    "w3 by columns on 2 (all-to-all)": (2, dict(shard=("w3=_,x", "b3=x"))),
}


@pytest.mark.parametrize("name", list(TRACED))
def test_traced_bytes_and_held_bytes_equal_costs(name, data64):
    """Per rank: the training traffic (every label but evaluation's and checkpoint's) is STEPS x costs()'s bytes
    per step; each label is one ``where`` of the collectives' list, and carries the bytes of that where's
    collectives (each priced by the collectives' cost model on its axis); held_bytes are costs()' figures."""
    p, flags = TRACED[name]
    cfg = spmd(**flags)
    predicted = SPMD.costs(SIZES, p, cfg)
    shape = parse_mesh(cfg.mesh, p)
    algorithm = flags.get("allreduce", "auto")
    for rank, (_, summary, figures) in enumerate(sim.run(p, run, cfg, data64, model_of(SIZES))):
        training = {label: ops["bytes_sent"] for label, ops in summary["operations"].items()
                    if label not in ("evaluation", "checkpoint")}  # fmt: skip
        assert sum(training.values()) == STEPS * predicted["sent_per_step"][rank]
        record = figures["collectives_per_step"]
        assert set(training) == {c["where"] for c in record}
        for where, traced in training.items():
            mine = [c for c in record if c["where"] == where]
            assert traced == STEPS * sum(priced(c, shape, rank, algorithm) for c in mine), where
        assert figures["held_bytes"][rank] == {k: predicted[k] for k in ("parameters", "gradients", "optimizer")}


def priced(c, shape, rank, algorithm, b=8):
    """The bytes ``rank`` sends in the recorded collective ``c``, from the collectives' cost model (its result's
    elements on one rank: a reduce-scatter reduces p of them, an all-to-all exchanges them)."""
    p, at, n = shape.size_of(c["axis"]), shape.coordinates(rank)[c["axis"]], c["elements"]
    if c["kind"] == "all-reduce":  # (the algorithm as the front door picks it: pricing's, ddp's too)
        return group_allreduce_bytes(algorithm, [n], b, p, at)
    if c["kind"] == "reduce-scatter":
        return costmodel.bytes_sent("ring", n * p, b, p, at, collective="reduce_scatter")
    if c["kind"] == "all-gather":
        return costmodel.bytes_sent("ring", n, b, p, at, collective="allgather")
    return costmodel.bytes_sent("pairwise", n, b, p, at, collective="alltoall")


def test_the_fsdp_weights_traffic_is_the_formula(data64):
    """The simulated run's labels, summed by kind, against the arithmetic of the ring: (p-1)/p of each gathered
    weight, and of each gradient reduce-scattered, 8 bytes an element, 4 ranks."""
    cfg = spmd(sharding="fsdp", allreduce="ring")
    w = {j: a * b for j, (a, b) in enumerate(itertools.pairwise(SIZES), start=1)}
    for rank, (_, summary, _) in enumerate(sim.run(4, run, cfg, data64, model_of(SIZES))):
        ops = summary["operations"]
        for j in (1, 2, 3):  # forward gather, backward's gather again (not w1: the input needs no gradient), and
            gathers = 1 if j == 1 else 2  # the gradient's reduce-scatter all share the weight's where
            assert ops[f"layer {j}: x @ w{j} (w{j})"]["bytes_sent"] == STEPS * (gathers + 1) * 3 * w[j] // 4 * 8
        biases = costmodel.bytes_sent("ring", 32 + 32 + 10, 8, 4, rank)
        assert ops["update: b1 b2 b3"]["bytes_sent"] == STEPS * biases


# --- 8. checkpoints: the full flat buffer, read by any paradigm -------------------------------------------------


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ((4, dict(paradigm="spmd", sharding="fsdp")), (2, dict(paradigm="ddp"))),
        ((2, dict(paradigm="spmd", shard=("w3=_,x", "b3=x"))), (1, dict(paradigm="single"))),
        ((2, dict(paradigm="ddp")), (4, dict(paradigm="spmd", sharding="dp-megatron", mesh="x=2,y=2"))),
        ((1, dict(paradigm="single")), (4, dict(paradigm="spmd", sharding="megatron"))),
    ],
    ids=[
        "spmd fsdp on 4 -> ddp on 2",
        "spmd all-to-all on 2 -> single",
        "ddp on 2 -> spmd dp-megatron 2x2",
        "single -> spmd megatron on 4",
    ],
)
def test_a_checkpoint_crosses_between_spmd_and_other_paradigms(writer, reader, tmp_path):
    train_util.check_resumed_elsewhere(tmp_path / "ckpt", FAST, writer, reader)


# --- 9. bad input on the command line: one line, exit 2, before any communication -------------------------------


def dtrain(*words, ranks: int = 1, env=None, cwd=None):
    launch = ["-m", "dtrain", "launch", "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run([sys.executable, *launch, "-m", "dtrain", "train", *words], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)  # fmt: skip


BAD = {
    "unknown tensor": (1, ["--shard", "w9=_,x"], "--shard w9=_,x: 'w9' is not a tensor of this model"),
    "a spec of the wrong length": (1, ["--shard", "w1=x"], "--shard w1=x: w1 has 2 dimension(s), so the spec needs 2"),
    "an axis not in the mesh": (1, ["--shard", "w1=_,y"], "--shard w1=_,y: the mesh has no axis 'y'"),
    "one axis for two dims": (1, ["--mesh", "x=1", "--shard", "w1=x,x"], "axis x splits two dimensions of one"),
    "a mesh that does not cover the world": (2, ["--mesh", "x=4"], "--mesh x=4 has 4 ranks, but 2 were launched"),
    "a dimension its axis does not divide": (
        2,
        ["--hidden", "31", "--sharding", "megatron"],
        "w1 laid out as [_,x]: its dimension 1 (31) does not divide by the 2 ranks of axis x",
    ),
    "dp-megatron on one axis": (
        1,
        ["--sharding", "dp-megatron"],
        "--sharding dp-megatron puts data on the mesh's first axis and the model on its second, but the mesh has 1 (x)",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_and_exit_2_before_any_communication(name, tmp_path):
    ranks, flags, message = BAD[name]
    out = tmp_path / "out"
    result = dtrain("--paradigm", "spmd", *flags, "--no-progress", "--out", str(out), ranks=ranks, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and all(line == lines[0] for line in lines), result.stderr  # one line (once per rank at most)
    assert lines[0].startswith("dtrain: error: ") and message in lines[0], lines[0]
    assert result.stdout.strip() == "" and not out.exists()  # nothing trained, nothing written


REFUSED = [
    (2, dict(mesh="x=4"), "--mesh x=4 has 4 ranks, but 2"),
    (4, dict(sharding="megatron", hidden=(30,)), r"its dimension 1 \(30\) does not divide by the 4 ranks of axis x"),
    (2, dict(shard=("b1=x,x",)), r"b1 has 1 dimension\(s\)"),
    (4, dict(mesh="x=2,y=2", batch_size=5), r"input laid out as \[x,_\]: its dimension 0 \(5 rows"),
    (4, dict(mesh="x=2,y=2", sharding="dp-megatron", accumulate=5), "--accumulate 5 must divide each rank's rows"),
    (2, dict(allreduce="hierarchical"), "needs nodes"),
    (2, dict(shard=("w1=_,x", "w1=x,_")), "--shard names w1 more than once"),
    (8, dict(mesh="x=2,y=2,z=2", sharding="dp-megatron"), r"but the mesh has 3 \(x, y, z\)"),
    (2, dict(mesh="datatooverlong=2"), "up to 8 letters"),
    (4, dict(mesh="x=2,y=2", sharding="auto", hidden=(32, 32, 32)), "more than the 3,000 it prices"),
]


@pytest.mark.parametrize(("world", "flags", "message"), REFUSED)
def test_the_check_refuses_before_any_communicator_is_made(world, flags, message):
    """The refusals come from SPMD.check, which the driver calls before it builds anything."""
    with pytest.raises(ConfigError, match=message):
        SPMD.check(TrainConfig(**{**FAST, "paradigm": "spmd", **flags}), world)


# --- 10. --explain ------------------------------------------------------------------------------------------------

EXPLAIN = ["--paradigm", "spmd", "--explain", "--dataset", "synthetic", "--hidden", "512,512"]


def explained(tmp_path, *flags):
    out = tmp_path / "out"
    result = dtrain(*EXPLAIN, *flags, "--out", str(out), env={**os.environ, "COLUMNS": "80"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not out.exists()  # no metrics: nothing was trained
    return result.stdout


def test_explain_on_one_process_lists_the_collectives_of_a_mesh_of_4(tmp_path):
    """One process explains --mesh x=4: the collectives it prints are the dry run's, row by row (fsdp's here)."""
    text = explained(tmp_path, "--sharding", "fsdp", "--mesh", "x=4")
    assert "spmd on the device mesh x=4 (4 ranks), --sharding fsdp" in text
    assert "nothing was trained (--explain)" in text
    rows = [line.split() for line in text.splitlines() if line.startswith(("forward ", "backward ", "update "))]
    listed = [(r[0], r[1], r[2], int(r[3].replace(",", ""))) for r in rows]
    assert listed == collectives("fsdp", "x=4")


@pytest.mark.parametrize("flags", [("--sharding", "dp-megatron", "--mesh", "x=2,y=2"),
                                   ("--shard", "w3=_,x", "--shard", "b3=x", "--mesh", "x=2"),
                                   ("--sharding", "auto", "--mesh", "x=2,y=2")])  # fmt: skip
def test_explain_fits_80_columns(flags, tmp_path):
    assert_fits(explained(tmp_path, *flags), 80)


# --- 11. flag words: --shard written back as repeated flags ------------------------------------------------------


def test_flag_words_write_shard_as_repeated_flags_that_parse_back():
    values = {"paradigm": "spmd", "shard": ("w1=_,x", "b1=x")}
    words = train_config.flag_words(values)
    assert words == ["--paradigm", "spmd", "--shard", "w1=_,x", "--shard", "b1=x"]
    args = train_config.train_parser().parse_args(words)
    assert args.paradigm == "spmd" and tuple(args.shard) == values["shard"]
    assert train_config.flag_words({"paradigm": args.paradigm, "shard": tuple(args.shard)}) == words
    assert train_config.flag_words({"shard": None}) == []  # (not given: no words)

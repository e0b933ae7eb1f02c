"""Tensor parallelism and the rank grid against their oracles: the unsharded layer, one process's training, the cost
formulas, the flat checkpoint format.

The f and g operators and a column-then-row block are held against the same computation on the whole matrices (the
gradients of every slice included) and their all-reduces counted by the tracer; ``tp`` on T ranks and ``dp x tp``
grids must hold, after k steps, the parameters one process holds after k steps with the same global batch; the
tracer's bytes per step and the bytes each rank holds must equal :meth:`TensorParallel.costs` exactly.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import train_util
from test_data_parallel import BATCH, STEPS, batches, config, for_model, model_of, relative, run

from dtrain import parallel
from dtrain.autograd import Tensor
from dtrain.comm import sim
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import steps_per_epoch
from dtrain.errors import ConfigError
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import grid, placement
from dtrain.parallel.placement import split
from dtrain.parallel.pricing import local_parameters
from dtrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorGroup,
    TensorParallel,
    f,
    g,
    shard,
)

SIZES = [64, 32, 16, 32, 10]  # column 64->32, row 32->16, column 16->32, row 32->10: two blocks; widths split by 2, 4
ODD = [64, 24, 16, 10]  # column 64->24, row 24->16, the 10-way output layer replicated; 24 splits by 3


def tp(sizes=SIZES, **overrides) -> TrainConfig:
    """A tp config for the model ``sizes`` (its hidden widths decide what splits, as they do in the driver)."""
    return for_model("tp", sizes, **overrides)


@pytest.fixture(scope="module")
def single64(data64):
    return {tuple(s): sim.run(1, run, config(paradigm="single"), data64, model_of(s))[0][0] for s in (SIZES, ODD)}


# --- the grid ---------------------------------------------------------------------------------------------------


def test_the_grid_of_8_ranks_is_the_docstrings_picture():
    shape = grid.Shape(dp=2, tp=2, pp=2)
    assert [shape.coordinates(r) for r in (0, 3, 5, 6)] == [
        {"dp": 0, "tp": 0, "pp": 0}, {"dp": 1, "tp": 1, "pp": 0}, {"dp": 0, "tp": 1, "pp": 1},
        {"dp": 1, "tp": 0, "pp": 1}]  # fmt: skip
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(shape.rank_of(**shape.coordinates(r)) == r for r in range(8))
    text = shape.describe()
    assert "tp groups (split the layers of a stage; all-reduce activations): [0 1] [2 3] [4 5] [6 7]" in text
    assert "  pp    0  0  0  0  1  1  1  1" in text


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 2), (3, 2, 1), (1, 4, 1), (2, 1, 3)])
def test_every_sub_communicator_holds_the_ranks_its_group_names(dp, tp, pp):
    shape = grid.Shape(dp, tp, pp)

    def fn(comm):
        mine = grid.Grid(comm, shape)
        return {axis: (c.Get_rank(), c.allgather(comm.Get_rank())) for axis, c in mine.comms.items()}

    for rank, found in enumerate(sim.run(shape.size, fn)):
        at = shape.coordinates(rank)
        for axis, (place, members) in found.items():
            assert place == at[axis]  # a rank's place in its group is its coordinate on that axis
            assert members in shape.groups(axis) and rank in members


@pytest.mark.parametrize(
    ("world", "flags", "fill", "message"),
    [
        (4, dict(dp=3, tp=2), "dp", "--dp 3 x --tp 2 x --pp 1 = 6 ranks, but 4 were launched"),
        (4, dict(tp=8), "dp", "--tp 8 is more than the 4 rank(s) launched"),
        (6, dict(tp=4), "dp", "--tp 4 = 4 rank(s) per replica does not divide the 6 ranks launched"),
        (4, dict(tp=0), "dp", "--tp must be >= 1, got 0"),
    ],
)
def test_a_grid_that_does_not_cover_the_world_is_one_clear_error(world, flags, fill, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        grid.shape_of(world, fill=fill, **flags)


def test_a_missing_size_takes_what_the_others_leave():
    assert grid.shape_of(8, tp=2, fill="dp") == grid.Shape(4, 2, 1)
    assert grid.shape_of(8, dp=2, fill="tp") == grid.Shape(2, 4, 1)
    assert grid.shape_of(8, dp=2, tp=2, fill="pp") == grid.Shape(2, 2, 2)
    assert grid.shape_of(6, fill="tp") == grid.Shape(1, 6, 1)


# --- the operators and the layers -------------------------------------------------------------------------------


def _on_group(comm):
    return TensorGroup(prepare(comm, timeout=0), "ring")


@pytest.mark.parametrize("t", [2, 3, 4])
def test_f_is_the_identity_forward_and_sums_the_gradients_backward(t):
    rng = np.random.default_rng(0)
    x, grads = rng.standard_normal((5, 6)), rng.standard_normal((t, 5, 6))

    def fn(comm):
        inputs = Tensor(x.copy(), requires_grad=True)
        out = f(inputs, _on_group(comm))
        forward = out.data.copy()
        out.backward(grads[comm.Get_rank()].copy())
        return forward, inputs.grad

    for forward, grad in sim.run(t, fn):
        assert np.array_equal(forward, x)
        assert np.allclose(grad, grads.sum(axis=0), rtol=1e-14, atol=0)


@pytest.mark.parametrize("t", [2, 3, 4])
def test_g_sums_the_partial_products_forward_and_is_the_identity_backward(t):
    rng = np.random.default_rng(1)
    parts, grad = rng.standard_normal((t, 5, 6)), rng.standard_normal((5, 6))

    def fn(comm):
        inputs = Tensor(parts[comm.Get_rank()].copy(), requires_grad=True)
        out = g(inputs * 1.0, _on_group(comm))  # (g all-reduces its input in place: give it a product to own)
        forward = out.data.copy()
        out.backward(grad.copy())
        return forward, inputs.grad

    for forward, back in sim.run(t, fn):
        assert np.allclose(forward, parts.sum(axis=0), rtol=1e-14, atol=0)
        assert np.array_equal(back, grad)


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_a_column_then_row_block_is_the_unsharded_block_with_one_allreduce_each_way(t, input_needs_grad):
    """Linear(16, 32) -> relu -> Linear(32, 8) on the whole matrices is the oracle: the block's output, the gradient of
    its input and of every slice of the weights. The tracer counts one all-reduce forward (g) and one backward (f);
    none backward when the input is data that needs no gradient (the first block of a model)."""
    whole = MLP([16, 32, 8], seed=5, dtype=np.float64)
    x = np.random.default_rng(2).standard_normal((7, 16))
    upstream = np.random.default_rng(3).standard_normal((7, 8))
    inputs = Tensor(x.copy(), requires_grad=input_needs_grad)
    whole(inputs).backward(upstream)
    expected_out = whole(Tensor(x)).data

    def fn(comm):
        prepared = prepare(comm, timeout=0)
        group = TensorGroup(prepared, "ring")
        modules, pieces = shard(whole, 0, 2, group)
        assert [type(m) for m in modules[::2]] == [ColumnParallelLinear, RowParallelLinear]
        mine = Tensor(x.copy(), requires_grad=input_needs_grad)
        out = mine
        for module in modules:
            out = module(out)
        out.backward(upstream.copy())
        grads = [p.grad for m in modules[::2] for p in (m.weight, m.bias)]
        return out.data, mine.grad, grads, pieces, prepared.tracer.summary()["operations"]

    for out, grad_in, grads, pieces, operations in sim.run(t, fn):
        assert relative(out, expected_out) < 1e-13
        if input_needs_grad:
            assert relative(grad_in, inputs.grad) < 1e-13
        whole_grads = whole.flat_grads
        for piece, mine in zip(pieces, grads):  # each slice's gradient is that slice of the whole gradient
            assert relative(mine, piece.view(whole_grads)) < 1e-13
        calls = {label: ops["calls"] for label, ops in operations.items()}
        expected = {} if t == 1 else {"tp/g-forward": 1, **({"tp/f-backward": 1} if input_needs_grad else {})}
        assert calls == expected


def test_pieces_cover_the_whole_model_and_take_and_put_are_inverse():
    """Every element of the whole flat buffer is held by some rank of the group; taking a rank's pieces and putting
    every rank's back rebuilds the buffer exactly."""
    whole = MLP(SIZES, seed=1, dtype=np.float64)
    flat = np.random.default_rng(0).standard_normal(whole.flat_params.size)
    for t in (1, 2, 4):
        rebuilt, covered = np.zeros_like(flat), np.zeros(flat.size, dtype=bool)
        for rank in range(t):
            group = type("Group", (), {"rank": rank, "size": t})()
            _, pieces = shard(whole, 0, len(SIZES) - 1, group)
            local = np.empty(sum(p.size for p in pieces))
            placement.take(flat, pieces, local)
            placement.put(local, pieces, rebuilt)
            for piece in pieces:
                piece.view(covered)[...] = True
            assert local.size == local_parameters(SIZES, t)
        assert covered.all() and np.array_equal(rebuilt, flat)


def test_the_plan_pairs_layers_and_replicates_the_one_left_over():
    assert split(4) == ["column", "row", "column", "row"]
    assert split(3) == ["column", "row", "replicated"]
    assert split(1) == ["replicated"]


def test_split_layers_hold_one_tth_and_the_replicated_layer_is_whole():
    """The docstring's memory formula, written out: per block (i h + h + h o) / T + o; the output layer whole."""
    for t in (1, 3):
        assert local_parameters(ODD, t) == (64 * 24 + 24 + 24 * 16) // t + 16 + 16 * 10 + 10
    n = parallel.parameter_count(SIZES)
    assert local_parameters(SIZES, 1) == n
    assert local_parameters(SIZES, 4) == (64 * 32 + 32 + 32 * 16 + 16 * 32 + 32 + 32 * 10) // 4 + 16 + 10


# --- training: the same steps as one process --------------------------------------------------------------------


GRIDS = {
    "tp2": (2, dict(tp=2), SIZES),
    "tp4": (4, dict(tp=4), SIZES),
    "dp2xtp2": (4, dict(dp=2, tp=2), SIZES),
    "tp3": (3, dict(tp=3), ODD),
    "dp2xtp3": (6, dict(dp=2, tp=3), ODD),
    "dp2xtp1": (2, dict(tp=1), SIZES),
}


@pytest.mark.parametrize(("p", "flags", "sizes"), list(GRIDS.values()), ids=list(GRIDS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tensor_parallel_follows_one_process_with_the_same_global_batch(p, flags, sizes, optimizer, data64):
    # Each row-parallel sum (g) and each f adds T partial products in another order than one matrix product does:
    # ~1e-16 relative per element per step; after 3 steps ~1e-13 (SGD). Adam divides by each element's own root
    # mean square, which amplifies a rounding difference in a tiny gradient element: 1e-11, as for ddp and zero.
    extra = {"optimizer": "adam", "lr": 0.01} if optimizer == "adam" else {}
    expected = sim.run(1, run, config(paradigm="single", **extra), data64, model_of(sizes))[0][0]
    results = sim.run(p, run, tp(sizes, **flags, **extra), data64, model_of(sizes))
    for params, _, _ in results:
        assert relative(params, expected) < (1e-12 if optimizer == "sgd" else 1e-11)
    assert all(np.array_equal(params, results[0][0]) for params, _, _ in results)  # one model, however it is held


def test_float32_within_the_rounding_bound(data64):
    # As ddp's float32 test: a different order of summation changes each element by a few eps32 (1.2e-7) of its size
    # per step; 3 steps stay far below 1e-5. A lost partial product or a bias added T times is ~1e-2.
    data = batches(np.float32)
    expected = sim.run(1, run, config(paradigm="single", dtype="float32"), data, model_of(SIZES))[0][0]
    for p, flags in ((2, dict(tp=2)), (4, dict(tp=4)), (4, dict(dp=2, tp=2))):
        for params, _, _ in sim.run(p, run, tp(dtype="float32", **flags), data, model_of(SIZES)):
            assert relative(params, expected) < 1e-5


def test_accumulation_changes_nothing_but_the_traffic(data64, single64):
    for params, _, _ in sim.run(4, run, tp(dp=2, tp=2, accumulate=2), data64, model_of(SIZES)):
        assert relative(params, single64[tuple(SIZES)]) < 1e-12


def test_one_tensor_rank_is_single_bit_for_bit():
    """Where the arithmetic is the same, so are the weights: with one tensor rank f and g do nothing, and the layers
    compute x @ W + b as single's do. (With T > 1 the row-parallel sums run in another order: equal to ~1e-13.)"""
    for p, flags in ((1, {}), (2, dict(dp=2, tp=1))):
        digest = on_sim(p, paradigm="tp", epochs=1, **flags)["weights_sha256"]
        reference = on_sim(p, paradigm="ddp" if p > 1 else "single", epochs=1)["weights_sha256"]
        assert digest == reference


# --- the cost as code, against the tracer and the arrays ---------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("algorithm", ["ring", "auto", "tree"])
@pytest.mark.parametrize(("p", "flags"), [(2, dict(tp=2)), (4, dict(tp=4)), (4, dict(dp=2, tp=2)), (3, dict(tp=3))])
def test_traced_bytes_per_step_equal_the_cost_function(p, flags, algorithm, accumulate, data64):
    sizes = ODD if flags.get("tp") == 3 else SIZES
    cfg = tp(sizes, allreduce=algorithm, accumulate=accumulate, **flags)
    predicted = TensorParallel.costs(sizes, p, cfg)["sent_per_step"]
    blocks = split(len(sizes) - 1).count("row")
    shape = TensorParallel.shape_of(cfg, p)
    for rank, (_, summary, _) in enumerate(sim.run(p, run, cfg, data64, model_of(sizes))):
        operations = summary["operations"]
        training = {label: ops for label, ops in operations.items() if label not in ("checkpoint", "evaluation")}
        assert sum(ops["bytes_sent"] for ops in training.values()) == STEPS * predicted[rank]
        # per step and micro-batch: one g per block forward, one f per block backward but the first's
        assert training["tp/g-forward"]["calls"] == STEPS * accumulate * blocks
        if blocks > 1:
            assert training["tp/f-backward"]["calls"] == STEPS * accumulate * (blocks - 1)
        if shape.dp > 1:
            assert training["dp/allreduce-gradients"]["calls"] == STEPS
        assert set(training) <= {"tp/g-forward", "tp/f-backward", "dp/allreduce-gradients"}


def test_the_bytes_are_the_docstrings_formula_for_the_ring():
    """On the ring, 2 (T-1)/T of every all-reduced buffer: g's m x o per block, f's m x i per block but the first,
    and the dp group's all-reduce of the local parameters."""
    for dp, t in ((1, 2), (1, 4), (2, 2)):
        cfg = tp(allreduce="ring", dp=dp, tp=t)
        m = BATCH // dp
        activations = m * 16 + m * 10 + m * 16  # g of blocks 1 and 2, f of block 2 (its input is 16 wide)
        expected = 2 * (t - 1) / t * activations * 8 + 2 * (dp - 1) / dp * local_parameters(SIZES, t) * 8
        assert TensorParallel.costs(SIZES, dp * t, cfg)["sent_per_step"] == [expected] * (dp * t)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_bytes_held_equal_the_cost_function_and_one_tth_of_the_split_layers(optimizer, data64):
    extra = {"optimizer": "adam", "lr": 0.01} if optimizer == "adam" else {}
    for p, flags in ((2, dict(tp=2)), (4, dict(tp=4)), (4, dict(dp=2, tp=2))):
        cfg = tp(**flags, **extra)
        predicted = TensorParallel.costs(SIZES, p, cfg)
        for rank, (_, _, figures) in enumerate(sim.run(p, run, cfg, data64, model_of(SIZES))):
            held = figures["held_bytes"][rank]
            assert held == {kind: predicted[kind] for kind in ("parameters", "gradients", "optimizer")}


def test_replicated_parameters_that_differ_are_an_error_naming_the_ranks(data64):
    """The output layer and the row-parallel biases are held whole by every rank of the group and must agree."""

    def fn(comm):
        paradigm = TensorParallel(prepare(comm, timeout=0), tp(tp=2))
        paradigm.build(model_of(SIZES), lambda m: make_optimizer("sgd", m, 0.1))
        if comm.Get_rank() == 1:
            paradigm.model.layers[-1].bias.data[0] += 1e-9  # the replicated output layer
        paradigm.finish()

    with pytest.raises(sim.SimRankError, match=r"replicated parameters of a tensor group.*\[1\]"):
        sim.run(2, fn)


# --- the driver: checkpoints, bad input, real ranks -------------------------------------------------------------

FAST = dict(hidden=(32, 16), batch_size=48, progress=False, quiet=True, timeout=0, dtype="float64")


def on_sim(p, **overrides):
    return train_util.on_sim(p, FAST, **overrides)


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ((2, dict(paradigm="tp")), (1, dict(paradigm="single"))),
        ((1, dict(paradigm="single")), (4, dict(paradigm="tp", tp=2))),
        ((4, dict(paradigm="tp", tp=4)), (2, dict(paradigm="zero", zero_stage=3))),
        ((3, dict(paradigm="ddp")), (2, dict(paradigm="tp", optimizer="sgd"))),
    ],
    ids=["tp2 -> single", "single -> dp2xtp2", "tp4 -> zero3", "ddp on 3 -> tp2"],
)
def test_a_checkpoint_is_resumed_by_another_paradigm_or_grid(writer, reader, tmp_path):
    train_util.check_resumed_elsewhere(tmp_path / "ckpt", FAST, writer, reader)


def test_the_driver_follows_single_and_evaluation_traffic_is_labelled():
    single = on_sim(1, paradigm="single", epochs=2)
    metrics = on_sim(4, paradigm="tp", tp=2, epochs=2)
    for ours, theirs in zip(metrics["epochs"], single["epochs"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-12)
        assert ours["test_accuracy"] == theirs["test_accuracy"]
    operations = metrics["communication"]["per_rank"][1]["operations"]
    assert operations["evaluation"]["bytes_sent"] > 0  # g's all-reduces on the test set, not training's
    assert metrics["model"]["parameters"] == parallel.parameter_count([64, 32, 16, 10])


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (dict(tp=2, hidden=(33, 16)), 2, "--tp 2 does not divide the width 33 between layers 0 and 1"),
        (dict(tp=3), 6, "--tp 3 does not divide the width 32 between layers 0 and 1"),
        (dict(dp=3, tp=2), 4, "--dp 3 x --tp 2 x --pp 1 = 6 ranks, but 4 were launched"),
        (dict(tp=4), 2, "--tp 4 is more than the 2 rank"),
        (dict(tp=2, allreduce="hierarchical"), 2, "--allreduce hierarchical is not available to --paradigm tp"),
        (dict(tp=2, microbatches=2), 2, "--microbatches is a flag of --paradigm pp, not of tp"),
        (dict(dp=2, tp=2, batch_size=47), 4, "must split evenly over the 2 trainers (of 4 ranks)"),
        (dict(tp=2, hidden=()), 2, "--tp 2 splits pairs of Linear layers"),
        (dict(dp=3), 4, "--dp 3 (the tp groups take the rest) does not divide the 4 ranks launched"),
    ],
)
def test_bad_flags_are_one_clear_error_before_any_communication(overrides, world, message):
    cfg = TrainConfig(**{**FAST, "paradigm": "tp", **overrides})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallel.get("tp").check(cfg, world)


def test_a_tensor_flag_on_another_paradigm_is_refused():
    with pytest.raises(ConfigError, match="--tp is a flag of --paradigm tp, pp, not of ddp"):
        parallel.get("ddp").check(TrainConfig(**{**FAST, "paradigm": "ddp", "tp": 2}), 2)


def test_more_tensor_ranks_than_launched_is_one_line_on_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dtrain", "train", "--paradigm", "tp", "--tp", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["dtrain: error: --tp 2 is more than the 1 rank(s) launched"]
    assert not (tmp_path / "metrics.json").exists()


COMMON = ["--hidden", "64,32", "--epochs", "2", "--dtype", "float64", "--batch-size", "48", "--no-progress",
          "--quiet"]  # fmt: skip


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "flags"), [(2, ["--tp", "2"]), (4, ["--tp", "4"]), (4, ["--dp", "2", "--tp", "2"])])
def test_under_mpiexec_tensor_parallel_follows_single(ranks, flags, tmp_path):
    """Real ranks, float64: each epoch's global train loss and the test loss are single's to rounding, every rank's
    traced bytes are the cost function's per step."""
    metrics = train_util.follows_single(tmp_path, ranks, COMMON, "--paradigm", "tp", *flags)
    steps = len(metrics["epochs"]) * steps_per_epoch(metrics["dataset"]["train_samples"], 48)
    for rank, mine in enumerate(metrics["communication"]["per_rank"]):
        sent = sum(ops["bytes_sent"] for label, ops in mine["operations"].items() if label.startswith(("tp/", "dp/")))
        assert sent == steps * metrics["costs"]["sent_per_step"][rank]
        assert mine["paradigm"]["held_bytes"][rank]["parameters"] == metrics["costs"]["parameters"]
    tensor = int(flags[flags.index("--tp") + 1])
    assert metrics["communication"]["per_rank"][0]["paradigm"]["grid"] == {"dp": ranks // tensor, "tp": tensor, "pp": 1}


BAD_ON_THREE = [
    ("tp", ["--tp", "3"], "--tp 3 does not divide the width 128 between layers 0 and 1"),
    ("pp", ["--pp", "3", "--hidden", "none"], "3 pipeline stages but the model has 1 Linear layers"),
]


@pytest.mark.mpi
@pytest.mark.parametrize(("paradigm", "flags", "message"), BAD_ON_THREE)
def test_bad_flags_under_mpiexec_are_one_line_per_rank_and_no_hang(paradigm, flags, message, tmp_path):
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "3", "-m", "dtrain", "train", "--paradigm", paradigm,
               *flags, "--batch-size", "48", "--no-progress", "--out", str(tmp_path / "out")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("dtrain: error")]
    assert lines and all(line.endswith(message) or message in line for line in lines), result.stderr
    assert not (tmp_path / "out").exists()


def test_shard_refuses_a_width_the_group_does_not_divide():
    """Called directly (as lessons do), not only through the paradigm's checks: no column may be dropped silently."""
    group = type("Group", (), {"rank": 0, "size": 4})()
    with pytest.raises(ConfigError, match="--tp 4 does not divide the width 30 between layers 0 and 1"):
        shard(MLP([16, 30, 8], seed=0), 0, 2, group)

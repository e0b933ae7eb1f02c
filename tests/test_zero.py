"""ZeRO stages 1-3 against their oracles: one process's training, the cost formulas, and the flat checkpoint format.

Every stage with SGD (momentum) and Adam on N = 1..4 ranks must hold, after k steps, the parameters one process holds
after k steps with the same global batch; traced bytes per step and the ledger's peak bytes per rank must equal
:meth:`Zero.costs` exactly; a checkpoint written by one stage and world size is resumed by another, by ddp and by
single.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import train_util
from test_data_parallel import BATCH, SIZES, STEPS, batches, config, make_model, relative, run

from dtrain import parallel
from dtrain.comm import sim
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import steps_per_epoch
from dtrain.errors import ConfigError
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel.zero import Zero, paper_formula

ADAM_LR = 0.01


def zero(stage, **overrides) -> TrainConfig:
    return config(paradigm="zero", zero_stage=stage, **overrides)


@pytest.fixture(scope="module")
def single64(data64):
    """One process's parameters after STEPS steps, per optimizer."""
    return {
        "sgd": sim.run(1, run, config(paradigm="single"), data64)[0][0],
        "adam": sim.run(1, run, config(paradigm="single", optimizer="adam", lr=ADAM_LR), data64)[0][0],
    }


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_follows_one_process_with_the_same_global_batch(stage, optimizer, p, data64, single64):
    # SGD: the only difference is the order in which the p slices' gradients are summed (~1e-16 per step). Adam
    # divides each element by the root of its own squared gradient, so a rounding difference in a gradient element
    # that is itself ~1e-6 of the largest comes out ~1e-12 relative after 3 steps: ddp shows the same (1.4e-12 at p=3).
    extra = {"optimizer": "adam", "lr": ADAM_LR} if optimizer == "adam" else {}
    results = sim.run(p, run, zero(stage, **extra), data64)
    bound = 1e-12 if optimizer == "sgd" else 1e-11
    for params, _, _ in results:
        assert relative(params, single64[optimizer]) < bound
    assert all(np.array_equal(params, results[0][0]) for params, _, _ in results)  # one model, however it is held


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_float32_within_the_rounding_bound(stage):
    # As ddp's float32 test: a different summation order changes each averaged gradient element by a few eps32 of
    # its size; after 3 steps that is far below 1e-5 of the parameters. A lost chunk or a missing 1/p is ~1e-2.
    data = batches(np.float32)
    expected = sim.run(1, run, config(paradigm="single", dtype="float32"), data)[0][0]
    for p in (2, 3, 4):
        for params, _, _ in sim.run(p, run, zero(stage, dtype="float32"), data):
            assert relative(params, expected) < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulating_micro_batches_changes_nothing_but_the_traffic(stage, data64, single64):
    for p in (2, 3):
        results = sim.run(p, run, zero(stage, accumulate=2), data64)
        for params, _, _ in results:
            assert relative(params, single64["sgd"]) < 1e-12


PAIRS = [("ring", p) for p in (2, 3, 4)] + [("rabenseifner", p) for p in (2, 4)]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize(("algorithm", "p"), PAIRS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_traced_bytes_per_step_equal_the_cost_function(stage, algorithm, p, accumulate, data64):
    cfg = zero(stage, allreduce=algorithm, accumulate=accumulate)
    predicted = Zero.costs(SIZES, p, cfg)["sent_per_step"]
    layers = len(SIZES) - 1
    gather = "doubling" if algorithm == "rabenseifner" else "ring"
    gathers = {1: ["params"], 2: ["params"], 3: ["forward", "backward"]}[stage]
    for rank, (_, summary, _) in enumerate(sim.run(p, run, cfg, data64)):
        operations = summary["operations"]
        training = {label: ops for label, ops in operations.items() if label.startswith("zero/")}
        assert sum(ops["bytes_sent"] for ops in training.values()) == STEPS * predicted[rank]
        # the calls, per step: one reduce-scatter per layer (per micro-batch from stage 2), the gathers per layer
        scatters = layers * (accumulate if stage > 1 else 1)
        assert training[f"zero/reduce-scatter/{algorithm}"]["calls"] == STEPS * scatters
        for when in gathers:
            calls = layers * (accumulate if stage == 3 else 1)
            assert training[f"zero/allgather-{when}/{gather}"]["calls"] == STEPS * calls
        assert set(operations) - set(training) <= {"checkpoint"}  # stage 3's final gather, not training


def test_stages_1_and_2_send_what_a_ring_all_reduce_sends_and_stage_3_half_as_much_again():
    """The formula's shape, on a model whose layers all split evenly (so no rounding of chunks blurs the ratio)."""
    sizes = [63, 64, 64, 8]  # 64*64+64 and 8*64+8 ... every layer's size is a multiple of 4
    for p in (2, 4):
        ddp = sum(parallel.get("ddp").costs(sizes, p, config(allreduce="ring", bucket_mb=0))["sent_per_step"])
        for stage, ratio in ((1, 1.0), (2, 1.0), (3, 1.5)):
            assert sum(Zero.costs(sizes, p, zero(stage, allreduce="ring"))["sent_per_step"]) == ratio * ddp


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_peak_bytes_held_equal_the_formula_on_every_rank(stage, optimizer, data64):
    extra = {"optimizer": "adam", "lr": ADAM_LR} if optimizer == "adam" else {}
    for p in (1, 2, 3, 4):
        cfg = zero(stage, **extra)
        predicted = Zero.costs(SIZES, p, cfg)
        for rank, (_, _, figures) in enumerate(sim.run(p, run, cfg, data64)):
            held = figures["held_bytes"][rank]
            assert held == {kind: predicted[kind][rank] for kind in ("parameters", "gradients", "optimizer")}
    # and the formula against the plain arithmetic of the table: n parameters, 8 bytes, p = 4, momentum
    n = parallel.parameter_count(SIZES)
    costs = Zero.costs(SIZES, 4, zero(stage, **extra))
    chunks = [sum(b - a for a, b in (chunk(size, 4)[r] for size in layer_sizes(SIZES))) for r in range(4)]
    assert sum(chunks) == n
    per_element = {"sgd": 1, "adam": 2}[optimizer]
    assert costs["optimizer"] == [per_element * s * 8 for s in chunks]


def test_costs_are_the_papers_formula_plus_the_layer_in_flight():
    """On a model whose layers split evenly, costs() is the ZeRO paper's per-stage formula in dtrain's terms
    (paper_formula, written from the paper's table) plus the one layer in flight that the paper leaves out; stage 0
    of the formula is ddp's own cost function."""
    sizes = [63, 64, 64, 8]  # layers of 4096, 4160 and 520 parameters: each divides by 2 and by 4
    n, largest = parallel.parameter_count(sizes), max(layer_sizes(sizes))
    for p, optimizer, momentum in itertools.product((2, 4), ("sgd", "adam"), (0.0, 0.9)):
        k = {"sgd": 1 if momentum else 0, "adam": 2}[optimizer]
        ddp = parallel.get("ddp").costs(sizes, p, config(optimizer=optimizer, momentum=momentum))
        assert {kind: ddp[kind] for kind in ("parameters", "gradients", "optimizer")} == paper_formula(n, p, 0, 8, k)
        for stage in (1, 2, 3):
            costs = Zero.costs(sizes, p, zero(stage, optimizer=optimizer, momentum=momentum))
            in_flight = {"parameters": stage == 3, "gradients": stage >= 2, "optimizer": False}
            for kind, expected in paper_formula(n, p, stage, 8, k).items():
                assert costs[kind] == [expected + in_flight[kind] * largest * 8] * p, (stage, kind)


def test_stage_3_gathers_one_layer_at_a_time_and_frees_it():
    """The ledger's history of one stage-3 step: each layer's parameters are held whole only between its gather and
    its free (forward in layer order, backward in reverse), its whole gradient only until it is reduce-scattered."""
    data = batches(np.float64)

    def one_step(comm):
        cfg = zero(3)
        paradigm = Zero(prepare(comm, timeout=0), cfg)
        paradigm.build(make_model(cfg), lambda m: make_optimizer("sgd", m, cfg.lr, cfg.momentum))
        paradigm.ledger.start_recording()
        local = BATCH // comm.Get_size()
        x, y = data[0]
        r = comm.Get_rank()
        paradigm.step(x[r * local : (r + 1) * local], y[r * local : (r + 1) * local])
        return paradigm.ledger.history, [u.size for u in paradigm.units]

    for history, sizes in sim.run(2, one_step):
        at_rest = history[0][1]
        whole = [held for _, held in history]
        steps = [(what, b["parameters"] - a["parameters"], b["gradients"] - a["gradients"])
                 for (what, b), a in zip(history[1:], whole)]  # fmt: skip
        layers = range(len(sizes))
        expected = [(f"layer {i}: gathered for forward", 8 * sizes[i], 0) for i in layers]
        expected = [e for i in layers for e in (expected[i], (f"layer {i}: forward done, freed", -8 * sizes[i], 0))]
        for i in reversed(layers):
            expected += [
                (f"layer {i}: gathered for backward", 8 * sizes[i], 0),
                (f"layer {i}: backward done, freed", -8 * sizes[i], 0),
                (f"layer {i}: its whole gradient", 0, 8 * sizes[i]),
                (f"layer {i}: gradient reduce-scattered, freed", 0, -8 * sizes[i]),
            ]
        assert steps == expected
        assert whole[-1] == at_rest  # nothing left over after the step


def layer_sizes(sizes):
    return [a * b + b for a, b in itertools.pairwise(sizes)]


def chunk(size, p):
    from dtrain.collectives import chunk_bounds

    return chunk_bounds(size, p)


def test_stage_3_never_holds_more_than_its_chunks_and_the_largest_layer():
    """On a deep model (five layers, each about a fifth of it) a stage-3 rank's parameter peak is its share plus one
    layer: about 45% of the model on 4 ranks, where ddp holds 100%."""
    sizes = [64, 64, 64, 64, 64, 10]
    data = batches(np.float64)

    def model():
        return MLP(sizes, seed=3, dtype=np.float64)

    n, largest = parallel.parameter_count(sizes), max(layer_sizes(sizes))
    for p in (2, 4):
        for rank, (_, _, figures) in enumerate(sim.run(p, run, zero(3), data, model)):
            peak = figures["held_bytes"][rank]["parameters"]
            # each layer's chunk may be one element longer than 1/p of it: at most one element per layer
            assert peak <= (n / p + largest + len(sizes) - 1) * 8
            assert peak < n * 8
            assert figures["held_bytes"][rank]["gradients"] == peak  # chunks plus the layer in flight, again


# --- checkpoints: the flat format, whatever wrote them ------------------------------------------------------------

FAST = dict(hidden=(32,), batch_size=48, progress=False, quiet=True, timeout=0, dtype="float64")


def on_sim(p, **overrides):
    return train_util.on_sim(p, FAST, **overrides)


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ((3, dict(paradigm="zero", zero_stage=3)), (2, dict(paradigm="ddp"))),
        ((2, dict(paradigm="zero", zero_stage=2)), (1, dict(paradigm="single"))),
        ((2, dict(paradigm="ddp")), (4, dict(paradigm="zero", zero_stage=3))),
        ((4, dict(paradigm="zero", zero_stage=1)), (3, dict(paradigm="zero", zero_stage=2))),
    ],
    ids=["zero3 on 3 -> ddp on 2", "zero2 on 2 -> single", "ddp on 2 -> zero3 on 4", "zero1 on 4 -> zero2 on 3"],
)
def test_a_checkpoint_is_resumed_by_another_stage_world_size_or_paradigm(writer, reader, tmp_path):
    """One epoch by the writer, then the reader resumes for a second: the same trajectory as the writer's
    uninterrupted run."""
    train_util.check_resumed_elsewhere(tmp_path / "ckpt", FAST, writer, reader, reference=writer)


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (dict(paradigm="zero", zero_stage=4), 2, "--zero-stage 4 is not a ZeRO stage: choose 1, 2 or 3"),
        (dict(paradigm="zero", zero_stage=0), 2, "--zero-stage 0 is not a ZeRO stage"),
        (dict(paradigm="zero", allreduce="rabenseifner"), 3, "rabenseifner needs a power-of-two number of ranks"),
        (dict(paradigm="zero", allreduce="tree"), 2, "--allreduce tree has no reduce-scatter/all-gather pair"),
        (dict(paradigm="ddp", zero_stage=2), 2, "--zero-stage is a flag of --paradigm zero, not of ddp"),
    ],
)
def test_bad_flags_are_refused_before_any_communication(overrides, world, message):
    cfg = TrainConfig(**{**FAST, **overrides})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parallel.get(cfg.paradigm).check(cfg, world)


def test_zero_on_one_rank_trains_and_says_it_is_plain_training(capsys):
    metrics = on_sim(1, paradigm="zero", zero_stage=2, epochs=1, quiet=False)
    single = on_sim(1, paradigm="single", epochs=1)
    assert "nothing to shard, this is plain training" in capsys.readouterr().out
    assert metrics["weights_sha256"] == single["weights_sha256"]  # one rank: the same arithmetic, bit for bit


def test_auto_takes_halving_and_doubling_on_a_power_of_two_and_the_ring_elsewhere():
    cfg = zero(3, allreduce="auto")
    assert [Zero.pair(cfg, p) for p in (1, 2, 3, 4, 6, 8)] == [("ring", "ring"), ("rabenseifner", "doubling"),
        ("ring", "ring"), ("rabenseifner", "doubling"), ("ring", "ring"), ("rabenseifner", "doubling")]  # fmt: skip


def test_a_bad_stage_on_the_command_line_is_one_line_and_no_run(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dtrain", "train", "--paradigm", "zero", "--zero-stage", "5", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--zero-stage: invalid choice: 5" in result.stderr
    assert not (tmp_path / "metrics.json").exists()


# --- real ranks -----------------------------------------------------------------------------------------------------


COMMON = ["--hidden", "64", "--epochs", "2", "--dtype", "float64", "--batch-size", "48", "--no-progress", "--quiet"]


def _train(tmp_path, name, ranks, *flags):
    return train_util.train_cli(tmp_path / name, ranks, *COMMON, *flags, timeout=240)


@pytest.mark.parametrize(("stage", "p"), [(1, 2), (2, 3), (3, 4), (3, 3)])
def test_under_mpiexec_every_stage_follows_single(stage, p, tmp_path):
    """Real ranks, float64: each epoch's global train loss and the test loss are single's to rounding, and every
    rank's traced bytes are the cost function's per step."""
    single = _train(tmp_path, "single", 1, "--paradigm", "single")
    metrics = _train(tmp_path, "zero", p, "--paradigm", "zero", "--zero-stage", str(stage))
    for ours, theirs in zip(metrics["epochs"], single["epochs"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-10)
        assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-10)
    steps = len(metrics["epochs"]) * steps_per_epoch(metrics["dataset"]["train_samples"], 48)
    for rank, mine in enumerate(metrics["communication"]["per_rank"]):
        sent = sum(ops["bytes_sent"] for label, ops in mine["operations"].items() if label.startswith("zero/"))
        assert sent == steps * metrics["costs"]["sent_per_step"][rank]
        assert mine["paradigm"]["held_bytes"][rank]["parameters"] == metrics["costs"]["parameters"][rank]

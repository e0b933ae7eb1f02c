"""Pipeline parallelism against its oracles: the schedules' rules checked without MPI, one process's training, the
cost formulas, the activations the interpreter counts, and the flat checkpoint format.

A schedule must run every micro-batch's forward before its backward, match its sends and receives one to one, never
deadlock, and keep as many activations in flight as the formulas say; its simulated bubble is (P-1)/(VM+P-1)
exactly. ``pp`` on P stages with M micro-batches runs, with dp = tp = 1, exactly the arithmetic of one process
accumulating M micro-batches (bit-identical weights), and follows one process on the whole batch to ~1e-12 on any
grid; bytes sent and held, and peak activation bytes, equal :meth:`Pipeline.costs` on every rank.
"""

from __future__ import annotations

import itertools
import json
import threading

import numpy as np
import pytest
import train_util
from test_data_parallel import STEPS, batches, config, for_model, model_of, relative, run

from dtrain import checkpoint, parallel
from dtrain.comm import sim, watchdog
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import steps_per_epoch
from dtrain.errors import ConfigError
from dtrain.optim import make_optimizer
from dtrain.parallel import schedules
from dtrain.parallel.pipeline import Pipeline
from dtrain.parallel.schedules import END_OF_STEP, AllReduceGradients, OptimizerStep, WaitSends
from dtrain.parallel.stages import cut, units

FOUR = [64, 32, 32, 16, 10]  # four Linear layers: P = 2 with V = 2 interleaved, P = 4
EIGHT = [64, 32, 32, 16, 16, 16, 16, 16, 10]  # eight: P = 4 with V = 2
CASES = [(P, M, name, V) for P in (1, 2, 3, 4) for M in (1, 2, 3, 4, 8)
         for name, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
         if name != "interleaved" or (M % P == 0 and P > 1)]  # fmt: skip


# --- the schedules, as data ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("P", "M", "name", "V"), CASES)
def test_every_schedule_keeps_the_rules_and_never_deadlocks(P, M, name, V):
    schedule = schedules.build(name, P, M, V)
    schedules.check(schedule, M, V)  # forward before backward, on the right rank; sends and receives one to one
    timeline = schedules.simulate(schedule, 1.0, 2.0, V)  # the message order, run: raises on a deadlock
    assert len(timeline) == 2 * P * V * M
    assert END_OF_STEP == (WaitSends(), AllReduceGradients(), OptimizerStep())
    assert all(tuple(program[-3:]) == END_OF_STEP for program in schedule)  # the same end on every rank


@pytest.mark.parametrize(("P", "M", "name", "V"), CASES)
def test_the_simulated_bubble_is_the_formula(P, M, name, V):
    """Balanced stages, t_B = 2 t_F: the idle fraction is (P-1)/(VM+P-1) exactly, for every schedule."""
    for forward, backward in ((1.0, 2.0), (1.0, 1.0)):
        timeline = schedules.simulate(schedules.build(name, P, M, V), forward, backward, V)
        assert schedules.bubble(timeline) == pytest.approx(schedules.bubble_formula(P, M, V), abs=1e-12)


@pytest.mark.parametrize("M", [1, 2, 4, 8])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_1f1b_warms_up_with_p_minus_s_minus_1_forwards_and_keeps_at_most_p_in_flight(P, M):
    for s, program in enumerate(schedules.one_f_one_b(P, M)):
        warmup = [ins for ins in program if ins.op == "forward" and ins.phase == "warm-up"]
        assert len(warmup) == min(P - s - 1, M)
        first_backward = next(i for i, ins in enumerate(program) if ins.op == "backward")
        assert sum(ins.op == "forward" for ins in program[:first_backward]) == min(P - s, M)
        assert schedules.in_flight(program) == min(P - s, M) <= P
    for program in schedules.gpipe(P, M):
        assert schedules.in_flight(program) == M


def test_interleaving_warms_up_as_megatron_does():
    """2 (P - r - 1) + (V - 1) P chunk-forwards before the steady state; all of them when M = P."""
    P, V = 4, 2
    for M in (4, 8):
        for r, program in enumerate(schedules.interleaved_1f1b(P, M, V)):
            warmup = sum(ins.op == "forward" and ins.phase == "warm-up" for ins in program)
            assert warmup == (M * V if M == P else min(2 * (P - r - 1) + (V - 1) * P, M * V))


def test_a_broken_schedule_is_caught():
    good = schedules.one_f_one_b(3, 4)
    no_recv = [list(p) for p in good]
    no_recv[1] = [ins for ins in no_recv[1] if not (ins.op == "recv" and ins.micro == 2)]
    with pytest.raises(ValueError, match="do not match one to one"):
        schedules.check(no_recv, 4)
    backward_first = [list(p) for p in good]
    f0 = next(i for i, ins in enumerate(backward_first[2]) if ins.op == "forward" and ins.micro == 0)
    b0 = next(i for i, ins in enumerate(backward_first[2]) if ins.op == "backward" and ins.micro == 0)
    backward_first[2][f0], backward_first[2][b0] = backward_first[2][b0], backward_first[2][f0]
    with pytest.raises(ValueError, match="before its forward"):
        schedules.check(backward_first, 4)
    # stage 1 waits for micro-batch 0's gradient before sending micro-batch 0 on: a cycle, whatever the timing
    cycle = [list(p) for p in good]
    send = next(i for i, ins in enumerate(cycle[1]) if ins.op == "send" and ins.kind == "activation" and ins.micro == 0)
    recv = next(i for i, ins in enumerate(cycle[1]) if ins.op == "recv" and ins.kind == "gradient" and ins.micro == 0)
    cycle[1].insert(recv, cycle[1].pop(send))
    schedules.check(cycle, 4)  # every rule of matching holds ...
    waits = "rank 1 waits at recv gradient 0 <- 2; rank 2 waits at recv activation 0 <- 1"
    with pytest.raises(RuntimeError, match=waits):
        schedules.simulate(cycle)  # ... and yet it can never finish


def test_the_cut_makes_the_largest_stage_smallest():
    """Against every possible cut, by brute force; and equal layers for interleaving."""
    for sizes in ([64, 128, 128, 10], [784, 64, 512, 512, 32, 10], EIGHT, [10, 400, 10, 400, 10, 400, 10]):
        weights = [a * b + b for a, b in itertools.pairwise(sizes)]
        for stages in range(1, len(weights) + 1):
            bounds = cut(sizes, stages)
            assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == stages + 1
            assert all(a < b for a, b in itertools.pairwise(bounds))
            best = min(max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *inner, len(weights))))
                       for inner in itertools.combinations(range(1, len(weights)), stages - 1))  # fmt: skip
            assert max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)) == best
    assert cut(EIGHT, 4, equal=True) == [0, 2, 4, 6, 8]


def test_with_tensor_parallelism_the_cut_falls_between_column_then_row_pairs():
    """Every stage then starts with a column layer, so each stage's layers split as the whole model's do (one layer
    left over joins the last pair); and the largest stage is again the smallest possible, against brute force."""
    assert units(5, 2) == [0, 2, 5] and units(4, 2) == [0, 2, 4] and units(1, 2) == [0] and units(3, 1) == [0, 1, 2, 3]
    sizes = [64, 512, 64, 64, 64, 64, 64, 10]  # 7 layers: pairs (0, 1), (2, 3), (4, 5, 6)
    weights = [a * b + b for a, b in itertools.pairwise(sizes)]
    for stages in (1, 2, 3):
        bounds = cut(sizes, stages, tp=2)
        assert set(bounds) <= {0, 2, 4, 7}
        options = [(0, *inner, 7) for inner in itertools.combinations((2, 4), stages - 1)]
        best = min(max(sum(weights[a:b]) for a, b in itertools.pairwise(o)) for o in options)
        assert max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)) == best
    assert cut(EIGHT, 2, equal=True, tp=2) == [0, 4, 8]


# --- training: the same steps as one process ----------------------------------------------------------------------


def pp(sizes, **overrides) -> TrainConfig:
    return for_model("pp", sizes, **overrides)


TRAINING = [(P, M, name) for P in (2, 3, 4) for M in (1, 4, 8) for name in ("gpipe", "1f1b")]
TRAINING += [(2, 4, "interleaved"), (2, 8, "interleaved"), (4, 4, "interleaved"), (4, 8, "interleaved")]


@pytest.mark.parametrize(("P", "M", "name"), TRAINING)
def test_a_pipeline_is_one_process_accumulating_its_micro_batches_bit_for_bit(P, M, name, data64):
    """With dp = tp = 1 the pipeline changes where each layer runs, not what it computes: micro-batch i's gradients
    are added in the same order as one process accumulating M micro-batches adds them. So the weights are the same
    to the last bit, and to ~1e-16 those of one process on the whole batch (another order of summation)."""
    sizes = EIGHT if (name == "interleaved" and P == 4) else FOUR
    accumulating = sim.run(1, run, config(paradigm="single", accumulate=M), data64, model_of(sizes))[0][0]
    whole_batch = sim.run(1, run, config(paradigm="single"), data64, model_of(sizes))[0][0]
    results = sim.SimWorld(P, eager_limit=0).run(run, pp(sizes, pp=P, microbatches=M, schedule=name), data64,
                                                  model_of(sizes))  # fmt: skip
    for params, _, _ in results:  # (eager_limit 0: every send waits for its receive, so ordering bugs deadlock)
        assert np.array_equal(params, accumulating)
        assert relative(params, whole_batch) < 1e-12


GRIDS = {
    "dp2xpp2": (4, dict(dp=2, pp=2)),
    "dp3xpp2": (6, dict(dp=3, pp=2, microbatches=2)),
    "tp2xpp2": (4, dict(tp=2, pp=2)),
    "dp2xtp2xpp2": (8, dict(dp=2, tp=2, pp=2, microbatches=2)),
    "tp2xpp2-interleaved": (8, dict(tp=2, pp=2, schedule="interleaved")),  # (on EIGHT: 4 pairs for 4 chunks)
    "dp2xpp4-gpipe": (8, dict(dp=2, pp=4, schedule="gpipe", microbatches=3)),
}


@pytest.mark.parametrize(("p", "flags"), list(GRIDS.values()), ids=list(GRIDS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_pipeline_grids_follow_one_process_with_the_same_global_batch(p, flags, optimizer, data64):
    # As for ddp and tp: summing the replicas' gradients (dp) or the tensor ranks' partial products (tp) in another
    # order is ~1e-16 per step; Adam amplifies a rounding in a tiny gradient element, hence 1e-11.
    extra = {"optimizer": "adam", "lr": 0.01} if optimizer == "adam" else {}
    sizes = EIGHT if flags.get("schedule") == "interleaved" else FOUR
    expected = sim.run(1, run, config(paradigm="single", **extra), data64, model_of(sizes))[0][0]
    results = sim.SimWorld(p, eager_limit=0).run(run, pp(sizes, **flags, **extra), data64, model_of(sizes))
    for params, _, _ in results:
        assert relative(params, expected) < (1e-12 if optimizer == "sgd" else 1e-11)
    assert all(np.array_equal(params, results[0][0]) for params, _, _ in results)


def test_float32_within_the_rounding_bound():
    # A pipeline in float32 on one replica is bit for bit one process accumulating its micro-batches (above); against
    # one process on the whole batch it differs by the rounding of the micro-batch sums, a few eps32 per step.
    data = batches(np.float32)
    expected = sim.run(1, run, config(paradigm="single", dtype="float32"), data, model_of(FOUR))[0][0]
    for p, flags in ((2, dict(pp=2)), (4, dict(pp=4, schedule="gpipe")), (4, dict(dp=2, pp=2))):
        for params, _, _ in sim.run(p, run, pp(FOUR, dtype="float32", **flags), data, model_of(FOUR)):
            assert relative(params, expected) < 1e-5


# --- the cost as code, against the tracer and the interpreter -----------------------------------------------------

COSTED = [
    (2, dict(pp=2)),
    (3, dict(pp=3, schedule="gpipe")),
    (4, dict(pp=4, microbatches=8)),
    (4, dict(dp=2, pp=2)),
    (4, dict(tp=2, pp=2, microbatches=2)),
    (8, dict(dp=2, tp=2, pp=2)),
    (4, dict(pp=2, schedule="interleaved", dp=2)),
    (4, dict(pp=4, schedule="interleaved", microbatches=8)),
]


@pytest.mark.parametrize(("p", "flags"), COSTED)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_bytes_sent_held_and_activations_equal_the_cost_function(p, flags, optimizer, data64):
    extra = {"optimizer": "adam", "lr": 0.01} if optimizer == "adam" else {}
    sizes = EIGHT if flags.get("pp") == 4 and flags.get("schedule") == "interleaved" else FOUR
    cfg = pp(sizes, **flags, **extra)
    predicted = Pipeline.costs(sizes, p, cfg)
    results = sim.SimWorld(p, eager_limit=0).run(run, cfg, data64, model_of(sizes))
    for rank, (_, summary, figures) in enumerate(results):
        training = {k: ops for k, ops in summary["operations"].items() if k not in ("checkpoint", "evaluation")}
        assert sum(ops["bytes_sent"] for ops in training.values()) == STEPS * predicted["sent_per_step"][rank]
        assert set(training) <= {"pp/activations", "pp/gradients", "pp/sends-in-flight", "tp/g-forward",
                                 "tp/f-backward", "dp/allreduce-gradients"}  # fmt: skip
        held = figures["held_bytes"][rank]
        assert held == {kind: predicted[kind][rank] for kind in ("parameters", "gradients", "optimizer")}
        assert figures["per_rank"][rank]["peak_activation_bytes"] == predicted["activations"][rank]


def test_the_bytes_are_the_docstrings_formula():
    """M m w b activations out of every stage but the last, M m w b gradients out of every stage but the first."""
    cfg = pp(FOUR, pp=4, microbatches=4)
    m = cfg.batch_size // 4
    out_widths, in_widths = FOUR[1:-1], FOUR[1:-1]
    expected = [4 * m * 8 * (([*out_widths, 0][s]) + ([0, *in_widths][s])) for s in range(4)]
    assert Pipeline.costs(FOUR, 4, cfg)["sent_per_step"] == expected


def test_1f1b_keeps_at_most_p_over_m_of_gpipes_activations(data64):
    """Measured by the interpreter on 4 stages with 8 micro-batches: 1F1B's peak on every stage is at most P/M of
    GPipe's (stage s keeps P - s micro-batches where GPipe keeps all M)."""
    P, M = 4, 8
    peaks = {}
    for name in ("gpipe", "1f1b"):
        results = sim.run(P, run, pp(FOUR, pp=P, microbatches=M, schedule=name), data64, model_of(FOUR))
        peaks[name] = [figures["per_rank"][r]["peak_activation_bytes"] for r, (_, _, figures) in enumerate(results)]
    for s in range(P):
        assert peaks["1f1b"][s] <= P / M * peaks["gpipe"][s]
        assert peaks["1f1b"][s] * M == peaks["gpipe"][s] * (P - s)


# --- the driver: evaluation, checkpoints, the trace, bad input, real ranks ----------------------------------------

FAST = dict(hidden=(32, 32, 16), batch_size=48, progress=False, quiet=True, timeout=0, dtype="float64")


def on_sim(p, **overrides):
    return train_util.on_sim(p, FAST, **overrides)


def test_the_driver_follows_single_and_the_timeline_is_in_the_trace(tmp_path):
    single = on_sim(1, paradigm="single", epochs=2)
    trace = tmp_path / "trace.json"
    metrics = on_sim(4, paradigm="pp", pp=2, tp=2, epochs=2, trace=str(trace))
    for ours, theirs in zip(metrics["epochs"], single["epochs"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-12)
        assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-12)
        assert ours["test_accuracy"] == theirs["test_accuracy"]  # the whole test set through the pipeline
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("cat") == "span"]
    for rank in range(4):  # every rank's row shows its forwards and backwards, with their phases
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert any(n.startswith("F0") for n in names) and any(n.startswith("B3") for n in names), names
        assert any(n.endswith("(cool-down)") for n in names) == (rank < 2)  # stage 0 (ranks 0, 1) cools down


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ((2, dict(paradigm="pp")), (1, dict(paradigm="single"))),
        ((1, dict(paradigm="single")), (4, dict(paradigm="pp", pp=2, tp=2))),
        ((4, dict(paradigm="pp", pp=2, schedule="interleaved", hidden=(32, 32, 16))), (2, dict(paradigm="tp"))),
        ((3, dict(paradigm="zero", zero_stage=3)), (3, dict(paradigm="pp", schedule="gpipe"))),
    ],
    ids=["pp2 -> single", "single -> tp2xpp2", "interleaved dp2xpp2 -> tp2", "zero3 on 3 -> pp3"],
)
def test_a_checkpoint_is_resumed_by_another_paradigm_or_grid(writer, reader, tmp_path):
    train_util.check_resumed_elsewhere(tmp_path / "ckpt", FAST, writer, reader)


def test_one_stage_with_one_micro_batch_is_single_bit_for_bit():
    single = on_sim(1, paradigm="single", epochs=1)
    assert on_sim(1, paradigm="pp", microbatches=1, epochs=1)["weights_sha256"] == single["weights_sha256"]


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (dict(pp=5), 5, "5 pipeline stages but the model has 4 Linear layers"),
        (dict(pp=2, schedule="interleaved", virtual_stages=3), 2, "6 chunks do not divide the 4 Linear layers"),
        (dict(pp=2, dp=3), 4, "--dp 3 x --tp 1 x --pp 2 = 6 ranks, but 4 were launched"),
        (dict(dp=2, tp=2, pp=2), 4, "--dp 2 x --tp 2 x --pp 2 = 8 ranks, but 4 were launched"),
        (dict(pp=2, microbatches=5), 2, "--microbatches 5 must divide each replica's slice of the batch (48"),
        (dict(pp=2, dp=2, microbatches=48), 4, "--microbatches 48 must divide each replica's slice of the batch (24"),
        (dict(pp=2, schedule="interleaved", microbatches=3), 2, "needs --microbatches a multiple of --pp 2, got 3"),
        (dict(pp=2, virtual_stages=2), 2, "--virtual-stages 2 is for --schedule interleaved, not 1f1b"),
        (dict(pp=1, schedule="interleaved"), 1, "--schedule interleaved needs --virtual-stages >= 2 and --pp >= 2"),
        (dict(pp=2, accumulate=2), 2, "--accumulate is not for --paradigm pp"),
        (dict(pp=2, tp=2, hidden=(33, 32, 16)), 4, "--tp 2 does not divide the width 33 between layers 0 and 1"),
        (dict(pp=2, tp=2, hidden=(32,)), 4, "2 pipeline stages but the model has 1 column-then-row pair(s)"),
        (dict(pp=2, tp=2, schedule="interleaved"), 4, "4 chunks do not divide the 2 column-then-row pair(s)"),
        (dict(pp=1, tp=2, hidden=()), 2, "1 pipeline stages but the model has 0 column-then-row pair(s)"),
        (dict(pp=9), 4, "--pp 9 is more than the 4 rank"),
    ],
)
def test_bad_flags_are_one_clear_error_before_any_communication(overrides, world, message):
    cfg = TrainConfig(**{**FAST, "paradigm": "pp", **overrides})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallel.get("pp").check(cfg, world)


COMMON = ["--hidden", "64,32,32", "--epochs", "2", "--dtype", "float64", "--batch-size", "48", "--no-progress",
          "--quiet"]  # fmt: skip


REAL = {
    "pp2-1f1b": (2, ["--pp", "2"]),
    "pp3-gpipe": (3, ["--pp", "3", "--schedule", "gpipe", "--microbatches", "8"]),
    "dp2xpp2-interleaved": (4, ["--pp", "2", "--schedule", "interleaved"]),
    "dp2xtp2xpp2": (8, ["--dp", "2", "--tp", "2", "--pp", "2"]),
}


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "flags"), list(REAL.values()), ids=list(REAL))
def test_under_mpiexec_pipelines_follow_single(ranks, flags, tmp_path):
    """Real ranks, float64: each epoch's global train loss and the test loss are single's to rounding, and every
    rank's traced bytes and peak activation bytes are the cost function's."""
    metrics = train_util.follows_single(tmp_path, ranks, COMMON, "--paradigm", "pp", *flags)
    steps = len(metrics["epochs"]) * steps_per_epoch(metrics["dataset"]["train_samples"], 48)
    costs = metrics["costs"]
    for rank, mine in enumerate(metrics["communication"]["per_rank"]):
        training = [ops for label, ops in mine["operations"].items() if label not in ("checkpoint", "evaluation")]
        assert sum(ops["bytes_sent"] for ops in training) == steps * costs["sent_per_step"][rank]
        assert mine["paradigm"]["per_rank"][rank]["peak_activation_bytes"] == costs["activations"][rank]


def test_the_docstrings_picture_is_what_the_schedules_draw():
    """schedules.py opens with GPipe and 1F1B for P = M = 4: the very lines text() draws from the instruction lists."""
    lines = [line[14:] for line in schedules.__doc__.splitlines() if line.startswith("    stage ")]
    for column, name in enumerate(("gpipe", "1f1b")):
        drawn = schedules.text(schedules.simulate(schedules.build(name, 4, 4), 1.0, 2.0), 4)
        assert [line.split()[column] for line in lines] == drawn


def test_a_stage_that_never_sends_is_reported_by_the_watchdog_not_a_hang(capfd, data64):
    """Stage 0 stalls (asleep in its first forward) for longer than the watchdog's limit: stage 1, waiting for the
    activations, reports whom and what it waits for and the run is aborted, instead of hanging."""
    cfg = pp(FOUR, pp=2)

    def fn(comm):
        pipeline = Pipeline(prepare(comm, timeout=1.0), cfg)
        pipeline.build(model_of(FOUR), lambda model: make_optimizer("sgd", model, 0.1))
        if comm.Get_rank() == 0:
            pipeline.delay = (3.0, 3.0)  # a stalled stage
        x, y = data64[0]
        pipeline.step(x, y)

    try:
        with pytest.raises(sim.SimAbort) as info:
            sim.SimWorld(2, timeout=60).run(fn)
    finally:
        watchdog.configure(None)
        for thread in threading.enumerate():  # the stalled rank wakes later, and ends at its next communication
            if thread.name.startswith("sim-rank"):
                thread.join(10)
    assert info.value.errorcode == watchdog.EXIT_CODE
    err = capfd.readouterr().err
    assert "pipeline stage 1: waiting for the activation of micro-batch 0 from rank 0" in err
    assert "rank 1 waits for rank 0" in err


def test_resuming_mid_epoch_after_a_crash_is_bit_identical(tmp_path, monkeypatch):
    """dp 2 x tp 2 x pp 2 writes a checkpoint at step 35 (in epoch 2), crashes at step 40, and resumes: the same
    weights, to the bit, as the uninterrupted run (the checkpoint is the whole flat buffer, gathered from the pieces,
    and the pieces are taken from it again)."""
    grid = dict(paradigm="pp", dp=2, tp=2, pp=2, epochs=2)
    whole = on_sim(8, **grid)
    step, calls = Pipeline.step, {}

    def crashing_step(self, x, y):
        calls[self.rank] = calls.get(self.rank, 0) + 1
        if calls[self.rank] == 40:
            raise RuntimeError("the machine went away")
        return step(self, x, y)

    monkeypatch.setattr(Pipeline, "step", crashing_step)
    with pytest.raises(sim.SimRankError):
        on_sim(8, **grid, checkpoint_dir=str(tmp_path), checkpoint_every=35)
    assert checkpoint.load(tmp_path)["meta"]["global_step"] == 35
    monkeypatch.setattr(Pipeline, "step", step)
    resumed = on_sim(8, **grid, checkpoint_dir=str(tmp_path), resume=True)
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    for ours, theirs in zip(resumed["epochs"], whole["epochs"]):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-12)


def test_a_gradient_sent_later_than_its_backward_is_still_that_micro_batchs(data64):
    """Schedules are data a learner may write: here stage 1 sends micro-batch 0's gradient only after micro-batch 1's
    backward. check() and simulate() accept it, and the interpreter must send each micro-batch's own gradient."""
    program = schedules.one_f_one_b(2, 2)
    late = [list(p) for p in program]
    send = next(i for i, ins in enumerate(late[1]) if ins.op == "send" and ins.kind == "gradient" and ins.micro == 0)
    moved = late[1].pop(send)
    b1 = next(i for i, ins in enumerate(late[1]) if ins.op == "backward" and ins.micro == 1)
    late[1].insert(b1 + 1, moved)
    schedules.check(late, 2)
    schedules.simulate(late)
    cfg = pp(FOUR, pp=2, microbatches=2)

    def fn(comm, schedule):
        pipeline = Pipeline(prepare(comm, timeout=0), cfg)
        pipeline.build(model_of(FOUR), lambda model: make_optimizer("sgd", model, 0.1))
        pipeline.program = schedule[pipeline.grid.pp_rank]
        x, y = data64[0]
        pipeline.step(x, y)
        return pipeline.full_parameters().copy()

    expected = sim.run(2, fn, program)[0]
    for params in sim.run(2, fn, late):
        assert np.array_equal(params, expected)

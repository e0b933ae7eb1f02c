"""``dtrain plan``: every configuration's predicted bytes and state against the tracer's counts on simulated ranks, its
times against the closed forms, the presets' sources, a paradigm that joins the plan by registering, and bad input.

The exact oracles are the simulator's counts (what each rank sent and held in a real training run of the
configuration) and the formulas of the cost model and of the pipeline bubble, written out here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from dtrain import parallel, report
from dtrain import plan as planner
from dtrain.collectives import costmodel
from dtrain.collectives.costmodel import Machine
from dtrain.comm import sim
from dtrain.errors import ConfigError
from dtrain.plan import hardware
from dtrain.train import train

SMALL = planner.Model([16, 8, 8, 8, 4], batch_size=24)


def simulated(row, model, steps: int = 2) -> dict:
    """Train ``row`` on simulated ranks for one epoch of ``steps`` steps: rank 0's metrics."""
    config = model.config(row.paradigm, row.flags)
    config.epochs, config.samples, config.quiet, config.progress = 1, -(-steps * model.batch_size * 5 // 4), True, False
    return sim.SimWorld(row.ranks, timeout=120).run(lambda comm: train(config, comm))[0]


def configurations(world: int) -> list:
    rows = planner.plan(SMALL, world, hardware.load("this"))
    return [pytest.param(world, row.label, id=f"{world}-{row.label}") for row in rows if row.time]


@pytest.mark.parametrize(("world", "label"), configurations(2) + configurations(4))
def test_predicted_counts_are_the_tracers(world, label):
    """Every configuration the planner prices on 2 and 4 ranks, trained on simulated ranks: the bytes each rank sends
    per step in the steady state (the difference of a 4k-step and a 2k-step run, so that what happens once a run, a
    worker's first pull, gossip's final average, cancels) are exactly the plan's, and so is the state each rank
    holds. ps-async's workers push when they are ready, so its count is per push: each worker's push bytes."""
    row = next(r for r in planner.plan(SMALL, world, hardware.load("this")) if r.label == label)
    k = row.flags.get("sync_every", 1)  # (local SGD averages every k steps: whole periods cancel)
    two, four = simulated(row, SMALL, 2 * k), simulated(row, SMALL, 4 * k)
    predicted = parallel.get(row.paradigm).costs(SMALL.sizes, row.ranks, SMALL.config(row.paradigm, row.flags))
    if row.paradigm == "ps-async":
        workers = world - row.flags["servers"]
        for rank in range(workers):
            push = four["communication"]["per_rank"][rank]["operations"]["ps/push"]
            assert push["bytes_sent"] / push["calls"] == predicted["sent_per_step"][rank]
    else:
        steady = [(b - a) / (2 * k) for a, b in zip(report.training_traffic(two), report.training_traffic(four))]
        assert steady == pytest.approx(predicted["sent_per_step"], abs=1e-9)
        assert max(steady) == pytest.approx(row.sent_per_step, abs=1e-9)
    assert report.state_bytes(four)[0] == row.state


def test_every_registered_paradigm_is_planned():
    """The planner names no paradigm: each registered one comes with at least one configuration."""
    rows = planner.plan(SMALL, 4, hardware.load("this"))
    assert {r.paradigm for r in rows} == set(parallel.names())
    source = (planner.__file__, hardware.__file__)
    for path in source:
        text = open(path).read()
        for name in ("ddp", "zero", "ps-sync", "gossip", "local-sgd", "central-storage"):
            assert f'"{name}"' not in text, f"{path} names the paradigm {name}"


def test_a_paradigm_joins_the_plan_by_registering(tmp_path):
    """A module named by $DTRAIN_PARADIGMS that registers a paradigm: it is in the plan, priced by its own formulas."""
    (tmp_path / "mine.py").write_text(
        textwrap.dedent("""
        from dtrain.parallel import register
        from dtrain.parallel.data_parallel import DataParallel

        @register
        class Mine(DataParallel):
            name = "mine"
            summary = "ddp, under another name"

            @classmethod
            def configurations(cls, world, config, hardware):
                return [("mine on every rank", {"allreduce": "ring"}, world)]
    """)
    )
    code = ("from dtrain import plan; from dtrain.plan import hardware; "
            "rows = plan.plan(plan.Model([16, 8, 4], 24), 4, hardware.load('this'));"
            "print([(r.label, r.sent_per_step) for r in rows if r.paradigm in ('mine', 'ddp')])")  # fmt: skip
    env = {"DTRAIN_PARADIGMS": "mine", "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    rows = dict(eval(out.stdout))  # (label, bytes) pairs
    assert rows["mine on every rank"] == rows["ddp ring"]


# --- times against the closed forms ----------------------------------------------------------------------------------
def flat_machine(**rates) -> hardware.Hardware:
    """A machine with round numbers, one link everywhere, each rank its own core."""
    link = Machine(alpha=1e-5, beta=1e-9, gamma=1e-10)
    base = dict(name="test", flops=1e9, layer_s=0.0, step_s=0.0, memory_bandwidth=1e9, memory=1e12, intra=link,
                inter=link)  # fmt: skip
    return hardware.Hardware(**{**base, **rates})


def test_ddp_step_is_compute_plus_the_ring_formula():
    model, world, m = planner.Model([64, 256, 10], 32), 4, flat_machine()
    row = next(r for r in planner.plan(model, world, m) if r.label == "ddp ring")
    n = parallel.parameter_count(model.sizes) * 4
    p = world
    ring = 2 * (p - 1) * m.intra.alpha + 2 * (p - 1) / p * n * m.intra.beta + (p - 1) / p * n * m.intra.gamma
    assert row.time["communication"] == pytest.approx(ring)
    flops = 6 * (32 // p) * (64 * 256 + 256 * 10)
    weights = 4 * (64 * 256 + 256 * 10) * 4  # forward and backward read them, backward reads and writes the gradient
    update = 5 * parallel.parameter_count(model.sizes) * 4  # SGD with momentum: read 3, write 2 buffers per parameter
    assert row.time["compute"] == pytest.approx(flops / m.flops + (weights + update) / m.memory_bandwidth)
    assert row.time["bubble"] == 0


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    """Balanced stages, no communication: the bubble is (P-1)/(M+P-1) of the step's forward-backward time."""
    free = Machine(alpha=0.0, beta=0.0, gamma=0.0)
    m = flat_machine(intra=free, inter=free, memory_bandwidth=math.inf)
    model = planner.Model([64, 64, 64, 64, 64], 64)  # four equal layers: 2 or 4 balanced stages (biases are tiny)
    for P, M in ((2, 2), (2, 8), (4, 4), (4, 16)):
        row = next(r for r in planner.plan(model, P, m, only=["pp"]) if r.label == f"pp{P} gpipe M={M}")
        t = row.time
        assert t["bubble"] / t["total"] == pytest.approx((P - 1) / (M + P - 1), rel=1e-6)


def test_hierarchical_crosses_nodes_on_the_inter_link():
    """On a cluster preset the all-reduce of a group that spans nodes is priced on the slower link."""
    m = hardware.load("dgx-h100")
    inside = m.allreduce("ring", 1 << 24, range(8), 8)
    across = m.allreduce("ring", 1 << 24, range(16), 16)
    assert inside == pytest.approx(costmodel.predict_time("ring", 1 << 24, 8, m.intra))
    assert across == pytest.approx(costmodel.predict_time("ring", 1 << 24, 16, m.inter))
    assert m.link([0, 7], 16) is m.intra and m.link([7, 8], 16) is m.inter


def test_presets_state_their_sources():
    for name, preset in hardware.presets().items():
        if name == hardware.THIS:
            continue
        assert preset["sources"], name
        m = hardware.load(name)
        assert m.flops > 0 and m.memory > 0 and m.intra.beta > 0 and m.inter.beta > 0
        assert m.ranks_per_node is None or m.ranks_per_node >= 1  # (None: every rank on one node)


def test_the_best_fits_and_makes_single_updates():
    rows = planner.plan(planner.Model([784, 512, 512, 10], 256), 4, hardware.load("this"))
    best = [r for r in rows if r.best]
    assert len(best) == 1 and best[0].fits and best[0].same_updates
    assert best[0].total == min(r.total for r in rows if r.fits and r.same_updates)
    assert "fastest" in planner.why(rows)


def test_memory_decides_what_fits():
    """With too little memory for a whole replica, ZeRO stage 3 still fits and ddp does not."""
    model = planner.Model([1024] * 9 + [10], 64, optimizer="adam")  # eight equal layers: one in flight is 1/8
    this = hardware.load("this")
    ddp_state = 4 * parallel.parameter_count(model.sizes) * 4  # parameters, gradients, Adam's two moments
    tight = dataclasses.replace(this, memory=0.6 * ddp_state * 4, cores=this.cores)  # per rank: 0.6 of ddp's state
    rows = {r.label: r for r in planner.plan(model, 4, tight)}
    assert not rows["ddp ring"].fits and rows["zero stage 3"].fits
    assert "needs" in rows["ddp ring"].ruled_out


# --- the command ----------------------------------------------------------------------------------------------------
def dtrain_plan(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dtrain", "plan", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--ranks", "8", "--tp", "3"], "--tp 3 does not divide --ranks 8"),
        (["--machine", "nope"], "is not a preset: choose one of this, dgx-h100"),
        (["--flops", "0"], "--flops must be a positive number"),
        (["--machine", "dgx-h100", "--inter-bandwidth", "-5"], "--inter-bandwidth must be a positive number"),
        (["--memory", "0.0001"], "fits no configuration"),
        (["--layers", "4"], "--layers and --width go together"),
        (["--ranks", "0"], "--ranks must be >= 1"),
        (["--paradigms", "ddp,nope"], "--paradigm 'nope' is not one of"),
    ],
)
def test_bad_input_is_one_line(args, says):
    result = dtrain_plan(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_json_and_png(tmp_path):
    result = dtrain_plan("--hidden", "64,64", "--features", "64", "--batch-size", "96", "--json", "p.json", "--png",
                         "p.png", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["best"] in result.stdout and plan["ranks"] == 4
    best = [c for c in plan["configurations"] if c["best"]]
    assert len(best) == 1 and best[0]["label"] == plan["best"]
    assert (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.mpi
def test_check_runs_the_best_here_and_counts_agree(tmp_path):
    """--check K trains the K best under mpiexec: predicted bytes and state equal the measured ones (exit 0)."""
    result = dtrain_plan("--ranks", "2", "--hidden", "32,32", "--features", "16", "--classes", "4", "--batch-size",
                         "32", "--check", "2", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout.split("checking the 2 best here")[1]
    assert table.count(" yes") >= 2 and " NO" not in table
    assert "the planner's first choice" in table


def test_check_needs_this_machine():
    with pytest.raises(Exception, match=r"--machine this \(with --device cpu\)"):
        from dtrain.plan import check as plan_check

        plan_check.check([], SMALL, 1, hardware.load("dgx-h100"))


def test_a_grid_that_does_not_divide_is_refused_before_anything():
    with pytest.raises(ConfigError, match="--pp 3 does not divide --ranks 4"):
        planner.plan(SMALL, 4, hardware.load("this"), pp=3)


def test_every_configurations_command_is_one_dtrain_train_takes():
    """The command the plan prints for a configuration parses, and asks for that configuration."""
    import shlex

    from dtrain import cli

    for row in planner.plan(SMALL, 4, hardware.load("this")):
        words = shlex.split(row.command(SMALL))
        assert words[:5] == ["dtrain", "launch", "-n", str(row.ranks), "-m"]
        args = cli.build_parser().parse_args(words[6:])
        assert args.paradigm == row.paradigm and list(args.hidden) == SMALL.sizes[1:-1]
        for name, value in row.flags.items():
            assert getattr(args, name) == value, (row.label, name)


def test_an_asynchronous_device_takes_the_longer_of_host_and_device():
    """A GPU queues kernels while it runs earlier ones: a micro-batch's time is max(layers x layer_s, arithmetic +
    weight passes), where a CPU adds them."""
    layers, rows, b = [(784, 4096), (4096, 4096), (4096, 10)], 1024, 4
    gpu = flat_machine(flops=4e13, layer_s=3e-4, memory_bandwidth=3e12, asynchronous=True)
    cpu = dataclasses.replace(gpu, asynchronous=False)
    device = sum(6 * rows * x * y / 4e13 + 4 * x * y * b / 3e12 for x, y in layers)
    assert gpu.layers_time(layers, rows, b) == pytest.approx(max(3 * 3e-4, device))
    assert cpu.layers_time(layers, rows, b) == pytest.approx(3 * 3e-4 + device)
    few = [(64, 64)] * 3  # host-bound: the fixed costs alone
    assert gpu.layers_time(few, 8, b) == pytest.approx(3 * 3e-4)


def test_the_gpu_fit_recovers_the_rates_that_made_the_times(monkeypatch):
    """measure_compute(device="gpu") on step times made by the asynchronous model from known rates gets them back
    (FLOP/s to the grid's 80 points a decade; the fixed costs to the few percent the update adds to small shapes)."""
    import itertools

    truth = {"flops": 4.2e13, "layer_s": 3.5e-4, "step_s": 6e-4, "memory_bandwidth": 2.9e12}

    def seconds(sizes, rows, accumulate=1, device="cpu"):
        layers = list(itertools.pairwise(sizes))
        shape = [sum(6 * rows * a * b for a, b in layers), len(layers), accumulate, sum(a * b for a, b in layers),
                 parallel.parameter_count(sizes)]  # fmt: skip
        return float(hardware.asynchronous_seconds([shape], truth["flops"], truth["layer_s"], truth["step_s"],
                                                   truth["memory_bandwidth"])[0])  # fmt: skip

    monkeypatch.setattr(hardware, "step_seconds", seconds)
    monkeypatch.setattr(hardware, "device_memory_bandwidth", lambda: truth["memory_bandwidth"])
    fit = hardware.measure_compute(hardware.GPU_SHAPES, device="gpu")
    assert fit["flops"] == pytest.approx(truth["flops"], rel=0.03)
    assert fit["layer_s"] == pytest.approx(truth["layer_s"], rel=0.05)
    assert fit["step_s"] == pytest.approx(truth["step_s"], rel=0.05)
    assert all(s["fitted"] == pytest.approx(s["seconds"], rel=0.05) for s in fit["shapes"])


def test_plan_for_the_gpu_uses_the_measured_preset_and_says_device_gpu(tmp_path):
    result = dtrain_plan("--device", "gpu", "--ranks", "2", "--json", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    out = json.loads((tmp_path / "plan.json").read_text())
    assert out["machine"]["name"] == hardware.GPU_MEASURED and out["model"]["device"] == "gpu"
    assert "--device gpu" in result.stdout.split("run it:")[1].split("\n\n")[0]
    refused = dtrain_plan("--device", "gpu", "--machine", "this", "--check", "1")
    assert refused.returncode == 2 and refused.stderr == (
        "dtrain: error: --device gpu on this, whose ranks compute on CPUs: leave --device out, or give "
        "--machine lent-h100 (a GPU measured by dtrain) or a GPU preset\n")  # fmt: skip


def test_a_gpu_preset_plans_for_its_gpus_and_the_command_says_so():
    """--preset is --machine's other name (the README calls them presets); a GPU preset's ranks are GPUs, so the
    command to run the best says --device gpu without being told; --device cpu there is refused."""
    result = dtrain_plan("--preset", "dgx-h100", "--ranks", "8")
    assert result.returncode == 0, result.stderr
    command = result.stdout.split("run it:")[1].split("\n\n")[0]
    assert "--device gpu" in command and command.strip().startswith("dtrain launch -n ")
    refused = dtrain_plan("--preset", "dgx-h100", "--device", "cpu")
    assert refused.returncode == 2 and refused.stderr == (
        "dtrain: error: --device cpu on dgx-h100, whose ranks compute on GPUs: leave --device out, or "
        "give --machine this (this machine's CPUs)\n")  # fmt: skip


def test_json_and_png_dash_are_standard_output_and_the_table_goes_to_stderr(tmp_path):
    """As in every Unix tool, "-" names standard output: the plan's JSON (or PNG) alone there, the table on stderr."""
    result = dtrain_plan("--ranks", "2", "--json", "-", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ranks"] == 2 and "best:" in result.stderr
    assert not (tmp_path / "-").exists()
    png = subprocess.run([sys.executable, "-m", "dtrain", "plan", "--ranks", "2", "--png", "-"], capture_output=True,
                         cwd=tmp_path)  # fmt: skip
    assert png.returncode == 0 and png.stdout.startswith(b"\x89PNG\r\n") and b"best:" in png.stderr
    both = dtrain_plan("--json", "-", "--png", "-")
    assert both.returncode == 2 and "only one of them can be standard output" in both.stderr

"""The driver with a paradigm behind the seam: train_loss is the global batch's, checkpoints resume bit-identically,
bad input is one clear error on every rank, and the simulator and mpiexec agree to the last bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import run_mpi_code

from dtrain import checkpoint
from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.errors import ConfigError
from dtrain.train import train

FAST = dict(hidden=(32,), epochs=2, batch_size=48, progress=False, quiet=True, timeout=0, dtype="float64")


def on_sim(p, cfg, **kwargs):
    """Every rank's metrics of a run of ``cfg`` on ``p`` simulated ranks."""
    return sim.SimWorld(p, timeout=120, **kwargs).run(lambda comm: train(cfg, comm))


def ddp(**overrides) -> TrainConfig:
    return TrainConfig(**{**FAST, "paradigm": "ddp", **overrides})


def test_train_loss_is_the_global_batchs_and_follows_single():
    single = train(TrainConfig(**FAST))
    for p in (2, 4):
        metrics = on_sim(p, ddp())[0]
        for ours, theirs in zip(metrics["epochs"], single["epochs"]):
            assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-12)
            assert ours["test_accuracy"] == theirs["test_accuracy"]


def test_metrics_carry_each_ranks_communication_and_timing():
    metrics = on_sim(2, ddp(allreduce="ring", bucket_mb=0.01))[0]
    costs = metrics["costs"]
    assert costs["parameters"] == costs["gradients"] == (64 * 32 + 32 + 32 * 10 + 10) * 8
    for rank, mine in enumerate(metrics["communication"]["per_rank"]):
        steps = sum(1 for _ in range(metrics["config"]["epochs"])) * (1438 // 48)
        assert mine["operations"]["allreduce/ring"]["bytes_sent"] == steps * costs["sent_per_step"][rank]
        assert mine["paradigm"]["allreduce"] == "ring" and 0 <= mine["paradigm"]["overlap_fraction"] <= 1
        assert mine["comm_time_s"] > 0 and mine["compute_time_s"] > 0
        # training's communication is within training's time: the build's broadcast (setup) is not in it
        assert mine["setup"]["time_s"] > 0 and mine["comm_time_s"] <= mine["train_time_s"]


# --- checkpoints ---------------------------------------------------------------------------------------------------


def test_resuming_at_an_epoch_boundary_is_bit_identical(tmp_path):
    whole = on_sim(2, ddp(epochs=3))[0]
    on_sim(2, ddp(epochs=1, checkpoint_dir=str(tmp_path)))
    resumed = on_sim(2, ddp(epochs=3, checkpoint_dir=str(tmp_path), resume=True))[0]
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    assert [e["train_loss"] for e in resumed["epochs"]] == [e["train_loss"] for e in whole["epochs"]]


def test_resuming_mid_epoch_after_a_crash_is_bit_identical(tmp_path, monkeypatch):
    whole = on_sim(3, ddp(epochs=2))[0]
    from dtrain.parallel.data_parallel import DataParallel

    step = DataParallel.step

    def crashing_step(self, x, y):
        if self.steps == 40:  # after the checkpoint of step 35, in the middle of epoch 2
            raise RuntimeError("the machine went away")
        return step(self, x, y)

    monkeypatch.setattr(DataParallel, "step", crashing_step)
    with pytest.raises(sim.SimRankError):
        on_sim(3, ddp(epochs=2, checkpoint_dir=str(tmp_path), checkpoint_every=35))
    assert checkpoint.load(tmp_path)["meta"]["global_step"] == 35
    monkeypatch.setattr(DataParallel, "step", step)
    resumed = on_sim(3, ddp(epochs=2, checkpoint_dir=str(tmp_path), resume=True))[0]
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    for ours, theirs in zip(resumed["epochs"], whole["epochs"]):  # the half-done epoch's loss is every rank's too
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-12)


def test_resuming_on_another_world_size_works_and_says_so(tmp_path, capsys):
    on_sim(4, ddp(epochs=1, checkpoint_dir=str(tmp_path)))
    whole = on_sim(2, ddp(epochs=2))[0]
    resumed = on_sim(2, ddp(epochs=2, checkpoint_dir=str(tmp_path), resume=True))[0]
    assert "written by 4 rank(s) on 2" in capsys.readouterr().out
    # the same global batches, summed in another order: equal to rounding, not to the bit
    assert resumed["epochs"][-1]["train_loss"] == pytest.approx(whole["epochs"][-1]["train_loss"], rel=1e-9)


def test_resuming_takes_the_learning_rate_of_the_new_run(tmp_path):
    on_sim(1, TrainConfig(**{**FAST, "epochs": 1, "checkpoint_dir": str(tmp_path)}))
    config = TrainConfig(**{**FAST, "lr": 0.01, "checkpoint_dir": str(tmp_path), "resume": True})
    lrs = sim.run(1, lambda comm: (train(config, comm), checkpoint.load(tmp_path)["optimizer"]["lr"]))
    assert lrs[0][1] == 0.01


def test_a_checkpoint_is_written_atomically_and_the_old_one_survives_a_failed_write(tmp_path, monkeypatch):
    on_sim(1, TrainConfig(**FAST, checkpoint_dir=str(tmp_path)))
    before = (tmp_path / checkpoint.FILENAME).read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, np.zeros(3), {}, {"paradigm": "single"})
    assert (tmp_path / checkpoint.FILENAME).read_bytes() == before
    assert checkpoint.load(tmp_path)["meta"]["paradigm"] == "single"


BAD_CHECKPOINTS = {
    "none there": (lambda folder: None, "no checkpoint in"),
    "truncated": (lambda folder: _truncate(folder), "damaged or not a dtrain checkpoint"),
    "not a checkpoint": (lambda folder: (folder / checkpoint.FILENAME).write_bytes(b"hello"), "damaged"),
    "pickled objects": (lambda folder: _pickled(folder), "damaged or not a dtrain checkpoint"),
    "another model": (lambda folder: _write(folder, hidden=(16,)), "model sizes [64, 16, 10], this run has [64, 32"),
    "no momentum state": (lambda folder: _write(folder, momentum=0.0), "optimizer state (--momentum 0 keeps none)"),
    "more epochs than asked": (lambda folder: _write(folder, epochs=3), "has trained 3 epoch(s), more than --epochs 2"),
}


def _write(folder, p=2, **overrides):
    on_sim(p, TrainConfig(**{**FAST, "paradigm": "ddp", "epochs": 1, "checkpoint_dir": str(folder), **overrides}))


def _pickled(folder):
    """An .npz whose arrays hold Python objects: loading them would unpickle, which can run code."""
    np.savez(folder / checkpoint.FILENAME, header=np.array([{"format": "x"}], dtype=object), params=np.zeros(3))


def _truncate(folder):
    _write(folder)
    path = folder / checkpoint.FILENAME
    path.write_bytes(path.read_bytes()[:300])


@pytest.mark.parametrize("reader", [{}, {"paradigm": "zero", "zero_stage": 3}], ids=["ddp", "zero3"])
@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_is_one_clear_error_on_every_rank_and_nothing_is_overwritten(case, reader, tmp_path):
    """(Read by ddp, and by zero, whose ranks each hold a chunk: the checks happen on rank 0 before any is loaded.)"""
    damage, phrase = BAD_CHECKPOINTS[case]
    damage(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    errors = []

    def fn(comm):
        try:
            train(ddp(checkpoint_dir=str(tmp_path), resume=True, out=str(tmp_path / "run"), **reader), comm)
        except ConfigError as exc:
            errors.append((comm.Get_rank(), str(exc)))

    sim.SimWorld(2, timeout=60).run(fn)
    assert sorted(rank for rank, _ in errors) == [0, 1]
    assert all(phrase in message and "\n" not in message for _, message in errors), errors
    assert not any("pickle" in message for _, message in errors), errors  # never advise loading pickled objects
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no metrics, no new checkpoint


# --- bad input before any step ---------------------------------------------------------------------------------------


def test_more_ranks_than_samples_per_step_is_one_clear_error_on_every_rank():
    errors = []

    def fn(comm):
        try:
            train(ddp(batch_size=2), comm)
        except ConfigError as exc:
            errors.append(str(exc))

    sim.run(3, fn)
    assert len(errors) == 3 and all("--batch-size 2 is smaller than the 3 ranks" in e for e in errors)


@pytest.mark.parametrize(
    ("flags", "world", "expected"),
    [
        (dict(paradigm="ddp"), 4, 64),
        (dict(paradigm="ddp"), 3, 63),  # 63 and 66 both split over 3: the nearer
        (dict(paradigm="ps-sync"), 4, 63),  # 3 workers
        (dict(paradigm="ps-async", servers=2), 7, 65),  # 5 workers: 65 is nearer than 60
        (dict(paradigm="pp", dp=2, pp=2, hidden=(8, 8, 8), microbatches=3), 4, 66),  # 2 replicas x 3 micro-batches
        (dict(paradigm="ddp", accumulate=5), 2, 60),  # 2 ranks x 5 micro-batches: 60 and 70, the nearer
    ],
)
def test_without_a_batch_size_the_default_is_the_nearest_to_64_that_the_paradigm_splits(flags, world, expected):
    from dtrain import parallel
    from dtrain.config import default_batch

    config = TrainConfig(**{**FAST, **flags, "batch_size": None})
    kind = parallel.get(config.paradigm)
    assert default_batch(kind, config, world) == expected
    for size in range(1, 4 * 64 + 1):  # the oracle: every size nearer 64 is refused by the paradigm's own check
        if abs(size - 64) < abs(expected - 64) or (abs(size - 64) == abs(expected - 64) and size < expected):
            with pytest.raises(ConfigError):
                kind.check(TrainConfig(**{**FAST, **flags, "batch_size": size}), world)


def test_a_run_without_a_batch_size_says_which_it_took_and_records_it(capsys):
    config = TrainConfig(**{**FAST, "paradigm": "ps-sync", "batch_size": None, "epochs": 1, "quiet": False})
    metrics = on_sim(4, config)[0]
    assert metrics["config"]["batch_size"] == 63
    assert "--batch-size 63: the size nearest the default 64 that --paradigm ps-sync splits evenly on 4 ranks" in (
        capsys.readouterr().out
    )
    with pytest.raises(sim.SimRankError, match="must split evenly over the 3 trainers"):
        on_sim(4, TrainConfig(**{**FAST, "paradigm": "ps-sync", "batch_size": 64}))  # given: never changed


def test_ranks_started_with_different_flags_get_one_clear_error():
    errors = []

    def fn(comm):
        try:
            train(ddp(lr=0.05 if comm.Get_rank() != 1 else 0.1), comm)
        except ConfigError as exc:
            errors.append(str(exc))

    sim.run(3, fn)
    assert len(errors) == 3 and all("different flags: rank(s) [1] differ from rank 0" in e for e in errors)


def test_the_driver_has_no_paradigm_branches():
    source = open(sys.modules[train.__module__].__file__).read()
    assert "paradigm ==" not in source and 'paradigm == "' not in source


# --- real ranks ------------------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_mpiexec_and_the_simulator_give_the_same_weights(tmp_path):
    cfg = dict(FAST, paradigm="ddp", allreduce="ring", bucket_mb=0.005)
    expected = on_sim(3, TrainConfig(**cfg))[0]["weights_sha256"]
    code = f"""
        from mpi4py import MPI
        from dtrain.config import TrainConfig
        from dtrain.train import train
        metrics = train(TrainConfig(**{cfg!r}), MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("digest", metrics["weights_sha256"], flush=True)
    """
    result = run_mpi_code(3, code, tmp_path, timeout=240)
    assert f"digest {expected}" in result.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_four_ranks_learn_the_digits(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "4", "-m", "dtrain", "train", "--paradigm", "ddp",
               "--no-progress", "--quiet", "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["final"]["test_accuracy"] >= 0.96


@pytest.mark.mpi
def test_bad_flags_under_mpiexec_are_one_line_per_rank_and_no_hang(tmp_path):
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "3", "-m", "dtrain", "train", "--paradigm", "ddp",
               "--batch-size", "2", "--no-progress"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--batch-size 2 is smaller than the 3 ranks" in result.stderr

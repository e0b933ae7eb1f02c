"""Training runs for the paradigm tests: the driver on simulated ranks, the command line on real ones, and a
checkpoint that crosses from one paradigm, grid or world size to another."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.train import train


def on_sim(p: int, base: dict, **overrides) -> dict:
    """``train()`` on ``p`` simulated ranks with the flags ``base`` and ``overrides``: rank 0's metrics."""
    config = TrainConfig(**{**base, **overrides})
    return sim.SimWorld(p, timeout=120).run(lambda comm: train(config, comm))[0]


def train_cli(folder, ranks: int, *flags, timeout: float = 300) -> dict:
    """``dtrain train FLAGS --out FOLDER`` on one process, or under ``dtrain launch -n RANKS``: its metrics.json."""
    train_command = ["-m", "dtrain", "train", *flags, "--out", str(folder)]
    launch = ["-m", "dtrain", "launch", "-n", str(ranks)] if ranks > 1 else []
    result = subprocess.run([sys.executable, *launch, *train_command], capture_output=True, text=True,
                            timeout=timeout, cwd=folder.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads((folder / "metrics.json").read_text())


def follows_single(folder, ranks: int, common, *flags, rel: float = 1e-10) -> dict:
    """``dtrain train COMMON --paradigm single`` on one process and ``dtrain train COMMON FLAGS`` on ``ranks``: each
    epoch's global train loss and test loss must be single's to ``rel``. Returns the run's metrics."""
    single = train_cli(folder / "single", 1, *common, "--paradigm", "single")
    metrics = train_cli(folder / "run", ranks, *common, *flags)
    for ours, theirs in zip(metrics["epochs"], single["epochs"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=rel)
        assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=rel)
    return metrics


def check_resumed_elsewhere(folder, base: dict, writer, reader, reference=(1, {"paradigm": "single"})) -> None:
    """One epoch by ``writer`` = (ranks, flags), then ``reader`` resumes its checkpoint for a second: the final losses
    are those of ``reference`` running both epochs uninterrupted (every global batch is the same; only the order of
    summation over ranks differs, so to rounding)."""
    (p_w, w), (p_r, r), (p_ref, ref) = writer, reader, reference
    on_sim(p_w, base, epochs=1, checkpoint_dir=str(folder), **w)
    resumed = on_sim(p_r, base, epochs=2, checkpoint_dir=str(folder), resume=True, **r)
    whole = on_sim(p_ref, base, epochs=2, **ref)
    first = ("train_loss", "test_loss", "test_accuracy")  # the first epoch's metrics come from the checkpoint
    ours, theirs = [resumed["epochs"][0][k] for k in first], [whole["epochs"][0][k] for k in first]
    assert ours == theirs if reference == writer else ours == pytest.approx(theirs, rel=1e-10)
    assert resumed["final"]["train_loss"] == pytest.approx(whole["final"]["train_loss"], rel=1e-10)
    assert resumed["final"]["test_loss"] == pytest.approx(whole["final"]["test_loss"], rel=1e-10)

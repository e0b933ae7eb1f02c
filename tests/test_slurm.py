"""Slurm (scripts/slurm/): the batch scripts refuse to run outside an allocation, and train.sbatch trains on a cluster.

The refusal is checked everywhere, always. The training is opt-in (``pytest tests/test_slurm.py -m slurm``): it needs
``sbatch`` and a cluster that answers, and is skipped, saying which is missing, without them (CI has neither). It
submits train.sbatch with 4 tasks from the repository's root, as a learner would, and holds the job's metrics.json
against an independent oracle: ``dtrain train --paradigm single`` on one process here. Every wait has a deadline, so
a job stuck in the queue is cancelled and the test fails instead of hanging.

    sudo bash scripts/slurm/try_local_slurm.sh -- pytest tests/test_slurm.py -m slurm     a one-node cluster, here

On a real cluster, run it from the repository's root on a login node (the job writes into runs/, which the compute
nodes must see); SBATCH_PARTITION, SBATCH_ACCOUNT and the like choose where it runs, and DTRAIN_SLURM_TIMEOUT (seconds,
default 600) how long it may wait and run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("train.sbatch", "tour.sbatch")
DEADLINE_S = float(os.environ.get("DTRAIN_SLURM_TIMEOUT", "600"))
# In float64 the 4 ranks' curve differs from single's only by the order in which gradients are summed: measured
# ~1e-15; this is the bound train_util.follows_single holds every paradigm to under mpiexec. (In float32 the same
# round-off grows to a few 1e-6 over 20 epochs, too close to any bound; a real bug moves the loss by ~1e-2.)
REL = 1e-10


@pytest.mark.parametrize("script", SCRIPTS)
def test_outside_an_allocation_it_says_to_submit_it_and_exits_2(script):
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    done = subprocess.run(["bash", f"scripts/slurm/{script}", "--epochs", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert f"submit it: sbatch scripts/slurm/{script}" in done.stderr


def _no_cluster() -> str | None:
    """Why the opt-in test cannot run here (None: it can): no sbatch, or no cluster answering sinfo."""
    if shutil.which("sbatch") is None:
        return "sbatch is not installed: no Slurm here (scripts/slurm/try_local_slurm.sh starts a one-node cluster)"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "no Slurm controller answered sinfo within 30 s"
    if done.returncode != 0 or not done.stdout.strip():
        said = (done.stderr.strip().splitlines() or ["no nodes"])[-1]
        return f"sbatch is installed but no Slurm cluster answers (sinfo: {said}); is SLURM_CONF set?"
    return None


def _slurm(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _wait_for(job: str) -> None:
    """Until ``job`` leaves the queue; past the deadline it is cancelled and the test fails, saying where it was."""
    deadline = time.monotonic() + DEADLINE_S
    while _slurm("squeue", "-h", "-j", job, "-o", "%i").stdout.strip():
        if time.monotonic() > deadline:
            where = _slurm("squeue", "-h", "-j", job, "-o", "%T %r").stdout.strip()
            _slurm("scancel", job)
            pytest.fail(f"job {job} still in the queue after {DEADLINE_S:g} s ({where}); cancelled it")
        time.sleep(1)


@pytest.mark.slurm
@pytest.mark.timeout(DEADLINE_S + 180)
def test_train_sbatch_on_4_tasks_follows_single_on_one_process(tmp_path):
    reason = _no_cluster()
    if reason:
        pytest.skip(reason)
    (REPO / "runs").mkdir(exist_ok=True)  # Slurm opens --output=runs/slurm-%j.out before the script starts
    flags = ["--paradigm", "ddp", "--dtype", "float64", "--epochs", "10"]
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=4", "scripts/slurm/train.sbatch", *flags],
        cwd=REPO, env={**os.environ, "DTRAIN_VENV": sys.prefix}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]  # "JOBID" or "JOBID;CLUSTER"
    out, folder = REPO / "runs" / f"slurm-{job}.out", REPO / "runs" / f"slurm-{job}"
    try:
        _wait_for(job)
        said = out.read_text() if out.exists() else "(no output file)"
        # The .out is this job's (Slurm truncates it); it names the metrics only once they are written.
        assert f"metrics written to runs/slurm-{job}/metrics.json" in said, said[-3000:]
        run = json.loads((folder / "metrics.json").read_text())
        single = subprocess.run(
            [sys.executable, "-m", "dtrain", "train", "--paradigm", "single", *flags[2:], "--quiet",
             "--out", str(tmp_path / "single")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert single.returncode == 0, single.stderr
        reference = json.loads((tmp_path / "single" / "metrics.json").read_text())
        assert run["world_size"] == 4
        assert (folder / "trace.json").exists()  # the trace's default place
        for ours, theirs in zip(run["epochs"], reference["epochs"], strict=True):
            assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=REL)
            assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=REL)
    finally:
        if _slurm("squeue", "-h", "-j", job, "-o", "%i").stdout.strip():
            _slurm("scancel", job)
    shutil.rmtree(folder)  # passed: what the job wrote is not needed any more
    out.unlink()

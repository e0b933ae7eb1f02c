"""The lessons run end to end and say what they promise: lesson 1 trains, lesson 2's all-reduces all agree with MPI.

Each lesson checks its own claims (gradients against finite differences, every all-reduce against MPI_Allreduce and
NumPy, every rank's bytes against the cost model) and ends with a line a test can read; lesson 2 also exits non-zero
when a check fails, so a failure shows up here with the lesson's whole output.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import run_mpi

from dtrain.collectives import ALGORITHMS

LESSONS = Path(__file__).resolve().parent.parent / "lessons"


def test_lesson_01_single_device_trains():
    result = subprocess.run(
        [sys.executable, str(LESSONS / "01_single_device.py"), "--epochs", "2"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = re.search(r"final test accuracy ([\d.]+)%", result.stdout)
    assert accuracy, result.stdout
    assert float(accuracy.group(1)) > 80, result.stdout  # two epochs on digits already reach ~95%
    assert "bit-identical to the weights of the loop in section 3: yes" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_lesson_02_allreduce_every_algorithm_agrees_with_mpi(nranks):
    args = [str(LESSONS / "02_allreduce.py"), "--size-mib", "0.05", "--repeats", "2"]
    if nranks == 4:
        args += ["--ranks-per-node", "2"]  # the hierarchical algorithms across two emulated nodes
    out = run_mpi(nranks, args, timeout=180).stdout
    assert "all algorithms agree with MPI_Allreduce: yes" in out, out
    assert "bytes sent match costmodel.bytes_sent on every rank: yes" in out, out
    for algorithm in ALGORITHMS:  # one row per algorithm, and each says ok
        row = re.search(rf"^{algorithm}\s.*$", out, flags=re.MULTILINE)
        assert row and row.group(0).split()[1 if algorithm != "auto" else 3] == "yes", (algorithm, out)


def test_lesson_02_exits_nonzero_on_bad_arguments():
    result = run_mpi(1, [str(LESSONS / "02_allreduce.py"), "--algorithms", "ring,bogus"], timeout=60, check=False)
    assert result.returncode != 0
    assert "bogus" in result.stderr

"""scripts/bench_allreduce.py: its shared-memory rows (zero copy, copy-in, hierarchical_shm) run under mpiexec and
write a row per size and algorithm, with the speed against MPI's own Allreduce measured in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # (the benchmark imports bench_util from its folder)

import bench_allreduce  # noqa: E402

SHM_ROWS = ["mpi", "ring", "shm", "shm-copyin", "hierarchical_shm", "hierarchical_shm-copyin"]


def test_a_rows_algorithm_and_buffer():
    assert bench_allreduce.variant("shm") == ("shm", "window")
    assert bench_allreduce.variant("shm-copyin") == ("shm", "plain")
    assert bench_allreduce.variant("hierarchical_shm") == ("hierarchical_shm", "node")
    assert bench_allreduce.variant("hierarchical_shm-copyin+watchdog") == ("hierarchical_shm", "plain")
    assert bench_allreduce.variant("ring+watchdog") == ("ring", "plain")


@pytest.mark.mpi
def test_the_shared_memory_rows_on_two_emulated_nodes(tmp_path):
    command = [sys.executable, str(SCRIPTS / "bench_allreduce.py"), "--ranks", "4", "--min-size", "64KiB",
               "--max-size", "256KiB", "--rounds", "9", "--algorithms", ",".join(SHM_ROWS), "--stat", "best",
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "allreduce.json").read_text())
    assert result["meta"]["stat"] == "best"
    rows = result["rows"]
    assert {(r["bytes"], r["algorithm"]) for r in rows} == {(s, a) for s in (64 << 10, 256 << 10) for a in SHM_ROWS}
    for row in rows:
        assert row["p"] == 4 and row["rounds"] >= 9
        assert 0 < row["best_s"] == row["time_s"] <= row["median_s"]
        assert row["ratio_vs_mpi"] > 0
    assert (tmp_path / "allreduce.txt").read_text().count("hierarchical_shm-copyin") >= 3  # (each of the tables)
    assert "x faster" in done.stdout or "x slower" in done.stdout

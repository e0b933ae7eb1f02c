"""scripts/calibrate.py's shared-memory constants: fence, copy and shm_from_bytes (where "auto" takes shm)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from mpi_util import run_mpi_code

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # (the script imports bench_util from its folder)

_environment = dict(os.environ)
import calibrate  # noqa: E402

os.environ.clear()  # (calibrate.py sets one thread per rank for itself at import: not for the other tests' processes)
os.environ.update(_environment)


def rows(*faster):
    """Measured sizes 1 KiB, 4 KiB, ...: shm 1 s where ``faster`` says so, else 3 s, against 2 s chosen."""
    return [{"bytes": 1024 << 2 * i, "chosen_s": 2.0, "shm_copyin_s": 1.0 if f else 3.0, "shm_zero_copy_s": 1.0}
            for i, f in enumerate(faster)]  # fmt: skip


def test_shm_from_bytes_is_the_smallest_size_from_which_shm_wins_at_every_larger_one():
    assert calibrate.shm_from_bytes(rows(True, True, True)) == 1024
    assert calibrate.shm_from_bytes(rows(False, True, True)) == 4096
    assert calibrate.shm_from_bytes(rows(True, False, True, True)) == 16384  # (a loss in between starts it again)
    assert calibrate.shm_from_bytes(rows(True, True, False)) is None  # slower at the largest size: never
    assert calibrate.shm_from_bytes(rows(False, False), "shm_zero_copy_s") == 1024
    tie = [{"bytes": 1024, "chosen_s": 1.0, "shm_copyin_s": 1.0}]
    assert calibrate.shm_from_bytes(tie) is None  # (as fast is not faster)


@pytest.mark.mpi
def test_the_shared_memory_measurements_on_three_ranks(tmp_path):
    code = f"""
        import json, sys
        sys.path.insert(0, {str(SCRIPTS)!r})
        import calibrate
        from mpi4py import MPI
        from dtrain.collectives import costmodel

        comm = MPI.COMM_WORLD
        found = {{"fence": calibrate.fence_time(comm, reps=3, batches=2),
                  "copy": calibrate.copy_time_per_byte(comm, nbytes=1 << 16, reps=2),
                  "rows": calibrate.shm_against_chosen(comm, costmodel.Machine(), sizes=[4096, 3 << 16])}}
        if comm.Get_rank() == 0:
            print("FOUND", json.dumps(found))
    """
    done = run_mpi_code(3, code, tmp_path, timeout=120)
    found = json.loads(done.stdout.split("FOUND", 1)[1])
    assert found["fence"] > 0 and found["copy"] > 0
    assert [row["bytes"] for row in found["rows"]] == [4096, 3 << 16]
    for row in found["rows"]:
        assert row["chosen"] in ("doubling", "rabenseifner", "ring", "tree")
        for name in ("chosen", "shm_copyin", "shm_zero_copy"):
            assert 0 < row[f"{name}_s"] <= row[f"{name}_median_s"]

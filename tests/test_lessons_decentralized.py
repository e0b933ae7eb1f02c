"""Lessons 5 (local SGD) and 6 (gossip) run end to end and say what they promise.

Each lesson checks its own claims (H = 1 against ddp, bytes against the cost functions, drift against distances
computed from the weights, mixing matrices and spectral gaps against closed forms, gossip rounds against W x) and
prints an OK line per claim, then ``all checks passed: yes``; here small runs must pass every check (the verdicts in
their measurements file), and bad arguments must end the job with a message that says what was wrong.
"""

from __future__ import annotations

import itertools
import math

import pytest
from mpi_util import LESSONS, run_lesson, run_mpi


@pytest.mark.mpi
def test_lesson_05_local_sgd_checks_its_claims(tmp_path):
    flags = ["--epochs", "2", "--seeds", "2", "--warmup-sync-steps", "10"]
    results, out = run_lesson(4, "05_local_sgd.py", flags, tmp_path, timeout=120)
    assert len(results["checks"]) == 6, results["checks"]  # every one passed (run_lesson)
    assert "H = 8 on 4 ranks:" in out, out
    assert results["world"] == 4 and results["steps"] == 2 * results["steps_per_epoch"] == 28
    for via in ("allreduce", "master"):
        assert results["equality"][via]["weights"] < 1e-12 and results["equality"][via]["mean_velocity"] < 1e-12
    assert results["equality"]["adam"] > 1e-6
    for name, row in results["bytes"].items():
        if name not in ("initial_broadcast", "evaluation"):
            assert row["measured"] == row["costs"], name
    for h in (1, 4, 8, 16):  # 28 steps: ddp sends 28 / ceil(28 / H) times the bytes on every rank
        assert results["bytes"][f"H={h}"]["ratio_to_ddp"] == pytest.approx([28 / math.ceil(28 / h)] * 4)
    n = results["n_bytes"]
    master = results["bytes"]["H=8 master"]
    assert master["measured"] == [master["averages"] * 3 * n] + [master["averages"] * n] * 3
    assert all(d == 0.0 for d in results["drift"]["1"]["per_step"])
    assert max(results["drift"]["16"]["per_step"]) > max(results["drift"]["4"]["per_step"]) > 0
    assert set(results["accuracy"]) == {"ddp", "H=1", "H=4", "H=8", "H=16", "post-local W=10 H=16"}
    assert all(len(row["test_accuracy"]) == 2 for row in results["accuracy"].values())
    assert math.isfinite(results["h8_difference_points"])


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [4, 8])
def test_lesson_06_gossip_checks_its_claims(nranks, tmp_path):
    results, _ = run_lesson(nranks, "06_gossip.py", ["--epochs", "2", "--rounds", "6"], tmp_path, timeout=120)
    assert len(results["checks"]) == 5, results["checks"]  # every one passed (run_lesson)
    assert results["world"] == nranks and results["topologies"] == ["ring", "exponential", "torus", "random"]
    gaps = results["spectral_gap"][str(nranks)]
    assert gaps["ring"] == pytest.approx(1 - (1 + 2 * math.cos(2 * math.pi / nranks)) / 3, abs=1e-12)
    assert gaps["exponential"] > gaps["ring"]
    ring = results["rounds"]["ring"]["spread"]
    assert len(ring) == 7 and all(b < a for a, b in itertools.pairwise(ring))
    training = results["training"]
    assert training["exponential"]["before_final_average"] < training["ring"]["before_final_average"]
    steps, n = results["steps"], results["n_bytes"]
    assert results["bytes"]["ring"]["measured"] == [2 * n * steps] * nranks
    assert results["bytes"]["ddp"]["messages"] == [2 * (nranks - 1) * steps] * nranks


@pytest.mark.parametrize(
    ("lesson", "flags", "message"),
    [
        ("05_local_sgd.py", ["--batch-size", "47"], "--batch-size 47 must be divisible by the 3 ranks"),
        ("05_local_sgd.py", ["--sync-every", "4,x"], "--sync-every '4,x' must be whole numbers >= 1"),
        ("06_gossip.py", ["--batch-size", "100"], "--batch-size 100 must be divisible by the 3 ranks"),
    ],
)
def test_lessons_05_06_exit_nonzero_on_bad_arguments(lesson, flags, message):
    """With 3 ranks the first rank to leave aborts the rest: it must have said why."""
    result = run_mpi(3, [str(LESSONS / lesson), *flags], timeout=60, check=False)
    assert result.returncode != 0
    assert "bad arguments" in result.stderr and message in result.stderr, result.stderr

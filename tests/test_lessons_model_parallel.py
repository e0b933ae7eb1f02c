"""Lessons 7 (tensor parallelism) and 8 (pipelines) run on several rank counts and say what they promise; their
measurements hold against what this test computes itself: the memory formula written out, the bubble formula, the
closed form of the activations each schedule keeps, and single's loss curve."""

from __future__ import annotations

import pytest
from mpi_util import LESSONS, run_lesson, run_mpi

TP = LESSONS / "07_tensor_parallel.py"
PP = LESSONS / "08_pipeline_parallel.py"


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_lesson_07_tensor_parallel_checks_its_claims(nranks, tmp_path):
    shrink = ["--epochs", "2", "--hidden", "256,256", "--big-batch", "64", "--steps", "2"]
    results, _ = run_lesson(nranks, TP.name, shrink, tmp_path, claims=(
        "the split block computes the whole block, gradients included",
        "one all-reduce forward (g) and one backward (f); none backward for data",
        "each rank's sub-communicators hold the ranks its groups name",
        "each rank holds what TensorParallel.costs() and the formula say",
        "every grid follows single's loss curve",
        "every rank's bytes per step equal TensorParallel.costs()",
    ))  # fmt: skip
    assert results["world"] == nranks
    h = 256
    for t, held in results["memory"]["rows"]:  # the column/row block split t ways, the output layer whole
        assert held == (784 * h + h + h * h) // t + h + h * 10 + 10
    curves = results["training"]
    assert len(curves) == 1 + sum(nranks % t == 0 for t in range(1, nranks + 1))  # single and every dp x tp grid
    for label, curve in curves.items():
        assert curve == pytest.approx(curves["single"], rel=1e-10), label
    assert results["timing"]["tp1_ms"] > 0 and 0 <= results["timing"]["comm_share"] <= 1


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_lesson_08_pipeline_parallel_checks_its_claims(nranks, tmp_path):
    results, _ = run_lesson(nranks, PP.name, ["--epochs", "2", "--max-microbatches", "4"], tmp_path, claims=(
        "every simulated bubble is the formula's",
        "each micro-batch went forward stage by stage and came back in reverse",
        "the measured bubble is the formula's, within 0.1, and falls as M grows",
        "the interpreter's peaks equal Pipeline.costs()",
        "1F1B keeps at most P/M of GPipe's activations on every stage",
        "every schedule and grid follows single's loss curve",
        "every rank's bytes per step equal Pipeline.costs()",
    ))  # fmt: skip
    P = results["world"]
    assert P == nranks
    for row in results["bubble"]:
        assert row["formula"] == pytest.approx((P - 1) / (row["M"] + P - 1))
        assert abs(row["measured"] - row["formula"]) < 0.1
    M, peaks = 4, results["activations"]
    for s in range(P):  # GPipe keeps all M micro-batches' activations, 1F1B min(P - s, M)
        assert peaks["1f1b"][s] * M == peaks["gpipe"][s] * min(P - s, M)
    curves = results["training"]
    for label, curve in curves.items():
        assert curve == pytest.approx(curves["single"], rel=1e-10), label
    assert ("pp 4 interleaved" in curves) == (nranks == 4) and ("dp 2 x pp 2" in curves) == (nranks == 4)


BAD = [(TP, 2, ["--hidden", "255,256"]), (TP, 1, ["--steps", "1"]), (PP, 3, ["--batch-size", "30"]),
       (PP, 1, ["--sleep-ms", "-1"])]  # fmt: skip


@pytest.mark.parametrize(("lesson", "nranks", "flags"), BAD)
def test_lessons_7_and_8_refuse_bad_arguments_before_any_communication(lesson, nranks, flags):
    """(With several ranks the first rank to leave aborts the rest: it must have said why.)"""
    result = run_mpi(nranks, [str(lesson), *flags], timeout=60, check=False)
    assert result.returncode == 2
    assert "bad arguments" in result.stderr and flags[0] in result.stderr

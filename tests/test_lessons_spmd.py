"""Lesson 14 (SPMD: tensor layouts on a device mesh) runs on 4 ranks and says what it promises; its measurements hold
against what this test computes itself.

The lesson checks its own claims (the blocks against coordinates written out by hand, the matmul rule's cases
against A @ B and the tracer, every training run against single's curve and costs(), spmd's runs against ddp's, tp's
and ZeRO-3's); this test reads their verdicts from its --json and holds the figures against the formulas written out
again here: a ring all-reduce, all-gather and reduce-scatter of n elements on p ranks send 2(p-1)n, (p-1)n and (p-1)n
elements in all, and each layout's collectives follow from the rules by hand. (notebooks/14_spmd.ipynb, the same on
simulated ranks, is run by nbmake with the other notebooks.)
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
from mpi_util import LESSONS, run_lesson, run_mpi

LESSON = LESSONS / "14_spmd.py"
SIZES = [64, 64, 64, 10]  # digits, --hidden 64,64 (the lesson's default)
BATCH, P, B = 48, 4, 8  # the global batch, the ranks, bytes per float64
WEIGHTS = [a * b for a, b in itertools.pairwise(SIZES)]
BIASES = SIZES[1:]
N = sum(WEIGHTS) + sum(BIASES)


@pytest.mark.mpi
def test_lesson_14_spmd_checks_its_claims(tmp_path):
    results, out = run_lesson(P, LESSON.name, [], tmp_path, claims=(
        "each axis's communicator holds the ranks its mesh groups name",
        "every rank's block is the slice its coordinates name, of Layout.local_shape's shape",
        "the blocks of every rank put A back together exactly",
        "each case's C and collectives are the rule's, as written out here",
        "every case computes A @ B (gathered whole, to 1e-12)",
        "the dry run (no communicator) lists the same collectives",
        "spmd --sharding dp ends with ddp's weights bit for bit, sending its bytes",
        "--sharding megatron sends tp's bytes on every rank and ends with its weights",
        "every weight is gathered before use (again in backward where needed), its gradient reduce-scattered",
        "a rank holds 1/4 of every weight and every bias whole (the formula, = costs())",
        "dp-megatron sends tp 2 x dp 2's bytes and ends with its weights, as do the --shard words",
        "each invalid layout is refused, its error naming what is wrong",
        "every spmd run called the one forward once per step, and once in its dry run",
        "each run's collectives per step are its dry run's (what --explain prints)",
    ))  # fmt: skip
    assert results["world"] == P
    assert out.rstrip().endswith("all checks passed: yes")

    # 1. the blocks of an 8 x 12 matrix: rank r = 2 x + y (the last axis fastest)
    rows = {tuple(row[:3]): row[3:] for row in results["notation"]}
    assert rows["A[I_x, J_y]", "[x,y]", "4x6"] == ["0:4,0:6", "0:4,6:12", "4:8,0:6", "4:8,6:12"]
    assert rows["A[I_y, J_x]", "[y,x]", "4x6"] == ["0:4,0:6", "4:8,0:6", "0:4,6:12", "4:8,6:12"]

    # 2. the matmul of 8 x 12 by 12 x 6 on axes of 2 ranks: an all-gather sends half its result from each rank
    cases = results["matmul"]
    assert cases["1"]["matmul"] == cases["3"]["matmul"] == 0
    assert cases["2"]["matmul"] == 8 * 12 / 2 * B  # A gathered whole over x
    assert cases["4"]["matmul"] == 12 * 6 / 2 * B  # B's columns gathered over x
    assert cases["3"]["made_whole"] == 2 * (8 * 6) / 2 * B  # the partial sum: one all-reduce of C over x

    runs = results["runs"]
    for label, run in runs.items():
        assert run["sent"] == run["costs"], label
    for label, curve in results["training"].items():
        assert curve == pytest.approx(results["training"]["single"], rel=1e-10), label

    # 3. dp: one all-reduce of every parameter over the 4 ranks, ddp's, and ddp's weights
    assert runs["spmd dp"]["digest"] == runs["ddp"]["digest"]
    assert sum(runs["spmd dp"]["sent"]) == 2 * (P - 1) * N * B
    assert [(c["phase"], c["kind"], c["axis"], c["elements"]) for c in runs["spmd dp"]["collectives"]] == [
        ("update", "all-reduce", "x", N)
    ]

    # 4. megatron: g, one all-reduce of the batch's rows x the second layer's outputs, forward only; tp's bytes
    assert runs["spmd megatron"]["sent"] == runs["tp 4"]["sent"] == [2 * (P - 1) / P * BATCH * SIZES[2] * B] * P
    assert runs["spmd megatron"]["digest"] == runs["tp 4"]["digest"]

    # 5. fsdp: every weight gathered forward; backward layer by layer from the last, w3 and w2 gathered again and
    # every weight's gradient reduce-scattered; the biases all-reduced; ZeRO-3 gathers every parameter twice and
    # reduce-scatters it once
    fsdp = [(c["phase"], c["kind"], c["elements"]) for c in runs["spmd fsdp"]["collectives"]]
    backward = []
    for j in (2, 1, 0):
        backward += [("backward", "all-gather", WEIGHTS[j])] if j else []
        backward += [("backward", "reduce-scatter", WEIGHTS[j] // P)]
    assert fsdp == [("forward", "all-gather", w) for w in WEIGHTS] + backward + [("update", "all-reduce", sum(BIASES))]
    assert sum(runs["spmd fsdp"]["sent"]) == (P - 1) * B * (3 * sum(WEIGHTS) - WEIGHTS[0] + 2 * sum(BIASES))
    assert sum(runs["zero 3"]["sent"]) == 3 * (P - 1) * N * B

    # 6. dp-megatron on x=2,y=2: g over y (2 ranks) of half the batch's rows; ddp's all-reduce over x of the blocks
    blocks = WEIGHTS[0] // 2 + BIASES[0] // 2 + WEIGHTS[1] // 2 + BIASES[1] + WEIGHTS[2] + BIASES[2]
    dpm = [(c["phase"], c["kind"], c["axis"], c["elements"]) for c in runs["dp-megatron"]["collectives"]]
    assert dpm == [("forward", "all-reduce", "y", BATCH // 2 * SIZES[2]), ("update", "all-reduce", "x", blocks)]
    assert runs["dp-megatron"]["sent"] == [(BATCH // 2 * SIZES[2] + blocks) * B] * P  # 2 (p-1)/p = 1 on 2 ranks
    assert runs["dp-megatron"]["digest"] == runs["tp 2 x dp 2"]["digest"] == runs["--shard words"]["digest"]
    assert runs["dp-megatron"]["sent"] == runs["tp 2 x dp 2"]["sent"]


BAD = [(2, [], "needs 4 ranks"), (4, ["--hidden", "62,64"], "--hidden"), (4, ["--batch-size", "50"], "--batch-size")]


@pytest.mark.parametrize(("nranks", "flags", "said"), BAD)
def test_lesson_14_refuses_bad_arguments_before_any_communication(nranks, flags, said):
    """(With several ranks the first rank to leave aborts the rest: it must have said why.)"""
    result = run_mpi(nranks, [str(LESSON), *flags], timeout=60, check=False)
    assert result.returncode == 2
    assert said in result.stderr


def test_lesson_14s_invalid_layout_is_dtrain_trains_refusal():
    """Section 7 says dtrain train refuses each invalid layout with status 2 and the line it prints."""
    result = subprocess.run([sys.executable, "-m", "dtrain", "train", "--paradigm", "spmd", "--mesh", "x=2,y=2",
                             "--shard", "w1=x,x", "--explain"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "--shard w1=x,x: axis x splits two dimensions of one tensor" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

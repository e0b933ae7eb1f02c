"""Lesson 13 (gradient compression) runs end to end and says what it promises.

The lesson checks its own claims (bytes against costs() and the closed forms, the state each compressor keeps, the
rank of a rank's gradient, error feedback against none, fp16 and bf16 against their definitions, the cost model
against the planner's) and prints an OK line per claim, then ``all checks passed: yes``. Here its --quick run on 4
ranks must pass every check (the verdicts in its measurements file), and the bytes it reports must be what costs()
says when computed again here, from the flags it reports; bad arguments must end the job with a message.
"""

from __future__ import annotations

import math

import pytest
from mpi_util import LESSONS, run_lesson, run_mpi

from dtrain.config import TrainConfig
from dtrain.parallel.data_parallel import DataParallel


def costs(sizes, world: int, batch: int, flags: dict) -> dict:
    config = TrainConfig(paradigm="ddp", allreduce="ring", hidden=tuple(sizes[1:-1]), batch_size=batch, **flags)
    return DataParallel.costs(sizes, world, config)


@pytest.mark.mpi
def test_lesson_13_compression_checks_its_claims(tmp_path):
    results, out = run_lesson(4, "13_compression.py", ["--quick"], tmp_path, timeout=120)
    assert len(results["checks"]) == 14, results["checks"]  # every one passed (run_lesson)
    assert results["world"] == 4 and results["epochs"] == 4 and results["sizes"] == [64, 32, 32, 10]
    sizes, batch = results["sizes"], results["batch_size"]

    # 2: every run's bytes per step, as the tracer counted them, are costs()'s computed again here
    runs = results["runs"]
    assert list(runs) == ["ddp ring", "fp16", "bf16", "top-k 1%", "PowerSGD r=2"]
    for label, run in runs.items():
        expected = costs(sizes, 4, batch, run["flags"])
        assert run["measured"] == run["costs"] == expected["sent_per_step"], label
        assert run["state_bytes"] == expected.get("compression", 0), label
        assert math.isfinite(run["difference_points"]) and 0 < run["test_accuracy"] <= 100
    ddp = runs["ddp ring"]["measured"]
    assert runs["fp16"]["measured"] == runs["bf16"]["measured"] == [b / 2 for b in ddp]
    n, k = results["parameters"], math.ceil(0.01 * results["parameters"])
    assert runs["top-k 1%"]["measured"] == [3 * 2 * k * 4] * 4  # (p-1) 2k pairs of 4 bytes
    assert runs["top-k 1%"]["state_bytes"] == 4 * n  # the residual: the whole gradient
    assert max(runs["PowerSGD r=2"]["measured"]) < 0.25 * min(ddp)

    # 5: the cost model's bytes are costs()'s too, for both models
    for model in results["cost_model"].values():
        for label, row in model["methods"].items():
            assert row["bytes"] == costs(model["sizes"], 4, model["batch"], runs[label]["flags"])["sent_per_step"]
    slow = results["cost_model"]["MNIST-sized"]["methods"]
    assert slow["top-k 1%"]["slow"]["communication"] < slow["ddp ring"]["slow"]["communication"]

    # 1: shares of the squared norm grow with the singular values counted; a rank's gradient has rank <= its rows
    for layer in results["spectrum"].values():
        for kind in ("average", "own", "random"):
            assert 0 < layer[kind][0] <= layer[kind][1] <= layer[kind][2] <= 1 + 1e-12
    assert results["magnitudes"]["0.01"]["gradient"] > results["magnitudes"]["0.01"]["random"]

    # 3: error feedback; 4: fp16's underflow, bf16's none
    feedback = results["feedback"]
    assert feedback["top-k 1%, off"]["never_moved"] > feedback["top-k 1%, on"]["never_moved"]
    tiny = results["underflow"]["1e-08"]
    assert tiny["fp16"]["flushed"] > 0 and tiny["bf16"]["flushed"] == 0
    assert "all checks passed: yes" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ratio", "0"], "--ratio 0.0 must be in (0, 1]"),
        (["--rank", "11"], "--rank 11 must be >= 1 and at most the smaller side of every weight matrix (10)"),
        (["--batch-size", "47"], "--batch-size 47 must be divisible by the 2 ranks"),
    ],
)
def test_lesson_13_exits_nonzero_on_bad_arguments(flags, message):
    result = run_mpi(2, [str(LESSONS / "13_compression.py"), *flags], timeout=60, check=False)
    assert result.returncode != 0
    assert "bad arguments" in result.stderr and message in result.stderr, result.stderr

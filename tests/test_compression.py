"""``ddp --compress``: each compressor's bytes and state against the tracer, its result against the exact average
(within the format's rounding bound), its degenerate settings against plain ddp, error feedback's invariant, real
ranks against the simulator, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dtrain import report
from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.parallel import compression
from dtrain.train import train

BASE = dict(paradigm="ddp", dataset="digits", hidden=(32, 32), batch_size=48, quiet=True, progress=False, timeout=0)
SYNTHETIC = {"dataset": "synthetic", "features": 64, "classes": 10}  # (its --samples sets the steps of an epoch)
SETTINGS = {"fp16": {}, "bf16": {}, "topk": {"compress_ratio": 0.05}, "powersgd": {"powersgd_rank": 2}}


def run(p: int, **flags) -> dict:
    config = TrainConfig(**{**BASE, **flags})
    return sim.SimWorld(p, timeout=120).run(lambda comm: train(config, comm))[0]


def steady_bytes(p: int, **flags) -> list[int]:
    """Bytes each rank sent per training step: the difference of two runs of 2 and of 4 steps (what is sent once a
    run, the initial broadcast, cancels)."""
    sent = []
    for steps in (2, 4):
        m = run(p, epochs=1, samples=-(-steps * 48 * 5 // 4), **SYNTHETIC, **flags)
        sent.append([r["totals"]["bytes_sent"] for r in m["communication"]["per_rank"]])
    return [(b - a) // 2 for a, b in zip(*sent)]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_bytes_and_state_are_the_costs(name, p):
    flags = {"compress": name, **SETTINGS[name]}
    m = run(p, epochs=1, samples=240, **SYNTHETIC, **flags)
    held, predicted = report.state_bytes(m)
    assert held == predicted
    assert steady_bytes(p, **flags) == m["costs"]["sent_per_step"]


def test_the_savings_are_the_issues():
    """fp16: half the ring's bytes; top-k at 1% on 4 ranks: p k / n = 4% of ddp ring's; PowerSGD rank 2 on the
    784-512-512-10 MLP: under 5% (from costs(), which the test above holds to the tracer)."""
    from dtrain.parallel.data_parallel import DataParallel

    def sent(sizes, **flags):
        config = TrainConfig(**{**BASE, "allreduce": "ring", **flags})
        return sum(DataParallel.costs(sizes, 4, config)["sent_per_step"])

    digits = [64, 32, 32, 10]
    ddp = sent(digits)
    assert sent(digits, compress="fp16") / ddp == pytest.approx(0.5, abs=1e-3)
    assert sent(digits, compress="topk", compress_ratio=0.01) / ddp <= 0.05
    mnist = [784, 512, 512, 10]
    assert sent(mnist, compress="powersgd", powersgd_rank=2) / sent(mnist) <= 0.05


def exchange(p: int, name: str, grads: list, **flags) -> list:
    """One compressor exchange on ``p`` simulated ranks; rank r's gradient is ``grads[r]`` (one flat vector)."""
    config = TrainConfig(**{**BASE, "compress": name, **SETTINGS.get(name, {}), **flags})

    def rank(comm):
        flat = grads[comm.Get_rank()].copy()
        compression.make(config, comm, [flat]).exchange(flat)
        return flat

    return sim.SimWorld(p, timeout=60).run(rank)


@pytest.mark.parametrize(("name", "unit"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_precision_is_the_average_within_its_rounding(name, unit):
    """A chunk's sum is rounded to the format once per message it travels in (p - 1 partial sums, then the whole sum
    once more for the all-gather), each time by at most half an ulp, ``unit`` relative: p roundings of sums no larger
    than sum_r |g_r|, divided by p, put the average within unit x sum_r |g_r| of the exact one; the same bits on every
    rank."""
    rng = np.random.default_rng(0)
    p = 4
    grads = [rng.standard_normal(1001).astype(np.float32) for _ in range(p)]
    out = exchange(p, name, grads)
    exact = np.mean(np.array(grads, dtype=np.float64), axis=0)
    bound = unit * np.sum(np.abs(grads), axis=0) * 1.01 + 1e-7 * np.abs(exact)
    assert np.all(np.abs(out[0] - exact) <= bound)
    assert all(np.array_equal(o, out[0]) for o in out)
    assert np.abs(out[0] - exact).max() > 0  # (it did round)


def test_fp16_underflows_where_bf16_does_not():
    tiny = [np.full(8, 1e-8, dtype=np.float32)] * 2
    assert np.all(exchange(2, "fp16", tiny)[0] == 0)  # under fp16's smallest subnormal, 6e-8: flushed
    assert np.allclose(exchange(2, "bf16", tiny)[0], 1e-8, rtol=2.0**-7)


def test_topk_error_feedback_keeps_exactly_what_was_not_sent():
    """residual after + what was sent == residual before + gradient, to the bit, on every rank, over steps."""
    p, n = 3, 500
    config = TrainConfig(**{**BASE, "compress": "topk", "compress_ratio": 0.02})

    def rank(comm):
        rng = np.random.default_rng(comm.Get_rank())
        flat = np.zeros(n)
        topk = compression.make(config, comm, [flat])
        for _ in range(5):
            g = rng.standard_normal(n)
            owed = topk.residual + g
            flat[...] = g
            topk.exchange(flat)
            index, values = topk.last_sent
            back = topk.residual.copy()
            back[index] += values
            assert np.array_equal(back, owed) and np.all(topk.residual[index] == 0) and len(index) == topk.k
        return True

    assert all(sim.SimWorld(p, timeout=60).run(rank))


def test_topk_of_everything_and_full_rank_powersgd_follow_ddp():
    """k = n sends the whole gradient (summed in rank order, where the ring sums around the ring: float64 rounding
    apart); PowerSGD at full rank reconstructs the averaged matrix (P P^T M = M once P spans M's columns)."""
    common = dict(epochs=2, dtype="float64", hidden=(10, 10))  # every weight matrix's smaller side is 10
    ddp = run(4, allreduce="ring", **common)
    for flags in ({"compress": "topk", "compress_ratio": 1.0}, {"compress": "powersgd", "powersgd_rank": 10}):
        ours = run(4, **flags, **common)
        for a, b in zip(ours["epochs"], ddp["epochs"], strict=True):
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-9), flags
            assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-9), flags


def test_a_low_rank_and_a_small_ratio_still_train():
    """Error feedback makes the small settings converge (digits, 4 ranks, 5 epochs)."""
    ddp = run(4, epochs=5)["final"]["test_accuracy"]
    for flags in ({"compress": "topk", "compress_ratio": 0.01}, {"compress": "powersgd", "powersgd_rank": 2}):
        assert run(4, epochs=5, **flags)["final"]["test_accuracy"] > ddp - 0.03, flags


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 3, 4])
def test_real_ranks_train_as_the_simulator(tmp_path, p):
    """Under mpiexec, every compressor's weights are the simulator's to the bit."""
    for name, extra in SETTINGS.items():
        flags = [
            "--paradigm",
            "ddp",
            "--dataset",
            "digits",
            "--hidden",
            "32,32",
            "--batch-size",
            "48",
            "--epochs",
            "1",
            "--compress",
            name,
        ] + [w for k, v in extra.items() for w in (f"--{k.replace('_', '-')}", str(v))]
        folder = tmp_path / name
        command = [sys.executable, "-m", "dtrain", "launch", "-n", str(p), "-m", "dtrain", "train", *flags, "--quiet",
                   "--no-progress", "--out", str(folder)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        real = json.loads((folder / "metrics.json").read_text())
        assert real["weights_sha256"] == run(p, epochs=1, compress=name, **extra)["weights_sha256"], name


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--compress", "zip"], "invalid choice: 'zip'"),
     (["--compress", "topk", "--compress-ratio", "0"], "--compress-ratio must be in (0, 1]"),
     (["--compress", "topk", "--compress-ratio", "1.5"], "--compress-ratio must be in (0, 1]"),
     (["--compress", "powersgd", "--powersgd-rank", "11", "--hidden", "32,32"], "--powersgd-rank 11 is larger than"),
     (["--compress", "fp16", "--overlap"], "drop --overlap"),
     (["--compress", "fp16", "--allreduce", "mpi"], "drop --allreduce mpi"),
     (["--paradigm", "zero", "--compress", "fp16"], "--compress")],
)  # fmt: skip
def test_bad_input_is_one_line(tmp_path, flags, says):
    paradigm = [] if "--paradigm" in flags else ["--paradigm", "ddp"]
    done = subprocess.run([sys.executable, "-m", "dtrain", "train", *paradigm, *flags, "--epochs", "1"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr

"""The lessons run end to end and say what they promise: lesson 1 trains, lesson 2's all-reduces all agree with MPI.

Each lesson checks its own claims (gradients against finite differences, every all-reduce against MPI_Allreduce and
NumPy, every rank's bytes against the cost model) and ends with a line a test can read; lesson 2 also exits non-zero
when a check fails, so a failure shows up here with the lesson's whole output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import COLUMNS, LESSONS, assert_fits, run_lesson, run_mpi

from dtrain.collectives import ALGORITHMS, chunk_bounds


def test_lesson_01_single_device_trains():
    result = subprocess.run(
        [sys.executable, str(LESSONS / "01_single_device.py"), "--epochs", "2"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "COLUMNS": str(COLUMNS)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert_fits(result.stdout, COLUMNS)
    accuracy = re.search(r"final test accuracy ([\d.]+)%", result.stdout)
    assert accuracy, result.stdout
    assert float(accuracy.group(1)) > 80, result.stdout  # two epochs on digits already reach ~95%
    assert "bit-identical to the weights of the loop in section 3: yes" in result.stdout, result.stdout


def test_lesson_01_plot_without_matplotlib_is_one_line_before_training(tmp_path):
    (tmp_path / "matplotlib.py").write_text("raise ImportError('No module named matplotlib')\n")
    result = subprocess.run(
        [sys.executable, str(LESSONS / "01_single_device.py"), "--plot", str(tmp_path / "c.png")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "--plot: plotting needs matplotlib, which is not installed: pip install -e '.[course]' (everything the "
        "course uses), or pip install matplotlib"
    ], result.stderr
    assert result.stdout == ""  # refused before section 1, not after training


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_lesson_02_allreduce_every_algorithm_agrees_with_mpi(nranks, tmp_path):
    flags = ["--size-mib", "0.05", "--repeats", "2", "--shm-mib", "0.05,0.5"]
    if nranks == 4:
        flags += ["--ranks-per-node", "2"]  # the hierarchical algorithms across two emulated nodes
    results, out = run_lesson(nranks, "02_allreduce.py", flags, tmp_path, timeout=180, claims=(
        "all algorithms agree with MPI_Allreduce", "bytes sent match costmodel.bytes_sent on every rank",
        "ring and shm on one machine give the exact sum", "bytes copied match the formulas on every rank",
    ))  # fmt: skip
    assert "all algorithms agree with MPI_Allreduce: yes" in out, out
    assert "bytes sent match costmodel.bytes_sent on every rank: yes" in out, out
    for algorithm in ALGORITHMS:  # one row per algorithm, and each says ok
        row = re.search(rf"^{algorithm}\s.*$", out, flags=re.MULTILINE)
        assert row and row.group(0).split()[1 if algorithm != "auto" else 3] == "yes", (algorithm, out)
    assert_copies_counted(results, out, nranks)


def assert_copies_counted(results: dict, out: str, nranks: int, count: int = 13_107) -> None:
    """Lesson 2's part "On one machine, messages are copies": every rank's traced bytes (ring: sent; shm: copied)
    are the formulas written here, and the printed table shows rank 0's; timed against MPI on real ranks, said to be
    skipped on simulated ones (one rank)."""
    copies = results["copies"]
    q = 4 if nranks == 1 else nranks  # one rank: 4 simulated ones
    assert (copies["ranks"], copies["simulated"]) == (q, nranks == 1)
    n = 4 * count
    chunk = [4 * (b - a) for a, b in chunk_bounds(count, q)]
    for r, mine in enumerate(copies["per_rank"]):  # bytes this rank must move, whatever the lesson says
        exact = {
            "ring": (n - chunk[r]) + (n - chunk[(r + 1) % q]),  # every chunk but mine, then every chunk but r + 1's
            "shm, zero copy": 2 * (q - 1) * chunk[r],  # load chunk r of p-1 buffers, store the sum into p-1
            "shm, copy-in": 2 * (q - 1) * chunk[r] + 2 * (n - chunk[r]),  # + every chunk but mine, in and out
        }
        assert {name: mine[name]["measured"] for name in exact} == exact, (r, mine)
        assert mine["ring"]["bytes_copied"] == 0 and mine["shm, zero copy"]["bytes_sent"] == 0
        assert all(mine[name]["exact"] for name in exact)
    ring, zero, copy_in = (
        copies["per_rank"][0][name]["measured"] for name in ("ring", "shm, zero copy", "shm, copy-in")
    )
    assert re.search(rf"^ring, sent\s+2\(p-1\)/p n\s+{ring:,}\s+{ring:,}\s+=$", out, re.M), out
    assert re.search(rf"^ring, copied by MPI\s+2 x sent\s+{2 * ring:,}\s+-\s+-$", out, re.M), out
    assert re.search(rf"^shm zero copy, copied\s+2\(p-1\) c_r\s+{zero:,}\s+{zero:,}\s+=$", out, re.M), out
    assert re.search(rf"^shm copy-in, copied\s+.*\s{copy_in:,}\s+{copy_in:,}\s+=$", out, re.M), out
    if nranks == 1:
        assert results["timing"] == [] and "Timing skipped: 4 simulated ranks are threads of this one process" in out
        return
    contenders = ["MPI's Allreduce", "ring", "shm, zero copy", "shm, copy-in"]
    assert [(t["mib"], list(t["seconds"]), t["exact"]) for t in results["timing"]] == [
        (mib, contenders, True) for mib in (0.05, 0.5)
    ]
    assert all(s > 0 for t in results["timing"] for s in t["seconds"].values())
    for name in contenders[1:]:  # each size's row says which way, against MPI's
        said = re.findall(rf"^(?:\S+ MiB)?\s+{re.escape(name)}\s+[\d.]+\s+(\d+\.\d\dx (?:faster|slower)|as fast)$",
                          out, re.M)  # fmt: skip
        assert len(said) == 2, (name, out)


@pytest.mark.parametrize("nranks", [1, 3])  # with 3, said once all the same
@pytest.mark.parametrize(("flags", "said"), [(["--algorithms", "ring,bogus"], "bogus"), (["--shm-mib", "1,0"], "1,0")])
def test_lesson_02_exits_nonzero_on_bad_arguments(nranks, flags, said):
    result = run_mpi(nranks, [str(LESSONS / "02_allreduce.py"), *flags], timeout=60, check=False)
    assert result.returncode == 2
    assert said in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_lesson_03_data_parallel_checks_its_claims(nranks, tmp_path):
    """Lesson 3 checks the gradient average, the loss curves and every rank's bytes; here its measurements file says
    so, and its trace holds each rank's backward and bucket spans."""
    trace = tmp_path / "trace.json"
    ranks = [k for k in (1, 2, 4) if k <= nranks]
    flags = ["--epochs", "2", "--steps", "8", "--big-batch", "192", "--trace", str(trace)]
    results, out = run_lesson(nranks, "03_data_parallel.py", flags, tmp_path, claims=(
        "the average of the slice gradients is the whole batch's gradient",
        f"the loss curves on {ranks} ranks agree",
        "bytes per step match DataParallel.costs() and 2(p-1)/p n on every rank",
    ))  # fmt: skip
    assert results["world"] == nranks and results["ranks"] == ranks
    assert results["gradient"]["max_difference"] < 1e-12 and results["gradient"]["loss_difference"] < 1e-12
    curves = [results["training"][str(k)]["train_loss"] for k in ranks]
    assert all(len(c) == 2 and np.allclose(c, curves[0], rtol=0, atol=1e-5) for c in curves)
    for row in results["bytes"]:  # one bucket, then one per layer
        assert row["measured"] == row["costs"] and len(row["measured"]) == nranks
        assert row["messages"] == [2 * (nranks - 1) * len(row["buckets"])] * nranks
    timed = {(t["model"], t["ranks"]) for t in results["timing"]}
    assert timed == {(model, k) for model in ("64-32-10", "784-512-512-10") for k in ranks}
    assert all(0 <= t["waiting_ms"] <= t["ms_per_step"] for t in results["timing"])

    if nranks == 1:  # one rank: nothing to all-reduce, no timeline, no trace
        assert "no timeline" in out and not trace.exists()
        return
    assert set(results["overlap"]) >= {"on", "off", "fraction", "saved"}
    spans = {(e["pid"], e["name"]) for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "span"}
    for rank in range(nranks):  # three buckets (one per layer, the default --bucket-mb), each beside backward
        assert {(rank, "backward")} | {(rank, f"bucket {b} in flight") for b in range(3)} <= spans, spans


def test_lesson_03_exits_nonzero_on_bad_arguments():
    result = run_mpi(2, [str(LESSONS / "03_data_parallel.py"), "--batch-size", "47"], timeout=60, check=False)
    assert result.returncode != 0
    assert "--batch-size 47" in result.stderr and "divisible" in result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [3, 4])
def test_lesson_04_parameter_server_checks_its_claims(nranks, tmp_path):
    """Lesson 4 checks ps-sync against one process, bound 0 against ps-sync, the staleness histograms against the
    tracer's pushes and the bound, and every rank's bytes against the cost functions; its measurements file says
    so."""
    results, _ = run_lesson(nranks, "04_parameter_server.py", ["--epochs", "2", "--quick"], tmp_path, claims=(
        "ps-sync's weights are one process's on the whole global batch",
        "ps-async reaches 90% test accuracy (with and without a bound)",
        "ps-sync's loss curve is ddp's",
        "with bound 0 and plain SGD, ps-async is ps-sync",
        "every push is in the histogram once, and within the bound",
        "bytes per step match the cost functions on every rank, and the server sends W n / S",
    ))  # fmt: skip
    workers, servers = nranks - 1, [1, 2] if nranks >= 4 else [1]
    assert results["world"] == nranks and results["workers"] == workers and results["servers"] == servers
    assert all(d < 1e-12 for d in results["protocol"]["relative_difference"].values())
    assert results["lockstep_relative_difference"] < 1e-12
    tags = [m["tag"] for m in results["protocol"]["messages"]]  # the one-server run's every message, in time order
    assert tags.count("PULL") == tags.count("DONE") == tags.count("END") == workers
    assert tags.count("PUSH") == tags.count("WEIGHTS") == tags.count("END") + (tags.count("WEIGHTS") - workers)
    assert set(results["convergence"]) == {"ps-sync", "ps-async", "ps-async K=2", "ddp"}
    assert all(len(c["train_loss"]) == 2 for c in results["convergence"].values())
    bounds = {"ps-sync": 0, "ps-async": None, "ps-async K=2": (workers - 1) * 5, "ps-async K=0 (1 epoch)": workers - 1}
    assert set(results["staleness"]) == set(bounds)
    for name, st in results["staleness"].items():  # every push recorded once, and (W-1)(2K+1) at most
        assert sum(st["histogram"].values()) == st["pushes"] and st["ok"] and st["bound"] == bounds[name], name
        assert st["bound"] is None or st["max"] <= st["bound"], name
    for workload in ("synthetic", "digits"):
        runs = results["straggler"][workload]["runs"]
        assert len(runs) == 5 and all(len(r["pushes"]) == workers and r["samples_per_s"] > 0 for r in runs)
        assert all(r["pushes"] == runs[0]["pushes"] for r in runs if r["paradigm"] == "ps-sync")  # lockstep
    n = results["link"]["n"]
    for label, run in results["link"]["runs"].items():
        assert run["sent"] == run["costs"] and len(run["sent"]) == nranks, label
    assert results["link"]["runs"]["ps-sync S=1"]["sent"] == [n] * workers + [workers * n]
    if nranks >= 4:  # two servers: each sends the W - 1 workers half of the parameters
        assert results["link"]["runs"]["ps-sync S=2"]["sent"][-2:] == [(workers - 1) * n // 2] * 2


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("nranks", "args", "message"),
    [
        (4, ["--batch-size", "50"], "--batch-size 50 must be divisible by 2, 3, 4"),  # 3 and 2 workers, 4 for ddp
        (2, [], "lesson 4 needs at least 3 ranks"),
    ],
)
def test_lesson_04_exits_nonzero_on_bad_arguments(nranks, args, message):
    """Every rank refuses, so rank 0 alone says why, once, and every rank exits 2 without aborting."""
    result = run_mpi(nranks, [str(LESSONS / "04_parameter_server.py"), *args], timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.count(message) == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "Abort" not in result.stderr

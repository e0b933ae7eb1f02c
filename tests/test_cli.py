"""The ``dtrain`` command, run as a user runs it: a subprocess, judged by its exit code, stderr and metrics.json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from dtrain.data import write_idx

TIMEOUT = 120
TRAIN_FAST = ["--epochs", "3", "--hidden", "32", "--no-progress"]


def dtrain(*args, cwd, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    """``python -m dtrain ARGS`` in ``cwd`` (never the repository: the installed package must work anywhere)."""
    return subprocess.run(
        [sys.executable, "-m", "dtrain", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def metrics_of(folder) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def trained(tmp_path, *flags) -> tuple[dict, subprocess.CompletedProcess]:
    """``dtrain train FLAGS --out TMP_PATH/run`` in ``tmp_path``, which must succeed: its metrics.json, and the run."""
    result = ok(dtrain("train", *flags, "--out", tmp_path / "run", cwd=tmp_path))
    return metrics_of(tmp_path / "run"), result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three short digits runs: seed 0 twice and seed 1 once."""
    root = tmp_path_factory.mktemp("runs")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        ok(dtrain("train", *TRAIN_FAST, "--seed", seed, "--lr", "0.05", "--out", root / name, cwd=root))
    return root


# ------------------------------------------------------------------------------------------------- training
def test_metrics_json(runs):
    m = metrics_of(runs / "a")
    assert m["schema"] == "dtrain.metrics/1"
    for key in ("config", "world_size", "model", "dataset", "epochs", "final", "samples_per_s", "wall_time_s"):
        assert key in m, key
    assert set(m["environment"]) >= {"python", "numpy", "dtrain", "platform", "cpu_count"}
    cfg = m["config"]
    assert cfg["paradigm"] == "single" and cfg["dataset"] == "digits" and cfg["optimizer"] == "sgd"
    assert (cfg["epochs"], cfg["hidden"], cfg["seed"], cfg["lr"], cfg["batch_size"]) == (3, [32], 0, 0.05, 64)
    assert cfg["out"] == str(runs / "a")
    assert m["world_size"] == 1
    assert m["model"] == {"sizes": [64, 32, 10], "parameters": 64 * 32 + 32 + 32 * 10 + 10}
    assert m["dataset"] == {"name": "digits", "train_samples": 1438, "test_samples": 359, "features": 64, "classes": 10}

    epochs = m["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    losses = [e["train_loss"] for e in epochs]
    assert all(np.isfinite(losses)) and losses[0] > losses[1] > losses[2], losses
    assert epochs[0]["train_loss"] < np.log(10)  # below chance level already after one epoch
    for e in epochs:
        assert e["samples_per_s"] > 0 and e["train_time_s"] > 0 and 0 <= e["test_accuracy"] <= 1
        # samples/s counts whole global batches: 1438 // 64 = 22 steps of 64 per epoch
        assert e["samples_per_s"] == pytest.approx(22 * 64 / e["train_time_s"])
    assert m["final"] == {k: epochs[-1][k] for k in ("train_loss", "test_loss", "test_accuracy")}
    assert m["final"]["test_accuracy"] > 0.8
    assert m["samples_per_s"] > 0 and m["wall_time_s"] >= sum(e["train_time_s"] for e in epochs)
    assert re.fullmatch(r"[0-9a-f]{64}", m["weights_sha256"])


def test_same_seed_same_weights_other_seed_other_weights(runs):
    a, b, c = (metrics_of(runs / name) for name in "abc")
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a["epochs"][-1]["train_loss"] == b["epochs"][-1]["train_loss"]
    assert a["weights_sha256"] != c["weights_sha256"]


def test_cli_run_equals_library_run(runs):
    """The digest is of the final flat parameters: the same config through train() gives the same digest."""
    from dtrain.config import TrainConfig
    from dtrain.train import train

    metrics = train(TrainConfig(epochs=3, hidden=(32,), seed=0, lr=0.05, progress=False, quiet=True))
    assert metrics["weights_sha256"] == metrics_of(runs / "a")["weights_sha256"]


def test_weights_digest_is_sha256_of_all_the_bytes():
    import hashlib

    from dtrain.backend import weights_digest

    flat = np.linspace(-1, 1, 1001, dtype=np.float32)
    assert weights_digest(flat) == hashlib.sha256(flat.tobytes()).hexdigest()
    flipped = flat.copy()
    flipped[-1] = np.nextafter(flipped[-1], np.float32(2))  # one ulp in the last parameter
    assert weights_digest(flipped) != weights_digest(flat)
    assert weights_digest(flat[::2]) == hashlib.sha256(flat[::2].copy().tobytes()).hexdigest()


def test_default_digits_run_reaches_96_percent(tmp_path):
    m, result = trained(tmp_path)
    assert len(m["epochs"]) == 20 and m["config"]["hidden"] == [128, 128]
    assert m["final"]["test_accuracy"] >= 0.96, m["final"]
    assert "metrics written to" in result.stdout
    assert "epoch  20/20" in result.stdout


def test_synthetic_dataset(tmp_path):
    synthetic = ["--dataset", "synthetic", "--features", 20, "--classes", 3, "--samples", 300]
    m, _ = trained(tmp_path, *synthetic, *TRAIN_FAST, "--batch-size", 32, "--quiet")
    assert m["dataset"] == {"name": "synthetic", "train_samples": 240, "test_samples": 60, "features": 20, "classes": 3}
    assert m["model"]["sizes"] == [20, 32, 3]
    assert len(m["epochs"]) == 3


def test_mnist_from_a_data_dir(tmp_path, fake_mnist_dir):
    mnist = ["--dataset", "mnist", "--data-dir", fake_mnist_dir]
    m, _ = trained(tmp_path, *mnist, "--batch-size", 10, *TRAIN_FAST, "--quiet")
    assert m["dataset"] == {"name": "mnist", "train_samples": 20, "test_samples": 10, "features": 784, "classes": 10}
    assert m["model"]["sizes"] == [784, 32, 10]


# --------------------------------------------------------------------------------------------------- errors
def _remove_a_file(folder):
    (folder / "t10k-images-idx3-ubyte").unlink()


def _garbage_gz(folder):
    (folder / "train-images-idx3-ubyte.gz").write_bytes(b"\x00garbage bytes, not gzip\xff" * 10)


def _garbage_raw(folder):
    (folder / "t10k-labels-idx1-ubyte").write_bytes(b"GARBAGE!" * 3)


def _label_mismatch(folder):
    write_idx(folder / "t10k-labels-idx1-ubyte", np.zeros(9, dtype=np.uint8))


BAD_INPUTS = {
    "unknown optimizer": (["--optimizer", "foo"], None, "invalid choice: 'foo'"),
    "batch size 0": (["--batch-size", "0"], None, "--batch-size must be >= 1"),
    "hidden not integers": (["--hidden", "5,x"], None, "comma-separated integers"),
    "hidden 0": (["--hidden", "16,0"], None, "hidden sizes must be >= 1"),
    "epochs 0": (["--epochs", "0"], None, "--epochs must be >= 1"),
    "negative lr": (["--lr", "-1"], None, "--lr must be a positive number"),
    "momentum 1": (["--momentum", "1"], None, "--momentum must be in [0, 1)"),
    "weight decay nan": (["--weight-decay", "nan"], None, "--weight-decay must be a finite number"),
    "negative seed": (["--seed", "-1"], None, "--seed must be >= 0"),
    "negative timeout": (["--timeout", "-1"], None, "expected seconds >= 0"),
    "timeout not a number": (["--timeout", "soon"], None, "expected a number of seconds"),
    "lr not a number": (["--lr", "fast"], None, "invalid float value: 'fast'"),
    "mnist without data dir": (["--dataset", "mnist"], None, "pass --data-dir DIR"),
    "missing IDX file": (["--dataset", "mnist"], _remove_a_file, "missing t10k-images-idx3-ubyte"),
    "corrupt gz IDX file": (["--dataset", "mnist"], _garbage_gz, "cannot read it"),
    "corrupt raw IDX file": (["--dataset", "mnist"], _garbage_raw, "not an IDX file"),
    "label count mismatch": (["--dataset", "mnist"], _label_mismatch, "10 test images but 9 labels"),
    "spirals of one sample": (["--dataset", "spirals", "--samples", "1"], None, "spirals needs samples >= 2"),
    "batch larger than the data": (["--batch-size", "5000"], None, "larger than the training set (1438 samples)"),
    "diverging loss": (["--lr", "1e6"], None, "lower the learning rate"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_on_stderr(case, tmp_path, fake_mnist_dir):
    args, damage, phrase = BAD_INPUTS[case]
    if damage is not None:
        damage(fake_mnist_dir)
        args = [*args, "--data-dir", fake_mnist_dir, "--batch-size", "10"]
    result = dtrain("train", *args, "--out", tmp_path / "run", cwd=tmp_path)  # progress bar on: stderr is no tty
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert lines[0].startswith("dtrain"), lines[0]
    assert phrase in lines[0], lines[0]
    assert "\r" not in result.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()


ENVIRONMENT_MISTAKES = {
    "unknown kernel backend": ({"DTRAIN_KERNELS": "fortran"}, False, "unknown kernel backend 'fortran'"),
    "numba asked for, not installed": ({"DTRAIN_KERNELS": "numba"}, True, "install the numba extra"),
}


@pytest.mark.parametrize("case", list(ENVIRONMENT_MISTAKES))
def test_an_environment_that_cannot_be_honoured_is_one_line_before_training(case, tmp_path):
    env, hide_numba, phrase = ENVIRONMENT_MISTAKES[case]
    if hide_numba:  # python -m puts the working folder first: this numba.py is found before the real one
        (tmp_path / "numba.py").write_text("raise ImportError('No module named numba')\n")
    result = subprocess.run([sys.executable, "-m", "dtrain", "train", "--epochs", "1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **env})  # fmt: skip
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("dtrain: error: "), result.stderr
    assert phrase in result.stderr


# Under mpiexec every rank finds the same mistake: one line (rank 0's), exit 2 on every rank, nothing aborted. The
# data-file cases need a batch that 4 ranks split and the 20 fake training images hold.
UNDER_MPIEXEC = {**BAD_INPUTS, **{f"env: {name}": ([], None, case[2]) for name, case in ENVIRONMENT_MISTAKES.items()}}


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(UNDER_MPIEXEC))
def test_bad_input_under_mpiexec_is_one_line_exit_2_and_no_abort(case, tmp_path, fake_mnist_dir):
    args, damage, phrase = UNDER_MPIEXEC[case]
    env = dict(os.environ)
    if case.startswith("env: "):
        mistake, hide_numba, _ = ENVIRONMENT_MISTAKES[case[5:]]
        env.update(mistake)
        if hide_numba:
            (tmp_path / "numba.py").write_text("raise ImportError('No module named numba')\n")
    if damage is not None:
        damage(fake_mnist_dir)
        args = [*args, "--data-dir", fake_mnist_dir, "--batch-size", "8"]
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "4", "-m", "dtrain", "train", "--paradigm", "ddp",
               *map(str, args), "--out", str(tmp_path / "run")]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    mine = [line for line in result.stderr.splitlines() if line.startswith("dtrain")]
    assert len(mine) == 1 and phrase in mine[0], result.stderr
    assert "(rank" not in mine[0]  # every rank found it: nobody is singled out
    assert result.stderr.strip() == mine[0], result.stderr  # nothing else on stderr: no traceback, no abort banner
    assert "Abort" not in result.stdout and "BAD TERMINATION" not in result.stdout, result.stdout
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_out_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("")
    result = dtrain("train", "--epochs", 1, "--hidden", 8, "--quiet", "--out", tmp_path / "taken", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("dtrain"), result.stderr
    assert "is a file" in result.stderr and "taken" in result.stderr
    assert "epoch" not in result.stdout  # refused before training, not after


def test_gpu_without_cupy_is_one_line(tmp_path):
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here")
    result = dtrain("train", "--device", "gpu", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "--device gpu needs CuPy" in result.stderr, result.stderr


def test_diverging_loss_really_diverges(tmp_path):
    result = dtrain("train", "--lr", "1e6", "--quiet", cwd=tmp_path)
    assert result.returncode == 2
    assert re.fullmatch(
        r"dtrain: error: the loss became (nan|inf|-inf) at epoch 1, step \d+: training diverged; "
        r"lower the learning rate \(--lr 1e\+06 → try 100000\)",
        result.stderr.strip(),
    ), result.stderr


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        ([], "the following arguments are required"),
        (["fly"], "invalid choice: 'fly'"),
        (["plot"], "the following arguments are required: metrics"),
        (["launch", "-n", "0", "x.py"], "-n must be >= 1"),
        (["launch", "-n", "2"], "nothing to launch"),
    ],
)
def test_other_usage_errors_are_one_line(tmp_path, args, phrase):
    result = dtrain(*args, cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("dtrain"), result.stderr
    assert phrase in result.stderr


# ----------------------------------------------------------------------------------------------------- plot
def test_plot_writes_a_png(runs, tmp_path):
    out = tmp_path / "figs" / "curves.png"
    result = ok(dtrain("plot", runs / "a" / "metrics.json", runs / "c", "-o", out, cwd=tmp_path))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # a real figure, not an empty canvas
    assert str(out) in result.stdout


def test_plot_output_names(runs, tmp_path):
    bare = ok(dtrain("plot", runs / "a", "-o", tmp_path / "curves", cwd=tmp_path))
    assert bare.stdout.strip() == str(tmp_path / "curves.png") and (tmp_path / "curves.png").exists()
    wrong = dtrain("plot", runs / "a", "-o", tmp_path / "curves.txt", cwd=tmp_path)
    assert wrong.returncode != 0 and "Traceback" not in wrong.stderr
    assert len(wrong.stderr.splitlines()) == 1 and "'txt' is not supported" in wrong.stderr, wrong.stderr


def test_plot_labels_name_the_run_folder(runs):
    from dtrain.report import _label, load_metrics

    m = load_metrics(runs / "a")
    assert _label(m, runs / "a") == _label(m, runs / "a" / "metrics.json") == "single x1 (a)"


def test_plot_without_matplotlib_is_one_line(runs, tmp_path):
    """matplotlib is not a core dependency (`pip install -e .` leaves it out): say so, not a traceback."""
    (tmp_path / "matplotlib.py").write_text("raise ImportError('No module named matplotlib')\n")
    result = dtrain("plot", runs / "a", "-o", tmp_path / "x.png", cwd=tmp_path)  # python -m: cwd comes first
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "pip install matplotlib" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("content", "phrase"),
    [(None, "No such file"), ('{"epochs": []}', "not a dtrain metrics file"), ("{oops", "not a dtrain metrics file")],
)
def test_plot_of_a_bad_file_is_one_line(tmp_path, content, phrase):
    path = tmp_path / "m.json"
    if content is not None:
        path.write_text(content)
    result = dtrain("plot", path, "-o", tmp_path / "x.png", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("dtrain"), result.stderr
    assert phrase in result.stderr


# --------------------------------------------------------------------------------------------------- launch
@pytest.mark.mpi
def test_launch_runs_a_script_on_two_ranks(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(  # each rank writes its own file: ranks' stdout lines may interleave through mpiexec
        "import pathlib, sys\n"
        "from mpi4py import MPI\n"
        "comm = MPI.COMM_WORLD\n"
        "total = comm.allreduce(comm.Get_rank() + 1)\n"
        "text = f'rank {comm.Get_rank()} of {comm.Get_size()} total {total} arg {sys.argv[1]}'\n"
        "pathlib.Path(sys.argv[2], f'rank{comm.Get_rank()}.txt').write_text(text)\n"
    )
    ok(dtrain("launch", "-n", 2, script, "--flag", tmp_path, cwd=tmp_path))
    written = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert written == ["rank 0 of 2 total 3 arg --flag", "rank 1 of 2 total 3 arg --flag"]


@pytest.mark.mpi
def test_launch_code_after_a_double_dash(tmp_path):
    code = (
        "import pathlib; from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "pathlib.Path(f'r{c.Get_rank()}').write_text(str(c.Get_size()))"
    )
    ok(dtrain("launch", "-n", 2, "--", "-c", code, cwd=tmp_path))
    assert (tmp_path / "r0").read_text() == (tmp_path / "r1").read_text() == "2"


@pytest.mark.mpi
def test_paradigm_single_on_two_ranks_is_one_line_and_exit_2(tmp_path):
    """Every rank finds the mistake, so rank 0 alone says it and every rank exits 2: nothing is aborted."""
    result = dtrain("launch", "-n", 2, "-m", "dtrain", "train", "--epochs", 1, cwd=tmp_path, timeout=TIMEOUT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "dtrain: error: --paradigm single trains on one rank, but 2 were launched; run without mpiexec or choose a "
        "distributed paradigm (ddp)"
    ], result.stderr
    assert "Abort" not in result.stdout + result.stderr and "BAD TERMINATION" not in result.stdout


def test_trace_and_communication_summary(tmp_path):
    result = dtrain("train", "--epochs", 1, "--hidden", 8, "--quiet", "--out", tmp_path / "run",
                    "--trace", tmp_path / "trace.json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    per_rank = metrics["communication"]["per_rank"]
    assert len(per_rank) == metrics["world_size"] == 1
    assert per_rank[0]["totals"]["bytes_sent"] == 0  # one rank sends nothing
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert "traceEvents" in trace


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("flag", "environment", "expected"),
    [([], None, "300"), (["--timeout", "7"], "5", "7"), ([], "5", "5"), (["--timeout", "0"], None, "0")],
)
def test_launch_hands_the_watchdog_timeout_to_the_ranks(tmp_path, monkeypatch, flag, environment, expected):
    if environment is None:
        monkeypatch.delenv("DTRAIN_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("DTRAIN_TIMEOUT", environment)
    code = "import os, pathlib; pathlib.Path('seen').write_text(os.environ['DTRAIN_TIMEOUT'])"
    ok(dtrain("launch", "-n", 1, *flag, "--", "-c", code, cwd=tmp_path))
    assert (tmp_path / "seen").read_text() == expected


def test_training_is_watched_by_default_and_the_flag_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.delenv("DTRAIN_TIMEOUT", raising=False)
    for name, flag in (("watched", []), ("unwatched", ["--timeout", "0"])):
        ok(dtrain("train", "--epochs", 1, "--hidden", 8, "--quiet", *flag, "--out", tmp_path / name, cwd=tmp_path))
    watched, unwatched = metrics_of(tmp_path / "watched"), metrics_of(tmp_path / "unwatched")
    assert watched["config"]["timeout"] == 300 and unwatched["config"]["timeout"] == 0
    assert watched["communication"]["layers"] == ["WatchedComm", "TracedComm", "Intracomm"]
    assert unwatched["communication"]["layers"] == ["TracedComm", "Intracomm"]


def test_trace_that_is_a_folder_is_one_line(tmp_path):
    result = dtrain("train", "--epochs", 1, "--quiet", "--trace", tmp_path, cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "--trace" in result.stderr, result.stderr


@pytest.mark.mpi
def test_dash_is_standard_output_for_every_output_file_and_the_words_for_people_go_to_stderr(runs, tmp_path):
    """As in every Unix tool: ``--trace -`` (2 ranks under dtrain launch), ``plot -o -``, ``where --json -`` (and
    ``plan --json/--png -``, tests/test_plan.py) write their data alone on stdout; no file named "-" appears."""
    traced = ok(dtrain("launch", "-n", 2, "-m", "dtrain", "train", "--paradigm", "ddp", "--epochs", 1, "--hidden", 8,
                       "--no-progress", "--trace", "-", cwd=tmp_path))  # fmt: skip
    assert {e["pid"] for e in json.loads(traced.stdout)["traceEvents"]} == {0, 1}
    assert "epoch   1/1" in traced.stderr
    plotted = subprocess.run([sys.executable, "-m", "dtrain", "plot", str(runs / "a"), "-o", "-"], cwd=tmp_path,
                             capture_output=True, timeout=TIMEOUT)  # fmt: skip
    assert plotted.returncode == 0 and plotted.stdout.startswith(b"\x89PNG\r\n\x1a\n"), plotted.stderr
    where = ok(dtrain("launch", "-n", 2, "-m", "dtrain.launch.where", "--json", "-", cwd=tmp_path))
    assert len(json.loads(where.stdout)["ranks"]) == 2 and "ranks 0-1" in where.stderr
    assert not (tmp_path / "-").exists()

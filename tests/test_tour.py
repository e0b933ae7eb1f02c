"""``dtrain tour``: a short tour under mpiexec measures what the paradigms' costs predict, bad input is one line
before anything is launched, and a paradigm that fails is shown in its row while the tour goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dtrain import backend
from dtrain.course import tour

BOOM = textwrap.dedent('''
    """A learner's paradigm whose rank 1 fails at its first step."""

    from dtrain.parallel import Paradigm, register


    @register
    class Boom(Paradigm):
        name = "boom"
        summary = "rank 1 fails at its first step"

        def step(self, x, y):
            if self.rank == 1:
                raise RuntimeError("boom on rank 1")
            return super().step(x, y)
''')


def dtrain_tour(tmp_path, *args, env=None):
    """``dtrain tour ARGS --out tmp_path/tour``: the finished process and the rows of its tour.json (if written)."""
    out = tmp_path / "tour"
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "COLUMNS"}  # (a pipe: full width)
    result = subprocess.run([sys.executable, "-m", "dtrain", "tour", *map(str, args), "--out", str(out)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    written = out / "tour.json"
    rows = {r["name"]: r for r in json.loads(written.read_text())["runs"]} if written.exists() else None
    return result, rows


@pytest.mark.mpi
def test_a_short_tour_measures_what_the_costs_predict(tmp_path):
    result, rows = dtrain_tour(tmp_path, "--ranks", 2, "--paradigms", "single,ddp-ring,ps-sync", "--epochs", 1)
    assert result.returncode == 0, result.stderr
    assert list(rows) == ["single", "ddp-ring", "ps-sync"]
    for name, row in rows.items():
        assert row["status"] == "ok" and row["test_accuracy"] > 0.5, row  # chance: 0.1
        assert row["state_bytes"] == row["predicted_state_bytes"], name  # read off the arrays = costs(), every rank
        assert (tmp_path / "tour" / name / "metrics.json").is_file()
    ddp, ps = rows["ddp-ring"], rows["ps-sync"]
    assert ddp["sent_per_step"] == ddp["predicted_sent_per_step"]  # exact: the tracer and the cost model agree
    assert rows["single"]["sent_per_step"] == [0]
    # ps-sync's server sends what costs() says each step, and the weights once more to its worker (its first pull)
    n = ps["predicted_state_bytes"][0] // 2  # the worker's parameters and gradients
    assert round(ps["sent_per_step"][1] * ps["steps"]) == ps["predicted_sent_per_step"][1] * ps["steps"] + n
    table = (tmp_path / "tour" / "tour.txt").read_text()
    assert table in result.stdout + "\n" and "each worker pulls the weights once" in " ".join(table.split())
    summary = json.loads((tmp_path / "tour" / "tour.json").read_text())["runs"]
    for columns in (80, 120):  # a terminal's table fits it, and says the same
        fitted = tour.table(summary, [], width=columns)
        assert max(map(len, fitted.splitlines())) <= columns
        assert all(row["label"] in fitted and f"{max(row['sent_per_step']):,.0f}" in fitted for row in summary)
    assert (tmp_path / "tour" / "tour.png").is_file()
    # beside each measured step, the planner's; the closing line names its first choice and says how it measured
    assert all(row["step_s"] > 0 and row["predicted_step_s"] > 0 for row in rows.values())
    chosen = min(rows.values(), key=lambda r: r["predicted_step_s"])  # (all three make single's updates)
    fastest = min(rows.values(), key=lambda r: r["step_s"])
    said = "was the measured fastest" if chosen is fastest else f"slower than the fastest, {fastest['label']}"
    prose = " ".join(table.split())  # (its paragraphs are wrapped)
    assert f"The planner's first choice among the runs that make single's updates, {chosen['label']}" in prose
    assert said in prose


@pytest.mark.mpi
def test_a_failing_paradigm_is_shown_in_its_row_and_the_tour_goes_on(tmp_path):
    (tmp_path / "boom_paradigm.py").write_text(BOOM)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "DTRAIN_PARADIGMS": "boom_paradigm"}
    result, rows = dtrain_tour(tmp_path, "--ranks", 2, "--paradigms", "boom,single", "--epochs", 1, env=env)
    assert result.returncode == 1
    assert rows["boom"]["status"] == "FAILED" and rows["boom"]["error"] == "RuntimeError: boom on rank 1"
    assert rows["single"]["status"] == "ok"  # the tour went on
    assert "FAILED: RuntimeError: boom on rank 1" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "dtrain tour: 1 run(s) failed: boom"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--paradigms", "single,nope"], "--paradigms: 'nope' is neither one of the tour's (single, ddp-ring,"),
        (["--ranks", "1", "--paradigms", "ps-sync"], "--paradigms ps-sync cannot run on --ranks 1: --paradigm "
         "ps-sync needs at least 2 ranks"),
        (["--ranks", "2", "--paradigms", "grid"], "--paradigms grid cannot run on --ranks 2: a grid of tp 2 x pp 2 "
         "needs a multiple of 4 ranks"),
        (["--ranks", "0"], "--ranks and --epochs must be >= 1"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_nothing_is_launched(tmp_path, args, message):
    result, _ = dtrain_tour(tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"dtrain: error: {message}") and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == "" and not (tmp_path / "tour").exists()


@pytest.mark.skipif(backend.gpu_missing() is None, reason="a GPU is here: the tour would run")
def test_the_gpu_without_one_is_one_line_and_nothing_is_launched(tmp_path):
    result, _ = dtrain_tour(tmp_path, "--device", "gpu", "--paradigms", "single")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("dtrain: error: --device gpu needs CuPy")
    assert not (tmp_path / "tour").exists()


def test_every_entry_fits_4_ranks_and_those_that_cannot_fit_2_are_skipped():
    batch = tour.global_batch(4)
    assert batch == 96
    assert [e.name for e in tour.choose(None, 4, batch, 20) if e.skip] == []
    skipped = {e.name: e.skip for e in tour.choose(None, 2, tour.global_batch(2), 20) if e.skip}
    assert list(skipped) == ["grid"]
    pp = tour.entries(2)["pp"]
    assert pp.options["pp"] == 2 and pp.label == "pp 1f1b, 2 stages"  # adapted to the ranks


@pytest.mark.parametrize(
    ("stderr", "line"),
    [
        ("Traceback (most recent call last):\n  ...\nValueError: bad\nAbort(1) on node 1: application called "
         "MPI_Abort(MPI_COMM_WORLD, 1) - process 1\n", "ValueError: bad"),
        ("dtrain watchdog: rank 1 of 2 has waited 4.0 s in allreduce/ring\ndtrain watchdog: rank 1 is at x.py:3\n",
         "dtrain watchdog: rank 1 of 2 has waited 4.0 s in allreduce/ring"),
        ("noise\ndtrain: error: --lr must be a positive number, got -1\n",
         "dtrain: error: --lr must be a positive number, got -1"),
        ("", "exited with status 3"),
    ],
)  # fmt: skip
def test_a_failed_job_is_said_in_one_line(stderr, line):
    assert tour.one_line_error(stderr, 3) == line

"""Lesson 10 (debugging) tells the learner which message to look for in each failure: here each one really appears.

The lesson runs its broken programs as jobs of their own and checks the messages itself; the test runs it once and
reads what each job printed (its --json keeps every job's exit status and output), so a change in a report's wording
breaks this test and not only the lesson's prose. The simulator's messages, which the notebook quotes, are checked
here directly, in a few milliseconds each. Every job has a time limit: nothing here can hang.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import COLUMNS, LESSONS, assert_fits

from dtrain import collectives
from dtrain.comm import sim, watchdog
from dtrain.launch import launcher

LESSON = LESSONS / "10_debugging.py"


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    """One run of the whole lesson (jobs of 4 ranks), for a terminal of COLUMNS columns: its output, and what it
    measured and found (--json)."""
    folder = tmp_path_factory.mktemp("lesson10")
    done = subprocess.run([sys.executable, str(LESSON), "--out", str(folder), "--json", str(folder / "l.json")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": str(COLUMNS)})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads((folder / "l.json").read_text())


@pytest.mark.mpi
def test_every_claim_of_the_lesson_holds(lesson):
    out, found = lesson
    assert "all checks passed: yes" in out, out
    failed = [claim for claim, passed in found["checks"].items() if not passed]
    assert not failed and len(found["checks"]) >= 16, (failed, out)
    assert "dtrain exercises check 10.1 --path ex" in out and "dtrain exercises check 10.2 --path ex" in out


@pytest.mark.mpi
def test_what_it_prints_fits_the_terminal(lesson):
    assert_fits(lesson[0], COLUMNS)


@pytest.mark.mpi
def test_a_mismatched_collective_without_and_with_debug_mode(lesson):
    parts = lesson[1]["parts"]
    size = parts["mismatch-size"]  # an error, on the rank that noticed
    assert size["status"] == 1 and "uncaught exception (rank 2), ending the job:" in size["stderr"]
    assert "message truncated" in size["stderr"].lower()
    other = parts["mismatch-collective"]  # a hang, ended by the watchdog
    assert other["status"] == watchdog.EXIT_CODE and re.search(r"waits for rank \d", other["stderr"])
    assert re.search(r"rank 1: done, grads\[0\] = 1 \(expected 4\)", other["stdout"])
    dtype = parts["mismatch-dtype"]  # nothing fails: a wrong answer
    assert dtype["status"] == 0 and dtype["stderr"].strip() == ""
    assert "rank 0: done, grads[0] = 3.00781 (expected 4)" in dtype["stdout"]
    for part, differing in (("mismatch-size", "count"), ("mismatch-collective", "collective, algorithm, op, root"),
                            ("mismatch-dtype", "count, dtype")):  # fmt: skip
        said = parts[f"{part} DTRAIN_DEBUG=1"]
        assert said["status"] == 1 and said["stderr"].startswith("uncaught exception on every rank, ending the job:")
        assert "CollectiveMismatchError: the ranks are not making the same collective call" in said["stderr"]
        assert f"  differing: {differing}\n" in said["stderr"] and said["stderr"].count("Traceback") == 1
        assert re.search(r"rank 1: collective=.*  at 10_debugging\.py:\d+ in mismatch_", said["stderr"])


@pytest.mark.mpi
def test_a_stalled_rank_is_reported_by_the_watchdog(lesson):
    stall = lesson[1]["parts"]["stall"]
    assert stall["status"] == watchdog.EXIT_CODE
    reports = re.findall(r"dtrain watchdog: rank (\d+) of 4 .* has waited ([\d.]+) s in allreduce/ring \(call #3\)",
                         stall["stderr"])  # fmt: skip
    assert reports and all(rank != "2" and float(waited) >= 2.0 for rank, waited in reports), stall["stderr"]
    for rank, peer in re.findall(r"dtrain watchdog: rank (\d+) waits for rank (\d+): look at what", stall["stderr"]):
        assert int(peer) == (int(rank) - 1) % 4  # its left neighbour in the ring
    assert "is at dtrain/collectives/ring.py:" in stall["stderr"]
    assert "rank 2: step 3: reading the next batch" in stall["stdout"]
    said = " ".join(lesson[0].split())  # (its paragraphs, however wrapped)
    assert "the chain: " in said and "waits for rank 2, whose last line says" in said


@pytest.mark.mpi
def test_an_exception_on_one_rank_ends_the_job_once(lesson):
    parts = lesson[1]["parts"]
    one = parts["raise-one"]
    assert one["status"] == 1 and one["stderr"].startswith("uncaught exception (rank 1), ending the job:\nTraceback")
    assert one["stderr"].count("Traceback") == 1 and "ValueError: rank 1's slice of the batch is empty" in one["stderr"]
    bare = parts["raise-one-bare"]  # Python's own handler: a traceback, then the others wait until the watchdog
    assert bare["status"] == watchdog.EXIT_CODE and "ValueError: rank 1's slice" in bare["stderr"]
    assert "uncaught exception" not in bare["stderr"] and "dtrain watchdog: rank" in bare["stderr"]
    everywhere = parts["raise-everywhere"]
    assert everywhere["status"] == 1 and everywhere["stderr"].count("Traceback") == 1
    assert everywhere["stderr"].startswith("uncaught exception on every rank, ending the job:")


@pytest.mark.mpi
def test_the_trace_names_the_slow_rank(lesson):
    out, found = lesson
    straggler = {int(rank): row for rank, row in found["straggler"].items()}
    assert sorted(straggler) == [0, 1, 2, 3] and all(row["allreduces"] > 0 for row in straggler.values())
    assert max(straggler, key=lambda r: straggler[r]["outside_s"]) == 2
    assert min(straggler, key=lambda r: straggler[r]["inside_s"]) == 2
    said = " ".join(out.split())  # (its paragraphs, however wrapped)
    assert "the slow rank: rank 2" in said and "https://ui.perfetto.dev" in said


@pytest.mark.mpi
def test_one_broken_program_by_hand_as_the_docstring_says():
    """`dtrain launch -n 4 --timeout 5 lessons/10_debugging.py --part stall`, here on 3 ranks with 2 s."""
    done = subprocess.run([sys.executable, "-m", "dtrain", "launch", "-n", "3", "--timeout", "2", str(LESSON),
                           "--part", "stall"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == watchdog.EXIT_CODE, done.stdout + done.stderr
    assert "has waited" in done.stderr and "in allreduce/ring (call #3)" in done.stderr


@pytest.mark.mpi
def test_the_lesson_under_dtrain_launch_says_how_to_run_it():
    done = launcher.launch(2, [str(LESSON)], timeout=60, capture=True)
    assert done.returncode == 2 and "run it with `python lessons/10_debugging.py`" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_bad_arguments_are_one_line():
    done = subprocess.run([sys.executable, str(LESSON), "--ranks", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().startswith("bad arguments: --ranks must be >= 3"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == "", done.stderr


# --- the simulator's messages, as the notebook shows them -------------------------------------------------------
def mismatched(comm):
    grads = np.ones(1000)
    if comm.Get_rank() == 1:
        collectives.broadcast(comm, grads, root=0)
    else:
        collectives.allreduce(comm, grads, algorithm="ring")


def test_on_the_simulator_a_mismatch_deadlocks_and_debug_mode_reports_it():
    with pytest.raises(sim.SimDeadlock, match=r"rank 1: finished"):
        sim.run(4, mismatched)
    collectives.set_debug(True)
    try:
        with pytest.raises(sim.SimRankError) as raised:
            sim.run(4, mismatched)
    finally:
        collectives.set_debug(None)
    said = str(raised.value.exception)
    assert isinstance(raised.value.exception, collectives.CollectiveMismatchError)
    assert said.endswith("differing: collective, algorithm, op, root") and "in mismatched" in said


def test_on_the_simulator_a_deadlock_is_reported_exactly():
    def both_send_first(comm, n):
        other = 1 - comm.Get_rank()
        comm.Send(np.ones(n), dest=other)
        comm.Recv(np.empty(n), source=other)

    sim.run(2, both_send_first, 100)  # small: eager, no deadlock
    with pytest.raises(sim.SimDeadlock) as raised:
        sim.run(2, both_send_first, 100_000)
    said = str(raised.value)
    assert said.startswith("deadlock: every unfinished rank is blocked")
    assert "rank 0: Send(dest=1, tag=0, 800000 bytes, rendezvous: waiting for a matching receive)" in said


def test_on_the_simulator_the_watchdog_names_whom_a_rank_waits_for():
    import time

    def stalled(comm):
        if comm.Get_rank() == 2:
            time.sleep(3)
        collectives.allreduce(comm, np.ones(10), algorithm="ring")

    watchdog.configure(0.5)
    report = io.StringIO()
    try:
        with contextlib.redirect_stderr(report), pytest.raises(sim.SimAbort):
            sim.run(4, stalled)
    finally:
        watchdog.configure(None)
    (reporter, waits_for), = re.findall(r"rank (\d+) waits for rank (\d+)", report.getvalue())  # fmt: skip
    assert reporter != "2" and int(waits_for) == (int(reporter) - 1) % 4, report.getvalue()
    assert re.search(r"has waited [\d.]+ s in allreduce/ring \(call #1\)", report.getvalue())


@pytest.mark.mpi
def test_part_6_a_killed_rank_restarted_ends_with_the_uninterrupted_weights(lesson):
    restart = lesson[1]["restart"]
    assert restart["sha_equal"] and restart["restarts"]["count"] == 1 and restart["restarts"]["steps_lost"] == 3
    first = restart["restarts"]["attempts"][0]
    assert (first["rank"], first["signal"], first["reached_step"]) == (1, "SIGKILL", 23)
    assert restart["checkpoint_s"] > 0 and restart["young_s"] == pytest.approx(
        (2 * restart["checkpoint_s"] * 3600) ** 0.5
    )
    assert 0.5 < restart["best_s"] / restart["young_s"] < 2  # the simulated best: near Young's, never far


@pytest.mark.mpi
def test_part_7_a_whole_node_killed_and_the_job_goes_on_with_the_other_node(lesson):
    """As root (a cluster of network namespaces): node 2 killed whole, then cut off; else skipped, saying why."""
    from dtrain.launch import cluster

    machine = lesson[1]["machine"]
    if (why := cluster.missing("part 7 (a cluster of network namespaces)")) is not None:
        assert machine == {"skipped": why}
        return
    for how, node_said in (("killed", "mpiexec lost node lesson10-n2"), ("cut", "node lesson10-n2's ranks 2, 3")):
        run = machine[how]
        first = run["metrics"]["restarts"]["attempts"][0]
        assert run["status"] == 0 and run["metrics"]["world_size"] == 2 and run["left"] == [], run["stderr"]
        assert (first["ranks"], first["node"]) == (4, "lesson10-n2") and node_said in first["ended"]
        assert run["noticed_s"] >= 0
    assert machine["cut"]["noticed_s"] >= 3  # the watchdog's 3 s: nobody told mpiexec
    assert "[mpiexec@" not in lesson[0]


@pytest.mark.mpi
def test_part_8_a_server_killed_in_ps_async_resumes_a_snapshot_and_applies_every_push_once(lesson):
    server = lesson[1]["server"]
    pushes, restarts = server["pushes"], server["restarts"]
    first = restarts["attempts"][0]
    assert restarts["count"] == 1 and (first["rank"], first["signal"]) == (3, "SIGKILL")  # the server of 4 ranks
    assert pushes["exactly_once"] and all(row == pushes["sent"] for row in pushes["applied"])
    # 2 epochs of W x 29 pushes (and up to W - 1 more an epoch): the pushes redone after the kill are not counted twice
    assert first["resumed_from_step"] is None and 2 * 3 * 29 <= sum(pushes["sent"]) <= 2 * (3 * 29 + 2)

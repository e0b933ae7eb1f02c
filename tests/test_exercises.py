"""The exercises' checker, both ways: dtrain's reference implementations pass every exercise through the learner's
own command, the untouched stubs fail every one, each planted bug (tests/exercise_bugs/) fails with a message that
points at its mistake, and another correct way (tests/exercise_alternatives/) passes. Also: ``init`` never
overwrites, and every kind of bad input is one clear message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import assert_fits

from dtrain.course import exercises
from dtrain.course.exercises import checker

BUGS = Path(__file__).resolve().parent / "exercise_bugs"
ALL = exercises.catalogue()


def flat(text: str) -> str:
    """``text`` with its lines joined and its runs of spaces made one: the checker wraps what it prints to the
    terminal's width, so a message is looked for in this."""
    return " ".join(text.split())


def dtrain_command(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True, timeout=timeout)


def reference_folder(folder: Path) -> Path:
    """A learner's folder whose every file hands over dtrain's own reference for each of its exercises."""
    folder.mkdir(exist_ok=True)
    lines = {}
    for e in ALL:
        module, _, name = e.reference.partition(":")
        lines.setdefault(e.file, []).append(f"from {module} import {name} as {e.function}  # noqa: F401")
    for file, imports in lines.items():
        (folder / file).write_text("\n".join(imports) + "\n")
    return folder


def planted_bugs() -> list:
    """(bug file, exercise id, learner's file name, expected text) from each bug file's docstring."""
    found = []
    for path in sorted(BUGS.glob("*.py")):
        fields = dict(line.split(": ", 1) for line in path.read_text().split('"""')[1].splitlines() if ": " in line)
        found.append(pytest.param(path, fields["exercise"], fields["file"], fields["expect"], id=path.stem))
    return found


def test_catalogue_is_complete_and_consistent():
    ids = [e.id for e in ALL]
    assert len(ids) == len(set(ids))
    for e in ALL:
        stub = checker.STUBS / e.file
        assert stub.is_file(), f"exercise {e.id}: no stub {stub}"
        assert f'raise NotImplementedError("exercise {e.id}: ' in stub.read_text(), f"exercise {e.id}: stub message"
        assert callable(e.load_check()) and callable(e.load_reference())
        assert Path(e.lesson_script).name in {p.name for p in (Path(__file__).parents[1] / "lessons").glob("*.py")}
        if e.mpi_ranks:
            assert any(p & (p - 1) for p in e.mpi_ranks), f"exercise {e.id}: no non-power-of-two rank count"


@pytest.mark.parametrize("exercise", ALL, ids=[e.id for e in ALL])
def test_reference_passes_on_simulated_ranks(exercise, tmp_path, capsys):
    assert checker.check(exercise.id, reference_folder(tmp_path), mpi=False) == 0, capsys.readouterr().out


@pytest.mark.mpi
@pytest.mark.slow
def test_reference_passes_every_exercise_through_the_learners_command(tmp_path):
    done = dtrain_command("exercises", "check", "all", "--path", str(reference_folder(tmp_path / "ref")))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"course progress: {len(ALL)} of {len(ALL)} exercises passing" in done.stdout
    assert "mpiexec -n 3" in done.stdout  # the parts under mpiexec ran


def test_untouched_stubs_fail_every_exercise(tmp_path, capsys):
    checker.init(tmp_path)
    assert checker.check("all", tmp_path, mpi=False) == 1
    out = capsys.readouterr().out
    assert out.count("not started") == len(ALL), out
    assert f"course progress: 0 of {len(ALL)} exercises passing" in out


@pytest.mark.parametrize(("bug", "exercise_id", "file", "expected"), planted_bugs())
def test_planted_bug_fails_with_a_pointed_message(bug, exercise_id, file, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    (tmp_path / file).write_text(bug.read_text())
    assert checker.check(exercise_id, tmp_path, mpi=False) == 1
    out = capsys.readouterr().out
    assert ("FAIL" in out or "DEADLOCK" in out) and flat(expected) in flat(out), out  # (lesson 10's bugs hang)
    assert_fits(out, 80)


def test_every_subject_has_a_planted_bug():
    lessons_with_bugs = {exercises.get(p.values[1]).lesson for p in planted_bugs()}
    assert lessons_with_bugs >= {1, 2, 3, 8, 10, 13, 14}  # grows with the subjects


@pytest.mark.parametrize("exercise_id", ["13.1", "13.2", "14.1", "14.2"])
def test_another_correct_way_passes(exercise_id, tmp_path, capsys):
    """Lessons 13's and 14's checks pass solutions that are not dtrain's (tests/exercise_alternatives/): another
    exchange of the pairs, another orthonormal basis for PowerSGD's P; the matmul rule written in another order with
    lists for tuples, a redistribution by direct exchange with Sendrecv alone."""
    file = exercises.get(exercise_id).file
    (tmp_path / file).write_text((BUGS.parent / "exercise_alternatives" / file).read_text())
    assert checker.check(exercise_id, tmp_path, mpi=False) == 0, capsys.readouterr().out


@pytest.mark.mpi
def test_another_redistribution_passes_under_mpiexec(tmp_path):
    """14.2's direct exchange passes under mpiexec too, where the bytes are counted by the real ranks' tracer."""
    (tmp_path / "spmd.py").write_text((BUGS.parent / "exercise_alternatives" / "spmd.py").read_text())
    found = checker.run_mpi(exercises.get("14.2"), tmp_path / "spmd.py", 3)
    assert found["status"] == "pass", found


def test_the_matmul_exercise_covers_every_pair_and_every_case():
    """14.1 is graded on all 7 x 7 valid layouts of A and B on a mesh x, y, which reach each of the rule's four
    cases, and its reference is dtrain's rule read back: C's layout and the gathers that layouts.matmul implies."""
    from dtrain.course.exercises.checks import spmd
    from dtrain.parallel import layouts
    from dtrain.parallel.layouts import Layout

    assert len(spmd.PAIRS) == 49 and len(set(spmd.PAIRS)) == 49
    seen = {n for a, b in spmd.PAIRS for n in spmd.rule_cases(layouts.matmul(Layout(a), Layout(b))[3])}
    assert seen == {"1", "2", "3", "4"}
    assert spmd.matmul_layouts(("x", "y"), ("y", "x")) == (("x", None), "y", [("all-gather", "B", 1, "x")])
    assert spmd.matmul_layouts((None, "x"), ("y", None)) == (
        (None, None), None, [("all-gather", "A", 1, "x"), ("all-gather", "B", 0, "y")])  # fmt: skip


# --- the checker's words: the case (K of N) and the algorithm's step, a note only when it is the diagnosis ---------
FORGETS_TO_ADD = (
    "rank 0, case 1 of 8 (2 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...): buf after the call "
    "(the sum over all ranks): element 0 is 1.0, expected 102.0 (1 of 1 elements wrong) "
    "ring step 0 of the reduce-scatter: rank 1 received chunk 0 from rank 0, to add into its own (buf[0:1] += the "
    "chunk received); it wrote the chunk over its own values instead of adding it: at ring step 0 of the all-gather "
    "it sent element 0 as 1.0, expected 102.0 = 1.0 received + 101.0 its own"
)
OWN_VALUES = "still holds this rank's own values"


def run_ring(source: str, folder: Path, capsys, monkeypatch) -> str:
    """``source`` as ex/ring.py, checked on simulated ranks at 80 columns: what the checker printed (every line of
    which fits)."""
    monkeypatch.setenv("COLUMNS", "80")
    (folder / "ring.py").write_text(source)
    assert checker.check("2.1", folder, mpi=False) == 1
    out = capsys.readouterr().out
    assert_fits(out, 80)
    return out


def test_a_ring_that_forgets_to_add_names_the_case_and_the_ring_step(tmp_path, capsys, monkeypatch):
    """Issue 41: rank 0's buf (1.0) happens to equal its own value, but the ring wrote into it: no "own values"
    note; the case is the checker's (K of N, what it is), the ring step the algorithm's, and the rank that went
    wrong is named with what it received and what it sent on."""
    out = run_ring((BUGS / "ring_forgets_to_add.py").read_text(), tmp_path, capsys, monkeypatch)
    assert FORGETS_TO_ADD in flat(out), out
    assert OWN_VALUES not in out and "step 1 (" not in out, out


def test_a_ring_that_does_not_add_the_received_chunk_is_told_so(tmp_path, capsys, monkeypatch):
    source = (BUGS / "ring_forgets_to_add.py").read_text()
    source = source.replace("recvbuf=buf[c:d], source=left)  # the bug", "recvbuf=buf[c:d].copy(), source=left)  #", 1)
    out = run_ring(source, tmp_path, capsys, monkeypatch)
    assert (
        "ring step 0 of the reduce-scatter: rank 1 received chunk 0 from rank 0, to add into its own (buf[0:1] += the "
        "chunk received); it did not add the chunk: it passed its own values on: at ring step 0 of the all-gather it "
        "sent element 0 as 101.0, expected 102.0 = 1.0 received + 101.0 its own"
    ) in flat(out), out
    assert OWN_VALUES not in out, out


@pytest.mark.parametrize(
    ("source", "note"),
    [
        (
            "def ring_allreduce(comm, buf):\n    pass\n",
            "buf still holds this rank's own values, on every rank: the function wrote nothing into it; the result "
            "must be written into buf itself, in place (buf[a:b] += ..., comm.Recv(buf[a:b], ...)), not into a new "
            "array",
        ),
        (
            "from dtrain.collectives import ring\n\n\ndef ring_allreduce(comm, buf):\n    out = buf.copy()\n"
            "    ring.allreduce(comm, out)\n    return out\n",
            "buf still holds this rank's own values and the function returned the result as a new array: the caller "
            "sees only buf: write the result into buf itself, in place (buf[a:b] += ..., comm.Recv(buf[a:b], ...))",
        ),
    ],
    ids=["untouched", "returned"],
)
def test_a_ring_that_leaves_buf_untouched_is_told_so(source, note, tmp_path, capsys, monkeypatch):
    out = run_ring(source, tmp_path, capsys, monkeypatch)
    assert (
        "rank 0, case 1 of 8 (2 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...): buf after the "
        "call (the sum over all ranks): element 0 is 1.0, expected 102.0 (1 of 1 elements wrong) " + note
    ) in flat(out), out
    assert "ring step" not in out, out  # (no message of the ring's, no step of it to name)


RING_INTO = """import numpy as np


def ring_allreduce(comm, buf):
    p, r = comm.Get_size(), comm.Get_rank()
    bounds = [(c[0], c[-1] + 1) if len(c) else (0, 0) for c in np.array_split(np.arange(buf.size), p)]
    right, left = (r + 1) % p, (r - 1) % p
    scratch = np.empty(SCRATCH, dtype=buf.dtype)
    for s in range(p - 1):
        a, b = bounds[(r - s) % p]
        c, d = bounds[(r - s - 1) % p]
        comm.Sendrecv(buf[a:b], dest=right, recvbuf=scratch[: d - c], source=left)
        buf[c:d] += scratch[: d - c]
    for s in range(p - 1):
        a, b = bounds[(r - s + 1) % p]
        c, d = bounds[(r - s) % p]
        comm.Sendrecv(buf[a:b], dest=right, recvbuf=GATHERED, source=left)
"""
TOO_SMALL = {  # the receive too small: in the reduce-scatter (a scratch of n // p), in the all-gather (one short)
    "reduce-scatter": RING_INTO.replace("SCRATCH", "buf.size // p").replace("GATHERED", "buf[c:d]"),
    "all-gather": RING_INTO.replace("SCRATCH", "buf.size").replace("GATHERED", "buf[c : d - 1]"),
}


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        (
            "reduce-scatter",
            "rank 1, case 1 of 8 (2 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...); ring step 0 "
            "of the reduce-scatter: raised SimCommError: message truncated (MPI_ERR_TRUNCATE): rank 1 received from "
            "rank 0 (tag 0, world): 1 elements (8 bytes) into a buffer of 0 elements (ring.py line 12, in "
            "ring_allreduce: `comm.Sendrecv(buf[a:b], dest=right, recvbuf=scratch[: d - c], source=left)`) a message "
            "larger than the buffer that receives it: a receive's buffer must hold the whole message",
        ),
        (
            "all-gather",
            "rank 0, case 1 of 8 (2 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...); ring step 0 "
            "of the all-gather: raised SimCommError: message truncated (MPI_ERR_TRUNCATE): rank 0 received from rank "
            "1 (tag 0, world): 1 elements (8 bytes) into a buffer of 0 elements (ring.py line 17, in ring_allreduce: "
            "`comm.Sendrecv(buf[a:b], dest=right, recvbuf=buf[c : d - 1], source=left)`)",
        ),
    ],
)
def test_a_receive_into_a_buffer_too_small_names_rank_case_and_ring_step(phase, expected, tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    out = run_ring(TOO_SMALL[phase], tmp_path, capsys, monkeypatch)
    assert "ERROR on 2 ranks" in out and expected in flat(out), out


def test_a_deadlock_names_the_case_and_every_ranks_ring_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    (tmp_path / "allgather.py").write_text((BUGS / "allgather_sends_before_receiving.py").read_text())
    assert checker.check("10.1", tmp_path, mpi=False) == 1
    out = capsys.readouterr().out
    assert (
        "DEADLOCK on 2 ranks in case 5 of 7 (2 ranks, 40003 float64 elements; rank r's chunk r holds its values, the "
        "rest -1; this rank's chunk: 160,016 bytes); every rank in ring step 0 of the all-gather: deadlock:"
    ) in flat(out), out
    assert_fits(out, 80)


def test_init_never_overwrites(tmp_path, capsys):
    mine = tmp_path / "ring.py"
    mine.write_text("# my work\n")
    checker.init(tmp_path)
    assert mine.read_text() == "# my work\n"
    assert "kept your 1 existing files" in capsys.readouterr().out
    assert all((tmp_path / e.file).is_file() for e in ALL)


def list_rows(folder: Path, capsys) -> dict:
    """``exercises list``'s rows, printed at any width (one line a row), by exercise: the status cell."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("COLUMNS", raising=False)
        checker.show_list(folder)
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("exercise "))
    starts = [lines[header].index(word) for word in ("status", "what")]
    return {line.split()[0]: line[starts[0] : starts[1]].strip() for line in lines[header + 2 :] if line.strip()}


def test_list_shows_each_status(tmp_path, capsys):
    checker.init(tmp_path)
    reference_folder(tmp_path / "ref")
    (tmp_path / "ring.py").write_text((tmp_path / "ref" / "ring.py").read_text())
    checker.check("2.1", tmp_path, mpi=False)
    capsys.readouterr()
    rows = list_rows(tmp_path, capsys)
    assert rows["2.1"] == "passing on simulated ranks" and rows["2.2"] == "not started", rows
    (tmp_path / "ring.py").write_text("def ring_allreduce(comm, buf):\n    pass\n")
    assert list_rows(tmp_path, capsys)["2.1"] == "not checked since it changed"


SCHEDULES = """from dtrain.parallel.schedules import gpipe_order
from dtrain.parallel.schedules import one_f_one_b_order


def one_f_one_b(stages, microbatches):
    return one_f_one_b_order(stages, microbatches)


def gpipe(stages, microbatches):
    return gpipe_order(stages, microbatches)
"""


def test_list_tracks_each_exercise_by_its_own_function(tmp_path, capsys):
    """8.1 and 8.2 share schedules.py: each one's status follows its own function and what it uses (helpers,
    imports), not the file."""
    checker.init(tmp_path)
    schedules = tmp_path / "schedules.py"
    schedules.write_text(SCHEDULES)
    assert checker.check("8.1", tmp_path, mpi=False) == 0
    capsys.readouterr()
    rows = list_rows(tmp_path, capsys)
    assert (rows["8.1"], rows["8.2"]) == ("passing", "not checked yet"), rows  # 8.2 was never checked
    assert checker.check("8.2", tmp_path, mpi=False) == 0
    capsys.readouterr()
    mine = SCHEDULES.replace(
        "return gpipe_order(stages, microbatches)", "return list(gpipe_order(stages, microbatches))"
    )
    schedules.write_text(mine)  # 8.2's function edited
    rows = list_rows(tmp_path, capsys)
    assert (rows["8.1"], rows["8.2"]) == ("passing", "not checked since it changed"), rows
    assert checker.check("8.2", tmp_path, mpi=False) == 0
    capsys.readouterr()
    schedules.write_text(
        "# comments and blank lines do not count\n\n" + mine.replace("    return one_f", "\n    return one_f")
    )
    rows = list_rows(tmp_path, capsys)
    assert (rows["8.1"], rows["8.2"]) == ("passing", "passing"), rows
    schedules.write_text(mine.replace("import one_f_one_b_order", "import gpipe_order as one_f_one_b_order"))
    rows = list_rows(tmp_path, capsys)  # what 8.1 uses (an import) changed: 8.1 did, 8.2 did not
    assert (rows["8.1"], rows["8.2"]) == ("not checked since it changed", "passing"), rows


def test_list_reads_an_older_progress_file(tmp_path, capsys):
    """A progress file an older dtrain wrote (a digest of the whole file per exercise) is read, never a crash: its
    status holds while the file is as it was, and is unknown once it changed; an unreadable one is no progress."""
    checker.init(tmp_path)
    schedules = tmp_path / "schedules.py"
    schedules.write_text(SCHEDULES)
    old = {"8.1": {"status": "passing", "sha256": checker.digest(schedules)}, "8.2": "not a record"}
    (tmp_path / checker.PROGRESS).write_text(json.dumps(old))
    rows = list_rows(tmp_path, capsys)
    assert (rows["8.1"], rows["8.2"]) == ("passing", "not checked yet"), rows
    schedules.write_text(SCHEDULES + "\n# edited\n")
    assert list_rows(tmp_path, capsys)["8.1"] == "not checked since its file changed"
    for broken in ("[1, 2]", "{not json", '{"8.1": {"status": 3}}'):
        (tmp_path / checker.PROGRESS).write_text(broken)
        assert list_rows(tmp_path, capsys)["8.1"] == "not checked yet"


def test_a_folder_made_by_an_older_init_still_works(tmp_path, capsys):
    """Files copied by an earlier ``init`` (the stubs' words were different then): an untouched function is still
    "not started", for ``list`` and for ``check``."""
    checker.init(tmp_path)
    ring = tmp_path / "ring.py"
    ring.write_text(ring.read_text().replace("--path ex", "--path .").replace("ex/ring.py:", "ring.py:"))
    assert list_rows(tmp_path, capsys)["2.1"] == "not started"
    assert checker.check("2.1", tmp_path, mpi=False) == 1
    assert "not started" in capsys.readouterr().out


def test_list_fits_80_columns(tmp_path):
    checker.init(tmp_path)
    (tmp_path / checker.PROGRESS).write_text(json.dumps({"4.2": {"status": "passing", "sha256": "0"}}))
    (tmp_path / "parameter_server.py").write_text("def stale_synchronous_ready(waiting, clock, running, bound):\n"
                                                  "    return []\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "dtrain", "exercises", "list", "--path", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_fits(done.stdout, 80)
    assert "not checked since its file changed" in flat(done.stdout) and "2.1" in done.stdout, done.stdout


def test_the_stubs_and_the_checker_spell_commands_as_the_readme_does():
    """One spelling: ``--path ex`` and ``ex/ring.py:ring_allreduce`` (the README's), never ``--path .``."""
    texts = [path.read_text() for path in sorted(checker.STUBS.glob("*.py"))]
    assert all("--path ex" in text and "--path ." not in text for text in texts)
    assert "--allreduce ex/ring.py:ring_allreduce" in (checker.STUBS / "ring.py").read_text()
    assert not any(re.search(r"--allreduce [a-z_]+\.py:", text) for text in texts)


# --- bad input: one clear message each, never dtrain's traceback, never a hang --------------------------------------
def test_unknown_exercise_and_missing_file_are_one_line(tmp_path):
    done = dtrain_command("exercises", "check", "2.99", "--path", str(tmp_path))
    assert done.returncode == 2 and "there is no exercise '2.99'" in done.stderr and "Traceback" not in done.stderr
    done = dtrain_command("exercises", "check", "2.1", "--path", str(tmp_path))
    assert done.returncode == 2 and "ring.py does not exist" in done.stderr and "dtrain exercises init" in done.stderr


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def ring_allreduce(comm, buf)\n    pass\n", "line 1: expected ':'"),
        ("def ring_allreduce(comm):\n    pass\n", "has the wrong parameters"),
        ("def ring(comm, buf):\n    pass\n", "defines no ring_allreduce() (it defines: ring)"),
        ("import nonexistent_module_xyz\n", "raised ModuleNotFoundError"),
        (
            "def ring_allreduce(comm, buf):\n    if comm.Get_rank() == 1:\n        raise ValueError('only me')\n"
            "    comm.Barrier()\n",
            "rank 1, case 1 of 8 (2 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...): raised "
            "ValueError: only me (ring.py line 3",
        ),
        ("def ring_allreduce(comm, buf):\n    if comm.Get_rank() == 0:\n        comm.Recv(buf, source=1)\n", "rank 0"),
    ],
    ids=["syntax", "signature", "no-function", "import", "raises-on-one-rank", "hangs-on-one-rank"],
)
def test_a_broken_file_is_one_clear_message(source, expected, tmp_path, capsys):
    (tmp_path / "ring.py").write_text(source)
    assert checker.check("2.1", tmp_path, mpi=False) == 1
    out = capsys.readouterr().out
    assert flat(expected) in flat(out) and "Traceback" not in out, out


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "def ring_allreduce(comm, buf):\n    if comm.Get_rank() == 1:\n        raise ValueError('only me')\n"
            "    comm.Barrier()\n",
            "rank 1, case 1 of 10 (3 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...): raised "
            "ValueError: only me (ring.py line 3",
        ),
        (
            "def ring_allreduce(comm, buf):\n    if comm.Get_rank() == 0:\n        comm.Recv(buf, source=1)\n",
            "in case 1 of 10 (3 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...): a rank waited more "
            "than 3 s for the others: a deadlock",
        ),
        (
            TOO_SMALL["reduce-scatter"],
            "rank 1, case 1 of 10 (3 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...); ring step 0 "
            "of the reduce-scatter: raised Exception:",  # (then MPI's own words: MPICH's, Open MPI's)
        ),
    ],
    ids=["raises-on-one-rank", "hangs-on-one-rank", "receives-into-too-small-a-buffer"],
)
def test_under_mpiexec_a_rank_that_raises_or_hangs_is_reported_in_time(source, expected, tmp_path, capsys,
                                                                       monkeypatch):  # fmt: skip
    monkeypatch.setattr(checker, "WAIT_LIMIT_S", 3.0)
    (tmp_path / "ring.py").write_text(source)
    found = checker.run_mpi(exercises.get("2.1"), tmp_path / "ring.py", 3)
    assert found["status"] in ("error", "deadlock") and expected in found["message"], found


# --- a passing exercise trains the MLP --------------------------------------------------------------------------------
@pytest.mark.mpi
def test_ddp_trains_with_the_learners_allreduce_and_follows_single(tmp_path):
    import json

    from mpi_util import run_mpi

    ring = reference_folder(tmp_path / "ex") / "ring.py"  # a ring that passes exercise 2.1
    flags = ["--dataset", "digits", "--epochs", "2", "--batch-size", "96", "--quiet", "--no-progress"]
    run_mpi(3, ["-m", "dtrain", "train", "--paradigm", "ddp", "--allreduce", f"{ring}:ring_allreduce",
                *flags, "--out", str(tmp_path / "yours")])  # fmt: skip
    done = dtrain_command("train", *flags, "--out", str(tmp_path / "single"))
    assert done.returncode == 0, done.stderr
    yours, single = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("yours", "single"))
    for mine, reference in zip(yours["epochs"], single["epochs"], strict=True):
        assert mine["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)
    assert "allreduce/yours:ring_allreduce" in yours["communication"]["per_rank"][0]["operations"]


def test_a_learners_allreduce_that_cannot_load_is_refused_before_training(tmp_path):
    (tmp_path / "ring.py").write_text("def ring_allreduce(comm):\n    pass\n")
    done = dtrain_command("train", "--paradigm", "ddp", "--allreduce", f"{tmp_path}/ring.py:ring_allreduce")
    assert done.returncode == 2 and "has the wrong parameters" in done.stderr and "epoch" not in done.stdout
    done = dtrain_command("train", "--paradigm", "zero", "--allreduce", f"{tmp_path}/ring.py:ring_allreduce")
    assert done.returncode == 2 and "works with --paradigm ddp" in done.stderr


# --- 2.6: on simulated ranks a rank sees another's stores only after a fence, so a missing one fails every time ----
def test_the_checkers_window_shows_a_store_to_another_rank_only_after_a_fence():
    """The memory model of 2.6's check (checks/shared_memory.py): each rank stores into its own copy of the window;
    a fence publishes every rank's stores; until then another rank loads the new window's signalling NaN."""
    import numpy as np

    from dtrain.comm import sim, windows
    from dtrain.course.exercises.checks.shared_memory import WeakMemory

    def rank(comm):
        model = WeakMemory(comm)
        model.begin(4, np.float64)
        win = windows.allocate(model, 32)
        if comm.Get_rank() == 0:
            win.view(0, np.float64, 0, 4)[...] = 7.0
        seen = [win.view(0, np.float64, 0, 4).copy()]
        win.fence()
        seen.append(win.view(0, np.float64, 0, 4).copy())
        model.Barrier()  # a plain barrier (not the window's fence) publishes nothing
        if comm.Get_rank() == 0:
            win.view(0, np.float64, 0, 4)[0] = 8.0
        model.Barrier()
        seen.append(win.view(0, np.float64, 0, 4).copy())
        assert model.finish(np.zeros(4)) is None and (model.fences, model.barriers) == (1, 2)
        return [s.tolist() for s in seen]

    first, second = sim.run(2, rank)
    assert first == [[7.0] * 4, [7.0] * 4, [8.0, 7.0, 7.0, 7.0]]  # (rank 0 sees its own stores at once)
    assert np.isnan(second[0]).all() and second[1:] == [[7.0] * 4, [7.0] * 4]


SHM_BUGS = {  # planted bug -> its whole finding, on 3 simulated ranks
    "shm_forgets_the_first_fence": (
        "rank 0, case 1 of 10 (3 ranks, 1 float64 element; rank r holds 100 r + 1, 100 r + 2, ...): buf after the "
        "call (the sum over all ranks): element 0 is nan, expected 303.0 (1 of 1 elements wrong)\nrank 0 read rank "
        "1's chunk 0 (buf[0:1]) before rank 1's fence: rank 1 wrote it before fence 1, and rank 0 read it then too, "
        "with no fence between; a rank sees another's stores only after a fence that follows them (rank 0 made 1 "
        "fence in this call; the algorithm makes 2: fence 1 after copying buf in, fence 2 after storing the sums)"
    ),
    "shm_sums_before_copying_in": (
        "rank 0 read rank 1's chunk 0 (buf[0:1]) before rank 1 had written it and fenced: rank 1 wrote it before "
        "fence 1, and rank 0 read it before fence 1 too (it stored what it read only between fence 1 and fence 2); a "
        "rank sees another's stores only after a fence that follows them"
    ),
    "shm_forgets_the_second_fence": (
        "rank 0 stored into rank 1's segment at chunk 0 (buf[0:1]) after fence 1, and no fence followed: rank 1 need "
        "not see that store (fence 2 comes after every rank has stored its sums, before anyone copies its segment out)"
    ),
}


@pytest.mark.parametrize("bug", sorted(SHM_BUGS))
def test_a_misplaced_fence_fails_the_same_way_every_time(bug):
    """2.6's planted bugs on 3 simulated ranks, five times over: the same finding each time (no luck in it), naming
    the rank, the chunk it loaded too early, whose store it missed and which fence."""
    from dtrain.course.exercises import run

    found = [run.run_sim(exercises.get("2.6"), BUGS / f"{bug}.py", [3]) for _ in range(5)]
    assert all(f == found[0] for f in found), found
    assert found[0]["status"] == "fail" and SHM_BUGS[bug] in found[0]["message"], found[0]


def test_another_shared_memory_allreduce_passes(tmp_path, capsys):
    """2.6 passes a correct solution that is not dtrain's (its own chunk from buf, the sum stored into the others'
    segments only), and dtrain's own, whose window outlives the call (it keeps one per communicator)."""
    (tmp_path / "shm.py").write_text((BUGS.parent / "exercise_alternatives" / "shm.py").read_text())
    assert checker.check("2.6", tmp_path, mpi=False) == 0, capsys.readouterr().out


@pytest.mark.mpi
def test_the_shared_memory_allreduce_passes_under_mpiexec_on_mpis_own_window(tmp_path):
    """Under mpiexec the window is MPI's (Win.Allocate_shared), the fences Win.Sync, Barrier, Win.Sync."""
    (tmp_path / "shm.py").write_text((BUGS.parent / "exercise_alternatives" / "shm.py").read_text())
    found = checker.run_mpi(exercises.get("2.6"), tmp_path / "shm.py", 3)
    assert found["status"] == "pass", found
    reference = reference_folder(tmp_path / "ref") / "shm.py"
    assert checker.run_mpi(exercises.get("2.6"), reference, 4)["status"] == "pass"

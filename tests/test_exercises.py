"""The exercises' checker, both ways: dtrain's reference implementations pass every exercise through the learner's
own command, the untouched stubs fail every one, each planted bug (tests/exercise_bugs/) fails with a message that
points at its mistake, and another correct way (tests/exercise_alternatives/) passes. Also: ``init`` never
overwrites, and every kind of bad input is one clear message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dtrain import exercises
from dtrain.exercises import checker

BUGS = Path(__file__).resolve().parent / "exercise_bugs"
ALL = exercises.catalogue()


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
def test_planted_bug_fails_with_a_pointed_message(bug, exercise_id, file, expected, tmp_path, capsys):
    (tmp_path / file).write_text(bug.read_text())
    assert checker.check(exercise_id, tmp_path, mpi=False) == 1
    out = capsys.readouterr().out
    assert ("FAIL" in out or "DEADLOCK" in out) and expected in out, out  # (lesson 10's bugs hang)


def test_every_subject_has_a_planted_bug():
    lessons_with_bugs = {exercises.get(p.values[1]).lesson for p in planted_bugs()}
    assert lessons_with_bugs >= {1, 2, 3, 8, 10, 13}  # grows with the subjects


@pytest.mark.parametrize("exercise_id", ["13.1", "13.2"])
def test_another_correct_way_passes(exercise_id, tmp_path, capsys):
    """Lesson 13's checks pass solutions that are not dtrain's (tests/exercise_alternatives/compression.py):
    another exchange of the pairs, another orthonormal basis for PowerSGD's P."""
    (tmp_path / "compression.py").write_text((BUGS.parent / "exercise_alternatives" / "compression.py").read_text())
    assert checker.check(exercise_id, tmp_path, mpi=False) == 0, capsys.readouterr().out


def test_init_never_overwrites(tmp_path, capsys):
    mine = tmp_path / "ring.py"
    mine.write_text("# my work\n")
    checker.init(tmp_path)
    assert mine.read_text() == "# my work\n"
    assert "kept your 1 existing files" in capsys.readouterr().out
    assert all((tmp_path / e.file).is_file() for e in ALL)


def test_list_shows_each_status(tmp_path, capsys):
    checker.init(tmp_path)
    reference_folder(tmp_path / "ref")
    (tmp_path / "ring.py").write_text((tmp_path / "ref" / "ring.py").read_text())
    checker.check("2.1", tmp_path, mpi=False)
    capsys.readouterr()
    checker.show_list(tmp_path)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "passing on simulated ranks" in rows["2.1"]
    (tmp_path / "ring.py").write_text("def ring_allreduce(comm, buf):\n    pass\n")
    checker.show_list(tmp_path)
    assert "not checked since it changed" in capsys.readouterr().out


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
            "rank 1 raised ValueError: only me (ring.py line 3",
        ),
        ("def ring_allreduce(comm, buf):\n    if comm.Get_rank() == 0:\n        comm.Recv(buf, source=1)\n", "rank 0"),
    ],
    ids=["syntax", "signature", "no-function", "import", "raises-on-one-rank", "hangs-on-one-rank"],
)
def test_a_broken_file_is_one_clear_message(source, expected, tmp_path, capsys):
    (tmp_path / "ring.py").write_text(source)
    assert checker.check("2.1", tmp_path, mpi=False) == 1
    out = capsys.readouterr().out
    assert expected in out and "Traceback" not in out, out


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "def ring_allreduce(comm, buf):\n    if comm.Get_rank() == 1:\n        raise ValueError('only me')\n"
            "    comm.Barrier()\n",
            "rank 1 raised ValueError: only me (ring.py line 3",
        ),
        (
            "def ring_allreduce(comm, buf):\n    if comm.Get_rank() == 0:\n        comm.Recv(buf, source=1)\n",
            "a deadlock",
        ),
    ],
    ids=["raises-on-one-rank", "hangs-on-one-rank"],
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

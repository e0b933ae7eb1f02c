"""lessons/lesson_util.py, the lessons' toolkit: a claim that holds prints "OK: claim", one that does not prints
"FAIL: claim" (never "OK: ...: NO"), the --json verdicts stay booleans, and a failed check ends the lesson with
status 1; bad arguments are refused at once, with status 2.

Checks run here on simulated ranks (dtrain.comm.sim), so a claim false on one rank alone is seen to fail on all of
them, said once by rank 0; the lessons themselves run them on MPI's world (tests/test_lessons*.py).
"""

from __future__ import annotations

import json
import sys

import pytest
from mpi_util import LESSONS

from dtrain.comm import sim

sys.path.insert(0, str(LESSONS))  # (lesson_util lives beside the lessons, which import it from their folder)
from lesson_util import Checks, conclude, refuse_bad_arguments


def test_a_failing_claim_prints_fail_and_a_holding_one_ok(capsys):
    checks = Checks(sim.solo())
    assert checks.ok("every rank's bytes equal costs()", False) is False
    assert checks.ok_here("the loss curves agree", True, " (to 1e-10)") is True
    out = capsys.readouterr().out
    assert out.splitlines() == ["   FAIL: every rank's bytes equal costs()", "   OK: the loss curves agree (to 1e-10)"]
    assert "OK: every rank's bytes" not in out and ": NO" not in out and ": yes" not in out
    assert checks.verdicts == {"every rank's bytes equal costs()": False, "the loss curves agree": True}
    assert not checks.passed


def test_a_claim_made_again_holds_only_if_it_held_each_time(capsys):
    checks = Checks(sim.solo())
    checks.ok("the same weights", True)
    assert checks.ok("the same weights", False) is False and checks.ok("the same weights", True) is False
    assert capsys.readouterr().out.splitlines() == ["   OK: the same weights"] + ["   FAIL: the same weights"] * 2
    assert checks.verdicts == {"the same weights": False}


def test_a_long_failing_claim_wraps_under_its_words(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    Checks(sim.solo()).ok("a claim long enough to need a second line at forty columns", False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("   FAIL: a claim") and len(lines) > 1
    assert all(line.startswith(" " * 9) and not line.startswith(" " * 10) for line in lines[1:]), lines


def test_a_claim_false_on_one_rank_fails_on_every_rank_said_once(capsys):
    def claim(comm):
        return Checks(comm).ok("every rank agrees", comm.Get_rank() != 1)

    assert sim.run(3, claim) == [False, False, False]
    assert capsys.readouterr().out == "   FAIL: every rank agrees\n"  # rank 0's line alone


def test_conclude_writes_the_verdicts_and_exits_1_after_a_fail(tmp_path, capsys):
    checks = Checks(sim.solo())
    checks.ok("it holds", True)
    checks.ok("it does not", False)
    path = tmp_path / "lesson.json"
    with pytest.raises(SystemExit) as ended:
        conclude(str(path), {"world": 1}, checks)
    assert ended.value.code == 1
    assert json.loads(path.read_text()) == {"world": 1, "checks": {"it holds": True, "it does not": False}}
    out = capsys.readouterr().out
    assert "   OK: it holds\n   FAIL: it does not\n" in out and out.endswith("\nall checks passed: NO\n")


def test_conclude_after_every_claim_held_returns(tmp_path, capsys):
    checks = Checks(sim.solo())
    checks.ok("it holds", True)
    conclude(None, {}, checks, note="1 checks; a note")
    assert capsys.readouterr().out.endswith("\nall checks passed: yes (1 checks; a note)\n")


def test_bad_arguments_are_refused_all_at_once_with_status_2(capsys):
    refuse_bad_arguments([(False, "--epochs must be >= 1")])  # nothing bad: nothing said
    with pytest.raises(SystemExit) as ended:
        refuse_bad_arguments([(True, "--epochs must be >= 1"), (False, "--seeds must be >= 1"), (1, "--rank 0")])
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip() == "bad arguments: --epochs must be >= 1; --rank 0"

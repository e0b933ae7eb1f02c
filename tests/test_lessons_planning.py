"""Lesson 11 (planning) reports what the planner says, and the planner's figures hold against oracles computed here.

The lesson runs with python (its measured runs are jobs of their own, started through dtrain.plan.check.measure); the
test runs it once with --quick and reads its --json, then holds each figure against what it computes itself: plan()
called here for the same models and machines, both sides of the tp/ddp crossover, the bubble formula, the ZeRO
paper's formula written out again plus the layer in flight, the preset's best on each rank count. The functions that
the notebook imports from the lesson are checked directly, without MPI: the crossover against a scan of every width,
the bubble on two balanced stages against (P-1)/(M+P-1) to rounding. (notebooks/11_planning.ipynb itself is run by
nbmake, with the other notebooks.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import subprocess
import sys

import pytest
from mpi_util import COLUMNS, LESSONS, assert_fits

from dtrain.launch import cluster
from dtrain.plan import Model, hardware, plan

LESSON = LESSONS / "11_planning.py"
sys.path.insert(0, str(LESSONS))  # (the lesson imports lesson_util from its folder)
_spec = importlib.util.spec_from_file_location("lesson_11_planning", LESSON)
planning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(planning)


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    """One run of the lesson, --quick, for a terminal of COLUMNS columns: what it printed and what it wrote with
    --json."""
    folder = tmp_path_factory.mktemp("lesson11")
    done = subprocess.run([sys.executable, str(LESSON), "--quick", "--json", str(folder / "l.json")],
                          capture_output=True, text=True, timeout=420,
                          env={**os.environ, "COLUMNS": str(COLUMNS)})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads((folder / "l.json").read_text())


def fastest_distributed(rows):
    return next(r for r in rows if r.fits and r.same_updates and r.ranks > 1)


def ddp_and_tp_here(width: int, world: int, machine):
    """The oracle for part 2, written out again: the fastest ddp row that sends messages (shared memory sends none)
    and the tp row on every rank, from plan()."""
    rows = plan(Model([width] * 5, 256), world, machine, only=["ddp", "tp"])
    ddps = [r for r in rows if r.paradigm == "ddp" and r.time and r.same_updates and r.sent_per_step]
    ddp = min(ddps, key=lambda r: r.total)
    tp = next(r for r in rows if r.label == f"tp{world}")
    return ddp.total, tp.total


@pytest.mark.mpi
def test_every_claim_of_the_lesson_holds(lesson):
    out, found = lesson
    assert "all checks passed: yes" in out, out
    failed = [claim for claim, passed in found["checks"].items() if not passed]
    assert not failed and len(found["checks"]) >= 6, (failed, out)
    for part in ("1. When not to distribute", "2. Data against tensor", "3. How micro-batches", "4. What ZeRO buys",
                 "5. A real cluster", "6. The planner against an emulated cluster"):  # fmt: skip
        assert part in out, out


@pytest.mark.mpi
def test_what_it_prints_fits_the_terminal(lesson):
    assert_fits(lesson[0], COLUMNS)


@pytest.mark.mpi
def test_part_1_measures_what_the_planner_would_pick_and_says_who_won(lesson):
    out, found = lesson
    here = hardware.load(hardware.THIS)
    for name, measured in found["measured"].items():
        model = Model(measured["model"], measured["batch_size"])
        configurations = measured["configurations"]
        expected = {"single": next(r for r in plan(model, 1, here) if r.paradigm == "single")}
        expected.update({f"{p} ranks": fastest_distributed(plan(model, p, here)) for p in (2, 4)})
        assert {label: c["label"] for label, c in configurations.items()} == {k: r.label for k, r in expected.items()}
        for label, row in expected.items():  # the tracer's bytes and the arrays' state: the planner's, exactly
            got = configurations[label]
            assert got["sent_per_step"] == row.sent_per_step == got["predicted_sent"], (name, label)
            assert got["state_bytes"] == max(row.state), (name, label)
            assert got["predicted_s"] == pytest.approx(row.total, rel=1e-12) and got["step_s"] > 0
        fastest = min(configurations, key=lambda label: configurations[label]["step_s"])
        assert measured["fastest_measured"] == fastest
        said = "Measured here, single is the fastest" if fastest == "single" else "Measured here, distributing wins"
        assert said in out.replace("\n   ", " "), (name, out)
    assert found["measured"]["small"]["fastest_predicted"] == "single"  # a digits-sized model: the planner says so


@pytest.mark.mpi
def test_part_2_the_crossover_is_where_tp_becomes_faster(lesson):
    _, found = lesson
    for name, sweep in found["widths"].items():
        machine, p, at = hardware.load(name), sweep["ranks"], sweep["crossover"]
        assert at is not None and at % 64 == 0, name
        ddp, tp = ddp_and_tp_here(at, p, machine)
        assert tp < ddp, (name, at)
        if at > planning.WIDTHS[0]:
            ddp, tp = ddp_and_tp_here(at - 64, p, machine)
            assert tp >= ddp, (name, at)
        for row in sweep["sweep"]:  # every width of the table is plan()'s, and tp wins from the crossover on
            ddp, tp = ddp_and_tp_here(row["width"], p, machine)
            assert (row["ddp_s"], row["tp_s"]) == pytest.approx((ddp, tp), rel=1e-12)
            if row["width"] >= at:
                assert tp < ddp, (name, row["width"])
        last, before = sweep["sweep"][-1], sweep["sweep"][-2]  # doubling the width: ddp's bytes x4, tp's x2
        assert last["ddp_sent"] / before["ddp_sent"] == pytest.approx(4, rel=0.01)
        assert last["tp_sent"] / before["tp_sent"] == pytest.approx(2, rel=0.01)


@pytest.mark.mpi
def test_part_3_the_bubble_follows_the_formula(lesson):
    _, found = lesson
    mb = found["microbatches"]
    P = mb["stages"]
    assert [s["M"] for s in mb["sweep"]] == [2**k for k in range(len(mb["sweep"]))]
    for s in mb["sweep"]:
        assert s["formula"] == pytest.approx((P - 1) / (s["M"] + P - 1), rel=1e-12)
        assert abs(s["fraction"] - s["formula"]) < 0.01, s  # the end stages send one message, the others two
    fractions = [s["fraction"] for s in mb["sweep"]]
    assert fractions == sorted(fractions, reverse=True)
    assert mb["best_M"] == min(mb["sweep"], key=lambda s: s["step_s"])["M"]
    assert mb["per_microbatch_s"] > 0 and 1 < mb["formula_M"] < mb["sweep"][-1]["M"]


@pytest.mark.mpi
def test_part_4_zero_is_the_paper_plus_the_layer_in_flight(lesson):
    _, found = lesson
    zero = found["zero"]
    N, n, budget = zero["world"], Model(zero["sizes"], 64).parameters, zero["memory_per_rank"]
    largest = max(a * b + b for a, b in itertools.pairwise(zero["sizes"]))
    b, k = 4, 2  # float32, Adam's two moments
    for row in zero["stages"]:
        stage = row["stage"]
        for kind, sharded_from, copies in (("parameters", 3, 1), ("gradients", 2, 1), ("optimizer", 1, k)):
            paper = copies * n * b / (N if stage >= sharded_from else 1)  # the paper's formula, in dtrain's terms
            in_flight = largest * b if (kind == "gradients" and stage >= 2) or (kind == "parameters" and stage == 3) \
                else 0  # fmt: skip
            assert row["held"][kind] == pytest.approx(paper + in_flight, rel=1e-12), (stage, kind)
        assert row["fits"] == (row["total"] <= budget)
    fits = [row["fits"] for row in zero["stages"]]
    assert fits[0] is False and any(fits), fits  # the point of the part: ddp does not fit, some stage does
    machine = planning.with_memory_per_rank(hardware.load(hardware.THIS), budget, N)
    assert machine.per_rank_memory(N) == budget
    rows = plan(Model(zero["sizes"], 64, optimizer="adam"), N, machine)
    assert zero["best"] == next(r for r in rows if r.best).label


@pytest.mark.mpi
def test_part_5_the_cluster_plan_and_its_assumptions(lesson):
    out, found = lesson
    cluster = found["cluster"]
    machine = hardware.load(cluster["preset"])
    model = Model(cluster["sizes"], cluster["batch_size"], optimizer="adam")
    assert 0.9e9 < model.parameters < 1.1e9  # about a billion
    assert sorted(map(int, cluster["worlds"])) == [8, 64]  # --quick
    for p, said in cluster["worlds"].items():
        rows = plan(model, int(p), machine)
        best = next(r for r in rows if r.best)
        assert said["best"] == best.label and said["step_s"] == pytest.approx(best.total, rel=1e-12)
    flat = " ".join(out.split())
    for about, source in hardware.presets()[cluster["preset"]]["sources"].items():  # every stated assumption
        assert " ".join(f"{about}: {source}".split()) in flat, about
    # ddp with and without --overlap, both as the planner priced them, and the planner's pick among all
    plain, overlapped = planning.overlap_rows(plan(model, 8, machine))
    assert cluster["ddp_overlap_8_s"] == pytest.approx(overlapped.total, rel=1e-12)
    assert cluster["ddp_no_overlap_8_s"] == pytest.approx(plain.total, rel=1e-12)
    assert overlapped.total < plain.total and "The planner weighs --overlap" in flat
    assert "does not weigh --overlap" not in flat and "not overlapped with it (dtrain's default" not in flat


@pytest.mark.mpi
def test_part_6_the_emulated_cluster_measured_against_the_planner(lesson):
    """As root: the four configurations run across 2 nodes x 2 ranks, each run's bytes the planner's (costs(), on
    nodes of 2), a predicted and a measured step printed side by side, and the cluster taken down; elsewhere the part
    says why it was skipped."""
    out, found = lesson
    emulated = found["emulated"]
    why_not = cluster.missing("part 6's cluster")
    if why_not is not None:
        assert emulated == {"skipped": why_not} and why_not in " ".join(out.split())
        return
    assert emulated["link"] == "100mbit" and list(emulated["configurations"]) == list(planning.EMULATED_LABELS)
    nodes = dataclasses.replace(hardware.load(hardware.THIS), ranks_per_node=2)
    rows = {r.label: r for r in plan(planning.EMULATED, 4, nodes, labels=planning.EMULATED_LABELS)}
    for label, got in emulated["configurations"].items():
        assert got["sent_per_step"] == rows[label].sent_per_step, label
        assert got["predicted_s"] == pytest.approx(got["compute_s"] + got["communication_s"]) and got["measured_s"] > 0
        assert f"{got['measured_s'] / got['predicted_s']:.2f}" in out, label  # (predicted beside measured)
    assert f"dtrain cluster down --name {planning.EMULATED_NAME}" in out
    assert planning.EMULATED_NAME not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_crossover_is_the_first_width_of_a_scan():
    """crossover() (bisection) against every multiple of 64 between the sweep's widths, on a preset (no MPI)."""
    machine = hardware.load("dgx-h100")
    at = planning.crossover(8, machine)
    wins = {w: planning.ddp_and_tp(w, 8, machine)[1].total < planning.ddp_and_tp(w, 8, machine)[0].total
            for w in range(at - 256, at + 256 + 1, 64)}  # fmt: skip
    assert not wins[at - 64] and all(wins[w] for w in wins if w >= at), wins
    assert at == min(w for w in wins if all(wins[v] for v in wins if v >= w))


def test_bubble_on_balanced_stages_is_the_formula_exactly():
    """Two stages of one layer each (every width equal): each sends one message a micro-batch, so the stages are
    balanced and the planner's bubble share is (P-1)/(M+P-1) to rounding, on this machine and on a preset."""
    for machine in (hardware.load(hardware.THIS), hardware.load("dgx-h100")):
        sweep = planning.microbatch_sweep(Model([512] * 3, 64), 2, machine)
        assert [s["M"] for s in sweep] == [1, 2, 4, 8, 16, 32]
        for s in sweep:
            assert s["fraction"] == pytest.approx(1 / (s["M"] + 1), rel=1e-9), (machine.name, s["M"])


def test_memory_per_rank_is_the_planners_override():
    """with_memory_per_rank() gives each rank what `dtrain plan --memory` gives it, on a shared node and on a preset."""
    here, dgx = hardware.load(hardware.THIS), hardware.load("dgx-h100")
    for machine in (here, dgx):
        for world in (2, 4, 16):
            assert planning.with_memory_per_rank(machine, 123 * 2**20, world).per_rank_memory(world) == 123 * 2**20
    assert dataclasses.replace(dgx, memory=1.0).per_rank_memory(64) == 1.0  # (a preset's memory is per rank already)


@pytest.mark.parametrize("flags", [["--ranks", "3"], ["--preset", "nowhere"], ["--link", "100m"]])
def test_the_lesson_refuses_bad_arguments_before_any_work(flags):
    done = subprocess.run([sys.executable, str(LESSON), *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "bad arguments" in done.stderr and done.stdout == "", done.stderr

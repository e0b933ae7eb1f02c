"""The lessons' parts on a cluster on this machine: lesson 2's ring against hierarchical, lesson 5's ddp against
local SGD and lesson 13's ddp against top-k and PowerSGD across a slow link (``--cluster``, lessons/cluster_util.py).

Everywhere: each lesson takes ``--cluster`` and ``--link``, refuses a rate tc would not take in one line (exit 2),
says how to run its part when not asked, and where a cluster cannot be made (here: ``tc`` taken off PATH) prints the
part's heading and ``skipped:`` with ``cluster.missing()``'s reason, then goes on to its verdict. As root with ``ip``
and ``tc`` each part runs for real, and is held to oracles of its own: arithmetic for what the link's rate allows a
step (no step can beat the bytes it must send across), the digits for each run's accuracy, and the kernel's own
lists (``ip netns``, ``ip link``) for what the part must leave behind: nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi_util import COLUMNS, LESSONS, assert_fits, run_mpi

from dtrain.collectives import costmodel
from dtrain.launch import cluster

WHY_NOT = cluster.missing()
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
pytestmark = pytest.mark.mpi

# each lesson on 2 ranks, as short as its flags make it
LESSON_RUNS = {
    "02_allreduce.py": ["--size-mib", "0.05", "--repeats", "1", "--shm-mib", "0.05"],
    "05_local_sgd.py": ["--epochs", "2", "--seeds", "1", "--warmup-sync-steps", "10"],
    "13_compression.py": ["--quick"],
}
HEADINGS = {
    "02_allreduce.py": "Ring against hierarchical across a 100 Mbit/s link",
    "05_local_sgd.py": "5. Across a 100 Mbit/s link: ddp against local SGD (H = 8)",
    "13_compression.py": "6. Across a 100 Mbit/s link: ddp, top-k and PowerSGD",
}
GRADIENT_784 = 4 * (784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)  # lesson 2's MLP, in bytes
DIGITS_PARAMETERS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10  # lessons 5 and 13's MLP
RATE_BYTES_S = 100e6 / 8  # 100mbit
BURST = 64 * 1024  # more than tbf lets through at once at the veth's own speed (cluster.py's bucket: 16 KiB here)


def lesson(name: str, *extra: str, tmp_path, env=None, check=True):
    """``name`` on 2 ranks with its short flags, ``extra`` and --json: (its measurements, its output)."""
    measurements = tmp_path / "lesson.json"
    env = {**os.environ, "COLUMNS": str(COLUMNS), **(env or {})}
    done = run_mpi(2, [str(LESSONS / name), *LESSON_RUNS[name], *extra, "--json", str(measurements)], timeout=240,
                   env=env, check=check)  # fmt: skip
    assert_fits(done.stdout, COLUMNS)
    return json.loads(measurements.read_text()), done.stdout


def flat(text: str) -> str:
    return " ".join(text.split())


def without_tc(folder) -> dict:
    """PATH without the sbin folders, where tc lives, and cluster.SYSTEM_BIN emptied by a sitecustomize.py in
    ``folder`` (on PYTHONPATH: every rank imports it), so that dtrain does not look there either:
    cluster.missing() then has its reason (or root's)."""
    kept = [d for d in os.environ["PATH"].split(os.pathsep) if not d.rstrip("/").endswith("sbin")]
    (folder / "sitecustomize.py").write_text("import dtrain.launch.cluster\ndtrain.launch.cluster.SYSTEM_BIN = ()\n")
    python_path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PATH": os.pathsep.join(kept), "PYTHONPATH": python_path}


@pytest.mark.parametrize("name", list(LESSON_RUNS))
def test_where_no_cluster_can_be_made_the_part_says_why_and_the_lesson_goes_on(name, tmp_path):
    (tmp_path / "hide").mkdir()
    env = without_tc(tmp_path / "hide")
    reason = subprocess.run([sys.executable, "-c", "from dtrain.launch import cluster; print(cluster.missing())"],
                            capture_output=True, text=True, env={**os.environ, **env}).stdout.strip()  # fmt: skip
    assert reason != "None", "tc was still found: the test could not take it away"
    results, out = lesson(name, "--cluster", tmp_path=tmp_path, env=env)
    assert HEADINGS[name] in flat(out), out
    assert f"skipped: {reason}" in flat(out), out
    assert results["cluster"] is None
    assert all(results["checks"].values()), results["checks"]  # (the rest of the lesson as ever)


def test_without_cluster_the_part_says_how_to_run_it(tmp_path):
    results, out = lesson("02_allreduce.py", tmp_path=tmp_path)
    assert "skipped: run the lesson with --cluster to make a cluster of 2 nodes x 2 ranks" in flat(out), out
    assert results["cluster"] is None


@pytest.mark.parametrize("name", list(LESSON_RUNS))
def test_a_link_tc_would_not_take_is_refused_in_one_line(name):
    result = run_mpi(2, [str(LESSONS / name), "--cluster", "--link", "fast"], timeout=60, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and "--link 'fast': give a rate as tc spells it" in result.stderr


def nothing_left(record: dict) -> None:
    """The kernel's own lists: no namespace or link of the part's cluster is left, nor its folder."""
    name = record["name"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"{name}-n" not in namespaces
    assert f"dtb-{name}:" not in links and f"dtv-{name}-" not in links
    assert not (cluster.ROOT / name).exists()


@needs_root
@pytest.mark.slow
def test_lesson_2_ring_against_hierarchical_on_a_cluster(tmp_path):
    results, out = lesson("02_allreduce.py", "--cluster", tmp_path=tmp_path)
    part = results["cluster"]
    assert part["cluster"]["nodes"] == 2 and part["cluster"]["slots"] == 2 and part["cluster"]["link"] == "100mbit"
    ring, hier = part["runs"]["ring"], part["runs"]["hierarchical"]
    # no step beats the bytes it must send across the link: the ring's 2(p-1)/p n, hierarchical's 2(m-1)/m n
    assert ring["step_s"] >= (1.5 * GRADIENT_784 - BURST) / RATE_BYTES_S
    assert hier["step_s"] >= (1.0 * GRADIENT_784 - BURST) / RATE_BYTES_S
    assert ring["model_step_s"] > hier["model_step_s"] > GRADIENT_784 / RATE_BYTES_S
    assert "Measured, hierarchical is" in flat(out) and "taken down" in out
    nothing_left(part["cluster"])


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "runs"),
    [("05_local_sgd.py", ["ddp", "local SGD H=8"]), ("13_compression.py", ["ddp ring", "top-k 1%", "PowerSGD r=2"])],
)
def test_lessons_5_and_13_time_to_accuracy_on_a_cluster(name, runs, tmp_path):
    results, out = lesson(name, "--cluster", tmp_path=tmp_path)
    part = results["cluster"]
    assert list(part["runs"]) == runs
    for label, run in part["runs"].items():
        # every run reaches 96% within the part's epochs (its own test accuracy, epoch by epoch)
        assert run["epoch"] is not None and run["accuracy"][run["epoch"] - 1] >= 0.96, (label, run["accuracy"])
        assert run["seconds"] > 0 and run["model_seconds"] > 0
    ddp = part["runs"][runs[0]]
    assert ddp["bytes_per_step"] == max(costmodel.bytes_sent("ring", DIGITS_PARAMETERS, 4, 4, r) for r in range(4))
    assert ddp["step_s"] >= (ddp["bytes_per_step"] - BURST) / RATE_BYTES_S
    assert "taken down" in out
    nothing_left(part["cluster"])

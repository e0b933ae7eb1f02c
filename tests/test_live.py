"""The notebooks' live parts (dtrain/course/live.py): %%px cells on real MPI ranks, started and stopped by the notebook.

nbmake runs the notebooks with DTRAIN_LIVE=0 (conftest.py), so there their live sections only say they are skipped.
Here the live sections of notebooks 2, 3 and 8 (their cells tagged "live") run once, each in a kernel of its own with
DTRAIN_LIVE=1, on 4 MPI engines. Every rank checks its own claims with asserts inside the %%px cells (one that fails
fails its cell, and so the test); the test reads what every rank printed as well. Also: without ipyparallel, or with
DTRAIN_LIVE=0, the live part says so and the notebook runs on; engines that do not register in time are stopped, not
waited for; the watcher kills a cluster whose starter died without stopping it; and no process of any cluster
outlives its test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from dtrain.collectives import costmodel
from dtrain.config import TrainConfig
from dtrain.course import live
from dtrain.launch import mpiexec
from dtrain.parallel import schedules
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.pipeline import Pipeline

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
P = 4


def run_live_cells(name: str, env: dict, tmp_path: Path) -> list[str]:
    """Execute notebook ``name``'s live cells in a new kernel (temporary files in ``tmp_path``); each code cell's
    output text, in order. A cell that fails raises nbclient's CellExecutionError, with the cell's traceback."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nb.cells = [cell for cell in nb.cells if "live" in cell.metadata.get("tags", [])]
    assert nb.cells, f"{name} has no cells tagged 'live'"
    kernel_env = {**os.environ, "TMPDIR": str(tmp_path), "IPYTHONDIR": str(tmp_path / "ipython"), **env}
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=kernel_env)
    return ["".join(_text(output) for output in cell.outputs) for cell in nb.cells if cell.cell_type == "code"]


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return f"{output.ename}: {output.evalue}\n"
    return output.get("data", {}).get("text/plain", "")


def processes_under(path: Path) -> list[str]:
    """The processes still running whose command line names ``path`` (a cluster's profile folder is in it, for the
    controller, mpiexec, every engine and the watcher); a zombie has ended."""
    left = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or ())
        if str(path) in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(f"{process.pid}: {cmdline}")
    return left


def assert_nothing_left(path: Path, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while (left := processes_under(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "processes of a cluster left behind:\n" + "\n".join(left)
    assert not list(path.glob("dtrain-live-*")), "a cluster's profile folder left behind"


def per_rank(text: str, pattern: str) -> list[re.Match]:
    """The match of ``pattern`` (with {r} for the rank) on each rank's line, in rank order; fails if one is missing."""
    found = [re.search(pattern.format(r=r), text, flags=re.MULTILINE) for r in range(P)]
    assert all(found), f"a rank's line is missing ({pattern}) in:\n{text}"
    return found


# ----------------------------------------------------------------------------------------------------------------
# Without live ranks: the message, and a notebook that runs on
# ----------------------------------------------------------------------------------------------------------------


def test_without_ipyparallel_the_live_part_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ipyparallel", None)  # `import ipyparallel` now raises ImportError
    monkeypatch.delenv(live.ENV, raising=False)
    assert live.why_skipped() == live.MISSING == "the live part needs ipyparallel: pip install -e '.[live]'"
    assert live.begin(4) == (None, None)
    assert live.MISSING in capsys.readouterr().out
    live.end(None)  # nothing to stop, nothing said
    assert capsys.readouterr().out == ""
    with pytest.raises(live.LiveUnavailable, match=re.escape(live.MISSING)):
        live.start(4)
    monkeypatch.setenv(live.ENV, "1")  # required: a skip would hide a broken setup
    with pytest.raises(live.LiveUnavailable, match=re.escape(live.MISSING)):
        live.begin(4)
    monkeypatch.setenv(live.ENV, "0")
    assert live.why_skipped().startswith("DTRAIN_LIVE=0")


def test_without_ipyparallel_a_notebook_skips_its_live_part_and_runs_on(tmp_path):
    """In a real kernel: ipyparallel cannot be imported (a stand-in module raises ImportError); begin says what to
    install, every %%px cell says it is skipped instead of failing as an unknown magic, and every cell runs."""
    (tmp_path / "ipyparallel.py").write_text("raise ImportError('No module named ipyparallel')\n")
    env = {"PYTHONPATH": str(tmp_path), live.ENV: ""}
    outputs = run_live_cells("02_allreduce", env, tmp_path)
    assert live.MISSING in outputs[0]
    px_cells = [i for i, cell in enumerate(_live_code("02_allreduce")) if cell.startswith("%%px")]
    assert len(px_cells) == 3
    for i in px_cells:
        assert outputs[i] == f"skipped (no live ranks): {live.MISSING}\n", outputs[i]
    assert outputs[-1] == ""  # live.end(None): nothing to stop


def _live_code(name: str) -> list[str]:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and "live" in c.metadata.get("tags", [])]


def test_the_watcher_kills_the_cluster_once_its_starter_dies(tmp_path):
    """A starter that dies without stopping its cluster (SIGKILL, as nbclient kills a kernel whose cell timed out):
    the watcher's pipe closes, and it kills every process it saw under the roots, and removes the profile folder.
    Here the roots are two sleeping processes, one with a child, started with a watcher by a stand-in starter."""
    profile = tmp_path / "dtrain-live-test"
    profile.mkdir()
    starter = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from dtrain.course import live
sleeper = [sys.executable, "-c", "import time; time.sleep(60)", {str(profile)!r}]
quiet = dict(start_new_session=True, stdout=subprocess.DEVNULL)  # (not the pipe the test reads)
roots = [subprocess.Popen(sleeper, **quiet),
         subprocess.Popen(["sh", "-c", " ".join(map(repr, sleeper)) + "; true"], **quiet)]
live._watcher({str(profile)!r}, time.time(), [root.pid for root in roots])
time.sleep(1)  # the watcher notes the trees
print("ready", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert starter.stdout.readline() == "ready\n"
        assert len(processes_under(profile)) >= 4  # two sleepers, the shell, the watcher
        starter.kill()
        starter.wait()
        assert_nothing_left(profile, within=5)
        assert not profile.exists()
    finally:
        starter.kill()
        for process in psutil.process_iter(["cmdline"]):  # (only if the watcher failed)
            if str(profile) in " ".join(process.info["cmdline"] or ()):
                process.kill()


# ----------------------------------------------------------------------------------------------------------------
# With live ranks
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_engines_that_do_not_register_in_time_are_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the cluster's profile folder, so it can be found
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0 of 4 engines registered within 0\.2 s, so the cluster was stopped"):
        live.start(4, timeout=0.2)  # the controller alone takes longer to start
    assert time.monotonic() - began < 15
    assert not live._running
    assert_nothing_left(tmp_path)


def check_02(outputs: list[str]) -> None:
    for rank, match in enumerate(per_rank(outputs[1], r"^rank {r} of 4 \(process \d+\) holds \[(.*)\]$")):
        assert set(match.group(1).split()) == {f"{10**rank}."}
    for match in per_rank(outputs[2], r"^rank {r}: ring \[(.*)\]\n\s+MPI  \[(.*)\]$"):
        assert set(match.group(1).split()) == set(match.group(2).split()) == {"1111."}
    pattern = r"^rank {r}: ring == MPI_Allreduce on 10,001 values: (\w+); sent ([\d,]+) bytes, costmodel: ([\d,]+)$"
    for rank, match in enumerate(per_rank(outputs[3], pattern)):
        assert match.group(1) == "True"
        assert int(match.group(2).replace(",", "")) == costmodel.bytes_sent("ring", 10_001, 4, P, rank)
    assert "every rank holds the sum of the four buffers" in outputs[4]


def check_03(outputs: list[str]) -> None:
    per_rank(outputs[1], r"^rank {r} of 4: 12 samples \(slice {r} of 4\), loss [\d.]+$")
    config = TrainConfig(paradigm="ddp", hidden=(32,), batch_size=48, allreduce="ring", bucket_mb=0, overlap=False)
    predicted = DataParallel.costs([64, 32, 10], P, config)["sent_per_step"]
    pattern = (r"^rank {r}: gradient off the full batch's by ([\d.]+) before the all-reduce, ([\d.e+-]+) after; "
               r"sent ([\d,]+) bytes \(costs\(\): [\d,]+\); weights (\w+)$")  # fmt: skip
    found = per_rank(outputs[2], pattern)
    for rank, match in enumerate(found):
        assert float(match.group(1)) > 1e-3 and float(match.group(2)) < 1e-6
        assert int(match.group(3).replace(",", "")) == predicted[rank]
    assert len({match.group(4) for match in found}) == 1  # bit-identical replicas


def check_08(outputs: list[str]) -> None:
    per_rank(outputs[1], r"^rank {r} = stage {r}: layers \d+-\d+ \([\d-]+\), [\d,]+ parameters$")
    programs = schedules.build("1f1b", P, 4, 1)
    for rank, match in enumerate(per_rank(outputs[2], r"^rank {r} = stage {r} computed (.*)$")):
        assert match.group(1) == " ".join(str(i) for i in programs[rank] if i.op in ("forward", "backward"))
    sizes = [64, *[32] * 7, 10]
    config = TrainConfig(paradigm="pp", pp=P, microbatches=4, schedule="1f1b", hidden=tuple(sizes[1:-1]),
                         batch_size=32, dtype="float64")  # fmt: skip
    predicted = Pipeline.costs(sizes, P, config)["sent_per_step"]
    blocks = re.split(r"^(?=rank \d = stage)", outputs[2], flags=re.MULTILINE)[1:]
    assert len(blocks) == P, outputs[2]
    for rank, block in enumerate(blocks):
        sent = [int(n.replace(",", "")) for n in re.findall(r"messages, ([\d,]+) bytes", block)]
        assert len(sent) == (1 if rank in (0, P - 1) else 2) and sum(sent) == predicted[rank], block
    for match in per_rank(outputs[3], r"^rank {r}: the pipeline's weights after the step are within ([\d.e+-]+) "):
        assert float(match.group(1)) < 1e-12
    assert re.search(r"the batch's loss ([\d.]+), one process's \1$", outputs[3], flags=re.MULTILINE), outputs[3]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "check"), [("02_allreduce", check_02), ("03_data_parallel", check_03), ("08_pipeline_parallel", check_08)]
)
def test_live_part_of_the_notebook_runs_on_4_mpi_ranks(name, check, tmp_path):
    try:
        outputs = run_live_cells(name, {live.ENV: "1"}, tmp_path)
        match = re.search(r"^4 live ranks up in ([\d.]+) s: one MPI.COMM_WORLD of 4 ipyparallel engines, started by "
                          r"(\S+)", outputs[0], flags=re.MULTILINE)  # fmt: skip
        assert match, outputs[0]
        assert match.group(2) == str(mpiexec.path())  # this environment's mpiexec
        check(outputs)
        assert re.fullmatch(r"cluster stopped in [\d.]+ s: engines, mpiexec and the controller\n", outputs[-1])
    finally:
        assert_nothing_left(tmp_path)

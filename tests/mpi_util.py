"""Run code on N MPI ranks from a test, with a timeout, through dtrain's own launcher.

The launcher sets one BLAS/Numba thread per rank and MPICH's yielding wait when ranks outnumber cores, runs the
target under ``python -m dtrain.comm.run`` (a failure on any rank ends the job), and kills the whole process group on
timeout: a bug is a failed test, never a hung suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

from dtrain.launch import launcher

LESSONS = Path(__file__).resolve().parent.parent / "lessons"


def run_mpi(nranks: int, target: list[str], timeout: float = 180, check: bool = True, cwd=None, env=None):
    """Run ``target`` (``[script, args...]`` or ``["-m", module, ...]``) on ``nranks`` ranks; return the result.

    With ``check`` a non-zero exit fails the test and shows both output streams.
    """
    try:
        result = launcher.launch(nranks, target, timeout=timeout, capture=True, cwd=cwd, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{nranks} ranks did not finish within {timeout} s (a hang?)\nstdout:\n{exc.output}\nstderr:\n{exc.stderr}"
        ) from None
    if check and result.returncode != 0:
        raise AssertionError(
            f"mpiexec -n {nranks} {' '.join(target)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def run_mpi_code(nranks: int, code: str, tmp_path, timeout: float = 180, check: bool = True):
    """Write ``code`` (dedented) to a script in ``tmp_path`` and run it on ``nranks`` ranks."""
    script = tmp_path / f"mpi_script_{nranks}.py"
    script.write_text(textwrap.dedent(code))
    return run_mpi(nranks, [str(script)], timeout=timeout, check=check)


COLUMNS = 80  # a lesson under test prints for a terminal this wide, and must fit it (dtrain.terminal)


def assert_fits(text: str, columns: int) -> None:
    """Every line of ``text`` fits ``columns``, but for a line of one word (a path longer than the terminal cannot
    fit, and must not be cut); else the lines that do not, numbered."""
    long = [f"{i}: ({len(line)}) {line}" for i, line in enumerate(text.splitlines(), 1)
            if len(line) > columns and len(line.split()) > 1]  # fmt: skip
    assert not long, f"{len(long)} line(s) wider than {columns} columns:\n" + "\n".join(long[:20])


def run_lesson(
    nranks: int, lesson: str, flags: list[str], tmp_path, claims=(), timeout: float = 240
) -> tuple[dict, str]:
    """Run ``lessons/<lesson>`` with ``flags`` on ``nranks`` ranks and read what it wrote with ``--json``: every
    measurement, and under "checks" the verdict of every claim it checked ({claim: passed}). Every verdict must be a
    pass and each of ``claims`` must be among them (the lesson made it). Returns the measurements and the output."""
    measurements = tmp_path / "lesson.json"
    out = run_mpi(nranks, [str(LESSONS / lesson), *flags, "--json", str(measurements)], timeout=timeout,
                  env={**os.environ, "COLUMNS": str(COLUMNS)}).stdout  # fmt: skip
    assert_fits(out, COLUMNS)
    results = json.loads(measurements.read_text())
    failed = [claim for claim, passed in results["checks"].items() if not passed]
    assert not failed, f"claims that failed: {failed}\n{out}"
    missing = [claim for claim in claims if claim not in results["checks"]]
    assert not missing, f"claims not made: {missing}\n{out}"
    return results, out

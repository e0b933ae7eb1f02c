"""How a job ends when a rank fails (dtrain.comm.mpi.end_job, under dtrain.comm.run): said once, and never a hang.

Every rank failing alike is one report from rank 0 and no MPI_Abort; a failure only some ranks see is that rank's
report, naming it, and an MPI_Abort that ends the ranks still waiting for it.
"""

from __future__ import annotations

import textwrap
import time

import pytest
from mpi_util import run_mpi

pytestmark = pytest.mark.mpi


def run(tmp_path, code: str, nranks: int = 4):
    """Run ``code`` as job.py on ``nranks`` ranks; the result and how long it took."""
    (tmp_path / "job.py").write_text(textwrap.dedent(code))
    started = time.monotonic()
    result = run_mpi(nranks, ["job.py"], timeout=120, check=False, cwd=tmp_path)
    return result, time.monotonic() - started


def test_an_exception_on_every_rank_is_one_traceback_and_no_abort(tmp_path):
    result, _ = run(tmp_path, """
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        raise ValueError("every rank sees this")
    """)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("uncaught exception on every rank, ending the job:") == 1, result.stderr
    assert result.stderr.count("Traceback") == 1 and result.stderr.count("ValueError: every rank sees this") == 1
    assert 'File "job.py", line 4' in result.stderr  # the program's frames only: not runpy's or the runner's
    assert "runpy" not in result.stderr
    assert "Abort" not in result.stderr + result.stdout, result.stderr


def test_an_exception_on_one_rank_names_it_once_and_aborts_the_waiting_ranks(tmp_path):
    result, took = run(tmp_path, """
        import numpy as np
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.Get_rank() == 2:
            raise ValueError("only rank 2 sees this")
        comm.Recv(np.zeros(1), source=2)  # the others wait for rank 2, which will never send
    """)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("uncaught exception (rank 2), ending the job:") == 1, result.stderr
    assert result.stderr.count("ValueError: only rank 2 sees this") == 1, result.stderr
    assert "every rank" not in result.stderr
    assert took < 60  # the waiting ranks were aborted (the watchdog's default would take 300 s)


def test_different_mistakes_on_every_rank_are_each_said_once_with_their_ranks(tmp_path):
    result, _ = run(tmp_path, """
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
        raise ValueError("even" if rank % 2 == 0 else "odd")
    """)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("uncaught exception (ranks 0, 2), ending the job:") == 1, result.stderr
    assert result.stderr.count("uncaught exception (ranks 1, 3), ending the job:") == 1, result.stderr
    assert result.stderr.count("Traceback") == 2 and "Abort" not in result.stderr


def test_sys_exit_on_every_rank_is_the_programs_status_and_no_abort(tmp_path):
    result, _ = run(tmp_path, """
        import sys
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        sys.exit(3)
    """)  # fmt: skip
    assert result.returncode == 3 and result.stderr == "", result.stderr


def test_debug_mode_mismatch_is_one_report_with_every_ranks_call_and_where(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_DEBUG", "1")
    result, _ = run(tmp_path, """
        import numpy as np
        from mpi4py import MPI
        from dtrain import collectives

        comm = MPI.COMM_WORLD
        buf = np.zeros(11 if comm.Get_rank() == 1 else 10, np.float32)
        if comm.Get_rank() == 2:
            collectives.broadcast(comm, buf)  # line 9
        else:
            collectives.allreduce(comm, buf, algorithm="ring")  # line 11
    """)  # fmt: skip
    assert result.returncode == 1
    err = result.stderr
    assert err.count("CollectiveMismatchError: the ranks are not making the same collective call") == 1, err
    assert err.count("Traceback") == 1 and "Abort" not in err, err
    for rank, collective, count, line in ((0, "allreduce", 10, 11), (1, "allreduce", 11, 11), (2, "broadcast", 10, 9),
                                          (3, "allreduce", 10, 11)):  # fmt: skip
        assert f"rank {rank}: collective='{collective}'" in err and f"count={count}" in err, err
        assert f"at job.py:{line} in <module>" in err.split(f"rank {rank}: collective=")[1].splitlines()[0], err


def test_sys_exit_with_a_message_on_every_rank_says_it_once_and_exits_1(tmp_path):
    result, _ = run(tmp_path, """
        import sys
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        sys.exit("the data folder is empty")
    """)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("the data folder is empty") == 1, result.stderr
    assert "Abort" not in result.stderr + result.stdout and "Traceback" not in result.stderr, result.stderr


def test_a_module_that_does_not_exist_is_one_line(tmp_path):
    result = run_mpi(4, ["-m", "no_such_module_here"], timeout=120, check=False, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [f"dtrain: error: no module named 'no_such_module_here' (from {tmp_path}): check -m MODULE"], (
        result.stderr
    )


def test_a_module_in_the_folder_the_ranks_start_in_is_found(tmp_path):
    """As ``python -m``: the current folder comes first on the path."""
    (tmp_path / "local_job.py").write_text(
        "from mpi4py import MPI\nranks = MPI.COMM_WORLD.gather(MPI.COMM_WORLD.Get_rank())\n"
        "if ranks:\n    print('ran on', ranks)\n"
    )  # (one print, by rank 0: two ranks printing at once may interleave their lines)
    result = run_mpi(2, ["-m", "local_job"], timeout=120, cwd=tmp_path)
    assert "ran on [0, 1]" in result.stdout, result.stdout


def test_kernels_that_cannot_be_honoured_are_one_line_before_the_program(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_KERNELS", "fortran")
    (tmp_path / "job.py").write_text("print('the program started')\n")
    result = run_mpi(4, ["job.py"], timeout=120, check=False, cwd=tmp_path)
    assert result.returncode == 2 and "the program started" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: ") and "DTRAIN_KERNELS" in lines[0], result.stderr

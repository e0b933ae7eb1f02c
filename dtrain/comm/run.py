"""``python -m dtrain.comm.run TARGET``: run a program as one rank of a job, so that a failure ends the job well.

What ``dtrain launch`` starts on every rank, in the place of ``python -m mpi4py``. TARGET is what ``python`` takes:
``script.py [args]``, ``-m module [args]`` or ``-c code [args]``. Before the program starts, every rank sets up how
a failure ends the job (:func:`dtrain.comm.mpi.install_excepthook`); then:

* an uncaught exception ends the job once, through :func:`dtrain.comm.mpi.end_job`: one traceback when every rank
  raised the same (a bad argument, a mismatched collective in debug mode), else the traceback of the rank that
  raised it, and ``MPI_Abort`` for the ranks still waiting for it;
* ``sys.exit(n)`` with n != 0 is the program's own way to fail: the job exits n, quietly, through ``MPI_Finalize`` if
  every rank chose it, else through ``MPI_Abort(n)``;
* Ctrl-C (the launcher passes it on) ends the rank quietly with 130.
"""

from __future__ import annotations

import os
import runpy
import sys

from dtrain.comm import mpi

USAGE = "usage: python -m dtrain.comm.run script.py [args] | -m module [args] | -c code [args]"


def main(argv: list[str]) -> None:
    if not argv or (argv[0] in ("-m", "-c") and len(argv) < 2):
        sys.exit(USAGE)
    mpi.install_excepthook()
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()  # as python -m: argv[0] becomes the file's path
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if status:  # (a message in sys.exit("...") is written as Python would, by this rank)
            if not isinstance(exc.code, int):
                sys.stderr.write(f"{exc.code}\n")
            mpi.end_job("", status, template="")
        raise SystemExit(status) from None


if __name__ == "__main__":
    main(sys.argv[1:])

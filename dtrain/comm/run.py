"""``python -m dtrain.comm.run TARGET``: run a program as one rank of a job, so that a failure ends the job well.

What ``dtrain launch`` starts on every rank, in the place of ``python -m mpi4py``. TARGET is what ``python`` takes:
``script.py [args]``, ``-m module [args]`` or ``-c code [args]``. Before the program starts, every rank sets up how
a failure ends the job (:func:`dtrain.comm.mpi.install_excepthook`); then:

* an uncaught exception ends the job once, through :func:`dtrain.comm.mpi.end_job`: one traceback when every rank
  raised the same (a bad argument, a mismatched collective in debug mode), else the traceback of the rank that
  raised it, and ``MPI_Abort`` for the ranks still waiting for it;
* ``sys.exit(n)`` with n != 0 is the program's own way to fail: the job exits n, quietly, through ``MPI_Finalize`` if
  every rank chose it, else through ``MPI_Abort(n)`` (``sys.exit("why")``: exit 1, and "why" said once);
* a module that does not exist, or a ``DTRAIN_KERNELS`` that cannot be honoured, is one line before the program
  starts;
* Ctrl-C (the launcher passes it on) ends the rank quietly with 130.
"""

from __future__ import annotations

import importlib.util
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
        _refuse_what_cannot_run(argv)
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
        if status:  # sys.exit("why") is said once, as any failure: by rank 0 if every rank said it
            mpi.end_job("" if isinstance(exc.code, int) else str(exc.code), status)
        raise SystemExit(status) from None


def _refuse_what_cannot_run(argv: list[str]) -> None:
    """One line, said once, for what would otherwise be the same traceback on every rank: a module that does not
    exist, or a ``DTRAIN_KERNELS`` this machine cannot honour."""
    from dtrain import kernels
    from dtrain.errors import EXIT_USER_ERROR, UserError

    try:
        if argv[0] == "-m":
            sys.path.insert(0, os.getcwd())  # where python -m looks first
            try:
                found = importlib.util.find_spec(argv[1])
            except ImportError:  # a parent package that does not exist
                found = None
            finally:
                sys.path.pop(0)
            if found is None:
                raise UserError(f"no module named {argv[1]!r} (from {os.getcwd()}): check -m MODULE")
        kernels.check_environment()
    except UserError as exc:
        mpi.end_job(str(exc), EXIT_USER_ERROR, template="dtrain: error{who}: {message}")
        raise SystemExit(EXIT_USER_ERROR) from None


if __name__ == "__main__":
    main(sys.argv[1:])

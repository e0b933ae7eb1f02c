"""What the lessons on MPI ranks do the same way: explain, check a claim on every rank, and wait without spinning.

A lesson prints on rank 0, but it checks its claims on every rank, so that every rank agrees on the verdict and the
exit status (a rank that exits non-zero alone aborts the whole job; all of them alike just exit, see dtrain.comm.run)::

    checks = Checks(world)
    checks.ok("every stage follows single's loss curve", worst < 1e-10)    # prints "   OK: ...: yes" (or NO)
    ...
    checks.finish()                                                          # "all checks passed: yes", or exit 1
"""

from __future__ import annotations

import textwrap
import time

from dtrain.comm import mpi


def say(text: str) -> None:
    """Print (on rank 0) a paragraph of explanation, wrapped and indented like the tables."""
    mpi.print0(textwrap.fill(text, width=116, initial_indent="   ", subsequent_indent="   "))


def everywhere(flag: bool, comm) -> bool:
    """True on every rank iff ``flag`` is true on every rank."""
    return comm.allreduce(int(bool(flag)), op=_min()) == 1


def sleeping_barrier(comm) -> None:
    """A barrier whose waiters sleep: a rank left out of a run must not spin on a core that the run needs."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


class Checks:
    """The lesson's claims, each checked on every rank and printed as an OK line by rank 0."""

    def __init__(self, comm):
        self.comm, self.passed = comm, True

    def ok(self, claim: str, flag: bool) -> bool:
        flag = everywhere(flag, self.comm)
        self.passed = self.passed and flag
        mpi.print0(f"   OK: {claim}: {'yes' if flag else 'NO'}")
        return flag

    def finish(self) -> None:
        mpi.print0(f"\nall checks passed: {'yes' if self.passed else 'NO'}")
        if not self.passed:
            self.comm.Barrier()  # rank 0 has said what failed before any rank leaves (a non-zero exit aborts the job)
            raise SystemExit(1)  # on every rank (the verdict is the same everywhere), so mpiexec's status says so


def against_single(single: dict, runs: dict, steps: int, prefixes: tuple, epochs: int) -> tuple[dict, bool, bool]:
    """Print (on the rank holding the metrics) every run's loss curve beside ``single``'s and every rank's bytes per
    step (the traffic labelled with ``prefixes``) beside the run's cost function. Returns the curves, whether every
    curve is single's to 1e-10, and whether every rank's bytes equal ``costs()["sent_per_step"]``."""
    curves = {"single": [e["train_loss"] for e in single["epochs"]]}
    curves.update({label: [e["train_loss"] for e in metrics["epochs"]] for label, metrics in runs.items()})
    width = max(19, *(len(label) + 2 for label in curves))
    print(f"   {'epoch':>5s}" + "".join(f"{label:>{width}s}" for label in curves))
    for e in range(epochs):
        print(f"   {e + 1:5d}" + "".join(f"{curves[label][e]:{width}.14f}" for label in curves))
    worst = max(abs(a - b) / abs(b) for c in curves.values() for a, b in zip(c, curves["single"]))
    print(f"   largest relative difference from single: {worst:.1e}")
    print("\n   bytes sent per step by each rank (the tracer), and whether they equal costs() on every rank")
    bytes_ok = True
    for label, metrics in runs.items():
        sent = [sum(o["bytes_sent"] for name, o in mine["operations"].items() if name.startswith(prefixes)) / steps
                for mine in metrics["communication"]["per_rank"]]  # fmt: skip
        exact = sent == metrics["costs"]["sent_per_step"]
        bytes_ok = bytes_ok and exact
        print(f"   {label:{width}s}" + "".join(f"{s:10,.0f}" for s in sent) + f"   {'yes' if exact else 'NO'}")
    return curves, worst < 1e-10, bytes_ok


def _min():
    from mpi4py import MPI

    return MPI.MIN

"""The end of an MPI check script: every rank's failures gathered to rank 0 and printed, one verdict line, and an
exit status of 1 on every rank when anything failed (so mpiexec, and the test that ran it, see it)."""

from __future__ import annotations

import sys


def finish(comm, name: str, count: int, failures: list) -> None:
    """Report ``failures`` (lines) and ``count`` (checks made) of every rank of ``comm`` as ``name``; exit 1 if any."""
    everything = comm.gather(failures, root=0)
    total = comm.reduce(count, root=0)
    nfail = comm.bcast(sum(len(f) for f in everything) if comm.Get_rank() == 0 else None, root=0)
    if comm.Get_rank() == 0:
        for rank_failures in everything:
            for line in rank_failures[:50]:
                print("FAIL", line)
        print(f"{name} p={comm.Get_size()}: {total} checks, {nfail} failures", flush=True)
    comm.Barrier()
    if nfail:
        sys.exit(1)

"""Run on a dtrain cluster of 2 nodes x 2 ranks with a shaped link (tests/test_cluster.py): the link slows an
all-reduce between the nodes as its rate says, and leaves one inside a node alone.

    dtrain launch -n 4 --hostfile HOSTFILE tests/mpi_scripts/check_cluster_link.py RATE_BITS_S [MIB]

The oracle is arithmetic: an all-reduce of n bytes between two ranks must move at least n/2 bytes each way across the
link (a bandwidth-optimal one moves n), so it cannot take less than (n/2)·8/RATE; inside a node the bytes never touch
the link, so there it must take far less than n·8/RATE.
"""

import sys
import time

import numpy as np
from mpi4py import MPI
from report import finish

comm = MPI.COMM_WORLD
rate = float(sys.argv[1])
mib = float(sys.argv[2]) if len(sys.argv) > 2 else 16
nbytes = int(mib * (1 << 20))
failures, checks = [], 0
node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
across = comm.Split(node.Get_rank(), key=comm.Get_rank())  # rank 0 of each node together, rank 1 of each together
if node.Get_size() != 2 or across.Get_size() != 2:
    failures.append(f"rank {comm.Get_rank()}: node of {node.Get_size()}, across of {across.Get_size()}: want 2 and 2")
buf = np.ones(nbytes // 4, np.float32)


def timed(group, active: bool, data=buf) -> float:
    comm.Barrier()
    start = time.perf_counter()
    if active:
        group.Allreduce(MPI.IN_PLACE, data)
    seconds = time.perf_counter() - start
    comm.Barrier()
    return seconds


if not failures:
    timed(node, True, buf[:1024])  # (the first call of each sets up its connections)
    timed(across, node.Get_rank() == 0, buf[:1024])
    inside = timed(node, True)
    between = timed(across, node.Get_rank() == 0)  # the leaders alone: the link is theirs
    link_s = nbytes * 8 / rate
    slowest_between = comm.allreduce(between if node.Get_rank() == 0 else 0.0, op=MPI.MAX)
    checks += 1  # every rank: its node's all-reduce never touched the link
    if inside > 0.2 * slowest_between:
        failures.append(f"rank {comm.Get_rank()}: inside a node {inside:.3f} s > a fifth of between nodes "
                        f"({slowest_between:.3f} s)")  # fmt: skip
    if node.Get_rank() == 0:  # the leaders: the link held them to its rate
        checks += 1
        if between < 0.5 * link_s:
            failures.append(f"rank {comm.Get_rank()}: between nodes {between:.3f} s < (n/2)·8/rate = "
                            f"{0.5 * link_s:.3f} s")  # fmt: skip
    if comm.Get_rank() == 0:
        print(f"{mib:g} MiB all-reduce: inside a node {inside * 1e3:.1f} ms, between nodes "
              f"{slowest_between * 1e3:.1f} ms (n·8/rate = {link_s * 1e3:.0f} ms)", flush=True)  # fmt: skip
finish(comm, "check_cluster_link", checks, failures)

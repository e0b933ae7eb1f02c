"""``dtrain launch -n 8 --hostfile h -m dtrain.launch.where``: where did every rank land?

The first thing to run on a new cluster, before any training: it prints one line per rank (its machine, its place
among the ranks that share that machine's memory, its process, the cores it may run on) and one line per machine.
Two views of "the same machine" are shown side by side, because they can differ:

* **mpiexec's**: the local rank and count the process manager put in the environment (MPICH's ``MPI_LOCALRANKID`` /
  ``MPI_LOCALNRANKS``, Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK`` / ``_LOCAL_SIZE``): ranks it started together;
* **MPI's**: ``comm.Split_type(COMM_TYPE_SHARED)``, the ranks that really share memory. This is what the
  hierarchical all-reduce builds its nodes from (:mod:`dtrain.collectives.hierarchical`).

A machine is named as the launcher names it: ``MPI_Get_processor_name``, which is the host's name. On a cluster made
by ``dtrain cluster up`` (:mod:`dtrain.launch.cluster`) every node is a namespace of this one machine, and each is given
a hostname namespace of its own under the node's name in the hostfile (``dtrain-n1``), so the ranks there say that
name, not this machine's (which every namespace would otherwise share).

A hostfile that names one machine twice (``localhost`` and its hostname) makes two groups for mpiexec and one for
MPI. More ranks on a machine than cores it gives them is said too: it works, but each rank gets a share of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from dtrain import terminal
from dtrain.comm import mpi, ranks_on_this_node
from dtrain.comm.names import COMM_TYPE_SHARED

LOCAL_RANK = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")  # and srun's, read by ranks_on_this_node


def _env_int(names) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _spans(numbers) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    numbers, out = sorted(numbers), []
    for n in numbers:
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def this_rank(comm) -> dict:
    """What this rank knows of where it is (a collective call: every rank of ``comm`` calls it)."""
    from mpi4py import MPI

    node = comm.Split_type(COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return {
            "rank": comm.Get_rank(),
            "host": MPI.Get_processor_name(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "node_rank": node.Get_rank(),
            "node_size": node.Get_size(),
            "node_leader": node.bcast(comm.Get_rank(), root=0),  # names the node: its first rank in comm
            "mpiexec_local_rank": _env_int(LOCAL_RANK),
            "mpiexec_local_size": _env_int(LOCAL_SIZE)
            or (ranks_on_this_node() if _env_int(LOCAL_RANK) is not None else None),
            "cores": _cores(),
        }
    finally:
        node.Free()


def report(ranks: list[dict], library: str) -> str:
    """The table rank 0 prints: one line per rank, then one per machine."""
    machines: dict[str, list[dict]] = {}
    for r in ranks:
        machines.setdefault(r["host"], []).append(r)
    rows = []
    for r in ranks:
        local = "-" if r["mpiexec_local_rank"] is None else f"{r['mpiexec_local_rank']}/{r['mpiexec_local_size']}"
        rows.append([str(r["rank"]), r["host"], f"{r['node_rank']}/{r['node_size']}", local, str(r["pid"]),
                     _spans(r["cores"])])  # fmt: skip
    header = ["rank", "machine", "MPI: rank/size on it", "mpiexec: local rank", "pid", "cores"]
    lines = [f"{len(ranks)} ranks on {len(machines)} machine{'s' if len(machines) > 1 else ''}; MPI: {library}", "",
             terminal.table(header, rows, left=(1, 5))]  # fmt: skip
    lines.append("")
    for host, here in machines.items():
        cores = set().union(*(set(r["cores"]) for r in here))
        crowded = f" ({len(here) / len(cores):.1f} ranks a core)" if len(here) > len(cores) else ""
        nodes: dict[int, list[int]] = {}
        for r in here:
            nodes.setdefault(r["node_leader"], []).append(r["rank"])
        shared = " | ".join(_spans(members) for members in nodes.values())
        lines.append(f"{host}: ranks {_spans(r['rank'] for r in here)} on cores {_spans(cores)}{crowded}")
        lines.append(f"  sharing memory (MPI's nodes): {shared}")
        if len(nodes) > 1:
            lines.append(
                terminal.paragraph(
                    f"note: MPI sees {len(nodes)} nodes on the one machine {host} (its process manager was given it "
                    f"under {len(nodes)} names, or its ranks were split); the hierarchical all-reduce takes them as "
                    f"{len(nodes)} nodes",
                    indent="  ",
                    hanging="    ",
                )
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dtrain.launch.where", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json", metavar="FILE", help="also write every rank's record to FILE (-: to stdout, the report to stderr)"
    )
    args = parser.parse_args(argv)
    from mpi4py import MPI

    comm = mpi.world()
    ranks = comm.gather(this_rank(comm), root=0)
    if comm.Get_rank() == 0:
        library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
        print(report(ranks, library), file=terminal.human(args.json), flush=True)
        if args.json:
            terminal.write_output(args.json, json.dumps({"library": library, "ranks": ranks}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

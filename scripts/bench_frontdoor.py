"""Where the microseconds of a small all-reduce go: the front door, the algorithm's Python, mpi4py, MPI, the kernel.

    python scripts/bench_frontdoor.py                 # p = 2 under mpiexec, 4 KiB, the algorithm "auto" picks there
    python scripts/bench_frontdoor.py --ranks 1       # one rank: no messages, the front door's cost alone
    PYTHONPATH=/other/checkout python scripts/bench_frontdoor.py      # the same for another version of dtrain

**Calls.** The same all-reduce made several ways, interleaved round by round (median over rounds of the slowest
rank's time per call):

    mpi                comm.Allreduce(IN_PLACE, buf): MPI's own, none of dtrain's Python
    exchange + add     comm.Sendrecv + np.add: the least a p = 2 all-reduce written in Python can do (p = 2 only)
    algorithm          e.g. doubling.allreduce(comm, buf, "sum"): the algorithm function called directly
    front door         collectives.allreduce(comm, buf, algorithm=<the same one>)
    front door, auto   collectives.allreduce(comm, buf): the cost model picks (the choice is printed)

front door - algorithm is what the front door costs per call; algorithm - (exchange + add) is the algorithm's own
Python; exchange + add - mpi is what MPI gains by doing the whole thing in C.

**Steps.** Each piece that one of those calls runs, timed alone in a tight loop on every rank at once (no
communication; best of 5 runs): the argument checks, the debug-mode test, the per-communicator call number, the
auto choice, the tracer lookup, the watchdog's begin/end, flattening the buffer, the reduction kernel as the
algorithms call it (``kernels.reduce_``) against a bare ``np.add``, the scratch lookup, and mpi4py's own call
overhead (a ``Sendrecv`` to ``PROC_NULL``: argument parsing and MPI's bookkeeping, no message). A step that this
version of dtrain does not have prints "-". Which steps the front door runs on every call is the code's business:
docs/benchmarks.md puts the two together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np
from bench_util import add_worker_flags

from dtrain import terminal


def call_kinds(comm, buf, other, algorithm, p):
    """name -> a function making one all-reduce of ``buf`` (``other``: a scratch array for the bare exchange)."""
    from mpi4py import MPI

    from dtrain import collectives
    from dtrain.collectives import doubling, ring, tree

    direct = {  # the functions "auto" picks from (costmodel.CANDIDATES), by name
        "doubling": doubling.allreduce,
        "rabenseifner": doubling.rabenseifner,
        "ring": ring.allreduce,
        "tree": tree.allreduce,
    }
    kinds = {"mpi": lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)}
    if p == 2:
        peer = 1 - comm.Get_rank()

        def exchange_and_add():
            comm.Sendrecv(buf, dest=peer, recvbuf=other, source=peer)
            np.add(buf, other, out=buf)

        kinds["exchange + add"] = exchange_and_add
    kinds["algorithm"] = lambda: direct[algorithm](comm, buf, "sum")
    kinds["front door"] = lambda: collectives.allreduce(comm, buf, algorithm=algorithm)
    kinds["front door, auto"] = lambda: collectives.allreduce(comm, buf)
    return kinds


def time_calls(comm, kinds, buf, rounds, reps):
    """name -> median over rounds of the slowest rank's seconds per call."""
    from mpi4py import MPI

    times = {name: [] for name in kinds}
    for fn in kinds.values():  # warm-up: first-call costs
        fn()
    for _ in range(rounds):
        for name, fn in kinds.items():
            buf[...] = 0.0  # zeros stay zeros: no overflow however often the buffer is summed
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            elapsed = (time.perf_counter() - t0) / reps
            times[name].append(comm.allreduce(elapsed, op=MPI.MAX))
    return {name: statistics.median(t) for name, t in times.items()}


def steps(comm, buf, other, p):
    """label -> a function doing one piece of the work, or None when this version of dtrain has no such piece."""
    from mpi4py import MPI

    from dtrain import kernels
    from dtrain.collectives import _checks, _chunks, costmodel

    try:
        from dtrain.comm import watchdog
    except ImportError:
        watchdog = None

    def watch():
        watchdog.end(watchdog.begin(comm, "allreduce/doubling"))

    def checks():
        _checks.check_buffer(buf)
        _checks.check_choice("op", "sum", ("sum", "avg", "max"))
        _checks.check_choice("algorithm", "ring", ("auto", "ring", "tree"))

    return {
        "argument checks (buffer, op, algorithm)": checks,
        "debug-mode test (debug_enabled)": _checks.debug_enabled,
        "call number (next_sequence)": lambda: _checks.next_sequence(comm),
        "auto choice (costmodel.choose)": lambda: costmodel.choose(buf.nbytes, p),
        "tracer lookup (getattr)": lambda: getattr(comm, "tracer", None),
        "watchdog begin + end": watch if watchdog is not None and hasattr(watchdog, "begin") else None,
        "flatten (buf.reshape(-1))": lambda: buf.reshape(-1),
        "scratch buffer lookup": lambda: _chunks.scratch(buf, buf.size),
        "reduction kernel (kernels.reduce_)": lambda: kernels.reduce_(buf, other, "sum"),
        "  of which np.add itself": lambda: np.add(buf, other, out=buf),
        "mpi4py call (Sendrecv to PROC_NULL)": lambda: comm.Sendrecv(
            buf, dest=MPI.PROC_NULL, recvbuf=other, source=MPI.PROC_NULL
        ),
    }


def time_steps(comm, table, number=20000):
    """label -> best of 5 timings, seconds per call, on this rank (None where the step does not exist)."""
    comm.Barrier()
    result = {}
    for label, fn in table.items():
        if fn is None:
            result[label] = None
            continue
        fn()
        result[label] = min(timeit.repeat(fn, number=number, repeat=5)) / number
    return result


def run_ranks(args) -> None:
    from mpi4py import MPI

    from dtrain.collectives import costmodel

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    buf = np.zeros(args.bytes // 4, np.float32)
    other = np.zeros_like(buf)
    algorithm = costmodel.choose(buf.nbytes, p)
    calls = time_calls(comm, call_kinds(comm, buf, other, algorithm, p), buf, args.rounds, args.reps)
    parts = time_steps(comm, steps(comm, buf, other, p))
    if comm.Get_rank() == 0:
        import dtrain

        where = str(Path(dtrain.__file__).resolve().parents[1])
        result = {"p": p, "bytes": args.bytes, "algorithm": algorithm, "dtrain": where, "calls": calls, "steps": parts}
        Path(args.result).write_text(json.dumps(result))


def report(result, width="auto") -> str:
    """The result as text fitted to ``width`` (:mod:`dtrain.terminal`): the calls, then the steps."""
    calls, parts = result["calls"], result["steps"]

    def us(seconds, digits=2) -> str:
        return "-" if seconds is None else f"{seconds * 1e6:.{digits}f}"

    rows = [[name, us(seconds)] for name, seconds in calls.items()]
    rows.append(["= front door - algorithm", us(calls["front door"] - calls["algorithm"])])
    if "exchange + add" in calls:
        rows.append(["= algorithm - (exchange + add)", us(calls["algorithm"] - calls["exchange + add"])])
    steps = [[label, us(seconds, 3)] for label, seconds in parts.items()]
    return "\n".join([
        terminal.paragraph(f"## {result['bytes']} B all-reduce on p = {result['p']}, dtrain from {result['dtrain']}",
                           hanging="   ", width=width),
        terminal.paragraph(f"auto picks {result['algorithm']!r}; 'algorithm' and 'front door' below run that one",
                           width=width), "",
        terminal.table(["call", "us per call"], rows, width=width), "",
        terminal.table(["step (alone, no communication)", "us per call"], steps, width=width),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=4096, help="message size (default %(default)s: 4 KiB)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=2000, help="calls per timed round")
    parser.add_argument("--json", help="also write the numbers here")
    add_worker_flags(parser)
    args = parser.parse_args()
    if args.worker:
        run_ranks(args)
        return

    from dtrain.launch import launcher

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        forwarded = [a for a in sys.argv[1:] if a != "--worker"]
        rc = launcher.launch(args.ranks, [__file__, *forwarded, "--worker", "--result", str(out)]).returncode
        if rc != 0:
            raise SystemExit(f"benchmark on {args.ranks} ranks failed (exit {rc})")
        result = json.loads(out.read_text())
    print("\n" + report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Every hand-written all-reduce against MPI's own ``Allreduce``, in the same run, with nccl-tests' bandwidths.

    python scripts/bench_allreduce.py                       # p = 2 and 4, 4 KiB .. 64 MiB, writes docs/bench/
    python scripts/bench_allreduce.py --ranks 4 --max-size 4MiB --rounds 9   # quicker (9 rounds is the least)
    python scripts/bench_allreduce.py --repeat 3       # 3 separate jobs per p: median and range of each ratio
    python scripts/bench_allreduce.py --ranks 2 --max-size 64KiB --watchdog 300   # armed vs unarmed, interleaved
    python scripts/bench_allreduce.py --algorithms mpi,ring,shm,shm-copyin,hierarchical_shm --min-size 1MiB \
        --stat best --out docs/bench/shm                    # shared memory inside a node, best of the rounds

The script launches itself under ``mpiexec`` once per rank count (through dtrain's launcher: one thread per rank,
yielding waits when oversubscribed), then prints p's tables (fitted to the terminal), writes a JSON file and a PNG of
bus bandwidth against message size.

Definitions (NVIDIA nccl-tests, doc/PERFORMANCE.md):

* ``algbw = S / t`` for a buffer of S bytes all-reduced in t seconds (t: the slowest rank's time);
* ``busbw = algbw * 2(p-1)/p``: an all-reduce must move at least 2(p-1)/p * S bytes through each rank's link
  (reduce-scatter then all-gather), so busbw is comparable across p and with a link's peak bandwidth.

The speed against MPI is MPI's time over the algorithm's, in words ("1.50x faster", "1.16x slower"; ``ratio_vs_mpi``
in the JSON). ``mpi`` is ``comm.Allreduce(MPI.IN_PLACE, buf)`` called directly, so every other algorithm pays all of
dtrain's Python (argument checks, dispatch, the algorithm's own loop) and MPI pays none of it. The model's time is the
cost model's predicted time for that algorithm (alpha-beta-gamma, from ``dtrain/collectives/costmodel.py``), shown
over the measured time. Algorithms and MPI are interleaved within each round, and each result is the median over
rounds (``--stat best``: the fastest round), so machine noise hits all alike.

The shared-memory all-reduces (:mod:`dtrain.collectives.shm`) are measured on the buffer a caller would give them:
``shm`` and ``hierarchical_shm`` on one from ``shm.buffer`` (a window on the world, or on the topology's node: zero
copy, as ddp's flat gradients), ``shm-copyin`` and ``hierarchical_shm-copyin`` on an ordinary NumPy array (copied into
a scratch window and back out on every call). Every other row, MPI's included, gets an ordinary array.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_util import add_worker_flags, faster, faster_range, run_meta, write_results

from dtrain import terminal

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
# The rows that are not plain algorithm names: (the algorithm, the buffer it gets). "window": shm.buffer on the world;
# "node": shm.buffer on the topology's node (zero copy for hierarchical_shm); "plain": an ordinary NumPy array.
VARIANTS = {
    "shm": ("shm", "window"),
    "shm-copyin": ("shm", "plain"),
    "hierarchical_shm": ("hierarchical_shm", "node"),
    "hierarchical_shm-copyin": ("hierarchical_shm", "plain"),
}
DEFAULT_ALGORITHMS = "mpi,ring,tree,naive,doubling,rabenseifner,hierarchical,auto,shm,shm-copyin,hierarchical_shm"


def variant(label: str) -> tuple[str, str]:
    """A row's (algorithm, buffer): "shm-copyin" -> ("shm", "plain"); "ring+watchdog" -> ("ring", "plain")."""
    name = label.removesuffix("+watchdog")
    return VARIANTS.get(name, (name, "plain"))


def model_time(label, size, p, machine, ranks_per_node):
    """The cost model's time for a row (None where it has none): the copy-in rows add their copies (shm.py)."""
    from dtrain.collectives import costmodel, shm

    algorithm, place = variant(label)
    try:
        if algorithm == "shm" and place == "plain":
            return shm.predict_time("allreduce", size, p, machine, copy_in=True)
        if algorithm == "hierarchical_shm" and place == "plain":
            return None  # (the model prices the zero-copy path)
        return costmodel.predict_time(algorithm, size, p, machine, ranks_per_node=ranks_per_node)
    except (ValueError, KeyError):
        return None


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    low = text.strip().lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * factor)
    return int(low)


def human(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------------------- on every rank
def run_ranks(args) -> None:
    from mpi4py import MPI

    from dtrain.collectives import TABLE, allreduce, costmodel, hierarchical, shm
    from dtrain.comm import watchdog

    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    algorithms = args.algorithms.split(",")
    if args.watchdog:  # each algorithm again with the watchdog armed, interleaved with the unarmed runs
        algorithms += [f"{a}+watchdog" for a in algorithms if a != "mpi"]
    machine = costmodel.Machine.load(p=p)  # constants measured with p ranks busy, when calibrated
    sizes = [s for s in SIZES if parse_size(args.min_size) <= s <= parse_size(args.max_size)]
    # The nodes of the hierarchical algorithms, split once (a collective call) and handed to their calls only: the
    # other rows measure exactly what allreduce(comm, buf, algorithm=...) costs a caller.
    nodes = hierarchical.topology(comm, args.ranks_per_node)
    on_nodes = {name for name, entry in TABLE["allreduce"].items() if entry.nodes}
    options = {a: {"topology": nodes} if variant(a)[0] in on_nodes else {} for a in algorithms}
    places = {variant(a)[1] for a in algorithms}
    rows = []
    for size in sizes:
        count = size // 4
        src = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        buffers = {"plain": np.empty_like(src)}  # the shared ones: every rank allocates them (collectives)
        if "window" in places:
            buffers["window"] = shm.buffer(comm, count, np.float32)
        if "node" in places:
            buffers["node"] = shm.buffer(nodes.node, count, np.float32)
        # fewer rounds for big messages keeps the whole run to minutes; never fewer than 9
        rounds = max(9, min(args.rounds, int(args.rounds * (1 << 20) / max(size, 1 << 20))))
        times = {a: [] for a in algorithms}

        def run(alg, buffers=buffers):
            algorithm, place = variant(alg)
            if alg == "mpi":  # the baseline: MPI's own collective, called directly (none of dtrain's Python)
                comm.Allreduce(MPI.IN_PLACE, buffers[place], op=MPI.SUM)
            else:
                allreduce(comm, buffers[place], op="sum", algorithm=algorithm, **options[alg])

        for alg in algorithms:  # warm-up: first-call costs (Numba compilation, sub-communicators, scratch windows)
            buffers[variant(alg)[1]][...] = src
            run(alg)
        for _ in range(rounds):
            for alg in algorithms:
                reps = max(1, min(50, (256 << 10) // size))  # repeat tiny messages to beat timer resolution
                buffers[variant(alg)[1]][...] = src
                watchdog.configure(args.watchdog if alg.endswith("+watchdog") else 0)  # outside the timed part
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    run(alg)
                elapsed = (time.perf_counter() - t0) / reps
                times[alg].append(comm.allreduce(elapsed, op=MPI.MAX))
        shm.release(comm)  # the windows of this size: zero copy's, and the copy-in path's scratch
        shm.release(nodes.node)
        stat = min if args.stat == "best" else statistics.median
        mpi_time = stat(times["mpi"]) if "mpi" in times else None
        for alg in algorithms:
            t = stat(times[alg])
            algbw = size / t
            rows.append(
                {
                    "p": p,
                    "bytes": size,
                    "algorithm": alg,
                    "time_s": t,
                    "median_s": statistics.median(times[alg]),
                    "best_s": min(times[alg]),
                    "rounds": len(times[alg]),
                    "algbw_GBps": algbw / 1e9,
                    "busbw_GBps": algbw * 2 * (p - 1) / p / 1e9,
                    "ratio_vs_mpi": (mpi_time / t) if mpi_time else None,
                    "model_time_s": model_time(alg, size, p, machine, args.ranks_per_node),
                }
            )
    nodes.free()
    if rank == 0:
        Path(args.result).write_text(json.dumps(rows))


# ------------------------------------------------------------------------------------------- the driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default %(default)s)")
    parser.add_argument(
        "--algorithms",
        default=DEFAULT_ALGORITHMS,
        help="comma-separated rows: dtrain's all-reduce algorithms, mpi (MPI's own Allreduce), and shm-copyin and "
        "hierarchical_shm-copyin (shm and hierarchical_shm on an ordinary array; without -copyin they get a buffer "
        "from shm.buffer, zero copy). Default: %(default)s",
    )
    parser.add_argument("--ranks-per-node", type=int, default=2, help="emulated node size for hierarchical")
    parser.add_argument(
        "--stat",
        choices=("median", "best"),
        default="median",
        help="each row's time over the rounds: their median, or the fastest (best of the alternating rounds)",
    )
    parser.add_argument("--min-size", default="4KiB")
    parser.add_argument("--max-size", default="64MiB")
    parser.add_argument(
        "--rounds", type=int, default=15, help="timed rounds for messages <= 1 MiB (fewer above, never below 9)"
    )
    parser.add_argument(
        "--watchdog",
        type=float,
        default=0,
        metavar="S",
        help="also time every algorithm with the watchdog armed (timeout S), interleaved with the unarmed runs",
    )
    parser.add_argument("--repeat", type=int, default=1, help="whole sweeps per p, as separate jobs (default 1)")
    parser.add_argument("--out", default="docs/bench", help="folder for allreduce.json and allreduce_busbw.png")
    add_worker_flags(parser)
    args = parser.parse_args()
    if args.worker:
        run_ranks(args)
        return

    from dtrain.collectives import ALGORITHMS
    from dtrain.launch import launcher

    rows_known = ("mpi", *ALGORITHMS, *VARIANTS)
    unknown = set(args.algorithms.split(",")) - set(rows_known)
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {sorted(unknown)}: choose from {', '.join(dict.fromkeys(rows_known))}")
    all_rows = []
    for p in [int(v) for v in args.ranks.split(",")]:
        for run in range(args.repeat):  # separate jobs: run-to-run variation on a shared machine shows in the range
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "rows.json"
                forwarded = [a for a in sys.argv[1:] if a != "--worker"]
                rc = launcher.launch(p, [__file__, *forwarded, "--worker", "--result", str(result)]).returncode
                if rc != 0:
                    raise SystemExit(f"benchmark on {p} ranks failed (exit {rc})")
                all_rows += [{**row, "run": run} for row in json.loads(result.read_text())]
        print_table([r for r in all_rows if r["p"] == p], p, args.repeat, args.stat)
    out = Path(args.out)
    text = "\n\n".join(table([r for r in all_rows if r["p"] == p], p, args.repeat, args.stat, width=None)
                       for p in dict.fromkeys(r["p"] for r in all_rows))  # fmt: skip
    meta = run_meta(repeat=args.repeat, stat=args.stat)
    write_results(out, "allreduce", {"meta": meta, "rows": all_rows}, text=f"{meta['command']}\n\n{text}")
    plot(median_rows(all_rows), out / "allreduce_busbw.png")
    print(f"wrote {out / 'allreduce_busbw.png'}")


def median_rows(rows) -> list[dict]:
    """One row per (p, size, algorithm): the median over runs of time and bandwidths, with the ratio's range."""
    groups = {}
    for r in rows:
        groups.setdefault((r["p"], r["bytes"], r["algorithm"]), []).append(r)
    merged = []
    for (p, size, alg), group in groups.items():
        ratios = [g["ratio_vs_mpi"] for g in group if g["ratio_vs_mpi"]]
        row = {
            "p": p,
            "bytes": size,
            "algorithm": alg,
            "runs": len(group),
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
        }
        for key in ("time_s", "algbw_GBps", "busbw_GBps", "ratio_vs_mpi", "model_time_s"):
            values = [g[key] for g in group if g.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        merged.append(row)
    return merged


def print_table(rows, p, repeat, stat="median") -> None:
    print("\n" + table(rows, p, repeat, stat))


def table(rows, p, repeat, stat="median", width="auto") -> str:
    """p's results fitted to ``width`` (:mod:`dtrain.terminal`): a table each of the bus bandwidth, the speed
    against MPI's own Allreduce (and its range over the runs), and the cost model's time over the measured one; a
    row per message size, a column per algorithm. ``stat``: what a run's time is (the rounds' median, or best)."""
    rows = median_rows(rows)
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    sizes = sorted({r["bytes"] for r in rows})
    at = {(r["bytes"], r["algorithm"]): r for r in rows}
    theirs = [a for a in algorithms if a != "mpi"]
    runs = ", best of each run's rounds" if stat == "best" else ""
    runs += f", the median of {repeat} runs" if repeat > 1 else ""
    parts = [("bus bandwidth, GB/s" + runs, algorithms, lambda r: f"{r['busbw_GBps']:.2f}"),
             ("speed against MPI's own Allreduce in the same run (MPI's time over the algorithm's)" + runs, theirs,
              lambda r: faster(r["ratio_vs_mpi"]))]  # fmt: skip
    if repeat > 1:
        parts.append((f"the range of that speed over the {repeat} runs", theirs,
                      lambda r: faster_range(r["ratio_min"], r["ratio_max"])))  # fmt: skip
    parts.append(("the cost model's time over the measured time" + runs, algorithms,
                  lambda r: f"{r['model_time_s'] / r['time_s']:.1f}" if r["model_time_s"] else "-"))  # fmt: skip
    out = [f"## p = {p}"]
    for title, columns, cell in parts:
        cells = [[human(size), *(cell(at[size, a]) for a in columns)] for size in sizes]
        out += ["", terminal.paragraph(title, width=width),
                terminal.table(["size", *columns], cells, left=(), width=width)]  # fmt: skip
    return "\n".join(out)


def plot(rows, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(6 * len(ps), 4.2), squeeze=False)
    for ax, p in zip(axes[0], ps):
        for alg in dict.fromkeys(r["algorithm"] for r in rows):
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["p"] == p and r["algorithm"] == alg)
            style = {"color": "black", "linewidth": 2.5} if alg == "mpi" else {}
            ax.plot([s for s, _ in pts], [b for _, b in pts], marker="o", markersize=3, label=alg, **style)
        ax.set(
            xscale="log",
            xlabel="message size (bytes)",
            ylabel="bus bandwidth (GB/s)",
            title=f"all-reduce, p = {p} (MPI in black)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()

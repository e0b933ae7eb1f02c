"""Fit the cost model's machine constants on this machine: alpha (latency), beta (time per byte), gamma (reduce).

    python scripts/calibrate.py                  # writes dtrain/collectives/calibration.json
    python scripts/calibrate.py --ranks 2,4      # rank counts to measure under load (default 2,3,4,8)
    python scripts/calibrate.py --dry-run        # only print the fit

The alpha-beta model says sending n bytes takes ``alpha + beta * n``. Two ranks play ping-pong: rank 0 sends n
bytes, rank 1 sends them back; half the round trip is one message. A least-squares fit over sizes from 8 B to
16 MiB, weighted by 1/t so small and large messages count equally (relative error), gives alpha and beta.
gamma is the time per byte to reduce (``dst += src``) with the active kernel, measured on one rank.

Those are the constants of an idle machine. An all-reduce keeps *every* rank busy, so for each rank count p the
script also measures a ring step with all p ranks at once (each sends n bytes right and receives n from the left,
``Sendrecv``; the slowest rank counts) and the reduction with all p ranks reducing at once, and fits alpha, beta and
gamma for that p. With more ranks than cores these are the numbers that predict what an algorithm will take.

All three are *this machine's* numbers: two processes on one host talk through shared memory, so beta here is a
memory-copy rate, not a network's. On a cluster, run it across two nodes for the inter-node constants.
"""

from __future__ import annotations

import os

from dtrain.comm.launcher import THREAD_VARIABLES

for _name in THREAD_VARIABLES:  # before NumPy and Numba load: gamma below is measured on one thread, as a rank runs
    os.environ.setdefault(_name, "1")

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
OUTPUT = Path(__file__).resolve().parents[1] / "dtrain" / "collectives" / "calibration.json"


def pingpong(comm, nbytes: int, reps: int) -> float:
    """Median one-way time of an ``nbytes`` message between ranks 0 and 1."""
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    rank, samples = comm.Get_rank(), []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        samples.append((time.perf_counter() - t0) / 2)
    return statistics.median(samples)


def reduce_time_per_byte(nbytes: int = 16 << 20, reps: int = 20) -> float:
    from dtrain import kernels

    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    kernels.add_(a, b)  # compile / warm up
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        kernels.add_(a, b)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) / nbytes


def fit(sizes, times) -> tuple[float, float]:
    """Weighted least squares for t = alpha + beta * n (weights 1/t: relative errors)."""
    n, t = np.asarray(sizes, float), np.asarray(times, float)
    w = 1.0 / t
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def ring_step(comm, nbytes: int, reps: int) -> float:
    """Median time, on the slowest rank, of one ring step: all ranks send ``nbytes`` right, receive from the left."""
    from mpi4py import MPI

    from dtrain.comm import sendrecv

    p, r = comm.Get_size(), comm.Get_rank()
    send = np.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    recv = np.empty_like(send)
    samples = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        sendrecv(comm, send, (r + 1) % p, recv, (r - 1) % p)  # as the algorithms exchange (polling if oversubscribed)
        samples.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(samples)


def loaded_reduce_time_per_byte(comm, nbytes: int = 16 << 20, reps: int = 10) -> float:
    """Time per byte of ``kernels.add_`` with every rank reducing at the same moment (slowest rank)."""
    from mpi4py import MPI

    from dtrain import kernels

    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    kernels.add_(a, b)
    samples = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        kernels.add_(a, b)
        samples.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(samples) / nbytes


def reps_for(nbytes: int) -> int:
    return max(5, min(200, (64 << 20) // max(nbytes, 1 << 16)))


def worker(result_path: str, mode: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if mode == "pingpong":
        result = [pingpong(comm, n, reps_for(n)) for n in SIZES]
    else:
        result = {
            "seconds": [ring_step(comm, n, reps_for(n)) for n in SIZES],
            "gamma": loaded_reduce_time_per_byte(comm),
        }
    if comm.Get_rank() == 0:
        Path(result_path).write_text(json.dumps(result))


def measure(nranks: int, mode: str):
    from dtrain.comm import launcher

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        rc = launcher.launch(nranks, [__file__, "--worker", str(result), "--mode", mode]).returncode
        if rc != 0:
            raise SystemExit(f"{mode} on {nranks} ranks failed (exit {rc})")
        return json.loads(result.read_text())


def print_fit(title, times, alpha, beta) -> None:
    print(f"\n{title}\n{'bytes':>10s} {'measured':>12s} {'fit':>12s}")
    for n, t in zip(SIZES, times):
        print(f"{n:10d} {t * 1e6:10.2f}us {(alpha + beta * n) * 1e6:10.2f}us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,3,4,8", help="rank counts to measure under load (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    parser.add_argument("--worker", metavar="RESULT", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="pingpong", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mode)
        return

    from dtrain import kernels

    times = measure(2, "pingpong")
    alpha, beta = fit(SIZES, times)
    gamma = reduce_time_per_byte()
    print_fit("ping-pong, 2 ranks, idle machine", times, alpha, beta)
    summary = [("idle pair", alpha, beta, gamma)]
    by_ranks = {}
    for p in [int(v) for v in args.ranks.split(",")]:
        loaded = measure(p, "ring")
        a, b = fit(SIZES, loaded["seconds"])
        by_ranks[str(p)] = {"alpha": a, "beta": b, "gamma": loaded["gamma"], "seconds": loaded["seconds"]}
        print_fit(f"ring step, all {p} ranks at once", loaded["seconds"], a, b)
        summary.append((f"{p} ranks busy", a, b, loaded["gamma"]))
    print(f"\n{'':14s} {'alpha':>10s} {'beta':>16s} {'gamma':>16s}   ({kernels.backend_name()} kernels)")
    for name, a, b, g in summary:
        bandwidth = 1e-9 / b if b else float("inf")  # the fit clamps a negative beta to 0
        print(f"{name:14s} {a * 1e6:8.2f}us {b * 1e9:7.4f} ns/B {bandwidth:5.1f}GB/s {g * 1e9:7.4f} ns/B")
    if args.dry_run:
        return
    calibration = {
        "alpha": alpha,
        "beta": beta,
        "gamma": gamma,
        "by_ranks": by_ranks,
        "pingpong": {"bytes": SIZES, "seconds": times},
        "kernels": kernels.backend_name(),
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%F"),
    }
    OUTPUT.write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    sys.exit(main())

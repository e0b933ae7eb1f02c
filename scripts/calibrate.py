"""Fit the cost model's machine constants on this machine: alpha (latency), beta (time per byte), gamma (reduce).

    python scripts/calibrate.py                  # writes dtrain/collectives/calibration.json
    python scripts/calibrate.py --dry-run        # only print the fit

The alpha-beta model says sending n bytes takes ``alpha + beta * n``. Two ranks play ping-pong: rank 0 sends n
bytes, rank 1 sends them back; half the round trip is one message. A least-squares fit over sizes from 8 B to
16 MiB, weighted by 1/t so small and large messages count equally (relative error), gives alpha and beta.
gamma is the time per byte to reduce (``dst += src``) with the active kernel, measured on one rank.

All three are *this machine's* numbers: two processes on one host talk through shared memory, so beta here is a
memory-copy rate, not a network's. On a cluster, run it across two nodes for the inter-node constants.
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


def worker(result_path: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times = [pingpong(comm, n, reps=max(5, min(200, (64 << 20) // max(n, 1 << 16)))) for n in SIZES]
    if comm.Get_rank() == 0:
        Path(result_path).write_text(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    parser.add_argument("--worker", metavar="RESULT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return

    from dtrain import kernels
    from dtrain.comm import mpi

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "pingpong.json"
        rc = mpi.launch(2, [__file__, "--worker", str(result)]).returncode
        if rc != 0:
            raise SystemExit(f"ping-pong on 2 ranks failed (exit {rc})")
        times = json.loads(result.read_text())
    alpha, beta = fit(SIZES, times)
    gamma = reduce_time_per_byte()
    print(f"{'bytes':>10s} {'measured':>12s} {'fit':>12s}")
    for n, t in zip(SIZES, times):
        print(f"{n:10d} {t * 1e6:10.2f}us {(alpha + beta * n) * 1e6:10.2f}us")
    print(
        f"alpha = {alpha * 1e6:.2f} us, beta = {beta * 1e9:.4f} ns/B ({1 / beta / 1e9:.2f} GB/s), "
        f"gamma = {gamma * 1e9:.4f} ns/B ({kernels.backend_name()} kernels)"
    )
    if args.dry_run:
        return
    calibration = {
        "alpha": alpha,
        "beta": beta,
        "gamma": gamma,
        "pingpong": {"bytes": SIZES, "seconds": times},
        "kernels": kernels.backend_name(),
        "command": "python scripts/calibrate.py",
        "date": time.strftime("%F"),
    }
    OUTPUT.write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    sys.exit(main())

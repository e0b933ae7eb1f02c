"""Fit the cost model's machine constants on this machine: alpha (latency), beta (time per byte), gamma (reduce).

    python scripts/calibrate.py                  # writes dtrain/collectives/calibration.json
    python scripts/calibrate.py --ranks 2,4      # rank counts to measure under load (default 2,3,4,8)
    python scripts/calibrate.py --dry-run        # only print the fit
    python scripts/calibrate.py --compute        # only the compute rates (dtrain plan's), keeping the links
    python scripts/calibrate.py --shm            # only shared memory's constants (fence, copy, shm_from_bytes)
    python scripts/calibrate.py --gpu preset.json   # on a GPU machine: a dtrain plan preset of it (see below)

The alpha-beta model says sending n bytes takes ``alpha + beta * n``. Two ranks play ping-pong: rank 0 sends n
bytes, rank 1 sends them back; half the round trip is one message. A least-squares fit over sizes from 8 B to
16 MiB, weighted by 1/t so small and large messages count equally (relative error), gives alpha and beta.
gamma is the time per byte to reduce (``dst += src``) with the active kernel, measured on one rank.

Those are the constants of an idle machine. An all-reduce keeps *every* rank busy, so for each rank count p the
script also measures a ring step with all p ranks at once (each sends n bytes right and receives n from the left,
``Sendrecv``; the slowest rank counts) and the reduction with all p ranks reducing at once, and fits alpha, beta and
gamma for that p. With more ranks than cores these are the numbers that predict what an algorithm will take.

Shared memory inside a node (:mod:`dtrain.collectives.shm`) has constants of its own, measured for each p with all
p ranks at once and written beside that p's alpha, beta and gamma:

* ``fence``: seconds per fence of the shared-memory collectives over the p ranks (``Win.Sync``, a barrier of
  counters in the window, ``Win.Sync``: ``shm_windows.fence``; the slowest rank's time per fence over a loop);
* ``copy``: seconds per byte that a rank copies out of another rank's segment of a window (16 MiB, every rank copying
  its right neighbour's at once; the slowest rank);
* ``shm_from_bytes``: where ``algorithm="auto"`` starts taking shm on a real node (:func:`costmodel.shm_threshold`):
  the smallest all-reduce size, of those measured (1 KiB to 64 MiB, x4), from which shm was faster than the
  algorithm :func:`costmodel.choose` picks for that size at *every* larger size measured, or null if it never was.
  shm is timed on its copy-in path (an ordinary NumPy array, copied into a scratch window and back out), because
  ``auto`` takes any buffer the caller has: a buffer already in a window (zero copy, also timed and kept under
  ``shm_allreduce``) only does better, so the threshold never sends ``auto`` to shm where shm is slower. Each size
  interleaves the contenders round by round (9 to 15 rounds) and compares their best rounds (the slowest rank's
  time; on a shared machine noise only ever adds time); the medians are kept beside them. The same size for zero
  copy is written as ``shm_zero_copy_from_bytes`` (for reading; the cost model does not use it).

``--shm`` measures these alone and adds them to calibration.json, keeping everything else in it (``choose`` then
picks with the constants already there, which are the ones ``auto`` uses).

The compute rates ``dtrain plan`` prices a step with (:mod:`dtrain.plan.hardware`: FLOP/s of the matrix products,
seconds
per layer and per step besides them, the update's memory bandwidth) are fitted to dtrain's own training steps on one
thread (:func:`dtrain.plan.hardware.measure_compute`) and written under ``"compute"``.

``--gpu FILE`` measures a machine with a GPU for ``dtrain plan --device gpu``, as a preset of dtrain/plan/hardware.json
(to paste there under a name): the compute rates of dtrain's steps on the GPU (:data:`dtrain.plan.hardware.GPU_SHAPES`),
the ping-pong of GPU buffers between two ranks sharing the GPU, staged through pinned host memory as this MPI needs
(:class:`dtrain.comm.staging.StagedComm`), beside the same ping-pong of host buffers, and gamma of the GPU's
reduction kernel. calibration.json is not touched: it describes the machine the repository's CPU numbers come from.

All these are *this machine's* numbers: two processes on one host talk through shared memory, so beta here is a
memory-copy rate, not a network's. On a cluster, run it across two nodes for the inter-node constants.
"""

from __future__ import annotations

import os

# One thread, as a rank runs, set before NumPy and Numba load (importing anything of dtrain loads NumPy, whose BLAS
# reads these once): the compute rates and gamma below are one rank's.
ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
for _name in ONE_THREAD:
    os.environ.setdefault(_name, "1")

from dtrain.launch.mpiexec import THREAD_VARIABLES

assert set(ONE_THREAD) == set(THREAD_VARIABLES), "the launcher's thread variables changed: update ONE_THREAD"

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_util import faster

from dtrain import terminal

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
SHM_SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]  # all-reduces
COPY_BYTES = 16 << 20  # what each rank copies out of its neighbour's segment to time a copy
OUTPUT = Path(__file__).resolve().parents[1] / "dtrain" / "collectives" / "calibration.json"


def pingpong(comm, nbytes: int, reps: int, xp=np) -> float:
    """Median one-way time of an ``nbytes`` message between ranks 0 and 1 (``xp``: the buffer's array module)."""
    buf = xp.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
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


def fence_time(comm, reps: int = 50, batches: int = 7) -> float:
    """Seconds per fence of the shared-memory collectives (``shm_windows.fence``: Win.Sync, a barrier of counters in
    the window, Win.Sync) over all of ``comm``'s ranks: the median over ``batches`` of the slowest rank's time per
    fence in a loop of ``reps``."""
    from mpi4py import MPI

    from dtrain.collectives import shm_windows

    control = shm_windows.state(comm).control
    for _ in range(5):  # warm up
        shm_windows.fence(comm, (control,), "calibration")
    samples = []
    for _ in range(batches):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            shm_windows.fence(comm, (control,), "calibration")
        samples.append(comm.allreduce((time.perf_counter() - t0) / reps, op=MPI.MAX))
    shm_windows.release(comm)
    return statistics.median(samples)


def copy_time_per_byte(comm, nbytes: int = COPY_BYTES, reps: int = 10) -> float:
    """Seconds per byte of copying another rank's segment of a shared window into this rank's memory, every rank
    copying its right neighbour's at once (the slowest rank's time, median over ``reps``)."""
    from mpi4py import MPI

    from dtrain.comm import windows

    p, r = comm.Get_size(), comm.Get_rank()
    window = windows.allocate(comm, nbytes)
    window.segments[r][...] = r + 1  # (its pages touched by their owner, as a paradigm's buffer is)
    window.fence()
    src, dst = window.segments[(r + 1) % p], np.ones(nbytes, dtype=np.uint8)
    dst[...] = src  # warm up
    samples = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        dst[...] = src
        samples.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    window.fence()
    window.free()
    return statistics.median(samples) / nbytes


def shm_against_chosen(comm, machine, sizes=SHM_SIZES) -> list[dict]:
    """For each all-reduce size: the time (slowest rank; the best round, and the median) of the algorithm
    ``costmodel.choose`` picks with ``machine``, of shm on an ordinary array (copy-in) and of shm on a buffer in a
    window (zero copy), interleaved round by round."""
    from mpi4py import MPI

    from dtrain import collectives
    from dtrain.collectives import costmodel, shm

    p, r = comm.Get_size(), comm.Get_rank()
    measured = []
    for size in sizes:
        count = size // 4
        src = np.random.default_rng(r).standard_normal(count).astype(np.float32)
        plain, zero = np.empty_like(src), shm.buffer(comm, count, np.float32)
        chosen = costmodel.choose(size, p, machine)
        contenders = {"chosen": (chosen, plain), "shm_copyin": ("shm", plain), "shm_zero_copy": ("shm", zero)}
        # small ones repeated to beat the timer's resolution, never so often that p**reps overflows float32
        reps = max(1, min(50, (256 << 10) // size, 90 // (p - 1).bit_length()))
        rounds = max(9, min(15, int(15 * (1 << 20) / size)))
        times = {name: [] for name in contenders}
        for algorithm, buf in contenders.values():  # warm up (Numba, the scratch window, the caches)
            for _ in range(3):
                buf[...] = src
                collectives.allreduce(comm, buf, algorithm=algorithm)
        for _ in range(rounds):
            for name, (algorithm, buf) in contenders.items():
                buf[...] = src
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    collectives.allreduce(comm, buf, algorithm=algorithm)
                times[name].append(comm.allreduce((time.perf_counter() - t0) / reps, op=MPI.MAX))
        shm.release(comm)
        row = {"bytes": size, "chosen": chosen}
        for name, samples in times.items():
            row[f"{name}_s"], row[f"{name}_median_s"] = min(samples), statistics.median(samples)
        measured.append(row)
    return measured


def shm_from_bytes(measured: list[dict], key: str = "shm_copyin_s") -> int | None:
    """The smallest measured size from which shm (``key``'s path) was faster than the chosen algorithm at every
    larger measured size too; None if it was not faster at the largest."""
    threshold = None
    for row in sorted(measured, key=lambda row: row["bytes"], reverse=True):
        if row[key] >= row["chosen_s"]:
            break
        threshold = row["bytes"]
    return threshold


def shared_memory(comm, machine) -> dict:
    """The shared-memory constants for ``comm``'s ranks, all at once: fence, copy, and where shm starts to pay."""
    measured = shm_against_chosen(comm, machine)
    return {"fence": fence_time(comm), "copy": copy_time_per_byte(comm), "shm_from_bytes": shm_from_bytes(measured),
            "shm_zero_copy_from_bytes": shm_from_bytes(measured, "shm_zero_copy_s"),
            "shm_allreduce": measured}  # fmt: skip


LOAD_SHAPES = [((64, 256, 256, 256, 10), 24), ((784, 512, 512, 10), 64), ((64, 64, 64, 64, 10), 24)]


def dtrain_stack(comm, reps: int = 200) -> dict:
    """What dtrain plan needs beyond the links, measured with every rank of the node busy:

    ``alpha_dtrain``: seconds per message of dtrain's own all-reduce of a tiny buffer through the communicator a run
    uses (tracer, watchdog: :func:`dtrain.comm.prepare.prepare`), over its 2 (p-1) ring messages (the link's alpha
    is raw mpi4py's; this one adds dtrain's Python layers and the wait for a peer that shares a core);
    ``busy_step_s``: the slowest rank's time for dtrain's steps of :data:`LOAD_SHAPES` when every rank computes at
    once (ranks that share the cores and the memory bus), for the slowdown over one process alone (:func:`main`)."""
    from mpi4py import MPI

    from dtrain import collectives
    from dtrain.comm.prepare import prepare
    from dtrain.plan.hardware import step_seconds

    p = comm.Get_size()
    traced, buf, samples = prepare(comm.Dup(), events=False), np.zeros(2, dtype=np.float32), []
    for i in range(reps + 10):
        comm.Barrier()
        t0 = time.perf_counter()
        collectives.allreduce(traced, buf, algorithm="ring")
        if i >= 10:  # (the first ones warm up)
            samples.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    together = []
    for sizes, rows in LOAD_SHAPES:
        comm.Barrier()
        together.append(comm.allreduce(step_seconds(sizes, rows), op=MPI.MAX))
    return {"alpha_dtrain": statistics.median(samples) / max(2 * (p - 1), 1), "busy_step_s": together}


def reps_for(nbytes: int) -> int:
    return max(5, min(200, (64 << 20) // max(nbytes, 1 << 16)))


def gpu_reduce_time_per_byte(nbytes: int = 64 << 20, reps: int = 20) -> float:
    """Seconds per byte of ``kernels.add_`` on GPU arrays (CUDA events around ``reps`` calls)."""
    import cupy

    from dtrain import kernels

    a, b = cupy.ones(nbytes // 4, dtype=np.float32), cupy.ones(nbytes // 4, dtype=np.float32)
    kernels.add_(a, b)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        kernels.add_(a, b)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / reps / nbytes


def worker(result_path: str, mode: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if mode == "gpu":  # two ranks sharing the GPU: staged GPU buffers, then host buffers, the same sizes
        from dtrain import backend
        from dtrain.comm.staging import StagedComm

        gpu = backend.select_gpu(comm.Get_rank())
        staged = StagedComm(comm)
        import cupy

        result = {"staged": [pingpong(staged, n, reps_for(n), cupy) for n in SIZES],
                  "host": [pingpong(comm, n, reps_for(n)) for n in SIZES], "gpu": gpu,
                  "cuda_aware": staged.cuda_aware, "why": staged.cuda_aware_reason}  # fmt: skip
    elif mode == "pingpong":
        result = [pingpong(comm, n, reps_for(n)) for n in SIZES]
    elif mode == "shm":  # choose() picks with the constants calibration.json already holds (auto's)
        from dtrain.collectives import costmodel

        result = shared_memory(comm, costmodel.Machine.load(p=comm.Get_size()))
    else:
        from dtrain.collectives import costmodel

        seconds = [ring_step(comm, n, reps_for(n)) for n in SIZES]
        gamma = loaded_reduce_time_per_byte(comm)
        alpha, beta = fit(SIZES, seconds)  # (every rank has the same numbers: the slowest rank's)
        machine = costmodel.Machine(alpha=alpha, beta=beta, gamma=gamma)  # what choose() will pick with
        result = {"seconds": seconds, "gamma": gamma, **dtrain_stack(comm), **shared_memory(comm, machine)}
    if comm.Get_rank() == 0:
        Path(result_path).write_text(json.dumps(result))


def measure(nranks: int, mode: str):
    from dtrain.launch import launcher

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        rc = launcher.launch(nranks, [__file__, "--worker", str(result), "--mode", mode]).returncode
        if rc != 0:
            raise SystemExit(f"{mode} on {nranks} ranks failed (exit {rc})")
        return json.loads(result.read_text())


def print_shared_memory(p: int, found: dict) -> None:
    """p's shared-memory constants and the all-reduces the threshold was read from (a table fitted to the
    terminal)."""

    def where(threshold):
        return "at no size up to the largest" if threshold is None else f"from {threshold} bytes up"

    print()
    print(terminal.paragraph(f"shared memory, all {p} ranks at once: {found['fence'] * 1e6:.1f} us per fence, copies "
                             f"at {1e-9 / found['copy']:.1f} GB/s. shm is faster than the algorithm choose() picks: "
                             f"copy-in {where(found['shm_from_bytes'])} (shm_from_bytes, where auto takes shm), zero "
                             f"copy {where(found['shm_zero_copy_from_bytes'])}", hanging="  "))  # fmt: skip
    cells = [[str(row["bytes"]), row["chosen"], f"{row['chosen_s'] * 1e6:.1f}",
              f"{row['shm_copyin_s'] * 1e6:.1f}", faster(row["chosen_s"] / row["shm_copyin_s"]),
              f"{row['shm_zero_copy_s'] * 1e6:.1f}", faster(row["chosen_s"] / row["shm_zero_copy_s"])]
             for row in found["shm_allreduce"]]  # fmt: skip
    header = ["bytes", "chosen", "chosen us", "shm copy-in us", "copy-in", "shm zero copy us", "zero copy"]
    print(terminal.table(header, cells, left=(1,)))


SHM_KEYS = ("fence", "copy", "shm_from_bytes", "shm_zero_copy_from_bytes", "shm_allreduce")


def print_fit(title, times, alpha, beta) -> None:
    print()
    print(terminal.paragraph(title, hanging="  "))
    cells = [[str(n), f"{t * 1e6:.2f}", f"{(alpha + beta * n) * 1e6:.2f}"] for n, t in zip(SIZES, times)]
    print(terminal.table(["bytes", "measured us", "fit us"], cells, left=()))


def shapes_table(shapes: list[dict]) -> str:
    """measure_compute's shapes: each one's measured step against the fitted rates' (a table fitted to the
    terminal)."""
    cells = [["-".join(map(str, shape["sizes"])), str(shape["rows"]), str(shape["microbatches"]),
              f"{shape['seconds'] * 1e3:.3f}", f"{shape['fitted'] * 1e3:.3f}",
              f"{shape['fitted'] / shape['seconds']:.2f}"] for shape in shapes]  # fmt: skip
    header = ["model", "rows", "micro-batches", "measured ms", "fitted ms", "fitted / measured"]
    return terminal.table(header, cells, indent="  ")


def gpu_preset(path: str) -> None:
    """``--gpu FILE``: this GPU machine as a dtrain/plan/hardware.json preset (see the module's docstring)."""
    import cupy

    from dtrain import backend
    from dtrain.plan.hardware import GPU_SHAPES, measure_compute

    missing = backend.gpu_missing()
    if missing:
        raise SystemExit(f"--gpu: {missing}")
    gpu = backend.select_gpu(0)
    compute = measure_compute(GPU_SHAPES, device="gpu")
    print(terminal.paragraph(f"compute on {gpu['name']}: {compute['flops'] / 1e12:.1f} TFLOP/s in matrix products, "
                             f"{compute['layer_s'] * 1e6:.0f} us per layer, {compute['step_s'] * 1e6:.0f} us per step, "
                             f"{compute['memory_bandwidth'] / 1e9:.0f} GB/s updates", hanging="  "))  # fmt: skip
    print(shapes_table(compute["shapes"]))
    links = measure(2, "gpu")
    staged, host = fit(SIZES, links["staged"]), fit(SIZES, links["host"])
    gamma = gpu_reduce_time_per_byte()
    print_fit(f"ping-pong of GPU buffers, 2 ranks sharing the GPU ({links['why']})", links["staged"], *staged)
    print_fit("ping-pong of host buffers, the same 2 ranks", links["host"], *host)
    print(terminal.paragraph(f"GPU reduction: {gamma * 1e12:.3f} ps per byte ({1e-9 / gamma:.0f} GB/s of reduced "
                             "bytes)", hanging="  "))  # fmt: skip
    date, memory = time.strftime("%F"), cupy.cuda.runtime.getDeviceProperties(gpu["index"])["totalGlobalMem"]
    link = {"alpha": staged[0], "bandwidth": 1.0 / staged[1], "gamma": gamma}
    preset = {
        "about": f"this workplace's lent GPU machine: {gpu['count']} {gpu['name']}, ranks sharing it, messages staged "
        f"through pinned host memory (MPI not CUDA-aware); every number measured by dtrain on it, {date}",
        "ranks_per_node": None, "devices_per_node": gpu["count"], "asynchronous": True, "hidden": 0.0,
        "flops": {"float32": compute["flops"]}, "efficiency": 1.0, "layer_s": compute["layer_s"],
        "step_s": compute["step_s"], "memory": float(memory) * gpu["count"],
        "memory_bandwidth": compute["memory_bandwidth"], "intra": link, "inter": link,
        "sources": {
            "flops, layer_s, step_s": f"fitted to dtrain's own steps on the GPU ({date}): python "
            "scripts/calibrate.py --gpu (dtrain.plan.hardware.measure_compute, GPU_SHAPES, the asynchronous model); "
            "efficiency 1: the fit is already what dtrain sustains",
            "memory_bandwidth": "a 1 GiB device-to-device copy, bytes read and written (dtrain.plan.hardware."
            "device_memory_bandwidth)",
            "memory": "the node's GPUs' totalGlobalMem, read through CuPy: ranks beyond one per GPU share it (and the "
            "GPU: devices_per_node)",
            "hidden": "0: dtrain's messages are staged by the rank's own thread, so none hides behind backward",
            "intra": f"ping-pong of GPU buffers between 2 ranks staged through pinned host memory ({links['why']}), "
            f"8 B to 16 MiB; gamma: kernels.add_ on GPU arrays of 64 MiB, CUDA events ({date})",
            "inter": "no second machine was measured: the intra-node link stands in for it",
        },
        "measured": {"compute_shapes": compute["shapes"], "staged_seconds": links["staged"],
                     "host_seconds": links["host"], "host_fit": {"alpha": host[0], "beta": host[1]}, "bytes": SIZES},
    }  # fmt: skip
    Path(path).write_text(json.dumps(preset, indent=1) + "\n")
    print(f"wrote {path}")


def fit_compute() -> dict:
    """dtrain.plan.hardware's compute rates, fitted on this process (one BLAS thread, as a rank), with the command."""
    from dtrain.plan.hardware import measure_compute

    compute = measure_compute()
    print(terminal.paragraph(f"compute: {compute['flops'] / 1e9:.1f} GFLOP/s in matrix products, "
                             f"{compute['layer_s'] * 1e6:.0f} us per layer, {compute['step_s'] * 1e6:.0f} us per step, "
                             f"{compute['memory_bandwidth'] / 1e9:.1f} GB/s updates", hanging="  "))  # fmt: skip
    print(shapes_table(compute["shapes"]))
    return {**compute, "command": "python " + " ".join(sys.argv), "date": time.strftime("%F")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,3,4,8", help="rank counts to measure under load (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    parser.add_argument("--compute", action="store_true", help="only refit the compute rates, keep the links")
    parser.add_argument(
        "--shm",
        action="store_true",
        help="only measure shared memory's fence, copy and shm_from_bytes for each of --ranks, keeping the rest",
    )
    parser.add_argument("--gpu", metavar="FILE", help="measure this GPU machine; write a dtrain plan preset to FILE")
    parser.add_argument("--worker", metavar="RESULT", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="pingpong", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mode)
        return
    if args.gpu:
        gpu_preset(args.gpu)
        return

    from dtrain import kernels
    from dtrain.plan.hardware import step_seconds

    previous = json.loads(OUTPUT.read_text()) if OUTPUT.exists() else {}
    if args.shm:
        by_ranks = previous.get("by_ranks", {})
        for p in [int(v) for v in args.ranks.split(",")]:
            found = measure(p, "shm")
            print_shared_memory(p, found)
            by_ranks[str(p)] = {**by_ranks.get(str(p), {}), **found, "shm_command": "python " + " ".join(sys.argv),
                                "shm_date": time.strftime("%F")}  # fmt: skip
        if not args.dry_run:
            OUTPUT.write_text(json.dumps({**previous, "by_ranks": by_ranks}, indent=1) + "\n")
            print(f"wrote {OUTPUT}")
        return
    compute = fit_compute()
    if args.compute:
        if not args.dry_run:
            calibration = json.loads(OUTPUT.read_text()) if OUTPUT.exists() else {}
            OUTPUT.write_text(json.dumps({**calibration, "compute": compute}, indent=1) + "\n")
            print(f"wrote {OUTPUT}")
        return
    times = measure(2, "pingpong")
    alpha, beta = fit(SIZES, times)
    gamma = reduce_time_per_byte()
    print_fit("ping-pong, 2 ranks, idle machine", times, alpha, beta)
    summary = [("idle pair", alpha, beta, gamma)]
    by_ranks = {}
    alone = [step_seconds(sizes, rows) for sizes, rows in LOAD_SHAPES]  # (this process alone, one thread)
    for p in [int(v) for v in args.ranks.split(",")]:
        loaded = measure(p, "ring")
        a, b = fit(SIZES, loaded["seconds"])
        slowdown = statistics.median(busy / one for busy, one in zip(loaded["busy_step_s"], alone))
        by_ranks[str(p)] = {"alpha": a, "beta": b, "gamma": loaded["gamma"], "seconds": loaded["seconds"],
                            "alpha_dtrain": loaded["alpha_dtrain"], "slowdown": slowdown,
                            **{key: loaded[key] for key in SHM_KEYS}}  # fmt: skip
        print(terminal.paragraph(f"dtrain's own all-reduce: {loaded['alpha_dtrain'] * 1e6:.1f} us per message; "
                                 f"compute with all {p} ranks busy: {faster(1 / by_ranks[str(p)]['slowdown'])} than "
                                 "one process alone", hanging="  "))  # fmt: skip
        print_fit(f"ring step, all {p} ranks at once", loaded["seconds"], a, b)
        print_shared_memory(p, loaded)
        summary.append((f"{p} ranks busy", a, b, loaded["gamma"]))
    cells = []
    for name, a, b, g in summary:
        bandwidth = 1e-9 / b if b else float("inf")  # the fit clamps a negative beta to 0
        cells.append([name, f"{a * 1e6:.2f}", f"{b * 1e9:.4f}", f"{bandwidth:.1f}", f"{g * 1e9:.4f}"])
    print(f"\nthe fits (gamma: the {kernels.backend_name()} kernels)")
    print(terminal.table(["", "alpha us", "beta ns/B", "bandwidth GB/s", "gamma ns/B"], cells))
    if args.dry_run:
        return
    by_ranks = {**previous.get("by_ranks", {}), **by_ranks}  # rank counts not measured this time keep theirs
    calibration = {
        **previous,
        "alpha": alpha,
        "beta": beta,
        "gamma": gamma,
        "by_ranks": by_ranks,
        "pingpong": {"bytes": SIZES, "seconds": times},
        "compute": compute,
        "kernels": kernels.backend_name(),
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%F"),
    }
    OUTPUT.write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    sys.exit(main())

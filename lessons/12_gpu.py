"""Lesson 12: training on GPUs. CuPy arrays, CUDA-aware MPI or host staging, the stream, and where the time goes.

One rank per GPU is how synchronous training runs on a cluster: each rank's model, batches and gradients live in
its GPU's memory, the arithmetic runs there, and only the all-reduce leaves the GPU. dtrain runs every paradigm that
way with ``--device gpu``: the same Python on CuPy arrays instead of NumPy ones (``xp.zeros``, ``x @ w``). Two
questions decide how fast the messages are:

  1. can MPI read GPU memory? A *CUDA-aware* MPI (Open MPI or MPICH built with CUDA, UCX) takes a GPU buffer's
     address and moves the bytes itself, GPU to GPU over NVLink or from the network card into GPU memory (GPUDirect
     RDMA). Any other MPI would read that address as host memory: a crash, or garbage. dtrain asks the library
     (MPIX_Query_cuda_support) and says what it found; DTRAIN_CUDA_AWARE=0/1 overrides the answer;
  2. if not, every message is *staged*: copied to pinned (page-locked) host memory, sent, received into pinned
     memory, copied up (dtrain.comm.staging.StagedComm). Two copies over PCIe per message, and a wait for the GPU
     before each: its kernels run asynchronously, so a buffer is not ready when the Python line that computed it
     returns. MPI must not read it before the GPU's stream has finished writing it: the stream is synchronised
     first, staged or not.

    python lessons/12_gpu.py                 # on a machine with a GPU: ~1-2 min; without one: what can run here
    python lessons/12_gpu.py --quick         # fewer rounds and smaller buffers
    python lessons/12_gpu.py --results docs/bench/gpu.json   # the measured part read from a benchmark's results

What you will see:
  1. this MPI's answer to "are you CUDA-aware?" and what dtrain does with it (everywhere);
  2. the stream: a GPU call returns long before its work is done; the synchronisation that waits for it (a GPU);
  3. host staging in a real run: 2 ranks sharing the GPU train with ddp, every byte the ring sends copied down and
     up, counted in metrics.json beside the bytes MPI moved, and the seconds it took (a GPU);
  4. where the time goes: the all-reduce of GPU buffers against host buffers (staging, reduction, MPI), and the
     MLP's step on the GPU against the CPU and PyTorch (scripts/bench_gpu.py; without a GPU, its recorded results).

Without CuPy or a GPU, parts 2 and 3 say so and are skipped, and part 4 shows the results recorded in
docs/bench/gpu.json, with the GPU and the date they come from. Timings are printed, never checked.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lesson_util import Checks, conclude, heading, say, table

from dtrain import terminal

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "bench" / "gpu.json"
CHECKS = Checks()  # the lesson's claims (parts 2 and 3 make them; this process is a world of one rank)


def part_cuda_aware() -> dict:
    from dtrain.comm.cuda_aware import ENV_VAR, cuda_aware_mpi, cuda_awareness_reason

    aware = cuda_aware_mpi()
    heading("1. Is this MPI CUDA-aware?")
    say(cuda_awareness_reason(), hanging="     ")
    if aware:
        say("-> dtrain hands GPU buffers to MPI as they are, after synchronising the stream.", hanging="     ")
    else:
        say("-> dtrain stages every GPU message through pinned host memory (two PCIe copies per message).",
            hanging="     ")  # fmt: skip
    say(f"({ENV_VAR}=1 or 0 overrides the library's answer: 1 on an MPI that is not CUDA-aware crashes.)",
        hanging="     ")  # fmt: skip
    return {"cuda_aware": aware, "why": cuda_awareness_reason()}


def part_stream() -> dict:
    import cupy

    heading("2. The stream: a GPU call returns before its work is done")
    a = cupy.random.default_rng(0).standard_normal((8192, 8192), dtype=cupy.float32)
    (a @ a).sum()  # warm-up: cuBLAS's handle, the kernels loaded
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    started = time.perf_counter()
    c = a @ a  # 1.1 TFLOP, queued
    for _ in range(3):
        c = c @ a
    returned = time.perf_counter() - started
    stream.synchronize()
    done = time.perf_counter() - started
    say(f"four 8192x8192 products queued: the Python line returned after {returned * 1e3:.3f} ms, the GPU finished "
        f"after {done * 1e3:.1f} ms.")  # fmt: skip
    CHECKS.ok("the call returned before the GPU had done a tenth of its work", returned < done / 10)
    say("An MPI_Send of c right after the line returned would have sent c's memory as it was before the products "
        "wrote it. So StagedComm synchronises the stream before it copies a buffer down, and, with a CUDA-aware MPI, "
        "before it hands MPI the buffer itself. (A stream-ordered MPI, or NCCL on the compute stream, avoids the "
        "wait; plain MPI cannot.)")  # fmt: skip
    return {"call_returned_ms": returned * 1e3, "work_done_ms": done * 1e3}


def part_staging(quick: bool) -> dict:
    heading("3. Host staging in a real run: ddp on 2 ranks sharing the GPU")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "run"
        flags = ["--paradigm", "ddp", "--allreduce", "ring", "--device", "gpu", "--dataset", "digits",
                 "--hidden", "256,256", "--batch-size", "64", "--epochs", "1" if quick else "2", "--quiet",
                 "--no-progress", "--out", str(folder)]  # fmt: skip
        command = [sys.executable, "-m", "dtrain", "launch", "-n", "2", "-m", "dtrain", "train", *flags]
        shown = terminal.command(["dtrain", "launch", "-n", "2", "-m", "dtrain", "train", *flags[:-2]], "     ")
        print("   $ " + shown[5:], flush=True)
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise SystemExit(f"the run failed:\n{done.stderr[-3000:]}")
        metrics = json.loads((folder / "metrics.json").read_text())
    gpu, staging = metrics["gpu"], metrics["gpu"]["staging"]
    per_rank = metrics["communication"]["per_rank"]
    say(f"on {gpu['name']} (rank r uses GPU r % {gpu['count']}); test accuracy "
        f"{100 * metrics['final']['test_accuracy']:.1f}%")  # fmt: skip
    for r, (s, c) in enumerate(zip(staging, per_rank)):
        sent, train_s = c["totals"]["bytes_sent"], c["train_time_s"]
        how = "handed to MPI as they were" if s["cuda_aware"] else "staged"
        say(f"rank {r}: MPI sent {sent:,} B; {s['bytes_to_host']:,} B copied down and {s['bytes_to_device']:,} B up "
            f"({how}) in {s['seconds'] * 1e3:.0f} ms of {train_s * 1e3:.0f} ms of training",
            hanging="     ")  # fmt: skip
    sent = [c["totals"]["bytes_sent"] for c in per_rank]
    if not staging[0]["cuda_aware"]:
        CHECKS.ok("every byte a rank sent was copied down first, and every byte it received copied up after",
              all(s["bytes_to_host"] == mine and s["bytes_to_device"] == sum(sent) - mine
                  for s, mine in zip(staging, sent)))  # fmt: skip
    return {"gpu": gpu, "staging": staging, "bytes_sent": sent}


def part_breakdown(results: dict, source: str) -> None:
    heading(f"4. Where the time goes ({source})")
    for row in results.get("step", []):
        ms = row["step_ms"]
        torch = f", PyTorch {ms['torch']:.2f} ms" if "torch" in ms else ""
        gpu = terminal.speed(1.0, row["gpu_speedup_over_cpu"], "the CPU")  # (the file's ratios, as recorded)
        against = f", dtrain {terminal.speed(1.0, row['dtrain_over_torch_speed'], 'PyTorch')}" if "torch" in ms else ""
        say(f"784-{row['hidden']}-{row['hidden']}-10, batch {row['batch']}: CPU {ms['cpu']:.1f} ms, GPU "
            f"{ms['gpu']:.2f} ms{torch}: the GPU {gpu}{against}", hanging="     ")  # fmt: skip
    for p, got in results.get("allreduce", {}).items():
        rows = {(r["bytes"], r["case"]): r for r in got["rows"]}
        biggest = max(b for b, _ in rows)
        print()
        say(f"all-reduce of {biggest >> 20} MiB on {p} ranks sharing the GPU:")
        cells = []
        for algorithm in ("ring", "mpi"):
            host, staged = rows[(biggest, f"{algorithm} host")], rows[(biggest, f"{algorithm} staged")]
            cells.append([algorithm, f"{host['busbw_GBps']:.2f}", f"{staged['busbw_GBps']:.2f}",
                          f"{staged['busbw_GBps'] / host['busbw_GBps']:.0%}", f"{staged['time_s'] * 1e3:.1f}",
                          f"{staged['staging_s'] * 1e3:.1f}", f"{staged['gpu_reduce_s'] * 1e3:.2f}",
                          f"{staged['mpi_s'] * 1e3:.1f}"])  # fmt: skip
        table(["", "host GB/s", "staged GB/s", "staged / host", "staged ms", "staging ms", "GPU reduction ms",
               "MPI ms"], cells, groups=(4,))  # fmt: skip
    print()
    say("host: the all-reduce of host buffers; staged: of GPU buffers staged through pinned host memory, its time "
        "(staged ms) the sum of the staging, the GPU's reduction and MPI's; GB/s: bus bandwidth (busbw). Staging "
        "costs two PCIe copies per message and a wait for the GPU before each. The staged ring can still beat the "
        "host ring: its reductions run on the GPU, the host ring's on one CPU core per rank. MPI's own Allreduce is "
        "staged once, the whole buffer down and up, and reduces on the host either way. On a CUDA-aware MPI over "
        "NVLink no copy happens (dtrain plan prices that: dtrain plan --machine dgx-h100).")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller buffers")
    parser.add_argument("--results", metavar="PATH", help="part 4 from scripts/bench_gpu.py's --json instead of a run")
    parser.add_argument("--json", metavar="PATH", help="write what was measured to this file")
    args = parser.parse_args()
    from dtrain import backend

    missing = backend.gpu_missing()
    out = {"cuda_aware": part_cuda_aware()}
    if missing:
        heading(f"2-3. skipped: they need a GPU ({missing})")
    else:
        out["stream"] = part_stream()
        out["staging"] = part_staging(args.quick)
    if args.results or missing:
        path = Path(args.results) if args.results else RECORDED
        if path.exists():
            recorded = json.loads(path.read_text())
            where = f"recorded on {recorded['gpu']['name']}, {recorded['date']}: {recorded['command']}"
            part_breakdown(recorded, where)
        else:
            heading(f"4. skipped: no GPU here and no recorded results in {path}")
    else:
        with tempfile.TemporaryDirectory() as scratch:
            result = Path(scratch) / "gpu.json"
            command = [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--json", str(result)]
            subprocess.run(command + (["--quick"] if args.quick else []), check=True, timeout=900)
            part_breakdown(json.loads(result.read_text()), "measured now, scripts/bench_gpu.py")
    made = len(CHECKS.verdicts)
    why = "the checks belong to parts 2 and 3, which need a GPU" if not made else "timings are printed, never checked"
    conclude(args.json, out, CHECKS, note=f"{made} checks; {why}")


if __name__ == "__main__":
    main()

"""dtrain on a GPU, measured: the MLP's training step on the GPU against the CPU of the same machine and against
PyTorch on the same GPU; the all-reduce of GPU buffers staged through host memory against the same all-reduce of
host buffers, and where the staged one's time goes.

    python scripts/bench_gpu.py                          # both parts (~3 min on a 16-core H100 machine)
    python scripts/bench_gpu.py --part step              # or --part allreduce
    python scripts/bench_gpu.py --quick                  # fewer rounds and sizes: ~1 min
    python scripts/bench_gpu.py --json docs/bench/gpu.json

Needs CuPy and an NVIDIA GPU (without them it says why and stops); PyTorch is optional (its column is left out).

**The step** (``--part step``): forward, backward and a plain SGD update of the 784-H-H-10 ReLU MLP on one batch of
1024 rows, float32, H = 512 and 4096, the batch already where the model is (as in a loop whose loader keeps the
next batch ready). Contenders, all from the same initial weights (dtrain's), checked to compute the same first loss:

* ``cpu``: dtrain on NumPy, BLAS with every core of the machine (this process sets no thread limit);
* ``gpu``: dtrain on CuPy (``MLP(..., xp=cupy)``): the same Python, every array on the GPU;
* ``torch``: PyTorch eager on the same GPU (``nn.Sequential`` of ``Linear`` and ``ReLU``, ``cross_entropy``,
  ``optim.SGD``), float32 matrix products in IEEE float32 like CuPy's (no TF32 for either).

GPU steps are queued ``--steps`` at a time and timed to the synchronisation after the last, so the CPU's Python runs
ahead of the GPU as in training (the loss is not read inside a step); the contenders take turns, round after round,
and each figure is the median over rounds. Speeds, in words ("12.22x faster"): the GPU step's against the CPU's, and
dtrain's against PyTorch's on the GPU.

**The all-reduce** (``--part allreduce``): ``p`` = 2 and 4 ranks under ``dtrain launch``, all sharing the one GPU
(``rank % GPUs``), sum-all-reducing float32 buffers of 1 to 64 MiB: dtrain's ring and MPI's own ``Allreduce``, each
on host buffers (NumPy) and on GPU buffers (CuPy) through :class:`dtrain.comm.staging.StagedComm`, which copies each
message to pinned host memory and back because this MPI is not CUDA-aware (the ring stages every chunk it sends and
receives; MPI's ``Allreduce`` is staged once, the whole buffer down and up). ``busbw`` is nccl-tests' bus bandwidth,
S/t x 2(p-1)/p; ``vs host buffers``: the GPU buffers' speed against the host buffers' (the one busbw over the other,
in words). Where the staged time goes:
``staging`` (the copies and the stream synchronisations before them, StagedComm's own clock), ``reduce`` (the ring's
p-1 additions of a chunk on the GPU, timed alone with CUDA events), ``mpi`` (what is left: the messages themselves).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_util import add_worker_flags, faster, run_meta, write_json

from dtrain import terminal

LR, BATCH = 0.01, 1024
HIDDEN = (512, 4096)
SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]


# --- the step ------------------------------------------------------------------------------------------------------
def mlp_sizes(hidden: int) -> list[int]:
    return [784, hidden, hidden, 10]


class DtrainStep:
    def __init__(self, name, xp, sizes, x, y, sync):
        from dtrain.nn import MLP
        from dtrain.optim import SGD

        self.name, self.sync = name, sync
        self.model = MLP(sizes, seed=0, xp=xp)
        self.opt = SGD(self.model, lr=LR)
        self.x, self.y = xp.asarray(x), xp.asarray(y)

    def __call__(self):
        from dtrain.autograd import Tensor, softmax_cross_entropy

        self.model.zero_grad()
        loss = softmax_cross_entropy(self.model(Tensor(self.x)), self.y)
        loss.backward()
        self.opt.step()
        return loss.data

    def first_loss(self) -> float:
        return float(self())


class TorchStep:
    name = "torch"

    def __init__(self, sizes, x, y):
        import torch

        from dtrain.nn import MLP

        self.torch, device = torch, torch.device("cuda", torch.cuda.current_device())
        layers = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            layers += [torch.nn.Linear(n_in, n_out)] + ([torch.nn.ReLU()] if i < len(sizes) - 2 else [])
        self.model = torch.nn.Sequential(*layers)
        with torch.no_grad():  # dtrain's initial weights (torch keeps W as (out, in): transposed)
            for linear, ours in zip(layers[::2], MLP(sizes, seed=0).layers[::2]):
                linear.weight.copy_(torch.from_numpy(ours.weight.data.T.copy()))
                linear.bias.copy_(torch.from_numpy(ours.bias.data))
        self.model.to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.x, self.y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        self.sync = torch.cuda.synchronize

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return loss

    def first_loss(self) -> float:
        return float(self().item())


def time_steps(step, steps: int) -> float:
    """Seconds per step of ``steps`` steps queued back to back, to the synchronisation after the last."""
    step.sync()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    step.sync()
    return (time.perf_counter() - started) / steps


def bench_step(args) -> list[dict]:
    import cupy

    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False  # (the default; said here because the comparison needs it)
    except ImportError:
        torch = None
        print("(PyTorch is not installed: no torch column)")
    rows = []
    for hidden in HIDDEN:
        sizes = mlp_sizes(hidden)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((BATCH, sizes[0])).astype(np.float32)
        y = rng.integers(0, sizes[-1], BATCH)
        contenders = [DtrainStep("cpu", np, sizes, x, y, lambda: None),
                      DtrainStep("gpu", cupy, sizes, x, y, cupy.cuda.get_current_stream().synchronize)]  # fmt: skip
        if torch is not None:
            contenders.append(TorchStep(sizes, x, y))
        first = {c.name: c.first_loss() for c in contenders}
        for name, loss in first.items():  # the same arithmetic from the same weights: the same first loss
            if abs(loss - first["cpu"]) > 1e-4 * abs(first["cpu"]):
                raise SystemExit(f"{name}'s first loss {loss} differs from the CPU's {first['cpu']}")
        for c in contenders:  # warm-up: kernels compiled, memory pools filled, BLAS threads started
            time_steps(c, 3)
        times = {c.name: [] for c in contenders}
        for _ in range(args.rounds):
            for c in contenders:
                times[c.name].append(time_steps(c, 1 if c.name == "cpu" else args.steps))
        median = {name: statistics.median(t) for name, t in times.items()}
        row = {"hidden": hidden, "sizes": sizes, "batch": BATCH, "first_loss": first,
               "step_ms": {k: v * 1e3 for k, v in median.items()},
               "ranges_ms": {k: [min(t) * 1e3, max(t) * 1e3] for k, t in times.items()},
               "gpu_speedup_over_cpu": median["cpu"] / median["gpu"]}  # fmt: skip
        if "torch" in median:
            row["dtrain_over_torch_speed"] = median["torch"] / median["gpu"]
        flops = 6 * BATCH * sum(a * b for a, b in itertools.pairwise(sizes))
        row["gpu_tflops"] = flops / median["gpu"] / 1e12
        rows.append(row)
        print(f"  {'-'.join(map(str, sizes))}, batch {BATCH}: timed", flush=True)
    print("\n" + step_table(rows), flush=True)
    return rows


def step_table(rows: list[dict], width="auto") -> str:
    """The step's results (``bench_step``'s rows) as a table fitted to ``width`` (:mod:`dtrain.terminal`)."""
    names = list(rows[0]["step_ms"])
    header = ["model", *(f"{name} ms" for name in names), "GPU vs CPU"]
    header += ["dtrain vs torch, GPU"] if "torch" in names else []
    cells = []
    for row in rows:
        line = ["-".join(map(str, row["sizes"])), *(f"{row['step_ms'][n]:.3f}" for n in names),
                faster(row["gpu_speedup_over_cpu"])]  # fmt: skip
        line += [faster(row["dtrain_over_torch_speed"])] if "torch" in names else []
        cells.append([*line, f"{row['gpu_tflops']:.1f}"])
    legend = ("ms: the median step; GPU vs CPU: dtrain's step on the GPU against dtrain's on the CPU; dtrain vs torch: "
              "dtrain's GPU step against PyTorch's on the same GPU; TFLOP/s: dtrain's on the GPU")  # fmt: skip
    return "\n".join([terminal.paragraph(f"one training step, batch {rows[0]['batch']}, float32", width=width),
                      terminal.table([*header, "GPU TFLOP/s"], cells, width=width),
                      terminal.paragraph(legend, hanging="  ", width=width)])  # fmt: skip


# --- the all-reduce ------------------------------------------------------------------------------------------------
def allreduce_worker(args) -> None:
    """One rank of the all-reduce part (under dtrain launch)."""
    import cupy
    from mpi4py import MPI

    from dtrain import backend, kernels
    from dtrain.collectives import allreduce
    from dtrain.comm.staging import StagedComm

    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    gpu = backend.select_gpu(node.Get_rank())
    node.Free()
    staged = StagedComm(comm)
    stream = cupy.cuda.get_current_stream()
    rows = []
    for size in [s for s in SIZES if s <= args.max_bytes]:
        n = size // 4
        src = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        expected = np.empty_like(src)
        comm.Allreduce(src, expected, op=MPI.SUM)
        host, device = np.empty_like(src), cupy.empty(n, dtype=np.float32)
        cases = {"ring host": (comm, host, "ring"), "ring staged": (staged, device, "ring"),
                 "mpi host": (comm, host, "mpi"), "mpi staged": (staged, device, "mpi")}  # fmt: skip

        def once(case, cases=cases, src=src, host=host, device=device):
            target, buf, algorithm = cases[case]
            if buf is device:
                device.set(src)
            else:
                host[...] = src
            stream.synchronize()
            comm.Barrier()
            staging_before = staged.staging_seconds
            started = time.perf_counter()
            allreduce(target, buf, op="sum", algorithm=algorithm)
            stream.synchronize()
            elapsed = time.perf_counter() - started
            return elapsed, staged.staging_seconds - staging_before

        for case in cases:  # warm-up, and the result checked against MPI's on host buffers (same order of sums)
            once(case)
            got = cases[case][1].get() if cases[case][1] is device else cases[case][1]
            if not np.allclose(got, expected, rtol=1e-5, atol=1e-5):
                raise SystemExit(f"rank {rank}: {case} at {size} bytes differs from MPI's Allreduce")
        samples = {case: [] for case in cases}
        for _ in range(args.allreduce_rounds):
            for case in cases:
                elapsed, staging = once(case)
                slowest = comm.allreduce(elapsed, op=MPI.MAX)
                samples[case].append((slowest, comm.allreduce(staging, op=MPI.MAX)))
        # the ring's reductions alone: p - 1 additions of a chunk of n/p elements, on the GPU, CUDA events around
        a, b = cupy.asarray(src[: n // p]), cupy.asarray(src[n // p : 2 * (n // p)])
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        kernels.add_(a, b)
        start.record()
        for _ in range(p - 1):
            kernels.add_(a, b)
        end.record()
        end.synchronize()
        reduce_s = cupy.cuda.get_elapsed_time(start, end) / 1e3
        for case, pairs in samples.items():
            t = statistics.median(x for x, _ in pairs)
            staging = statistics.median(s for _, s in pairs) if "staged" in case else 0.0
            reduce = reduce_s if case == "ring staged" else 0.0
            rows.append({"p": p, "bytes": size, "case": case, "time_s": t,
                         "busbw_GBps": size / t * 2 * (p - 1) / p / 1e9, "staging_s": staging,
                         "gpu_reduce_s": reduce, "mpi_s": max(t - staging - reduce, 0.0)})  # fmt: skip
    if rank == 0:
        Path(args.result).write_text(json.dumps({"rows": rows, "gpu": gpu, "cuda_aware": staged.cuda_aware,
                                                 "why": staged.cuda_aware_reason}))  # fmt: skip


def bench_allreduce(args) -> dict:
    out = {}
    for p in args.ranks:
        with tempfile.TemporaryDirectory() as scratch:
            result = Path(scratch) / "result.json"
            command = [sys.executable, "-m", "dtrain", "launch", "-n", str(p), __file__, "--worker", "--result",
                       str(result), "--max-bytes", str(args.max_bytes), "--allreduce-rounds",
                       str(args.allreduce_rounds)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode:
                raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
            got = json.loads(result.read_text())
        out[p] = got
        print("\n" + allreduce_table(p, got), flush=True)
    return out


def allreduce_table(p: int, got: dict, width="auto") -> str:
    """The all-reduce's results on ``p`` ranks (what rank 0 wrote) as a table fitted to ``width``."""
    title = terminal.paragraph(f"all-reduce, {p} ranks sharing {got['gpu']['name']}; staging: {got['why']}",
                               hanging="  ", width=width)  # fmt: skip
    by = {(r["bytes"], r["case"]): r for r in got["rows"]}
    header = ["MiB", "case", "ms", "busbw GB/s", "vs host buffers", "staging ms", "reduce ms", "mpi ms"]
    cells = []
    for r in got["rows"]:
        host = by[(r["bytes"], r["case"].replace("staged", "host"))]
        versus = faster(r["busbw_GBps"] / host["busbw_GBps"]) if "staged" in r["case"] else ""
        ms = [f"{r[key] * 1e3:.3f}" for key in ("time_s", "staging_s", "gpu_reduce_s", "mpi_s")]
        cells.append([str(r["bytes"] >> 20), r["case"], ms[0], f"{r['busbw_GBps']:.2f}", versus, *ms[1:]])
    return title + "\n" + terminal.table(header, cells, left=(1,), keys=2, width=width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "step", "allreduce"), default="all")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, buffers up to 16 MiB")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of the step (default 15, quick 5)")
    parser.add_argument("--steps", type=int, default=20, help="GPU steps queued per timed sample (default 20)")
    parser.add_argument("--ranks", default="2,4", help="rank counts of the all-reduce (default %(default)s)")
    parser.add_argument("--allreduce-rounds", type=int, default=None, help="timed rounds per size (15, quick 7)")
    parser.add_argument("--max-bytes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="write every number to this file")
    add_worker_flags(parser)
    args = parser.parse_args()
    args.rounds = args.rounds or (5 if args.quick else 15)
    args.allreduce_rounds = args.allreduce_rounds or (7 if args.quick else 15)
    args.max_bytes = args.max_bytes or ((16 << 20) if args.quick else (64 << 20))
    if args.worker:
        allreduce_worker(args)
        return
    from dtrain import backend

    missing = backend.gpu_missing()
    if missing:
        raise SystemExit(f"bench_gpu.py needs a GPU: {missing}")
    args.ranks = [int(p) for p in args.ranks.split(",")]
    import cupy

    gpu = backend.select_gpu(0)
    print(f"{gpu['name']}; CuPy {cupy.__version__}, NumPy {np.__version__}; {os.cpu_count()} CPU cores", flush=True)
    results = run_meta(gpu=gpu, cupy=cupy.__version__)
    started = time.perf_counter()
    if args.part in ("all", "step"):
        results["step"] = bench_step(args)
    if args.part in ("all", "allreduce"):
        results["allreduce"] = bench_allreduce(args)
    results["seconds"] = time.perf_counter() - started
    if args.json:
        print(f"wrote {write_json(args.json, results)}")


if __name__ == "__main__":
    main()

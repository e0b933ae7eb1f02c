"""Data parallelism: dtrain's ``ddp`` against PyTorch DDP (gloo) and a hand-written NumPy + MPI floor, in one run.

One global step = forward + backward of a 784-512-512-10 ReLU MLP on this rank's slice of a global batch of 256
(256/N samples per rank), the gradients averaged over the N ranks, then a plain SGD update (lr 0.05, no momentum).
float32, one thread per rank, synthetic data made in memory beforehand. The contenders, each timed on the same
batches from the same initial weights (dtrain's initialisation):

* ``floor``: the network's forward and backward written out in NumPy (as in ``scripts/bench_step.py``), the
  gradients written straight into one flat buffer, ``comm.Allreduce(MPI.IN_PLACE, flat)`` on it, one SGD update:
  what NumPy + mpi4py can do with no framework at all;
* ``floor+dtrain-passes``: the floor plus the memory passes dtrain's model stack makes besides the arithmetic
  (zeroing the gradient buffer, gradients into temporaries then added in, the 1/N in a pass of its own, SGD through
  a scratch buffer): how much of the distance from ``ddp`` to ``floor`` is memory traffic, not Python;
* ``ddp``: ``dtrain.parallel`` ``DataParallel.step`` as the training driver calls it (communicator prepared by
  ``dtrain.comm.prepare``, tracer included), with its defaults: one all-reduce of the whole gradient after
  backward, ``--allreduce auto``;
* ``ddp`` variants, to see what overlap, buckets and the rest cost or buy here: ``--overlap`` (1 MiB buckets, each
  all-reduced by the non-blocking ring during backward), ``--overlap --bucket-mb 0`` (one bucket), ``--bucket-mb 1``
  (the buckets all-reduced after backward), ``--allreduce mpi`` (dtrain's paradigm around MPI's own all-reduce:
  against ``floor`` this is dtrain's autograd, optimizer and driver code; against ``ddp`` the way the gradients are
  all-reduced), ``--allreduce shm`` (the gradients in a shared window, summed in place: what ``auto`` takes under
  mpiexec on one node where calibrate.py measured it faster), and ``untraced`` (the defaults on the bare MPI
  communicator, without the tracer that ``prepare`` puts in: what counting every message costs);
* ``torch``: ``torch.nn.parallel.DistributedDataParallel`` over gloo on the CPU (its defaults: 25 MiB buckets,
  the all-reduce on gloo's own thread during backward), ``torch.set_num_threads(1)``; only if torch is installed
  (it is never a dependency of dtrain).

For each N the script launches itself under ``mpiexec`` (through dtrain's launcher: one thread per rank, yielding
waits when oversubscribed) ``--jobs`` times. Each job checks that every contender computes the same first loss and
the same weights after one step, then times them *interleaved*: each round runs ``--steps`` consecutive steps of
every contender (in an order that rotates from round to round), timed from a barrier to the slowest rank's end.
The table shows the median time over all rounds of all jobs; the speeds against ``torch`` and ``floor`` (samples/s
over theirs, in words: "1.20x faster", "1.09x slower") are medians over rounds of each round's ratio, so that a slow
minute on a shared machine cancels out.
``wait ms`` is the time per step ``average_gradients`` waits for the all-reduces (the exposed communication, including
waiting for slower ranks) and ``in bwd ms`` the time buckets were in flight while backward was still computing
(DataParallel's own accounting, mean over ranks).

After each job, the CLI, data pipeline and driver included: ``dtrain launch -n N -m dtrain train --paradigm ddp
--dataset synthetic --features 784 --hidden 512,512 --batch-size 256 --samples 25600 --epochs 2 --momentum 0 ...``
(plus each ``--cli-flags``), and torch DDP trained the same way (the same data through dtrain's ``ShardedLoader``,
2 epochs, the same timer), in alternating order. Each CLI run's ``epochs[-1].samples_per_s`` (the epoch after the
warm-up epoch) is divided by the torch run beside it; the median of those ratios is reported.

    python scripts/bench_ddp.py                        # N = 1, 2, 4; writes docs/bench/ddp.txt and ddp.json
    python scripts/bench_ddp.py --cli-flags= --cli-flags=--overlap     # two CLI configurations
    python scripts/bench_ddp.py --ranks 2 --rounds 10 --jobs 1 --no-cli --out /tmp/ddp     # quicker
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_name, "1")  # before NumPy loads BLAS: one thread per rank, for every contender

import argparse
import itertools
import json
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_util import Record, faster, forward_by_hand, run_meta, write_results

SIZES = [784, 512, 512, 10]
BATCH, LR, BATCHES = 256, 0.05, 4  # global batch, SGD learning rate, distinct batches cycled through
CLI_SAMPLES = 25600  # the CLI runs' --samples (a fifth of them are the test set): 80 steps per epoch

# label -> TrainConfig fields of a ddp contender
VARIANTS = {
    "ddp": {"overlap": False, "bucket_mb": None, "allreduce": "auto"},
    "ddp overlap": {"overlap": True, "bucket_mb": 1.0, "allreduce": "auto"},
    "ddp overlap 1-bucket": {"overlap": True, "bucket_mb": 0.0, "allreduce": "auto"},
    "ddp 1MiB-buckets": {"overlap": False, "bucket_mb": 1.0, "allreduce": "auto"},
    "ddp mpi-allreduce": {"overlap": False, "bucket_mb": 0.0, "allreduce": "mpi"},
    "ddp shm": {"overlap": False, "bucket_mb": None, "allreduce": "shm"},
    "ddp untraced": {"overlap": False, "bucket_mb": None, "allreduce": "auto", "traced": False},
}


def global_batches(rank: int, world: int):
    """This rank's slices of ``BATCHES`` global batches (the same global batches for every N)."""
    rng = np.random.default_rng(0)
    local = BATCH // world
    out = []
    for _ in range(BATCHES):
        x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
        y = rng.integers(0, SIZES[-1], BATCH)
        out.append((x[rank * local : (rank + 1) * local].copy(), y[rank * local : (rank + 1) * local].copy()))
    return out


# ------------------------------------------------------------------------------------ the contenders
class Floor:
    """Hand-written forward/backward into one flat gradient buffer, MPI's ``Allreduce`` on it, one SGD update.

    ``dtrain_passes``: the same arithmetic with the memory passes dtrain's model stack makes besides it (zero the
    gradient buffer, compute each gradient into a temporary and add it in, divide by N in a pass of its own, SGD
    through a scratch buffer), to measure what those passes cost without any of dtrain's Python.
    """

    def __init__(self, comm, world, dtrain_passes=False):
        from mpi4py import MPI

        from dtrain.nn import MLP

        self.MPI, self.comm, self.world, self.passes = MPI, comm, world, dtrain_passes
        self.model = MLP(SIZES, seed=0, dtype=np.float32)  # only for its flat buffers (and dtrain's initial weights)
        self.params = [p.data for p in self.model.parameters()]  # W1 b1 W2 b2 W3 b3: views into flat_params
        self.grads = [p.grad for p in self.model.parameters()]  # views into flat_grads
        self.scratch = np.empty_like(self.model.flat_params)

    def _grad(self, out, a, b) -> None:
        """``out = a @ b`` (weight) or, with ``b`` None, ``out = a.sum(axis=0)`` (bias)."""
        if self.passes:
            out += a @ b if b is not None else a.sum(axis=0)
        elif b is not None:
            np.matmul(a, b, out=out)
        else:
            a.sum(axis=0, out=out)

    def __call__(self, x, y):
        _, _, W2, _, W3, _ = self.params
        dW1, db1, dW2, db2, dW3, db3 = self.grads
        flat = self.model.flat_grads
        if self.passes:
            flat[...] = 0
        loss, dz3, (z1, h1, z2, h2) = forward_by_hand(self.params, x, y)  # (bench_step's hand-written forward)
        self._grad(dW3, h2.T, dz3)
        self._grad(db3, dz3, None)
        dz2 = (dz3 @ W3.T) * (z2 > 0)
        self._grad(dW2, h1.T, dz2)
        self._grad(db2, dz2, None)
        dz1 = (dz2 @ W2.T) * (z1 > 0)
        self._grad(dW1, x.T, dz1)
        self._grad(db1, dz1, None)
        self.comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)
        if self.passes:
            flat *= 1.0 / self.world
            self.model.flat_params -= np.multiply(flat, LR, out=self.scratch)
        else:
            flat *= LR / self.world  # the average, times the learning rate
            self.model.flat_params -= flat
        return loss

    def flat_weights(self):
        return self.model.flat_params


class Ddp:
    """dtrain's DataParallel, set up the way ``dtrain.train`` sets it up."""

    def __init__(self, world_comm, world, traced=True, **fields):
        from dtrain import parallel
        from dtrain.comm.prepare import prepare
        from dtrain.config import TrainConfig
        from dtrain.nn import MLP
        from dtrain.optim import make_optimizer

        config = TrainConfig(
            paradigm="ddp", dataset="synthetic", features=SIZES[0], hidden=tuple(SIZES[1:-1]), batch_size=BATCH,
            dtype="float32", lr=LR, momentum=0.0, timeout=0, progress=False, quiet=True, **fields,
        )  # fmt: skip
        cls = parallel.get("ddp")
        cls.check(config, world)
        self.p = cls(prepare(world_comm, timeout=0) if traced else world_comm, config)
        self.p.build(
            lambda: MLP(SIZES, seed=0, dtype=np.float32), lambda m: make_optimizer("sgd", m, lr=LR, momentum=0.0)
        )

    def __call__(self, x, y):
        return self.p.step(x, y)

    def flat_weights(self):
        return self.p.full_parameters()

    def describe(self) -> dict:
        p = self.p
        return {"algorithm": p.algorithm, "overlap": p.overlap, "buckets": [int(b.nbytes) for b in p.buckets]}


class TorchDdp:
    """PyTorch DistributedDataParallel over gloo, from dtrain's initial weights."""

    def __init__(self, comm, rank, world):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch = torch
        port = None
        if rank == 0:  # a free port, chosen by rank 0 and told to the others through MPI
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo talks over loopback
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        layers = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(SIZES)):
            layers.append(torch.nn.Linear(n_in, n_out))
            if i < len(SIZES) - 2:
                layers.append(torch.nn.ReLU())
        self.linears = layers[::2]
        model = torch.nn.Sequential(*layers)
        from dtrain.nn import MLP

        with torch.no_grad():  # dtrain's initial weights (torch keeps W as (out, in): transposed)
            for linear, ours in zip(self.linears, MLP(SIZES, seed=0, dtype=np.float32).layers[::2]):
                linear.weight.copy_(torch.from_numpy(ours.weight.data.T.copy()))
                linear.bias.copy_(torch.from_numpy(ours.bias.data))
        self.model = torch.nn.parallel.DistributedDataParallel(model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.0)

    def __call__(self, x, y):
        tx, ty = self.torch.from_numpy(x), self.torch.from_numpy(y)  # no copy
        self.opt.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(self.model(tx), ty)
        loss.backward()
        self.opt.step()
        return loss.item()

    def flat_weights(self):
        parts = []
        for linear in self.linears:
            parts += [linear.weight.detach().numpy().T.ravel(), linear.bias.detach().numpy()]
        return np.concatenate(parts)

    def close(self):
        self.torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------- on every rank
def run_ranks(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    batches = global_batches(rank, world)
    contenders = {"floor": Floor(comm, world), "floor+dtrain-passes": Floor(comm, world, dtrain_passes=True)}
    variants = [v for v in args.variants.split(",") if v]
    for label in variants:
        contenders[label] = Ddp(comm, world, **VARIANTS[label])
    torch_note = None
    if not args.no_torch:
        try:
            contenders["torch"] = TorchDdp(comm, rank, world)
        except ImportError as exc:
            torch_note = f"torch not installed ({exc}): skipping the PyTorch DDP rows"

    # Same arithmetic, same first loss and same weights after one step (a cheap check that we time equal work).
    x0, y0 = batches[0]
    first = {name: c(x0, y0) for name, c in contenders.items()}
    ref_w = contenders["floor"].flat_weights()
    for name, c in contenders.items():
        w = c.flat_weights()
        bad_loss = abs(first[name] - first["floor"]) > 1e-4 * abs(first["floor"])
        bad_w = not np.allclose(w, ref_w, rtol=1e-4, atol=1e-6)
        if bad_loss or bad_w:
            print(
                f"[rank {rank}] {name} does not compute what the floor does: loss {first[name]} vs "
                f"{first['floor']}, max weight difference {np.abs(w - ref_w).max():.3g}",
                flush=True,
            )
            comm.Abort(3)

    names = list(contenders)
    steps = itertools.cycle(batches)

    def timed(name) -> float:
        c = contenders[name]
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            x, y = next(steps)
            c(x, y)
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / args.steps

    for _ in range(args.warmup):  # Numba compiles on first use, torch and MPI set up on first use
        for name in names:
            timed(name)
    for c in contenders.values():
        if isinstance(c, Ddp):
            for key in c.p.timing:
                c.p.timing[key] = 0.0
    times = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(name))

    rows = []
    timed_steps = args.rounds * args.steps
    for name in names:
        c = contenders[name]
        row = {"N": world, "impl": name, "step_s": times[name], "median_step_s": statistics.median(times[name])}
        if isinstance(c, Ddp):
            row.update(c.describe())
            # per step, averaged over ranks: backward, exposed communication, time buckets were in flight and
            # the part of it hidden behind backward
            t = {k: comm.allreduce(v, op=MPI.SUM) / world / timed_steps for k, v in c.p.timing.items()}
            row["per_step_s"] = t
        rows.append(row)
    if "torch" in contenders:
        contenders["torch"].close()
    progress = background_progress(comm, contenders["ddp"].p.buckets[0].nbytes, x0) if world > 1 else None
    if rank == 0:
        Path(args.result).write_text(json.dumps({"rows": rows, "note": torch_note, "progress": progress}))


def background_progress(comm, nbytes: int, x, reps: int = 15) -> dict:
    """Does MPI move a message while the rank computes (what overlapping a bucket with backward relies on)?

    Every rank posts an ``Irecv`` from the left and an ``Isend`` to the right, computes for a few milliseconds
    (three products of layer 1's size: many times the transfer's own time), then asks once with ``Testall``
    whether the exchange is complete. With progress in the background it would be; a small (eager) message is the
    control. Counts are rank 0's.
    """
    from mpi4py import MPI

    rank, world = comm.Get_rank(), comm.Get_size()
    weight = np.ones((x.shape[1], SIZES[1]), np.float32)
    out = {"bytes": nbytes, "reps": reps}
    for label, size in (("small", 4096), ("bucket", nbytes)):
        send = np.ones(size // 4, np.float32)
        recv = np.empty_like(send)
        done, computing = 0, []
        for _ in range(reps):
            comm.Barrier()
            requests = [comm.Irecv(recv, source=(rank - 1) % world), comm.Isend(send, dest=(rank + 1) % world)]
            started = time.perf_counter()
            for _ in range(3):
                x @ weight
            computing.append(time.perf_counter() - started)
            done += bool(MPI.Request.Testall(requests))
            MPI.Request.Waitall(requests)
        out[f"{label}_complete"] = done
        out["compute_s"] = statistics.median(computing)
    return out


def run_torch_training(args) -> None:
    """Torch DDP the way the CLI trains: the CLI's data and loader, 2 epochs, samples/s of the last one."""
    from mpi4py import MPI

    from dtrain.data import ShardedLoader, load_dataset

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    data = load_dataset("synthetic", None, samples=CLI_SAMPLES, features=SIZES[0], classes=SIZES[-1], seed=0)
    loader = ShardedLoader(data.x_train, data.y_train, BATCH, rank, world, seed=0)
    model = TorchDdp(comm, rank, world)
    for epoch in (1, 2):  # as dtrain.train.run_epochs times an epoch: the loop over the loader, nothing else
        started = time.perf_counter()
        losses = [model(x, y) for x, y in loader.epoch(epoch)]
        samples_per_s = len(losses) * BATCH / (time.perf_counter() - started)
        comm.allreduce(float(np.mean(losses)))  # the global loss, as train() computes it between epochs
    model.close()
    if rank == 0:
        Path(args.result).write_text(json.dumps({"samples_per_s": samples_per_s}))


# ------------------------------------------------------------------------------------------- the driver
CLI = (
    "dtrain launch -n {n} -m dtrain train --paradigm ddp --dataset synthetic --features 784 --hidden 512,512 "
    "--batch-size 256 --samples {samples} --epochs 2 --lr 0.05 --momentum 0 --no-progress --quiet --timeout 0"
)


def run_job(launcher, n: int, worker_args: list[str]) -> dict:
    """Run this script's worker on ``n`` ranks; what rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        rc = launcher.launch(n, [__file__, "--worker", "--result", str(result), *worker_args]).returncode
        if rc != 0:
            raise SystemExit(f"benchmark on {n} ranks failed (exit {rc})")
        return json.loads(result.read_text())


def cli_run(n: int, flags: str) -> float:
    """One ``dtrain launch -n N -m dtrain train ...`` run: metrics.json's samples/s of its last epoch."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", *CLI.format(n=n, samples=CLI_SAMPLES).split(), *flags.split(), "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the CLI run on {n} ranks failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads((Path(out) / "metrics.json").read_text())["epochs"][-1]["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=36, help="timed rounds per N, in all jobs (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="consecutive steps per timing (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per job (default %(default)s)")
    parser.add_argument(
        "--jobs", type=int, default=3, help="separate mpiexec jobs per N, each followed by the CLI runs (default 3)"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"ddp rows, from: {', '.join(VARIANTS)} (default: all)"
    )
    parser.add_argument(
        "--cli-flags",
        action="append",
        metavar="FLAGS",
        help="extra flags for a CLI run after each job (repeatable; '' is the defaults; default: one run with '')",
    )
    parser.add_argument("--no-cli", action="store_true", help="skip the CLI runs")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch even if installed")
    parser.add_argument("--out", default="docs/bench", help="folder for ddp.txt and ddp.json (default %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--torch-training", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "ddp" not in variants:
        raise SystemExit(f"--variants: choose from {', '.join(VARIANTS)}, ddp included (got {args.variants!r})")
    if args.worker:
        run_torch_training(args) if args.torch_training else run_ranks(args)
        return
    cli_flags = [] if args.no_cli else (args.cli_flags or [""])

    from dtrain.launch import launcher

    out = Record()

    def say(text="", indent="", hanging="  "):
        out.say(text, indent, hanging)

    per_job = max(1, -(-args.rounds // args.jobs))
    say(
        f"ddp: MLP {'-'.join(map(str, SIZES))}, global batch {BATCH} (256/N per rank), float32, SGD lr {LR}, "
        f"1 thread per rank, {os.cpu_count()} cores"
    )
    say(
        f"{args.jobs} jobs x {per_job} interleaved rounds x {args.steps} steps per N; times are medians over rounds "
        f"of the slowest rank's time per step"
    )
    say(f"command: python {shlex.join(sys.argv)}")
    all_rows, summary, notes = [], {}, []
    started = time.perf_counter()
    for n in [int(v) for v in args.ranks.split(",")]:
        rows, cli, torch_training, progress = [], {flags: [] for flags in cli_flags}, [], []
        for job in range(args.jobs):
            worker = ["--rounds", str(per_job), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            worker += ["--variants", ",".join(variants)] + (["--no-torch"] if args.no_torch else [])
            got = run_job(launcher, n, worker)
            if got["note"] and got["note"] not in notes:
                notes.append(got["note"])
                say(f"({got['note']})")
            rows += [{**row, "job": job} for row in got["rows"]]
            if got["progress"]:
                progress.append(got["progress"])
            # Right after each job: the CLI runs and torch DDP trained the same way, in alternating order, so that
            # each CLI figure has a torch figure measured within seconds of it
            runs = list(cli_flags)
            if cli_flags and any(r["impl"] == "torch" for r in got["rows"]):
                runs.append(None)  # torch
            for flags in runs[:: 1 if job % 2 == 0 else -1]:
                if flags is None:
                    value = run_job(launcher, n, ["--torch-training"])["samples_per_s"]
                else:
                    value = cli_run(n, flags)
                (torch_training if flags is None else cli[flags]).append(value)
        all_rows += rows
        summary[n] = print_table(out, n, rows, cli, torch_training)
        if progress:
            summary[n]["progress"] = median_of(progress)
            say(progress_line(summary[n]["progress"]))
        say(f"({time.perf_counter() - started:.0f} s so far)")
    say()
    for i, line in enumerate(verdict(summary)):
        say(line, "  " if i else "", "      " if i else "  ")
    say(f"(total {time.perf_counter() - started:.0f} s)")

    meta = run_meta(cli_command=CLI.format(n="N", samples=CLI_SAMPLES) + " --out DIR", sizes=SIZES, batch=BATCH, lr=LR,
                    jobs=args.jobs, rounds_per_job=per_job, steps_per_timing=args.steps, numpy=np.__version__,
                    notes=notes)  # fmt: skip
    write_results(args.out, "ddp", {"meta": meta, "summary": summary, "rows": all_rows}, out.text())


def paired(rows, impl, ref, job=None) -> float:
    """Median over rounds of ``ref``'s time / ``impl``'s time in the same round (impl's speed relative to ref's).

    Each ratio compares two measurements taken within a second of each other, so a slow minute on the machine
    cancels out of it (a ratio of the two medians would not be paired that way)."""
    ratios = []
    for a, b in zip([r for r in rows if r["impl"] == impl], [r for r in rows if r["impl"] == ref]):
        if job is None or a["job"] == job:
            ratios += [tb / ta for ta, tb in zip(a["step_s"], b["step_s"])]
    return statistics.median(ratios)


def speeds(ratios: list[float]) -> str:
    """Several speed ratios (see :func:`bench_util.faster`) in words, the direction said once where they share it:
    "1.10, 1.09, 1.10x slower"."""
    words = [faster(r) for r in ratios]
    for way in ("x slower", "x faster"):
        if all(w.endswith(way) for w in words):
            return ", ".join(w.removesuffix(way) for w in words) + way
    return ", ".join(words)


def print_table(out, n, rows, cli, torch_training) -> dict:
    """One table for N ranks (all jobs' rounds together), printed and kept in ``out`` (a Record); the summary for
    ddp.json."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    jobs = sorted({r["job"] for r in rows})
    speed = {i: BATCH / statistics.median([t for r in rows if r["impl"] == i for t in r["step_s"]]) for i in impls}
    out.say()
    out.say(f"## N = {n}" + (" (more ranks than cores)" if n > (os.cpu_count() or 1) else ""))
    header = ["impl", "step ms", "samples/s", "vs torch", "vs floor", "per job vs floor", "all-reduce", "buckets",
              "wait ms", "in bwd ms"]  # fmt: skip
    cells = []
    for i in impls:
        vs_torch = "-" if "torch" not in speed or i == "torch" else faster(paired(rows, i, "torch"))
        vs_floor = "-" if i == "floor" else faster(paired(rows, i, "floor"))
        per_job = "-" if i == "floor" else speeds([paired(rows, i, "floor", job) for job in jobs])
        extra = ["", "", "", ""]
        if i.startswith("floor"):
            extra[:2] = ["MPI", "1"]
        elif i == "torch":
            extra[0] = "gloo"
        else:
            r = next(r for r in rows if r["impl"] == i)
            algorithm = (
                "-" if n == 1 else r["algorithm"] + (" (nb)" if r["overlap"] and r["algorithm"] == "ring" else "")
            )
            extra[:2] = [algorithm, str(len(r["buckets"]))]
            if n > 1:  # per step, mean over ranks and jobs
                t = {k: statistics.mean(r["per_step_s"][k] for r in rows if r["impl"] == i) for k in r["per_step_s"]}
                extra[2:] = [f"{1e3 * t['exposed_comm_s']:.2f}", f"{1e3 * t['hidden_s']:.2f}"]
        cells.append([i, f"{1e3 * BATCH / speed[i]:.2f}", f"{speed[i]:,.0f}", vs_torch, vs_floor, per_job, *extra])
    if "torch" not in speed:  # (no torch column)
        header, cells = [h for h in header if h != "vs torch"], [[c for k, c in enumerate(line) if k != 3]
                                                                 for line in cells]  # fmt: skip
    out.table(header, cells, left=(0, len(header) - 5, len(header) - 4))
    result = {"samples_per_s": speed, "over_floor": {i: paired(rows, i, "floor") for i in impls}}
    result["ddp_over_floor"] = result["over_floor"]["ddp"]
    line = f"ddp {faster(result['ddp_over_floor'], 'the floor')}"
    if "torch" in speed:
        result["over_torch"] = {i: paired(rows, i, "torch") for i in impls}
        result["ddp_over_torch"] = result["over_torch"]["ddp"]
        result["floor_over_torch"] = result["over_torch"]["floor"]
        line = (f"ddp {faster(result['ddp_over_torch'], 'torch DDP')}, {line.removeprefix('ddp ')}; the floor "
                f"{faster(result['floor_over_torch'], 'torch DDP')}")  # fmt: skip
    out.say(line + " (medians of per-round ratios)", hanging="  ")
    result["cli"] = {}
    if torch_training:
        result["torch_training_samples_per_s"] = torch_training
        out.say(
            f"torch DDP trained as the CLI trains (same data and loader, last of 2 epochs): "
            f"{statistics.median(torch_training):,.0f} samples/s ("
            + ", ".join(f"{v:,.0f}" for v in torch_training)
            + ")",
            hanging="  ",
        )
    for flags, values in cli.items():
        entry = {"samples_per_s": values, "median_samples_per_s": statistics.median(values)}
        text = f"CLI{' ' + flags if flags else ''}: {entry['median_samples_per_s']:,.0f} samples/s (last epoch; "
        text += ", ".join(f"{v:,.0f}" for v in values) + ")"
        if torch_training:  # each CLI run against the torch run next to it, then the median
            entry["over_torch"] = statistics.median(a / b for a, b in zip(values, torch_training))
            text += f"; {faster(entry['over_torch'], 'torch DDP')} (same pipeline, run beside it)"
        entry["over_ddp_step_loop"] = entry["median_samples_per_s"] / speed["ddp"]
        text += f"; {faster(entry['over_ddp_step_loop'], 'the ddp step loop')}"
        result["cli"][flags] = entry
        out.say(text, hanging="  ")
    return result


def median_of(dicts: list[dict]) -> dict:
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}


def progress_line(p: dict) -> str:
    return (
        f"MPI progress: after {1e3 * p['compute_s']:.1f} ms of computing, an Isend/Irecv pair of "
        f"{p['bytes'] / 1e6:.2f} MB (bucket 0) was complete at the first Test in {p['bucket_complete']:g} of "
        f"{p['reps']} tries; one of 4 KB in {p['small_complete']:g} (rank 0, median over jobs)"
    )


def verdict(summary) -> list[str]:
    """The targets, a line each: ddp (its defaults: under mpiexec on one node, ``auto`` gives its gradients shared
    memory) at least 2x faster than torch DDP, and at least as fast as the floor."""
    out = ["targets (N = 2 and 4): ddp 2x faster than torch DDP or more, and at least as fast as the floor:"]
    for n, s in summary.items():
        if n == 1:
            continue
        ok = "met" if s["ddp_over_floor"] >= 1.0 else "MISSED"
        parts = [f"ddp {faster(s['ddp_over_floor'], 'the floor')} ({ok})"]
        if "ddp_over_torch" in s:
            ok = "met" if s["ddp_over_torch"] >= 2.0 else "MISSED"
            parts.insert(0, f"ddp {faster(s['ddp_over_torch'], 'torch DDP')} ({ok})")
        for flags, entry in s["cli"].items():
            if "over_torch" in entry:
                ok = "met" if entry["over_torch"] >= 2.0 else "MISSED"
                parts.append(f"CLI{' ' + flags if flags else ''} {faster(entry['over_torch'], 'torch DDP')} ({ok})")
        out.append(f"N = {n}: " + "; ".join(parts))
    return out


if __name__ == "__main__":
    main()

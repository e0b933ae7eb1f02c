"""Lesson 3: data parallelism on real MPI ranks. Every rank holds the whole model and trains on a slice of the batch.

Each step, every rank computes the gradient of its own slice of the global batch, the ranks average those gradients
with an all-reduce (lesson 2), and every rank takes the same optimizer step (dtrain/parallel/data_parallel.py):

    dtrain launch -n 4 lessons/03_data_parallel.py
    dtrain launch -n 2 lessons/03_data_parallel.py
    dtrain launch -n 4 lessons/03_data_parallel.py --trace ddp.json     # one step on every rank, for Perfetto
`--device gpu` runs the same on GPUs (one per rank, rank % GPUs); section 5's cost model still prices host-to-host MPI.

What you will see:
  1. why it works: the average of the ranks' slice gradients IS the global batch's gradient (in float64, to ~1e-16);
  2. one training run on 1, 2 and 4 ranks: the loss curves side by side, equal up to float32 rounding, and the
     samples per second of each;
  3. bytes per step: what the tracer counted on every rank, against DataParallel.costs() and the formula
     2(p-1)/p n, with one bucket and with a bucket per layer;
  4. buckets and overlap: when each bucket's all-reduce was in flight against backward, on every rank, for one step;
     and what overlapping bought on this machine, measured with overlap on against off;
  5. when NOT to distribute: a small model timed on 1, 2 and 4 ranks against a 784-512-512 one, and why:
     communication per step against computation per step.

Runs on fewer ranks than were launched (1 and 2 of 4) use sub-communicators (``comm.Split``); the ranks left out
wait in a barrier that sleeps, so that they leave the cores to the ranks at work. Every timing is measured in this
run, with the variants compared interleaved (step by step or round by round), so that a machine whose speed drifts
slows them alike. What is printed as a conclusion follows from the numbers above it. With more ranks than cores
(4 ranks on 2 cores) a rank often waits for a core rather than for a message: see docs/benchmarks.md.

Things to try:
  * --batch-size 480: ten times the samples per step for the same bytes per step; does 4 ranks still lose?
  * --bucket-mb 0: one bucket, which can only start when the whole backward is done: nothing to overlap;
  * dtrain launch -n 2: one core per rank, no waiting for a core;
  * --trace ddp.json, then https://ui.perfetto.dev: each rank's backward, its buckets, every message.

Exercises (`dtrain exercises init ex` once, then `dtrain exercises check 3.1 --path ex`; one process, no ranks):
  3.1  ex/buckets.py: buckets_to_start(missing, started, bucket) -> list[int], the decision DDP's bucket-ready hook
       takes (dtrain/parallel/buckets.py): count the ready parameter off, return the buckets that start now, strictly
       in order; checked against a replay of random readiness orders over random bucket plans.
  3.2  ex/buckets.py: plan_buckets(parameters, bucket_bytes), cutting the flat gradient into buckets in reverse
       parameter order; checked against hand-computed plans and the plan's rules on random layouts.
"""

import argparse
import itertools
import statistics
import time

import numpy as np
from lesson_util import (
    Checks,
    add_device_flag,
    conclude,
    heading,
    lesson_xp,
    parse_and_start,
    refuse_bad_arguments,
    say,
    sleeping_barrier,
    table,
)

from dtrain import collectives, terminal
from dtrain.autograd import Tensor, softmax_cross_entropy
from dtrain.backend import to_host
from dtrain.collectives import costmodel
from dtrain.comm import mpi, usable_cores
from dtrain.comm.prepare import prepare
from dtrain.comm.trace import write_chrome_trace
from dtrain.config import TrainConfig
from dtrain.data import ShardedLoader, load_dataset
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import parameter_count
from dtrain.parallel.buckets import plan_buckets
from dtrain.parallel.data_parallel import DataParallel
from dtrain.train import train

parser = argparse.ArgumentParser(description="Lesson 3: data parallelism on MPI ranks")
parser.add_argument("--epochs", type=int, default=5, help="epochs of section 2's training runs (default %(default)s)")
parser.add_argument("--batch-size", type=int, default=48, help="global batch on digits (default %(default)s)")
parser.add_argument("--big-batch", type=int, default=768, help="global batch of the big model (default %(default)s)")
parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (default %(default)s)")
parser.add_argument("--bucket-mb", type=float, default=0.01, help="bucket size, MiB (default: one bucket per layer)")
parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of section 4's step")
parser.add_argument("--json", metavar="PATH", help="write every measurement to this file (the notebook draws them)")
add_device_flag(parser)

args, world, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
from mpi4py import MPI  # for MPI.UNDEFINED, MPI.MAX (MPI has started by now)

refuse_bad_arguments([(
    args.batch_size % p or args.big_batch % p or args.epochs < 1 or args.steps < 4 or args.bucket_mb < 0,
    f"--batch-size {args.batch_size} and --big-batch {args.big_batch} must be divisible by the {p} ranks (each "
    "takes an equal slice), --epochs >= 1, --steps >= 4, --bucket-mb >= 0",
)])  # fmt: skip
xp = lesson_xp(args, world)  # numpy, or cupy on this rank's GPU (--device gpu)

RANKS = sorted({k for k in (1, 2, 4) if k < p} | {p})  # the world sizes compared: 1, 2, 4 (and p)
OVERSUBSCRIBED = p > usable_cores()  # more ranks than cores: a rank often waits for a core, not for a message
B, BIG_B = args.batch_size, args.big_batch
digits = load_dataset("digits")
wide = load_dataset("synthetic", samples=4 * BIG_B, features=784)  # MNIST-sized inputs, for a big model
SMALL = [digits.n_features, 32, digits.n_classes]  # 64-32-10: 2,410 parameters
BIG = [wide.n_features, 512, 512, wide.n_classes]  # 784-512-512-10: 669,706 parameters
results = {"world": p, "ranks": RANKS}  # every measurement, for --json
checks = Checks(world)  # each claim checked on every rank, and printed: checks.ok(claim, flag)


def name(sizes) -> str:
    return "-".join(map(str, sizes))


FIRST = {k: world.Split(0 if rank < k else MPI.UNDEFINED, rank) for k in RANKS}  # ranks 0..k-1; others: COMM_NULL


def on_first(k: int, work):
    """Run ``work(sub)`` on ranks 0..k-1 (``sub``: their communicator) while the others sleep; its result, or None."""
    result = work(FIRST[k]) if rank < k else None
    sleeping_barrier(world)
    return result


mpi.print0(terminal.paragraph(f"Lesson 3: data parallelism on {p} rank(s); runs on {', '.join(map(str, RANKS))} rank(s)"
                               " compared"))  # fmt: skip

# ------------------------------------------------------------------------ 1. the average IS the big-batch gradient
# The global batch's loss is the mean of its B per-sample losses. Cut into p equal slices, that is the mean over
# ranks of each slice's mean loss; and the gradient of a mean is the mean of the gradients. So the all-reduced
# average of the slice gradients must be the gradient one process computes on the whole batch. In float64 we see
# that it is, to the last bits (the additions merely happen in another order). Equal slices matter: a mean of means
# of unequal slices is not the mean (that is why the global batch must divide by p, see dtrain/data.py).
heading(f"1. One global batch of {B} digits, {B // p} per rank: the average of the slice gradients")
x64 = digits.x_train.astype(np.float64)
x_mine, y_mine = next(ShardedLoader(x64, digits.y_train, B, rank, p, seed=0, xp=xp).epoch(1))  # my slice of batch 0
x_all, y_all = next(ShardedLoader(x64, digits.y_train, B, seed=0, xp=xp).epoch(1))  # the whole of batch 0


def gradient(x, y):
    """Loss and flat gradient of the mean loss over (x, y); seed 0, so every rank starts from the same weights."""
    model = MLP(SMALL, seed=0, dtype=np.float64, xp=xp)
    loss = softmax_cross_entropy(model(Tensor(x)), y)
    loss.backward()
    return float(loss.data), model.flat_grads.copy()


full_loss, full_grad = gradient(x_all, y_all)  # one process, the whole batch (every rank can compute it)
my_loss, my_grad = gradient(x_mine, y_mine)
# (CuPy gradients reach MPI through a prepared world: staged through host memory unless MPI is CUDA-aware)
gpu_world = prepare(world, device="gpu") if args.device == "gpu" else world
averaged = collectives.allreduce(gpu_world, my_grad.copy(), "avg", "ring")  # what data parallelism computes
mean_loss = float(collectives.allreduce(world, np.array([my_loss]), "avg", "ring")[0])
my_grad, full_grad, averaged = to_host(my_grad), to_host(full_grad), to_host(averaged)  # compared with NumPy
own_error, error = np.abs(my_grad - full_grad).max(), np.abs(averaged - full_grad).max()
rows = world.gather((own_error, error), root=0)
if rank == 0:
    say("How far from the whole batch's gradient (largest difference):")
    table(["rank", "its own slice's gradient", "the average"],
          [[str(r), f"{own:.3f}", f"{avg:.1e}"] for r, (own, avg) in enumerate(rows)], left=())  # fmt: skip
    say(f"loss: mean of the {p} slice losses {mean_loss:.15f}, whole batch {full_loss:.15f}")
    results["gradient"] = {
        "max_difference": max(avg for _, avg in rows),
        "own_slice_difference": [own for own, _ in rows],
        "loss_difference": abs(mean_loss - full_loss),
    }
checks.ok("the average of the slice gradients is the whole batch's gradient",
          error < 1e-12 and abs(mean_loss - full_loss) < 1e-12)  # fmt: skip

# ----------------------------------------------------------------------------- 2. one training run, 1, 2, 4 ranks
# The same run (seed, global batch, learning rate) on 1, 2 and 4 ranks, through dtrain's driver: the loss curves
# must coincide. In float32 the all-reduce adds the slices' gradients in another order than one process's matrix
# product adds the samples', so they agree to ~1e-8, not to the bit (the weights' digests differ).
heading(f"2. Training {name(SMALL)} on digits, global batch {B}, {args.epochs} epochs, on each of {RANKS} ranks")
config = TrainConfig(paradigm="ddp", epochs=args.epochs, hidden=tuple(SMALL[1:-1]), batch_size=B,
                     allreduce="ring", progress=False, quiet=True, device=args.device)  # fmt: skip
runs = {k: on_first(k, lambda sub: train(config, sub)) for k in RANKS}
training_ok = True
if rank == 0:
    curves = {k: [e["train_loss"] for e in runs[k]["epochs"]] for k in RANKS}
    table(["epoch", *(f"loss on {k}" for k in RANKS), *(f"test accuracy on {k}" for k in RANKS)],
          [[str(e + 1), *(f"{curves[k][e]:.9f}" for k in RANKS),
            *(f"{100 * runs[k]['epochs'][e]['test_accuracy']:.2f}%" for k in RANKS)] for e in range(args.epochs)],
          left=(), groups=(1, 1 + len(RANKS)))  # fmt: skip
    spread = max(abs(a - b) for k in RANKS for a, b in zip(curves[k], curves[1]))
    speeds = ", ".join(f"{k} rank(s) {runs[k]['samples_per_s']:,.0f}" for k in RANKS)
    say(f"largest difference from the 1-rank curve: {spread:.1e}; samples/s: {speeds}")
    results["training"] = {
        str(k): {
            "train_loss": curves[k],
            "test_accuracy": [e["test_accuracy"] for e in runs[k]["epochs"]],
            "samples_per_s": runs[k]["samples_per_s"],
            "weights_sha256": runs[k]["weights_sha256"],
        }
        for k in RANKS
    }
    training_ok = spread < 1e-5
checks.ok(f"the loss curves on {RANKS} ranks agree", training_ok)


# ------------------------------------------------------ the tool of sections 3-5: DataParallel driven by hand
class Run:
    """One data-parallel training run on the ranks of ``comm``, stepped by hand, each step timed."""

    def __init__(self, comm, sizes, data, batch, overlap=True, bucket_mb=1.0, warmup=3):
        self.comm = prepare(comm, device=args.device)  # the tracer (and the watchdog, if armed; GPU: the staging)
        self.config = TrainConfig(paradigm="ddp", hidden=tuple(sizes[1:-1]), batch_size=batch, allreduce="ring",
                                  bucket_mb=bucket_mb, overlap=overlap, device=args.device)  # fmt: skip
        self.ddp = DataParallel(self.comm, self.config)
        self.ddp.build(lambda: MLP(sizes, seed=0, xp=xp), lambda model: make_optimizer("sgd", model, 0.05, 0.9))
        index, count = self.ddp.batch_slice
        loader = ShardedLoader(data.x_train, data.y_train, batch, index, count, xp=xp)
        self.batches = itertools.cycle(list(loader.epoch(1)))
        for _ in range(warmup):  # Numba's first calls, MPI's first connections: not what we measure
            self.ddp.step(*next(self.batches))
        self.comm.tracer.reset()
        self.timing_before, self.times, self.busy, self.events = dict(self.ddp.timing), [], [], []

    def steps(self, count: int) -> None:
        for _ in range(count):
            x, y = next(self.batches)
            self.comm.Barrier()  # the ranks start each step together; a step ends when the slowest rank's does
            mark, waited, start = len(self.comm.tracer.events), self.ddp.timing["exposed_comm_s"], time.perf_counter()
            self.ddp.step(x, y)
            if xp is not np:  # a GPU step ends when its kernels have run, not when Python has queued them
                xp.cuda.get_current_stream().synchronize()
            elapsed, waited = time.perf_counter() - start, self.ddp.timing["exposed_comm_s"] - waited
            self.times.append(self.comm.allreduce(elapsed, op=MPI.MAX))  # the step's time: its slowest rank's
            self.busy.append(self.comm.allreduce(elapsed - waited, op=MPI.MAX))  # the busiest rank's own work
            self.events = self.comm.tracer.events[mark:]  # the last step's messages and spans

    def figures(self) -> dict:
        """This rank's figures per step: ms (median, slowest rank), bytes and messages sent, DataParallel's timing."""
        steps, totals = len(self.times), self.comm.tracer.summary()["totals"]
        t = self.ddp.timing
        return {
            "ms_per_step": 1e3 * statistics.median(self.times),
            "rest_ms": 1e3 * statistics.median(self.busy),  # <= ms_per_step, as each step's busy <= its time
            "bytes_per_step": totals["bytes_sent"] // steps,
            "messages_per_step": totals["messages_sent"] // steps,
            "buckets": [int(b.nbytes) for b in self.ddp.buckets],
            **{k: 1e3 * (t[k] - self.timing_before[k]) / steps for k in t},  # backward_s, exposed_comm_s, ... (ms)
        }

    def timeline(self) -> dict:
        """The last step's spans, as DataParallel put them on the tracer's timeline: "backward", and "bucket b in
        flight" from the start of its all-reduce to its end; {name: (start, end)} in microseconds."""
        return {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in self.events if e["cat"] == "span"}


def mean_over_ranks(rows: list, key: str) -> float:
    return statistics.mean(row[key] for row in rows)


# ------------------------------------------------------------------------------------------- 3. bytes per step
# With the ring each rank sends 2(p-1)/p of an n-byte buffer, whatever p (lesson 2); data parallelism does that once
# per bucket per step, so buckets change the number of messages (2(p-1) per bucket), not the bytes. The tracer
# counts; DataParallel.costs() predicts, exactly, chunk by chunk; the formula is exact up to one element per chunk.
n = parameter_count(BIG) * 4
heading(f"3. Bytes sent per step by each rank: {name(BIG)}, n = {n:,} bytes of gradients, {p} rank(s)")
bytes_ok, results["bytes"] = True, []
for bucket_mb in (0.0, args.bucket_mb):
    run = Run(world, BIG, wide, BIG_B, bucket_mb=bucket_mb, warmup=1)
    run.steps(2)
    mine = run.figures()
    everyone = world.gather(mine, root=0)
    if rank == 0:
        measured = [f["bytes_per_step"] for f in everyone]
        messages = [f["messages_per_step"] for f in everyone]
        predicted = DataParallel.costs(BIG, p, run.config)["sent_per_step"]
        m = len(mine["buckets"])
        formula = sum(2 * (p - 1) / p * b for b in mine["buckets"])
        say(f"{m} bucket(s) of {', '.join(f'{b:,}' for b in mine['buckets'])} bytes:")
        table(["rank", "tracer", "costs()", "2(p-1)/p n", "messages"],
              [[str(r), f"{measured[r]:,d}", f"{predicted[r]:,d}", f"{formula:,.0f}", str(messages[r])]
               for r in range(p)], left=())  # fmt: skip
        exact = measured == predicted and messages == [2 * (p - 1) * m] * p
        close = all(abs(b - formula) <= 2 * 4 * m for b in measured)  # < one float32 per phase and bucket
        bytes_ok = bytes_ok and exact and close
        results["bytes"].append(
            {"buckets": mine["buckets"], "measured": measured, "costs": predicted, "formula": formula,
             "messages": messages}
        )  # fmt: skip
checks.ok("bytes per step match DataParallel.costs() and 2(p-1)/p n on every rank", bytes_ok)

# --------------------------------------------------------------------------------- 4. buckets, overlap, timeline
# Backward produces gradients last layer first. With a bucket per layer, the last layer's bucket can start its
# all-reduce while backward is still computing the earlier layers' gradients. Where each bucket lies:
heading(f"4. Buckets and overlap: {name(BIG)}, global batch {BIG_B}, {p} rank(s), --bucket-mb {args.bucket_mb:g}")
model = MLP(BIG, seed=0, xp=xp)
layout = [(where.start, where.stop - where.start, 4) for where in model.param_slices.values()]
names = list(model.param_slices)
table(["bucket", "flat_grads slice", "bytes", "parameters"],
      [[str(b), f"[{start:,}:{stop:,}]", f"{4 * (stop - start):,}", ", ".join(names[i] for i in sorted(members))]
       for b, (start, stop, members) in enumerate(plan_buckets(layout, int(args.bucket_mb * (1 << 20))))],
      left=(1, 3), wrap=(3,))  # fmt: skip

if p == 1:
    say("one rank: nothing to all-reduce, so no timeline (run with dtrain launch -n 2 or more)")
else:
    # The same steps with overlap on and off, interleaved step by step so both see the same machine.
    on, off = (Run(world, BIG, wide, BIG_B, overlap=o, bucket_mb=args.bucket_mb) for o in (True, False))
    for _ in range(args.steps):
        on.steps(1)
        off.steps(1)
    figures = {"on": world.gather(on.figures(), root=0), "off": world.gather(off.figures(), root=0)}
    timelines, events = world.gather(on.timeline(), root=0), world.gather(on.events, root=0)
    if rank == 0:
        # A picture of the last step with overlap, in text: a line per rank and span, "#" backward, "0" bucket 0 ...
        # As wide as the terminal allows, 64 characters at most: 31 go to the indent, the names and the two bars.
        origin = min(lo for t in timelines for lo, _ in t.values())
        end = max(hi for t in timelines for _, hi in t.values())
        label = max(len(span) for t in timelines for span in t)
        width = max(16, min(64, (terminal.columns() or 100) - (3 + 7 + label + 3)))
        scale = width / (end - origin)
        say(f"the last step with overlap on ({(end - origin) / 1e3:.1f} ms), as DataParallel put it on the timeline:")
        for r, t in enumerate(timelines):
            for i, (span, (lo, hi)) in enumerate(sorted(t.items(), key=lambda item: item[1])):
                a = min(int((lo - origin) * scale), width - 1)
                mark = "#" if span == "backward" else span.split()[1][-1] if span.startswith("bucket") else "*"
                cells = (" " * a + mark * max(1, int((hi - origin) * scale) - a)).ljust(width)
                print(f"   {f'rank {r}' if i == 0 else '':6s} {span:{label}s} |{cells}|")
        results["timeline"] = [
            {span: [(v - origin) / 1e3 for v in times] for span, times in t.items()} for t in timelines
        ]

        # What the ranks measured (DataParallel's own timing, mean over ranks, ms per step)
        print()
        say("What the ranks measured, ms per step (the step: the slowest rank's; the rest: DataParallel's own"
            " timing, the mean over ranks):")  # fmt: skip
        cells = []
        for variant, rows in figures.items():
            mean = {k: mean_over_ranks(rows, k) for k in ("backward_s", "exposed_comm_s", "in_flight_s", "hidden_s")}
            ms = [rows[0]["ms_per_step"], *mean.values()]
            cells.append([f"overlap {variant}", *(f"{v:.2f}" for v in ms)])
            results.setdefault("overlap", {})[variant] = {"ms_per_step": rows[0]["ms_per_step"], **mean}
        table(
            ["", "whole step", "backward", "waiting after it", "buckets in flight", "of which during backward"], cells
        )
        with_, without = figures["on"][0]["ms_per_step"], figures["off"][0]["ms_per_step"]
        fraction = mean_over_ranks(figures["on"], "hidden_s") / mean_over_ranks(figures["on"], "in_flight_s")
        change = (without - with_) / without
        verdict = (
            f"saved {100 * change:.0f}% of the step" if change > 0.05
            else f"cost {100 * -change:.0f}% more per step" if change < -0.05
            else f"made no clear difference ({100 * change:+.0f}%)"
        )  # fmt: skip
        results["overlap"]["fraction"], results["overlap"]["saved"] = fraction, change
        say(f"overlap_fraction {fraction:.2f}: the share of the buckets' time in flight during which backward was"
            f" still running. Against all-reduces after backward, overlap {verdict} here (median step of"
            f" {args.steps}, overlap on and off interleaved step by step).")  # fmt: skip
        # Why time in flight says little about bytes moved, on a CPU (see data_parallel.py and docs/benchmarks.md)
        say(
            "In flight is not moving: a bucket's ring advances only when its rank calls into MPI (in the gradient-"
            "ready hooks, between layers), and MPICH copies an intra-node message in the receiving process, inside "
            "those calls: while a rank computes, its messages wait."
            + (" With more ranks than cores, no core is idle to move them either." if OVERSUBSCRIBED else "")
            + " Overlap pays where something else moves the bytes while the processor computes: a GPU with NCCL."
        )
        if args.trace:  # every rank's row: its backward, its buckets in flight, every message
            write_chrome_trace(args.trace, events)
            say(f"that step's trace written to {args.trace}: open https://ui.perfetto.dev and drag the file in")

# ----------------------------------------------------------------------------------- 5. when not to distribute
# Per step each rank computes forward and backward on its B/p samples, about 6 N B/p floating-point operations for N
# parameters, then waits for one all-reduce of the whole gradient: 2(p-1)/p 4N bytes and 2(p-1) latencies per bucket.
# More ranks divide the arithmetic, not the all-reduce. For an MLP both grow with N, so what decides is the number of
# samples each rank computes on per step, against the costs that do not shrink: latencies, and Python's overhead per
# step. Timed for a small model on a small batch and a big one on a big batch; the world sizes interleaved round by
# round (the ranks not in a round sleep).
rounds = 4
heading(f"5. When not to distribute: ms per step on {RANKS} ranks (median of {rounds * (args.steps // rounds)} steps,"
        " slowest rank)")  # fmt: skip
timing = []
for sizes, data, batch in ((SMALL, digits, B), (BIG, wide, BIG_B)):
    runs = {k: on_first(k, lambda sub, s=sizes, d=data, b=batch: Run(sub, s, d, b)) for k in RANKS}
    for _ in range(rounds):
        for k in RANKS:
            on_first(k, lambda sub, run=runs[k]: run.steps(args.steps // rounds))
    for k in RANKS:
        rows = on_first(k, lambda sub, run=runs[k]: sub.gather(run.figures(), root=0))
        if rank == 0:
            grad_bytes = parameter_count(sizes) * 4
            timing.append({
                "model": name(sizes), "gradient_bytes": grad_bytes, "batch": batch, "ranks": k,
                "mflop_per_rank": 6 * parameter_count(sizes) * batch / k / 1e6,
                "ms_per_step": rows[0]["ms_per_step"], "rest_ms": rows[0]["rest_ms"],
                "waiting_ms": rows[0]["ms_per_step"] - rows[0]["rest_ms"],
                "model_ms": 1e3 * costmodel.predict_time("ring", grad_bytes, k) if k > 1 else 0.0,
            })  # fmt: skip
if rank == 0:
    cells = []
    for t in timing:
        one = next(u for u in timing if u["model"] == t["model"] and u["ranks"] == 1)
        t["speedup"] = one["ms_per_step"] / t["ms_per_step"]
        cells.append([t["model"], str(t["ranks"]), str(t["batch"]), f"{t['gradient_bytes']:,d}",
                      f"{t['mflop_per_rank']:.2f}", f"{t['ms_per_step']:.2f}", f"{t['rest_ms']:.2f}",
                      f"{t['waiting_ms']:.2f}", f"{t['model_ms']:.2f}",
                      terminal.speed(t["ms_per_step"], one["ms_per_step"]) if t["ranks"] > 1 else "-"])  # fmt: skip
    # The model and the ranks name a row; what a step computes, then what it took (a second table if need be)
    table(["model", "ranks", "batch", "gradient bytes", "MFLOP per rank", "ms per step", "rest", "waiting",
           "cost model", "vs 1 rank"], cells, keys=2, groups=(5,))  # fmt: skip
    say(
        "(MFLOP per rank ~ 6 N B/p; times in ms; rest: the busiest rank's forward, backward and update, i.e. its step"
        " but for its wait after backward; waiting = ms per step - rest; cost model: the ring all-reduce of the"
        " gradient as costmodel.predict_time prices it; vs 1 rank: the step against the same model's on one rank)"
    )
    results["timing"] = timing
    for model_name in dict.fromkeys(t["model"] for t in timing if p > 1):
        mine = [t for t in timing if t["model"] == model_name]
        best = max(mine, key=lambda t: t["speedup"])
        worst = min(mine, key=lambda t: t["speedup"])
        one_ms = mine[0]["ms_per_step"]
        if best["ranks"] == 1:
            say(f"{model_name}: fastest on ONE rank; on {worst['ranks']} ranks"
                f" {terminal.speed(worst['ms_per_step'], one_ms, 'one rank')}")  # fmt: skip
        else:
            say(f"{model_name}: fastest on {best['ranks']} ranks,"
                f" {terminal.speed(best['ms_per_step'], one_ms, 'one rank')}")  # fmt: skip
        # Did the ranks' arithmetic run in parallel? k ranks compute 1/k of the batch each: on k free cores the rest
        # of the step (all but the waiting) gets up to k times faster. Less: the cores were not free (more ranks than
        # cores, or other programs), or the step is mostly fixed overhead that does not divide.
        rest = ", ".join(f"on {t['ranks']} ranks {terminal.speed(t['rest_ms'], one_ms, 'one rank')}" for t in mine[1:])
        mpi.print0(terminal.paragraph(f"without the waiting, its step ran {rest}; {usable_cores()} cores allow"
                                      f" {min(usable_cores(), p)}x faster at most", "      "))  # fmt: skip
    why = (
        "Each rank's arithmetic shrinks with p, the all-reduce does not: 2(p-1) latencies and 2(p-1)/p n bytes per"
        " rank per step, however little there is to compute"
    )
    if OVERSUBSCRIBED:
        why += (
            f" (and with {p} ranks on {usable_cores()} cores, each latency can be a wait for a descheduled neighbour)"
        )
    small = [t for t in timing if t["model"] == name(SMALL)]  # 1 rank first, p ranks last
    if p > 1:
        step, wait = small[0]["ms_per_step"], small[-1]["waiting_ms"]
        why += (
            f". The small model's whole step takes {step:.2f} ms on one rank; on {p} ranks each step waits"
            f" {wait:.2f} ms for the all-reduce alone" + (": distributing it only adds waiting" if wait > step else "")
        )
    say(
        why + ". Distribute when a step's arithmetic dwarfs its all-reduce: many samples per rank per step (for an"
        " MLP the arithmetic and the bytes both grow with the parameters, so the batch decides), and a core or a GPU"
        " per rank."
    )

mpi.print0()
mpi.print0(terminal.paragraph("Exercises: `dtrain exercises init ex` once, then each of these commands grades one"
                              " function of yours in ex/buckets.py:"))  # fmt: skip
for exercise, what in (("3.1", "buckets_to_start(missing, started, bucket): which buckets a gradient hook may start,"
                               " in order"), ("3.2", "plan_buckets(parameters, bucket_bytes)")):  # fmt: skip
    mpi.print0(f"  dtrain exercises check {exercise} --path ex")
    mpi.print0(terminal.paragraph(what, "      "))
conclude(args.json, results, checks)

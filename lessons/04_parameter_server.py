"""Lesson 4: parameter servers on real MPI ranks. The parameters live on servers; workers pull, compute and push.

The last S ranks are servers, each owning a slice (shard) of the flat parameter buffer and its optimizer state; the
first W = p - S ranks are workers, which hold the whole model for forward and backward but no optimizer state. Each
step a worker pushes its gradient to the servers and gets the new weights back (dtrain/parallel/parameter_server.py;
the server's loop, one method per message, in ps_server.py):

    dtrain launch -n 4 lessons/04_parameter_server.py          # 3 workers and 1 server (2 and 2 in the S=2 runs)
    dtrain launch -n 3 lessons/04_parameter_server.py          # the least: 2 workers and a server
    dtrain launch -n 5 lessons/04_parameter_server.py --quick
`--device gpu` runs the same on GPUs (one per rank, rank % GPUs), servers included; the checks read host copies.

What you will see:
  1. the roles and the protocol: which rank does what, the first and last messages of a real run drawn as a sequence
     diagram from its trace, and ps-sync's final weights equal to one process training on the whole global batch
     (float64, to ~1e-16 relative), with one server and with two;
  2. synchronous against asynchronous: loss and test accuracy per epoch of ps-sync, ps-async, ps-async with a
     staleness bound, and ddp on the same ranks; and ps-async with bound 0 and no momentum equal to ps-sync;
  3. staleness: how many updates landed between the weights a worker computed on and the arrival of its gradient,
     as a histogram, against the number of pushes the tracer counted and the bound (W-1)(2K+1);
  4. a straggler: one worker 3 times slower, ps-sync against ps-async, on a workload whose steps are mostly
     arithmetic and on the digits, whose steps are mostly overhead;
  5. the server's link: bytes sent per step by every rank, from the tracer, against ParameterServer.costs() and a
     ring all-reduce's 2(p-1)/p n per rank; sharding the parameters over S servers divides the server's bytes by S.
  6. central storage (TensorFlow's CentralStorageStrategy): every rank computes, rank 0 alone holds the optimizer
     state and updates; equal to one process, its bytes per step and its optimizer state equal to its costs().

Every check compares with an independent oracle (one process's training, the tracer's counts, a formula) and prints an
OK line (FAIL if it does not hold); the last line says whether all passed (the exit status is non-zero if not).
Asynchronous runs are not reproducible: which worker's push lands first depends on the scheduler, so their numbers
differ from run to run. Timings are printed, never checked: speed belongs to benchmarks (docs/benchmarks.md). With more
ranks than cores (4 ranks on 2 cores) a rank often waits for a core rather than for a message.

Things to try:
  * --quick: one epoch of each straggler workload instead of two (what the notebook and the tests run);
  * dtrain launch -n 6: 5 workers through one server's link, against 4 and 2 through two;
  * dtrain train --paradigm ps-async --staleness 1 --slow-rank 1 --slow-factor 5: the bound makes the fast workers
    wait for the straggler, and the staleness histogram shrinks (see metrics.json, docs/metrics.md).

Exercises (write them yourself; `dtrain exercises init ex` once copies the stubs
into ex/), each graded by the command under it:
  4.1  a worker's push and pull: each server its slice of the gradient (PUSH),
       its slice of the weights back (WEIGHTS), all in flight together:
       dtrain exercises check 4.1 --path ex
  4.2  the stale-synchronous gate: which held workers a server may answer,
       within K steps of the slowest:
       dtrain exercises check 4.2 --path ex
4.1 runs on simulated ranks and under mpiexec, the checker's own servers on the
last ranks; 4.2 in one process.
"""

import argparse
import json
import math
import os
import shutil
import tempfile

import numpy as np
from lesson_util import (
    Checks,
    add_device_flag,
    conclude,
    heading,
    lesson_xp,
    parse_and_start,
    refuse,
    refuse_bad_arguments,
    say,
    sleeping_barrier,
    table,
)

from dtrain import checkpoint, terminal
from dtrain.comm import mpi, usable_cores
from dtrain.config import TrainConfig
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.parameter_server import DONE, END, PULL, PUSH, WEIGHTS, ParameterServer
from dtrain.train import train

parser = argparse.ArgumentParser(description="Lesson 4: parameter servers on MPI ranks")
parser.add_argument("--epochs", type=int, default=5, help="epochs of section 2's training runs (default %(default)s)")
parser.add_argument("--batch-size", type=int, default=60, help="global batch on digits (default %(default)s)")
parser.add_argument("--quick", action="store_true", help="one epoch per straggler run instead of two (section 4)")
parser.add_argument("--json", metavar="PATH", help="write every measurement to this file (the notebook draws them)")
add_device_flag(parser)

args, world, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
B = args.batch_size
SERVERS = [1, 2] if p >= 4 else [1]  # two servers need two workers besides: 4 ranks or more
if p < 3:
    refuse(
        f"lesson 4 needs at least 3 ranks (a server and two workers, so that there is something to be asynchronous "
        f"about), got {p}: dtrain launch -n 4 lessons/04_parameter_server.py"
    )
counts = sorted({p - s for s in SERVERS} | {p})  # the workers of each run, and the ranks of ddp
refuse_bad_arguments([(
    args.epochs < 1 or B < 1 or any(B % k for k in counts),
    f"--batch-size {B} must be divisible by {', '.join(map(str, counts))} (the workers of each run, and the {p} "
    f"ranks of ddp, each take an equal slice of it), --epochs {args.epochs} must be >= 1",
)])  # fmt: skip
lesson_xp(args, world)  # --device gpu: this rank's GPU, or one line if there is none (every array is the driver's)

W = p - 1  # workers when there is one server
OVERSUBSCRIBED = p > usable_cores()
TAGS = {PUSH: "PUSH", PULL: "PULL", DONE: "DONE", WEIGHTS: "WEIGHTS", END: "END"}
# Every run: the digits, a 64-32-10 MLP, the driver of `dtrain train` (train(config, comm)), a watchdog of 120 s.
BASE = dict(dataset="digits", hidden=(32,), batch_size=B, lr=0.05, momentum=0.9, progress=False, quiet=True,
            timeout=120, device=args.device)  # fmt: skip
results = {"world": p, "workers": W, "servers": SERVERS, "batch_size": B, "cores": usable_cores()}
checks = Checks(world)  # the checks are made on rank 0, which holds the gathered metrics (the others pass True)


def shared_folder() -> str:
    """A fresh temporary folder, the same path on every rank (every rank's config must be the same)."""
    return world.bcast(tempfile.mkdtemp(prefix="lesson04-") if rank == 0 else None, root=0)


def run(**overrides) -> dict:
    """One training run on every rank of the world, through dtrain's driver; the metrics (complete on rank 0)."""
    return train(TrainConfig(**{**BASE, **overrides}), world)


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def figures(metrics) -> dict:
    """The paradigm's own figures (roles, staleness ...), the same on every rank: rank 0's copy."""
    return metrics["communication"]["per_rank"][0]["paradigm"]


def pushes(metrics) -> list:
    """Pushes each worker made, as the tracer counted them (one "ps/push" operation per step)."""
    per_rank = metrics["communication"]["per_rank"]
    return [r["operations"]["ps/push"]["calls"] for r, role in zip(per_rank, figures(metrics)["roles"])
            if role == "worker"]  # fmt: skip


def arrow(src: int, dst: int, columns: int, width: int) -> str:
    """One line of a sequence diagram, ``columns * width`` characters: a lifeline "|" per rank, in the middle of its
    ``width`` characters, and an arrow from src's to dst's."""
    cells = [" "] * (columns * width)
    for c in range(columns):
        cells[c * width + width // 2] = "|"
    a, b = src * width + width // 2, dst * width + width // 2
    lo, hi = min(a, b), max(a, b)
    cells[lo + 1 : hi] = "-" * (hi - lo - 1)
    cells[hi - 1 if b > a else lo + 1] = ">" if b > a else "<"
    return "".join(cells)


mpi.print0(f"Lesson 4: parameter servers on {p} ranks ({usable_cores()} cores); global batch {B} digits")

# ----------------------------------------------------------------------------- 1. roles, the protocol, ps-sync = one
# ps-sync: every worker pushes the gradient of its slice of the global batch; the server averages the W pushes (in
# worker order) and takes one optimizer step. The average of the slice gradients is the whole batch's gradient
# (lesson 3), so ps-sync must follow one process training on the whole global batch, to rounding: in float64, ~1e-16.
# The oracle: dtrain's driver with --paradigm single, on a one-rank simulated world, on rank 0 alone.
heading("1. Roles and the protocol: ps-sync (float64, 1 epoch) against one process on the whole global batch")
SYNC64 = dict(paradigm="ps-sync", dtype="float64", epochs=1)
folders = {s: shared_folder() for s in SERVERS}
trace_path = os.path.join(folders[1], "trace.json")
sync64 = {s: run(**SYNC64, servers=s, checkpoint_dir=folders[s], trace=trace_path if s == 1 else None)
          for s in SERVERS}  # fmt: skip
reference = None
if rank == 0:
    from dtrain.comm import sim

    single_folder = tempfile.mkdtemp(prefix="lesson04-single-")
    single = TrainConfig(**{**BASE, **SYNC64, "paradigm": "single", "checkpoint_dir": single_folder, "timeout": 0})
    sim.run(1, lambda comm: train(single, comm))
    reference = checkpoint.load(single_folder)["params"]
    shutil.rmtree(single_folder)
sleeping_barrier(world)

protocol_ok = True
if rank == 0:
    results["protocol"] = {"relative_difference": {}, "roles": {}, "shards": {}}
    for s in SERVERS:
        fig = figures(sync64[s])
        workers = fig["roles"].count("worker")
        n = sync64[s]["model"]["parameters"]
        shards = ", ".join(f"rank {workers + i} [{a:,}, {b:,})" for i, (a, b) in enumerate(fig["shards"]))
        say(f"--servers {s}: ranks 0-{workers - 1} are workers, each computing on 1/{workers} of every global batch;"
            f" the servers own these slices of the {n:,} parameters: {shards}")  # fmt: skip
        results["protocol"]["roles"][s], results["protocol"]["shards"][s] = fig["roles"], fig["shards"]

    # The first and last messages of the one-server run, from its trace (each rank's sends, by start time)
    events = json.load(open(trace_path))["traceEvents"]
    sends = sorted((e for e in events if e["name"] in ("Send", "Isend") and e["args"].get("tag") in TAGS),
                   key=lambda e: e["ts"])  # fmt: skip
    messages = [{"t_ms": e["ts"] / 1e3, "src": e["pid"], "dst": e["args"]["peer"], "tag": TAGS[e["args"]["tag"]],
                 "bytes": e["args"].get("bytes_sent", 0)} for e in sends]  # fmt: skip
    results["protocol"]["messages"] = messages
    print()
    say(f"the one-server run as it happened on the real ranks (its trace: each rank's sends by start time;"
        f" {len(messages)} messages in all)")  # fmt: skip
    first, last = 4 * W, 3 * W  # the pulls and the first step; the last step and the DONEs
    shown = messages if len(messages) <= first + last else [*messages[:first], None, *messages[-last:]]
    # A lifeline per rank, each as wide as the terminal leaves beside each message's words and time (22 at most)
    labels = [f"{m['tag']} {m['bytes']:,} B" if m else "... every step ..." for m in shown]
    times = [f"{m['t_ms']:.3f} ms" if m else "" for m in shown]
    beside = 2 + max(map(len, labels)) + 2 + max(map(len, times))
    room = (terminal.columns() or 100) - 3 - beside  # for the lifelines: each rank's in the middle of its width
    width = next((w for w in range(22, 3, -1) if (p - 1) * w + w // 2 + 1 <= room), 3)
    span = (p - 1) * width + width // 2 + 1  # up to the last lifeline
    names = [(f"rank {r}", "server" if r == W else "worker") if width >= 8 else (str(r), "s" if r == W else "w")
             for r in range(p)]  # fmt: skip
    for line in range(2):
        print(("   " + "".join(f"{name[line]:^{width}s}" for name in names)).rstrip())
    for m, label, time_ in zip(shown, labels, times):
        drawing = (" " * (width // 2) + ":" + " " * (width - width // 2 - 1)) * p if m is None else arrow(
            m["src"], m["dst"], p, width)  # fmt: skip
        drawing = drawing[:span]
        print(f"   {drawing}  {label:{max(map(len, labels))}s}  {time_:>{max(map(len, times))}s}".rstrip())
    if width < 8:
        say("(w: a worker, s: the server)")
    say(
        "Each worker PULLs the first weights (0 bytes asked, n bytes back); each step it PUSHes its gradient (n bytes)"
        " and waits. ps-sync: the server answers once all W pushes are in, WEIGHTS to every worker (END instead at"
        " the end of an epoch); after its last step a worker says DONE, and the server leaves its loop when all have."
    )
    print()
    for s in SERVERS:
        final = checkpoint.load(folders[s])["params"]
        difference = relative(final, reference)
        results["protocol"]["relative_difference"][s] = difference
        say(f"--servers {s}: final weights against one process, largest relative difference {difference:.1e}")
        protocol_ok = protocol_ok and difference < 1e-12
for folder in folders.values():
    if rank == 0:
        shutil.rmtree(folder)
checks.ok("ps-sync's weights are one process's on the whole global batch", protocol_ok)

# ------------------------------------------------------------------------------------ 2. synchronous, asynchronous
# ps-async applies each push on arrival (scaled by 1/W: a worker's slice is 1/W of the global batch) and answers at
# once: nobody waits for anybody, but a worker's gradient was computed on weights that other pushes have changed
# since. An epoch is a budget of W x steps pushes shared by the workers. --staleness K: a worker more than K steps
# ahead of the slowest is not answered until the slowest catches up (stale-synchronous parallel).
heading(f"2. Synchronous against asynchronous: 64-32-10 on digits, {args.epochs} epoch(s), {W} workers + 1 server")
RUNS = {  # name: overrides
    "ps-sync": dict(paradigm="ps-sync"),
    "ps-async": dict(paradigm="ps-async"),
    "ps-async K=2": dict(paradigm="ps-async", staleness=2),
    "ddp": dict(paradigm="ddp", allreduce="ring", bucket_mb=0),  # every rank a worker: the reference of lesson 3
}
curves = {name: run(**overrides, epochs=args.epochs) for name, overrides in RUNS.items()}
# K = 0 with plain SGD: each round's W updates of gradient/W add up to ps-sync's one update of their average
folders = {name: shared_folder() for name in ("ps-sync", "ps-async K=0")}
LOCKSTEP = dict(dtype="float64", momentum=0.0, epochs=1)
lockstep = {
    "ps-sync": run(paradigm="ps-sync", **LOCKSTEP, checkpoint_dir=folders["ps-sync"]),
    "ps-async K=0": run(paradigm="ps-async", staleness=0, **LOCKSTEP, checkpoint_dir=folders["ps-async K=0"]),
}
if rank == 0:
    results["convergence"] = {
        name: {key: [e[key] for e in m["epochs"]] for key in ("train_loss", "test_accuracy", "train_time_s")}
        | {"samples_per_s": m["samples_per_s"]}
        for name, m in curves.items()
    }
    say("train loss (the global batch's, averaged over the epoch) and test accuracy after each epoch:")
    table(["epoch", *(f"{name} loss" for name in curves), *(f"{name} accuracy" for name in curves)],
          [[str(e + 1), *(f"{m['epochs'][e]['train_loss']:.4f}" for m in curves.values()),
            *(f"{100 * m['epochs'][e]['test_accuracy']:.2f}%" for m in curves.values())] for e in range(args.epochs)],
          left=(), groups=(1, 1 + len(curves)))  # fmt: skip
    say("samples/s: " + ", ".join(f"{name} {m['samples_per_s']:,.0f}" for name, m in curves.items()))
    accuracy = {name: curves[name]["final"]["test_accuracy"] for name in curves}
    gap = max(abs(a["train_loss"] - b["train_loss"]) for a, b in zip(curves["ps-sync"]["epochs"],
                                                                       curves["ddp"]["epochs"]))  # fmt: skip
    say(f"ps-sync against ddp: loss curves within {gap:.1e} (the same global batch, float32 rounding)")
    asynchronous_ok = all(accuracy[name] >= 0.90 for name in ("ps-async", "ps-async K=2"))
    checks.ok_here("ps-async reaches 90% test accuracy (with and without a bound)", asynchronous_ok,
                   f" ({100 * accuracy['ps-async']:.2f}%, {100 * accuracy['ps-async K=2']:.2f}%)")  # fmt: skip
    checks.ok_here("ps-sync's loss curve is ddp's", gap < 1e-5)
    equal = relative(checkpoint.load(folders["ps-async K=0"])["params"], checkpoint.load(folders["ps-sync"])["params"])
    results["lockstep_relative_difference"] = equal
    say(f"ps-async --staleness 0 against ps-sync, no momentum, float64: largest relative difference {equal:.1e}")
    checks.ok_here("with bound 0 and plain SGD, ps-async is ps-sync", equal < 1e-12)
    say(
        "Why bound 0 is synchronous: no worker may be a step ahead of another, so each round every worker pushes"
        " once, and the W updates of gradient/W sum to the average's update (in another order: ~1e-16). With"
        " momentum it is not: the velocity decays once per push, W times per round."
    )
    for folder in folders.values():
        shutil.rmtree(folder)

# --------------------------------------------------------------------------------------------------- 3. staleness
# Staleness of an update: how many updates the server applied between the weights it sent the worker and the arrival
# of the gradient the worker computed on them. The bound: after worker w's k-th push is answered, every other worker
# u has pushed at least k - K times (else w would not have been answered) and can push at most k + K + 1 times before
# w's next push arrives (u is then K + 1 ahead of w, and waits). So at most 2K + 1 pushes of each of the W - 1
# others land in between: staleness <= (W - 1)(2K + 1). ps-sync: every gradient is applied to the weights it was
# computed on, staleness 0.
heading(f"3. Staleness: updates between a worker's weights and its gradient's arrival ({W} workers)")
staleness_ok = True
if rank == 0:
    results["staleness"] = {}
    rows = [(name, curves[name], RUNS[name].get("staleness")) for name in ("ps-sync", "ps-async", "ps-async K=2")]
    rows.append(("ps-async K=0 (1 epoch)", lockstep["ps-async K=0"], 0))
    for name, m, bound in rows:
        st = figures(m)["staleness"]
        histogram = {int(k): v for k, v in st["histogram"].items()}
        counted = sum(pushes(m))  # the tracer's count on the workers, against the server's histogram
        limit = 0 if name == "ps-sync" else (W - 1) * (2 * bound + 1) if bound is not None else None
        within = limit is None or st["max"] <= limit
        ok = sum(histogram.values()) == counted and within
        staleness_ok = staleness_ok and ok
        results["staleness"][name] = {"histogram": histogram, "mean": st["mean"], "max": st["max"], "bound": limit,
                                      "pushes": counted, "ok": ok}  # fmt: skip
        say(f"{name}: {counted:,} pushes, mean staleness {st['mean']:.2f}, max {st['max']}"
            + (f" (bound (W-1)(2K+1) = {limit})" if limit is not None and name != "ps-sync" else ""))  # fmt: skip
        widest = max(histogram.values())
        longest = max(8, min(50, (terminal.columns() or 100) - 17))  # the bars fit the terminal, 50 at most
        for k in range(max(histogram) + 1):
            count = histogram.get(k, 0)
            print(f"      {k:3d} {count:6,d} {'#' * math.ceil(longest * count / widest) if count else ''}".rstrip())
    say(
        "Without a bound, staleness is set by the scheduler: with more ranks than cores a worker that has lost its"
        " core lets the others push many times. The bound caps it, at the price of making the fast workers wait."
    )
checks.ok("every push is in the histogram once, and within the bound", staleness_ok)

# --------------------------------------------------------------------------------------------------- 4. a straggler
# --slow-rank R --slow-factor F: rank R sleeps (F-1) x its forward and backward time every step. ps-sync's step waits
# for its slowest worker; in ps-async the others go on, and take more of the epoch's pushes.
SYNTHETIC = dict(dataset="synthetic", samples=24000, batch_size=1500, hidden=(256,), epochs=1 if args.quick else 2)
SLOW, FACTOR = 1, 3.0
heading(f"4. A straggler: worker {SLOW} takes {FACTOR:g}x its compute time per step; samples/s (higher is faster)")
workloads = {
    "synthetic": (SYNTHETIC, f"784-256-10 on {SYNTHETIC['samples']:,} synthetic samples, global batch 1500"),
    "digits": (dict(epochs=1 if args.quick else 2), f"64-32-10 on the digits, global batch {B}"),
}
VARIANTS = [("ps-sync", 1.0, None), ("ps-async", 1.0, None), ("ps-sync", FACTOR, None), ("ps-async", FACTOR, None),
            ("ps-async", FACTOR, 2)]  # fmt: skip
straggler = {}
for workload, (overrides, _) in workloads.items():
    for paradigm, factor, bound in VARIANTS:
        straggler[workload, paradigm, factor, bound] = run(**{**overrides, "paradigm": paradigm, "staleness": bound,
                                                              "slow_rank": SLOW, "slow_factor": factor})  # fmt: skip
if rank == 0:
    results["straggler"] = {}
    for workload, (_, description) in workloads.items():
        say(f"{description}:")
        rows, cells = [], []
        for paradigm, factor, bound in VARIANTS:
            m = straggler[workload, paradigm, factor, bound]
            st, steps = figures(m)["staleness"], pushes(m)[0]
            row = {"paradigm": paradigm, "slow_factor": factor, "staleness_bound": bound,
                   "samples_per_s": m["samples_per_s"], "pushes": pushes(m), "staleness_mean": st["mean"],
                   "staleness_max": st["max"], "worker_wait_s": figures(m)["worker_wait_s"],
                   "step_ms": 1e3 * m["communication"]["per_rank"][0]["train_time_s"] / steps,
                   "wait_ms": 1e3 * figures(m)["worker_wait_s"][0] / steps}  # fmt: skip
            rows.append(row)
            name = f"{paradigm}{f' K={bound}' if bound is not None else ''}"
            staleness = f"{st['mean']:.1f}, {st['max']}" if paradigm == "ps-async" else "0"
            cells.append([name, f"{factor:g}x" if factor != 1 else "none", f"{m['samples_per_s']:,.0f}",
                          str(pushes(m)), staleness, f"{row['step_ms']:.2f}", f"{row['wait_ms']:.2f}"])  # fmt: skip
        table(["run", "straggler", "samples/s", "pushes per worker", "staleness mean, max", "worker 0 ms per step",
               "of which waiting"], cells, keys=2)  # fmt: skip
        find = {(r["paradigm"], r["slow_factor"], r["staleness_bound"]): r for r in rows}
        ratio = find["ps-async", FACTOR, None]["samples_per_s"] / find["ps-sync", FACTOR, None]["samples_per_s"]
        kept = find["ps-sync", FACTOR, None]["samples_per_s"] / find["ps-sync", 1.0, None]["samples_per_s"]
        # (samples/s are speeds: the time for a sample is their inverse)
        faster = terminal.speed(1 / find["ps-async", FACTOR, None]["samples_per_s"],
                                1 / find["ps-sync", FACTOR, None]["samples_per_s"], "ps-sync")  # fmt: skip
        kept_words = terminal.speed(1 / find["ps-sync", FACTOR, None]["samples_per_s"],
                                    1 / find["ps-sync", 1.0, None]["samples_per_s"], "without one")  # fmt: skip
        say(f"with the straggler, ps-async ran {faster}, and ps-sync {kept_words}")
        print()
        results["straggler"][workload] = {"description": description, "runs": rows, "async_over_sync": ratio,
                                          "sync_with_over_without": kept}  # fmt: skip
    synthetic, digits = results["straggler"]["synthetic"]["runs"][0], results["straggler"]["digits"]["runs"][0]
    own = {name: row["step_ms"] - row["wait_ms"] for name, row in (("synthetic", synthetic), ("digits", digits))}
    say(
        "(waiting: the time worker 0 spent between its push and the reply, which ParameterServer measures;"
        " the rest of its step is its own: forward, backward, its share of Python.) Why the straggler matters on one"
        " workload and hardly on the other: it sleeps (F-1) times its own forward and backward. On the synthetic"
        f" workload, without a straggler, a worker's own part is a large part of a step ({own['synthetic']:.1f} of"
        f" {synthetic['step_ms']:.1f} ms), so a 3x straggler makes every synchronous step wait for about twice that"
        " more, while asynchronous workers go on without it. On the digits a worker computes on"
        f" {B // W} samples of a 2,410-parameter model: its own part is {own['digits']:.2f} of a"
        f" {digits['step_ms']:.2f} ms step, most of it Python's fixed cost per layer, not arithmetic; the rest is"
        " the round trip to the server (messages, the server's loop"
        + (", and, with more ranks than cores, waiting for a core" if OVERSUBSCRIBED else "")
        + "), which asynchrony does not remove: every worker still waits for its own reply. Tripling the arithmetic"
        " changes little. With a straggler, the pushes per worker show the fast asynchronous workers taking the slow"
        " one's share of the epoch, unless a bound K holds them back: they may run at most K steps ahead of it, so"
        " over many steps they go at its pace, as in ps-sync. (Timings vary from run to run.)"
    )

# -------------------------------------------------------------------------------------------- 5. the server's link
# Per step a worker sends its gradient (n bytes) and receives the weights (n); the server receives W gradients and
# sends W copies of the weights: W n each way through one link. A ring all-reduce sends 2(p-1)/p n per rank, under 2n
# whatever p. With S servers each owns n/S of the parameters, so each link carries W n / S.
n = sync64[1]["model"]["parameters"] * 8  # float64
heading(f"5. The server's link: bytes sent per step, from the tracer (n = {n:,} bytes of float64 parameters)")
ddp64 = run(paradigm="ddp", allreduce="ring", bucket_mb=0, dtype="float64", epochs=1)
link_ok = True
if rank == 0:
    results["link"] = {"n": n, "runs": {}}
    cells = []
    for label, m in [*((f"ps-sync S={s}", sync64[s]) for s in SERVERS), ("ddp (ring)", ddp64)]:
        per_rank, predicted = m["communication"]["per_rank"], m["costs"]["sent_per_step"]
        if label.startswith("ps"):
            roles, steps = figures(m)["roles"], pushes(m)[0]
            workers, servers = roles.count("worker"), roles.count("server")
            # a worker's pushes; a server's replies to the pushes (its answers to the first PULLs are "ps/pull")
            sent = [r["operations"]["ps/push" if role == "worker" else "ps/weights"]["bytes_sent"] // steps
                    for r, role in zip(per_rank, roles)]  # fmt: skip
            expected = {"worker": "n", "server": f"W n / S = {workers} n / {servers}"}
        else:
            roles, steps = ["-"] * p, per_rank[0]["operations"]["allreduce/ring"]["calls"]  # one bucket per step
            sent = [r["operations"]["allreduce/ring"]["bytes_sent"] // steps for r in per_rank]
            expected = {"-": "2(p-1)/p n"}
        received = [  # a worker's weights arrive inside its push; a server receives nothing but pushes (and 0 bytes)
            (r["operations"].get("ps/push") or r["operations"].get("allreduce/ring") or r["totals"])["bytes_received"]
            // steps
            for r in per_rank
        ]
        cells += [[label if r == 0 else "", str(r), roles[r], f"{sent[r]:,d}", f"{predicted[r]:,d}",
                   f"{sent[r] / n:.2f}", f"{received[r]:,d}", expected[roles[r]]] for r in range(p)]  # fmt: skip
        exact = sent == predicted
        if label.startswith("ps"):
            shares = sum(s for s, role in zip(sent, roles) if role == "server")
            exact = exact and shares == workers * n and all(s == n for s, r in zip(sent, roles) if r == "worker")
        else:
            exact = exact and all(abs(s - 2 * (p - 1) / p * n) <= 2 * 8 for s in sent)  # < one float per phase
            exact = exact and predicted == DataParallel.costs(m["model"]["sizes"], p, TrainConfig(
                paradigm="ddp", allreduce="ring", bucket_mb=0, dtype="float64"))["sent_per_step"]  # fmt: skip
        link_ok = link_ok and exact
        results["link"]["runs"][label] = {"roles": roles, "sent": sent, "costs": predicted, "received": received}
    table(["run", "rank", "role", "sent", "costs()", "/ n", "received", "expected"], cells, left=(0, 2, 7), keys=2)
    busiest = {label: max(v["sent"]) / n for label, v in results["link"]["runs"].items()}
    say("the busiest link, per step: " + ", ".join(f"{label} {b:.2f} n" for label, b in busiest.items())
        + f" (2(p-1)/p n = {2 * (p - 1) / p:.2f} n)")  # fmt: skip

    # The same from costs() alone, without running anything: the server's link grows with W, the ring's does not
    sizes, ps = sync64[1]["model"]["sizes"], [4, 8, 16, 64, 256]
    print()
    say("the same from the cost functions alone, for more ranks: bytes sent per step by the busiest rank / n")
    projection = {}
    for label, servers in (("one server", lambda q: 1), ("S = p/4 servers", lambda q: q // 4)):
        projection[label] = [max(ParameterServer.costs(sizes, q, TrainConfig(paradigm="ps-sync", servers=servers(q),
                             dtype="float64"))["sent_per_step"]) / n for q in ps]  # fmt: skip
    projection["ring all-reduce"] = [2 * (q - 1) / q for q in ps]
    table(["p =", *map(str, ps)], [[label, *(f"{v:.2f}" for v in row)] for label, row in projection.items()])
    results["link"]["projection"] = {"p": ps, **projection}
    say(
        "Every push and every reply goes through the server: its link carries W times a worker's bytes each way,"
        " and W grows with the cluster, while a ring all-reduce keeps every rank's share under 2n. Sharding the"
        " parameters over S servers divides each server's bytes by S (3/4 of the ranks working and a quarter"
        " serving keeps each link at 3n whatever p). Whether the link is the bottleneck in time depends on the"
        " link: here, a 2,410-parameter model on one machine, the bytes are cheap. The server's own figure is"
        f" server_busy_fraction in metrics.json (this run's: {100 * figures(sync64[1])['server_busy_fraction'][0]:.0f}%"
        " of its loop not spent waiting for a message)."
    )
checks.ok("bytes per step match the cost functions on every rank, and the server sends W n / S", link_ok)

# --------------------------------------------------------------------------------------------- 6. central storage
# TensorFlow's CentralStorageStrategy (dtrain/parallel/central_storage.py): no rank is set aside to serve. Every rank
# computes on its slice; the gradients are reduced to rank 0 (a binomial tree), which alone holds the optimizer state
# and updates; the new weights are broadcast (a tree again). Like ps-sync it follows one process on the global batch.
heading("6. Central storage: every rank computes, rank 0 alone holds the optimizer and updates (float64, 1 epoch)")
storage_folder = shared_folder()
central = run(paradigm="central-storage", dtype="float64", epochs=1, checkpoint_dir=storage_folder)
storage_ok = True
if rank == 0:
    difference = relative(checkpoint.load(storage_folder)["params"], reference)
    shutil.rmtree(storage_folder)
    per_rank, costs = central["communication"]["per_rank"], central["costs"]
    steps = per_rank[0]["operations"]["reduce/tree"]["calls"]
    held = central["communication"]["per_rank"][0]["paradigm"]["held_bytes"]
    say(f"final weights against one process, largest relative difference {difference:.1e}")
    sent = []
    for mine in per_rank:
        ops = mine["operations"]
        first_broadcast = ops["broadcast/tree"]["bytes_sent"] // (steps + 1)  # the build's, then one per step
        sent.append((ops["reduce/tree"]["bytes_sent"] + ops["broadcast/tree"]["bytes_sent"] - first_broadcast) // steps)
    table(["rank", "sent per step (tracer)", "costs()", "optimizer state held"],
          [[str(r), f"{sent[r]:,d}", f"{costs['sent_per_step'][r]:,d}", f"{held[r]['optimizer']:,d}"]
           for r in range(p)], left=())  # fmt: skip
    storage_ok = difference < 1e-12 and sent == costs["sent_per_step"]
    storage_ok = storage_ok and [h["optimizer"] for h in held] == costs["optimizer"]
    results["central_storage"] = {"relative_difference": difference, "sent": sent, "held": held}
    say(
        "Against ps-sync: nobody idles as a server, and the tree spreads rank 0's traffic over log2 p rounds instead"
        " of W messages through one link; but nothing is sharded, and rank 0's update sits on every step's critical"
        " path. Against ddp: the other ranks hold no optimizer state (the memory of Adam's two moments, saved p - 1"
        " times), at the price of a reduce and a broadcast instead of one all-reduce."
    )
checks.ok("central storage is one process's training, its bytes and its state are costs()", storage_ok)

mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
conclude(args.json, results, checks)

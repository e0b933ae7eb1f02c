"""Lesson 5: local SGD on real MPI ranks. Every rank takes H steps on its own data, then the ranks average weights.

Data parallelism (lesson 3) all-reduces the gradients at every step, so the replicas never differ. Local SGD lets
each rank take H optimizer steps on its own slices of the global batches, then replaces every rank's weights by their
average, one all-reduce of the weights every H steps instead of one of the gradients every step
(dtrain/parallel/local_sgd.py, ``dtrain train --paradigm local-sgd --sync-every H``):

    dtrain launch -n 4 lessons/05_local_sgd.py
    dtrain launch -n 2 lessons/05_local_sgd.py
    dtrain launch -n 3 lessons/05_local_sgd.py --sync-every 1,2,7,14
    dtrain launch -n 4 lessons/05_local_sgd.py --cluster          # + part 5, on a cluster (root)
`--device gpu` runs the same on GPUs (one per rank, rank % GPUs); the checks' distances are NumPy's, on host copies.

What you will see:
  1. H = 1 is ddp: with SGD, momentum and weight decay the weights after every step equal ddp's (float64, to
     ~1e-16 relative), although every rank keeps its own momentum buffer; and why; with Adam they do not;
  2. bytes: what the tracer counted on every rank against LocalSGD.costs(); ddp sends H times more (exactly H when H
     divides the number of steps); averaging through rank 0 (--average-via master) instead of a ring;
  3. drift: how far the replicas are from their average after every step, for each H (zero for H = 1, a sawtooth
     otherwise), and the driver's figure at the end of each epoch (metrics.json's consensus_distance);
  4. accuracy against bytes: H = 1, 4, 8, 16 and post-local SGD (ddp for the first W steps), over a few seeds,
     against ddp's accuracy after the same epochs;
  5. with --cluster (as root): across a 100 Mbit/s link, time to 96%. The lesson makes a cluster on this machine
     (dtrain cluster: 2 nodes that are network namespaces, 2 ranks each, each node's link shaped to --link),
     trains ddp and local SGD (H = 8) on the digits across it (a wider MLP, 64-256-256-10, so that the link
     counts) and prints each one's training time to 96% test accuracy (metrics.json's epochs) beside the cost
     model's; then takes the cluster down (without root: it says why and goes on).

Every check compares with an independent oracle (ddp's weights, the tracer's counts, a distance computed here from the
weights themselves) and prints an OK line (FAIL if it does not hold); the last line says whether all passed (the exit
status is non-zero if not). Accuracies and timings are measurements, printed and never checked. With more ranks than
cores (4 ranks on 2 cores) a rank often waits for a core rather than for a message: the seconds in section 4 say little
about a cluster; section 5 measures on one.

Things to try:
  * --sync-every 1,16,64,1000: how far can H go on the digits before accuracy suffers? (1000: one average, at the end);
  * --cluster --link 1gbit (or 10mbit): how much of local SGD's lead is the link's?
  * --batch-size 48: 29 steps per epoch, so H = 4, 8, 16 no longer divide the steps: count the averages;
  * dtrain train --paradigm local-sgd --sync-every 8 --average-via master: see metrics.json's per-rank bytes.

Exercises (`dtrain exercises init ex` once copies the stubs into ex/):
  5.1  local SGD's averaging step, local_sgd_step(comm, flat, step, sync_every)
       in ex/local_sgd.py: average the weights over the ranks every
       sync_every-th local step, send nothing otherwise:
       dtrain exercises check 5.1 --path ex
It is checked on simulated ranks and under mpiexec against the mean over ranks,
step by step.
"""

import argparse
import math
import statistics

import cluster_util
import numpy as np
from cluster_util import add_cluster_flags, cluster_part, link_problem, rate_words
from lesson_util import (
    Checks,
    add_device_flag,
    conclude,
    everywhere,
    heading,
    lesson_xp,
    parse_and_start,
    refuse_bad_arguments,
    say,
    table,
    whole_numbers,
)

from dtrain import parallel, terminal
from dtrain.backend import to_host, weights_digest
from dtrain.comm import mpi
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import ShardedLoader, load_dataset, steps_per_epoch
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import parameter_count
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.local_sgd import LocalSGD
from dtrain.train import train

parser = argparse.ArgumentParser(description="Lesson 5: local SGD on MPI ranks")
parser.add_argument("--epochs", type=int, default=8, help="epochs of every training run (default %(default)s)")
parser.add_argument("--batch-size", type=int, default=96, help="global batch on digits (default %(default)s)")
parser.add_argument("--sync-every", default="1,4,8,16", help="the values of H compared (default %(default)s)")
parser.add_argument(
    "--warmup-sync-steps",
    type=int,
    default=28,
    help="post-local SGD: ddp steps, then the largest H (default %(default)s)",
)
parser.add_argument("--seeds", type=int, default=5, help="seeds averaged over in section 4 (default %(default)s)")
parser.add_argument("--json", metavar="PATH", help="write every measurement to this file")
add_device_flag(parser)
add_cluster_flags(parser, "part 5")

args, world, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
from mpi4py import MPI  # for MPI.IN_PLACE, MPI.SUM, MPI.MAX (MPI has started by now)

digits = {dtype: load_dataset("digits", dtype=np.dtype(dtype)) for dtype in ("float32", "float64")}
train_samples = len(digits["float32"].y_train)
HS = sorted(set(whole_numbers(args.sync_every)))
STEPS = args.epochs * steps_per_epoch(train_samples, args.batch_size) if 0 < args.batch_size <= train_samples else 0
refuse_bad_arguments([
    (p < 2, f"local SGD averages replicas: launch 2 ranks or more (dtrain launch -n 4 ...), not {p}"),
    (not HS or min(HS) < 1, f"--sync-every {args.sync_every!r} must be whole numbers >= 1, such as 1,4,8,16"),
    (args.batch_size % p or not 0 < args.batch_size <= train_samples,
     f"--batch-size {args.batch_size} must be divisible by the {p} ranks, and at most {train_samples} (the digits)"),
    (args.epochs < 1 or args.seeds < 1, "--epochs and --seeds must be >= 1"),
    (not 0 <= args.warmup_sync_steps < STEPS,
     f"--warmup-sync-steps {args.warmup_sync_steps} must be >= 0 and less than the {STEPS} steps of the runs"),
    link_problem(args),
])  # fmt: skip
xp = lesson_xp(args, world)  # numpy, or cupy on this rank's GPU (--device gpu)

B, W, H_MAX = args.batch_size, args.warmup_sync_steps, max(HS)
SIZES = [digits["float32"].n_features, 32, digits["float32"].n_classes]  # 64-32-10: 2,410 parameters
N = parameter_count(SIZES) * 4  # bytes of float32 weights (or gradients)
PER_EPOCH = steps_per_epoch(train_samples, B)
results = {"world": p, "sizes": SIZES, "n_bytes": N, "steps": STEPS, "steps_per_epoch": PER_EPOCH, "sync_every": HS}


checks = Checks(world)  # each claim checked on every rank, and printed: checks.ok(claim, flag)


def config(**overrides) -> TrainConfig:
    """The run every section varies: 64-32-10 on the digits, SGD with momentum, a ring all-reduce."""
    base = dict(paradigm="local-sgd", epochs=args.epochs, hidden=tuple(SIZES[1:-1]), batch_size=B, lr=0.05,
                momentum=0.9, allreduce="ring", progress=False, quiet=True, device=args.device)  # fmt: skip
    return TrainConfig(**{**base, **overrides})


def stepped(cfg: TrainConfig, steps: int | None = None):
    """dtrain.train's driver loop, one step at a time: yields (step, paradigm) after each optimizer step.

    The same model, data order and slices as ``train(cfg)`` (the driver's evaluation and loss averaging, left out
    here, only read the weights), so the weights after step s are the driver's after step s. The caller calls
    ``paradigm.finish()`` (the final average, the replicas' check) when done.
    """
    kind = parallel.get(cfg.paradigm)
    kind.check(cfg, p)
    paradigm = kind(prepare(world, device=cfg.device), cfg)  # (GPU: CuPy buffers reach MPI through staging)
    dtype = np.dtype(cfg.dtype)
    paradigm.build(
        lambda: MLP(SIZES, seed=cfg.seed, dtype=dtype, xp=xp),
        lambda model: make_optimizer(cfg.optimizer, model, cfg.lr, cfg.momentum, cfg.weight_decay),
    )
    index, count = paradigm.batch_slice
    data = digits[cfg.dtype]
    loader = ShardedLoader(data.x_train, data.y_train, cfg.batch_size, index, count, cfg.seed, xp)
    step = 0
    for epoch in range(1, cfg.epochs + 1):
        for x, y in loader.epoch(epoch):
            paradigm.step(x, y)
            step += 1
            yield step, paradigm
            if step == steps:
                return


def run_to_end(cfg: TrainConfig, steps: int):
    """The paradigm after ``steps`` steps of ``cfg`` (not finished)."""
    *_, (_, paradigm) = stepped(cfg, steps)
    return paradigm


def trained(cfg: TrainConfig) -> dict:
    """``train(cfg)`` on all ranks; its metrics on every rank (the per-rank figures are gathered on rank 0)."""
    return world.bcast(train(cfg, world), root=0)


def relative(a, b) -> float:
    a, b = to_host(a), to_host(b)  # (GPU weights are compared on the host)
    return float(np.abs(a - b).max() / np.abs(b).max())


def mean_over_ranks(a: np.ndarray) -> np.ndarray:
    """The average of ``a`` over the ranks, in float64, with MPI's own all-reduce (no dtrain code involved)."""
    total = np.array(a, dtype=np.float64)
    world.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return total / p


mpi.print0(terminal.paragraph(
    f"Lesson 5: local SGD on {p} ranks; {'-'.join(map(str, SIZES))} on digits, global batch {B} ({B // p} per rank), "
    f"{PER_EPOCH} steps per epoch"
))  # fmt: skip

# ------------------------------------------------------------------------------------------- 1. H = 1 is ddp
# SGD's update is linear in the gradient. With momentum mu and weight decay wd, rank r's step from the common weights
# w is  v_r <- mu v_r + g_r + wd w,  w_r <- w - lr v_r.  Average over the ranks: mean(w_r) = w - lr mean(v_r), and
# mean(v_r) <- mu mean(v_r) + mean(g_r) + wd w: the very recursion of ddp's single v with the averaged gradient
# mean(g_r). So averaging the weights after every step (H = 1) gives ddp's weights, although each rank's own v_r is
# not ddp's v: only their mean is. Adam divides by the square root of its second moment, which is not linear.
STEPS_1 = min(STEPS, 2 * PER_EPOCH)
heading(f"1. H = 1 against ddp: {STEPS_1} steps in float64, SGD with momentum 0.9 and weight decay 1e-3")
sgd = dict(dtype="float64", momentum=0.9, weight_decay=1e-3)
ddp = run_to_end(config(paradigm="ddp", **sgd), STEPS_1)
ddp_weights, ddp_velocity = ddp.model.flat_params.copy(), ddp.optimizer_state()["velocity"]
ddp.finish()
equality = {}
for via in ("allreduce", "master"):
    local = run_to_end(config(sync_every=1, average_via=via, **sgd), STEPS_1)
    velocity = local.optimizer_state()["velocity"]
    mean_velocity = mean_over_ranks(velocity)
    row = {
        "weights": relative(local.model.flat_params, ddp_weights),
        "mean_velocity": relative(mean_velocity, ddp_velocity),
        "own_velocity": world.allreduce(relative(velocity, ddp_velocity), op=MPI.MAX),
        "averages": local.averages,
    }
    local.finish()
    equality[via] = row
say(f"How far from ddp's after {STEPS_1} steps (the largest relative difference):")
table(["--average-via", "averages", "weights", "each rank's momentum buffer, up to", "their mean"],
      [[via, str(row["averages"]), f"{row['weights']:.1e}", f"{row['own_velocity']:.2f}", f"{row['mean_velocity']:.1e}"]
       for via, row in equality.items()])  # fmt: skip
adam = {}
for paradigm in ("ddp", "local-sgd"):
    extra = {"sync_every": 1} if paradigm == "local-sgd" else {}
    run = run_to_end(config(paradigm=paradigm, dtype="float64", optimizer="adam", lr=0.005, **extra), STEPS_1)
    adam[paradigm] = run.model.flat_params.copy()
    run.finish()
adam_difference = relative(adam["local-sgd"], adam["ddp"])
say(f"Adam, H = 1: weights off ddp's by {adam_difference:.1e} (relative): not rounding, another algorithm")
results["equality"] = {**equality, "steps": STEPS_1, "adam": adam_difference}
checks.ok(
    "with SGD (momentum, weight decay) H = 1 equals ddp to < 1e-12, and so does the mean of the local momentum buffers",
    all(r["weights"] < 1e-12 and r["mean_velocity"] < 1e-12 and r["own_velocity"] > 1e-6 for r in equality.values()),
)
checks.ok("with Adam H = 1 is not ddp (difference > 1e-6, far above rounding)", adam_difference > 1e-6)

# ----------------------------------------------------------------------------------------------------- 2. bytes
# ddp all-reduces n bytes of gradients every step; local SGD all-reduces n bytes of weights every H steps, plus one
# more average at the end if the last steps were local (every rank must end with the same model). The ring sends
# 2(p-1)/p n per rank per all-reduce. Counted by the tracer under "allreduce/ring" (master: "reduce/naive" and
# "broadcast/naive"); not training traffic, and left out: the initial broadcast of rank 0's weights
# ("broadcast/tree", the same in every run) and the average evaluated at each epoch's end ("evaluation").
heading(f"2. Bytes each rank sent in {STEPS} steps ({args.epochs} epochs), n = {N:,} bytes of weights, ring")
runs = {}  # seed 0's runs, name -> (config, metrics); section 4 adds the other seeds
VARIANTS = {"ddp": dict(paradigm="ddp"), **{f"H={h}": dict(sync_every=h) for h in HS},
            f"post-local W={W} H={H_MAX}": dict(sync_every=H_MAX, warmup_sync_steps=W)}  # fmt: skip
H_MASTER = 8 if 8 in HS else H_MAX
for name, overrides in {**VARIANTS, f"H={H_MASTER} master": dict(sync_every=H_MASTER, average_via="master")}.items():
    cfg = config(**overrides)
    runs[name] = (cfg, trained(cfg))


def averaging_labels(cfg) -> tuple:
    if cfg.paradigm == "local-sgd" and cfg.average_via == "master":
        return ("reduce/naive", "broadcast/naive")
    return ("allreduce/ring",)


def traced(metrics, labels) -> list:
    """Bytes each rank sent under ``labels``."""
    return [sum(r["operations"].get(k, {}).get("bytes_sent", 0) for k in labels)
            for r in metrics["communication"]["per_rank"]]  # fmt: skip


def predicted(cfg) -> tuple:
    """(bytes per rank, averages) for the whole run, from the cost functions."""
    if cfg.paradigm == "ddp":
        return [STEPS * b for b in DataParallel.costs(SIZES, p, cfg)["sent_per_step"]], 0
    costs = LocalSGD.costs(SIZES, p, cfg)
    warm = min(W, STEPS) if cfg.warmup_sync_steps else 0
    averages = math.ceil((STEPS - warm) / cfg.sync_every)  # the last one at the end, if the steps stop between two
    sent = [warm * a + averages * b for a, b in zip(costs["sent_per_warmup_step"], costs["sent_per_average"])]
    return sent, averages


bytes_ok, results["bytes"] = True, {}
others = "rank 1" if p == 2 else f"ranks 1-{p - 1}"
cells = []
ddp_bytes = traced(runs["ddp"][1], averaging_labels(runs["ddp"][0]))
for name, (cfg, metrics) in runs.items():
    measured = traced(metrics, averaging_labels(cfg))
    expected, averages = predicted(cfg)
    counted = metrics["communication"]["per_rank"][0]["paradigm"].get("averages", 0)
    right = measured == expected and counted == averages
    bytes_ok &= right
    rest = f"{measured[1]:,}" if len(set(measured[1:])) == 1 else f"{min(measured[1:]):,}-{max(measured[1:]):,}"
    ratios = [a / b for a, b in zip(ddp_bytes, measured)]
    cells.append([name, str(counted), f"{measured[0]:,d}", rest, "yes" if right else "NO", f"{ratios[0]:.2f}"])
    results["bytes"][name] = {"measured": measured, "costs": expected, "averages": counted, "ratio_to_ddp": ratios}
table(["run", "averages", "bytes sent: rank 0", others, "= costs()", "ddp / this"], cells)
initial = traced(runs["ddp"][1], ("broadcast/tree",))
evaluation = traced(runs[f"H={H_MAX}"][1], ("evaluation",))
results["bytes"]["initial_broadcast"], results["bytes"]["evaluation"] = initial, evaluation
ring = 2 * (p - 1) / p * N
say(
    f"An all-reduce of the ring sends 2(p-1)/p n = {ring:,.0f} bytes per rank (costs() counts its chunks exactly:"
    f" {LocalSGD.costs(SIZES, p, config())['sent_per_average'][0]:,}); ddp pays it {STEPS} times. Left out of every"
    f" row: the initial broadcast of rank 0's weights (broadcast/tree, {initial[0]:,} bytes from rank 0, the same"
    f" in every run), and the evaluation at each epoch's end, one all-reduce of the weights per epoch"
    f" ({evaluation[0]:,} bytes per rank in {args.epochs} epochs: for H = {H_MAX} about as much as the training"
    " itself; a metric, which a real run would compute less often)."
)
ratio_ok = True
for h in HS:
    expected_ratio = STEPS / math.ceil(STEPS / h)
    ratios = results["bytes"][f"H={h}"]["ratio_to_ddp"]
    ratio_ok &= all(abs(r - expected_ratio) < 1e-12 for r in ratios)
    how = "H exactly" if STEPS % h == 0 else f"{STEPS} / ceil({STEPS} / {h}), not {h}: H does not divide {STEPS}"
    mpi.print0(terminal.paragraph(f"H = {h}: ddp sends {ratios[0]:.2f} times the bytes of local SGD, on every rank"
                                  f" ({how})", "   ", "      "))  # fmt: skip
master = results["bytes"][f"H={H_MASTER} master"]["measured"]
averages = results["bytes"][f"H={H_MASTER} master"]["averages"]
say(
    f"Through rank 0 (--average-via master, H = {H_MASTER}), each average costs rank 0 (p-1) n ="
    f" {(p - 1) * N:,} bytes (the average sent back to each rank) and every other rank n = {N:,} (its weights to rank"
    f" 0): rank 0 sends {master[0] / averages:,.0f} per average against the ring's {ring:,.0f} on every rank,"
    f" p/2 = {p / 2:g} times more; the busiest link decides how long an average takes."
)
master_ok = master == [averages * (p - 1) * N] + [averages * N] * (p - 1)
checks.ok("traced bytes per rank equal LocalSGD.costs() (and DataParallel.costs() for ddp) in every run", bytes_ok)
checks.ok("ddp / local SGD = steps / ceil(steps / H): H when H divides the steps", ratio_ok)
checks.ok("through rank 0: (p-1) n per average from rank 0, n from every other rank", master_ok)

# ----------------------------------------------------------------------------------------------------- 3. drift
# Between averages every rank follows its own data, so the replicas drift apart; an average puts them back on one
# point. The consensus distance, the mean over ranks of ||w_r - w_avg|| / ||w_avg||, computed here after every step
# from the weights themselves (their average in float64 with MPI's own all-reduce), on the very runs of section 2.
DRIFT_HS = [h for h in HS if h in (1, 4, 16)] or HS
heading(f"3. Drift: distance of the replicas from their average after every step, H = {', '.join(map(str, DRIFT_HS))}")


def consensus(flat) -> float:
    flat = to_host(flat)  # (GPU weights: measured on a host copy)
    mean = mean_over_ranks(flat)
    return world.allreduce(float(np.linalg.norm(flat - mean))) / p / float(np.linalg.norm(mean))


drift, drift_ok = {}, True
RAMP = " .:-=+*#%@"  # low to high
SHOWN = min(96, STEPS, max(16, (terminal.columns() or 100) - 24))  # the steps drawn: as many as fit, 96 at most
say(f"one character per step, the first {SHOWN} steps: '{RAMP[0]}' zero (right after an average), '{RAMP[-1]}' the"
    " run's largest distance (given after each line)")  # fmt: skip
for h in DRIFT_HS:
    cfg, metrics = runs[f"H={h}"]
    distances = []
    for _, paradigm in stepped(cfg):
        distances.append(consensus(paradigm.model.flat_params))
    paradigm.finish()
    same_run = everywhere(weights_digest(paradigm.full_parameters()) == metrics["weights_sha256"], world)
    at_average = [d for s, d in enumerate(distances, 1) if s % h == 0]  # right after an average
    between = [d for s, d in enumerate(distances, 1) if s % h]
    driver = metrics["communication"]["per_rank"][0]["paradigm"]["consensus_distance"]
    mine = distances[PER_EPOCH - 1 :: PER_EPOCH]  # at each epoch's end
    agree = all(abs(a - b) <= 1e-6 + 1e-3 * b for a, b in zip(driver, mine))
    drift_ok &= same_run and agree and all(d == 0.0 for d in at_average) and all(d > 0 for d in between)
    top = max(distances)
    line = "".join(RAMP[math.ceil(d / top * (len(RAMP) - 1))] if top else RAMP[0] for d in distances[:SHOWN])
    scale = f"{top:.4f}" if top else "all 0"
    mpi.print0(f"   H = {h:2d} |{line}| {scale}")
    drift[h] = {"per_step": distances, "driver_per_epoch": driver, "mine_per_epoch": mine, "same_run": same_run}
if rank == 0:
    say("Each epoch's distances: their mean, their largest, the last (at the epoch's end), and the driver's figure"
        " at the end:")  # fmt: skip
    cells = []
    for e in range(args.epochs):
        cells.append([str(e + 1)])
        for h in DRIFT_HS:
            epoch = drift[h]["per_step"][e * PER_EPOCH : (e + 1) * PER_EPOCH]
            ends = (statistics.mean(epoch), max(epoch), epoch[-1], drift[h]["driver_per_epoch"][e])
            cells[-1] += [f"{v:.4f}" for v in ends]
    table(["epoch", *(f"H={h} {what}" for h in DRIFT_HS for what in ("mean", "max", "at end", "driver's"))], cells,
          left=(), groups=tuple(range(1, 1 + 4 * len(DRIFT_HS), 4)))  # fmt: skip
    means = [statistics.mean(drift[h]["per_step"]) for h in DRIFT_HS]
    say(
        "Mean distance over all steps: "
        + ", ".join(f"H = {h}: {m:.4f}" for h, m in zip(DRIFT_HS, means))
        + ". It is zero right after every average and grows until the next one, so the figure at an epoch's end"
        f" depends on where the epoch's {PER_EPOCH} steps fall between two averages (zero whenever H divides the"
        " step count): metrics.json's consensus_distance is a sample of the sawtooth, not its height."
    )
results["drift"] = {str(h): v for h, v in drift.items()}
checks.ok(
    "exactly 0 after every average (always for H = 1), > 0 between; the driver's figures at the epochs' ends agree"
    " and its final weights are these",
    drift_ok,
)

# ------------------------------------------------------------------------------------- 4. accuracy against bytes
# What the saved bytes cost: each variant trained with --seeds seeds (seed 0's runs are section 2's), the test
# accuracy of the final model (the replicas' average) after the same epochs as ddp.
SEEDS = list(range(args.seeds))
heading(f"4. Accuracy against bytes: {args.epochs} epochs, test accuracy of the final model, seeds"
        f" {', '.join(map(str, SEEDS))}")  # fmt: skip
accuracy = {}
for name, overrides in VARIANTS.items():
    rows = [runs[name][1]] + [trained(config(seed=s, **overrides)) for s in SEEDS[1:]]
    accuracy[name] = {
        "test_accuracy": [100 * m["final"]["test_accuracy"] for m in rows],
        "train_loss": [m["final"]["train_loss"] for m in rows],
        "train_time_s": [sum(e["train_time_s"] for e in m["epochs"]) for m in rows],
        "bytes": results["bytes"][name]["measured"][0],
    }
if rank == 0:
    reference = statistics.mean(accuracy["ddp"]["test_accuracy"])
    cells = []
    for name, row in accuracy.items():
        mean = statistics.mean(row["test_accuracy"])
        row["difference"] = mean - reference
        spread = f"{min(row['test_accuracy']):.2f}-{max(row['test_accuracy']):.2f}"
        cells.append([name, f"{row['bytes']:,d}", f"{row['bytes'] / accuracy['ddp']['bytes']:.1%}", f"{mean:.2f}%",
                      f"{row['difference']:+.2f}", spread, f"{statistics.mean(row['train_loss']):.4f}",
                      f"{statistics.mean(row['train_time_s']):.2f}"])  # fmt: skip
    table(["run", "bytes per rank", "of ddp", "test accuracy", "vs ddp", "range over seeds", "train loss", "train s"],
          cells, groups=(3,))  # fmt: skip
    say(
        f"(test accuracy: the mean over the seeds, in %, on {len(digits['float32'].y_test)} test images, so one image"
        f" is {100 / len(digits['float32'].y_test):.2f} points; vs ddp: points; train loss: the ranks' own losses"
        " on their slices in the last epoch; train s: seconds of training on this machine, rank 0)"
    )
    if 8 in HS:
        d = accuracy["H=8"]["difference"]
        met = "met" if abs(d) <= 1.5 else "NOT met"
        say(f"H = 8 on {p} ranks: {d:+.2f} points from ddp's accuracy, sending"
            f" {results['bytes']['H=8']['ratio_to_ddp'][0]:.1f} times fewer bytes (target: within 1.5 points:"
            f" {met})")  # fmt: skip
    say(
        "On the digits local SGD gives up next to nothing for these H: the replicas start from the same weights,"
        f" drift at most {100 * max(max(d['per_step']) for d in drift.values()):.0f}% of their norm away from their"
        " average (section 3), and that average is as good a model as ddp's. The saving in bytes is"
        " exact, the cost in accuracy is a measurement of this problem: harder problems, bigger learning rates and"
        " larger H drift further (post-local SGD keeps the first, large-gradient steps exact)."
    )
    results["accuracy"] = accuracy
    results["h8_difference_points"] = accuracy["H=8"]["difference"] if 8 in HS else None

# ------------------------------------------------------------------------- 5. across a slow link, time to 96%
CLUSTER_RUNS = {"ddp": {**cluster_util.DIGITS_RUN, "paradigm": "ddp", "allreduce": "ring"},
                "local SGD H=8": {**cluster_util.DIGITS_RUN, "paradigm": "local-sgd", "sync_every": 8,
                                  "allreduce": "ring"}}  # fmt: skip


def across_a_slow_link(cluster) -> dict:
    """ddp and local SGD (H = 8) trained on the digits across the cluster's link: each one's training time to 96%
    beside the cost model's, and why (rank 0, while the lesson's other ranks sleep)."""
    sizes, per_epoch = cluster_util.digits_workload()
    accuracy, epochs = cluster_util.ACCURACY, cluster_util.DIGITS_EPOCHS
    measured = cluster_util.to_accuracy(cluster, CLUSTER_RUNS, sizes, per_epoch, epochs, accuracy, "ddp")
    n, q = 4 * parameter_count(sizes), cluster.nodes * cluster.slots
    ddp, local = measured["ddp"], measured["local SGD H=8"]
    say(f"(MLP {'-'.join(map(str, sizes))}, global batch {CLUSTER_RUNS['ddp']['batch_size']} ({per_epoch} steps an"
        f" epoch), SGD lr {CLUSTER_RUNS['ddp']['lr']} momentum {CLUSTER_RUNS['ddp']['momentum']}, {epochs} epochs;"
        f" epochs: to {100 * accuracy:g}% test accuracy; seconds: their training time, from metrics.json;"
        " model s: those epochs' steps x the paradigm's step_time, this machine's compute shared by all the"
        " cluster's ranks and the link's rate and latency; step ms: training time a step, epochs 2 on)")  # fmt: skip
    if ddp["seconds"] and local["seconds"]:
        said = (f"It needed {local['epoch']} epoch(s) to ddp's {ddp['epoch']}, and reached {100 * accuracy:g}%"
                f" {terminal.speed(local['seconds'], ddp['seconds'], 'ddp')}; the model says"
                f" {terminal.speed(local['model_seconds'], ddp['model_seconds'], 'ddp')}.")  # fmt: skip
    else:
        said = f"One of them did not reach {100 * accuracy:g}% in {epochs} epochs (the table says which)."
    say(f"ddp's ring sends 2(p-1)/p n = {2 * (q - 1) / q * n / 1e3:,.0f} KB of gradient across the link each way"
        f" every step (n = {n:,} bytes), {1e3 * 2 * (q - 1) / q * n * 8 / cluster.link_bits_s:.0f} ms at"
        f" {rate_words(cluster.link)}, against about a millisecond of compute: on this link a ddp step is the link."
        " Local SGD sends the same bytes, the weights, once every 8 steps. " + said)  # fmt: skip
    return measured


heading(f"5. Across a {rate_words(args.link)} link: ddp against local SGD (H = 8), the time to"
        f" {100 * cluster_util.ACCURACY:g}% test accuracy on a cluster")  # fmt: skip
measured = cluster_part(args, world, "5", across_a_slow_link)
if rank == 0:
    results["cluster"] = measured

mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
conclude(args.json, results, checks)

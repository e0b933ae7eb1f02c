"""Lesson 9: ZeRO on real MPI ranks. Data parallelism in which no rank keeps a whole copy of the training state.

Data parallelism (lesson 3) keeps on every rank the parameters, the gradients and the optimizer state of the whole
model. ZeRO (the idea behind PyTorch FSDP and DeepSpeed) keeps the data parallelism, the same steps as one process,
but lets rank r *own* chunk r of every layer and hold the rest only while it is needed: the optimizer state (stage
1), the gradients too (stage 2), the parameters too (stage 3). dtrain/parallel/zero.py, with its bookkeeping in
zero_shards.py; ``dtrain train --paradigm zero --zero-stage 1|2|3``:

    dtrain launch -n 4 lessons/09_zero.py
    dtrain launch -n 3 lessons/09_zero.py          # chunks of unequal size
    dtrain launch -n 2 lessons/09_zero.py --json zero.json

What you will see:
  1. the memory of one training step, broken down: parameters, gradients and optimizer state grow with the model,
     activations with the batch; which of them ZeRO shards (not the activations);
  2. who owns what: every rank's chunk of every layer, what each rank holds between steps at each stage, and one
     stage-3 step on rank 0, allocation by allocation: each layer gathered, used and freed, forward then backward;
  3. training on real ranks: every stage follows single's loss curve (float64, to ~1e-12); the bytes each rank held
     at its peak, counted by the paradigm's ledger, against Zero.costs() (exactly) and the ZeRO paper's formula in
     dtrain's terms (which leaves out the layer in flight); the bytes it sent per step against the formula and
     against a ring all-reduce (stages 1 and 2: the same, stage 3: 1.5x);
  4. when each stage pays: the largest model that fits a memory budget at each stage and N, from the cost formula,
     and the price measured here: step time against ddp.

Every check compares with an independent oracle (single-process training, the ledger against the cost function, the
tracer's bytes against the formula) and prints an OK line (FAIL if it does not hold); the last line says whether all
passed (the exit status is non-zero if not). Timings are measurements, printed and never checked; with more ranks than
cores (4 ranks on 2 cores) a rank often waits for a core rather than for a message (docs/benchmarks.md, section 7).

`--device gpu` runs the same on GPUs (one per rank, rank % GPUs): the models, batches, optimizer state and
collectives of every section (through StagedComm when MPI is not CUDA-aware); nothing stays on the CPU.

Things to try:
  * --hidden 2048,2048: the largest layer is 72% of the model, and stages 2 and 3 hold it whole while it is in
    flight: how much do they still save?
  * --accumulate 4 in section 3: stages 2 and 3 reduce-scatter after every micro-batch; count the bytes;
  * dtrain launch -n 4 -m dtrain train --paradigm zero --zero-stage 3 --trace z.json, then https://ui.perfetto.dev.

Exercises (write it yourself; `dtrain exercises init ex` once copies the stubs
into ex/):
  9.1  the ZeRO step: reduce-scatter the gradient (the average), step the
       optimizer on your chunk only, all-gather the weights:
         dtrain exercises check 9.1 --path ex
Checked against one SGD step with the average gradient in one process, and
against the bytes of a reduce-scatter and an all-gather, on simulated ranks and
under mpiexec.
"""

import itertools
import statistics

import numpy as np
from lesson_util import (
    Checks,
    add_device_flag,
    big_model_parser,
    big_model_widths,
    conclude,
    heading,
    lesson_xp,
    parse_and_start,
    say,
    single_reference,
    slowest_seconds,
    table,
)

from dtrain import terminal
from dtrain.autograd import Tensor, activation_bytes, softmax_cross_entropy
from dtrain.comm import mpi
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import ShardedLoader, load_dataset, steps_per_epoch
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import parameter_count
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.zero import Zero, paper_formula
from dtrain.parallel.zero_shards import KINDS, units_of
from dtrain.train import train

parser = big_model_parser("Lesson 9: ZeRO on MPI ranks", epochs=3, trained_in=3, model="big", hidden="1024,1024",
                          big_batch=192, steps=8, timed_in=4)  # fmt: skip
add_device_flag(parser)
args, world, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
xp = lesson_xp(args, world)  # numpy, or cupy on this rank's GPU (--device gpu)

HIDDEN = big_model_widths(args, p, split=False)

digits = load_dataset("digits")
wide = load_dataset("synthetic", samples=2 * args.big_batch, features=784)
SMALL = [digits.n_features, 128, 128, digits.n_classes]  # the default model of `dtrain train`
BIG = [wide.n_features, *HIDDEN, wide.n_classes]
STAGES = (1, 2, 3)
results = {"world": p}
checks = Checks(world)  # each claim checked on every rank, and printed: checks.ok(claim, flag)


def name(sizes) -> str:
    return "-".join(map(str, sizes))


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f}"


def zero_config(stage: int, sizes, batch: int, **extra) -> TrainConfig:
    return TrainConfig(paradigm="zero", zero_stage=stage, hidden=tuple(sizes[1:-1]), batch_size=batch,
                       allreduce="ring", timeout=0, device=args.device, **extra)  # fmt: skip


def built(stage: int, sizes, batch: int, optimizer: str = "sgd") -> Zero:
    """A Zero paradigm on the whole world, built as the driver builds it (each rank: its chunks)."""
    zero = Zero(prepare(world, device=args.device, timeout=0), zero_config(stage, sizes, batch, optimizer=optimizer))
    zero.build(lambda: MLP(sizes, seed=0, xp=xp), lambda model: make_optimizer(optimizer, model, 0.01))
    return zero


mpi.print0(f"Lesson 9: ZeRO, sharded data parallelism, on {p} rank(s)")

# ------------------------------------------------------------------- 1. the memory of a training step, broken down
# Three kinds of training state have one entry per parameter: the parameters, their gradients, and the optimizer's
# buffers (SGD's momentum: one; Adam's two moments: two). Activations are different: forward keeps every
# intermediate result for backward, one row per sample, so they grow with the batch, not with the parameters.
n_big = parameter_count(BIG)
heading(f"1. What one replica of {name(BIG)} ({n_big:,} parameters) holds for a step, in float32 (MB)")
model = MLP(BIG, seed=0, xp=xp)
state = {
    "parameters": model.flat_params.nbytes,
    "gradients": model.flat_grads.nbytes,
    "optimizer (SGD momentum)": make_optimizer("sgd", model, 0.01, momentum=0.9).velocity.nbytes,
    "optimizer (Adam: m and v)": sum(b.nbytes for b in make_optimizer("adam", model, 0.01)._buffers().values()),
}
batches = (8, 64, 512)
activations = {}
for b in batches:  # measured: the intermediate results one forward keeps for its backward
    rows = np.arange(b) % len(wide.y_train)  # (repeating samples where the set is smaller: the bytes are the same)
    x, y = xp.asarray(wide.x_train[rows]), xp.asarray(wide.y_train[rows])
    activations[b] = activation_bytes(softmax_cross_entropy(model(Tensor(x)), y))
sharded_from = {"parameters": "stage 3", "gradients": "stage 2"}
cells = [[what, "the model", *(mb(nbytes) for _ in batches), f"from {sharded_from.get(what, 'stage 1')}"]
         for what, nbytes in state.items()]  # fmt: skip
cells.append(["activations (measured)", "the batch", *(mb(activations[b]) for b in batches), "never"])
table(["what", "grows with", *(f"batch {b}" for b in batches), "ZeRO shards it"], cells, left=(0, 1, 5))
per_sample = [(activations[b] - 4) / b for b in batches]  # (the loss itself is one float32)
say(
    f"Per sample, the forward keeps {per_sample[0] / 1e3:.1f} KB (every layer's x@W, +b and ReLU outputs). With "
    "Adam, the state that grows with the model is 4x the weights; ZeRO divides it by the ranks. Activations are the "
    "business of other tools: smaller micro-batches (--accumulate), recomputing them in backward (activation "
    "checkpointing), or splitting the layers themselves (tensor and pipeline parallelism)."
)
checks.ok("activations grow linearly with the batch", max(per_sample) - min(per_sample) < 1e-9)
results["memory"] = {"state": state, "activations": {str(b): a for b, a in activations.items()}}

# ---------------------------------------------------------------------------------------- 2. who owns what
# Each layer's slice of the flat buffer (weight, then bias) is cut into p chunks by chunk_bounds, the cut that a
# reduce-scatter makes: rank r owns chunk r of every layer, so a reduce-scatter of a layer's gradient leaves on rank
# r exactly the chunk it updates.
heading(f"2. Who owns what: every layer of {name(BIG)} cut into {p} chunks")
owned = world.gather([(u.lo, u.hi) for u in units_of(BIG, rank, p)], root=0)
if rank == 0:
    layers = [a * b + b for a, b in itertools.pairwise(BIG)]
    table(["layer", "parameters", *(f"rank {r} owns" for r in range(p))],
          [[f"{i}", f"{size:,}", *(f"[{owned[r][i][0]:,}, {owned[r][i][1]:,})" for r in range(p))]
           for i, size in enumerate(layers)], left=(), keys=2)  # fmt: skip
    results["ownership"] = owned
held_between_steps = {}
for stage in STAGES:
    zero = built(stage, BIG, args.big_batch)
    held_between_steps[stage] = world.gather(dict(zero.ledger.now), root=0)
if rank == 0:
    full = n_big * 4
    print()
    say("what each rank holds between steps (# = held, . = not held; momentum SGD):")
    who = len(f"rank {p - 1}")
    n = max(8, min(24, ((terminal.columns() or 100) - 3 - 10 - 1 - who - 1 - 8) // 3))  # (three bars of n a line)
    kinds = " ".join(f"{kind:{n + 2}s}" for kind in ("parameters", "gradients", "optimizer state"))
    print(f"   {'':10s} {'':{who}s} {kinds}".rstrip())
    for stage in STAGES:
        for r, held in enumerate(held_between_steps[stage]):
            bars = " ".join("[" + "#" * round(n * held[k] / full) + "." * (n - round(n * held[k] / full)) + "]"
                            for k in KINDS)  # fmt: skip
            print(f"   {f'stage {stage}' if r == 0 else '':10s} {f'rank {r}':{who}s} {bars}")

# One stage-3 step on rank 0, as its ledger saw it: a layer exists whole only between its gather and its free.
zero = built(3, BIG, args.big_batch)
zero.ledger.start_recording()
x, y = next(ShardedLoader(wide.x_train, wide.y_train, args.big_batch, rank, p, xp=xp).epoch(1))
zero.step(x, y)
history = zero.ledger.history
peak_ok = True
if rank == 0:
    print()
    chunks = mb(history[0][1]["parameters"])
    say(f"one stage-3 step on rank 0, allocation by allocation (MB held; its chunks: {chunks})")
    table(["what happened", "parameters", "gradients"],
          [[what, mb(held["parameters"]), mb(held["gradients"])] for what, held in history])  # fmt: skip
    largest = max(u.size for u in zero.units) * 4
    peak = max(held["parameters"] for _, held in history)
    peak_ok = history[-1][1] == history[0][1] and peak == history[0][1]["parameters"] + largest
    results["history"] = history
checks.ok("every layer is freed after use; the peak is chunks + largest layer", peak_ok)

# ------------------------------------------------------------------------------ 3. training on real ranks
# The driver's train() on digits in float64 (so that rounding hides nothing): single on rank 0 alone, then ddp and
# ZeRO's three stages on all p ranks. Same seed, same global batches: every curve must be single's.
heading(f"3. Training {name(SMALL)} on digits, float64, global batch {args.batch_size}, {args.epochs} epochs")
common = dict(epochs=args.epochs, hidden=tuple(SMALL[1:-1]), batch_size=args.batch_size, dtype="float64",
              timeout=0, progress=False, quiet=True, device=args.device)  # fmt: skip
single, _ = single_reference(TrainConfig(paradigm="single", **common), world)
configs = {"ddp": TrainConfig(paradigm="ddp", allreduce="ring", bucket_mb=0, **common)}
configs.update({f"zero {s}": TrainConfig(paradigm="zero", zero_stage=s, allreduce="ring", **common) for s in STAGES})
runs = {label: train(cfg, world) for label, cfg in configs.items()}  # rank 0's has every rank's figures
training_ok = held_ok = bytes_ok = True
if rank == 0:
    steps = args.epochs * steps_per_epoch(len(digits.y_train), args.batch_size)
    curves = {"single": [e["train_loss"] for e in single["epochs"]]}
    curves.update({label: [e["train_loss"] for e in m["epochs"]] for label, m in runs.items()})
    table(["epoch", *curves], [[f"{e + 1}", *(f"{curves[label][e]:.14f}" for label in curves)]
                               for e in range(args.epochs)], left=())  # fmt: skip
    worst = max(abs(a - b) / abs(b) for label in curves for a, b in zip(curves[label], curves["single"]))
    training_ok = worst < 1e-10
    say(f"largest relative difference from single: {worst:.1e}")

    n, b = parameter_count(SMALL), 8
    largest = max(a * c + c for a, c in itertools.pairwise(SMALL))
    print()
    say(f"peak bytes held per rank, KB (n = {n:,} parameters of {b} bytes; the largest layer {largest:,}): measured "
        "by the paradigm's ledger, and the ZeRO paper's formula in dtrain's terms")  # fmt: skip
    results["held"], cells = {}, []
    for stage in STAGES:
        label, metrics = f"zero {stage}", runs[f"zero {stage}"]
        held = metrics["communication"]["per_rank"][0]["paradigm"]["held_bytes"]
        costs, paper = metrics["costs"], paper_formula(n, p, stage, b, 1)
        for r in range(p):
            exact = all(held[r][k] == costs[k][r] for k in KINDS)
            held_ok = held_ok and exact
            cells.append([label if r == 0 else "", f"{r}", *(f"{held[r][k] / 1e3:.1f}" for k in KINDS),
                          "yes" if exact else "NO", *(f"{paper[k] / 1e3:.1f}" for k in KINDS)])  # fmt: skip
        results["held"][label] = {"measured": held, "costs": {k: costs[k] for k in KINDS}, "paper": paper}
    table(["", "rank", *(f"ledger: {k}" for k in KINDS), "= costs()", *(f"paper: {k}" for k in KINDS)], cells,
          left=(0, 5), keys=2, groups=(6,))  # fmt: skip
    say(
        f"Stage 1 shards the momentum; stages 2 and 3 hold, besides their chunks, one layer whole while it is in "
        f"flight ({largest * b / 1e3:.1f} KB here: the gradient being reduce-scattered, the layer being gathered), "
        f"which the paper's formula leaves out: on this small model that layer is {100 * largest / n:.0f}% of it, so "
        "the saving is far from 1/N; docs/benchmarks.md (section 7) measures larger models."
    )

    def sent_per_step(metrics, prefix):
        return [sum(o["bytes_sent"] for label, o in mine["operations"].items() if label.startswith(prefix)) / steps
                for mine in metrics["communication"]["per_rank"]]  # fmt: skip

    ddp_sent = sent_per_step(runs["ddp"], "allreduce/")
    print()
    say(f"bytes sent per step, every rank (ddp: one ring all-reduce of {n * b:,} bytes)")
    results["bytes"], cells = {"ddp": ddp_sent}, []
    for label in ("ddp", *(f"zero {s}" for s in STAGES)):
        sent = sent_per_step(runs[label], "zero/" if label != "ddp" else "allreduce/")
        exact = sent == runs[label]["costs"]["sent_per_step"]
        ratio = sum(sent) / sum(ddp_sent) if sum(ddp_sent) else float("nan")
        bytes_ok = bytes_ok and exact and (p == 1 or abs(ratio - (1.5 if label == "zero 3" else 1.0)) < 0.01)
        cells.append([label, *(f"{s:,.0f}" for s in sent), "yes" if exact else "NO", f"{ratio:.3f}"])
        results["bytes"][label] = sent
    table(["", *(f"rank {r}" for r in range(p)), "= costs()", "bytes / ddp's"], cells, left=(0, p + 1))
    say(
        "A reduce-scatter and an all-gather are the two halves of a ring all-reduce: stages 1 and 2 send what ddp "
        "sends, only in another order around the optimizer step. Stage 3 gathers each layer twice (before its "
        "forward and before its backward): 1.5x."
    )
    results["training"] = curves
checks.ok("every stage follows single's loss curve", training_ok)
checks.ok("the bytes held at the peak equal Zero.costs() on every rank", held_ok)
checks.ok("bytes per step = Zero.costs(); stages 1-2 send ddp's, stage 3 1.5x", bytes_ok)

# ----------------------------------------------------------------------------------- 4. when each stage pays
# Memory: per parameter, ddp holds b (weights) + b (gradients) + k b (optimizer) on every rank; stage s divides the
# kinds it shards by N. So the largest model a rank can train grows with N only when the parameters are sharded too.
heading("4. When each stage pays")
budget, b, k = 80e9, 4, 2  # an 80 GB accelerator, float32, Adam
say(
    f"From the paper's formula in dtrain's terms: the largest model, in billions of parameters, whose float32 Adam "
    f"state fits in {budget / 1e9:.0f} GB per rank (activations need room too):"
)
counts = (1, 8, 64, 512)
largest_model = {}
for stage in (0, *STAGES):
    label = "ddp" if stage == 0 else f"zero {stage}"
    per_parameter = [sum(paper_formula(1, c, stage, b, k).values()) for c in counts]
    largest_model[label] = [budget / per / 1e9 for per in per_parameter]
table(["", *(f"N = {c}" for c in counts)], [[label, *(f"{v:.1f}" for v in values)]
                                            for label, values in largest_model.items()])  # fmt: skip
say(
    "ddp's limit does not move with N; stage 1 and 2 approach a limit of budget / 2b and budget / b (the unsharded "
    "weights, and gradients); only stage 3 grows with N, and only while the largest layer, which it holds whole, fits."
)


def timed_steps(paradigm, batches, count: int) -> list[float]:
    """Wall time of ``count`` steps, each the slowest rank's (a barrier before each: the ranks start together)."""
    times = []
    for _ in range(count):
        x, y = next(batches)
        times.append(slowest_seconds(world, paradigm.step, x, y))  # (it reads the loss: on a GPU, that waits)
    return times


contenders = {"ddp": None, **{f"zero {s}": s for s in STAGES}}
paradigms, feeds = {}, {}
for label, stage in contenders.items():
    if stage is None:
        cfg = TrainConfig(paradigm="ddp", hidden=HIDDEN, batch_size=args.big_batch, allreduce="ring", bucket_mb=0,
                          optimizer="adam", device=args.device)  # fmt: skip
        paradigm = DataParallel(prepare(world, device=args.device, timeout=0), cfg)
        paradigm.build(lambda: MLP(BIG, seed=0, xp=xp), lambda m: make_optimizer("adam", m, 0.001))
    else:
        paradigm = built(stage, BIG, args.big_batch, "adam")
    paradigms[label] = paradigm
    loader = ShardedLoader(wide.x_train, wide.y_train, args.big_batch, rank, p, xp=xp)
    feeds[label] = itertools.cycle(list(loader.epoch(1)))
    timed_steps(paradigm, feeds[label], 1)  # warm-up: first touches, Numba's first calls
times = {label: [] for label in contenders}
for _ in range(args.steps):  # interleaved, step by step: a slow moment of the machine slows every contender alike
    for label in contenders:
        times[label] += timed_steps(paradigms[label], feeds[label], 1)
if rank == 0:
    base = statistics.median(times["ddp"])
    print()
    say(f"measured here: {name(BIG)}, Adam, global batch {args.big_batch}, {p} rank(s); the median of {args.steps} "
        "interleaved steps")  # fmt: skip
    costs = {label: (DataParallel.costs(BIG, p, paradigms[label].config) if label == "ddp"
                     else Zero.costs(BIG, p, paradigms[label].config)) for label in contenders}  # fmt: skip
    timing, cells = [], []
    for label in contenders:
        c = costs[label]
        by_rank = [[c[kind]] * p if not isinstance(c[kind], list) else c[kind] for kind in KINDS]
        held, sent = max(map(sum, zip(*by_rank))), max(c["sent_per_step"])
        ms = 1e3 * statistics.median(times[label])
        against = "-" if label == "ddp" else terminal.speed(ms, 1e3 * base, "ddp")
        cells.append([label, f"{ms:.1f}", against, f"{held / 1e6:.2f}", f"{sent / 1e6:.2f}"])
        timing.append({"contender": label, "ms_per_step": ms, "held_bytes": held, "sent_per_step": sent})
    table(["", "ms per step", "against ddp", "MB held (fullest rank)", "MB sent per step"], cells, left=(0, 2))
    ddp_row, stage_rows = timing[0], timing[1:]
    findings = "; ".join(
        f"{t['contender']} is {terminal.speed(t['ms_per_step'], ddp_row['ms_per_step'], 'ddp')} and holds "
        f"{t['held_bytes'] / ddp_row['held_bytes']:.0%} of its memory"
        for t in stage_rows
    )
    stage1, stage3 = stage_rows[0], stage_rows[-1]
    if p == 1:
        why = "On one rank there is nothing to shard: every stage does ddp's work, plus its own bookkeeping"
    elif stage1["ms_per_step"] < ddp_row["ms_per_step"]:
        why = (
            "Sharding the optimizer state also shards the optimizer's work (each rank updates 1/N of the weights), "
            "and here that outweighs the per-layer collectives"
        )
    else:
        why = (
            "Here the per-layer collectives (one per layer where ddp makes one) cost more than the optimizer work "
            "that sharding saves"
        )
    extra = stage3["ms_per_step"] - stage1["ms_per_step"]
    traffic = (f"{stage3['sent_per_step'] / stage1['sent_per_step']:.1f}x the bytes" if stage1["sent_per_step"]
               else "on one rank nothing is sent: the difference is the work of gathering and freeing")  # fmt: skip
    say(
        f"Measured: {findings}. {why}. Stage 3's extra gathers cost {extra:+.1f} ms per step against stage 1 "
        f"here ({traffic}). Take the lowest stage whose "
        "memory fits, and stage 3 when the parameters themselves do not fit on a rank."
    )
    results["timing"] = timing
    results["largest_model_billions"] = largest_model

# the docstring's Exercises section, as it is (it keeps to 80 columns: it is printed)
mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
conclude(args.json, results, checks)

"""Lesson 7: tensor parallelism on real MPI ranks. Every layer's matrices split over ranks that compute it together.

When a model's layers are too large for one device, split the *model*, not the data. Megatron-LM's tensor
parallelism cuts a Linear layer's weight by columns (each rank computes a block of the output columns from the whole
input) and the next layer's by rows (each rank multiplies its block and the partial products are summed by one
all-reduce). dtrain/parallel/tensor_parallel.py, with the rank grid in grid.py, each rank's pieces of the whole model
in placement.py and what tensor and pipeline parallelism share in model_parallel.py;
``dtrain train --paradigm tp --tp T [--dp D]``:

    dtrain launch -n 4 lessons/07_tensor_parallel.py
    dtrain launch -n 2 lessons/07_tensor_parallel.py --json tp.json

What you will see:
  1. the two conjugate operators, f (identity forward, all-reduce backward) and g (all-reduce forward, identity
     backward), verified on these ranks against the unsharded layers: the output, the input's gradient and every
     slice of the weights' gradient; and the tracer's count: one all-reduce forward and one backward per
     column-then-row block (none backward for the model's first block, whose input is data);
  2. the rank grid: every way to factor this world into dp x tp, the printed map, and each rank's sub-communicators
     checked against it;
  3. memory per rank: a split layer costs 1/T per rank, a replicated one all of it; measured on a built model and
     held against TensorParallel.costs() and the formula;
  4. training on real ranks: every grid follows single's loss curve (float64, to ~1e-12), and every rank's bytes per
     step are the cost function's;
  5. the price: a step of a wide MLP (hidden 2048) with one thread per rank, tp = 1 against tp = N, and the share of
     it spent in communication. Measured, printed, never checked: with more ranks than cores (4 on 2) a rank waits
     for a core more than for a message.

Every check compares with an independent oracle and prints an OK line (FAIL if it does not hold); the last line says
whether all passed (the exit status is non-zero if not).

`--device gpu` runs the same on GPUs (one per rank, rank % GPUs): the models, batches and all-reduces of every
section (through StagedComm when MPI is not CUDA-aware); only the comparisons are made on host copies.

Things to try:
  * --hidden 4096,4096: the split layers' share of the memory grows; does the step time follow?
  * dtrain launch -n 4 -m dtrain train --paradigm tp --tp 2 --trace tp.json, then https://ui.perfetto.dev: the
    g all-reduce after every row-parallel layer, the f all-reduce in backward.

Exercises (write f and g yourself; `dtrain exercises init ex` once copies the
stubs into ex/):
  7.1  f, identity forward and all-reduce of the gradient backward, with
       Tensor._make:
         dtrain exercises check 7.1 --path ex
  7.2  g, all-reduce forward and identity backward:
         dtrain exercises check 7.2 --path ex
Each is checked alone (what it sends, and when) and inside a column-then-row
block against the unsharded layers, on simulated ranks and under mpiexec.
"""

import itertools
import statistics

import numpy as np
from lesson_util import (
    Checks,
    add_device_flag,
    against_single,
    big_model_parser,
    big_model_widths,
    conclude,
    heading,
    lesson_xp,
    parse_and_start,
    say,
    single_reference,
    sleeping_barrier,
    slowest_seconds,
    table,
)

from dtrain import terminal
from dtrain.autograd import Tensor
from dtrain.backend import to_host
from dtrain.comm import mpi, usable_cores
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import ShardedLoader, load_dataset
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import grid, parameter_count
from dtrain.parallel.placement import split
from dtrain.parallel.pricing import local_parameters
from dtrain.parallel.tensor_parallel import TensorGroup, TensorParallel, shard
from dtrain.train import train

parser = big_model_parser("Lesson 7: tensor parallelism on MPI ranks", epochs=3, trained_in=4, model="wide",
                          hidden="2048,2048", big_batch=256, steps=6, timed_in=5)  # fmt: skip
add_device_flag(parser)
args, world, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
xp = lesson_xp(args, world)  # numpy, or cupy on this rank's GPU (--device gpu)
from mpi4py import MPI  # for MPI.MAX (MPI has started by now)

HIDDEN = big_model_widths(args, p, split=True)  # the widths are split over the ranks

checks = Checks(world)
digits = load_dataset("digits")
SMALL = [
    digits.n_features,
    48,
    24,
    digits.n_classes,
]  # 48 splits over 1, 2, 3, 4, 6 ranks; the output layer: replicated
WIDE = [784, *HIDDEN, 10]
results = {"world": p}


def name(sizes) -> str:
    return "-".join(map(str, sizes))


def relative(a, b):
    """The largest difference of ``a`` from ``b``, relative to b's largest magnitude (on host copies)."""
    a, b = to_host(a), to_host(b)
    return np.abs(a - b).max() / np.abs(b).max()


def traffic(comm) -> dict:
    """This rank's tracer: calls and bytes sent per label."""
    return {label: (o["calls"], o["bytes_sent"]) for label, o in comm.tracer.summary()["operations"].items()}


mpi.print0(f"Lesson 7: tensor parallelism on {p} rank(s)")

# ---------------------------------------------------------------------- 1. f and g, against the unsharded layers
# Y = X A with A cut by columns: rank t computes Y_t = X A_t from the whole X. relu(Y) keeps the blocks apart. Z =
# relu(Y) B with B cut by rows: Z = sum_t relu(Y_t) B_t, one all-reduce (g). Backward, dX = sum_t dY_t A_t^T: one
# all-reduce again (f). Here every rank of the world is one tensor group, and every rank also computes the whole
# block itself, the oracle.
BLOCK = [96, 192, 48]  # widths that split over 1, 2, 3, 4, 6 and 12 ranks
m = 16
heading(f"1. A column-then-row block {name(BLOCK)} split over {p} rank(s), against the whole block (float64)")
whole = MLP(BLOCK, seed=1, dtype=np.float64, xp=xp)
x = xp.asarray(np.random.default_rng(2).standard_normal((m, BLOCK[0])))
upstream = xp.asarray(np.random.default_rng(3).standard_normal((m, BLOCK[-1])))
oracle_in = Tensor(x.copy(), requires_grad=True)
oracle_out = whole(oracle_in)
oracle_out.backward(upstream)
comm = prepare(world, device=args.device, timeout=0)
modules, pieces = shard(whole, 0, 2, TensorGroup(comm, "ring"))
worst, counts = 0.0, {}
for needs_grad in (True, False):  # a hidden block (its input needs a gradient) and a model's first block (data)
    comm.tracer.reset()
    inputs = Tensor(x.copy(), requires_grad=needs_grad)
    out = inputs
    for module in modules:
        for parameter in module.parameters():
            parameter.grad = xp.zeros_like(parameter.data)
        out = module(out)
    out.backward(upstream.copy())
    mine = [parameter.grad for module in modules for parameter in module.parameters()]
    diffs = [relative(out.data, oracle_out.data)]
    diffs += [relative(g, piece.view(whole.flat_grads)) for g, piece in zip(mine, pieces)]
    if needs_grad:
        diffs.append(relative(inputs.grad, oracle_in.grad))
    worst = max(worst, *diffs)
    counts[needs_grad] = traffic(comm)
if rank == 0:
    held = ", ".join(f"{type(mod).__name__} holds {'x'.join(map(str, mod.weight.data.shape))}" for mod in modules[::2])
    say(f"rank 0: {held}")
    cells = []
    for needs_grad, seen in counts.items():
        what = "a hidden block (input needs a gradient)" if needs_grad else "a model's first block (input is data)"
        mine = [[label, f"{c}", f"{b:,}"] for label, (c, b) in sorted(seen.items())] or [["none", "0", "0"]]
        cells += [[what if k == 0 else "", *row] for k, row in enumerate(mine)]
    table(["block", "all-reduce", "calls", "bytes sent"], cells, left=(0, 1))
    say(f"largest relative difference from the whole block (output, dX, every weight slice): {worst:.1e}")
expected = {True: {"tp/g-forward": 1, "tp/f-backward": 1}, False: {"tp/g-forward": 1}} if p > 1 else {True: {},
            False: {}}  # fmt: skip
checks.ok("the split block computes the whole block, gradients included", worst < 1e-13)
checks.ok(
    "one all-reduce forward (g) and one backward (f); none backward for data",
    all({label: c for label, (c, _) in counts[k].items()} == expected[k] for k in (True, False)),
)
ring = 2 * (p - 1) / p * m * BLOCK[-1] * 8
checks.ok("g sends 2 (T-1)/T m o b bytes (the ring's all-reduce)", p == 1 or counts[True]["tp/g-forward"][1] == ring)
say(
    "The output layer's bias is added once, after g (every rank holds it whole); added before the sum it would count "
    "T times. The column layer's bias splits with its columns. And f costs nothing when the block's input is the data "
    "batch: the autograd never computes a gradient nobody needs."
)

# --------------------------------------------------------------------------------------------- 2. the rank grid
# dp x tp = p ranks. tp varies fastest: the ranks that split a layer are neighbours (one node, the fastest link).
heading(f"2. The rank grid: every dp x tp = {p}")
grids_ok = True
factorings = [(p // t, t) for t in range(1, p + 1) if p % t == 0]
for dp, t in factorings:
    shape = grid.Shape(dp=dp, tp=t)
    mine = grid.Grid(world, shape)
    members = {axis: c.allgather(rank) for axis, c in mine.comms.items()}
    grids_ok = grids_ok and all(
        members[a] in shape.groups(a) and mine.comms[a].Get_rank() == mine.coordinates[a] for a in grid.AXES
    )
    mine.free()
    if rank == 0 and (t > 1 or dp == p):
        for line in shape.describe().splitlines():  # (a line longer than the terminal wrapped, standing in by two)
            lead = "   " + " " * (len(line) - len(line.lstrip()))
            print(terminal.paragraph(line.strip(), lead, lead + "  "))
checks.ok("each rank's sub-communicators hold the ranks its groups name", grids_ok)

# --------------------------------------------------------------------------------------------- 3. memory per rank
heading(f"3. Memory per rank: {name(WIDE)} in float32 ({parameter_count(WIDE):,} parameters)")
kinds = split(len(WIDE) - 1)
rows, cells = [], []
for t in sorted({1, 2, 4, 8, p}):
    if all(h % t == 0 for h in HIDDEN):
        n_t = local_parameters(WIDE, t)
        rows.append((t, n_t))
        cells.append([f"{t}", f"{n_t * 4 / 1e6:.2f}", f"{n_t / parameter_count(WIDE):.3f}"])
table(["tp", "MB of parameters per rank", "share of a replica"], cells, left=())
say(
    f"The layers are split {', '.join(f'{i}: {k}' for i, k in enumerate(kinds))}. Split layers cost 1/T of their "
    f"parameters per rank; the replicated output layer ({WIDE[-2]} x {WIDE[-1]}) costs all of it on every rank, so "
    "the share falls a little slower than 1/T. Gradients and optimizer state follow the parameters."
)
config = TrainConfig(paradigm="tp", tp=p, hidden=HIDDEN, batch_size=args.big_batch, timeout=0, quiet=True,
                     device=args.device)  # fmt: skip
paradigm = TensorParallel(prepare(world, device=args.device, timeout=0), config)
paradigm.build(lambda: MLP(WIDE, seed=0, xp=xp), lambda model: make_optimizer("sgd", model, 0.01, momentum=0.9))
held = paradigm.held_bytes()
costs = TensorParallel.costs(WIDE, p, config)
formula = sum((i * h + h + h * o) // p + o for i, h, o in zip(WIDE[0::2], WIDE[1::2], WIDE[2::2]))  # each block
formula += sum(i * o + o for (i, o), k in zip(itertools.pairwise(WIDE), kinds) if k == "replicated")
say(f"built on these {p} rank(s): rank {rank} holds {held['parameters']:,} bytes of parameters")
checks.ok(
    "each rank holds what TensorParallel.costs() and the formula say",
    held == {k: costs[k] for k in held} and held["parameters"] == formula * 4,
)
results["memory"] = {"rows": rows, "held": held}

# ------------------------------------------------------------------------------------ 4. training on real ranks
heading(f"4. Training {name(SMALL)} on digits, float64, global batch {args.batch_size}, {args.epochs} epochs")
common = dict(epochs=args.epochs, hidden=tuple(SMALL[1:-1]), batch_size=args.batch_size, dtype="float64",
              timeout=0, progress=False, quiet=True, device=args.device)  # fmt: skip
single, alone = single_reference(TrainConfig(paradigm="single", **common), world)
runs = {f"dp {dp} x tp {t}": train(TrainConfig(paradigm="tp", dp=dp, tp=t, **common), world) for dp, t in factorings}
results["training"] = against_single(
    checks, single, runs, ("tp/", "dp/"), "grid", "TensorParallel.costs()",
    "The same steps, however the model is held: tensor parallelism changes where each product is computed and the "
    "order in which the row-parallel partial products are summed, nothing else. The bytes grow with the batch "
    "(activations), not with the model; the data-parallel groups add one all-reduce of each rank's share of the "
    "gradients.",
)  # fmt: skip

# ---------------------------------------------------------------------------------------- 5. the price, measured
wide = load_dataset("synthetic", samples=2 * args.big_batch, features=784)
heading(f"5. A step of {name(WIDE)}, float32, global batch {args.big_batch}, one thread per rank")


def timed(paradigm, comm, count: int) -> tuple[list, list]:
    """Step times (the slowest rank's) and the time in the tensor group's all-reduces, per step."""
    batches = itertools.cycle(list(ShardedLoader(wide.x_train, wide.y_train, args.big_batch, 0, 1, xp=xp).epoch(1)))
    steps, comm_s = [], []
    for _ in range(count):
        x, y = next(batches)
        before = sum(o["time_s"] for lab, o in comm.tracer.summary()["operations"].items() if lab.startswith("tp/"))
        steps.append(slowest_seconds(comm, paradigm.step, x, y))  # (it reads the loss: on a GPU, that waits)
        after = sum(o["time_s"] for lab, o in comm.tracer.summary()["operations"].items() if lab.startswith("tp/"))
        comm_s.append(comm.allreduce(after - before, op=MPI.MAX))
    return steps, comm_s


def contender(comm, t):
    cfg = TrainConfig(paradigm="tp", tp=t, hidden=HIDDEN, batch_size=args.big_batch, timeout=0, quiet=True,
                      device=args.device)  # fmt: skip
    prepared = prepare(comm, device=args.device, timeout=0)
    built = TensorParallel(prepared, cfg)
    built.build(lambda: MLP(WIDE, seed=0, xp=xp), lambda model: make_optimizer("sgd", model, 0.01, momentum=0.9))
    timed(built, prepared, 1)  # warm-up: first touches of the buffers
    return timed(built, prepared, args.steps)


one = contender(alone, 1) if rank == 0 else None  # tp = 1 on rank 0 alone, the others asleep
sleeping_barrier(world)
split = contender(world, p)
if rank == 0:
    base = statistics.median(one[0])
    ms, share = 1e3 * statistics.median(split[0]), statistics.median(c / s for s, c in zip(*split))
    table(["", "ranks", "ms per step", "against tp = 1", "share in all-reduces"],
          [["tp = 1", "1", f"{1e3 * base:.1f}", "-", "-"],
           [f"tp = {p}", f"{p}", f"{ms:.1f}", terminal.speed(ms, 1e3 * base, "tp = 1"), f"{100 * share:.0f}%"]],
          left=(0, 3))  # fmt: skip
    crowded = f" and {p} ranks share {usable_cores()} cores" if p > usable_cores() else ""
    say(
        f"Each rank multiplies 1/{p} of the big matrices, so the products take about 1/{p} of the time while every "
        f"rank has a core of its own; in exchange every block puts an all-reduce of batch x width activations on the "
        f"critical path, forward and backward: {100 * share:.0f}% of the step here{crowded}. On a GPU node with NVLink "
        "that all-reduce is cheap next to the matrix products; across nodes it would not be, which is why tensor "
        "parallelism stays inside a node. docs/benchmarks.md (section 8) measures tp = 1, 2 and 4."
    )
    results["timing"] = {"tp1_ms": 1e3 * base, f"tp{p}_ms": ms, "comm_share": share}

# the docstring's Exercises section, as it is (it keeps to 80 columns: it is printed)
mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
conclude(args.json, results, checks)

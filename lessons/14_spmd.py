"""Lesson 14: SPMD on real MPI ranks. Say how each tensor is split over a mesh of devices; the messages follow.

Every paradigm so far placed its messages by hand: ddp's all-reduce (lesson 3), Megatron's f and g (lesson 7),
ZeRO's gathers (lesson 9). GSPMD, JAX's shardings and PyTorch's DTensor turn that around: the model's code is
written once, each tensor gets a **layout** (which mesh axis splits which of its dimensions), and a rule per op
derives the communication. Data parallelism is then batch sharding, Megatron column-then-row weight sharding, FSDP
row sharding of every weight. dtrain/parallel/spmd.py, with the mesh in mesh.py, the layouts and their rules in
layouts.py, the sharded tensors and their collectives in sharded.py and the MLP as a sharded program in
shardings.py; ``dtrain train --paradigm spmd --mesh x=2,y=2 --sharding dp|megatron|dp-megatron|fsdp|auto
--shard TENSOR=SPEC --explain``:

    dtrain launch -n 4 lessons/14_spmd.py
    dtrain launch -n 4 lessons/14_spmd.py --json spmd.json

What you will see:
  1. the notation: A[I_x, J_y] on a 2 x 2 mesh, the block (and its shape) each rank holds, checked against the
     coordinates written out by hand, and the blocks put back together into A;
  2. the matmul rule's four cases on real ranks: the layout of C, what is sent (the tracer's bytes against the
     formula) and the same list from the dry run that --explain and costs() read;
  3. data parallelism as batch sharding: --sharding dp ends with ddp's weights, bit for bit, and ddp's bytes;
  4. Megatron as column-then-row sharding: --sharding megatron sends tp's bytes (and ends with tp's weights);
  5. FSDP as weight sharding: every weight all-gathered before use, its gradient reduce-scattered after; the
     bytes and the state held against the formulas and against ZeRO stage 3;
  6. a 2 x 2 mesh that mixes them (dp-megatron): tp 2 x dp 2's bytes and weights, and the same run from --shard
     words alone;
  7. invalid layouts, and the one-line errors that refuse them before any message;
  8. the seed's point: one model code for every run; only --mesh, --sharding and --shard changed;
  9. --sharding auto in miniature: every layout tried, each priced on the planner's model, the cheapest kept.

Every training run is on digits in float64 and follows single's loss curve (to 1e-10; the runs differ from single
only in the order of a few sums). Every check compares with an independent oracle and prints an OK line (FAIL if
it does not hold); the last line says whether all passed (the exit status is non-zero if not).

Things to try:
  * dtrain train --paradigm spmd --mesh x=2,y=2 --sharding dp-megatron --explain: the query plan, on one process;
  * --shard w3=_,y on top of it (a third split layer): what does the loss now need, and what does it cost?
  * --sharding auto: which layout the planner's model picks on this machine, and what it beat;
  * dtrain launch -n 4 -m dtrain train --paradigm spmd --sharding fsdp --trace f.json, then
    https://ui.perfetto.dev: every message is labelled with its place in the graph.

Exercises (write them yourself; `dtrain exercises init ex` once copies the
stubs into ex/):
  14.1  matmul_layouts, the matmul propagation rule: from the layouts of A and
        B, C's layout, the axis it is a partial sum over, and the gathers:
          dtrain exercises check 14.1 --path ex
  14.2  redistribute, one redistribution of a rank's block on a mesh axis
        (all-reduce, reduce-scatter, all-gather):
          dtrain exercises check 14.2 --path ex
14.1 is checked on all 49 pairs of layouts on a mesh x, y against dtrain's
rule; 14.2 against NumPy on the whole tensor and a ring's bytes, on simulated
ranks and under mpiexec.
"""

import argparse
import inspect
import time
from dataclasses import replace

import numpy as np
from lesson_util import (
    Checks,
    against_single,
    conclude,
    heading,
    parse_and_start,
    refuse,
    refuse_bad_arguments,
    say,
    single_reference,
    table,
    whole_numbers,
)

from dtrain import terminal
from dtrain.autograd import Tensor
from dtrain.comm import mpi
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import steps_per_epoch
from dtrain.errors import ConfigError
from dtrain.parallel import auto_sharding, layouts, shardings
from dtrain.parallel.layouts import Layout
from dtrain.parallel.mesh import Mesh, MeshShape
from dtrain.parallel.sharded import Program, Sharded
from dtrain.parallel.spmd import SPMD
from dtrain.plan.hardware import Hardware
from dtrain.train import train

started = time.perf_counter()
parser = argparse.ArgumentParser(description="Lesson 14: SPMD, tensor layouts on a device mesh, on MPI ranks")
parser.add_argument("--epochs", type=int, default=2, help="epochs of every training run (default %(default)s)")
parser.add_argument("--batch-size", type=int, default=48, help="global batch on digits (default %(default)s)")
parser.add_argument("--hidden", default="64,64", help="the MLP's hidden widths (default %(default)s)")
parser.add_argument("--json", metavar="PATH", help="write every measurement to this file")
args, world, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it

if p != 4:
    refuse(f"lesson 14 lays its tensors on a mesh of 2 x 2 ranks, so it needs 4 ranks, got {p}: dtrain launch -n 4 "
           "lessons/14_spmd.py")  # fmt: skip
HIDDEN = whole_numbers(args.hidden)
refuse_bad_arguments([(
    args.epochs < 1 or args.batch_size < 1 or args.batch_size % 4 or len(HIDDEN) != 2 or min(HIDDEN, default=0) < 1
    or any(h % 4 for h in HIDDEN),
    f"--epochs must be >= 1, --batch-size divisible by the 4 ranks (got {args.batch_size}), --hidden two widths "
    f"divisible by 4 (Megatron and FSDP split them over 4 ranks; got {args.hidden!r})",
)])  # fmt: skip

checks = Checks(world)
results = {"world": p}
GRID = MeshShape((("x", 2), ("y", 2)))  # the 2 x 2 mesh of sections 1, 2 and 6
SIZES = dict(GRID.axes)
B = 8  # bytes per float64


def hand_coordinates(r: int) -> dict:
    """Rank r's place on the 2 x 2 mesh, written out by hand (the last axis varies fastest): the oracle."""
    return {"x": r // 2, "y": r % 2}


def span(n: int, axis, at: dict) -> tuple[int, int]:
    """The part ``start, stop`` of a dimension of ``n`` split over ``axis`` that a rank at coordinates ``at`` holds."""
    size = n if axis is None else n // SIZES[axis]
    start = 0 if axis is None else at[axis] * size
    return start, start + size


def block_of(matrix, dims, at: dict):
    """The block of ``matrix`` a rank at coordinates ``at`` holds under ``dims``, cut by hand: the oracle."""
    return matrix[tuple(slice(*span(n, axis, at)) for n, axis in zip(matrix.shape, dims))]


def written(dims, names: str = "IJ") -> str:
    """``I_x, J``: the notation of GSPMD and "How to Scale Your Model" for a layout of a matrix whose dimensions are
    called ``names``."""
    return ", ".join(d if a is None else f"{d}_{a}" for d, a in zip(names, dims))


def traffic(comm) -> dict:
    """This rank's tracer: bytes sent per label."""
    return {label: o["bytes_sent"] for label, o in comm.tracer.summary()["operations"].items()}


mpi.print0(f"Lesson 14: SPMD, tensor layouts on a device mesh, on {p} ranks")

# ------------------------------------------------------------------------------ 1. the notation, and local shapes
# A[I_x, J_y]: the rows of A split over mesh axis x, its columns over y. A rank holds one block: its x coordinate
# picks the rows, its y coordinate the columns. An axis a layout does not name leaves that dimension whole on every
# rank of it: the ranks that differ only on that axis hold the same block (replicas).
heading("1. The notation: A[I_x, J_y] on a 2 x 2 mesh, and the block each rank holds")
comm = prepare(world, timeout=0)  # traced: every byte counted, by label
mesh = Mesh(comm, GRID)  # one communicator per axis (a collective)
for line in GRID.describe().splitlines():
    mpi.print0(terminal.paragraph(line.strip(), "   " + " " * (len(line) - len(line.lstrip())), "     "))
members = {axis: mesh.comm(axis).allgather(rank) for axis in GRID.names}
by_hand = {"x": [[0, 2], [1, 3]], "y": [[0, 1], [2, 3]]}  # ranks with the same y, and with the same x
checks.ok("each axis's communicator holds the ranks its mesh groups name", all(
    members[a] in by_hand[a] and members[a] in GRID.groups(a) and mesh.comm(a).Get_rank() == hand_coordinates(rank)[a]
    for a in GRID.names))  # fmt: skip

A = np.arange(8 * 12, dtype=np.float64).reshape(8, 12)  # A[i, j] = 12 i + j: every block tells where it came from
LAYOUTS = [(None, None), ("x", None), (None, "y"), ("x", "y"), ("y", "x")]
program = Program(SIZES, mesh.coordinates, mesh.comms)
cells, blocks_ok, shapes_ok, whole_ok = [], True, True, True
for dims in LAYOUTS:
    layout = Layout(dims)
    whole = Sharded(Tensor(A.copy()), layouts.replicated(2), A.shape, "A")
    mine = program.redistribute(whole, layout, "section 1").tensor.data  # dtrain's cut: slices, nothing sent
    oracle = block_of(A, dims, hand_coordinates(rank))
    blocks_ok = blocks_ok and np.array_equal(mine, oracle)
    shapes_ok = shapes_ok and mine.shape == layout.local_shape(A.shape, SIZES)
    gathered = world.allgather(mine)  # every rank's block: placed back where the coordinates say
    again = np.full_like(A, np.nan)
    for r, theirs in enumerate(gathered):
        rows, cols = (slice(*span(n, a, hand_coordinates(r))) for n, a in zip(A.shape, dims))
        again[rows, cols] = theirs
    whole_ok = whole_ok and np.array_equal(again, A)
    spans = [",".join("{}:{}".format(*span(n, a, hand_coordinates(r))) for n, a in zip(A.shape, dims))
             for r in range(4)]  # fmt: skip
    shape = "x".join(map(str, layout.local_shape(A.shape, SIZES)))
    cells.append([f"A[{written(dims)}]", f"[{layouts.spec(dims)}]", shape, *spans])
table(["notation", "--shard", "block", *(f"rank {r}" for r in range(4))], cells, left=(0, 1))
say(
    "A is 8 x 12. A[I_x, J] splits its rows over x (ranks 0 and 1, with x = 0, hold rows 0:4; ranks 2 and 3 rows "
    "4:8) and keeps the columns whole: ranks that differ only in y hold the same block. A[I_x, J_y] splits both: "
    "four different blocks of 4 x 6. A[I_y, J_x] is the same split with the axes exchanged. The command line writes "
    "a layout as one entry per dimension, an axis or _ (whole): --shard w1=x,y."
)
checks.ok("every rank's block is the slice its coordinates name, of Layout.local_shape's shape",
          blocks_ok and shapes_ok)  # fmt: skip
checks.ok("the blocks of every rank put A back together exactly", whole_ok)
checks.ok("cutting a block out of a whole tensor sends nothing", not any(traffic(comm).values()))
results["notation"] = cells

# ------------------------------------------------------------------------------ 2. the matmul rule's four cases
# C[I, K] = A[I, J] @ B[J, K]: J is contracted. Whether communication is needed depends only on J's layout in the
# two operands, and on whether one axis would have to split both of C's dimensions.
I, J, K = 8, 12, 6
heading(f"2. The matmul rule: C[I, K] = A[I, J] @ B[J, K] ({I} x {J} @ {J} x {K}) in its four cases")
rng = np.random.default_rng(14)
A, Bm = rng.standard_normal((I, J)), rng.standard_normal((J, K))
CASES = {  # operands' dims, and what the rule must give: C's layout, and the collectives (kind, axis, elements)
    1: ((("x", None), (None, "y")), "[x,y]", []),
    2: (((None, "x"), (None, None)), "[_,_]", [("all-gather", "x", I * J)]),  # A gathered whole over x
    3: (((None, "x"), ("x", None)), "[_,_] partial sum(x)", []),  # each rank's product: a part of the sum
    4: ((("x", None), (None, "x")), "[x,_]", [("all-gather", "x", J * K)]),  # B's columns gathered
}
cells, rules, rule_ok, values_ok, bytes_ok, dry_ok, sent_by_case = [], {}, True, True, True, True, {}
for case, ((da, db), expected, collectives) in CASES.items():
    program = Program(SIZES, mesh.coordinates, mesh.comms, "ring")
    a = Sharded(Tensor(block_of(A, da, mesh.coordinates).copy()), Layout(da), A.shape, "A")
    b = Sharded(Tensor(block_of(Bm, db, mesh.coordinates).copy()), Layout(db), Bm.shape, "B")
    comm.tracer.reset()
    c = program.matmul(a, b, f"case {case}", "C")
    sent = sum(traffic(comm).values())
    made = [(e["kind"], e["axis"], e["elements"]) for e in program.record]
    moved = [(e["kind"], e["axis"], e["where"].rsplit("(", 1)[1].rstrip(")")) for e in program.record]  # (its tensor)
    inside = ", ".join(f"{kind}({axis}) of {tensor}" for kind, axis, tensor in moved) or "nothing"
    rule_ok = rule_ok and str(c.layout) == expected and made == collectives
    p_axis = 2  # every axis of this mesh has 2 ranks: an all-gather of n elements sends (p-1)/p n b from each
    formula = sum((p_axis - 1) / p_axis * n * B for _, _, n in collectives)
    bytes_ok = bytes_ok and sent == formula
    # the dry run: the same program with no communicators (one process), what --explain and costs() read
    dry = Program(SIZES, GRID.coordinates(0))
    dry.matmul(*(Sharded(Tensor(np.zeros(Layout(d).local_shape(m.shape, SIZES))), Layout(d), m.shape, n)
                 for d, m, n in ((da, A, "A"), (db, Bm, "B"))), f"case {case}", "C")  # fmt: skip
    dry_ok = dry_ok and dry.record == program.record
    comm.tracer.reset()
    whole = program.redistribute(c, layouts.replicated(2), f"case {case}: made whole")  # to compare with A @ B
    after = sum(traffic(comm).values())
    values_ok = values_ok and np.abs(whole.tensor.data - A @ Bm).max() < 1e-12
    rules[case] = program.plan[0]["case"].split(": ", 1)[1]
    cells.append([f"{case}", f"A[{written(da)}]", f"B[{written(db, 'JK')}]", f"C{c.layout}", inside,
                  f"{sent:,.0f}", f"{after:,.0f}"])  # fmt: skip
    sent_by_case[case] = {"matmul": sent, "made_whole": after, "formula": formula}
table(["case", "A", "B", "C", "sent", "bytes", "to whole"], cells, left=(1, 2, 3, 4))
for case, rule in rules.items():
    say(f"case {case}, in layouts.matmul's words: {rule}", hanging="     ")
say(
    "1: J is whole in both operands: every rank multiplies its blocks, nothing is sent, and C inherits A's rows and "
    "B's columns. 2: J is split in one operand only: it is all-gathered (each of the 2 ranks of x sends its half, "
    f"(p-1)/p n b = {sent_by_case[2]['matmul']:,.0f} bytes for A's {I * J} elements), then as case 1. 3: J split over "
    "the same axis in both: each rank multiplies its blocks of J, and C is a partial sum, made only when something "
    f"needs it whole (an all-reduce: 2 (p-1)/p n b = {sent_by_case[3]['made_whole']:,.0f} bytes for C's {I * K} "
    "elements; a reduce-scatter if it is wanted split). 4: x would split both of C's dimensions, which no block can "
    "be: B's columns are gathered first. 'bytes' is the tracer's count on each rank inside the matmul; 'to whole' "
    "what gathering C on every rank cost afterwards, to compare it with A @ B."
)
checks.ok("each case's C and collectives are the rule's, as written out here", rule_ok)
checks.ok("every case computes A @ B (gathered whole, to 1e-12)", values_ok)
made_whole = sent_by_case[3]["made_whole"] == 2 * (p_axis - 1) / p_axis * I * K * B  # case 3's partial sum, made
checks.ok("the tracer's bytes: (p-1)/p n b per all-gather, 2 (p-1)/p n b for a partial sum of n",
          bytes_ok and made_whole)  # fmt: skip
checks.ok("the dry run (no communicator) lists the same collectives", dry_ok)
results["matmul"] = sent_by_case

# ------------------------------------------------------------------------------------ 3.-6. training on real ranks
# The driver's train() on digits in float64: single on rank 0 alone, then each paradigm and each layout on all 4
# ranks. Same seed, same global batches: every curve must be single's.
sizes = [64, *HIDDEN, 10]  # digits: 8 x 8 pixels, 10 classes
name = "-".join(map(str, sizes))
common = dict(epochs=args.epochs, hidden=HIDDEN, batch_size=args.batch_size, dtype="float64", timeout=0,
              progress=False, quiet=True)  # fmt: skip
PREFIXES = ("allreduce/", "tp/", "dp/", "zero/", "input", "layer", "loss", "update")  # a step's traffic, by label
forward_calls = []  # every call of the one model code, by every spmd run (section 8 reads it)
model_code = shardings.forward


def counted(program, *forward_args, **kwargs):
    forward_calls.append((running, program.comms is None))  # (which run; a dry run's, with no communicators?)
    return model_code(program, *forward_args, **kwargs)


shardings.forward = counted  # (spmd.py calls shardings.forward: counting its calls changes nothing else)
running, runs, flags_of = None, {}, {}


def run(label: str, **flags) -> dict:
    """``train`` on every rank; rank 0's metrics (every rank's figures) under ``label``."""
    global running
    running, flags_of[label] = label, flags
    runs[label] = train(TrainConfig(**common, allreduce="ring", **flags), world)  # (ring: every run's all-reduce)
    return runs[label]


def collectives_of(metrics) -> list[dict]:
    return metrics["communication"]["per_rank"][0]["paradigm"]["collectives_per_step"]


def listed(metrics) -> None:
    """A run's collectives of one step, as metrics.json records them."""
    say("The collectives spmd derived for one step (metrics.json's collectives_per_step):")
    rows = [[c["phase"], c["kind"], c["axis"], f"{c['elements']:,}", c["where"]] for c in collectives_of(metrics)]
    table(["phase", "kind", "axis", "elements", "where"], rows or [["-", "none", "-", "0", "-"]], left=(0, 1, 2, 4))


def digest(label: str) -> str:
    return runs[label]["weights_sha256"] if rank == 0 else ""


def steps_of(metrics) -> int:
    return args.epochs * steps_per_epoch(metrics["dataset"]["train_samples"], args.batch_size)


def sent_per_rank(label: str) -> list[float]:
    metrics = runs[label]
    return [sum(o["bytes_sent"] for lab, o in mine["operations"].items() if lab.startswith(PREFIXES))
            / steps_of(metrics) for mine in metrics["communication"]["per_rank"]]  # fmt: skip


heading(f"3. Data parallelism is batch sharding: {name} on digits, float64, global batch {args.batch_size}, "
        f"{args.epochs} epochs")  # fmt: skip
say("single runs on rank 0 alone (the reference); ddp (one ring all-reduce of the whole gradient) and --paradigm "
    "spmd --sharding dp (--mesh x=4, the default: one axis of every rank) on all 4:")  # fmt: skip
single, _ = single_reference(TrainConfig(paradigm="single", **common), world)
run("ddp", paradigm="ddp", bucket_mb=0)
run("spmd dp", paradigm="spmd", sharding="dp")
curves = against_single(checks, single, {k: runs[k] for k in ("ddp", "spmd dp")}, PREFIXES, "data-parallel run",
                        "their own costs()", "Only the input's rows are split: input[B_x, F].")  # fmt: skip
if rank == 0:
    listed(runs["spmd dp"])
    say(
        "Every weight is replicated and multiplies a block of rows, so its gradient is a sum over the blocks: partial "
        "over x. The update makes it whole, all the parameters in one flat buffer, with a mean (each rank's loss is "
        "its own rows' mean): ddp's one all-reduce, derived from one layout."
    )
same = rank != 0 or (digest("spmd dp") == digest("ddp") and sent_per_rank("spmd dp") == sent_per_rank("ddp"))
checks.ok("spmd --sharding dp ends with ddp's weights bit for bit, sending its bytes", same)
results["dp"] = {"sent": sent_per_rank("spmd dp") if rank == 0 else None, "digests_equal": same}

heading("4. Megatron is column-then-row sharding: --sharding megatron against --paradigm tp --tp 4")
run("tp 4", paradigm="tp", tp=4)
run("spmd megatron", paradigm="spmd", sharding="megatron")
against_single(checks, single, {k: runs[k] for k in ("tp 4", "spmd megatron")}, PREFIXES, "Megatron run",
               "TensorParallel.costs() and SPMD.costs()",
               "w1[F, H_x] b1[H_x] w2[H_x, H]: w1 split by columns, its bias with them, w2 by rows; w3 (a layer left "
               "without a pair) and b2 replicated.")  # fmt: skip
if rank == 0:
    listed(runs["spmd megatron"])
    say(
        "Layer 1 is case 1 (J whole: nothing sent) and leaves z1[B, H_x]; layer 2 is case 3 (H split in both) and "
        "leaves a partial sum, made whole before + b2 needs it: Megatron's g, derived. Megatron's f, the all-reduce "
        "of the input's gradient, is absent: the input is data, and no rule asks for a gradient nobody needs. Every "
        "rank sees the whole batch, so no gradient is partial at the update: nothing else is sent."
    )
same = rank != 0 or (digest("spmd megatron") == digest("tp 4")
                     and sent_per_rank("spmd megatron") == sent_per_rank("tp 4"))  # fmt: skip
checks.ok("--sharding megatron sends tp's bytes on every rank and ends with its weights", same)
results["megatron"] = {"sent": sent_per_rank("spmd megatron") if rank == 0 else None}

heading("5. FSDP is weight sharding: --sharding fsdp against --paradigm zero --zero-stage 3")
run("zero 3", paradigm="zero", zero_stage=3)
run("spmd fsdp", paradigm="spmd", sharding="fsdp")
against_single(
    checks,
    single,
    {k: runs[k] for k in ("zero 3", "spmd fsdp")},
    PREFIXES,
    "FSDP run",
    "Zero.costs() and SPMD.costs()",
    "input[B_x, F] and every weight's rows over x: w1[F_x, H] w2[H_x, H] w3[H_x, C]; the biases whole.",
)
weights = {f"w{j}": sizes[j - 1] * sizes[j] for j in range(1, 4)}
biases = sum(sizes[1:])
fsdp_ok = held_ok = against_zero = True
if rank == 0:
    listed(runs["spmd fsdp"])
    record = [(c["phase"], c["kind"], c["elements"], c["where"].split(":")[0])
              for c in collectives_of(runs["spmd fsdp"])]  # fmt: skip
    # written out: forward gathers every weight whole (case 2: its rows are J); backward, layer by layer from the
    # last, gathers w3 and w2 again (dA = dC w^T needs it; w1's input is data: no gradient, no gather) and
    # reduce-scatters each weight's gradient, partial over x, onto its rows; the biases, whole and partial over x,
    # are all-reduced at the update.
    expected = [("forward", "all-gather", weights[f"w{j}"], f"layer {j}") for j in (1, 2, 3)]
    for j in (3, 2, 1):
        expected += [("backward", "all-gather", weights[f"w{j}"], f"layer {j}")] if j > 1 else []
        expected += [("backward", "reduce-scatter", weights[f"w{j}"] // 4, f"layer {j}")]
    expected += [("update", "all-reduce", biases, "update")]
    fsdp_ok = record == expected
    held = runs["spmd fsdp"]["communication"]["per_rank"][0]["paradigm"]["held_bytes"]
    mine = (sum(weights.values()) // 4 + biases) * B  # a quarter of every weight, every bias
    held_ok = all(h == {"parameters": mine, "gradients": mine, "optimizer": mine} for h in held)
    fsdp, zero = sum(sent_per_rank("spmd fsdp")), sum(sent_per_rank("zero 3"))
    # every rank together: an all-gather or reduce-scatter of n elements sends (p-1) n b, an all-reduce 2 (p-1) n b
    formula = 3 * B * (3 * sum(weights.values()) - weights["w1"]) + 2 * 3 * B * biases
    zero_formula = 3 * 3 * B * (sum(weights.values()) + biases)  # ZeRO-3: every layer gathered twice, reduce-scattered
    against_zero = fsdp == formula and zero == zero_formula and zero - fsdp == 3 * B * (weights["w1"] + biases)
    say(
        f"A rank holds a quarter of every weight and every bias whole: {mine:,} bytes of parameters (ZeRO-3 also "
        f"splits the biases, in chunks of the flat buffer that need not be whole rows). Every rank together sends "
        f"{fsdp:,.0f} bytes a step: (p-1) b (3 x the weights - w1) + 2 (p-1) b x the biases. ZeRO-3 sends "
        f"{zero:,.0f}, 3 (p-1) b for every parameter: it gathers w1 again in backward, which FSDP here need not (its "
        "input is data), and treats the biases like the weights. Backward goes layer by layer: gather a weight "
        "again, use it, reduce-scatter its gradient, so no layer's whole gradient outlives its layer."
    )
checks.ok("every weight is gathered before use (again in backward where needed), its gradient reduce-scattered",
          fsdp_ok)  # fmt: skip
checks.ok("a rank holds 1/4 of every weight and every bias whole (the formula, = costs())", held_ok)
checks.ok("FSDP's bytes: the formula; ZeRO-3's less one gather of w1 and a third of the biases'", against_zero)

heading("6. A 2 x 2 mesh that mixes them: --mesh x=2,y=2 --sharding dp-megatron")
WORDS = ("input=x,_", "w1=_,y", "b1=y", "w2=y,_")  # the preset, written out as --shard words
run("tp 2 x dp 2", paradigm="tp", tp=2, dp=2)
run("dp-megatron", paradigm="spmd", sharding="dp-megatron", mesh="x=2,y=2")
run("--shard words", paradigm="spmd", sharding="none", shard=WORDS, mesh="x=2,y=2")
against_single(checks, single, {k: runs[k] for k in ("tp 2 x dp 2", "dp-megatron", "--shard words")}, PREFIXES,
               "2 x 2 run", "costs() on the 2 x 2 grid",
               "Data over x, the model over y: input[B_x, F] w1[F, H_y] b1[H_y] w2[H_y, H]; '--shard words' gives "
               f"these four layouts one by one (--sharding none --shard {' --shard '.join(WORDS)}).")  # fmt: skip
plan = SPMD.plan_of(sizes, 4, TrainConfig(paradigm="spmd", sharding="dp-megatron", mesh="x=2,y=2", **common)).plan
if rank == 0:
    say("The program, op by op (the dry run's plan: what --explain prints):")
    table(["where", "operands -> result", "case"],
          [[e["where"], f"{' @ '.join(e['inputs']) if e['op'] == 'matmul' else ', '.join(e['inputs'])} -> "
            f"{e['output']}", e["case"].split(":")[0] or "-"] for e in plan], left=(0, 1))  # fmt: skip
    listed(runs["dp-megatron"])
    say(
        "Megatron's g over y inside each data group, and ddp's all-reduce over x of every gradient, each rank's "
        "blocks only (a quarter of w1 and w2, half of b1): the two groups of tp's grid, derived from four layouts."
    )
same = rank != 0 or (digest("dp-megatron") == digest("tp 2 x dp 2") == digest("--shard words")
                     and sent_per_rank("dp-megatron") == sent_per_rank("tp 2 x dp 2"))  # fmt: skip
checks.ok("dp-megatron sends tp 2 x dp 2's bytes and ends with its weights, as do the --shard words", same)

# --------------------------------------------------------------------------------- 7. invalid layouts, refused
heading("7. Invalid layouts, refused before any message")
say("Each of these is refused by SPMD.check, which dtrain train calls before any rank talks to another (it exits "
    "with status 2 and this line):")  # fmt: skip
BAD = [  # (flags, a word the message must name)
    (dict(mesh="x=2,y=2", shard=("w1=x,x",)), "two dimensions"),
    (dict(mesh="x=2,y=2", shard=("w1=_,z",)), "'z'"),
    (dict(mesh="x=2,y=2", shard=("w1=_",)), "2 entries"),
    (dict(mesh="x=2,y=2", shard=("w9=_,_",)), "'w9'"),
    (dict(mesh="x=4", shard=("w3=_,x",)), "does not divide"),
    (dict(mesh="x=3,y=2"), "cover the world"),
    (dict(mesh="x=4", sharding="dp-megatron"), "but the mesh has 1 (x)"),
]
refused = []
for flags, word in BAD:
    words = " ".join(f"--{k} {v}" if k != "shard" else " ".join(f"--shard {s}" for s in v) for k, v in flags.items())
    say(f"$ dtrain train --paradigm spmd {words}", hanging="     ")
    try:
        SPMD.check(TrainConfig(paradigm="spmd", **common, **flags), p)
        refused.append(False)
        say("accepted", indent="     ")
    except ConfigError as error:
        refused.append(word in str(error))
        say(str(error), indent="     ", hanging="       ")
checks.ok("each invalid layout is refused, its error naming what is wrong", all(refused))

# ------------------------------------------------------------------------------ 8. one model code, every layout
heading("8. The seed's point: the model's code is the same in every run")
source, first = inspect.getsourcelines(model_code)
say(
    f"dtrain/parallel/shardings.py, lines {first}-{first + len(source) - 1}: forward(program, params, x, ...) is the "
    "MLP: for each layer, h = program.matmul(h, w), h = program.bias_add(h, b), h = program.relu(h), and "
    "at the end program.cross_entropy(h, labels). It names no collective and no paradigm: each op asks its rule "
    "(layouts.py) what its operands' layouts need, and sharded.py makes the moves."
)
SPMD_RUNS = ("spmd dp", "spmd megatron", "spmd fsdp", "dp-megatron", "--shard words")
same_config = same_plans = one_code = True
if rank == 0:
    layout_flags = {"mesh", "sharding", "shard"}
    config_of = {label: {k: v for k, v in runs[label]["config"].items() if k not in layout_flags}
                 for label in SPMD_RUNS}  # fmt: skip
    same_config = all(config == config_of["spmd dp"] for config in config_of.values())
    cells = []
    for label in SPMD_RUNS:
        given = flags_of[label]
        flags = [f"--mesh {given.get('mesh', 'x=4')}"] + [f"--sharding {given['sharding']}"] + [
            f"--shard {w}" for w in given.get("shard", ())]  # fmt: skip
        dry = SPMD.plan_of(sizes, 4, TrainConfig(**common, allreduce="ring", **given)).record
        same_plans = same_plans and dry == collectives_of(runs[label])
        kinds = [f"{c['kind']}({c['axis']})" for c in collectives_of(runs[label])]
        summary = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "none"
        calls, dry_calls = forward_calls.count((label, False)), forward_calls.count((label, True))
        one_code = one_code and calls == steps_of(runs[label]) and dry_calls >= 1
        cells.append([label, " ".join(flags), summary, f"{calls:,} + {dry_calls}"])
    table(["run", "the only flags that differ", "collectives a step", "forward calls"], cells, left=(0, 1, 2))
    say(
        f"Every spmd run above called the same forward once per step ({steps_of(runs['spmd dp'])} steps), and once "
        "more in its dry run (no communicators: the decisions alone, which costs() priced); the flags were the same "
        "but for the layouts. The collectives of each came from its layouts alone, and metrics.json's list of them is "
        "the dry run's, the one --explain prints without training."
    )
checks.ok("every spmd run called the one forward once per step, and once in its dry run", one_code)
checks.ok("the spmd runs' configs differ in --mesh, --sharding and --shard only", same_config)
checks.ok("each run's collectives per step are its dry run's (what --explain prints)", same_plans)
shardings.forward = model_code

# ------------------------------------------------------------------------------ 9. --sharding auto in miniature
heading("9. --sharding auto: try every layout, price each, keep the cheapest")
say(
    "Alpa and XLA choose layouts by solving an integer program over the graph's costs; a 3-layer MLP is small enough "
    "to try them all (dtrain/parallel/auto_sharding.py): the batch's rows split over an axis or whole, each weight "
    "whole, by rows, by columns or both, its bias with its columns. Each candidate is run dry (its collectives, its "
    "blocks) and priced with the planner's model of this machine. On the 784-512-512-10 MLP of docs/benchmarks.md "
    "(batch 64; dry runs only, nothing trained):"
)
auto_ok = True
if rank == 0:
    big, cells = (784, 512, 512, 10), []
    for mesh_text in ("x=4", "x=2,y=2"):
        ranked = auto_sharding.ranking(big, 4, mesh_text, 64, 1)
        best, words, _ = ranked[0]
        config = TrainConfig(dataset="synthetic", features=784, classes=10, hidden=(512, 512), batch_size=64,
                             paradigm="spmd", mesh=mesh_text)  # fmt: skip
        hardware = Hardware.this()
        presets = {name: SPMD.step_time(big, 4, replace(config, sharding=name), hardware)
                   for name in ("dp", "megatron", "fsdp", "dp-megatron") if name != "dp-megatron" or "," in mesh_text
                   }  # fmt: skip
        priced = {name: parts["compute"] + parts["communication"] for name, parts in presets.items()}
        # the oracle: the exhaustive search's winner is no dearer than any preset, and it is one of them here
        auto_ok = auto_ok and all(best <= t + 1e-12 for t in priced.values()) and len(ranked) > len(priced)
        axes, shapes = tuple(a.partition("=")[0] for a in mesh_text.split(",")), shardings.tensors(big, 64)
        every = {name: {t: shardings.preset(name, axes, 3).get(t, (None,) * len(shape)) for t, shape in shapes.items()}
                 for name in priced}  # (each preset, every tensor named)  # fmt: skip
        same = [name for name, dims in every.items() if dims == shardings.from_words(words)]
        auto_ok = auto_ok and bool(same)
        cells.append([mesh_text, f"{len(ranked):,}", f"{best * 1e3:.2f}", same[0] if same else "none",
                      ", ".join(f"{n} {t * 1e3:.2f}" for n, t in priced.items())])  # fmt: skip
    table(["mesh", "layouts", "auto ms", "= preset", "the presets, ms"], cells, left=(0, 3, 4))
    say(
        "On one axis of 4 ranks the cheapest is Megatron's layout: the batch whole, w1 by columns, w2 by rows, w3 "
        "whole: one all-reduce of 64 x 512 a step, the fewest bytes of any layout. On 2 x 2 it is dp-megatron's. "
        "docs/benchmarks.md section 16 measured the choices: on x=4 within 15% of the fastest preset, on 2 x 2 as "
        "fast as dp-megatron (the best that mesh allows). "
        "The price is the planner's, so the choice is as good as its model: an early model that left out the copies "
        "sharded.py makes chose a layout that measured 1.16x slower; dtrain train --paradigm spmd --sharding auto "
        "--explain says what won and what it beat."
    )
checks.ok("auto's layout is no dearer than any preset on the planner's model, and here it is one of them", auto_ok)
mesh.free()
if rank == 0:
    results["training"] = curves
    results["runs"] = {label: {"sent": sent_per_rank(label), "digest": digest(label),
                               "costs": runs[label]["costs"]["sent_per_step"],
                               "collectives": collectives_of(runs[label]) if label.startswith(("spmd", "dp-", "--"))
                               else None} for label in runs}  # fmt: skip
# the docstring's Exercises section, as it is (it keeps to 80 columns: it is printed)
mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
conclude(args.json, results, checks, started=started)

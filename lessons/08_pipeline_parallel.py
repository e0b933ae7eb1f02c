"""Lesson 8: pipeline parallelism on real MPI ranks. Consecutive layers on consecutive ranks, micro-batches flowing.

Cut the model's layers into P stages, one per rank; a micro-batch's activations go forward from stage to stage as
messages, their gradients come back. With one batch, all but one stage would wait; with M micro-batches the stages
work on different ones at once, and the *schedule* says which. dtrain/parallel/pipeline.py (the interpreter) and
schedules.py (the schedules, as data); ``dtrain train --paradigm pp --pp P --microbatches M --schedule S``:

    dtrain launch -n 4 lessons/08_pipeline_parallel.py
    dtrain launch -n 2 lessons/08_pipeline_parallel.py --json pp.json

What you will see:
  1. GPipe, 1F1B and interleaved 1F1B drawn from their instruction lists before anything runs, and the bubble each
     leaves: (P-1)/(M+P-1), and (P-1)/(VM+P-1) interleaved;
  2. one 1F1B step on these ranks, instruction by instruction: each stage's list (warm-up, steady state, cool-down),
     then the order in which the ranks really ran it;
  3. the bubble measured on these ranks with a sleep-calibrated pipeline (each layer's forward sleeps 5 ms, its
     backward 10 ms: the schedule, not Python's overhead or a shared core, sets the time), against the formula, as M
     grows;
  4. activation memory per stage, counted by the interpreter: GPipe keeps all M micro-batches, 1F1B at most P - s;
     both held against Pipeline.costs();
  5. training on real ranks: every schedule and grid follows single's loss curve (float64, to ~1e-12), and every
     rank's bytes per step are the cost function's.

Every check compares with an independent oracle and prints an OK line (FAIL if it does not hold); the last line says
whether all passed (the exit status is non-zero if not).

`--device gpu` runs the same on GPUs (one per rank, rank % GPUs): sections 2 to 5, their models, batches and
messages (through StagedComm when MPI is not CUDA-aware); section 1 simulates the schedules in plain Python.

Things to try:
  * --sleep-ms 0: the real compute of a small model is tens of microseconds, and the bubble drowns in overhead;
  * dtrain launch -n 4 -m dtrain train --paradigm pp --pp 4 --hidden 64,64,64 --trace pp.json, then
    https://ui.perfetto.dev: each rank's forwards and backwards on its row, the bubble between them.

Exercises (`dtrain exercises init ex` once; one process, no ranks):
  8.1  ex/schedules.py: one_f_one_b(stages, microbatches), each stage's order
       of Forward/Backward records in 1F1B (dtrain/parallel/schedules.py adds
       the messages); checked against a schedule's rules, a deadlock-free
       simulation, the bubble (P - 1) / (M + P - 1), and at most P - s
       micro-batches in flight on stage s:
         dtrain exercises check 8.1 --path ex
  8.2  ex/schedules.py: gpipe(stages, microbatches), the same for GPipe (all
       forwards, then all backwards):
         dtrain exercises check 8.2 --path ex
"""

import argparse

import numpy as np
from lesson_util import (
    Checks,
    add_device_flag,
    against_single,
    conclude,
    heading,
    lesson_xp,
    parse_and_start,
    refuse_bad_arguments,
    say,
    single_reference,
    table,
)

from dtrain import terminal
from dtrain.comm import mpi
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import load_dataset
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import schedules
from dtrain.parallel.pipeline import Pipeline
from dtrain.train import train


def draw(lines: list[str], unit: float = 1.0) -> None:
    """A schedule drawn (schedules.text: a line per stage, two characters per ``unit`` of time), on rank 0, in
    pieces as wide as the terminal lets them be (100 columns into a file), each after the first saying when it
    starts."""
    label = len(f"   stage {len(lines) - 1}  ")
    room = max(2, ((terminal.columns() or 100) - label) // 2 * 2)  # (a whole cell: two characters)
    for start in range(0, len(lines[0]), room):
        if start:
            mpi.print0(f"   ... continued, from time {start // 2 * unit:g}:")
        for s, line in enumerate(lines):
            mpi.print0(f"   stage {s:<{label - 11}d}  {line[start : start + room]}")


parser = argparse.ArgumentParser(description="Lesson 8: pipeline parallelism on MPI ranks")
parser.add_argument("--epochs", type=int, default=3, help="epochs of section 5's training runs (default %(default)s)")
parser.add_argument("--batch-size", type=int, default=48, help="global batch on digits (default %(default)s)")
parser.add_argument("--sleep-ms", type=float, default=5.0, help="section 3: a layer's forward sleeps this long, its "
                    "backward twice as long (default %(default)s)")  # fmt: skip
parser.add_argument("--max-microbatches", type=int, default=8, help="section 3's largest M (default %(default)s)")
parser.add_argument("--json", metavar="PATH", help="write every measurement to this file")
add_device_flag(parser)

args, world, P, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
xp = lesson_xp(args, world)  # numpy, or cupy on this rank's GPU (--device gpu)
refuse_bad_arguments([(
    args.batch_size % (4 * P) or args.epochs < 1 or args.sleep_ms < 0 or args.max_microbatches < 1,
    f"--batch-size {args.batch_size} must be divisible by 4 x the {P} ranks (4 micro-batches per stage), --epochs "
    ">= 1, --sleep-ms >= 0, --max-microbatches >= 1",
)])  # fmt: skip

checks = Checks(world)
digits = load_dataset("digits")
DEEP = [digits.n_features, *[32] * (2 * P - 1), digits.n_classes]  # 2P Linear layers: 2 per stage, or 1 per chunk
results = {"world": P}
mpi.print0(f"Lesson 8: pipeline parallelism on {P} rank(s)")

# ----------------------------------------------------------------------- 1. the schedules, before anything runs
M = 2 * P
heading(f"1. Three schedules for P = {P} stages and M = {M} micro-batches, simulated from their instruction lists")
say("(forward 1 unit of time, backward 2, per whole stage; F3/B3: micro-batch 3; lower case: a rank's second chunk; "
    ".. idle)")  # fmt: skip
drawn_ok = True
for name, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
    if name == "interleaved" and P == 1:
        continue
    schedule = schedules.build(name, P, M, V)
    schedules.check(schedule, M, V)  # every forward before its backward, sends and receives matched
    timeline = schedules.simulate(schedule, 1.0, 2.0, V)  # raises if the message order deadlocks
    simulated, formula = schedules.bubble(timeline), schedules.bubble_formula(P, M, V)
    drawn_ok = drawn_ok and abs(simulated - formula) < 1e-12
    peaks = [schedules.in_flight(program) for program in schedule]
    mpi.print0()
    say(f"{name}{f' (V = {V})' if V > 1 else ''}: bubble {simulated:.3f} = (P-1)/(VM+P-1) = {formula:.3f}; "
        f"activations in flight per stage: {peaks}")  # fmt: skip
    draw(schedules.text(timeline, P, unit=1 / V), 1 / V)
checks.ok("every simulated bubble is the formula's", drawn_ok)
say(
    "GPipe and 1F1B leave the same bubble: each stage idles while the first micro-batch reaches it and while the last "
    "one's gradient comes back. 1F1B starts each backward as early as it can, so a stage never holds more than P - s "
    "micro-batches' activations; GPipe holds all M. Interleaving gives every rank two smaller chunks: the pipeline "
    "fills and drains in half-sized steps, at the price of twice as many messages."
)

# ------------------------------------------------------------------ 2. one 1F1B step, instruction by instruction
heading(f"2. One 1F1B step of {'-'.join(map(str, DEEP))} on these {P} rank(s), M = {P + 1}, instruction by "
        f"instruction")  # fmt: skip
rows = 8 * max(P + 1, args.max_microbatches)  # 8 samples per micro-batch, for every M below
rng = np.random.default_rng(0)
x_batch, y_batch = xp.asarray(rng.standard_normal((rows, DEEP[0]))), xp.asarray(rng.integers(0, 10, rows))


def built(schedule: str, microbatches: int, sizes=DEEP) -> Pipeline:
    """A pipeline of ``sizes`` over this world's P ranks, built as the driver builds it, for batches of 8 M."""
    config = TrainConfig(paradigm="pp", pp=P, microbatches=microbatches, schedule=schedule, dtype="float64",
                         hidden=tuple(sizes[1:-1]), batch_size=8 * microbatches, timeout=0, quiet=True,
                         device=args.device)  # fmt: skip
    pipeline = Pipeline(prepare(world, device=args.device, timeout=0), config)
    pipeline.build(
        lambda: MLP(sizes, seed=0, dtype=np.float64, xp=xp), lambda model: make_optimizer("sgd", model, 0.01)
    )
    return pipeline


pipe = built("1f1b", P + 1)
programs = world.gather([str(ins) + ("" if not ins.phase else f" ({ins.phase})") for ins in pipe.program], root=0)
world.Barrier()
pipe.step(x_batch[: 8 * (P + 1)], y_batch[: 8 * (P + 1)])
measured = world.gather(pipe.timeline, root=0)
order_ok = True
if rank == 0:
    for s, program in enumerate(programs):
        print(terminal.paragraph(f"stage {s}: " + ", ".join(program), "   ", "     "))
    events = sorted((start, s, op, micro) for s, line in enumerate(measured) for op, _, micro, start, _ in line)
    print(terminal.paragraph("as they ran (every rank's clock is this machine's): " + " ".join(
        f"{op[0].upper()}{micro}@{s}" for _, s, op, micro in events), "   ", "     "))  # fmt: skip
    # the data dependencies held: micro-batch i's forward on stage s after its forward on s - 1, backward the reverse
    when = {(op, s, micro): start for start, s, op, micro in events}
    order_ok = all(when["forward", s - 1, i] < when["forward", s, i] and when["backward", s, i] < when["backward",
                   s - 1, i] for s in range(1, P) for i in range(P + 1))  # fmt: skip
checks.ok("each micro-batch went forward stage by stage and came back in reverse", order_ok)

# ---------------------------------------------------------------------- 3. the bubble, measured on these ranks
# Balanced stages (the formula assumes them): 2P layers of 32 x 32, so every stage holds two equal layers.
EQUAL = [32] * (2 * P + 1)
heading(f"3. The bubble measured: P = {P}, sleep-calibrated ({args.sleep_ms:g} ms per layer forward, "
        f"{2 * args.sleep_ms:g} ms backward), {2 * P} layers of 32 x 32, two per stage")  # fmt: skip


def measured_bubble(pipeline, steps: int = 2) -> float:
    """The idle fraction of the last of ``steps`` steps, from every rank's timestamps: 1 - busy / (P x span)."""
    for _ in range(steps):
        world.Barrier()
        pipeline.step(x_batch[: 8 * pipeline.M, :32], y_batch[: 8 * pipeline.M])
    lines = world.allgather(pipeline.timeline)  # every rank's (op, stage, micro, start, end) of the last step
    return schedules.idle_fraction((r, start, end) for r, line in enumerate(lines) for *_, start, end in line)


bubbles = []
for m in sorted({1, 2, 4, args.max_microbatches}):
    for name in ("gpipe", "1f1b"):
        pipeline = built(name, m, EQUAL)
        pipeline.delay = (args.sleep_ms / 1e3, 2 * args.sleep_ms / 1e3)
        got, formula = measured_bubble(pipeline), schedules.bubble_formula(P, m)
        bubbles.append({"M": m, "schedule": name, "measured": got, "formula": formula})
table(["M", "schedule", "bubble measured", "formula (P-1)/(M+P-1)"],
      [[f"{b['M']}", b["schedule"], f"{b['measured']:.3f}", f"{b['formula']:.3f}"] for b in bubbles],
      left=(1,))  # fmt: skip
if args.sleep_ms >= 5:  # (shorter sleeps measure the interpreter's overhead more than the schedule: no claim then)
    close = all(abs(b["measured"] - b["formula"]) < 0.1 for b in bubbles)
    # (the rows alternate gpipe and 1f1b: each is compared with the same schedule's row at the next M)
    falls = P == 1 or all(a["measured"] > b["measured"] for a, b in zip(bubbles, bubbles[2:]))
    checks.ok("the measured bubble is the formula's, within 0.1, and falls as M grows", close and falls)
else:
    say(f"(not checked: with {args.sleep_ms:g} ms per layer the overhead between computations sets the time)")
say(
    "Each stage waits P - 1 slots for the first micro-batch to reach it and P - 1 more for the last gradient to come "
    "back; the M micro-batches fill the rest. The measured fraction sits a little above the formula: every hop adds "
    "a message's latency, and sleeping is not exact. docs/benchmarks.md (section 9) measures P = 4 up to M = 16."
)
results["bubble"] = bubbles

# ----------------------------------------------------------------------------------- 4. activation memory
m = args.max_microbatches
heading(f"4. Activations kept for backward, per stage (bytes; the interpreter's count; M = {m}, float64; "
        f"P/M = {P / m:.3f})")  # fmt: skip
peaks, costs_ok = {}, True
for name in ("gpipe", "1f1b"):
    pipeline = built(name, m)
    pipeline.step(x_batch[: 8 * m], y_batch[: 8 * m])
    peaks[name] = world.allgather(pipeline.peak)
    costs_ok = costs_ok and pipeline.peak == Pipeline.costs(DEEP, P, pipeline.config)["activations"][rank]
table(["stage", "GPipe", "1F1B", "1F1B / GPipe"],
      [[f"{s}", f"{peaks['gpipe'][s]:,d}", f"{peaks['1f1b'][s]:,d}", f"{peaks['1f1b'][s] / peaks['gpipe'][s]:.3f}"]
       for s in range(P)], left=())  # fmt: skip
checks.ok("the interpreter's peaks equal Pipeline.costs()", costs_ok)
checks.ok("1F1B keeps at most P/M of GPipe's activations on every stage",
          all(peaks["1f1b"][s] <= P / m * peaks["gpipe"][s] for s in range(P)))  # fmt: skip
say(
    "A micro-batch's activations live from its forward to its backward. GPipe runs every forward first, so each stage "
    "holds all M; 1F1B runs a backward as soon as one is due, so stage s holds P - s. The memory no longer grows with "
    "M, which is what lets 1F1B take many micro-batches, and so a small bubble."
)
results["activations"] = peaks

# ------------------------------------------------------------------------------------ 5. training on real ranks
heading(f"5. Training {'-'.join(map(str, DEEP))} on digits, float64, global batch {args.batch_size}, "
        f"{args.epochs} epochs")  # fmt: skip
common = dict(epochs=args.epochs, hidden=tuple(DEEP[1:-1]), batch_size=args.batch_size, dtype="float64", timeout=0,
              progress=False, quiet=True, device=args.device)  # fmt: skip
single, _ = single_reference(TrainConfig(paradigm="single", **common), world)
configs = {f"pp {P} {s}": dict(pp=P, schedule=s) for s in ("gpipe", "1f1b")}
if P > 1 and 4 % P == 0:  # (interleaving: the 4 micro-batches must be a multiple of the stages)
    configs[f"pp {P} interleaved"] = dict(pp=P, schedule="interleaved")
if P % 2 == 0 and P > 2:
    configs[f"dp 2 x pp {P // 2}"] = dict(dp=2, pp=P // 2)
runs = {label: train(TrainConfig(paradigm="pp", **flags, **common), world) for label, flags in configs.items()}
results["training"] = against_single(
    checks, single, runs, ("pp/", "dp/"), "schedule and grid", "Pipeline.costs()",
    "The same steps, however the layers are spread: the pipeline runs each micro-batch through the same layers and "
    "adds the M micro-batches' gradients, as one process accumulating M micro-batches does (to the last bit, "
    "tests/test_pipeline.py checks). Each stage sends one activation per micro-batch forward and one gradient back: "
    "bytes that grow with the batch and the width at the cut, not with the model.",
)  # fmt: skip

# the docstring's Exercises section, as it is (it keeps to 80 columns: it is printed)
mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
conclude(args.json, results, checks)

"""Lesson 11: planning. Whether to distribute at all, which paradigm on which grid, and why, priced before anything
runs and held to runs on this machine.

Lessons 3 to 9 each taught one way of spreading a step over ranks. Which one to use is a question of numbers: the
compute a rank saves against the messages it adds, the memory a rank has against the state it must hold. Each
paradigm states those numbers as code (``costs()``: bytes sent and held, exact; ``activations()``; ``step_time()``:
seconds on some hardware), and ``dtrain plan`` (dtrain/plan/planner.py) asks every registered paradigm for every grid it
could
run on, prices each, rules out what cannot run or does not fit, and marks the fastest that makes single's updates.
It runs nothing. This lesson asks it six questions; the first and the last are answered by measurement too:

    python lessons/11_planning.py                  # a minute or so on 2 cores (part 6, as root: +30 s)
    python lessons/11_planning.py --quick          # fewer measured steps, the cluster on 8 and 64 ranks only
    python lessons/11_planning.py --png plan.png   # part 5's plan for 64 ranks, drawn (time and memory by kind)

It runs with python, not under dtrain launch: the measured runs of parts 1 and 6 are jobs of their own, started by
dtrain.plan.check.measure (dtrain train under mpiexec, as `dtrain plan --check` runs them).

What you will see:
  1. when not to distribute: a digits-sized MLP (64-64-64-64-10), single against the best configuration on 2 and 4
     ranks, predicted and measured here; then the same for a model 16 times as wide. Splitting the batch divides
     only the arithmetic, and a small model's step is mostly per-layer overhead; the ranks share this machine's
     cores; every step adds a collective's latency. Where the planner says distributing starts to pay here;
  2. data against tensor parallelism as the model widens: ddp all-reduces every gradient (bytes ~ width^2), tp
     all-reduces activations (bytes ~ width x batch); the width from which tp's step is the shorter, found by
     bisection, on this machine and on a cluster preset;
  3. how micro-batches pay for a pipeline: the bubble against (P-1)/(M+P-1) as M grows, the fixed cost each
     micro-batch adds, and the M that balances the two;
  4. what ZeRO buys when memory is the limit: a model whose ddp state does not fit a rank, each stage's parameters,
     gradients and optimizer state per rank against the ZeRO paper's formula (plus the layer in flight), which
     stages fit, what they cost, and what the planner picks when every paradigm may compete;
  5. the same questions on a real cluster: DGX H100 nodes (dtrain/plan/hardware.json, every number with its source),
     an MLP of about a billion parameters with Adam on 8, 64 and 512 ranks: what the planner picks and why;
  6. the planner against an emulated cluster: 2 nodes x 2 ranks of this machine (network namespaces, `dtrain
     cluster up`, root only: skipped with the reason elsewhere) joined by a 100 Mbit/s link; ddp ring, hierarchical,
     top-k 1% and local SGD (H = 8) priced from the link's rate and measured across it. Every all-reduce pays for
     the bytes that cross a node's one link, and the ranks of a node that cross at once share it.

Every check compares the planner with an independent oracle (the tracer's bytes, the formulas) and prints an OK line
(FAIL if it does not hold); the last line says whether all passed (the exit status is non-zero if not). Timings are
measurements, printed and never checked: on a busy machine they move, and the sentences that explain them are computed
from them.

Things to try:
  * dtrain plan --machine pcie-ethernet --ranks 64 --layers 24 --width 6144 --features 6144 --classes 6144
    --batch-size 1024 --optimizer adam: part 5's model without NVLink or InfiniBand;
  * --ranks 2 or 8 (parts 2-4), --preset dgx-a100 or pcie-ethernet, --cluster-batch 4096 (part 5's global batch),
    --memory-mib 1200 (part 4: ddp fits; what is left for ZeRO?);
  * dtrain plan --features 64 --hidden 1024,1024,1024 --classes 10 --batch-size 64 --check 3: the planner's three
    best for part 1's wide model, run here;
  * --link 1gbit (part 6), or as root: hostfile=$(dtrain cluster up --nodes 2 --slots 2 --link 100mbit | tail -n 1);
    dtrain plan --hostfile $hostfile --check 3; dtrain cluster down: the planner's three best, run across it;
  * notebooks/11_planning.ipynb walks the same story with cells to change (the width, the ranks, the preset).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
from lesson_util import Checks, conclude, heading, refuse, refuse_bad_arguments, say, table

from dtrain import parallel, terminal
from dtrain.comm import mpi
from dtrain.errors import ConfigError, UserError
from dtrain.launch import cluster as clusters
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import parameter_count
from dtrain.parallel.zero_shards import KINDS, paper_formula
from dtrain.plan import Model, Row, figure, hardware, hostfile, plan, price, why
from dtrain.plan import check as plan_check

MIB, GIB = 1 << 20, 1 << 30
SMALL = Model([64, 64, 64, 64, 10], batch_size=64)  # digits-sized: 64 pixels, three hidden layers of 64, 10 classes
WIDE = Model([64, 1024, 1024, 1024, 10], batch_size=64)  # the same, 16 times as wide (about 200 times the arithmetic)
WIDTHS = [128 * 2**k for k in range(8)]  # part 2's sweep: 128 .. 16384
WIDTH_LAYERS, WIDTH_BATCH, WIDTH_STEP = 4, 256, 64  # part 2: 4 layers of width x width, a global batch of 256
PIPE_WIDTH, PIPE_LAYERS, PIPE_BATCH = 1024, 8, 256  # part 3: 8 layers of 1024 x 1024 on P stages
ZERO_WIDTH, ZERO_LAYERS, ZERO_BATCH, ZERO_MEMORY_MIB = 2048, 16, 64, 512  # part 4: ~67 M parameters, Adam
CLUSTER_WIDTH, CLUSTER_LAYERS = 6144, 24  # part 5: 25 Linear layers of 6144 x 6144 (943,872,000 parameters)
EMULATED = Model([784, 512, 512, 10], batch_size=256)  # part 6: on 2 nodes x 2 ranks of this machine
EMULATED_NAME, EMULATED_NODES, EMULATED_SLOTS = "lesson11", 2, 2
EMULATED_LABELS = ("ddp ring", "ddp hierarchical (2 nodes)", "ddp topk 1%", "local-sgd H=8")


def bullet(text: str) -> None:
    """An item of a list under a part, wrapped to the terminal; a word longer than the room (an address) is printed
    whole on a line of its own, standing in less (terminal.paragraph keeps it whole too, but at the item's indentation,
    past the end of the line: dgx-h100's sources would not fit 80 columns)."""
    width = terminal.prose_width()
    for line in textwrap.wrap(text, width, initial_indent="     - ", subsequent_indent="       ",
                              break_long_words=False, break_on_hyphens=False):  # fmt: skip
        word = line.lstrip()
        print(line if len(line) <= width else " " * max(0, width - len(word)) + word)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def nbytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def itemsize(model: Model) -> int:
    return np.dtype(model.dtype).itemsize


def buffers(model: Model) -> int:
    """The optimizer's buffers per parameter (momentum SGD: 1, Adam: 2)."""
    return buffers_per_parameter(model.optimizer, model.momentum)


# ------------------------------------------------------------------------------------- what the plan says
def best_distributed(rows: list[Row]) -> Row | None:
    """The fastest row that fits, makes single's updates and uses more than one rank (the planner's "best" may be
    single itself)."""
    return next((r for r in rows if r.fits and r.same_updates and r.ranks > 1), None)


def single_row(rows: list[Row]) -> Row:
    return next(r for r in rows if r.paradigm == "single")


def contenders(model: Model, machine, worlds=(2, 4)) -> dict[str, Row]:
    """single, and the best distributed configuration on each of ``worlds`` ranks: what part 1 measures."""
    chosen = {"single": single_row(plan(model, 1, machine))}
    for world in worlds:
        best = best_distributed(plan(model, world, machine))
        if best is not None:
            chosen[f"{world} ranks"] = best
    return chosen


def single_breakdown(model: Model, machine) -> dict:
    """single's predicted step on ``machine``, in the planner's own terms (dtrain/plan/hardware.py): the arithmetic of
    the
    matrix products, which splitting the batch divides, and what it does not divide: the fixed cost of each layer
    (the interpreter, NumPy's calls), and the optimizer's update with the step's own overhead."""
    layers = list(itertools.pairwise(model.sizes))
    arithmetic = sum(6 * model.batch_size * a * b for a, b in layers) / machine.flops
    return {"arithmetic": arithmetic, "per_layer": len(layers) * machine.layer_s,
            "update": machine.update_time(model.parameters, itemsize(model), buffers(model))}  # fmt: skip


def distributing_pays_from(machine, world: int, widths=(64, 128, 256, 512, 1024, 2048, 4096), batch: int = 64):
    """The narrowest hidden width (of a 64-w-w-w-10 MLP) at which the planner's best configuration on ``world``
    ranks is faster than single, and the ratio there; (None, None) if none of ``widths`` is."""
    for width in widths:
        rows = plan(Model([64, width, width, width, 10], batch), world, machine)
        best = best_distributed(rows)
        if best is not None and best.total < single_row(rows).total:
            return width, single_row(rows).total / best.total
    return None, None


def measure_interleaved(chosen: dict[str, Row], model: Model, repeats: int, budget_s: float) -> dict[str, dict]:
    """Run each of ``chosen`` (label -> row) ``repeats`` times here, interleaved (a busy moment of the machine slows
    every contender alike), through plan_check.measure: its median step, its bytes per step and the state its
    fullest rank held."""
    runs = {label: [] for label in chosen}
    with tempfile.TemporaryDirectory(prefix="lesson11-") as scratch:
        for repeat in range(repeats):
            for i, (label, row) in enumerate(chosen.items()):
                folder = Path(scratch) / f"{i}-{repeat}"
                runs[label].append(plan_check.measure(row, model, folder, plan_check.steps_for(row.total, budget_s)))
    return {label: {"step_s": statistics.median(m.step_s for m in got), "steps_s": [m.step_s for m in got],
                    "sent_per_step": got[-1].sent_per_step, "state_bytes": got[-1].state_bytes}
            for label, got in runs.items()}  # fmt: skip


# ---------------------------------------------------------------------------------- part 2: ddp against tp
def width_model(width: int, batch: int = WIDTH_BATCH, layers: int = WIDTH_LAYERS) -> Model:
    """``layers`` Linear layers of width x width (features and classes = width too: the blocks of a wider model)."""
    return Model([width] * (layers + 1), batch)


def ddp_and_tp(width: int, world: int, machine, batch: int = WIDTH_BATCH, layers: int = WIDTH_LAYERS):
    """(the fastest ddp row that sends messages, the tp row on all ``world`` ranks) for :func:`width_model`, priced by
    plan(). (Shared memory, ``--allreduce shm``, sends no bytes at all inside one node: lesson 2; the comparison
    here is of what crosses a link, which is what a cluster pays.)"""
    rows = plan(width_model(width, batch, layers), world, machine, only=["ddp", "tp"])
    messages = [r for r in rows if r.paradigm == "ddp" and r.time and r.same_updates and r.sent_per_step]
    ddp = min(messages, key=lambda r: r.total)
    tp = next(r for r in rows if r.paradigm == "tp" and r.flags["tp"] == world)
    return ddp, tp


def crossover(world: int, machine, widths=WIDTHS, batch: int = WIDTH_BATCH, layers: int = WIDTH_LAYERS,
              step: int = WIDTH_STEP) -> int | None:  # fmt: skip
    """The narrowest width (a multiple of ``step``) from which tp's predicted step is shorter than ddp's: the first of
    ``widths`` where tp wins and keeps winning over the rest of the sweep, then bisection between it and the width
    before it. None if tp never wins; ``widths[0]`` if it wins from the start."""

    def tp_wins(width):
        ddp, tp = ddp_and_tp(width, world, machine, batch, layers)
        return tp.total < ddp.total

    wins = [tp_wins(w) for w in widths]
    first = next((i for i in range(len(widths)) if all(wins[i:])), None)
    if first is None:
        return None
    if first == 0:
        return widths[0]
    lo, hi = widths[first - 1] // step, widths[first] // step  # tp loses at lo * step, wins at hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if tp_wins(mid * step) else (mid, hi)
    return hi * step


# ------------------------------------------------------------------------------- part 3: micro-batches
def pipeline_model(width: int = PIPE_WIDTH, layers: int = PIPE_LAYERS, batch: int = PIPE_BATCH) -> Model:
    return Model([width] * (layers + 1), batch)


def microbatch_sweep(model: Model, stages: int, machine, counts=None) -> list[dict]:
    """A pipeline of ``stages`` stages (GPipe, no data parallelism) priced for each count M of micro-batches: the
    step, the update (which no pipeline overlaps), the busy time of the slowest stage (M micro-batches), the bubble,
    and the bubble's share of the pipelined time beside (P-1)/(M+P-1)."""
    pp = parallel.get("pp")
    counts = counts or [m for m in (2**k for k in range(12)) if model.batch_size % m == 0 and model.batch_size // m
                        >= 2]  # fmt: skip
    found = []
    for m in counts:
        flags = {"pp": stages, "tp": 1, "dp": 1, "schedule": "gpipe", "microbatches": m}
        row = price(pp, f"pp{stages} gpipe M={m}", flags, stages, model, machine)
        if row.ruled_out:
            continue
        stage_parameters = max(row.state) / (itemsize(model) * (2 + buffers(model)))  # the fullest stage's
        update = machine.slowdown(stages) * machine.update_time(stage_parameters, itemsize(model), buffers(model))
        t = row.time
        busy = t["compute"] + t["communication"] - update
        found.append({"M": m, "rows": model.batch_size // m, "step_s": t["total"], "update_s": update,
                      "busy_s": busy, "bubble_s": t["bubble"], "fraction": t["bubble"] / (t["bubble"] + busy),
                      "formula": (stages - 1) / (m + stages - 1), "row": row})  # fmt: skip
    return found


def microbatch_fit(sweep: list[dict], stages: int) -> dict:
    """The slowest stage's busy time is about a B + c M (a B: the arithmetic of the whole batch, c: what each
    micro-batch costs whatever its rows: per-layer overheads and message latencies), fitted to the first and last
    M; the step is then about a B + c M + (P-1)(a B / M + c) + the update, shortest at M* = sqrt((P-1) a B / c)."""
    first, last = sweep[0], sweep[-1]
    c = (last["busy_s"] - first["busy_s"]) / (last["M"] - first["M"])
    whole = first["busy_s"] - c * first["M"]
    best = min(sweep, key=lambda s: s["step_s"])
    optimum = math.sqrt((stages - 1) * whole / c) if c > 0 and whole > 0 else math.inf
    return {"per_microbatch_s": c, "arithmetic_s": whole, "best_M": best["M"], "formula_M": optimum}


# ------------------------------------------------------------------------------------------ part 4: ZeRO
def zero_model(width: int = ZERO_WIDTH, layers: int = ZERO_LAYERS, batch: int = ZERO_BATCH) -> Model:
    return Model([width] * (layers + 1), batch, optimizer="adam")


def with_memory_per_rank(machine, per_rank: float, world: int):
    """``machine`` with ``per_rank`` bytes for each of ``world`` ranks (as ``dtrain plan --memory``: where ranks share a
    node's memory, as on this machine, the node gets ranks x per_rank)."""
    shared = machine.ranks_on_node(world) if machine.cores else 1
    return dataclasses.replace(machine, memory=per_rank * shared)


def zero_table(model: Model, world: int, machine) -> list[dict]:
    """ddp and ZeRO stages 1-3 on ``world`` ranks: each one's fullest rank by kind (plan's price), the ZeRO paper's
    formula for the same (dtrain's terms: one precision, no master copy), the layer in flight, whether it fits."""
    b, k = itemsize(model), buffers(model)
    largest = max(a * c + c for a, c in itertools.pairwise(model.sizes))
    found = []
    for stage in (0, 1, 2, 3):
        kind, flags = ("ddp", {"allreduce": "ring"}) if stage == 0 else ("zero", {"zero_stage": stage})
        row = price(parallel.get(kind), "ddp ring" if stage == 0 else f"zero stage {stage}", flags, world, model,
                    machine)  # fmt: skip
        paper = paper_formula(model.parameters, world, stage, b, k)
        in_flight = {"parameters": largest * b if stage == 3 else 0, "gradients": largest * b if stage >= 2 else 0,
                     "optimizer": 0}  # fmt: skip
        found.append({"stage": stage, "label": row.label, "row": row, "paper": paper, "in_flight": in_flight,
                      "held": {kind_: row.memory[kind_] for kind_ in KINDS}})  # fmt: skip
    return found


# ------------------------------------------------------------------------------------- part 5: a cluster
def cluster_model(batch: int = 1024) -> Model:
    return Model([CLUSTER_WIDTH] * (CLUSTER_LAYERS + 2), batch, optimizer="adam")


FAMILIES = ("ddp", "zero", "tp", "pp")  # part 5 shows the fastest of each


def fastest_of(rows: list[Row], paradigm: str) -> Row | None:
    """The fastest row of one paradigm that fits and takes single's steps (rows come fastest first; ddp's
    compressed rows are approximations)."""
    return next((r for r in rows if r.paradigm == paradigm and r.fits and r.same_updates), None)


def overlap_rows(rows: list[Row]) -> tuple[Row, Row]:
    """ddp ring without and with --overlap, as plan() priced them (both are among ddp's configurations:
    dtrain/parallel/data_parallel.py; with --overlap backward hides part of the all-reduces)."""
    by_label = {r.label: r for r in rows}
    return by_label["ddp ring"], by_label["ddp ring, overlapped"]


def sources(name: str) -> dict:
    """A preset's stated sources and assumptions (hardware.json), by what they are about."""
    return hardware.presets()[name].get("sources", {})


# ------------------------------------------------------------------------------------------- the lesson
def arguments(argv=None) -> tuple[argparse.Namespace, object]:
    """The lesson's flags and the preset they name (a dtrain.plan.hardware.Hardware), each refused before any work if
    it is bad (exit status 2, one line); so is a run under mpiexec: this lesson starts the jobs it measures itself."""
    parser = argparse.ArgumentParser(description="Lesson 11: planning (run it with python)")
    parser.add_argument("--quick", action="store_true",
                        help="one measured run per configuration, fewer steps; part 5 on 8 and 64 ranks")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3,
                        help="part 1: measured runs per configuration, interleaved (default %(default)s)")  # fmt: skip
    parser.add_argument("--ranks", type=int, default=4, help="parts 2-4: ranks (default %(default)s)")
    parser.add_argument("--preset", default="dgx-h100",
                        help="part 2's second machine and part 5's cluster (default %(default)s)")  # fmt: skip
    parser.add_argument("--cluster-batch", type=int, default=1024, help="part 5's global batch (default %(default)s)")
    parser.add_argument("--memory-mib", type=float, default=ZERO_MEMORY_MIB,
                        help="part 4: memory per rank, MiB (default %(default)s)")  # fmt: skip
    parser.add_argument("--png", metavar="PATH", help="draw part 5's plan for 64 ranks here")
    parser.add_argument("--link", default="100mbit", help="part 6: the emulated cluster's link, as tc spells a rate "
                        "(default %(default)s)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write every figure and every check to this file")
    args = parser.parse_args(argv)
    if mpi.launched_size() > 1:
        refuse("lesson 11 starts the jobs it measures itself: run it with python lessons/11_planning.py")
    refuse_bad_arguments([
        (args.ranks < 2 or args.ranks & (args.ranks - 1) or args.ranks > 8 or args.repeats < 1 or args.memory_mib <= 0,
         "--ranks must be 2, 4 or 8, --repeats >= 1, --memory-mib > 0"),
        (not is_rate(args.link), "--link is a rate as tc spells it: 10mbit, 100mbit, 1gbit"),
    ])  # fmt: skip
    try:
        preset = hardware.load(args.preset)
    except ConfigError as exc:  # (it lists the presets)
        refuse(f"bad arguments: {exc}")
    if args.png:
        from dtrain.report import pyplot

        pyplot()  # a missing matplotlib said now, not after the work
    return args, preset


def is_rate(text: str) -> bool:
    try:
        return clusters.rate_bits_s(text) > 0
    except UserError:
        return False


def introduction(here) -> None:
    """This machine, as the planner knows it: what it is, and how much slower a rank computes when ranks share it."""
    say(f"Lesson 11: planning. Here: {here.about}", "", "   ")
    say(f"Its ranks share {here.cores} cores: each rank computes "
        + ", ".join(f"{here.slowdown(p):.2f}x slower with {p} ranks" for p in (2, 4))
        + " busy (measured by scripts/calibrate.py).")  # fmt: skip


def part_1_when_not_to_distribute(here, world: int, repeats: int, budget: float, checks: Checks,
                                  results: dict) -> None:  # fmt: skip
    """single against the planner's best on 2 and 4 ranks, for a digits-sized MLP and one 16 times as wide: predicted,
    then measured here (``repeats`` runs each, interleaved, of about ``budget`` seconds), and why the small one does
    not pay; then from which width the planner says distributing pays here, on 2 and ``world`` ranks."""
    heading("1. When not to distribute: predicted, then measured here")
    results["measured"] = {}
    for name, model in (("small", SMALL), ("wide", WIDE)):
        chosen = contenders(model, here)
        print()
        say(model.describe())
        say(f"measuring {', '.join(f'{label}: {r.label}' for label, r in chosen.items())} ({repeats} run(s) each, "
            "interleaved) ...")  # fmt: skip
        got = measure_interleaved(chosen, model, repeats, budget)
        base = got["single"]["step_s"]
        cells = []
        for label, row in chosen.items():
            g = got[label]
            against = "-" if label == "single" else terminal.speed(g["step_s"], base, "single")
            cells.append([label, row.label, ms(row.total), ms(g["step_s"]), f"{row.total / g['step_s']:.2f}",
                          against, nbytes(row.sent_per_step), nbytes(g["sent_per_step"])])  # fmt: skip
        table(["", "configuration", "step predicted", "step measured", "predicted over measured",
               "measured, against single", "sent per step predicted", "sent per step measured"], cells,
              left=(0, 1, 5), keys=2, groups=(6,))  # fmt: skip
        exact = all(got[label]["sent_per_step"] == row.sent_per_step and got[label]["state_bytes"] == max(row.state)
                    for label, row in chosen.items())  # fmt: skip
        checks.ok(f"{name}: every run's bytes per step and state per rank are the planner's, to the byte", exact)
        fastest = min(got, key=lambda label: got[label]["step_s"])
        predicted_first = min(chosen, key=lambda label: chosen[label].total)
        distributed = [label for label in chosen if label != "single"]
        if fastest == "single":
            slower = "; ".join(f"the best on {label}, {chosen[label].label}, is "
                               f"{terminal.speed(got[label]['step_s'], base, 'single')}"
                               for label in distributed)  # fmt: skip
            verdict = f"Measured here, single is the fastest: {slower}."

        else:
            verdict = (f"Measured here, distributing wins: {chosen[fastest].label} on {fastest} is "
                       f"{terminal.speed(got[fastest]['step_s'], base, 'single')}.")  # fmt: skip
        agree = ("The planner predicted the same winner" if predicted_first == fastest else
                 f"The planner predicted {chosen[predicted_first].label} ({predicted_first}) would be the fastest; "
                 f"the measurement says {chosen[fastest].label}")  # fmt: skip
        accuracy = {label: chosen[label].total / got[label]["step_s"] for label in chosen}
        most = max(distributed, key=lambda label: chosen[label].ranks)
        parts = single_breakdown(model, here)
        single_pred, spread = chosen["single"].total, chosen[most]
        shared = (", and ranks that share the cores cost more, measured, than the slowdown it applies"
                  if accuracy[most] < accuracy["single"] else "")  # fmt: skip
        say(f"{verdict} {agree}. Its predicted steps are {accuracy['single']:.2f}x the measured one for single and "
            f"{accuracy[most]:.2f}x for {most} (its rates are fitted to steps in one process{shared}). What splitting "
            "the batch can save: of "
            f"single's predicted {ms(single_pred)} a step, the arithmetic of the matrix products is "
            f"{ms(parts['arithmetic'])} ({100 * parts['arithmetic'] / single_pred:.0f}%), and that is all that "
            f"splitting the batch divides. The fixed cost of its {len(model.sizes) - 1} layers "
            f"({ms(parts['per_layer'])}: the interpreter, NumPy's calls) every rank pays in full, and so the update "
            f"({ms(parts['update'])}) unless the configuration shards the weights (tp, ZeRO). On {spread.ranks} "
            f"ranks sharing {here.cores} cores each rank computes {here.slowdown(spread.ranks):.2f}x slower, so "
            f"{spread.label}'s predicted compute is {ms(spread.time['compute'])}, before "
            f"{ms(spread.time['communication'])} of collectives each step.")  # fmt: skip
        results["measured"][name] = {
            "model": model.sizes, "batch_size": model.batch_size,
            "configurations": {label: {"label": row.label, "ranks": row.ranks, "predicted_s": row.total,
                                       "predicted_sent": row.sent_per_step, "predicted_state": max(row.state),
                                       **got[label]} for label, row in chosen.items()},
            "fastest_measured": fastest, "fastest_predicted": predicted_first}  # fmt: skip
    for p in sorted({2, world}):
        width, ratio = distributing_pays_from(here, p)
        if width is None:
            say(f"On {p} ranks, the planner predicts no width up to 4096 (64-w-w-w-10, batch 64) for which "
                "distributing pays on this machine.")  # fmt: skip
        else:
            say(f"On {p} ranks the planner predicts that distributing starts to pay here from a hidden width of "
                f"{width} (64-{width}-{width}-{width}-10, batch 64: {terminal.speed(1.0, ratio, 'single')} "
                "there).")  # fmt: skip

        results.setdefault("pays_from", {})[str(p)] = width


def part_2_data_against_tensor_parallelism(here, preset, world: int, checks: Checks, results: dict) -> None:
    """ddp against tp as the model widens, on ``world`` ranks of this machine and 8 of ``preset``: each one's step
    and bytes, and the width from which tp's step is the shorter (bisection)."""
    heading(f"2. Data against tensor parallelism as the model widens: {WIDTH_LAYERS} layers of width x width, global "
            f"batch {WIDTH_BATCH}, float32, momentum SGD")  # fmt: skip

    results["widths"] = {}
    say(
        "ddp's column is its fastest configuration that sends messages: inside one node shared memory (--allreduce"
        " shm, lesson 2) sends none, and what tp and ddp are compared on here is what crosses a link."
    )
    for machine, p in ((here, world), (preset, 8)):
        print()
        say(f"on {p} ranks of {machine.name} ({nbytes(machine.per_rank_memory(p))} per rank)")
        cells, sweep = [], []
        for width in WIDTHS:
            ddp, tp = ddp_and_tp(width, p, machine)
            sweep.append({"width": width, "ddp": ddp.label, "ddp_s": ddp.total, "ddp_sent": ddp.sent_per_step,
                          "ddp_fits": ddp.fits, "tp": tp.label, "tp_s": tp.total, "tp_sent": tp.sent_per_step,
                          "tp_fits": tp.fits})  # fmt: skip
            cells.append([f"{width:,}", f"{parameter_count(width_model(width).sizes):,}", ddp.label, ms(ddp.total),
                          nbytes(ddp.sent_per_step), "" if ddp.fits else "no", ms(tp.total), nbytes(tp.sent_per_step),
                          "" if tp.fits else "no", "tp" if tp.total < ddp.total else "ddp"])  # fmt: skip
        table(["width", "parameters", "ddp: its fastest", "ddp step", "ddp sent per step", "ddp fits", f"tp{p} step",
               f"tp{p} sent per step", f"tp{p} fits", "faster"], cells, left=(2, 9), groups=(6,))  # fmt: skip
        at = crossover(p, machine)
        growth_ddp = sweep[-1]["ddp_sent"] / sweep[-2]["ddp_sent"]
        growth_tp = sweep[-1]["tp_sent"] / sweep[-2]["tp_sent"]
        bytes_cross = next((s["width"] for s in sweep if s["tp_sent"] < s["ddp_sent"]), None)
        if at is None:
            where = f"tp{p}'s step is never the shorter in this sweep"
        elif at == WIDTHS[0]:
            where = f"tp{p}'s step is the shorter from the narrowest width priced ({at}) on"
        else:
            ddp, tp = ddp_and_tp(at, p, machine)
            where = (f"tp{p}'s step becomes the shorter at width {at:,} (bisection, in steps of {WIDTH_STEP}: "
                     f"{tp.total * 1e3:.4g} ms against {ddp.label}'s {ddp.total * 1e3:.4g} ms)")  # fmt: skip
        no_room = next((s for s in sweep if not s["ddp_fits"]), None)
        room = "" if no_room is None else (
            f" From width {no_room['width']:,} on, ddp's replicas do not even fit a rank's "
            f"{nbytes(machine.per_rank_memory(p))}" + ("." if no_room["tp_fits"] else f", nor tp{p}'s shards.")
        )  # fmt: skip
        fewer = ("tp never sends fewer bytes in this sweep" if bytes_cross is None else
                 f"tp sends fewer bytes from width {bytes_cross:,} on")  # fmt: skip
        say(f"On {machine.name}, {where}. Doubling the width multiplies ddp's bytes by {growth_ddp:.1f} (it "
            f"all-reduces every gradient: ~width^2) and tp's by {growth_tp:.1f} (it all-reduces activations: ~width "
            f"x batch); {fewer}. Where the steps cross depends on more "
            "than bytes: tp makes several all-reduces per step where ddp makes one (each pays the latency), and a tp "
            f"rank updates only its 1/{p} of the weights, where every ddp rank updates all of them.{room}")  # fmt: skip
        if at is not None and at > WIDTHS[0]:
            below, above = ddp_and_tp(at - WIDTH_STEP, p, machine), ddp_and_tp(at, p, machine)
            checks.ok(f"{machine.name}: at width {at} tp's predicted step is shorter than ddp's, at {at - WIDTH_STEP}"
                      " it is not", above[1].total < above[0].total and below[1].total >= below[0].total)  # fmt: skip
        results["widths"][machine.name] = {"ranks": p, "sweep": sweep, "crossover": at, "bytes_crossover": bytes_cross}


def part_3_micro_batches(here, world: int, checks: Checks, results: dict) -> None:
    """A GPipe pipeline on ``world`` stages of this machine, priced for M = 1, 2, 4, ... micro-batches: the bubble
    against (P-1)/(M+P-1), the fixed cost each micro-batch adds, and the M that balances the two."""
    stages, model = world, pipeline_model()
    heading(f"3. How micro-batches pay for a pipeline: {model.describe()}, GPipe on {stages} stages of this machine")
    sweep = microbatch_sweep(model, stages, here)
    fit = microbatch_fit(sweep, stages)
    cells = [[f"{s['M']}", f"{s['rows']}", ms(s["step_s"]), ms(s["busy_s"]), ms(s["busy_s"] / s["M"]),
              ms(s["bubble_s"]), f"{s['fraction']:.3f}", f"{s['formula']:.3f}", ms(s["update_s"])]
             for s in sweep]  # fmt: skip
    table(["M", "rows", "step", "busy (M x t)", "t", "bubble", "bubble share", "(P-1)/(M+P-1)", "update"], cells,
          left=())  # fmt: skip
    worst = max(abs(s["fraction"] - s["formula"]) for s in sweep)
    checks.ok("the bubble's share of the pipelined time is (P-1)/(M+P-1), within 0.01", worst < 0.01,
              f" (largest difference {worst:.4f})")  # fmt: skip
    first, best = sweep[0], next(s for s in sweep if s["M"] == fit["best_M"])
    uneven = (" (the small difference: the first and last stages send one message per micro-batch, the others two)"
              if worst > 1e-9 else "")  # fmt: skip
    say(f"With one micro-batch, {stages - 1} of the {stages} stages wait at any moment: the bubble is "
        f"{100 * first['fraction']:.0f}% of the pipelined time. M micro-batches shrink it to (P-1)/(M+P-1) of it"
        f"{uneven}. But "
        f"each micro-batch costs about {ms(fit['per_microbatch_s'])} whatever its rows (the per-layer overheads of "
        f"its stage's {PIPE_LAYERS // stages} layers, forward and backward, and its messages' latency), so the "
        f"busy time grows from {ms(first['busy_s'])} at M = 1 to {ms(sweep[-1]['busy_s'])} at M = "
        f"{sweep[-1]['M']}. The shortest step priced is M = {fit['best_M']} ({ms(best['step_s'])}, bubble "
        f"{100 * best['fraction']:.0f}%); balancing the two costs, a B + c M + (P-1)(a B / M + c), puts it at M* = "
        f"sqrt((P-1) a B / c) = {fit['formula_M']:.1f}.")  # fmt: skip
    results["microbatches"] = {"stages": stages, "sizes": model.sizes, "batch_size": model.batch_size,
                               "sweep": [{k: v for k, v in s.items() if k != "row"} for s in sweep], **fit}  # fmt: skip


def part_4_zero(here, world: int, memory_mib: float, checks: Checks, results: dict) -> None:
    """A model whose ddp state does not fit ``memory_mib`` MiB a rank on ``world`` ranks: each ZeRO stage's state by
    kind against the ZeRO paper's formula plus the layer in flight, which stages fit and what they cost, and what the
    planner picks when every paradigm competes."""
    model = zero_model()
    budget_bytes = memory_mib * MIB
    small = with_memory_per_rank(here, budget_bytes, world)
    heading(f"4. What ZeRO buys when memory is the limit: {model.describe()}, on {world} ranks of this machine with "
            f"{nbytes(budget_bytes)} per rank (an assumption: as if `dtrain plan --memory "
            f"{memory_mib / 1024:g}`)")  # fmt: skip
    found = zero_table(model, world, small)
    cells = []
    for z in found:
        r, paper = z["row"], z["paper"]
        cells.append([z["label"], *(nbytes(r.memory[k]) for k in KINDS), nbytes(r.memory["activations"]),
                      nbytes(r.memory["total"]), "yes" if r.fits else "no", nbytes(sum(paper.values())),
                      nbytes(sum(z["in_flight"].values())), ms(r.total), nbytes(r.sent_per_step)])  # fmt: skip
    table(["", "parameters", "gradients", "optimizer", "activations", "total", "fits", "paper's formula",
           "layer in flight", "step", "sent per step"], cells, groups=(7,))  # fmt: skip
    exact = all(z["held"][k] == z["paper"][k] + z["in_flight"][k] for z in found for k in KINDS)
    checks.ok("every stage's bytes per rank = the ZeRO paper's formula + the layer in flight, by kind", exact)
    fitting = [z for z in found if z["row"].fits]
    ddp_row = found[0]["row"]
    if not fitting:
        said = "Nothing fits: not even stage 3; more ranks, a smaller batch or a smaller model."
    elif fitting[0]["stage"] == 0:
        said = (f"ddp fits ({nbytes(ddp_row.memory['total'])} of {nbytes(budget_bytes)}): with this much memory "
                "ZeRO buys nothing but a smaller footprint; give --memory-mib less to see it pay.")  # fmt: skip
    else:
        lowest = fitting[0]
        r = lowest["row"]
        said = (f"ddp needs {nbytes(ddp_row.memory['total'])} per rank and a rank has {nbytes(budget_bytes)}: it does "
                f"not fit. The lowest stage that fits is {lowest['stage']} ({nbytes(r.memory['total'])}); it is "
                f"priced {terminal.speed(r.total, ddp_row.total, 'ddp')} and sends "
                f"{r.sent_per_step / ddp_row.sent_per_step:.2f}x its bytes.")  # fmt: skip
    update = small.slowdown(world) * small.update_time(model.parameters, itemsize(model), buffers(model))
    said += (f" (Sharding the optimizer state also shards the optimizer's work: each rank updates only its chunk. "
             f"Adam's update of every weight is {ms(update)} of ddp's {ms(ddp_row.total)} here, memory-bound on "
             f"{world} ranks sharing {here.cores} cores.)")  # fmt: skip
    z3 = found[3]
    say(f"{said} Stage 1 shards the optimizer state (Adam: 2 buffers per weight), stage 2 the gradients too, stage 3 "
        f"the parameters too. The paper's formula (dtrain's terms: one precision, no master copy) leaves out the "
        f"layer in flight, {nbytes(z3['in_flight']['parameters'])} here, which stages 2 and 3 hold whole while it "
        f"is reduce-scattered or used: stage 3's {nbytes(sum(z3['held'].values()))} of state is "
        f"{nbytes(sum(z3['paper'].values()))} of chunks and {nbytes(sum(z3['in_flight'].values()))} of "
        "layers.")  # fmt: skip
    everyone = plan(model, world, small)
    best = next((r for r in everyone if r.best), None)
    if best is not None:
        say(f"But ZeRO is not the only way to fit. With every paradigm competing for this memory: {why(everyone)} "
            f"It needs {nbytes(best.memory['total'])} per rank.")  # fmt: skip
    results["zero"] = {"world": world, "memory_per_rank": budget_bytes, "sizes": model.sizes,
                       "stages": [{"stage": z["stage"], "held": z["held"], "paper": z["paper"],
                                   "in_flight": z["in_flight"], "total": z["row"].memory["total"],
                                   "fits": z["row"].fits, "step_s": z["row"].total,
                                   "sent_per_step": z["row"].sent_per_step} for z in found],
                       "best": best.label if best else None}  # fmt: skip


def part_5_a_real_cluster(preset, cluster_batch: int, worlds: tuple[int, ...], png: str | None, results: dict) -> None:
    """An MLP of about a billion parameters with Adam on ``worlds`` ranks of ``preset`` (every number with its source):
    what the planner picks and why, how the best step scales, and what overlapping ddp's all-reduce is worth; drawn
    to ``png`` for 64 ranks if asked."""
    model = cluster_model(cluster_batch)
    heading(f"5. A real cluster: {preset.about}")
    say(model.describe())
    say("what the preset assumes, and where each number comes from (dtrain/plan/hardware.json):")
    for about, source in sources(preset.name).items():
        bullet(f"{about}: {source}")
    hides = "as long as it lasts" if preset.hidden >= 1 else f"for {preset.hidden:.0%} of the time it lasts"
    bullet("and what this lesson and the planner assume besides: the global batch is fixed whatever the ranks (strong "
           "scaling); float32 arithmetic without tensor cores; ddp priced both ways, its all-reduce after backward "
           f"(dtrain's default) and overlapped with backward (--overlap: backward, 2/3 of the compute, hides "
           f"all-reduces {hides}); tp's and pp's messages not overlapped with compute; no activation "
           "recomputation; ranks fill nodes in order; a collective that spans nodes is priced on the slower link "
           "throughout (no hierarchy unless the configuration says so).")  # fmt: skip
    results["cluster"] = {"preset": preset.name, "sizes": model.sizes, "batch_size": model.batch_size, "worlds": {}}
    plans, cells = {}, []
    for p in worlds:
        rows = plans[p] = plan(model, p, preset)
        best, single = next(r for r in rows if r.best), single_row(rows)
        speedup = single.total / best.total if single.fits else math.nan
        cells.append([f"{p}", best.label, ms(best.total), f"{speedup:.1f}x" if single.fits else "-",
                      f"{speedup / p:.2f}" if single.fits else "-",
                      f"{100 * best.time['communication'] / best.total:.0f}%",
                      f"{100 * best.time['bubble'] / best.total:.0f}%", nbytes(best.memory["total"]),
                      f"{model.batch_size / best.total:,.0f}"])  # fmt: skip
        fastest = {name: fastest_of(rows, name) for name in FAMILIES}
        results["cluster"]["worlds"][str(p)] = {
            "best": best.label, "step_s": best.total, "single_s": single.total, "why": why(rows),
            "fastest": {name: {"label": r.label, "step_s": r.total} if r else None
                        for name, r in fastest.items()}}  # fmt: skip
    table(["ranks", "the planner's best", "step", "speed-up over single", "efficiency", "comm", "bubble",
           "memory per rank", "samples per s"], cells, left=(1,), keys=2, groups=(5,))  # fmt: skip
    say(
        "speed-up over single: single's predicted step over the best's (5.0x: five times as fast); efficiency: that "
        "speed-up per rank (1 would be perfect); comm and bubble: their shares of the step; memory: the fullest rank's."
    )
    for p in worlds:
        rows = plans[p]
        best = next(r for r in rows if r.best)
        families = "; ".join(f"{name}: {fastest_of(rows, name).label} {ms(fastest_of(rows, name).total)}"
                             if fastest_of(rows, name) else f"{name}: none fits" for name in FAMILIES)  # fmt: skip
        print()
        say(f"{p} ranks ({-(-p // preset.ranks_per_node)} node(s) of {preset.ranks_per_node}):")
        say(f"The fastest of each paradigm that fits: {families}. {why(rows)}")
    steps = [results["cluster"]["worlds"][str(p)]["step_s"] for p in worlds]
    trend = "; ".join(f"{b} ranks {terminal.speed(t, s, f'{a}')}" for (a, s), (b, t) in
                      itertools.pairwise(zip(worlds, steps)))  # fmt: skip
    last = (f"{worlds[-1]} ranks are {terminal.speed(steps[-1], steps[-2], str(worlds[-2]))}: more ranks stopped "
            "paying" if steps[-1] > steps[-2] else f"more ranks still pay at {worlds[-1]}")  # fmt: skip
    say(f"How the best step scales with the ranks, the global batch fixed at {model.batch_size}: {trend}; {last}. "
        f"Each rank gets less work ({model.batch_size / worlds[-1]:g} sample(s) per rank on {worlds[-1]} ranks, if "
        "every rank takes a share of the batch) for collectives that do not shrink as fast, and more of them cross "
        "the slower links between nodes.")  # fmt: skip
    # ddp with and without --overlap on one node, as the planner priced both (dtrain/parallel/data_parallel.py)
    plain, overlapped = overlap_rows(plans[8])
    best8, ddp8 = next(r for r in plans[8] if r.best), fastest_of(plans[8], "ddp")
    picked = (f"the planner picked {best8.label} ({ms(best8.total)}) over every ddp configuration, overlapped or "
              "not" if best8.paradigm != "ddp" else f"the planner picked {best8.label} itself")  # fmt: skip
    say(f"One assumption weighs on one node: whether ddp's all-reduce overlaps its backward. The planner weighs "
        f"--overlap: on 8 ranks it prices ddp ring overlapped at {ms(overlapped.total)} a step "
        f"({ms(overlapped.time['communication'])} of all-reduces left after backward's hiding) and ddp ring not "
        f"overlapped at {ms(plain.total)} ({ms(plain.time['communication'])} after backward): overlapped is "
        f"{terminal.speed(overlapped.total, plain.total, 'not overlapped')}. ddp's fastest there is "
        f"{ddp8.label if ddp8 else 'none that fits'}, and {picked}.")  # fmt: skip
    results["cluster"]["ddp_overlap_8_s"] = overlapped.total
    results["cluster"]["ddp_no_overlap_8_s"] = plain.total
    if png and 64 in plans:
        print()
        say(f"drawn: {figure(plans[64], png, f'{model.describe()} on 64 ranks of {preset.name}')}")


def part_6_an_emulated_cluster(link: str, budget: float, checks: Checks, results: dict) -> None:
    """The planner against a cluster of this machine's network namespaces (``dtrain cluster up``, root only; skipped
    with the reason elsewhere): ddp ring, hierarchical, top-k 1% and local SGD (H = 8) priced from the link's rate
    and measured across it, ``budget`` seconds of steps an epoch; the cluster taken down whatever happens."""
    heading(f"6. The planner against an emulated cluster: {EMULATED_NODES} nodes x {EMULATED_SLOTS} ranks of this "
            f"machine, {link} between them")  # fmt: skip
    why_not = clusters.missing("part 6's cluster")
    if why_not is not None:
        say(f"skipped: {why_not}.")
        results["emulated"] = {"skipped": why_not}
        return
    say(f"dtrain cluster up --nodes {EMULATED_NODES} --slots {EMULATED_SLOTS} --link {link} --name {EMULATED_NAME}: "
        "each node a network namespace on a bridge of its own, its link shaped to the rate each way; MPI's bytes "
        "between nodes cross it over TCP, the ranks of a node still share memory.")  # fmt: skip
    try:
        made = clusters.up(EMULATED_NAME, EMULATED_NODES, EMULATED_SLOTS, link)
    except UserError as exc:  # (one of that name is up already: it is not this lesson's to take down)
        say(f"skipped: {exc}.")
        results["emulated"] = {"skipped": str(exc)}
        return
    try:
        world = hostfile.read(made.hostfile)
        machine = hostfile.machine(hardware.load(hardware.THIS), world)
        say(f"dtrain plan --hostfile {made.hostfile} reads it as {world.source}.")
        rows = {r.label: r for r in plan(EMULATED, world.ranks, machine, only=["ddp", "local-sgd"],
                                         labels=EMULATED_LABELS)}  # fmt: skip
        say(f"{EMULATED.describe()}; measuring {', '.join(EMULATED_LABELS)} across it (as dtrain plan --hostfile "
            "FILE --check runs them) ...")  # fmt: skip
        got = {}
        with tempfile.TemporaryDirectory(prefix="lesson11-cluster-") as scratch:
            for i, label in enumerate(EMULATED_LABELS):
                row = rows[label]
                steps = plan_check.steps_of(row, row.total, budget)
                got[label] = plan_check.measure(row, EMULATED, Path(scratch) / str(i), steps, hosts=world.hosts)
        emulated_table(rows, got)
        exact = all(got[label].sent_per_step == rows[label].sent_per_step for label in EMULATED_LABELS)
        checks.ok("on the cluster, every run's bytes per step are the planner's, to the byte", exact)
        emulated_story(rows, got, made, world)
        results["emulated"] = {
            "link": link, "latency_us": made.latency_us, "measured_bits_s": made.measured_bits_s,
            "configurations": {label: {"predicted_s": rows[label].total, "measured_s": got[label].step_s,
                                       "compute_s": rows[label].time["compute"],
                                       "communication_s": rows[label].time["communication"],
                                       "sent_per_step": got[label].sent_per_step}
                               for label in EMULATED_LABELS}}  # fmt: skip
    finally:
        clusters.down(EMULATED_NAME)
        say(f"dtrain cluster down --name {EMULATED_NAME}: its namespaces, links, processes and files removed.")


def emulated_table(rows: dict, got: dict) -> None:
    """Part 6's table: each configuration's predicted step (compute + communication) beside the measured one."""
    cells = []
    for label in EMULATED_LABELS:
        row, step = rows[label], got[label].step_s
        cells.append([label, ms(row.time["compute"]), ms(row.time["communication"]), ms(row.total), ms(step),
                      f"{step / row.total:.2f}", nbytes(row.sent_per_step)])  # fmt: skip
    table(["configuration", "compute", "comm", "step predicted", "step measured", "measured over predicted",
           "sent per step"], cells, keys=1, groups=(3,))  # fmt: skip


def emulated_story(rows: dict, got: dict, made, world) -> None:
    """What part 6's numbers say: what each configuration sends across a node's link, which won, and what the
    planner's formulas leave out of the link (TCP's headers, flows that share it)."""
    step = {label: got[label].step_s for label in EMULATED_LABELS}
    ring, hier, topk, _local = EMULATED_LABELS
    ratios = [step[label] / rows[label].total for label in EMULATED_LABELS]
    n = EMULATED.parameters * 4
    say(f"What crosses a node's link, at {world.inter_bytes_s / 1e6:.3g} MB/s each way (the gradient: n = "
        f"{nbytes(n)}): the ring's 6 steps each send n/4 out of every node (one rank a node sends across), 1.5 n in "
        f"all; hierarchical sends n (the two leaders' ring), {terminal.speed(rows[hier].total, rows[ring].total)} "
        f"predicted and {terminal.speed(step[hier], step[ring])} measured than the ring; top-k 1% all-gathers "
        f"{nbytes(rows[topk].sent_per_step)} a rank; local SGD averages once in 8 steps by recursive doubling, "
        "whose one crossing step has both ranks of a node send n at once: 2 n on the node's one link. Measured "
        f"over predicted: {min(ratios):.2f} to {max(ratios):.2f}.")  # fmt: skip
    tcp = made.measured_bits_s / clusters.rate_bits_s(made.link) if made.measured_bits_s else math.nan
    say(f"What the planner leaves out of the link: TCP's and IP's headers, which the shaping counts (a stream "
        f"carried {tcp:.1%} of the rate as data when dtrain cluster up measured it), and flows that share a link "
        "slow each other more than their share of it (local SGD's doubling step); the latency it prices is the "
        f"link's, {made.latency_us:g} us one way, under a millisecond of each step. Compute is priced with all "
        f"{world.ranks} ranks on this machine's cores: the nodes are namespaces of one machine.")  # fmt: skip


def main(argv=None) -> None:
    """The lesson: its arguments, then its six parts in order, then the verdict (the exit status is 1 if a check
    failed)."""
    args, preset = arguments(argv)  # bad ones are refused here, before any work
    started = time.perf_counter()
    here, checks = hardware.load(hardware.THIS), Checks()  # (this process alone: the jobs of part 1 are its own)
    repeats, budget = (1, 0.3) if args.quick else (args.repeats, 0.6)
    worlds = (8, 64) if args.quick else (8, 64, 512)
    results = {"quick": args.quick, "ranks": args.ranks, "preset": args.preset}
    introduction(here)
    part_1_when_not_to_distribute(here, args.ranks, repeats, budget, checks, results)
    part_2_data_against_tensor_parallelism(here, preset, args.ranks, checks, results)
    part_3_micro_batches(here, args.ranks, checks, results)
    part_4_zero(here, args.ranks, args.memory_mib, checks, results)
    part_5_a_real_cluster(preset, args.cluster_batch, worlds, args.png, results)
    part_6_an_emulated_cluster(args.link.strip().lower(), 1.0 if args.quick else 2.0, checks, results)
    conclude(args.json, results, checks, started=started)


if __name__ == "__main__":
    main()

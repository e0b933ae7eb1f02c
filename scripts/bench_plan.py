"""The planner against measurement: every paradigm ``dtrain plan`` ranks, trained here on 2 and 4 ranks for three
models, its predicted step time, bytes and state beside what the runs measured.

    python scripts/bench_plan.py                                # ranks 2 and 4; small, mlp, wide; 3 rounds: ~13 min
    python scripts/bench_plan.py --ranks 4 --sizes mlp --rounds 2
    python scripts/bench_plan.py --quick                        # small and mlp, 2 rounds, fewer steps: ~4 min
    python scripts/bench_plan.py --json docs/bench/plan.json    # every round's numbers too (docs/benchmarks.md, 12)

(minutes on the idle 2-core VM; run it on an idle machine: with 4 ranks on 2 cores, anything else running shows up as
2-9x swings between rounds.)

The models (``--sizes``): ``small`` 64-64-64-64-10 on a global batch of 96, ``mlp`` 784-512-512-10 on 256 (the
planner's default; on 4 ranks it rules out a parameter server with 3 workers, which cannot split 256), ``wide``
784-2048-2048-10 on 240 (a batch every configuration's check accepts). Each configuration is a row of
:func:`dtrain.plan.plan`, and what it predicts is held against :func:`dtrain.plan.check.measure` (``dtrain train``
under this environment's ``mpiexec``, synthetic data of the model's shape, 2 epochs, the last one timed)::

    step time    predicted: compute + communication + bubble (row.time) on this machine's rates; the compute rates
                 are refitted at the start of this run (dtrain.plan.hardware.measure_compute on one BLAS thread, in a
                 subprocess; calibration.json is not written), the links and the slowdown of shared cores are
                 calibration.json's. Measured: the median over the rounds; the ratio is predicted / measured.
    bytes/step   predicted: the paradigm's costs() per rank (the table shows the busiest's, row.sent_per_step).
                 Measured: the tracer's bytes per rank in the steady state: the rounds run different numbers of
                 steps, and the difference of two rounds' totals over the difference of their steps cancels what is
                 sent once a run (ps-sync's first pull of the weights, gossip's final average), as tests/test_plan.py
                 does. ps-async's workers push when they are ready, so its count is per push (each worker's bytes
                 per push against its costs() entry).
    state        predicted: row.state (parameters + gradients + optimizer state, by rank); measured: what each rank
                 held, read off its arrays. Both counts must be equal, to the byte, on every rank.

The first choice: the planner's best (the fastest predicted that fits and makes single's updates) against the timed
configurations that make single's updates, paired by round: each one's step time over the first choice's in the same
round, the median over the rounds (the "vs 1st" column, in words: "1.20x slower"); the first choice passes if none is
more than 10% faster.

What is timed: every configuration the planner prices that fits here, but of the pipeline one per grid (pp x tp x dp:
1F1B with the micro-batch count predicted fastest; GPipe's predicted time is 1F1B's, the schedules differ in activation
memory), local SGD at its smallest H (it averages most often) and gossip on the ring; ``ddp ring, overlapped`` too (the
planner prices it as ddp ring here: a CPU hides nothing behind backward). Each (ranks, model) block runs all its
configurations once per round, the order rotated each round, so that a slow minute on this VM falls on all of them
alike; the rounds follow one another within the block. The steps per epoch: :func:`dtrain.plan.check.steps_for` of the
predicted step with ``--budget`` seconds (5 to 50 steps), one more each round (local SGD: H more, whole periods).

Then worlds this machine cannot run: 16, 32 and 64 simulated ranks (dtrain.comm.sim: threads, the same tracer), a
tiny model trained for one epoch of 2 and of 4 steps per configuration (ddp ring and hierarchical_rs, ZeRO 1/2/3,
tp x dp, pp x dp, pp x tp x dp, ps-sync): the steady-state bytes and the state of every rank against the plan's.

And two things the formulas assume, measured (``--no-diagnose`` skips them, ~1 min): how much slower a rank computes
its share of the batch with every rank of the world computing at once than alone (calibration.json's slowdown, which
multiplies every distributed configuration's compute), and what splitting a step into 8 micro-batches costs one
process (a pipeline's compute is priced per micro-batch as its rows' arithmetic and ``layer_s`` per layer).

Exit status 1 if any count (bytes or state, run here or simulated) differs from the plan's, or a run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_util import faster, rotated, run_meta, say, write_json

from dtrain import kernels, parallel, report, terminal
from dtrain import plan as planner
from dtrain.comm import sim
from dtrain.errors import UserError
from dtrain.launch.mpiexec import THREAD_VARIABLES
from dtrain.plan import hardware
from dtrain.plan.check import measure, steps_for
from dtrain.train import train

SIZES = {"small": ([64, 64, 64, 64, 10], 96), "mlp": ([784, 512, 512, 10], 256), "wide": ([784, 2048, 2048, 10], 240)}
TARGETS = ("ddp", "zero", "tp", "pp")  # the families whose predicted step the issue holds to a factor of measured
FACTOR = 1.5  # the factor aimed for
WITHIN = 0.10  # the planner's first choice: the measured fastest, or this much slower at most
SIM_SIZES = [32, 32, 32, 32, 8]  # the simulated worlds' model: four layers (pp4 possible), widths tp4 divides
RATES = ("flops", "layer_s", "step_s", "memory_bandwidth")  # what measure_compute fits
TOLERANCE = 1e-6  # bytes: a steady-state count is a difference of integers over a difference of steps


# --- this machine, now ---------------------------------------------------------------------------------------------
def refit_compute() -> dict:
    """dtrain.plan.hardware.measure_compute in a subprocess with one BLAS thread (as a rank runs) and the NumPy kernels
    (as measure() runs them): the four compute rates fitted to dtrain's own steps, now."""
    code = "import json; from dtrain.plan.hardware import measure_compute; print(json.dumps(measure_compute()))"
    env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, "1")}
    env.setdefault(kernels.ENV_VAR, "numpy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"measure_compute failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def this_machine(refit: bool) -> tuple[hardware.Hardware, dict]:
    machine = hardware.load(hardware.THIS)
    if not refit:
        return machine, {}
    fit = refit_compute()
    rates = {k: fit[k] for k in RATES}
    return dataclasses.replace(machine, **rates), fit


def rates_line(m: hardware.Hardware) -> str:
    return (f"{m.flops / 1e9:.1f} GFLOP/s, {m.layer_s * 1e6:.0f} us per layer, {m.step_s * 1e6:.0f} us per step, "
            f"{m.memory_bandwidth / 1e9:.2f} GB/s updates")  # fmt: skip


# --- which configurations ------------------------------------------------------------------------------------------
def timed(rows: list) -> list:
    """The priced rows that fit, the pipeline's one per grid, local SGD's smallest H, gossip's ring; the best always."""
    priced = [r for r in rows if r.time and r.fits]
    grids, keep = {}, []
    for r in priced:
        if r.paradigm == "pp":
            key = (r.flags.get("pp"), r.flags.get("tp"), r.flags.get("dp"), r.flags.get("interleave"))
            grids.setdefault(key, []).append(r)
        elif r.paradigm == "local-sgd":
            if r.flags["sync_every"] == min(x.flags["sync_every"] for x in priced if x.paradigm == "local-sgd"):
                keep.append(r)
        elif r.paradigm == "gossip":
            if r.flags.get("topology") == "ring" or r.best:
                keep.append(r)
        else:
            keep.append(r)
    for variants in grids.values():
        keep.append(min(variants, key=lambda r: (r.total, r.flags.get("schedule") != "1f1b")))
    keep += [r for r in priced if r.best and r not in keep]
    return sorted(keep, key=lambda r: r.total)


def predicted_sent(row, model) -> list:
    """The paradigm's costs(): bytes each rank sends per step."""
    config = model.config(row.paradigm, row.flags)
    return parallel.get(row.paradigm).costs(model.sizes, row.ranks, config)["sent_per_step"]


# --- the counts ----------------------------------------------------------------------------------------------------
def per_push(metrics: dict) -> dict:
    """ps-async: each worker's bytes per push (rank -> bytes)."""
    out = {}
    for r, mine in enumerate(metrics["communication"]["per_rank"]):
        push = mine["operations"].get("ps/push")
        if push and push["calls"]:
            out[r] = push["bytes_sent"] / push["calls"]
    return out


def steady_bytes(runs: list) -> tuple[list, list, str]:
    """Bytes per rank per step from the runs (each: its steps and each rank's training bytes): the difference of the
    runs with the fewest and the most steps over the difference of their steps, what was sent once a run (the rest),
    and how it was counted; with one step count only, the total over the steps."""
    first, last = min(runs, key=lambda x: x["steps"]), max(runs, key=lambda x: x["steps"])
    if last["steps"] == first["steps"]:
        return [b / first["steps"] for b in first["traffic"]], [0.0] * len(first["traffic"]), "total / steps"
    steps = last["steps"] - first["steps"]
    steady = [(b - a) / steps for a, b in zip(first["traffic"], last["traffic"])]
    once = [a - s * first["steps"] for a, s in zip(first["traffic"], steady)]
    return steady, once, f"({last['steps']} - {first['steps']} steps)"


def same(measured: list, predicted: list) -> bool:
    return len(measured) == len(predicted) and all(
        p is not None and abs(m - p) <= TOLERANCE for m, p in zip(measured, predicted)
    )


def bytes_check(row, model, runs: list) -> dict:
    """The bytes check of one configuration: measured (busiest rank), predicted (busiest), equal on every rank?"""
    predicted = predicted_sent(row, model)
    if row.paradigm == "ps-async":  # per push, each worker against its own entry
        pushes = [per_push(run["metrics"]) for run in runs]
        ranks = sorted(pushes[0])
        equal = all(set(p) == set(ranks) and same([p[r] for r in ranks], [predicted[r] for r in ranks])
                    for p in pushes)  # fmt: skip
        return {"measured": max(pushes[0].values()), "predicted": max(predicted[r] for r in ranks), "equal": equal,
                "once": 0.0, "how": "per push (workers)"}  # fmt: skip
    steady, once, how = steady_bytes(runs)
    equal = same(steady, predicted) and abs(max(steady) - row.sent_per_step) <= TOLERANCE
    return {"measured": max(steady), "predicted": row.sent_per_step, "equal": equal, "once": max(once), "how": how,
            "per_rank": steady}  # fmt: skip


# --- one block: a rank count and a model ---------------------------------------------------------------------------
def run_block(world: int, size: str, machine, rounds: int, budget: float, scratch: Path) -> dict:
    sizes, batch = SIZES[size]
    model = planner.Model(sizes, batch)
    rows = planner.plan(model, world, machine)
    chosen = timed(rows)
    print()
    say(f"== {world} ranks, {size}: {model.describe()}; {len(chosen)} configurations x {rounds} rounds", hanging="   ")
    runs = {r.label: [] for r in chosen}
    failed = {}
    started = time.perf_counter()
    for rnd in range(rounds):
        for row in rotated(chosen, rnd):
            if row.label in failed:
                continue
            q = row.flags.get("sync_every", 1)  # (local SGD: whole periods, so that its averages fall alike)
            steps = -(-steps_for(row.total, budget) // q) * q + rnd * q
            folder = scratch / f"{world}-{size}-{len(runs[row.label])}-{row.label.replace(' ', '_')}"
            try:
                got = measure(row, model, folder, steps)
            except UserError as exc:
                failed[row.label] = str(exc)
                say(f"{row.label}: FAILED: {exc}", "  ", "    ")
                continue
            runs[row.label].append({"round": rnd, "steps": report.training_steps(got.metrics), "step_s": got.step_s,
                                    "traffic": report.training_traffic(got.metrics),
                                    "messages": report.training_traffic(got.metrics, "messages_sent"),
                                    "held": report.state_bytes(got.metrics)[0], "metrics": got.metrics})  # fmt: skip
        print(f"  round {rnd + 1}/{rounds} done ({time.perf_counter() - started:.0f} s)", flush=True)
    out = []
    for row in chosen:
        mine = runs[row.label]
        entry = {"label": row.label, "paradigm": row.paradigm, "flags": row.flags, "ranks": row.ranks,
                 "same_updates": row.same_updates, "best": row.best, "predicted": row.time,
                 "predicted_sent_per_step": row.sent_per_step, "predicted_state": row.state}  # fmt: skip
        if not mine:
            out.append({**entry, "failed": failed.get(row.label, "no run")})
            continue
        times = [x["step_s"] for x in mine]
        by_round = [next((x["step_s"] for x in mine if x["round"] == rnd), None) for rnd in range(rounds)]
        counted = bytes_check(row, model, mine)
        messages = steady_bytes([{"steps": x["steps"], "traffic": x["messages"]} for x in mine])[0]
        entry.update(measured_s=statistics.median(times), rounds_s=by_round, steps=[x["steps"] for x in mine],
                     messages_per_step=max(messages),
                     ratio=row.total / statistics.median(times), bytes=counted,
                     measured_state=mine[0]["held"], state_equal=all(x["held"] == row.state for x in mine))  # fmt: skip
        if row.label in failed:
            entry["failed"] = failed[row.label]
        out.append(entry)
    block = {"ranks": world, "size": size, "sizes": sizes, "batch_size": batch, "describe": model.describe(),
             "seconds": time.perf_counter() - started, "load_average": os.getloadavg(),
             "configurations": out}  # fmt: skip
    block["verdict"] = verdict(out)
    print(block_table(block), flush=True)
    return block


def versus(entry: dict, other: dict) -> float | None:
    """The median over the rounds both ran of ``entry``'s step time over ``other``'s in the same round (paired: a
    slow minute slows both)."""
    pairs = [a / b for a, b in zip(entry.get("rounds_s", []), other.get("rounds_s", [])) if a and b]
    return statistics.median(pairs) if pairs else None


def verdict(entries: list) -> dict:
    """The planner's first choice against the fastest measured of those that make single's updates, round by round:
    each one's time over the first choice's in the same round, the median over the rounds."""
    best = next((e for e in entries if e["best"] and e.get("measured_s")), None)
    if best is None:
        return {"text": "the planner's first choice was not measured", "within": False}
    for e in entries:
        e["vs_best"] = versus(e, best)
    ran = [e for e in entries if e.get("vs_best") and e["same_updates"]]
    fastest = min(ran, key=lambda e: e["vs_best"])
    slower = 1 / fastest["vs_best"] - 1
    if fastest is best or slower <= 0:
        text = f"the planner's first choice, {best['label']}, was the measured fastest"
    else:
        text = (f"the planner's first choice, {best['label']}, measured {100 * slower:.0f}% slower than the fastest, "
                f"{fastest['label']} (the median over the rounds of the first choice's time over its time in the "
                f"same round): {'within' if slower <= WITHIN else 'NOT within'} {100 * WITHIN:.0f}%")  # fmt: skip
    return {"text": text, "best": best["label"], "fastest": fastest["label"] if slower > 0 else best["label"],
            "slower": max(slower, 0.0), "within": slower <= WITHIN}  # fmt: skip


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def block_table(block: dict, width="auto") -> str:
    """One block's configurations, predicted beside measured, as text fitted to ``width`` (:mod:`dtrain.terminal`)."""
    header = ["", "configuration", "pred ms", "pred compute ms", "pred comm ms", "pred bubble ms", "meas ms",
              "meas range ms", "vs 1st", "pred / meas", "msgs per step", "B/step pred", "B/step meas", "B equal",
              "once B", "state B pred", "state B meas", "state equal"]  # fmt: skip
    cells = []
    for e in block["configurations"]:
        t = e["predicted"]
        mark = "*" if e["best"] else "" if e["same_updates"] else "~"
        head = [mark, e["label"], _ms(t["total"]), _ms(t["compute"]), _ms(t["communication"]),
                _ms(t["bubble"]) if t["bubble"] > 1e-9 else "-"]  # fmt: skip
        if "measured_s" not in e:
            cells.append([*head, "FAILED", *[""] * 11])
            continue
        b = e["bytes"]
        once = "-" if b["once"] < 0.5 else f"{b['once']:,.0f}"
        times = [t for t in e["rounds_s"] if t]
        versus = "-" if e["best"] else faster(1 / e["vs_best"]) if e.get("vs_best") else ""
        cells.append([*head, _ms(e["measured_s"]), f"{_ms(min(times))}-{_ms(max(times))}", versus,
                      f"{e['ratio']:.2f}", f"{e['messages_per_step']:.0f}", f"{b['predicted']:,.0f}",
                      f"{b['measured']:,.0f}", "yes" if b["equal"] else "NO", once, f"{max(e['predicted_state']):,.0f}",
                      f"{max(e['measured_state']):,.0f}", "yes" if e["state_equal"] else "NO"])  # fmt: skip
    load = ", ".join(f"{x:.1f}" for x in block["load_average"])
    legend = ("* the planner's first choice; ~ not single's updates (not chosen); meas ms: the median of the rounds "
              "(range: theirs); vs 1st: its speed against the first choice's, paired by round (the median over the "
              "rounds of its time over the first choice's in the same round); pred / meas: predicted over measured; "
              "msgs: messages the busiest rank sends per step; B/step: its bytes (ps-async: per push); once B: sent "
              "once a run besides")  # fmt: skip
    lines = ["", terminal.paragraph(f"{block['ranks']} ranks, {block['size']}: {block['describe']} "
                                    f"({block['seconds']:.0f} s; load average after: {load})", hanging="  ",
                                    width=width),
             terminal.table(header, cells, left=(0, 1), keys=2, groups=(2, 6, 10, 15), width=width),
             terminal.paragraph(legend, hanging="  ", width=width),
             terminal.paragraph("first choice: " + block["verdict"]["text"], hanging="  ", width=width)]  # fmt: skip
    return "\n".join(lines)


# --- the factors -----------------------------------------------------------------------------------------------------
def factors(blocks: list) -> list:
    """Per rank count and paradigm family: the median and the worst predicted/measured (worst: farthest from 1)."""
    out = []
    for world in sorted({b["ranks"] for b in blocks}):
        by_family = {}
        for b in blocks:
            if b["ranks"] != world:
                continue
            for e in b["configurations"]:
                if e.get("ratio"):
                    by_family.setdefault(e["paradigm"], []).append((e["ratio"], f"{b['size']} {e['label']}"))
        for family, ratios in sorted(by_family.items()):
            worst = max(ratios, key=lambda x: abs(math.log(x[0])))
            out.append({"ranks": world, "family": family, "n": len(ratios),
                        "median": statistics.median(r for r, _ in ratios), "low": min(r for r, _ in ratios),
                        "high": max(r for r, _ in ratios), "worst": worst[0], "worst_at": worst[1],
                        "factor": max(max(worst[0], 1 / worst[0]), 1.0)})  # fmt: skip
    return out


def factors_table(rows: list, width="auto") -> str:
    header = ["ranks", "family", "configs", "median pred / meas", "range", "worst pred / meas", "off by", "where"]
    cells = [[str(f["ranks"]), f["family"] + (" (target)" if f["family"] in TARGETS else ""), str(f["n"]),
              f"{f['median']:.2f}", f"{f['low']:.2f}-{f['high']:.2f}", f"{f['worst']:.2f}", f"{f['factor']:.2f}x",
              f["worst_at"]] for f in rows]  # fmt: skip
    return terminal.table(header, cells, left=(1, 7), keys=2, width=width)


# --- two things the formulas assume, measured here ----------------------------------------------------------------
MICRO = 8  # micro-batches of the micro-batch check (the pipeline's 4P at P = 2)


def one_step(sizes, rows: int, accumulate: int = 1, steps: int = 6) -> float:
    """Seconds per step of ``single`` on ``rows`` rows in ``accumulate`` micro-batches, on this process (the second of
    two epochs): dtrain.plan.hardware.step_seconds, with micro-batches."""
    from dtrain.config import TrainConfig

    config = TrainConfig(paradigm="single", dataset="synthetic", features=sizes[0], classes=sizes[-1],
                         hidden=tuple(sizes[1:-1]), batch_size=rows, samples=-(-rows * steps * 5 // 4), epochs=2,
                         accumulate=accumulate, quiet=True, progress=False, timeout=0)  # fmt: skip
    return train(config, sim.solo())["epochs"][-1]["train_time_s"] / steps


def worker(result: str, divisor: int, sizes: list, micro: bool) -> None:
    """A rank of the diagnostics: every rank steps each model on its 1/``divisor`` of the batch at once (the slowest
    rank's time, the median of 3); with ``micro``, also the whole batch in 1 and in MICRO micro-batches."""
    from mpi4py import MPI

    comm, out = MPI.COMM_WORLD, {}
    for size in sizes:
        model, batch = SIZES[size]
        times = []
        for _ in range(3):
            comm.Barrier()
            times.append(comm.allreduce(one_step(model, batch // divisor), op=MPI.MAX))
        out[size] = {"step_s": statistics.median(times)}
        if micro:
            out[size].update({f"accumulate_{k}": statistics.median(one_step(model, batch, k) for _ in range(3))
                              for k in (1, MICRO)})  # fmt: skip
    if comm.Get_rank() == 0:
        Path(result).write_text(json.dumps(out))


def diagnose(worlds: list, sizes: list, machine) -> dict:
    """(1) How much slower a rank computes with every rank of a world computing at once than alone (one thread each)
    on its share of the batch, beside calibration.json's slowdown, which the formulas multiply compute by; (2) what
    splitting a step into MICRO micro-batches costs one process, beside what the formulas add for it (a pipeline's
    compute is charged per micro-batch: its rows' arithmetic, layer_s per layer and four passes over the weights)."""
    from bench_util import launch

    def run(ranks: int, divisor: int, micro: bool = False) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            launch(ranks, [__file__, "--worker", "--result", str(result), "--divisor", str(divisor), "--sizes",
                           ",".join(sizes)] + (["--micro"] if micro else []))  # fmt: skip
            return json.loads(result.read_text())

    slowdown = []
    for world in (w for w in worlds if w > 1):
        alone, busy = run(1, world), run(world, world)
        for size in sizes:
            x = busy[size]["step_s"] / alone[size]["step_s"]
            slowdown.append({"ranks": world, "size": size, "rows": SIZES[size][1] // world,
                             "alone_s": alone[size]["step_s"], "busy_s": busy[size]["step_s"], "measured": x,
                             "calibrated": machine.slowdown(world)})  # fmt: skip
    whole = run(1, 1, micro=True)
    micro = []
    for size in sizes:
        model, batch = SIZES[size]
        one, many = whole[size]["accumulate_1"], whole[size][f"accumulate_{MICRO}"]
        layers = list(itertools.pairwise(model))  # the planner's own charge: M micro-batches against one
        formula = MICRO * machine.layers_time(layers, batch // MICRO, 4) - machine.layers_time(layers, batch, 4)
        micro.append({"size": size, "batch": batch, "one_s": one, "micro_s": many, "formula_extra_s": formula})
    diagnosed = {"slowdown": slowdown, "micro_batches": micro}
    print(diagnosis_tables(diagnosed))
    return diagnosed


def diagnosis_tables(diagnosed: dict, width="auto") -> str:
    """:func:`diagnose`'s two measurements as tables fitted to ``width`` (:mod:`dtrain.terminal`)."""
    busy = [[str(d["ranks"]), f"{d['size']} {d['rows']}", _ms(d["alone_s"]), _ms(d["busy_s"]),
             faster(1 / d["measured"]), faster(1 / d["calibrated"])] for d in diagnosed["slowdown"]]  # fmt: skip
    micro = [[f"{m['size']} {m['batch']}", _ms(m["one_s"]), _ms(m["micro_s"]), _ms((m["micro_s"] - m["one_s"]) /
              (MICRO - 1)), _ms(m["formula_extra_s"] / (MICRO - 1))] for m in diagnosed["micro_batches"]]  # fmt: skip
    return "\n".join([
        "", terminal.paragraph("compute with every rank busy (one step of each rank's share of the batch; one thread "
                               "a rank), against one process alone:", width=width),
        terminal.table(["ranks", "model, rows each", "alone ms", "all at once ms", "all at once vs alone",
                        "calibration.json's slowdown"], busy, left=(1,), keys=2, width=width),
        "", terminal.paragraph(f"one process, the whole batch in 1 and in {MICRO} micro-batches (single "
                               "--accumulate):", width=width),
        terminal.table(["model, batch", "1 ms", f"{MICRO} ms", "ms per extra micro-batch",
                        "the formulas' ms per extra"], micro, width=width),
    ])  # fmt: skip


# --- worlds this machine cannot run ----------------------------------------------------------------------------------
def simulated_rows(world: int, machine) -> tuple[planner.Model, list]:
    """The tiny model on ``world`` ranks (a batch that ps-sync's world - 4 workers and every grid split) and the
    configurations checked there."""
    model = planner.Model(SIM_SIZES, math.lcm(world, world - 4))
    rows = [r for r in planner.plan(model, world, machine) if r.time]
    picks = [
        lambda r: r.paradigm == "ddp" and r.flags.get("allreduce") in ("ring", "hierarchical_rs"),
        lambda r: r.paradigm == "zero",
        lambda r: r.paradigm == "tp" and r.flags.get("tp") == 4,
        lambda r: r.paradigm == "pp" and r.flags.get("tp") == 1 and r.flags.get("pp") == 2,
        lambda r: r.paradigm == "pp" and r.flags.get("tp") == 2 and r.flags.get("pp") == 2,
        lambda r: r.paradigm == "ps-sync" and r.flags.get("servers") == 4,
    ]
    chosen = []
    for pick in picks:
        matching = [r for r in rows if pick(r) and r.flags.get("schedule", "1f1b") == "1f1b"]
        if matching and matching[0].paradigm == "pp":  # the pipeline: its fewest micro-batches (the cheapest run)
            matching = [min(matching, key=lambda r: r.flags["microbatches"])]
        chosen += matching
    return model, chosen


def simulate(row, model, steps: int) -> dict:
    config = model.config(row.paradigm, row.flags)
    config.epochs, config.samples, config.quiet, config.progress = 1, -(-steps * model.batch_size * 5 // 4), True, False
    config.timeout = 0
    return sim.SimWorld(row.ranks, timeout=600).run(lambda comm: train(config, comm))[0]


def run_simulated(worlds: list, machine) -> list:
    out = []
    for world in worlds:
        model, rows = simulated_rows(world, machine)
        started = time.perf_counter()
        for row in rows:
            runs = []
            for steps in (2, 4):
                metrics = simulate(row, model, steps)
                runs.append({"steps": report.training_steps(metrics), "traffic": report.training_traffic(metrics),
                             "held": report.state_bytes(metrics)[0], "metrics": metrics})  # fmt: skip
            counted = bytes_check(row, model, runs)
            out.append({"world": world, "batch_size": model.batch_size, "label": row.label,
                        "predicted_sent_per_step": row.sent_per_step, "measured_sent_per_step": counted["measured"],
                        "bytes_equal": counted["equal"], "once": counted["once"],
                        "predicted_state": max(row.state), "measured_state": max(runs[-1]["held"]),
                        "state_equal": all(r["held"] == row.state for r in runs)})  # fmt: skip
        print(f"  {world} simulated ranks: {len(rows)} configurations ({time.perf_counter() - started:.0f} s)",
              flush=True)  # fmt: skip
    return out


def simulated_table(rows: list, width="auto") -> str:
    header = ["ranks", "batch", "configuration", "B/step plan", "B/step tracer", "B equal", "once B", "state B plan",
              "state B held", "state equal"]  # fmt: skip
    cells = [[str(r["world"]), str(r["batch_size"]), r["label"], f"{r['predicted_sent_per_step']:,.0f}",
              f"{r['measured_sent_per_step']:,.0f}", "yes" if r["bytes_equal"] else "NO",
              "-" if r["once"] < 0.5 else f"{r['once']:,.0f}", f"{r['predicted_state']:,.0f}",
              f"{r['measured_state']:,.0f}", "yes" if r["state_equal"] else "NO"] for r in rows]  # fmt: skip
    return terminal.table(header, cells, left=(2,), keys=3, groups=(3, 7), width=width)


# --- the command -----------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="rank counts run here (default %(default)s)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"models, of {', '.join(SIZES)} (default all)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per block (default 3; --quick 2)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of predicted steps per epoch (dtrain.plan.check.steps_for: 5 to 50 steps; "
                        "default 0.5, --quick 0.25)")  # fmt: skip
    parser.add_argument("--sim-worlds", default="16,32,64", help="simulated rank counts ('' for none)")
    parser.add_argument("--quick", action="store_true", help="small and mlp, 2 rounds, half the steps, 16 simulated")
    parser.add_argument("--no-refit", action="store_true", help="calibration.json's compute rates, not refitted now")
    parser.add_argument("--no-diagnose", action="store_true", help="skip the busy-cores and micro-batch checks")
    parser.add_argument("--json", help="write the results (every round's numbers) to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--divisor", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--micro", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.result, args.divisor, args.sizes.split(","), args.micro)
        return
    if args.quick:
        args.sizes = "small,mlp" if args.sizes == ",".join(SIZES) else args.sizes
        args.sim_worlds = "16" if args.sim_worlds == "16,32,64" else args.sim_worlds
    rounds = args.rounds or (2 if args.quick else 3)
    budget = args.budget or (0.25 if args.quick else 0.5)
    worlds = [int(w) for w in args.ranks.split(",") if w.strip()]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            parser.error(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
    sim_worlds = [int(w) for w in args.sim_worlds.split(",") if w.strip()]
    if rounds < 2:
        say("(one round: bytes are total / steps, so what is sent once a run, ps-sync's first pull and gossip's final "
            "average, counts against them)")  # fmt: skip

    began, load_before = time.perf_counter(), os.getloadavg()
    if not args.no_refit:
        print("refitting this machine's compute rates (one BLAS thread, ~40 s) ...", flush=True)
    stored = hardware.load(hardware.THIS)
    machine, fit = this_machine(not args.no_refit)
    say(f"compute rates: {rates_line(machine)}" + ("" if args.no_refit else f" (calibration.json's: "
        f"{rates_line(stored)})"), hanging="  ")  # fmt: skip
    say(f"slowdown of busy cores (calibration.json): {machine.slowdowns}; dtrain's latency per message: "
        + ", ".join(f"{p} ranks {m.alpha * 1e6:.0f} us" for p, m in sorted(machine.loaded.items())),
        hanging="  ")  # fmt: skip

    blocks = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as scratch:
        for world in worlds:
            for size in sizes:
                blocks.append(run_block(world, size, machine, rounds, budget, Path(scratch)))

    table = factors(blocks)
    print()
    say("predicted / measured step time by paradigm family (off by: the worst's factor, max(r, 1/r))")
    print(factors_table(table))
    missed = [f for f in table if f["family"] in TARGETS and f["factor"] > FACTOR]
    say(f"targets (ddp, zero, tp, pp within {FACTOR}x): "
        + ("met" if not missed else "missed by " + ", ".join(f"{f['family']} at {f['ranks']} ranks "
           f"({f['factor']:.2f}x)" for f in missed)), hanging="  ")  # fmt: skip
    print("first choices:")
    for b in blocks:
        say(f"{b['ranks']} ranks, {b['size']}: {b['verdict']['text']}", "  ", "    ")

    diagnosed = {} if args.no_diagnose else diagnose(worlds, sizes, machine)

    simulated = []
    if sim_worlds:
        print(f"\nsimulated worlds ({', '.join(map(str, sim_worlds))} ranks), {'-'.join(map(str, SIM_SIZES))}:",
              flush=True)  # fmt: skip
        simulated = run_simulated(sim_worlds, machine)
        print(simulated_table(simulated))

    wrong = [f"{b['ranks']} ranks {b['size']} {e['label']}: " + ", ".join(
        k for k, bad in (("bytes", not e["bytes"]["equal"]), ("state", not e["state_equal"])) if bad)
        for b in blocks for e in b["configurations"] if "measured_s" in e and
        not (e["bytes"]["equal"] and e["state_equal"])]  # fmt: skip
    wrong += [f"{s['world']} simulated ranks {s['label']}" for s in simulated
              if not (s["bytes_equal"] and s["state_equal"])]  # fmt: skip
    failures = [f"{b['ranks']} ranks {b['size']} {e['label']}: {e['failed']}" for b in blocks
                for e in b["configurations"] if "failed" in e]  # fmt: skip
    seconds = time.perf_counter() - began
    counted = sum("measured_s" in e for b in blocks for e in b["configurations"]) + len(simulated)
    print()
    say(f"counts: {counted - len(wrong)} of {counted} configurations equal to the plan's, bytes and state"
        + ("" if not wrong else "; DIFFERENT: " + "; ".join(wrong)), hanging="  ")  # fmt: skip
    for line in failures:
        say(f"FAILED: {line}", hanging="  ")
    print(f"took {seconds / 60:.1f} min")

    if args.json:
        meta = run_meta(rounds=rounds, budget_s=budget, seconds=seconds, load_average_before=load_before,
                        load_average_after=os.getloadavg(), compute_fit=fit,
                        compute_stored={k: getattr(stored, k) for k in RATES}, slowdowns=machine.slowdowns,
                        alpha_dtrain={p: m.alpha for p, m in machine.loaded.items()})  # fmt: skip
        path = write_json(args.json, {"meta": meta, "blocks": blocks, "factors": table, "diagnosed": diagnosed,
                                      "simulated": simulated})  # fmt: skip
        print(f"wrote {path}")
    if wrong or failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

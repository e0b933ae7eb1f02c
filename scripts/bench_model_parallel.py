"""Tensor and pipeline parallelism measured: bytes and memory per rank against the formulas, time, and the bubble.

Four parts, each written to docs/bench/ (``model_parallel.txt`` and ``.json``; ``pipeline_timeline.png``,
``model_parallel.png`` and ``pipeline_trace.json``, a Chrome/Perfetto trace of one measured 1F1B step):

1. **Tensor parallelism** through the CLI (``dtrain launch -n N -m dtrain train --paradigm tp ...``) on the wide MLP
   784-2048-2048-10, float32, synthetic data, global batch 256, ring all-reduces: tp = 1, 2, 4 and dp 2 x tp 2. Per
   rank: the tracer's bytes against ``TensorParallel.costs`` (exactly), the parameter bytes held against the cost
   function and against ``single``'s (1/T for the split layers), the step time (the last epoch's) and the share of
   the training time spent in communication (the tracer's). Rounds interleave the contenders in a rotating order;
   the speed against tp = 1 is the median over rounds of tp 1's time over the contender's ("1.89x faster").
2. **The bubble, sleep-calibrated**: 4 ranks on this 2-core machine would time-share the cores, so the compute is a
   sleep: each layer's forward sleeps ``--sleep-ms`` (20 ms), its backward twice that, on a model of 8 equal layers
   (two per stage, one per chunk interleaved) whose real arithmetic is negligible. The schedule, not Python's
   overhead or a shared core, then sets the time. P = 4; M = 1, 4, 8, 16; GPipe, 1F1B and interleaved (V = 2). The
   measured bubble (from every rank's timestamps: 1 - busy / (P x span) over one step) against (P-1)/(VM+P-1); the
   interpreter's peak activation bytes and the tracer's bytes against ``Pipeline.costs``; the timeline drawn from
   the instruction lists (simulated) beside the measured one.
3. **The bubble with real compute**: P = 2 ranks on the 2 cores, 8 layers of 1024 x 1024, micro-batches of 64: what
   is left of the formula when the work is real (stages balanced by parameters, backward about twice forward).
4. **Grids**: pp, dp x pp, tp x pp and dp x tp x pp (8 ranks) through the CLI on the digits: every rank's bytes,
   state and peak activations against ``Pipeline.costs``, exactly.

Any exact check that fails prints FAIL and the script exits non-zero.

    python scripts/bench_model_parallel.py                  # about 2 min on the 2-core VM
    python scripts/bench_model_parallel.py --quick --out /tmp/mp   # one round, fewer sizes: about 40 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_util import (
    Record,
    add_round_flags,
    exit_if_failed,
    faster,
    faster_range,
    launch,
    rotated,
    samples_for,
    sent_per_rank,
    train_metrics,
    training_steps,
    write_json,
    write_results,
)

MB = 1e6
TP_CONTENDERS = {"tp 1": (1, ["--tp", "1"]), "tp 2": (2, ["--tp", "2"]), "tp 4": (4, ["--tp", "4"]),
                 "dp 2 x tp 2": (4, ["--dp", "2", "--tp", "2"])}  # fmt: skip
GRIDS = {
    "pp 4, 1f1b": (4, ["--pp", "4"]),
    "pp 4, gpipe, M 8": (4, ["--pp", "4", "--schedule", "gpipe", "--microbatches", "8"]),
    "dp 2 x pp 2": (4, ["--dp", "2", "--pp", "2"]),
    "tp 2 x pp 2": (4, ["--tp", "2", "--pp", "2"]),
    "dp 2 x pp 2, interleaved": (4, ["--pp", "2", "--schedule", "interleaved"]),
    "dp 2 x tp 2 x pp 2": (8, ["--dp", "2", "--tp", "2", "--pp", "2"]),
}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


# --- 1. tensor parallelism ------------------------------------------------------------------------------------------


def tensor_parallel(args, scratch: Path) -> tuple[Record, list, dict]:
    sizes = [784, *map(int, args.hidden.split(",")), 10]
    flags = ["--paradigm", "tp", "--allreduce", "ring", "--dataset", "synthetic", "--features", "784", "--samples",
             str(samples_for(args.steps, 256)), "--hidden", args.hidden, "--batch-size", "256", "--epochs",
             str(args.epochs), "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01"]  # fmt: skip
    runs = {label: [] for label in TP_CONTENDERS}
    for repeat in range(args.repeats):
        for label in rotated(list(TP_CONTENDERS), repeat):
            ranks, own = TP_CONTENDERS[label]
            metrics = train_metrics(ranks, [*flags, *own], scratch / f"tp-{label.replace(' ', '')}-{repeat}")
            steps = training_steps(metrics)
            per_epoch = steps // len(metrics["epochs"])
            per_rank = metrics["communication"]["per_rank"]
            runs[label].append({
                "sent": sent_per_rank(metrics, ("tp/", "dp/")),
                "sent_formula": [steps * s for s in metrics["costs"]["sent_per_step"]],
                "held": [r["paradigm"]["held_bytes"][i] for i, r in enumerate(per_rank)],
                "held_formula": {k: metrics["costs"][k] for k in ("parameters", "gradients", "optimizer")},
                "step_ms": 1e3 * metrics["epochs"][-1]["train_time_s"] / per_epoch,
                "comm_share": statistics.mean(r["comm_time_s"] / r["train_time_s"] for r in per_rank),
                "steps": steps,
            })  # fmt: skip
            print(f"  tp: {label:12s} round {repeat + 1}: {runs[label][-1]['step_ms']:7.1f} ms/step", flush=True)
    part, checks = tp_report(runs, sizes)
    return part, checks, runs


def tp_report(runs: dict, sizes: list) -> tuple[Record, list]:
    """Tensor parallelism's table (a Record, not printed yet) and its exact checks, from the runs."""
    from dtrain.parallel import parameter_count

    n = parameter_count(sizes)
    part = Record(echo=False)
    part.say()
    part.say(f"## 1. Tensor parallelism: {'-'.join(map(str, sizes))}, float32, global batch 256, ring all-reduces "
             f"(n = {n:,} parameters, {4 * n / MB:.2f} MB); params: rank 0's, sent: the busiest rank's; vs tp 1: the "
             "speed against tp 1's step (its time over this one's, the median over rounds, and the range)",
             hanging="   ")  # fmt: skip
    header = ["contender", "ranks", "params MB", "params, x single", "sent MB per step", "step ms", "vs tp 1",
              "vs tp 1, range", "comm share"]  # fmt: skip
    cells, checks = [], []
    base = runs["tp 1"]
    for label, rounds in runs.items():
        first = rounds[0]
        speeds = [b["step_ms"] / r["step_ms"] for r, b in zip(rounds, base)]
        held = first["held"][0]["parameters"]
        mine = label == "tp 1"
        cells.append([label, str(TP_CONTENDERS[label][0]), f"{held / MB:.2f}", f"{held / (4 * n):.3f}x",
                      f"{max(first['sent']) / first['steps'] / MB:.3f}",
                      f"{statistics.median(r['step_ms'] for r in rounds):.1f}",
                      "-" if mine else faster(statistics.median(speeds)),
                      "-" if mine else faster_range(min(speeds), max(speeds)),
                      f"{100 * statistics.median(r['comm_share'] for r in rounds):.0f}%"])  # fmt: skip
        exact = all(r["sent"] == r["sent_formula"] for r in rounds)
        checks.append(f"{'PASS' if exact else 'FAIL'}  tp, {label}: bytes sent per rank == steps x costs() on every "
                      "rank, every round")  # fmt: skip
        held_ok = all(h == r["held_formula"] for r in rounds for h in r["held"])
        checks.append(f"{'PASS' if held_ok else 'FAIL'}  tp, {label}: bytes held (parameters, gradients, optimizer) "
                      "== costs() on every rank")  # fmt: skip
    part.table(header, cells, groups=(2, 5))
    return part, checks


# --- 2 and 3. the pipeline's bubble (a worker under mpiexec) ----------------------------------------------------------


def measure(lines: list) -> tuple[float, float]:
    """(bubble, span in seconds) of one step from every rank's timeline [(op, stage, micro, start, end), ...]."""
    from dtrain.parallel.schedules import idle_fraction

    span = max(e for line in lines for *_, e in line) - min(s for line in lines for *_, s, _ in line)
    return idle_fraction((rank, s, e) for rank, line in enumerate(lines) for *_, s, e in line), span


def worker(args) -> None:
    """Runs under mpiexec: every schedule and M on this world, one pipeline each; rank 0 writes the results."""
    import numpy as np
    from mpi4py import MPI

    from dtrain.comm.prepare import prepare
    from dtrain.comm.trace import gather_events, write_chrome_trace
    from dtrain.config import TrainConfig
    from dtrain.nn import MLP
    from dtrain.optim import make_optimizer
    from dtrain.parallel.pipeline import Pipeline

    world = MPI.COMM_WORLD
    P, rank = world.Get_size(), world.Get_rank()
    sleep = args.worker == "sleep"
    width, rows = (64, 8) if sleep else (1024, 64)
    sizes = [width] * (2 * P + 1) if sleep else [width] * 9
    grid = [(name, V, M) for name, V in SCHEDULES for M in args.microbatches if name != "interleaved" or M % P == 0]
    if not sleep:
        grid = [(name, V, M) for name, V, M in grid if name != "interleaved"]
    rng = np.random.default_rng(0)
    results = []
    for name, V, M in grid:
        config = TrainConfig(paradigm="pp", pp=P, microbatches=M, schedule=name, virtual_stages=V if V > 1 else None,
                             hidden=tuple(sizes[1:-1]), batch_size=rows * M, timeout=0, quiet=True)  # fmt: skip
        comm = prepare(world, timeout=0)
        pipe = Pipeline(comm, config)
        pipe.build(lambda: MLP(sizes, seed=0), lambda model: make_optimizer("sgd", model, 1e-4))
        if sleep:
            pipe.delay = (args.sleep_ms / 1e3, 2 * args.sleep_ms / 1e3)
        x = rng.standard_normal((rows * M, sizes[0])).astype(np.float32)
        y = rng.integers(0, sizes[-1], rows * M)
        measured = []
        for step in range(1 + args.pp_steps):  # the first is a warm-up
            world.Barrier()
            comm.tracer.reset()
            pipe.step(x, y)
            lines = world.allgather(pipe.timeline)
            if step:
                measured.append((*measure(lines), lines))
        sent = sum(o["bytes_sent"] for label, o in comm.tracer.summary()["operations"].items()
                   if label.startswith("pp/"))  # (the last step's: the tracer was reset before it)  # fmt: skip
        costs = Pipeline.costs(sizes, P, config)
        checks = world.gather({"sent": sent == costs["sent_per_step"][rank],
                               "activations": pipe.peak == costs["activations"][rank]}, root=0)  # fmt: skip
        peaks = world.gather(pipe.peak, root=0)
        if sleep and name == "1f1b" and M == 8:
            events = gather_events(comm.tracer, world)  # the last step's spans and messages, every rank
            if rank == 0:
                write_chrome_trace(Path(args.out) / "pipeline_trace.json", events)
        if rank == 0:
            bubble, span, lines = sorted(measured)[len(measured) // 2]  # the median step
            results.append({"schedule": name, "V": V, "M": M, "bubble": bubble, "span_s": span,
                            "bubbles": [b for b, *_ in measured], "peaks": peaks, "checks": checks,
                            "timeline": lines, "ops": {op: statistics.median(e - s for line in lines
                                                       for o, _, _, s, e in line if o == op)
                                                       for op in ("forward", "backward")}})  # fmt: skip
    if rank == 0:
        write_json(Path(args.out, f"pipeline_{args.worker}.json"), {"P": P, "sizes": sizes, "rows": rows,
                                                                       "results": results})  # fmt: skip


def pipeline_report(data: dict, title: str) -> tuple[Record, list]:
    from dtrain.parallel import schedules

    P = data["P"]
    part = Record(echo=False)
    part.say()
    part.say(title, hanging="   ")
    header = ["schedule", "M", "bubble", "formula", "rel. diff", "each step's bubble", "step s", "t_F ms", "t_B ms",
              "peak activation bytes per stage"]  # fmt: skip
    cells, checks = [], []
    for r in data["results"]:
        formula = schedules.bubble_formula(P, r["M"], r["V"])
        rel = (r["bubble"] - formula) / formula if formula else 0.0
        label = r["schedule"] + (f" V={r['V']}" if r["V"] > 1 else "")
        cells.append([label, str(r["M"]), f"{r['bubble']:.3f}", f"{formula:.3f}", f"{100 * rel:.1f}%",
                      " ".join(f"{b:.3f}" for b in r["bubbles"]), f"{r['span_s']:.3f}",
                      f"{1e3 * r['ops']['forward']:.1f}", f"{1e3 * r['ops']['backward']:.1f}",
                      " ".join(str(peak) for peak in r["peaks"])])  # fmt: skip
        ok = all(c["sent"] and c["activations"] for c in r["checks"])
        checks.append(f"{'PASS' if ok else 'FAIL'}  pp {label} M={r['M']} ({title.split(':')[0][3:]}): bytes sent "
                      "and peak activation bytes == Pipeline.costs() on every rank")  # fmt: skip
    part.table(header, cells, left=(0, 5, 9), keys=2)
    return part, checks


# --- 4. grids ---------------------------------------------------------------------------------------------------------


def grids(args, scratch: Path) -> tuple[Record, list]:
    flags = ["--paradigm", "pp", "--hidden", "64,64,64", "--dtype", "float64", "--batch-size", "48", "--epochs", "1"]
    part = Record(echo=False)
    part.say()
    part.say("## 4. Grids through the CLI (digits, 64-64-64-64-10, float64, 1 epoch): per rank, against "
             "Pipeline.costs()", hanging="   ")  # fmt: skip
    cells, checks = [], []
    for label, (ranks, own) in GRIDS.items():
        metrics = train_metrics(ranks, [*flags, *own], scratch / f"grid-{len(checks)}")
        steps, costs = training_steps(metrics), metrics["costs"]
        per_rank = metrics["communication"]["per_rank"]
        sent = sent_per_rank(metrics, ("pp/", "tp/", "dp/"))
        peaks = [r["paradigm"]["per_rank"][i]["peak_activation_bytes"] for i, r in enumerate(per_rank)]
        held = [r["paradigm"]["held_bytes"][i] for i, r in enumerate(per_rank)]
        ok = (sent == [steps * s for s in costs["sent_per_step"]] and peaks == costs["activations"]
              and all(h[k] == costs[k][i] for i, h in enumerate(held) for k in h))  # fmt: skip
        cells.append([label, str(ranks), " ".join(f"{s / steps / 1e3:.1f}" for s in sent),
                      " ".join(f"{p / 1e3:.1f}" for p in peaks)])  # fmt: skip
        checks.append(f"{'PASS' if ok else 'FAIL'}  grid {label}: bytes sent, held and peak activations == "
                      "Pipeline.costs() on every rank")  # fmt: skip
        print(f"  grid: {label} done", flush=True)
    part.table(["grid", "ranks", "KB sent per step, by rank", "peak KB activations, by rank"], cells, left=(0, 2, 3),
               wrap=(2, 3))  # fmt: skip
    return part, checks


# --- figures --------------------------------------------------------------------------------------------------------


def plot(sleep: dict, real: dict, tp_runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dtrain.parallel import schedules
    from dtrain.report import draw_timeline

    P = sleep["P"]
    fig, axes = plt.subplots(len(SCHEDULES), 2, figsize=(15, 2.6 * len(SCHEDULES)))
    for row, (name, V) in enumerate(SCHEDULES):
        run = next(r for r in sleep["results"] if r["schedule"] == name and r["M"] == 8)
        simulated = schedules.simulate(schedules.build(name, P, 8, V), 2.0, 4.0, V)  # per stage: 2 layers of 1 and 2
        title = f"{name}, P = {P}, M = 8: from the instruction lists (bubble {schedules.bubble(simulated):.3f})"
        draw_timeline(axes[row, 0], schedules.bars(simulated, P), title)
        bars = [(rank, op, micro, s, e, stage // P) for rank, line in enumerate(run["timeline"])
                for op, stage, micro, s, e in line]  # fmt: skip
        draw_timeline(axes[row, 1], bars, f"measured on 4 ranks, sleep-calibrated (bubble {run['bubble']:.3f})")
        axes[row, 0].set_xlabel("time (a layer's forward = 1)")
        axes[row, 1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "pipeline_timeline.png", dpi=100)
    plt.close(fig)

    fig, (ax_bubble, ax_tp) = plt.subplots(1, 2, figsize=(13, 4.2))
    for (name, V), colour in zip(SCHEDULES, ("C0", "C1", "C2")):
        runs = [r for r in sleep["results"] if r["schedule"] == name]
        label = name + (f" V={V}" if V > 1 else "")
        ax_bubble.plot(
            [r["M"] for r in runs], [r["bubble"] for r in runs], "o", color=colour, label=f"{label}, measured"
        )
        ms = range(1, max(r["M"] for r in runs) + 1)
        ax_bubble.plot(ms, [schedules.bubble_formula(P, m, V) for m in ms], "-", color=colour, alpha=0.5,
                       label=f"(P-1)/({'V' if V > 1 else ''}M+P-1)")  # fmt: skip
    for name in ("gpipe", "1f1b"):
        runs = [r for r in real["results"] if r["schedule"] == name]
        ax_bubble.plot([r["M"] for r in runs], [r["bubble"] for r in runs], "x", ms=9,
                       label=f"{name}, P = {real['P']}, real compute")  # fmt: skip
    ms = range(1, 17)
    ax_bubble.plot(
        ms, [schedules.bubble_formula(real["P"], m) for m in ms], ":", color="grey", label="(P-1)/(M+P-1), P=2"
    )
    ax_bubble.set(xlabel="micro-batches M", ylabel="bubble (idle fraction of a step)", xscale="log",
                  title=f"The bubble, P = {P} (sleep-calibrated) and P = 2")  # fmt: skip
    ax_bubble.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    ax_bubble.grid(alpha=0.3)
    ax_bubble.legend(fontsize=7)
    labels = list(tp_runs)
    held = [tp_runs[label][0]["held"][0]["parameters"] / MB for label in labels]
    ms_step = [statistics.median(r["step_ms"] for r in tp_runs[label]) for label in labels]
    share = [statistics.median(r["comm_share"] for r in tp_runs[label]) for label in labels]
    ax_tp.bar(range(len(labels)), ms_step, color="C0", label="ms per step")
    ax_tp.bar(range(len(labels)), [m * s for m, s in zip(ms_step, share)], color="C3", label="of it communicating")
    for i, h in enumerate(held):
        ax_tp.text(i, ms_step[i], f"{h:.1f} MB\nparams/rank", ha="center", va="bottom", fontsize=8)
    ax_tp.set_xticks(range(len(labels)), labels)
    ax_tp.set_ylim(0, 1.25 * max(ms_step))
    ax_tp.set(ylabel="ms per step (median over rounds)", title="Tensor parallelism, 784-2048-2048-10, batch 256")
    ax_tp.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "model_parallel.png", dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", default="2048,2048", help="tensor parallelism's model (default %(default)s)")
    add_round_flags(parser, steps=6, epochs=3, of="tp: ", quick="one round, fewer sizes: checks the script",
                    results="the results")  # fmt: skip
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="a layer's forward, sleep-calibrated")
    parser.add_argument("--pp-steps", type=int, default=3, help="pp: measured steps per schedule and M")
    parser.add_argument("--worker", choices=("sleep", "real"), help=argparse.SUPPRESS)  # (the mpiexec side)
    parser.add_argument("--microbatches", type=lambda t: [int(m) for m in t.split(",")], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.repeats, args.steps, args.epochs, args.pp_steps, args.sleep_ms = 1, 3, 2, 1, 10.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    me = str(Path(__file__).resolve())
    common = ["--out", str(out), "--pp-steps", str(args.pp_steps), "--sleep-ms", str(args.sleep_ms)]
    with tempfile.TemporaryDirectory() as scratch:
        tp_part, tp_checks, tp_runs = tensor_parallel(args, Path(scratch))
        print("  pp: sleep-calibrated, 4 ranks", flush=True)
        launch(4, [me, "--worker", "sleep", "--microbatches", "4,8" if args.quick else "1,4,8,16", *common])
        print("  pp: real compute, 2 ranks", flush=True)
        launch(2, [me, "--worker", "real", "--microbatches", "1,4,8", *common])
        sleep = json.loads((out / "pipeline_sleep.json").read_text())
        real = json.loads((out / "pipeline_real.json").read_text())
        grid_part, grid_checks = grids(args, Path(scratch))
    sleep_part, sleep_checks = pipeline_report(
        sleep,
        f"## 2. The bubble, sleep-calibrated: P = {sleep['P']}, 8 layers of {sleep['sizes'][0]} x "
        f"{sleep['sizes'][0]} (2 per stage), {args.sleep_ms:g} ms per layer forward, {2 * args.sleep_ms:g} ms "
        f"backward, micro-batches of {sleep['rows']}; the median of {args.pp_steps} step(s)",
    )
    real_part, real_checks = pipeline_report(
        real,
        f"## 3. The bubble with real compute: P = {real['P']} ranks on the 2 cores, 8 layers of 1024 x 1024 "
        f"(4 per stage), float32, micro-batches of {real['rows']}; the median of {args.pp_steps} step(s)",
    )
    command = "python scripts/bench_model_parallel.py" + (" --quick" if args.quick else "")
    checks = tp_checks + sleep_checks + real_checks + grid_checks
    record = Record()
    record.say(f"# {command}")
    for part in (tp_part, sleep_part, real_part, grid_part):
        record.add(part)
    record.say()
    for line in checks:
        record.say(line, hanging="      ")
    write_results(out, "model_parallel", {"command": command, "tp": tp_runs, "sleep": sleep, "real": real},
                  record.text())  # fmt: skip
    for name in ("pipeline_sleep.json", "pipeline_real.json"):
        (out / name).unlink()
    plot(sleep, real, tp_runs, out)
    print(f"and {out}/model_parallel.png, pipeline_timeline.png, pipeline_trace.json")
    exit_if_failed(checks)


if __name__ == "__main__":
    main()

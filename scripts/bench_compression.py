"""Gradient compression (``ddp --compress``) against ddp's ring all-reduce and local SGD: bytes, accuracy and time.

Every run trains through the CLI on 4 real ranks (``dtrain launch -n 4 -m dtrain train ...``, via
``bench_util.train_metrics``), so the times are those of real processes (4 ranks on this machine's cores). The
contenders: ``ddp ring`` (``--allreduce ring``: the baseline), ``fp16`` and ``bf16``, ``topk`` at ratios 0.1 and
0.01 (error feedback), ``powersgd`` at ranks 1, 2 and 4 (error feedback), and ``local-sgd H=8`` (``--sync-every 8
--allreduce ring``: average the weights every 8 steps) for comparison. Two workloads:

* ``digits``: the 64-64-64-10 MLP (``--hidden 64,64``), global batch 48, ``--epochs`` (10) epochs, each contender
  with ``--seeds`` (3) seeds (``--seed``), in an order that rotates from seed to seed: final test accuracy.
* ``mlp784``: the 784-512-512-10 MLP on synthetic data (``--features 784 --classes 10``), batch 256, 2 epochs of
  16 steps (32 steps in all), one seed, run ``--rounds`` (3) times for its time (rotated order; the same seed gives
  the same weights each round): bytes and time, and the test accuracy after those 32 steps.

Per contender, from each run's metrics.json:

* **bytes**: ``costs()["sent_per_step"]`` (the cost model's exact bytes per rank per step; the table shows the
  busiest rank's) and that as a multiple of ddp ring's ("0.5000x"); beside it the tracer's training bytes per step
  (``report.training_traffic``: the initial broadcast and the evaluation left out), which must equal costs() on
  every rank for ddp and every compressor (checked; printed PASS/FAIL). Local SGD's costs() is the average's share,
  1/H of it a step; a run whose steps are not a multiple of H ends with one more average, which the tracer counts
  (the epoch-end evaluation of the replicas' average is under "evaluation", left out).
* **accuracy**: the final test accuracy, mean over seeds, and its difference to ddp ring's mean, in points.
* **time here**: training time per step (``epochs[].train_time_s`` of epochs 2..E over their steps: epoch 1 warms
  up), the median over seeds (784 model: over rounds), and its speed against ddp ring's, in words (ddp ring's time
  over its time: "1.20x faster", "1.16x slower").
* **time on a slow link** (a prediction): the cost model's compute of one replica's step on this machine
  (``pricing.replica_compute`` on ``hardware.load("this")``: its calibrated compute rates and the slowdown of
  4 ranks sharing its cores), plus the tracer's bytes per step of the busiest rank / 125e6 B/s (1 Gbit/s), plus its
  messages per step x 50e-6 s; and its speed against ddp ring's, as above. Left out: the reduction's arithmetic,
  and the compressors' own compute (encoding, top-k selection, PowerSGD's products and QR), which only the measured
  time shows.

    python scripts/bench_compression.py            # docs/bench/compression.json: ~3 min on the 2-core VM
    python scripts/bench_compression.py --quick --json /tmp/c.json   # 3 epochs, 1 seed, 1 round: about 80 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_util import (
    exit_if_failed,
    faster,
    rotated,
    run_meta,
    samples_for,
    say,
    train_metrics,
    training_steps,
    write_json,
)

from dtrain import terminal
from dtrain.config import TrainConfig
from dtrain.parallel import pricing
from dtrain.parallel.data_parallel import DataParallel
from dtrain.plan import hardware
from dtrain.report import training_traffic

RANKS = 4
ALPHA, BANDWIDTH = 50e-6, 125e6  # the slow link: 50 us a message, 1 Gbit/s
DDP = "ddp ring"
CONTENDERS = {
    DDP: ["--paradigm", "ddp", "--allreduce", "ring"],
    "fp16": ["--paradigm", "ddp", "--compress", "fp16"],
    "bf16": ["--paradigm", "ddp", "--compress", "bf16"],
    "topk 0.1": ["--paradigm", "ddp", "--compress", "topk", "--compress-ratio", "0.1"],
    "topk 0.01": ["--paradigm", "ddp", "--compress", "topk", "--compress-ratio", "0.01"],
    "powersgd r=1": ["--paradigm", "ddp", "--compress", "powersgd", "--powersgd-rank", "1"],
    "powersgd r=2": ["--paradigm", "ddp", "--compress", "powersgd", "--powersgd-rank", "2"],
    "powersgd r=4": ["--paradigm", "ddp", "--compress", "powersgd", "--powersgd-rank", "4"],
    "local-sgd H=8": ["--paradigm", "local-sgd", "--sync-every", "8", "--allreduce", "ring"],
}
WORKLOADS = {  # name: (sizes, batch, data flags)
    "digits": ([64, 64, 64, 10], 48, ["--dataset", "digits"]),
    "mlp784": ([784, 512, 512, 10], 256, ["--dataset", "synthetic", "--features", "784", "--classes", "10"]),
}


def figures(metrics: dict) -> dict:
    """What one run measured: bytes and messages per step (tracer, per rank), costs(), accuracy, time per step."""
    steps = training_steps(metrics)
    per_epoch = steps // len(metrics["epochs"])
    timed = metrics["epochs"][1:] or metrics["epochs"]
    return {
        "steps": steps,
        "traced_bytes": training_traffic(metrics),  # the whole run, per rank
        "traced_messages": training_traffic(metrics, "messages_sent"),
        "costs_sent_per_step": metrics["costs"]["sent_per_step"],
        "test_accuracy": metrics["final"]["test_accuracy"],
        "step_s": sum(e["train_time_s"] for e in timed) / (per_epoch * len(timed)),
    }


def compute_seconds(workload: str) -> float:
    """The cost model's compute of one replica's step on this machine, 4 ranks (the same for every contender)."""
    sizes, batch, _ = WORKLOADS[workload]
    config = TrainConfig(paradigm="ddp", allreduce="ring", hidden=tuple(sizes[1:-1]), batch_size=batch)
    return pricing.replica_compute(DataParallel, sizes, RANKS, config, hardware.load("this"))


def summarise(runs: dict, workload: str) -> dict:
    """Per contender: the table's figures and the exact check."""
    compute = compute_seconds(workload)
    rows = {}
    for label, rs in runs.items():
        first = rs[0]
        costs = max(first["costs_sent_per_step"])
        traced = max(b / first["steps"] for b in first["traced_bytes"])
        messages = max(m / first["steps"] for m in first["traced_messages"])
        exact = all(r["traced_bytes"] == [c * r["steps"] for c in r["costs_sent_per_step"]] for r in rs)
        rows[label] = {
            "bytes_per_step": costs,
            "traced_bytes_per_step": traced,
            "messages_per_step": messages,
            "traced_equals_costs": exact,
            "accuracy_mean": statistics.mean(r["test_accuracy"] for r in rs),
            "accuracies": [r["test_accuracy"] for r in rs],
            "step_s_median": statistics.median(r["step_s"] for r in rs),
            "step_s": [r["step_s"] for r in rs],
            "slow_link": {"compute_s": compute, "bytes_s": traced / BANDWIDTH, "latency_s": messages * ALPHA},
        }
        rows[label]["slow_link_step_s"] = sum(rows[label]["slow_link"].values())
    base = rows[DDP]
    for row in rows.values():
        row["bytes_x_ddp"] = row["bytes_per_step"] / base["bytes_per_step"]
        row["accuracy_points_vs_ddp"] = 100 * (row["accuracy_mean"] - base["accuracy_mean"])
        row["step_x_ddp"] = row["step_s_median"] / base["step_s_median"]
        row["slow_link_x_ddp"] = row["slow_link_step_s"] / base["slow_link_step_s"]
    return rows


def table(rows: dict, workload: str, accuracy: bool, width="auto") -> str:
    """One workload's contenders as a table fitted to ``width`` (:mod:`dtrain.terminal`): bytes as multiples of ddp
    ring's, times as speeds against ddp ring's ("1.20x slower")."""
    sizes, batch, _ = WORKLOADS[workload]
    header = ["contender", "B/step", "B/step, x ddp", "traced B/step", "msgs per step"]
    header += ["acc %", "acc vs ddp, points"] if accuracy else []
    header += ["ms per step", "vs ddp", "slow link ms", "slow link vs ddp"]
    cells = []
    for label, r in rows.items():
        line = [label, f"{r['bytes_per_step']:,.0f}", f"{r['bytes_x_ddp']:.4f}x", f"{r['traced_bytes_per_step']:,.0f}",
                f"{r['messages_per_step']:.2f}"]  # fmt: skip
        if accuracy:
            line += [f"{100 * r['accuracy_mean']:.2f}", f"{r['accuracy_points_vs_ddp']:+.2f}"]
        mine = label == DDP
        line += [f"{1e3 * r['step_s_median']:.2f}", "-" if mine else faster(1 / r["step_x_ddp"]),
                 f"{1e3 * r['slow_link_step_s']:.2f}", "-" if mine else faster(1 / r["slow_link_x_ddp"])]  # fmt: skip
        cells.append(line)
    groups = (1, 5, 7, 9) if accuracy else (1, 5, 7)
    title = f"{workload}: {'-'.join(map(str, sizes))}, {RANKS} ranks, global batch {batch}"
    return terminal.paragraph(title, width=width) + "\n" + terminal.table(header, cells, groups=groups, width=width)


def targets(results: dict) -> list[str]:
    """The issue's targets, met or not, with the numbers."""
    d, m = results["digits"], results["mlp784"]
    lines = []

    def verdict(ok: bool, text: str) -> None:
        lines.append(f"{'met    ' if ok else 'NOT met'}  {text}")

    for half in ("fp16", "bf16"):
        r = d[half]
        verdict(r["bytes_x_ddp"] <= 0.5 + 1e-3 and abs(r["accuracy_points_vs_ddp"]) <= 0.5,
                f"{half}: {r['bytes_x_ddp']:.4f}x ddp's bytes (digits; 784 model {m[half]['bytes_x_ddp']:.4f}x), "
                f"accuracy {r['accuracy_points_vs_ddp']:+.2f} points (target 0.5x, within 0.5 points)")  # fmt: skip
    r = d["topk 0.01"]
    verdict(r["bytes_x_ddp"] <= 0.05 and abs(r["accuracy_points_vs_ddp"]) <= 1.5,
            f"topk 1%: {r['bytes_x_ddp']:.4f}x ddp's bytes (784 model {m['topk 0.01']['bytes_x_ddp']:.4f}x), "
            f"accuracy {r['accuracy_points_vs_ddp']:+.2f} points on digits (target <= 0.05x, within 1.5)")  # fmt: skip
    r = m["powersgd r=2"]
    verdict(r["bytes_x_ddp"] <= 0.05, f"powersgd r=2 on 784-512-512-10: {r['bytes_x_ddp']:.4f}x ddp's bytes "
            "(target <= 0.05x)")  # fmt: skip
    r = m["powersgd r=2"]
    verdict(abs(r["accuracy_points_vs_ddp"]) <= 1.5, f"powersgd r=2 accuracy on 784-512-512-10 after its 32 steps (one "
            f"seed): {r['accuracy_points_vs_ddp']:+.2f} points (target within 1.5)")  # fmt: skip
    r = d["powersgd r=2"]
    verdict(abs(r["accuracy_points_vs_ddp"]) <= 1.5, f"powersgd r=2 accuracy, measured on digits (64-64-64-10: "
            f"{r['bytes_x_ddp']:.4f}x ddp's bytes there): {r['accuracy_points_vs_ddp']:+.2f} points (target within "
            "1.5)")  # fmt: skip
    return lines


def report(header: list[str], results: dict, checks: list[str], width="auto") -> str:
    """What the run found, as text fitted to ``width``: the header, a table per workload, the checks, the targets."""
    lines = [terminal.paragraph(line, hanging="  ", width=width) for line in header]
    for workload in ("digits", "mlp784"):
        lines += ["", table(results[workload], workload, True, width)]
    lines += ["", *(terminal.paragraph(line, hanging="      ", width=width) for line in checks), ""]
    lines += [terminal.paragraph(line, hanging=" " * 9, width=width) for line in targets(results)]
    return "\n".join(lines)


def plot(results: dict, png) -> Path:
    """Accuracy against bytes per step on the digits (mean over seeds), every compressor beside ddp and local SGD,
    and the 784 model's bytes beside them: the figure docs/benchmarks.md shows."""
    from dtrain import report

    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ddp = 100 * results["digits"]["ddp ring"]["accuracy_mean"]
    ax.axhspan(ddp - 1.5, ddp + 1.5, color="0.93", label="within 1.5 points of ddp (top-k, PowerSGD targets)")
    ax.axhspan(ddp - 0.5, ddp + 0.5, color="0.85", label="within 0.5 points (fp16, bf16 target)")
    for i, (label, r) in enumerate(sorted(results["digits"].items(), key=lambda item: item[1]["bytes_per_step"])):
        kind = "local" if label.startswith("local") else "ddp" if label.startswith("ddp") else "compressed"
        style = {"ddp": ("k", "s"), "local": ("tab:green", "^"), "compressed": ("tab:blue", "o")}[kind]
        ax.scatter(r["bytes_per_step"], 100 * r["accuracy_mean"], color=style[0], marker=style[1], zorder=3)
        ax.annotate(label, (r["bytes_per_step"], 100 * r["accuracy_mean"]), fontsize=8, rotation=60,
                    xytext=(0, 6 if i % 2 else -40), textcoords="offset points", ha="center")  # fmt: skip
    ax.set_ylim(ddp - 2.5, ddp + 2.5)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes a rank sends per step (4 ranks, digits MLP 64-64-64-10)")
    ax.set_ylabel("final test accuracy, mean of the seeds (%)")
    ax.set_title("Sending fewer bytes: compression and local SGD against ddp's ring")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return Path(png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="digits: epochs (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=3, help="digits: seeds 1..S (default %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="784 model: steps per epoch (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="784 model: runs of each (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="3 epochs, 1 seed, 4 steps, 1 round: checks the script")
    parser.add_argument("--json", default="docs/bench/compression.json", help="where to write the numbers")
    parser.add_argument("--png", default="docs/bench/compression.png", help="the figure (accuracy against bytes)")
    parser.add_argument("--plot-only", metavar="JSON", help="draw the figure from an earlier run's JSON and stop")
    args = parser.parse_args()
    if args.plot_only:
        print(f"wrote {plot(json.loads(Path(args.plot_only).read_text())['results'], args.png)}")
        return
    if args.quick:
        args.epochs, args.seeds, args.steps, args.rounds = 3, 1, 4, 1

    raw = {"digits": {c: [] for c in CONTENDERS}, "mlp784": {c: [] for c in CONTENDERS}}
    plan = [("digits", seed, ["--epochs", str(args.epochs)]) for seed in range(1, args.seeds + 1)]
    plan += [("mlp784", 1, ["--epochs", "2", "--samples", str(samples_for(args.steps, 256))])] * args.rounds
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as scratch:
        for round_, (workload, seed, extra) in enumerate(plan):
            sizes, batch, data = WORKLOADS[workload]
            for label in rotated(list(CONTENDERS), round_):
                flags = [*CONTENDERS[label], *data, "--hidden", ",".join(map(str, sizes[1:-1])), "--batch-size",
                         str(batch), "--seed", str(seed), *extra]  # fmt: skip
                folder = Path(scratch) / f"{round_}-{workload}-{seed}-{label.replace(' ', '_')}"
                run = figures(train_metrics(RANKS, flags, folder))
                raw[workload][label].append(run)
                print(f"  {workload} seed {seed} {label:14s} acc {100 * run['test_accuracy']:6.2f}%  "
                      f"{1e3 * run['step_s']:7.2f} ms/step", flush=True)  # fmt: skip

    load.append(os.getloadavg())
    results = {w: summarise(runs, w) for w, runs in raw.items()}
    checks = [
        f"{'PASS' if r['traced_equals_costs'] else 'FAIL'}  {w} {label}: tracer's bytes per rank == steps x "
        "costs()['sent_per_step'] on every rank, every run"
        for w, rows in results.items()
        for label, r in rows.items()
        if not label.startswith("local-sgd")
    ]
    header = [
        f"# {RANKS} ranks under dtrain launch; digits: {args.epochs} epochs x {args.seeds} seed(s); 784 model: 2 "
        f"epochs of {args.steps} steps, 1 seed, {args.rounds} round(s). B/step = costs()['sent_per_step'] (busiest "
        "rank), traced = the tracer's, msgs = its messages per step; acc = mean final test accuracy, points = minus "
        "ddp ring's; ms per step measured here (median over seeds or rounds, epochs 2..E); vs ddp: the speed against "
        "ddp ring's (its time over this one's); slow link = cost-model compute on this machine + traced bytes / "
        f"{BANDWIDTH:g} B/s + msgs x {ALPHA:g} s",
    ]
    print(report(header, results, checks))
    say(f"load average (1, 5, 15 min) at the start {load[0]}, at the end {load[1]}", hanging="  ")
    meta = run_meta(ranks=RANKS, epochs=args.epochs, seeds=args.seeds, steps_784=args.steps, rounds_784=args.rounds,
                    load_average_start=load[0], load_average_end=load[1],
                    slow_link={"alpha_s": ALPHA, "bandwidth_B_per_s": BANDWIDTH})  # fmt: skip
    path = write_json(args.json, {"meta": meta, "results": results, "checks": checks, "targets": targets(results),
                                  "runs": raw})  # fmt: skip
    print(f"\nwrote {path}, {plot(results, args.png)}")
    exit_if_failed(checks)


if __name__ == "__main__":
    main()

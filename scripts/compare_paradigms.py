"""Every paradigm on one problem: digits, 4 ranks, the same seed, batch and epochs; accuracy against bytes and time.

The runs (each ``dtrain launch -n 4 -m dtrain train --paradigm ... --dataset digits --batch-size 96 --epochs 20``):
ddp (the baseline), local-sgd with H = 1, 4, 8, 16, post-local SGD (H = 8 after a warm-up of 2 epochs of ddp
steps), gossip on a ring and on an exponential graph, ZeRO stages 1, 2 and 3, ps-sync and ps-async (1 server + 3
workers: the same 4 processes, one fewer computing), and central storage. The global batch 96 divides among 4
ranks and among 3 workers, and its 14 steps per epoch make 280 steps, a multiple of every H, so no run pays an extra
final average.

For each: final test accuracy, wall time (``train()`` from start to end: data, model, training, evaluation; the
median of ``--repeats`` runs, interleaved; reductions by NumPy, see ``run_once``), and bytes per
rank from the tracer (metrics.json ``communication.per_rank``): the mean over ranks and the largest rank (a
parameter server's), training traffic only (local SGD's and gossip's per-epoch evaluation of the replicas' average
is counted under "evaluation" and shown apart), and the parameters, gradients and optimizer state the fullest rank
holds (the paradigm's cost function). Ratios are against ddp measured in the same run. Two figures:
accuracy against bytes per rank and accuracy against wall time (``docs/bench/compare_paradigms.png``).

    python scripts/compare_paradigms.py                    # writes docs/bench/compare_paradigms.{txt,json,png}
    python scripts/compare_paradigms.py --epochs 5 --repeats 1 --out /tmp/cmp     # quicker
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench_util import Record, faster, train_metrics, write_results

from dtrain import report

RUNS = {  # label: flags after --paradigm
    "ddp": ["--paradigm", "ddp"],
    "local-sgd H=1": ["--paradigm", "local-sgd", "--sync-every", "1"],
    "local-sgd H=4": ["--paradigm", "local-sgd", "--sync-every", "4"],
    "local-sgd H=8": ["--paradigm", "local-sgd", "--sync-every", "8"],
    "local-sgd H=16": ["--paradigm", "local-sgd", "--sync-every", "16"],
    "post-local H=8": ["--paradigm", "local-sgd", "--sync-every", "8", "--warmup-sync-steps", "WARMUP"],
    "gossip ring": ["--paradigm", "gossip", "--topology", "ring"],
    "gossip exponential": ["--paradigm", "gossip", "--topology", "exponential"],
    "zero stage 1": ["--paradigm", "zero", "--zero-stage", "1"],
    "zero stage 2": ["--paradigm", "zero", "--zero-stage", "2"],
    "zero stage 3": ["--paradigm", "zero", "--zero-stage", "3"],
    "ps-sync": ["--paradigm", "ps-sync"],
    "ps-async": ["--paradigm", "ps-async"],
    "central-storage": ["--paradigm", "central-storage"],
}


def run_once(flags: list[str], args, folder: Path) -> dict:
    """One training job; its metrics.json, read back."""
    common = ["--dataset", "digits", "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
              "--seed", str(args.seed)]  # fmt: skip
    # NumPy's reductions, not Numba's: a process's first large reduction would import Numba and load its compiled
    # loops (about 0.7 s here), which in jobs this short would be most of ddp's time and little of the others'.
    return train_metrics(args.ranks, [*common, *flags], folder, env={**os.environ, "DTRAIN_KERNELS": "numpy"})


def traffic(metrics: dict) -> tuple[float, int, float]:
    """(mean training bytes sent per rank, the largest rank's, mean evaluation bytes per rank). Not training: the
    "evaluation" label, and "checkpoint" (ZeRO-3 gathers the final model from its chunks); the initial broadcast of
    the weights is counted (``setup=True``)."""
    training = report.training_traffic(metrics, setup=True)
    evaluation = [mine["operations"].get("evaluation", {}).get("bytes_sent", 0)
                  for mine in metrics["communication"]["per_rank"]]  # fmt: skip
    return statistics.mean(training), max(training), statistics.mean(evaluation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="jobs per configuration, interleaved (median time)")
    parser.add_argument("--out", default="docs/bench", help="folder for compare_paradigms.{txt,json,png}")
    args = parser.parse_args()
    steps_per_epoch = 1438 // args.batch_size  # digits: 1,438 training samples
    warmup = str(2 * steps_per_epoch)

    results = {label: [] for label in RUNS}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for label, flags in RUNS.items():  # interleaved: a slow minute hits every configuration alike
                flags = [warmup if f == "WARMUP" else f for f in flags]
                metrics = run_once(flags, args, Path(scratch) / f"{repeat}-{label.replace(' ', '_')}")
                results[label].append(metrics)
                print(f"  {label:20s} repeat {repeat + 1}: {metrics['final']['test_accuracy']:.4f}, "
                      f"{metrics['wall_time_s']:.2f} s", flush=True)  # fmt: skip

    rows = {}
    for label, runs in results.items():
        first = runs[0]  # accuracy and bytes do not depend on the repeat for the deterministic paradigms
        mean_bytes, max_bytes, eval_bytes = traffic(first)
        rows[label] = {
            "accuracy": statistics.median(r["final"]["test_accuracy"] for r in runs),
            "accuracies": [r["final"]["test_accuracy"] for r in runs],
            "wall_s": statistics.median(r["wall_time_s"] for r in runs),
            "train_s": statistics.median(sum(e["train_time_s"] for e in r["epochs"]) for r in runs),
            "bytes_mean": mean_bytes,
            "bytes_max": max_bytes,
            "evaluation_bytes": eval_bytes,
            "state_bytes": max(report.state_bytes(first)[1]),  # the fullest rank's, from the cost function
            "steps": len(first["epochs"]) * steps_per_epoch,
        }
    base = rows["ddp"]
    command = f"python scripts/compare_paradigms.py --epochs {args.epochs} --repeats {args.repeats}"
    out = Record()
    out.say(f"# {command}")
    out.say(f"# digits, {args.ranks} ranks, global batch {args.batch_size}, {args.epochs} epochs, seed {args.seed}; "
            f"wall time: median of {args.repeats} interleaved jobs; vs ddp: the speed against ddp's (its wall time "
            "over this one's); bytes: training traffic from the tracer; DTRAIN_KERNELS=numpy",
            hanging="  ")  # fmt: skip
    out.say()
    out.table(*paradigm_table(rows), groups=(1, 3, 5))
    h8 = rows["local-sgd H=8"]
    ddp_steps = base["steps"] * statistics.mean(results["ddp"][0]["costs"]["sent_per_step"])  # mean over ranks
    broadcast = base["bytes_mean"] - ddp_steps  # the initial broadcast of rank 0's weights, mean over ranks
    limit = ddp_steps / 8 + broadcast
    out.say()
    out.say(
        f"local-sgd H=8 against ddp: {h8['bytes_mean'] / 1e6:.3f} MB per rank, limit 1/8 of ddp's steps plus the "
        f"initial broadcast = {limit / 1e6:.3f} MB ({'met' if h8['bytes_mean'] <= limit else 'NOT met'}); accuracy "
        f"{100 * (h8['accuracy'] - base['accuracy']):+.2f} points "
        f"({'within' if abs(h8['accuracy'] - base['accuracy']) <= 0.015 else 'NOT within'} 1.5 of ddp's)",
        hanging="  ",
    )
    write_results(args.out, "compare_paradigms", {"command": command, "rows": rows}, out.text())
    plot(rows, Path(args.out) / "compare_paradigms.png")
    print(f"and {args.out}/compare_paradigms.png")


def paradigm_table(rows: dict) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of the table: a row per paradigm, its accuracy, time and bytes beside ddp's."""
    base = rows["ddp"]
    header = ["paradigm", "test acc %", "vs ddp, points", "wall s", "vs ddp", "MB per rank", "MB, x ddp",
              "MB max", "eval MB", "state MB"]  # fmt: skip
    cells = [[label, f"{100 * r['accuracy']:.2f}", f"{100 * (r['accuracy'] - base['accuracy']):+.2f}",
              f"{r['wall_s']:.2f}", "-" if label == "ddp" else faster(base["wall_s"] / r["wall_s"]),
              f"{r['bytes_mean'] / 1e6:.2f}", f"{r['bytes_mean'] / base['bytes_mean']:.3f}x",
              f"{r['bytes_max'] / 1e6:.2f}", f"{r['evaluation_bytes'] / 1e6:.2f}", f"{r['state_bytes'] / 1e6:.3f}"]
             for label, r in rows.items()]  # fmt: skip
    return header, cells


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_bytes, by_time) = plt.subplots(1, 2, figsize=(13, 4.8))
    markers = "osD^v<>Xp*hHP8d"
    for (label, r), marker in zip(rows.items(), markers):
        for axis, x in ((by_bytes, r["bytes_mean"] / 1e6), (by_time, r["wall_s"])):
            axis.scatter(x, 100 * r["accuracy"], marker=marker, s=50, label=label, alpha=0.8)
    by_time.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("MB sent per rank (training, mean over ranks; log scale)")
    by_time.set_xlabel("wall time of the job (s, median)")
    for axis in (by_bytes, by_time):
        axis.set_ylabel("final test accuracy (%)")
        axis.grid(alpha=0.3)
    fig.suptitle("digits, 4 ranks, same seed, batch and epochs (one test image = 0.28 points)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

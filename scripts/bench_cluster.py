"""A cluster on this machine (``dtrain cluster``: nodes that are network namespaces, links shaped by tc): what dtrain
teaches about a slow link between nodes, measured instead of predicted.

The script makes its own cluster (``--name``, default ``bench``: ``--nodes`` 2 x ``--slots`` 2, ``--link`` 100mbit),
runs every job on it through ``dtrain launch -n N --hostfile HOSTFILE -m dtrain train ...`` and always takes it down
again (at the end, on an error, on Ctrl-C or SIGTERM). Every time is the training time the run itself recorded in
metrics.json (``epochs[].train_time_s``: the training loop, evaluation left out), never mpiexec's start-up. The runs
of each part go in rounds (``--repeats``), in an order that rotates from round to round.

* **Part A, ddp's all-reduce across the link**: the 784-512-512-10 MLP, global batch 256, synthetic data with 784
  features, SGD lr 0.05 without momentum, 2 epochs of ``--steps`` steps, with ``--allreduce ring`` (the flat ring:
  with 2 nodes, one of its hops crosses the link each way and carries 2(p-1)/p of the gradient), ``hierarchical``
  (a tree inside each node, a ring between the nodes' leaders: 2(m-1)/m of it across, m nodes) and ``mpi`` (MPI's
  own Allreduce, for reference). Samples/s of epoch 2 (epoch 1 warms up), the median over rounds; the speed of
  hierarchical against the ring ("1.45x faster", the median of the rounds' ratios); and the cost model's step for
  each: ``DataParallel.step_time`` on the cluster as ``dtrain plan --hostfile`` prices it (dtrain/plan/hostfile.py:
  this machine's calibrated compute, all the cluster's ranks sharing its cores, and between nodes the link's rate
  and the latency ``dtrain cluster up`` measured, cluster.json). Target: hierarchical >= 1.3x the ring's
  samples/s (the bytes across the link allow 1.5x).
* **Part B, time to accuracy on the same link**: digits, the 64-256-256-10 MLP, global batch 64, SGD lr 0.05 with
  momentum 0.9, ``--epochs`` epochs, a seed per round: ddp (``--allreduce ring``), local SGD (``--sync-every 8``,
  ring), ddp ``--compress topk --compress-ratio 0.01`` and ``--compress powersgd`` (rank 2). The time to
  ``--accuracy`` (0.96) test accuracy: the training time of the epochs up to the first whose test accuracy reaches
  it (metrics.json records each epoch's time and accuracy), the median over rounds, and its ratio to ddp's (the
  median of the rounds' ratios); beside it the cost model's: the steps those epochs took times the paradigm's
  ``step_time`` on the cluster, priced as in part A (which leaves out the compressors' own arithmetic). Target:
  top-k 1% and local SGD in <= 1/3 of ddp's time.

Raw results go to ``--out``/bench_cluster.json and .txt (docs/benchmarks.md, "A cluster on one machine", quotes
them). It needs root and ``ip``/``tc`` (``dtrain cluster up``); without, one line and exit status 2.

    python scripts/bench_cluster.py                    # ~2.5 min; docs/bench/cluster/bench_cluster.{json,txt}
    python scripts/bench_cluster.py --repeats 1 --parts A --out /tmp/cluster       # ring vs hierarchical, ~40 s
    python scripts/bench_cluster.py --link 1gbit --name bench2 --out /tmp/cluster1g
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_util import Record, faster, rotated, run_meta, samples_for, write_results

from dtrain import config as train_config
from dtrain import parallel, report
from dtrain.errors import UserError
from dtrain.launch import cluster as clusters
from dtrain.launch import mpiexec
from dtrain.layout import parameter_count
from dtrain.plan import hardware
from dtrain.plan import hostfile as hostfiles

# Part A: ddp's all-reduce on the 784-512-512-10 MLP
A_SIZES, A_BATCH = [784, 512, 512, 10], 256
A_FLAGS = {"paradigm": "ddp", "dataset": "synthetic", "features": 784, "classes": 10, "hidden": (512, 512),
           "batch_size": A_BATCH, "lr": 0.05, "momentum": 0.0, "epochs": 2}  # fmt: skip
A_ALGORITHMS = ("ring", "hierarchical", "mpi")
# Part B: digits, to an accuracy
B_HIDDEN, B_BATCH = (256, 256), 64
B_FLAGS = {"dataset": "digits", "hidden": B_HIDDEN, "batch_size": B_BATCH, "lr": 0.05, "momentum": 0.9}
DDP = "ddp"
B_RUNS = {
    DDP: {"paradigm": "ddp", "allreduce": "ring"},
    "local SGD H=8": {"paradigm": "local-sgd", "sync_every": 8, "allreduce": "ring"},
    "top-k 1%": {"paradigm": "ddp", "compress": "topk", "compress_ratio": 0.01},
    "PowerSGD r=2": {"paradigm": "ddp", "compress": "powersgd", "powersgd_rank": 2},
}
B_TARGETS = ("local SGD H=8", "top-k 1%")  # in <= 1/3 of ddp's time
A_TARGET, B_TARGET = 1.3, 3.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="bench", help="the cluster's name (default %(default)s)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (default %(default)s)")
    parser.add_argument("--slots", type=int, default=2, help="ranks a node (default %(default)s)")
    parser.add_argument("--link", default="100mbit", help="each node's link, as tc spells a rate (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each part (default %(default)s)")
    parser.add_argument("--parts", default="A,B", help="which parts: A, B or A,B (default %(default)s)")
    parser.add_argument("--steps", type=int, default=12, help="A: steps an epoch (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=8, help="B: epochs of each run (default %(default)s)")
    parser.add_argument("--accuracy", type=float, default=0.96, help="B: the test accuracy (default %(default)s)")
    parser.add_argument("--out", default="docs/bench/cluster", help="folder for bench_cluster.{json,txt}")
    args = parser.parse_args()
    parts = {part.strip().upper() for part in args.parts.split(",") if part.strip()}
    bad = [(not parts or parts - {"A", "B"}, f"--parts {args.parts!r}: A, B or A,B"),
           (args.repeats < 1 or args.steps < 1 or args.epochs < 1, "--repeats, --steps and --epochs must be >= 1"),
           (not 0 < args.accuracy < 1, f"--accuracy {args.accuracy}: a fraction, such as 0.96"),
           (args.nodes < 2, f"--nodes {args.nodes}: a link between nodes needs 2 or more")]  # fmt: skip
    if any(flag for flag, _ in bad):
        parser.exit(2, f"{parser.prog}: error: {'; '.join(why for flag, why in bad if flag)}\n")
    why = clusters.missing(f"{parser.prog} (it makes a cluster)")
    if why is not None:
        parser.exit(2, f"{parser.prog}: error: {why}\n")

    signal.signal(signal.SIGTERM, _interrupted)  # (SIGINT already raises KeyboardInterrupt: the finally below runs)
    started, load = time.perf_counter(), os.getloadavg()
    try:
        cluster = clusters.up(args.name, args.nodes, args.slots, args.link)
    except UserError as exc:  # (nothing made, or the half made removed again: and a cluster of that name not ours)
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    try:
        out, results = run(args, cluster, sorted(parts), load)
    except KeyboardInterrupt:
        clusters.down(cluster.name)
        parser.exit(130, f"{parser.prog}: interrupted; cluster {cluster.name} taken down\n")
    finally:
        clusters.down(cluster.name)  # (on an error too; again after an interrupt: nothing left, nothing done)
    out.say(f"(total {time.perf_counter() - started:.0f} s; cluster {cluster.name} taken down)")
    meta = run_meta(cluster=dataclasses.asdict(cluster), load_before=load, load_after=os.getloadavg())
    write_results(args.out, "bench_cluster", {"meta": meta, **results}, out.text())


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args, cluster: clusters.Cluster, parts: list[str], load) -> tuple[Record, dict]:
    out = Record()
    world = cluster.nodes * cluster.slots
    out.say(f"cluster {cluster.name}: {cluster.nodes} nodes x {cluster.slots} ranks, link {cluster.link or 'unshaped'} "
            f"each way; measured node 1 -> node 2: {cluster.latency_us:.0f} us one way, a TCP stream at "
            f"{cluster.measured_bits_s / 1e6:.1f} Mbit/s", hanging="  ")  # fmt: skip
    out.say(f"command: python {' '.join(sys.argv)}; load average before: {load[0]:.2f}", hanging="  ")
    machine = cluster_hardware(cluster)
    results = {"world": world}
    if "A" in parts:
        results["A"] = part_a(args, cluster, machine, out)
    if "B" in parts:
        results["B"] = part_b(args, cluster, machine, out)
    out.say()
    out.say("targets:")
    for line in verdicts(results):
        out.say(line, "  ", "    ")
    return out, results


def cluster_hardware(cluster: clusters.Cluster) -> hardware.Hardware:
    """The cluster as ``dtrain plan --hostfile HOSTFILE`` prices it (:mod:`dtrain.plan.hostfile`): this machine's
    calibrated compute and links, with every rank of the cluster busy on its cores, and between nodes the link: its
    rate and the latency measured at up, one link a node shared by the flows that cross it."""
    return hostfiles.machine(hardware.Hardware.this(), hostfiles.read(cluster.hostfile))


def predicted_step(fields: dict, sizes: list[int], world: int, machine: hardware.Hardware) -> float:
    """Seconds of a step of ``fields`` (TrainConfig's) in the paradigm's own cost function, on ``machine``."""
    cfg = train_config.TrainConfig(**fields)
    return sum(parallel.get(cfg.paradigm).step_time(sizes, world, cfg, machine).values())


def train(cluster: clusters.Cluster, fields: dict, folder: Path) -> dict:
    """One ``dtrain launch -n N --hostfile HOSTFILE -m dtrain train FLAGS`` on the cluster: its metrics.json."""
    words = [*train_config.flag_words(fields), "--no-progress", "--quiet", "--out", str(folder)]
    command = [sys.executable, "-m", "dtrain", "launch", "-n", str(cluster.nodes * cluster.slots),
               "--hostfile", str(cluster.hostfile), "-m", "dtrain", "train", *words]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(mpiexec.A_RANKS_OWN)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"\n{done.stderr[-3000:]}")  # fmt: skip
    return json.loads((folder / "metrics.json").read_text())


# === part A


def across(algorithm: str, nbytes: int, cluster: clusters.Cluster) -> float | None:
    """Bytes each way across one node's link per all-reduce of ``nbytes`` (the algorithm's formula; None: MPI's, not
    known). The ring: ranks fill nodes in order, so one hop leaves each node, carrying 2(p-1)/p of the buffer; the
    hierarchical: only the leaders' ring crosses, 2(m-1)/m of it for m nodes."""
    p, m = cluster.nodes * cluster.slots, cluster.nodes
    return {"ring": 2 * (p - 1) / p * nbytes, "hierarchical": 2 * (m - 1) / m * nbytes}.get(algorithm)


def part_a(args, cluster, machine, out: Record) -> dict:
    world = cluster.nodes * cluster.slots
    samples = samples_for(args.steps, A_BATCH)
    out.say()
    out.say(f"## A. ddp's all-reduce across the link: MLP {'-'.join(map(str, A_SIZES))}, global batch {A_BATCH}, "
            f"synthetic, 2 epochs of {args.steps} steps (epoch 2 timed), {args.repeats} round(s)",
            hanging="  ")  # fmt: skip
    runs = {a: [] for a in A_ALGORITHMS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for algorithm in rotated(list(A_ALGORITHMS), repeat):
                fields = {**A_FLAGS, "allreduce": algorithm, "samples": samples}
                metrics = train(cluster, fields, Path(tmp) / f"{algorithm}-{repeat}")
                last = metrics["epochs"][-1]
                ran = metrics["communication"]["per_rank"][0]["paradigm"]["allreduce"]
                runs[algorithm].append({"samples_per_s": last["samples_per_s"], "train_time_s": last["train_time_s"],
                                        "epochs": metrics["epochs"], "ran": ran,
                                        "sent_per_step": metrics["costs"]["sent_per_step"]})  # fmt: skip
            out.say(f"round {repeat + 1}: " + ", ".join(f"{a} {runs[a][-1]['samples_per_s']:,.0f}" for a in runs)
                    + " samples/s", "  ", "    ")  # fmt: skip
    nbytes = 4 * parameter_count(A_SIZES)
    summary, cells = {}, []
    for algorithm, rounds in runs.items():
        speed = statistics.median(r["samples_per_s"] for r in rounds)
        model = predicted_step({**A_FLAGS, "allreduce": algorithm}, A_SIZES, world, machine)
        ratio = statistics.median(a["samples_per_s"] / b["samples_per_s"] for a, b in zip(rounds, runs["ring"]))
        link = across(algorithm, nbytes, cluster)
        summary[algorithm] = {"samples_per_s": [r["samples_per_s"] for r in rounds], "median_samples_per_s": speed,
                              "step_s": A_BATCH / speed, "model_step_s": model, "over_ring": ratio,
                              "across_link_bytes": link, "ran": rounds[0]["ran"],
                              "sent_per_step": rounds[0]["sent_per_step"]}  # fmt: skip
        cells.append([algorithm, f"{1e3 * A_BATCH / speed:.0f}", f"{1e3 * model:.0f}", f"{speed:,.0f}",
                      "(baseline)" if algorithm == "ring" else faster(ratio),
                      "-" if link is None else f"{link / 1e6:.2f}"])  # fmt: skip
    out.table(["all-reduce", "step ms", "model ms", "samples/s", "vs ring", "MB across"], cells, left=(0, 4))
    hier = summary["hierarchical"]
    predicted = summary["ring"]["model_step_s"] / hier["model_step_s"]
    out.say(f"hierarchical: {faster(hier['over_ring'], 'the ring')} (median of the rounds' ratios); the cost model: "
            f"{faster(predicted, 'the ring')}; the bytes across the link: "
            f"{summary['ring']['across_link_bytes'] / hier['across_link_bytes']:.2f}x fewer", hanging="  ")  # fmt: skip
    out.say("(step ms: global batch / median samples/s of epoch 2; model ms: DataParallel.step_time on the cluster's "
            "links, as dtrain plan --hostfile prices them; MB across: each way across a node's link per step, by the "
            "algorithm's formula; mpi: MPI's own Allreduce, its algorithm MPI's choice, priced by the planner as the "
            "best of doubling, Rabenseifner, ring and hierarchical on the cluster)", hanging="  ")  # fmt: skip
    return {"flags": {**A_FLAGS, "samples": samples}, "gradient_bytes": nbytes, "algorithms": summary,
            "hierarchical_over_ring": hier["over_ring"], "model_hierarchical_over_ring": predicted,
            "target": A_TARGET}  # fmt: skip


# === part B


def in_seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def part_b(args, cluster, machine, out: Record) -> dict:
    from dtrain.data import load_dataset, steps_per_epoch

    world = cluster.nodes * cluster.slots
    digits = load_dataset("digits")
    sizes = [digits.n_features, *B_HIDDEN, digits.n_classes]
    per_epoch = steps_per_epoch(len(digits.y_train), B_BATCH)
    out.say()
    out.say(f"## B. time to {100 * args.accuracy:g}% test accuracy on digits: MLP {'-'.join(map(str, sizes))}, "
            f"global batch {B_BATCH} ({per_epoch} steps an epoch), SGD lr {B_FLAGS['lr']} momentum "
            f"{B_FLAGS['momentum']}, {args.epochs} epochs, {args.repeats} round(s) (seed = round)",
            hanging="  ")  # fmt: skip
    runs = {label: [] for label in B_RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for label in rotated(list(B_RUNS), repeat):
                fields = {**B_FLAGS, **B_RUNS[label], "epochs": args.epochs, "seed": repeat}
                metrics = train(cluster, fields, Path(tmp) / f"{len(runs[label])}-{label.replace(' ', '_')}")
                epoch, seconds = report.time_to_accuracy(metrics, args.accuracy)
                later = metrics["epochs"][1:] or metrics["epochs"]
                runs[label].append({"epoch": epoch, "seconds": seconds, "seed": repeat,
                                    "step_s": sum(e["train_time_s"] for e in later) / (len(later) * per_epoch),
                                    "accuracy": [e["test_accuracy"] for e in metrics["epochs"]],
                                    "train_time_s": [e["train_time_s"] for e in metrics["epochs"]],
                                    "final_accuracy": metrics["final"]["test_accuracy"]})  # fmt: skip
            out.say(f"round {repeat + 1}, to {100 * args.accuracy:g}%: " + ", ".join(
                f"{label} {in_seconds(r[-1]['seconds'])}" for label, r in runs.items()), "  ", "    ")  # fmt: skip
    summary, cells, never = {}, [], []
    for label, rounds in runs.items():
        model_step = predicted_step({**B_FLAGS, **B_RUNS[label]}, sizes, world, machine)
        got = [r for r in rounds if r["seconds"] is not None]
        if len(got) < len(rounds):
            never.append(f"{label} ({len(rounds) - len(got)} of {len(rounds)} rounds)")
        entry = {"rounds": rounds, "model_step_s": model_step, "step_s": statistics.median(r["step_s"] for r in rounds)}
        if got:
            entry["seconds"] = statistics.median(r["seconds"] for r in got)
            entry["epochs"] = statistics.median(r["epoch"] for r in got)
            entry["model_seconds"] = statistics.median(r["epoch"] * per_epoch * model_step for r in got)
            pairs = [(r["seconds"], d["seconds"]) for r, d in zip(rounds, runs[DDP])
                     if r["seconds"] is not None and d["seconds"] is not None]  # fmt: skip
            entry["over_ddp"] = statistics.median(d / s for s, d in pairs) if pairs else None
        summary[label] = entry
        cells.append([label, f"{entry.get('epochs', 0):g}" if got else "never",
                      f"{entry['seconds']:.2f}" if got else "-", f"{entry['model_seconds']:.2f}" if got else "-",
                      "(baseline)" if label == DDP else faster(entry.get("over_ddp")),
                      f"{1e3 * entry['step_s']:.1f}", f"{1e3 * model_step:.1f}"])  # fmt: skip
    out.table(["run", "epochs", "seconds", "model s", "vs ddp", "step ms", "model ms"], cells, left=(0, 4))
    out.say(f"(epochs: to {100 * args.accuracy:g}%, median over rounds; seconds: the training time of those epochs "
            "(metrics.json, evaluation left out), median; model s: those epochs' steps x the model's step; vs ddp: "
            "median of the rounds' ratios; step ms: training time a step, epochs 2 on; final test accuracy, median: "
            + ", ".join(f"{label} {100 * statistics.median(r['final_accuracy'] for r in rounds):.1f}%"
                        for label, rounds in runs.items()) + ")", hanging="  ")  # fmt: skip
    if never:
        out.say(f"never reached {100 * args.accuracy:g}% within {args.epochs} epochs: {', '.join(never)}",
                hanging="  ")  # fmt: skip
    return {"flags": B_FLAGS, "sizes": sizes, "steps_per_epoch": per_epoch, "epochs": args.epochs,
            "accuracy": args.accuracy, "runs": summary, "never": never, "target": 1 / B_TARGET}  # fmt: skip


def verdicts(results: dict) -> list[str]:
    lines = []
    if "A" in results:
        ratio = results["A"]["hierarchical_over_ring"]
        ok = "met" if ratio >= A_TARGET else "MISSED"
        lines.append(f"A: hierarchical {faster(ratio, 'the ring')}, target {A_TARGET}x or more: {ok}")
    if "B" in results:
        for label in B_TARGETS:
            ratio = results["B"]["runs"][label].get("over_ddp")
            ok = "met" if ratio and ratio >= B_TARGET else "MISSED"
            said = "never reached the accuracy" if ratio is None else f"{faster(ratio, 'ddp')}"
            lines.append(f"B: {label} {said} to the accuracy, target 1/{B_TARGET:g} of ddp's time or less: {ok}")
    return lines


if __name__ == "__main__":
    main()

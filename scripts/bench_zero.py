"""ZeRO stages 1-3 against ddp: the bytes each rank holds and sends per step, measured against the formulas, and time.

Every contender trains through the CLI (``dtrain launch -n N -m dtrain train ...``) on models whose training state
is large enough to matter: 784-2048-2048-10 (n = 5,824,522 parameters, 23.3 MB in float32; its largest layer is 72%
of it) and 784-1024x6-10 (n = 6,062,090, 24.2 MB; six layers of about 1 M parameters, the largest 17%), on
synthetic data, global batch 256, float32, with SGD (momentum 0.9: one optimizer buffer) and with Adam (two). The
contenders: ``ddp`` (``--allreduce ring --bucket-mb 0``: one ring all-reduce of the whole gradient after backward)
and ``zero`` stages 1, 2 and 3 (``--allreduce ring``: ring reduce-scatter and ring all-gather), on N = 2 and 4 ranks.

From each run's metrics.json:

* **held**: each rank's peak bytes of parameters, gradients and optimizer state, counted by zero's ledger as it
  gathers and frees (``communication.per_rank[r].paradigm.held_bytes``; not the process's RSS). ddp has no ledger: a
  replica holds everything all the time, which its cost function states. Checked per rank, exactly, against
  ``costs`` (``Zero.costs``), and set beside the ZeRO paper's formula adapted to one precision and k buffers
  (``paper_formula``; it leaves out the layer in flight) and the paper's own mixed-precision Adam numbers.
* **sent**: each rank's training traffic from the tracer (labels ``zero/...`` or ``allreduce/...``; the initial
  broadcast, evaluation and the final gather are other labels), divided by the steps; checked per rank, exactly,
  against ``costs["sent_per_step"]``.
* **time**: the samples/s of the last epoch (the first pays start-up). Each round runs every contender of an (N,
  optimizer) once, in an order that rotates from round to round; the speed against ddp is the median over rounds of that
  round's ratio, so a slow minute on the shared machine hits both sides.

Any check that fails is printed as FAIL and the script exits non-zero.

    python scripts/bench_zero.py                       # docs/bench/zero.{txt,json,png}: ~8 min on the 2-core VM
    python scripts/bench_zero.py --quick --out /tmp/z  # one round, N = 2: under a minute
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from pathlib import Path

from bench_util import (
    Record,
    add_round_flags,
    exit_if_failed,
    faster,
    faster_range,
    rotated,
    samples_for,
    sent_per_rank,
    train_metrics,
    training_steps,
    write_results,
)

from dtrain.parallel import parameter_count
from dtrain.parallel.zero import paper_formula

CONTENDERS = {  # label: (zero stage, 0 for ddp; flags)
    "ddp": (0, ["--paradigm", "ddp", "--allreduce", "ring", "--bucket-mb", "0"]),
    "zero 1": (1, ["--paradigm", "zero", "--zero-stage", "1", "--allreduce", "ring"]),
    "zero 2": (2, ["--paradigm", "zero", "--zero-stage", "2", "--allreduce", "ring"]),
    "zero 3": (3, ["--paradigm", "zero", "--zero-stage", "3", "--allreduce", "ring"]),
}
OPTIMIZERS = {"sgd": (1, ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01"]),
              "adam": (2, ["--optimizer", "adam", "--lr", "0.001"])}  # fmt: skip
MODELS = {  # hidden widths: the wide model, and a deep one whose layers are each a small part of it
    "2048,2048": "two wide layers: the largest is 72% of the model",
    "1024,1024,1024,1024,1024,1024": "six layers of about 1 M parameters: the largest is 17% of the model",
}
KINDS = ("parameters", "gradients", "optimizer")
MB = 1e6


def run_once(args, hidden: str, n_ranks: int, contender: str, optimizer: str, folder: Path) -> dict:
    """One training job; its metrics.json, read back."""
    flags = [*CONTENDERS[contender][1], *OPTIMIZERS[optimizer][1], "--dataset", "synthetic", "--features", "784",
             "--samples", str(args.samples), "--hidden", hidden, "--batch-size", str(args.batch_size),
             "--epochs", str(args.epochs)]  # fmt: skip
    return train_metrics(n_ranks, flags, folder)


def per_rank(costs: dict, kind: str, world: int) -> list:
    value = costs[kind]
    return value if isinstance(value, list) else [value] * world


def figures(metrics: dict, stage: int) -> dict:
    """What one run measured, per rank, and what its cost function says."""
    world, costs, steps = metrics["world_size"], metrics["costs"], training_steps(metrics)
    sent = sent_per_rank(metrics, "zero/" if stage else "allreduce/")
    if stage:
        held = metrics["communication"]["per_rank"][0]["paradigm"]["held_bytes"]  # the ledger's peaks, by rank
    else:  # a ddp replica holds all of it, all the time: its cost function (no ledger to read)
        held = [{kind: per_rank(costs, kind, world)[r] for kind in KINDS} for r in range(world)]
    return {
        "steps": steps,
        "sent": sent,
        "sent_formula": [s * steps for s in costs["sent_per_step"]],
        "held": held,
        "held_formula": [{kind: per_rank(costs, kind, world)[r] for kind in KINDS} for r in range(world)],
        "samples_per_s": metrics["epochs"][-1]["samples_per_s"],
    }


def check(results: dict, n: int, layers: list[int]) -> list[str]:
    """Every exact check of one (N, optimizer): bytes sent and held per rank against the formulas, stage 3's bound."""
    lines = []
    for contender, runs in results.items():
        stage, first = CONTENDERS[contender][0], runs[0]
        world = len(first["sent"])
        sent_ok = all(r["sent"] == r["sent_formula"] for r in runs)
        lines.append(f"{'PASS' if sent_ok else 'FAIL'}  {contender}: bytes sent per rank == steps x costs()"
                     f"['sent_per_step'] on every rank, every round")  # fmt: skip
        if stage:
            held_ok = all(r["held"] == r["held_formula"] for r in runs)
            lines.append(f"{'PASS' if held_ok else 'FAIL'}  {contender}: the ledger's peak bytes held == costs() for "
                         "parameters, gradients and optimizer state on every rank")  # fmt: skip
        if stage == 3:
            bound = (n / world + max(layers) + len(layers)) * 4  # 1/N, one layer, one element per layer's chunk
            peak = max(h["parameters"] for r in runs for h in r["held"])
            lines.append(f"{'PASS' if peak <= bound else 'FAIL'}  zero 3: peak parameter bytes {peak:,} <= "
                         f"(n/N + largest layer) = {bound:,.0f}")  # fmt: skip
    return lines


def report(all_results: dict) -> tuple[Record, list[str]]:
    """The tables (a Record, not printed yet) and the checks."""
    part, checks = Record(echo=False), []
    header = ["contender", "params MB", "grads MB", "optim MB", "total MB", "formula MB", "paper MB",
              "held, x ddp", "sent MB per step", "formula MB per step", "sent, x ddp", "samples/s", "vs ddp",
              "vs ddp, range"]  # fmt: skip
    for (hidden, world, optimizer), results in all_results.items():
        sizes = model_sizes(hidden)
        n = parameter_count(sizes)
        layers = [a * b + b for a, b in itertools.pairwise(sizes)]
        k = OPTIMIZERS[optimizer][0]
        base = results["ddp"]
        base_held = sum(base[0]["held"][0].values())
        base_sent = max(base[0]["sent"]) / base[0]["steps"]
        part.say()
        part.say(f"N = {world}, {optimizer} (k = {k} optimizer buffer{'s' if k > 1 else ''}), "
                 f"{'-'.join(map(str, sizes))}, n = {n:,} parameters ({4 * n / MB:.2f} MB in float32), "
                 f"largest layer {max(layers):,} ({4 * max(layers) / MB:.2f} MB)", hanging="  ")  # fmt: skip
        part.say("MB held per rank (the fullest rank; measured = the ledger's peaks, ddp: its cost function); vs ddp: "
                 "the speed against ddp's (samples/s, the median over rounds of each round's ratio, and the range)",
                 hanging="  ")  # fmt: skip
        cells = []
        for contender, runs in results.items():
            stage, first = CONTENDERS[contender][0], runs[0]
            fullest = max(range(world), key=lambda r: sum(first["held"][r].values()))
            held = first["held"][fullest]
            formula = sum(first["held_formula"][fullest].values())
            paper = sum(paper_formula(n, world, stage, 4, k).values())
            sent = max(first["sent"]) / first["steps"]
            sent_formula = max(first["sent_formula"]) / first["steps"]
            ratios = [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(runs, base)]
            mine = contender == "ddp"
            cells.append([contender, *(f"{held[kind] / MB:.2f}" for kind in KINDS), f"{sum(held.values()) / MB:.2f}",
                          f"{formula / MB:.2f}", f"{paper / MB:.2f}", f"{sum(held.values()) / base_held:.3f}x",
                          f"{sent / MB:.3f}", f"{sent_formula / MB:.3f}", f"{sent / base_sent:.3f}x",
                          f"{statistics.median(r['samples_per_s'] for r in runs):,.0f}",
                          "-" if mine else faster(statistics.median(ratios)),
                          "-" if mine else faster_range(min(ratios), max(ratios))])  # fmt: skip
        part.table(header, cells, groups=(1, 8, 11))
        psi = n  # the paper's mixed-precision Adam (K = 12) for the same model, for scale
        paper_mp = {"ddp": 16 * psi, "zero 1": 4 * psi + 12 * psi / world, "zero 2": 2 * psi + 14 * psi / world,
                    "zero 3": 16 * psi / world}  # fmt: skip
        part.say(
            "the paper's own mixed-precision Adam for this model (fp16 weights and gradients, fp32 master copy and "
            "moments): " + ", ".join(f"{c} {v / MB:.1f} MB" for c, v in paper_mp.items()),
            hanging="  ",
        )
        where = f"{'-'.join(map(str, sizes))}, N = {world}, {optimizer}"
        checks += [f"{line[:4]}  {where}: {line[6:]}" for line in check(results, n, layers)]
    return part, checks


def plot(all_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((h, o) for h, _, o in all_results))
    rows = 2 if len(panels) > 2 else 1
    cols = -(-len(panels) // rows)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    colours = {"parameters": "C0", "gradients": "C1", "optimizer": "C2"}
    for ax, (hidden, optimizer) in zip(axes.flat, panels):
        labels, positions, x = [], [], 0.0
        for (h, world, opt), results in all_results.items():
            if (h, opt) != (hidden, optimizer):
                continue
            for contender, runs in results.items():
                held = max(runs[0]["held"], key=lambda h: sum(h.values()))
                bottom = 0.0
                for kind in KINDS:
                    ax.bar(x, held[kind] / MB, bottom=bottom, color=colours[kind], label=kind if not labels else None)
                    bottom += held[kind] / MB
                labels.append(f"{contender}\nN={world}")
                positions.append(x)
                x += 1
            x += 0.5  # a gap between rank counts
        ax.set_xticks(positions)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("MB held per rank (the fullest rank, at its peak)")
        ax.set_title(f"{'-'.join(map(str, model_sizes(hidden)))}, float32, {optimizer}", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def model_sizes(hidden: str) -> list[int]:
    return [784, *map(int, hidden.split(",")), 10]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default %(default)s)")
    parser.add_argument("--optimizers", default="sgd,adam", help="sgd (momentum 0.9) and/or adam")
    parser.add_argument("--models", nargs="+", default=list(MODELS), metavar="HIDDEN",
                        help="hidden widths of each model, e.g. 2048,2048 (default: %(default)s)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=256, help="global batch (default %(default)s)")
    add_round_flags(parser, steps=6, epochs=2, quick="N = 2, one round: checks the script in a minute",
                    results="zero.{txt,json,png}")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.repeats = "2", 1
    ranks = [int(r) for r in args.ranks.split(",")]
    optimizers = args.optimizers.split(",")
    if any(o not in OPTIMIZERS for o in optimizers) or min(ranks) < 1 or args.batch_size % max(ranks):
        raise SystemExit(f"bad arguments: --optimizers from {list(OPTIMIZERS)}, ranks >= 1 dividing --batch-size")
    args.samples = samples_for(args.steps, args.batch_size)

    all_results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for hidden, world, optimizer in itertools.product(args.models, ranks, optimizers):
            results = {c: [] for c in CONTENDERS}
            for repeat in range(args.repeats):
                for contender in rotated(list(CONTENDERS), repeat):
                    folder = Path(scratch) / f"{hidden}-{world}-{optimizer}-{contender.replace(' ', '')}-{repeat}"
                    metrics = run_once(args, hidden, world, contender, optimizer, folder)
                    results[contender].append(figures(metrics, CONTENDERS[contender][0]))
                    print(f"  {hidden} N={world} {optimizer:4s} {contender:7s} round {repeat + 1}: "
                          f"{results[contender][-1]['samples_per_s']:,.0f} samples/s", flush=True)  # fmt: skip
            all_results[hidden, world, optimizer] = results

    command = "python scripts/bench_zero.py" + (" --quick" if args.quick else f" --repeats {args.repeats}")
    part, checks = report(all_results)
    out = Record()
    out.say(f"# {command}")
    out.say(f"# float32, synthetic data (784 features), global batch {args.batch_size}, {args.epochs} epochs of "
            f"{args.steps} steps (the last timed), ring reduce-scatter/all-gather (zero) and ring all-reduce (ddp, one "
            f"bucket); {args.repeats} interleaved round(s); 'formula' = costs(), 'paper' = the ZeRO paper's per-stage "
            "formula in dtrain's terms (one precision, no master copy; no layer in flight)", hanging="  ")  # fmt: skip
    out.add(part)
    out.say()
    for line in checks:
        out.say(line, hanging="      ")
    raw = {f"{h} N={w} {o}": results for (h, w, o), results in all_results.items()}
    write_results(args.out, "zero", {"command": command, "results": raw}, out.text())
    plot(all_results, Path(args.out) / "zero.png")
    print(f"and {args.out}/zero.png")
    exit_if_failed(checks)


if __name__ == "__main__":
    main()

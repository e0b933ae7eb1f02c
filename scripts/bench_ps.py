"""Parameter servers: ps-sync, ps-async, stale-synchronous (K = 2) and ddp, with and without a straggler.

Every contender trains through the CLI (``dtrain launch -n N -m dtrain train ...``), so what is measured is what a
user gets: data pipeline, driver, tracer and watchdog included. The parameter-server contenders run on 4 ranks, 1
server (rank 3) and 3 workers (ranks 0-2); ``ddp`` on the same 3 computing ranks with no server (``--ddp-ranks``:
a server computes no gradient, so 3 ranks is the same compute; 4 would give ddp a fourth worker). The straggler is
``--slow-rank 0 --slow-factor 3``: rank 0 sleeps twice its own compute time after each backward, in every
paradigm (rank 0 is a worker everywhere, and it is the rank that times the epochs: its train time then contains
the straggler's last step of each epoch, which in ps-async a fast rank 0's timer would miss).

Two workloads, because the straggler matters only when computing dominates a step:

* ``compute``: ``--dataset synthetic --samples 24000 --batch-size 1500 --hidden 256`` (a 784-256-10 MLP, 0.8 MB of
  parameters, 500 samples per worker per step): forward and backward dominate the step. Throughput, with and without
  the straggler. The synthetic clusters overlap (a single process peaks near 58% test accuracy), so this workload
  never reaches 90%.
* ``digits``: ``--dataset digits --batch-size 60`` (64-128-128-10, 0.1 MB, 20 samples per worker per step,
  lr 0.05, momentum 0.9): per-step overheads and messages dominate. Throughput and time to 90% test accuracy: the
  cumulative *train* time (``epochs[].train_time_s`` of metrics.json, evaluation excluded) of the epochs up to and
  including the first whose test accuracy is >= 90% (the test set is evaluated once per epoch).

For each workload, each round runs all 8 configurations (4 contenders x straggler off/on) once, in an order that
rotates from round to round; ``--repeats`` rounds. Throughput is rank 0's samples/s of its median epoch among epochs
2..E (epoch 1 is warm-up, and a burst of load from elsewhere spoils an epoch rather than the run's figure; an epoch is
every training sample once, in ps-async the W x steps pushes of the shared budget, plus the W - 1 pushes already
under way when it runs out, which are applied but not counted). Every speed against another ("1.50x faster", "1.16x
slower") is the median over rounds of that round's ratio (so a slow minute on the shared machine hits both sides); the
absolute figures are medians with [min..max]. From rank 0's metrics.json: the staleness histogram (every update a
server applied, summed over the rounds), the server's busy fraction (1 - time in Probe / time serving), each worker's
time waiting for weights, and the bytes every rank sent and received, from the tracer: a worker's ``ps/push``
(gradient out, weights back), the server's ``ps/weights`` replies and all it received, ddp's ``allreduce/*``.

    python scripts/bench_ps.py                        # docs/bench/ps/ps.{txt,json,png}: ~4-5 min, quiet 2-core VM
    python scripts/bench_ps.py --quick --out /tmp/ps  # one round, fewer epochs: under a minute
    python scripts/bench_ps.py --workloads compute --repeats 3 --out /tmp/ps
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_util import Record, faster, faster_range, run_meta, write_results

WORKLOADS = {
    "compute": ["--dataset", "synthetic", "--samples", "24000", "--batch-size", "1500", "--hidden", "256"],
    "digits": ["--dataset", "digits", "--batch-size", "60"],
}
EPOCHS = {"compute": 5, "digits": 10}
CONTENDERS = ["ps-sync", "ps-async", "ssp K=2", "ddp"]
PS_RANKS = 4  # 3 workers + 1 server
SERVERS = 1
TARGET_ACCURACY = 0.90
TARGET_RATIO = 1.5  # the issue: with a straggler, ps-async samples/s >= 1.5x ps-sync


def flags_of(contender: str) -> list[str]:
    return {
        "ps-sync": ["--paradigm", "ps-sync", "--servers", str(SERVERS)],
        "ps-async": ["--paradigm", "ps-async", "--servers", str(SERVERS)],
        "ssp K=2": ["--paradigm", "ps-async", "--servers", str(SERVERS), "--staleness", "2"],
        "ddp": ["--paradigm", "ddp"],
    }[contender]


def command(args, workload: str, contender: str, straggler: bool) -> list[str]:
    """The CLI command of one run (without --out)."""
    n = args.ddp_ranks if contender == "ddp" else PS_RANKS
    cmd = ["dtrain", "launch", "-n", str(n), "-m", "dtrain", "train", *flags_of(contender), *WORKLOADS[workload]]
    cmd += ["--epochs", str(args.epochs[workload]), "--no-progress", "--quiet"]
    if straggler:
        cmd += ["--slow-rank", str(args.slow_rank), "--slow-factor", f"{args.slow_factor:g}"]
    return cmd


def run_once(args, workload: str, contender: str, straggler: bool) -> dict:
    """Launch one training run; the figures this benchmark reads from its metrics.json."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", *command(args, workload, contender, straggler), "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"failed (exit {done.returncode}): {shlex.join(cmd)}\n{done.stderr[-3000:]}")
        return digest(json.loads((Path(out) / "metrics.json").read_text()), contender)


def digest(m: dict, contender: str) -> dict:
    """What one run's metrics.json says about throughput, accuracy, staleness, waiting and bytes."""
    epochs = m["epochs"]
    per_step = len_loader(m)  # global steps (budget) per epoch
    batch = m["config"]["batch_size"]
    warm = epochs[1:] or epochs
    row = {
        # the median epoch: a burst of load from elsewhere on the machine spoils an epoch, not the run's figure
        "samples_per_s": statistics.median(e["samples_per_s"] for e in warm),
        "samples_per_s_mean": sum(per_step * batch for _ in warm) / sum(e["train_time_s"] for e in warm),
        "samples_per_s_all_epochs": m["samples_per_s"],
        "final_accuracy": m["final"]["test_accuracy"],
        "curve": [(e["train_time_s"], e["test_accuracy"]) for e in epochs],
        "train_time_s": sum(e["train_time_s"] for e in epochs),
        "steps_per_epoch": per_step,
        "param_bytes": m["model"]["parameters"] * {"float16": 2, "float32": 4, "float64": 8}[m["config"]["dtype"]],
        "sent_per_step_model": m["costs"]["sent_per_step"],
    }
    # (estimate) the same number of epochs at the median speed of epochs 2..E: time to 90% without what the first
    # epoch pays once (ddp: importing Numba and loading its cached kernels on the first all-reduce)
    row["warm_epoch_s"] = statistics.median(e["train_time_s"] for e in warm)
    elapsed, row["t90_s"], row["epochs_to_90"], row["t90_warm_s"] = 0.0, None, None, None
    for e in epochs:
        elapsed += e["train_time_s"]
        if e["test_accuracy"] >= TARGET_ACCURACY:
            row["t90_s"], row["epochs_to_90"] = elapsed, e["epoch"]
            row["t90_warm_s"] = e["epoch"] * row["warm_epoch_s"]
            break
    ranks = m["communication"]["per_rank"]
    figures = ranks[0]["paradigm"]
    roles = figures.get("roles", ["worker"] * len(ranks))
    workers = [r for r, role in enumerate(roles) if role == "worker"]
    # rank 0's train time against the slowest worker's (the critical path): ~1.0 when rank 0 is the straggler
    row["slowest_worker_over_rank0"] = max(ranks[r]["train_time_s"] for r in workers) / ranks[0]["train_time_s"]
    if contender == "ddp":  # per rank: with p not a power of two, recursive doubling's folded rank sends more
        sent, received = [], []
        for rank in ranks:
            ops = [op for label, op in rank["operations"].items() if label.startswith("allreduce/")]
            calls = sum(op["calls"] for op in ops)
            sent.append(sum(op["bytes_sent"] for op in ops) / calls)
            received.append(sum(op["bytes_received"] for op in ops) / calls)
        algorithm = [label for label in ranks[0]["operations"] if label.startswith("allreduce/")]
        row["bytes"] = {"algorithm": algorithm, "rank_sent_per_step": sent, "rank_received_per_step": received}
        return row
    row["staleness"] = figures["staleness"]
    row["server_busy_fraction"] = figures["server_busy_fraction"]
    row["server_updates"] = figures["server_updates"]
    # each worker's share of its train time spent waiting for the servers' replies
    row["worker_wait_fraction"] = [figures["worker_wait_s"][r] / ranks[r]["train_time_s"] for r in workers]
    pushes = [ranks[r]["operations"]["ps/push"]["calls"] for r in workers]
    row["pushes_per_worker"] = pushes
    push0 = ranks[0]["operations"]["ps/push"]
    server = ranks[roles.index("server")]
    global_steps = sum(pushes) / len(workers)  # W pushes make one global step's worth of gradient
    row["bytes"] = {
        "worker_sent_per_step": push0["bytes_sent"] / push0["calls"],
        "worker_received_per_step": push0["bytes_received"] / push0["calls"],
        "server_sent_per_step": server["operations"]["ps/weights"]["bytes_sent"] / global_steps,
        "server_received_per_step": server["totals"]["bytes_received"] / global_steps,
        "server_sent_total": server["totals"]["bytes_sent"],
        "worker0_sent_total": ranks[0]["totals"]["bytes_sent"],
    }
    return row


def len_loader(m: dict) -> int:
    """Global steps per epoch: samples/s * train time / batch, exact from metrics.json's definition."""
    e = m["epochs"][0]
    return round(e["samples_per_s"] * e["train_time_s"] / m["config"]["batch_size"])


# ------------------------------------------------------------------------------------------- statistics
def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def span(values) -> str:
    values = [v for v in values if v is not None]
    return f"[{min(values):,.0f}..{max(values):,.0f}]" if values else ""


def paired(a: list, b: list, key="samples_per_s"):
    """(median, min, max) over rounds of a's figure / b's figure in the same round (None where one is missing)."""
    ratios = [x[key] / y[key] for x, y in zip(a, b) if x[key] is not None and y[key] is not None]
    return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None


# ------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of all 8 configurations (default 5)")
    parser.add_argument("--workloads", default="compute,digits", help="comma list of: compute, digits (default both)")
    parser.add_argument("--epochs-compute", type=int, default=EPOCHS["compute"], help="default %(default)s")
    parser.add_argument("--epochs-digits", type=int, default=EPOCHS["digits"], help="default %(default)s")
    parser.add_argument("--ddp-ranks", type=int, default=3, help="ranks of the ddp runs (default 3: the 3 workers)")
    parser.add_argument("--slow-rank", type=int, default=0, help="the straggler (a worker; default 0)")
    parser.add_argument("--slow-factor", type=float, default=3.0, help="how many times slower (default 3)")
    parser.add_argument("--quick", action="store_true", help="one round, 2 and 4 epochs: a smoke test (~1 min)")
    parser.add_argument("--no-plot", action="store_true", help="skip the figure")
    parser.add_argument("--replot", metavar="JSON", help="only redraw the figure from a ps.json this script wrote")
    parser.add_argument("--out", default="docs/bench/ps", help="folder for ps.txt, ps.json, ps.png (%(default)s)")
    args = parser.parse_args()
    if args.replot:
        replot(Path(args.replot))
        return
    if args.quick:
        args.repeats, args.epochs_compute, args.epochs_digits = 1, 2, 4
    args.epochs = {"compute": args.epochs_compute, "digits": args.epochs_digits}
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise SystemExit(f"--workloads: choose from {', '.join(WORKLOADS)} (got {args.workloads!r})")

    out = Record()

    def say(text="", indent="", hanging="  "):
        out.say(text, indent, hanging)

    configs = [(c, s) for s in (False, True) for c in CONTENDERS]
    say(
        f"parameter servers: {PS_RANKS} ranks = {PS_RANKS - SERVERS} workers + {SERVERS} server; ddp on "
        f"{args.ddp_ranks} ranks; straggler: rank {args.slow_rank} x{args.slow_factor:g}; {os.cpu_count()} cores"
    )
    say(f"{args.repeats} rounds of {len(configs)} configurations per workload, order rotating; medians [min..max]")
    say(f"command: python {shlex.join(sys.argv)}")
    for w in workloads:
        say(f"{w}: " + shlex.join(command(args, w, "ps-sync", True)).replace("ps-sync", "P", 1) + " --out DIR", "  ",
            "      ")  # fmt: skip
    started = time.perf_counter()
    runs = {w: {(c, s): [] for c, s in configs} for w in workloads}
    load = []
    for r in range(args.repeats):
        load.append(os.getloadavg()[0])
        for w in workloads:
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for c, s in order:
                runs[w][(c, s)].append(run_once(args, w, c, s))
        say(
            f"(round {r + 1}/{args.repeats} done, {time.perf_counter() - started:.0f} s; 1-min load average "
            f"before it {load[-1]:.1f} on {os.cpu_count()} cores)"
        )

    summary = {}
    for w in workloads:
        summary[w] = report(out, args, w, runs[w])
    say()
    for i, line in enumerate(verdict(summary)):
        say(line, "  " if i else "", "      " if i else "  ")
    say(f"(total {time.perf_counter() - started:.0f} s)")

    folder = Path(args.out)
    cli = {w: shlex.join(command(args, w, "ps-sync", True)) + " --out DIR" for w in workloads}
    meta = run_meta(cli_commands=cli, repeats=args.repeats, epochs=args.epochs, ddp_ranks=args.ddp_ranks,
                    slow_rank=args.slow_rank, slow_factor=args.slow_factor,
                    load_average_before_rounds=load)  # fmt: skip
    raw = {w: {f"{c}{' +straggler' if s else ''}": rows for (c, s), rows in runs[w].items()} for w in workloads}
    write_results(folder, "ps", {"meta": meta, "summary": summary, "runs": raw}, out.text())
    if not args.no_plot:
        plot(runs, summary, args, folder / "ps.png")
        print(f"wrote {folder / 'ps.png'}")


def label(c: str, s: bool) -> str:
    return c + (" +straggler" if s else "")


def report(out, args, w: str, rows: dict) -> dict:
    """The tables of one workload, printed and kept in ``out`` (a Record); its summary for ps.json."""

    def say(text="", indent="", hanging="  "):
        out.say(text, indent, hanging)

    say()
    say(f"## {w}: " + " ".join(WORKLOADS[w]) + f", {args.epochs[w]} epochs", hanging="   ")
    header = ["contender", "samples/s", "min..max", "vs ps-sync", "vs no straggler", "final acc", "t90 s",
              "t90 vs ps-sync", "ep90", "t90 warm s"]  # fmt: skip
    cells, summary, internals = [], {}, []
    for s in (False, True):
        for c in CONTENDERS:
            runs = rows[(c, s)]
            entry = {
                "samples_per_s": med([r["samples_per_s"] for r in runs]),
                "samples_per_s_runs": [r["samples_per_s"] for r in runs],
                "over_ps_sync": paired(runs, rows[("ps-sync", s)]),
                "final_accuracy": med([r["final_accuracy"] for r in runs]),
                "t90_s": med([r["t90_s"] for r in runs]),
                "t90_reached": sum(r["t90_s"] is not None for r in runs),
                "t90_speedup_vs_ps_sync": paired(rows[("ps-sync", s)], runs, "t90_s"),
                "epochs_to_90": med([r["epochs_to_90"] for r in runs]),
                "t90_warm_s": med([r["t90_warm_s"] for r in runs]),
                "slowest_worker_over_rank0": med([r["slowest_worker_over_rank0"] for r in runs]),
            }
            if s:
                entry["over_no_straggler"] = paired(runs, rows[(c, False)])
            summary[label(c, s)] = entry
            t90 = f"{entry['t90_s']:.3f}" if entry["t90_s"] is not None else "-"
            if entry["t90_reached"] not in (0, len(runs)):
                t90 += f" ({entry['t90_reached']}/{len(runs)} runs)"
            speedup = entry["t90_speedup_vs_ps_sync"]
            cells.append([
                label(c, s), f"{entry['samples_per_s']:,.0f}", span(entry["samples_per_s_runs"]).strip("[]"),
                "-" if c == "ps-sync" else faster(entry["over_ps_sync"][0]),
                faster(entry["over_no_straggler"][0]) if s else "-", f"{entry['final_accuracy']:.3f}", t90,
                "-" if c == "ps-sync" else faster(speedup[0]) if speedup else "-",
                f"{entry['epochs_to_90']:g}" if entry["epochs_to_90"] is not None else "-",
                f"{entry['t90_warm_s']:.3f}" if entry["t90_warm_s"] is not None else "-",
            ])  # fmt: skip
            if c == "ddp":
                continue
            entry["staleness_mean"] = med([r["staleness"]["mean"] for r in runs])
            entry["staleness_max"] = max(r["staleness"]["max"] for r in runs)
            hist = collections.Counter()
            for r in runs:
                hist.update({int(k): v for k, v in r["staleness"]["histogram"].items()})
            entry["staleness_histogram"] = {str(k): hist[k] for k in sorted(hist)}
            entry["server_busy_fraction"] = med([r["server_busy_fraction"][0] for r in runs])
            fractions = [r["worker_wait_fraction"] for r in runs]
            slow = args.slow_rank
            entry["wait_fraction_rank_slow"] = med([f[slow] for f in fractions])
            entry["wait_fraction_others"] = med([v for f in fractions for i, v in enumerate(f) if i != slow])
            workers = len(runs[0]["pushes_per_worker"])
            entry["pushes_per_worker"] = [med([r["pushes_per_worker"][i] for r in runs]) for i in range(workers)]
            internals.append([
                label(c, s), f"{entry['staleness_mean']:.2f}", str(entry["staleness_max"]),
                f"{entry['server_busy_fraction']:.2f}", f"{entry['wait_fraction_others']:.2f}",
                f"{entry['wait_fraction_rank_slow']:.2f}", f"{entry['slowest_worker_over_rank0']:.3f}",
                ", ".join(f"{v:g}" for v in entry["pushes_per_worker"]),
            ])  # fmt: skip
    out.table(header, cells, groups=(1, 5))
    say(
        "samples/s: rank 0's median epoch of epochs 2..E (median of the rounds); vs ps-sync: its speed against "
        "ps-sync's, paired in the same round and straggler setting; vs no straggler: against the same contender's "
        "without the straggler, paired by round; t90: train seconds (evaluation excluded) to >= 90% test accuracy, "
        "ep90 the epoch it is reached; t90 vs ps-sync: ps-sync's t90 over this t90, paired by round, in words; t90 "
        "warm (an estimate): ep90 x the median epoch time of epochs 2..E"
    )
    say()
    out.table(["parameter servers", "stale mean", "stale max", "server busy", "wait, others",
               f"wait, rank {args.slow_rank}", "slowest / rank 0", "pushes per worker"], internals,
              left=(0, 7))  # fmt: skip
    say(
        "stale: updates a server applied between the weights a worker was sent and its gradient's arrival (max: "
        "over all rounds); server busy: 1 - time in Probe / time serving; wait: share of a worker's train time "
        f"spent waiting for the server's reply (rank {args.slow_rank} is the straggler in the +straggler rows); "
        "slowest / rank 0: the slowest worker's train time over rank 0's (1.0: rank 0's timer is the critical path)"
    )

    # bytes per step, from the tracer (runs without the straggler; the counts do not depend on it)
    b_ps = rows[("ps-sync", False)][0]["bytes"]
    b_async = rows[("ps-async", False)][0]["bytes"]
    b_ddp = rows[("ddp", False)][0]["bytes"]
    n = rows[("ps-sync", False)][0]["param_bytes"]
    workers = PS_RANKS - SERVERS
    p = args.ddp_ranks
    say()
    say(f"bytes per global step (tracer), model n = {n:,} bytes of parameters:")
    table = [
        ("ps-sync worker (ps/push)", b_ps["worker_sent_per_step"], b_ps["worker_received_per_step"]),
        ("ps-sync server", b_ps["server_sent_per_step"], b_ps["server_received_per_step"]),
        ("ps-async worker (per push)", b_async["worker_sent_per_step"], b_async["worker_received_per_step"]),
        ("ps-async server (per W pushes)", b_async["server_sent_per_step"], b_async["server_received_per_step"]),
    ]
    for rank, (sent, received) in enumerate(zip(b_ddp["rank_sent_per_step"], b_ddp["rank_received_per_step"])):
        table.append((f"ddp rank {rank} ({', '.join(b_ddp['algorithm'])}, p={p})", sent, received))
    cells = [[name, f"{sent:,.0f}", f"{received:,.0f}", f"{sent / n:.3f}"] for name, sent, received in table]
    out.table(["", "sent", "received", "sent / n"], cells)
    say(
        f"formulas: worker n, server W n = {workers} n, ring all-reduce 2(p-1)/p n = {2 * (p - 1) / p:.3f} n per "
        f"rank; the server's link carries {b_ps['server_sent_per_step'] / b_ps['worker_sent_per_step']:.2f}x a "
        f"worker's and {b_ps['server_sent_per_step'] / max(b_ddp['rank_sent_per_step']):.2f}x the busiest ddp rank's"
    )
    summary["bytes"] = {"param_bytes": n, "ps-sync": b_ps, "ps-async": b_async, "ddp": b_ddp}

    say()
    say("staleness histogram (updates applied with staleness k, all rounds; share of the total):")
    for c in ("ps-sync", "ps-async", "ssp K=2"):
        for s in (False, True):
            hist = summary[label(c, s)]["staleness_histogram"]
            total = sum(hist.values())
            cells = "  ".join(f"{k}:{v / total:.2f}" for k, v in hist.items() if v / total >= 0.005)
            say(f"{label(c, s)}: {cells}", "  ", "      ")
    return summary


def verdict(summary) -> list[str]:
    out = [f"target: with one worker slowed {3}x, ps-async {TARGET_RATIO}x faster than ps-sync or more (samples/s)"]
    for w, s in summary.items():
        ratio, lo, hi = s[label("ps-async", True)]["over_ps_sync"]
        ok = "met" if ratio >= TARGET_RATIO else "MISSED"
        out.append(f"{w}: {faster(ratio, 'ps-sync')} (rounds: {faster_range(lo, hi)}): {ok}")
    return out


def replot(path: Path) -> None:
    """The figure again, from the runs a previous invocation saved (next to its ps.json)."""
    saved = json.loads(path.read_text())
    configs = [(c, s) for s in (False, True) for c in CONTENDERS]
    runs = {w: {(c, s): saved["runs"][w][label(c, s)] for c, s in configs} for w in saved["runs"]}
    args = argparse.Namespace(ddp_ranks=saved["meta"]["ddp_ranks"], repeats=saved["meta"]["repeats"])
    plot(runs, saved["summary"], args, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.png')}")


def plot(runs, summary, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(runs)
    colours = {"ps-sync": "tab:blue", "ps-async": "tab:orange", "ssp K=2": "tab:green", "ddp": "tab:red"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    # throughput bars, per workload
    for ax, w in zip(axes[0], workloads):
        width = 0.38
        for i, s in enumerate((False, True)):
            xs = [j + (i - 0.5) * width for j in range(len(CONTENDERS))]
            values = [summary[w][label(c, s)]["samples_per_s_runs"] for c in CONTENDERS]
            heights = [statistics.median(v) for v in values]
            errors = [[h - min(v) for h, v in zip(heights, values)], [max(v) - h for h, v in zip(heights, values)]]
            ax.bar(
                xs, heights, width, yerr=errors, capsize=3, label="3x straggler (rank 0)" if s else "no straggler",
                color=[colours[c] for c in CONTENDERS], alpha=0.45 if s else 0.95, hatch="//" if s else None,
                edgecolor="black", linewidth=0.5,
            )  # fmt: skip
            for x, v, c in zip(xs, values, CONTENDERS):
                if s:  # above the error bar
                    r = summary[w][label(c, s)]["over_ps_sync"][0]
                    ax.annotate(f"{r:.2f}x", (x, max(v)), ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                                textcoords="offset points")  # fmt: skip
        ax.set_xticks(range(len(CONTENDERS)), CONTENDERS)
        ax.set_ylabel("samples/s (median, min..max)")
        ax.set_title(f"{w}: throughput (labels: / ps-sync, both with the straggler)", fontsize=10)
        ax.legend(fontsize=8)
    if len(workloads) == 1:
        axes[0][1].axis("off")
    # accuracy vs train time, digits if run (the median-time run of each configuration)
    w = "digits" if "digits" in runs else workloads[0]
    ax = axes[1][0]
    for c in CONTENDERS:
        for s in (False, True):
            rs = sorted(runs[w][(c, s)], key=lambda r: r["train_time_s"])
            r = rs[len(rs) // 2]
            t, xs, ys = 0.0, [], []
            for dt, acc in r["curve"]:
                t += dt
                xs.append(t)
                ys.append(acc)
            ax.plot(xs, ys, marker="o", ms=3, color=colours[c], ls="--" if s else "-", label=label(c, s))
    ax.axhline(TARGET_ACCURACY, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("cumulative train time, s (evaluation excluded; log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.8 if w == "digits" else 0.0, 1.0 if w == "digits" else 0.7)
    ax.set_title(f"{w}: test accuracy after each epoch (median-time run)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    # staleness histograms with the straggler
    ax = axes[1][1]
    w = "compute" if "compute" in runs else workloads[0]
    styles = [("ps-async", False), ("ps-async", True), ("ssp K=2", True)]
    width = 0.8 / len(styles)
    for i, (c, s) in enumerate(styles):
        hist = summary[w][label(c, s)]["staleness_histogram"]
        total = sum(hist.values())
        ks = [int(k) for k in hist]
        ax.bar(
            [k + (i - 1) * width for k in ks], [v / total for v in hist.values()], width, label=label(c, s),
            color=colours[c], alpha=0.5 if s else 0.95, hatch="//" if s else None, edgecolor="black", lw=0.5,
        )  # fmt: skip
    ax.set_xlim(-0.6, 12.6)
    ax.set_xlabel("staleness k: updates between a worker's weights and its gradient's arrival")
    ax.set_ylabel("share of updates")
    ax.set_title(f"{w}: staleness (ps-sync: all 0)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"Parameter servers, 3 workers + 1 server (ddp: {args.ddp_ranks} ranks), {os.cpu_count()} cores, "
        f"{args.repeats} rounds",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

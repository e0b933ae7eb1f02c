"""``dtrain plan --check``: the planner held to its own runs, here and now.

Each configuration is trained for a few steps under this environment's ``mpiexec`` (``dtrain train`` on synthetic
data of the model's shape: same widths, same batch, same flags), on this machine or, with ``--hostfile FILE``, across
the hostfile's machines as ``dtrain launch --hostfile FILE`` places them (a dtrain cluster's nodes reached as its
launcher reaches them, :mod:`dtrain.launch.cluster`), and its metrics.json gives what the prediction is held
against:

    step time           the last epoch's training time over its steps (the first epoch warms caches and pools up)
    bytes per step      the tracer's count for the busiest rank          = costs(): exact, a mismatch is a bug
    state per rank      parameters + gradients + optimizer state the fullest rank held, read off its arrays = costs()

:func:`measure` is what ``scripts/bench_plan.py`` calls too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from dtrain import kernels, report, terminal
from dtrain.config import flag_words
from dtrain.errors import UserError
from dtrain.launch import launcher

EPOCHS = 2


@dataclasses.dataclass
class Measured:
    step_s: float
    sent_per_step: float  # the busiest rank's, measured by the tracer
    state_bytes: float  # the fullest rank's parameters + gradients + optimizer state, read off its arrays
    metrics: dict


def steps_for(predicted_s: float, budget_s: float = 2.0) -> int:
    """Steps per epoch: about ``budget_s`` seconds of them, 5 at least and 50 at most."""
    return int(min(50, max(5, budget_s / max(predicted_s, 1e-6))))


def steps_of(row, predicted_s: float, budget_s: float = 2.0) -> int:
    """:func:`steps_for`, rounded up to a whole number of local SGD's periods (``--sync-every H``): every epoch then
    averages as often, 1 step in H, as the planner's price assumes."""
    steps, every = steps_for(predicted_s, budget_s), row.flags.get("sync_every", 1)
    return -(-steps // every) * every


def measure(row, model, folder, steps: int, timeout: float = 300.0, hosts=None) -> Measured:
    """Train ``row`` (a :class:`dtrain.plan.Row`) for :data:`EPOCHS` epochs of ``steps`` steps here (or on ``hosts``,
    a list of :class:`dtrain.launch.hosts.Host`, as ``dtrain launch --hostfile`` places ranks); what it took."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train = steps * model.batch_size
    samples = -(-train * 5 // 4)  # (a fifth is the test split: the train split is `train` samples)
    flags = {"paradigm": row.paradigm, **row.flags, "dataset": "synthetic", "samples": samples,
             "features": model.sizes[0], "classes": model.sizes[-1],
             "hidden": ",".join(map(str, model.sizes[1:-1])) or "none", "batch_size": model.batch_size,
             "epochs": EPOCHS, "dtype": model.dtype, "optimizer": model.optimizer, "momentum": model.momentum,
             "device": model.device, "out": str(folder)}  # fmt: skip
    target = ["-m", "dtrain", "train", *flag_words(flags), "--no-progress", "--quiet", "--timeout",
              f"{timeout / 2:g}"]  # fmt: skip
    env = {**os.environ}
    env.setdefault(kernels.ENV_VAR, "numpy")  # (as the tour: Numba's compilation is not what is being predicted)
    done = launcher.launch(row.ranks, target, timeout=timeout, capture=True, env=env, hosts=hosts)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or [f"status {done.returncode}"]
        raise UserError(f"--check: {row.label} failed {'here' if hosts is None else 'on the hosts'}: {last[0]}")
    metrics = json.loads((folder / "metrics.json").read_text())
    summary = report.run_summary(metrics)
    per_epoch = summary["steps"] / len(metrics["epochs"])
    held, _predicted = report.state_bytes(metrics)
    return Measured(step_s=metrics["epochs"][-1]["train_time_s"] / per_epoch, sent_per_step=max(summary[
        "sent_per_step"]), state_bytes=max(held) if held else float("nan"), metrics=metrics)  # fmt: skip


def check(rows, model, count: int, machine, hosts=None, everyone: bool = False) -> int:
    """Run the ``count`` best configurations that fit here (``dtrain plan --check K``), or across the machines of
    ``hosts`` (a :class:`dtrain.plan.hostfile.World`: ``--hostfile FILE``); ``everyone``: every row that fits, those
    that do not make single's updates too (the configurations named by ``--configuration``). Print predicted beside
    measured, and whether the planner's first choice was the measured fastest. 1 if a count differed."""
    from dtrain.plan.hardware import GPU_MEASURED, THIS

    here = GPU_MEASURED if model.device == "gpu" else THIS  # (the machine the runs happen on, as measured)
    if machine.name != here:
        raise UserError(f"--check runs the configurations here, so it needs the machine measured here, --machine "
                        f"{here} (with --device {model.device}), not {machine.name}")  # fmt: skip
    chosen = [r for r in rows if r.fits and (r.same_updates or everyone)][:count]
    where = "here" if hosts is None else f"on {hosts.path}'s {len(hosts.hosts)} machine(s)"
    which = "named" if everyone else "best"
    print("\n" + terminal.paragraph(f"checking the {len(chosen)} {which} {where} ({EPOCHS} epochs each; the last one "
                                    "timed):", hanging="  "), flush=True)  # fmt: skip
    cells, results, wrong = [], [], 0
    with tempfile.TemporaryDirectory(prefix="dtrain-plan-") as scratch:
        for i, row in enumerate(chosen):
            got = measure(row, model, Path(scratch) / str(i), steps_of(row, row.total),
                          hosts=None if hosts is None else hosts.hosts)  # fmt: skip
            results.append((row, got))
            same = got.sent_per_step == row.sent_per_step and got.state_bytes == max(row.state)
            wrong += not same
            cells.append([row.label, f"{row.total * 1e3:.2f}", f"{got.step_s * 1e3:.2f}",
                          f"{abs(row.total / got.step_s - 1):.0%} " + ("high" if row.total > got.step_s else "low"),
                          f"{row.sent_per_step:,.0f}", f"{got.sent_per_step:,.0f}", f"{max(row.state):,.0f}",
                          f"{got.state_bytes:,.0f}", "yes" if same else "NO"])  # fmt: skip
            said = (f"{row.label}: predicted {row.total * 1e3:.2f} ms, measured {got.step_s * 1e3:.2f} ms "
                    f"({got.step_s / row.total:.2f}x the predicted)")  # fmt: skip
            print(terminal.paragraph(said, "  ", "    "), flush=True)
    header = ["configuration", "predicted ms", "measured ms", "prediction", "predicted B/step", "measured B/step",
              "predicted state B", "measured state B", "counts equal"]  # fmt: skip
    print("\n" + terminal.table(header, cells, groups=(1, 4)))
    print("\n" + terminal.paragraph(verdict(results), hanging="  "))
    return 1 if wrong else 0


def verdict(results) -> str:
    """Whether the planner's first choice (the best, or the first checked) was the measured fastest of those checked
    that make single's updates (or within 10% of it)."""
    results = [pair for pair in results if pair[0].same_updates]
    if not results:
        return "nothing that makes single's updates was checked"
    first = next((pair for pair in results if pair[0].best), results[0])
    fastest = min(results, key=lambda pair: pair[1].step_s)
    if fastest is first:
        return f"the planner's first choice, {first[0].label}, was the measured fastest."
    slower = first[1].step_s / fastest[1].step_s - 1
    within = "within 10% of it" if slower <= 0.10 else "NOT within 10% of it"
    return (
        f"the planner's first choice, {first[0].label}, measured {100 * slower:.0f}% slower than the fastest "
        f"checked, {fastest[0].label} ({within})."
    )

"""Evidence a run leaves behind: ``metrics.json``, and figures made from one or several of them.

The schema (``"schema": "dtrain.metrics/1"``) is documented in ``docs/metrics.md``. Lessons, notebooks, benchmarks
and tests read these files instead of scraping printed text.
"""

from __future__ import annotations

import io
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

import dtrain
from dtrain import terminal
from dtrain.errors import MissingPackage, UserError

SCHEMA = "dtrain.metrics/1"


class MetricsError(UserError, ValueError):
    """A file that is not a dtrain ``metrics.json``."""


def environment() -> dict:
    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "dtrain": dtrain.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    for name in ("mpi4py", "numba", "cupy"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "?")
    return info


def write_metrics(out_dir, metrics: dict) -> Path:
    """Write ``out_dir/metrics.json`` (creating the folder) and return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"schema": SCHEMA, **metrics}, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)  # never leave a half-written file behind
    return path


def load_metrics(path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except ValueError as exc:  # invalid JSON or not text at all
        raise MetricsError(f"{path}: not a dtrain metrics file ({exc})") from exc
    schema = metrics.get("schema") if isinstance(metrics, dict) else None
    if schema != SCHEMA:
        raise MetricsError(f"{path}: not a dtrain metrics file (schema {schema!r}, expected {SCHEMA})")
    return metrics


# --- what one run cost, read from its metrics.json ----------------------------------------------------------------
def training_steps(metrics: dict) -> int:
    """The optimizer steps of a training run (every epoch's, of the global batch)."""
    from dtrain.data import steps_per_epoch

    per_epoch = steps_per_epoch(metrics["dataset"]["train_samples"], metrics["config"]["batch_size"])
    return len(metrics["epochs"]) * per_epoch


def training_traffic(metrics: dict, key: str = "bytes_sent", setup: bool = False) -> list:
    """What each rank sent for training (``key``: the tracer's ``bytes_sent`` or ``messages_sent``): all it sent,
    but the "evaluation" and "checkpoint" labels, and unless ``setup``, what it sent while the paradigm was built (the
    initial broadcast of the weights: once a run, not once a step)."""
    from dtrain.comm.trace import NOT_TRAINING  # (here: importing the tracer starts MPI, which plotting needs not)

    sent = []
    for mine in metrics["communication"]["per_rank"]:
        aside = sum(mine["operations"].get(label, {}).get(key, 0) for label in NOT_TRAINING)
        once = 0 if setup else mine.get("setup", {}).get(key, 0)
        sent.append(mine["totals"][key] - aside - once)
    return sent


def state_bytes(metrics: dict) -> tuple[list | None, list]:
    """(measured, predicted): the bytes of parameters, gradients and optimizer state each rank held, as the paradigm
    read them off its arrays (``held_bytes`` in its figures; None if it reports none) and as its ``costs()`` says (a
    number there: every rank alike; a list: by rank)."""
    # (compression: a compressor's state beside ddp's, --compress; the other paradigms have none)
    kinds = ("parameters", "gradients", "optimizer", "compression")
    world, costs = metrics["world_size"], metrics["costs"]
    predicted = [0] * world
    for kind in kinds:
        value = costs.get(kind, 0)
        values = value if isinstance(value, list) else [value] * world
        predicted = [a + b for a, b in zip(predicted, values)]
    held = metrics["communication"]["per_rank"][0]["paradigm"].get("held_bytes")
    return ([sum(h.get(k, 0) for k in kinds) for h in held] if held else None), predicted


def time_to_accuracy(metrics: dict, accuracy: float) -> tuple[int | None, float | None]:
    """The first epoch whose test accuracy is at least ``accuracy``, and the training time up to its end (the
    training loop's, evaluation and start-up left out); (None, None) if no epoch reached it."""
    seconds = 0.0
    for e in metrics["epochs"]:
        seconds += e["train_time_s"]
        if e["test_accuracy"] >= accuracy:
            return e["epoch"], seconds
    return None, None


def run_summary(metrics: dict) -> dict:
    """One run's results and costs, from its metrics.json: accuracy, times, and per rank the training bytes and
    messages it sent per step (measured: :func:`training_traffic` over :func:`training_steps`; predicted:
    ``costs()``) and the state it held (:func:`state_bytes`)."""
    steps = training_steps(metrics)
    held, predicted = state_bytes(metrics)
    return {
        "test_accuracy": metrics["final"]["test_accuracy"],
        "wall_time_s": metrics["wall_time_s"],
        "samples_per_s": metrics["samples_per_s"],
        "world_size": metrics["world_size"],
        "steps": steps,
        "sent_per_step": [b / steps for b in training_traffic(metrics)],
        "predicted_sent_per_step": metrics["costs"]["sent_per_step"],
        "messages_per_step": [m / steps for m in training_traffic(metrics, "messages_sent")],
        "state_bytes": held,
        "predicted_state_bytes": predicted,
        "train_loss": [e["train_loss"] for e in metrics["epochs"]],
        "test_accuracies": [e["test_accuracy"] for e in metrics["epochs"]],
    }


def plot_paradigms(plt, runs: dict, path, reference: str | None = None) -> Path:
    """Three panels for runs of several paradigms (``runs``: label -> :func:`run_summary`): the training loss per
    epoch (``reference``'s dashed in black), the final test accuracy against the bytes the busiest rank sent per
    step, and the state each rank held (a dot per rank, ``costs()``'s prediction for the fullest rank a cross)."""
    fig, (curves, by_bytes, state) = plt.subplots(1, 3, figsize=(19, 5.5))
    palette = plt.get_cmap("tab20")
    for i, (label, r) in enumerate(runs.items()):
        colour, marker = ("black", "s") if label == reference else (palette(i % 20), "osD^v<>pPXh*"[i % 12])
        style = dict(ls="--", lw=2.5, zorder=5) if label == reference else dict(lw=1.2)
        curves.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"], color=colour, label=label, **style)
        sent = max(r["sent_per_step"])
        if sent > 0:
            by_bytes.scatter(sent, 100 * r["test_accuracy"], color=colour, marker=marker, s=50, label=label)
        else:
            by_bytes.axhline(100 * r["test_accuracy"], color=colour, ls="--", lw=1, label=f"{label}: sends nothing")
        held = r["state_bytes"] or []
        state.scatter([b / 1e3 for b in held], [i] * len(held), color=colour, marker=marker, s=30)
        state.scatter(max(r["predicted_state_bytes"]) / 1e3, i, marker="x", color="black", s=50)
    curves.set(xlabel="epoch", ylabel="training loss (global batch)", yscale="log", title="Loss, every paradigm")
    by_bytes.set(xscale="log", xlabel="bytes the busiest rank sent per step (training)",
                 ylabel="final test accuracy (%)", title="Accuracy against bytes")  # fmt: skip
    by_bytes.xaxis.set_minor_formatter(plt.NullFormatter())  # (labels on the powers of ten only: no overlap)
    for axis in (curves, by_bytes):
        axis.legend(fontsize=7)
    state.set_yticks(range(len(runs)), list(runs), fontsize=7)
    state.invert_yaxis()
    state.set(xlabel="kB held: parameters + gradients + optimizer state", title="State per rank (dots: each rank; "
              "x: costs(), fullest rank)")  # fmt: skip
    for axis in (curves, by_bytes, state):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def pyplot():
    """matplotlib's pyplot, drawing to files (Agg), or a one-line error saying how to install it. Call it before
    the work whose results are to be drawn, so that a missing matplotlib is said before, not after."""
    try:
        import matplotlib
    except ImportError as exc:  # not a core dependency: `pip install -e .` does not bring it
        raise MissingPackage(
            "plotting needs matplotlib, which is not installed: pip install -e '.[course]' (everything the course "
            "uses), or pip install matplotlib"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_metrics(paths, out_png, labels=None) -> Path:
    """Training loss and test accuracy per epoch for one or more runs, side by side, saved as a PNG."""
    plt = pyplot()

    runs = [load_metrics(p) for p in paths]
    labels = labels or [_label(run, p) for run, p in zip(runs, paths)]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run, label in zip(runs, labels):
        epochs = [e["epoch"] for e in run["epochs"]]
        ax_loss.plot(epochs, [e["train_loss"] for e in run["epochs"]], marker="o", label=label)
        ax_acc.plot(epochs, [100 * e["test_accuracy"] for e in run["epochs"]], marker="o", label=label)
    ax_loss.set(xlabel="epoch", ylabel="training loss (mean cross-entropy)", yscale="log", title="Loss")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="Accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    if terminal.to_stdout(out_png):  # "-": the PNG to standard output
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=120)
        plt.close(fig)
        terminal.write_output(out_png, png.getvalue())
        return Path(out_png)
    out_png = Path(out_png)
    if not out_png.suffix:
        out_png = out_png.with_suffix(".png")  # what matplotlib writes for a bare name: report the real file
    out_png.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out_png, dpi=120)
    except ValueError as exc:  # an extension matplotlib cannot write, such as -o curves.txt
        raise UserError(f"{out_png}: {exc}") from exc
    finally:
        plt.close(fig)
    return out_png


COLOURS = {"forward": ("#4C72B0", "#A6BDDB"), "backward": ("#DD8452", "#F5C6A5")}  # chunk 0, later chunks


def draw_timeline(ax, bars, title: str | None = None) -> None:
    """A pipeline's timeline on the matplotlib axes ``ax``: a row per pipeline rank (stage 0 on top), a bar per
    forward (blue) and backward (orange) from its start to its end, its micro-batch written inside; a rank's later
    chunks (interleaving) in lighter shades. The white space is the bubble.

    ``bars``: ``(rank, op, micro, start, end, chunk)`` tuples, from a schedule simulated before running anything
    (:func:`dtrain.parallel.schedules.simulate`, made into bars by ``schedules.bars``) or measured by a pipeline.
    """
    bars = list(bars)
    origin = min(bar[3] for bar in bars)
    for rank, op, micro, start, end, chunk in bars:
        colour = COLOURS[op][0 if chunk == 0 else 1]
        ax.barh(rank, end - start, left=start - origin, height=0.8, color=colour, edgecolor="white", linewidth=0.5)
        ax.text((start + end) / 2 - origin, rank, str(micro), ha="center", va="center", fontsize=7)
    ranks = sorted({bar[0] for bar in bars})
    ax.set_yticks(ranks, [f"stage {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, -0.6)
    ax.set_xlim(0, max(bar[4] for bar in bars) - origin)
    if title:
        ax.set_title(title, fontsize=10)


def _label(run: dict, path) -> str:
    """``paradigm xN (run folder)``, for a metrics.json path or a run folder alike."""
    cfg, path = run.get("config", {}), Path(path)
    folder = path if path.is_dir() else path.parent
    return f"{cfg.get('paradigm', '?')} x{run.get('world_size', '?')} ({folder.name or path})"


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to metrics.json")

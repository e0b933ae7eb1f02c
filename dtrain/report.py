"""Evidence a run leaves behind: ``metrics.json``, and figures made from one or several of them.

The schema (``"schema": "dtrain.metrics/1"``) is documented in ``docs/metrics.md``. Lessons, notebooks, benchmarks
and tests read these files instead of scraping printed text.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

import dtrain

# weights_digest lives with the model stack (paradigms use it too); the driver's callers find it here as before
from dtrain.backend import weights_digest  # noqa: F401
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

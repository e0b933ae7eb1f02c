"""What every benchmark script shares: its hidden worker flags, how it runs training jobs, and how it writes its
results.

A benchmark that needs ranks starts itself again under ``mpiexec`` with ``--worker --result FILE`` (the ranks' part:
measure, and rank 0 writes FILE), and the first process gathers the files into one table. A benchmark of whole
training jobs runs them through the CLI (``train_metrics``), in rounds whose order rotates (``rotated``), and reads
their metrics.json (``training_steps``, ``sent_per_rank``). At the end it writes the table as text and the numbers as
JSON into its ``--out`` folder, with the command that made them and the machine they were made on
(docs/benchmarks.md quotes them), and exits non-zero if an exact check failed (``exit_if_failed``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dtrain import terminal
from dtrain.report import training_steps  # noqa: F401  (the benchmarks' too)


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """``--worker`` (this process is one of the benchmark's ranks) and ``--result FILE`` (where rank 0 writes),
    hidden from ``--help``: the script passes them to itself."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def run_meta(**fields) -> dict:
    """The run's description for the JSON: the command, then ``fields``, then the machine and the date."""
    return {
        "command": "python " + shlex.join(sys.argv),
        **fields,
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%F"),
        "machine": platform.platform(),
    }


def write_json(path, data: dict) -> Path:
    """Write ``data`` as JSON to ``path`` (its folder made if need be); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def write_results(out, name: str, data: dict, text: str | None = None) -> list[Path]:
    """Write ``data`` to ``out/name.json`` and, if given, ``text`` to ``out/name.txt``; say so; return the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if text is not None:
        written.append(out / f"{name}.txt")
        written[-1].write_text(text.rstrip("\n") + "\n")
    written.append(write_json(out / f"{name}.json", data))
    print()
    say(f"wrote {' and '.join(map(str, written))}", hanging="  ")
    return written


def say(text: str = "", indent: str = "", hanging: str | None = None) -> None:
    """Print a line of prose wrapped to the terminal (:func:`dtrain.terminal.paragraph`; later lines start with
    ``hanging``)."""
    print(terminal.paragraph(text, indent, hanging) if text else "", flush=True)


class Record:
    """What a benchmark prints, kept twice: fitted to the terminal as it is printed (:mod:`dtrain.terminal`), and
    whole for the .txt file that records the run (``text()``: every row of a table on one line, every line whole).
    ``echo=False`` prints nothing yet: a part made before its turn, printed by the record it is added to."""

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo
        self.shown: list[str] = []  # as printed
        self.lines: list[str] = []  # whole

    def _keep(self, shown: str, whole: str) -> None:
        if self.echo:
            print(shown, flush=True)
        self.shown.append(shown)
        self.lines.append(whole)

    def say(self, text: str = "", indent: str = "", hanging: str | None = None) -> None:
        """A line of prose: wrapped on the terminal (later lines start with ``hanging``), whole in the record."""
        self._keep(terminal.paragraph(text, indent, hanging) if text else "", indent + text)

    def table(self, header: list[str], rows: list[list[str]], **options) -> None:
        """A table (:func:`dtrain.terminal.table`, ``options`` its own): fitted on the terminal, full width in the
        record."""
        self._keep(terminal.table(header, rows, **options), terminal.table(header, rows, **options, width=None))

    def add(self, part: Record) -> None:
        """Another record's lines after these (printed now if this record prints)."""
        for shown, whole in zip(part.shown, part.lines):
            self._keep(shown, whole)

    def text(self) -> str:
        return "\n".join(self.lines)


def faster(ratio: float | None, whose: str = "") -> str:
    """A ratio of speeds (the other's time over ours: above 1, ours is faster) in dtrain's words
    (:func:`dtrain.terminal.speed`): "1.50x faster than MPI", "1.16x slower than MPI", "as fast as MPI"; without
    ``whose`` (a column whose header names the other), "1.50x faster", "1.16x slower", "as fast"."""
    if not ratio or ratio <= 0:
        return "-"
    return terminal.speed(1.0, ratio, whose or None)


def faster_range(low: float | None, high: float | None) -> str:
    """The range of a speed ratio (see :func:`faster`) in the same words: "1.12-1.32x faster", "2.78-3.70x slower",
    "1.04x slower to 1.11x faster"."""
    if not low or not high:
        return "-"
    if low > 1:
        return f"{low:.2f}-{high:.2f}x faster"
    if high < 1:
        return f"{1 / high:.2f}-{1 / low:.2f}x slower"
    return f"{faster(low)} to {faster(high)}"


def exit_if_failed(checks: list[str]) -> None:
    """End the benchmark with a non-zero status if any of its exact checks (lines "PASS ..." or "FAIL ...") failed."""
    if any(line.startswith("FAIL") for line in checks):
        raise SystemExit("some checks FAILED (above)")


def add_round_flags(parser: argparse.ArgumentParser, *, steps: int, epochs: int, quick: str, results: str,
                    of: str = "") -> None:  # fmt: skip
    """The flags of a benchmark that times training jobs in interleaved rounds: ``--steps`` per epoch, ``--epochs``
    (the last one timed), ``--repeats`` (rounds), ``--quick`` (``quick`` says what it cuts) and ``--out`` (the folder
    for ``results``). ``of``: which of the script's parts they are for, e.g. "tp: "."""
    parser.add_argument("--steps", type=int, default=steps, help=f"{of}steps per epoch (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=epochs, help=f"{of}the last one is timed (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help=f"{of}rounds, interleaved (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", default="docs/bench", help=f"folder for {results}")


def samples_for(steps: int, batch_size: int) -> int:
    """The ``--samples`` that make ``steps`` training steps of ``batch_size`` per epoch: 80% of the samples train
    (dtrain.data.TEST_FRACTION)."""
    return -(-steps * batch_size * 5 // 4)


def rotated(labels: list, repeat: int) -> list:
    """Round ``repeat``'s order of the contenders ``labels``: rotated by one each round, so that no contender always
    runs first (or right after the same other one) on a machine whose speed drifts."""
    shift = repeat % len(labels)
    return labels[shift:] + labels[:shift]


def launch(ranks: int, target: list[str], env: dict | None = None) -> None:
    """``dtrain launch -n RANKS TARGET`` (a script and its arguments, or ``-m module ...``); if it fails, the benchmark
    ends with the command and its output."""
    command = [sys.executable, "-m", "dtrain", "launch", "-n", str(ranks), *target]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")


def train_metrics(ranks: int, flags: list[str], folder, env: dict | None = None) -> dict:
    """One training job through the CLI, ``dtrain launch -n RANKS -m dtrain train FLAGS --out FOLDER`` (no progress
    bar, quiet): its metrics.json."""
    launch(ranks, ["-m", "dtrain", "train", *flags, "--no-progress", "--quiet", "--out", str(folder)], env)
    return json.loads((Path(folder) / "metrics.json").read_text())


def sent_per_rank(metrics: dict, prefixes: str | tuple) -> list[int]:
    """Bytes each rank of a training job sent under the labels starting with ``prefixes`` (the tracer's)."""
    return [sum(o["bytes_sent"] for label, o in mine["operations"].items() if label.startswith(prefixes))
            for mine in metrics["communication"]["per_rank"]]  # fmt: skip


def forward_by_hand(params: list, x, y) -> tuple:
    """A ReLU MLP of three Linear layers (``params``: W1 b1 W2 b2 W3 b3) and its mean softmax cross-entropy on
    ``(x, y)``, written out in NumPy with no graph and no objects: the hand-written floor's forward. Returns the loss,
    its gradient with respect to the logits, and what the backward needs: (z1, h1, z2, h2)."""
    W1, b1, W2, b2, W3, b3 = params
    rows = np.arange(len(y))
    z1 = x @ W1 + b1
    h1 = np.maximum(z1, 0)
    z2 = h1 @ W2 + b2
    h2 = np.maximum(z2, 0)
    z3 = h2 @ W3 + b3
    shifted = z3 - z3.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    s = e.sum(axis=1, keepdims=True)
    loss = (np.log(s[:, 0]) - shifted[rows, y]).mean()
    dz3 = e / s
    dz3[rows, y] -= 1
    dz3 *= 1.0 / len(y)
    return float(loss), dz3, (z1, h1, z2, h2)

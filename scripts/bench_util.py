"""What every benchmark script shares: its hidden worker flags, and how it writes its results.

A benchmark that needs ranks starts itself again under ``mpiexec`` with ``--worker --result FILE`` (the ranks' part:
measure, and rank 0 writes FILE), and the first process gathers the files into one table. At the end it writes the
table as text and the numbers as JSON into its ``--out`` folder, with the command that made them and the machine
they were made on (docs/benchmarks.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path


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


def write_results(out, name: str, data: dict, text: str | None = None) -> list[Path]:
    """Write ``data`` to ``out/name.json`` and, if given, ``text`` to ``out/name.txt``; say so; return the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if text is not None:
        written.append(out / f"{name}.txt")
        written[-1].write_text(text.rstrip("\n") + "\n")
    written.append(out / f"{name}.json")
    written[-1].write_text(json.dumps(data, indent=1))
    print(f"\nwrote {' and '.join(map(str, written))}")
    return written

"""A paradigm is one file that reads as its algorithm and ends with its price (shared/DESIGN.md).

Every registered paradigm's file (and the compressors', compression.py) has one marked line, the same in each; after
it come ``costs`` (held against the tracer) and what the planner asks, and the algorithm above it never calls what is
defined below it. No file of ``dtrain/parallel`` or ``dtrain/collectives`` is over 300 lines.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from dtrain import parallel

ROOT = Path(__file__).resolve().parent.parent / "dtrain"
MARKER = "# === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ==="
PRICE = {"costs", "configurations", "step_time", "activations", "updates_like_single"}
MOST_LINES = 300


def paradigm_files() -> list[Path]:
    files = {Path(inspect.getfile(parallel.get(name))).resolve() for name in parallel.names()}
    return sorted(files | {ROOT / "parallel" / "compression.py"})


@pytest.mark.parametrize("path", paradigm_files(), ids=lambda path: path.name)
def test_the_file_ends_with_its_price(path):
    lines = path.read_text().splitlines()
    marked = [number for number, line in enumerate(lines, 1) if line.strip() == MARKER]
    assert len(marked) == 1, f"{path.name}: {len(marked)} lines mark the price, not 1"
    (marker,) = marked
    defined = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)]
    early = [f"{node.name} (line {node.lineno})" for node in defined if node.name in PRICE and node.lineno < marker]
    assert not early, f"{path.name}: the price comes after line {marker}, not {early}"
    after = {node.name for node in defined if node.lineno > marker}
    used = []
    for node in ast.walk(ast.parse("\n".join(lines[:marker]))):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name in after:
            used.append(f"{name} (line {node.lineno})")
    assert not used, f"{path.name}: the algorithm calls into its price: {used}"


@pytest.mark.parametrize("folder", ["parallel", "collectives"])
def test_no_file_is_longer_than_a_reader_holds(folder):
    long = {path.name: n for path in sorted((ROOT / folder).glob("*.py")) if (n := len(path.read_text().splitlines()))
            > MOST_LINES}  # fmt: skip
    assert not long, f"dtrain/{folder}: over {MOST_LINES} lines: {long}"

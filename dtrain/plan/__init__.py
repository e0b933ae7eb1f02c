"""``dtrain plan``: which paradigm, which grid, how fast and how much memory, for a model on some hardware.

The planner runs nothing. Its three rooms:

    planner.py     every registered paradigm's configurations, checked and priced from the paradigm's own formulas
                   (costs(), activations(), step_time()), the best marked, the table, the JSON, the figure
    hardware.py    the machines it prices on: this one as scripts/calibrate.py measured it, and real clusters'
                   datasheets (hardware.json, every number with its source)
    check.py       ``--check K``: the K best run here under mpiexec, predicted beside measured

:func:`command` is the ``dtrain plan`` command itself.
"""

from __future__ import annotations

import contextlib
import json
import math

from dtrain import parallel, terminal
from dtrain.errors import UserError
from dtrain.plan import check, planner
from dtrain.plan.planner import Model, Row, as_json, figure, plan, price, table, why

__all__ = ["Model", "Row", "as_json", "command", "figure", "plan", "price", "table", "why"]


def command(args) -> int:
    """``dtrain plan``: the table (or --json), the figure (--png), the check (--check)."""
    model = planner.model_of(args)
    only = None
    if args.paradigms:
        only = [name.strip() for name in args.paradigms.split(",") if name.strip()]
        for name in only:
            parallel.get(name)
    machine = planner.machine_of(args, args.ranks)
    rows = planner.plan(model, args.ranks, machine, only, args.tp, args.pp)
    if not any(r.fits for r in rows):
        priced = [r for r in rows if r.memory]
        if not priced:
            raise UserError(f"no configuration can run on --ranks {args.ranks}: "
                            + "; ".join(f"{r.label}: {r.ruled_out}" for r in rows[:4]))  # fmt: skip
        smallest = min(priced, key=lambda r: r.memory["total"])
        raise UserError(
            f"the model fits no configuration on {args.ranks} rank(s) of {machine.name}: the smallest, "
            f"{smallest.label}, needs {planner.nbytes(smallest.memory['total'])} per rank and a rank has "
            f"{planner.nbytes(machine.per_rank_memory(args.ranks))}; give more ranks, a smaller batch, --memory "
            f"{math.ceil(smallest.memory['total'] / planner.GIB)} (GiB) or more, or a smaller model"
        )
    if terminal.to_stdout(args.json) and terminal.to_stdout(args.png):
        raise UserError("--json - and --png -: only one of them can be standard output; give the other a file")
    with contextlib.redirect_stdout(terminal.human(args.json, args.png)):  # (stdout is the data's, if "-")
        print(planner.table(rows, model, args.ranks, machine, args.all))
        if args.json:
            terminal.write_output(
                args.json, json.dumps(planner.as_json(rows, model, args.ranks, machine), indent=1) + "\n"
            )
            if not terminal.to_stdout(args.json):
                print(f"wrote {args.json}")
        if args.png:
            planner.figure(rows, args.png, model.describe())
            if not terminal.to_stdout(args.png):
                print(f"wrote {args.png}")
        if args.check:
            return check.check(rows, model, args.check, machine)
    return 0

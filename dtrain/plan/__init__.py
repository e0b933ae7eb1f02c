"""``dtrain plan``: which paradigm, which grid, how fast and how much memory, for a model on some hardware.

The planner runs nothing. Its three rooms:

    planner.py     every registered paradigm's configurations, checked and priced from the paradigm's own formulas
                   (costs(), activations(), step_time()), the best marked, the table, the JSON, the figure
    hardware.py    the machines it prices on: this one as scripts/calibrate.py measured it, and real clusters'
                   datasheets (hardware.json, every number with its source)
    hostfile.py    ``--hostfile FILE``: the ranks and nodes a hostfile gives; a dtrain cluster's, its link too
    check.py       ``--check K``: the K best run here under mpiexec (or across the hostfile's machines), predicted
                   beside measured

:func:`command` is the ``dtrain plan`` command itself.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math

from dtrain import parallel, terminal
from dtrain.errors import UserError
from dtrain.plan import check, hostfile, planner
from dtrain.plan.planner import Model, Row, as_json, figure, plan, price, table, why

__all__ = ["Model", "Row", "as_json", "command", "figure", "plan", "price", "table", "why"]
DEFAULT_RANKS = 4  # --ranks without a hostfile
HOSTFILE_FLAGS = ("ranks", "ranks_per_node", "inter_bandwidth", "inter_latency")  # what a hostfile gives, unless given


def command(args) -> int:
    """``dtrain plan``: the table (or --json), the figure (--png), the check (--check)."""
    model = planner.model_of(args)
    only = None
    if args.paradigms is not None:
        only = [name.strip() for name in args.paradigms.split(",") if name.strip()]
        if not only:
            raise UserError(f"--paradigms {args.paradigms!r} names no paradigm: give some, e.g. ddp,tp, or leave it "
                            "out for every one")  # fmt: skip
        for name in only:
            parallel.get(name)
    hosts = hostfile.read(args.hostfile) if args.hostfile else None
    ranks = args.ranks if args.ranks is not None else hosts.ranks if hosts else DEFAULT_RANKS
    if hosts and args.check and ranks > hosts.ranks:
        raise UserError(f"--check runs on {hosts.path}'s {hosts.ranks} slot(s): --ranks {ranks} would not fit; give "
                        f"--ranks {hosts.ranks} or fewer")  # fmt: skip
    machine = planner.machine_of(args, ranks, hosts)
    named = args.configuration
    if named:
        known = planner.labels(model, ranks, machine, only)
        for label in named:
            if label not in known:
                near = difflib.get_close_matches(label, known, n=3, cutoff=0.4) or known[:3]
                raise UserError(f"--configuration {label!r} is not one of this plan's: "
                                f"{', '.join(map(repr, near))}, ... (the labels in dtrain plan's table)")  # fmt: skip
    rows = planner.plan(model, ranks, machine, only, args.tp, args.pp, named)
    if not any(r.fits for r in rows):
        priced = [r for r in rows if r.memory]
        if not priced:
            raise UserError(f"no configuration can run on --ranks {ranks}: "
                            + "; ".join(f"{r.label}: {r.ruled_out}" for r in rows[:4]))  # fmt: skip
        smallest = min(priced, key=lambda r: r.memory["total"])
        raise UserError(
            f"the model fits no configuration on {ranks} rank(s) of {machine.name}: the smallest, "
            f"{smallest.label}, needs {planner.nbytes(smallest.memory['total'])} per rank and a rank has "
            f"{planner.nbytes(machine.per_rank_memory(ranks))}; give more ranks, a smaller batch, --memory "
            f"{math.ceil(smallest.memory['total'] / planner.GIB)} (GiB) or more, or a smaller model"
        )
    if terminal.to_stdout(args.json) and terminal.to_stdout(args.png):
        raise UserError("--json - and --png -: only one of them can be standard output; give the other a file")
    with contextlib.redirect_stdout(terminal.human(args.json, args.png)):  # (stdout is the data's, if "-")
        if hosts:
            given = [f"--{name.replace('_', '-')} {getattr(args, name):g}" for name in HOSTFILE_FLAGS
                     if getattr(args, name) is not None]  # fmt: skip
            instead = f"; given instead: {', '.join(given)}" if given else ""
            print(terminal.paragraph(f"hardware from {hosts.source}{instead}", hanging="  "))
        print(planner.table(rows, model, ranks, machine, args.all, hostfile=hosts.path if hosts else None))
        if args.json:
            terminal.write_output(args.json, json.dumps(planner.as_json(rows, model, ranks, machine), indent=1) + "\n")
            if not terminal.to_stdout(args.json):
                print(f"wrote {args.json}")
        if args.png:
            planner.figure(rows, args.png, model.describe())
            if not terminal.to_stdout(args.png):
                print(f"wrote {args.png}")
        if args.check:  # (the configurations named, every one; else the K best)
            count = len(named) if named else args.check
            return check.check(rows, model, count, machine, hosts, everyone=bool(named))
    return 0

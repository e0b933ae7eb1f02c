"""The lessons' one toolkit: start, refuse bad arguments, explain, time, check a claim on every rank, and end.

A lesson parses its own arguments before any rank talks to another and refuses bad ones before any work; it prints
on rank 0 (in a lesson that is a plain process, such as 10, 11 and 12, that is the process itself), but checks its
claims on every rank, so that every rank agrees on the verdict and the exit status (a rank that exits non-zero alone
aborts the whole job; all of them alike just exit, see dtrain.comm.run)::

    parser = argparse.ArgumentParser(description="Lesson N: ...")
    parser.add_argument("--json", metavar="PATH", help="write every measurement to this file")
    args, world, p, rank = parse_and_start(parser)                          # parses, then the world
    refuse_bad_arguments([(args.epochs < 1, "--epochs must be >= 1")])     # exit status 2, said once
    checks = Checks(world)
    heading("1. ...")                                                       # a part's title, after an empty line
    say("what the numbers below mean")                                      # a paragraph, wrapped to the terminal
    table(["epoch", "loss"], rows, left=())                                 # on rank 0, fitted to the terminal
    checks.ok("every stage follows single's loss curve", worst < 1e-10)    # "   OK: ..." (or "   FAIL: ...")
    seconds = slowest_seconds(world, paradigm.step, x, y)                  # the slowest rank's time of a step
    ...
    conclude(args.json, results, checks)   # --json (with every claim's verdict), then "all checks passed: yes"
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from dtrain import terminal
from dtrain.comm import mpi
from dtrain.comm.names import MAX, MIN

if TYPE_CHECKING:
    from dtrain.config import TrainConfig


def parse_and_start(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, object, int, int]:
    """Parse the lesson's arguments, then set up how a failure ends the job; returns ``(args, world, p, rank)``: the
    parsed arguments, MPI.COMM_WORLD, its size and this rank. Arguments come first, so ``--help`` and a refused
    argument happen before any rank talks to another (each rank parses the same command line alike)."""
    args = parser.parse_args()
    mpi.install_excepthook()  # a failure ends every rank, said once (under a plain mpiexec too, not only dtrain launch)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return args, world, world.Get_size(), world.Get_rank()


def refuse(why: str) -> None:
    """End the lesson now, before any work, because of its arguments (or the ranks it was started on): ``why`` on one
    line of stderr and exit status 2, as argparse refuses a flag it does not know. Every rank finds the same, so the
    job ends without an abort and says it once (:func:`dtrain.comm.mpi.refuse_arguments`)."""
    mpi.refuse_arguments(why)


def refuse_bad_arguments(problems: list[tuple[object, str]]) -> None:
    """``problems``: pairs (bad, why), a condition on the arguments and what the argument must be. If any is bad,
    :func:`refuse` with "bad arguments: " and the why of every bad one, joined by "; ": all that is wrong, at once."""
    said = [why for bad, why in problems if bad]
    if said:
        refuse("bad arguments: " + "; ".join(said))


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """``--device cpu|gpu``: where the lesson's models, batches and gradients live (gpu: CuPy arrays, each rank on
    GPU local rank % GPUs, as ``dtrain train --device gpu``)."""
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the lesson's arrays live: gpu needs CuPy and a GPU (default %(default)s)",
    )


def lesson_xp(args: argparse.Namespace, world):
    """The array module of the lesson's own models and buffers (``numpy``, or ``cupy`` on GPU local rank % GPUs),
    once its arguments are parsed: a missing GPU is refused on every rank alike, before any message."""
    import numpy as np

    device = getattr(args, "device", "cpu")
    if device == "cpu":
        return np
    from dtrain import backend

    missing = backend.gpu_missing()
    if missing:
        refuse(missing)
    from dtrain.train import select_rank_gpu

    select_rank_gpu(world)  # (GPU local rank % GPUs, as dtrain train)
    return backend.get_xp("gpu")


def big_model_parser(description: str, *, epochs: int, trained_in: int, model: str, hidden: str, big_batch: int,
                     steps: int, timed_in: int) -> argparse.ArgumentParser:  # fmt: skip
    """The arguments of a lesson that trains a small model on digits (in section ``trained_in``) and times a big
    ``model`` ("wide", "big", in section ``timed_in``): --epochs and --batch-size of the training runs, --hidden,
    --big-batch and --steps of the timed one, and --json. big_model_widths() checks them once MPI has started."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=epochs,
                        help=f"epochs of section {trained_in}'s training runs (default %(default)s)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=48, help="global batch on digits (default %(default)s)")
    parser.add_argument("--hidden", default=hidden, help=f"the {model} model's hidden widths (default %(default)s)")
    parser.add_argument("--big-batch", type=int, default=big_batch,
                        help=f"global batch of the {model} model (default %(default)s)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=steps,
                        help=f"timed steps per contender in section {timed_in} (default %(default)s)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write every measurement to this file")
    return parser


def big_model_widths(args: argparse.Namespace, p: int, split: bool) -> tuple[int, ...]:
    """The big model's hidden widths (``--hidden``), once big_model_parser's arguments are checked on ``p`` ranks:
    each rank takes an equal slice of both batches (and, if ``split``, of every width); a refusal says what is wrong
    and ends the job."""
    widths = whole_numbers(args.hidden)
    slices = "" if split else " (each takes an equal slice)"
    widths_must = f"and divisible by {p} (they are split over the ranks; got" if split else "(got"
    refuse_bad_arguments([(
        args.batch_size % p or args.big_batch % p or args.epochs < 1 or args.steps < 2 or not widths
        or min(widths) < 1 or (split and any(h % p for h in widths)),
        f"--batch-size {args.batch_size} and --big-batch {args.big_batch} must be divisible by the {p} ranks{slices}, "
        f"--epochs >= 1, --steps >= 2, --hidden widths >= 1 {widths_must} {args.hidden!r})",
    )])  # fmt: skip
    return widths


def whole_numbers(text: str) -> tuple[int, ...]:
    """The comma-separated whole numbers of an argument such as ``--hidden 2048,2048``; () if it is not such a list
    (the lesson then refuses the argument)."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        return ()


def say(text: str, indent: str = "   ", hanging: str | None = None) -> None:
    """Print (on rank 0) a paragraph of explanation, wrapped to the terminal: each line indented like the tables
    (``indent``), its second and later lines by ``hanging`` if given (an item that stands out: ``hanging`` deeper;
    lesson 2's paragraphs: ``indent`` "", ``hanging`` " "). In a lesson that is one process, rank 0 is that process."""
    mpi.print0(terminal.paragraph(text, indent, hanging))


def heading(text: str) -> None:
    """Print (on rank 0) a part's title, after an empty line, wrapped to the terminal (its later lines standing in by
    three, like the part's paragraphs)."""
    mpi.print0("\n" + terminal.paragraph(text, hanging="   "))


def table(header: list[str], rows: list[list[str]], left=(0,), **fitting) -> None:
    """Print (on rank 0) a table fitted to the terminal (:func:`dtrain.terminal.table`) and indented like the rest:
    the ``left`` columns aligned left (text), the others right (numbers); ``fitting``: terminal.table's other
    keywords (keys, notes, groups, wrap; and indent, three spaces unless given)."""
    mpi.print0(terminal.table(header, rows, left=left, **{"indent": "   ", **fitting}))


def everywhere(flag: bool, comm=None) -> bool:
    """True on every rank of ``comm`` (default: the world) iff ``flag`` is true on every rank."""
    return (mpi.world() if comm is None else comm).allreduce(int(bool(flag)), op=MIN) == 1


def slowest_seconds(comm, work, *args) -> float:
    """The seconds ``work(*args)`` took on the slowest rank of ``comm``, what a synchronous step costs: the ranks start
    it together (a barrier), each times its own call, and every rank gets the longest (every rank must call this). A
    GPU call returns before the GPU has done its work: what ``work`` returns (a step's loss), if anything, is read
    before the clock stops, which waits for it; else ``work`` must wait itself (lesson 2 synchronises the stream)."""
    comm.Barrier()
    start = time.perf_counter()
    result = work(*args)
    if result is not None:
        float(result)  # (on a GPU, reading a result waits for the work queued to compute it)
    return comm.allreduce(time.perf_counter() - start, op=MAX)


def sleeping_barrier(comm) -> None:
    """A barrier whose waiters sleep: a rank left out of a run must not spin on a core that the run needs."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


class Checks:
    """The lesson's claims, each checked on every rank of ``comm`` (default: the world; a lesson that is one process
    is a world of one) and printed by rank 0 as "   OK: claim", or "   FAIL: claim" if it does not hold. ``verdicts``
    keeps them ({claim: passed}, in order): conclude() writes them to the --json file, which is what tests read."""

    def __init__(self, comm=None):
        self.comm, self.verdicts = comm, {}

    @property
    def passed(self) -> bool:
        return all(self.verdicts.values())

    def ok(self, claim: str, flag: bool, note: str = "") -> bool:
        """``claim`` holds iff ``flag`` holds on every rank (every rank must call this); printed on rank 0 as
        "   OK: claim" (or "   FAIL: claim"), then ``note``. Returns the verdict, the same on every rank."""
        return self.ok_here(claim, everywhere(flag, self.comm), note)

    def ok_here(self, claim: str, flag: bool, note: str = "") -> bool:
        """A claim that only the calling rank can check (rank 0, on the figures it gathered), recorded and printed
        there without communicating; conclude() gives every rank the verdict."""
        flag = self.verdicts.get(claim, True) and bool(flag)  # (a claim made again holds only if it held each time)
        self.verdicts[claim] = flag
        word = "OK" if flag else "FAIL"
        mpi.print0(terminal.paragraph(f"{word}: {claim}{note}", "   ", " " * (3 + len(word) + 2)), comm=self.comm)
        return flag


def single_reference(config: TrainConfig, world) -> tuple[dict | None, object]:
    """The run every parallel run is compared against: ``train(config)`` (a "single" config) on rank 0 alone, while
    the other ranks sleep. Returns its metrics on rank 0 (None on the others) and rank 0's own communicator
    (COMM_NULL on the others), for more work on rank 0 alone."""
    from mpi4py import MPI

    from dtrain.train import train  # here, not on top: lesson 2 does not train

    rank = world.Get_rank()
    alone = world.Split(0 if rank == 0 else MPI.UNDEFINED, rank)
    single = train(config, alone) if rank == 0 else None
    sleeping_barrier(world)
    return single, alone


def conclude(json_path: str | None, results: dict, checks: Checks, started: float | None = None,
             note: str = "") -> None:  # fmt: skip
    """The lesson's last lines: write its measurements ``results`` and its claims' verdicts (under "checks") to
    ``json_path`` (--json; rank 0 writes), then say whether all its checks passed (and ``note``, in parentheses), and
    exit 1 on every rank if not. ``started``: the lesson's time.perf_counter() at its start; the seconds since then
    go to --json ("seconds") and are said before the verdict."""
    comm = mpi.world() if checks.comm is None else checks.comm
    passed = everywhere(checks.passed, comm)  # (a claim checked on rank 0 alone is known there only)
    took = ""
    if started is not None:
        seconds = time.perf_counter() - started
        results, took = {**results, "seconds": seconds}, f"\n(the lesson took {seconds:.0f} s)"
    if json_path and comm.Get_rank() == 0:
        with open(json_path, "w") as f:
            json.dump({**results, "checks": checks.verdicts}, f, indent=1)
        print(f"\nmeasurements written to\n  {json_path}")  # (a path cannot wrap: a line of its own)
    verdict = f"all checks passed: {'yes' if passed else 'NO'}" + (f" ({note})" if note else "")
    mpi.print0(took + "\n" + terminal.paragraph(verdict, hanging="   "), comm=comm)
    if not passed:
        comm.Barrier()  # rank 0 has said what failed before any rank leaves (a non-zero exit aborts the job)
        raise SystemExit(1)  # on every rank (the verdict is the same everywhere), so mpiexec's status says so


def against_single(checks: Checks, single: dict | None, runs: dict, prefixes: tuple, what: str, costs: str,
                   why: str) -> dict | None:  # fmt: skip
    """A lesson's training on real ranks, checked: on rank 0 (which holds the metrics), every run's loss curve beside
    ``single``'s and every rank's bytes per step (the traffic labelled with ``prefixes``) beside the run's cost
    function, two tables fitted to the terminal, then ``why``; on every rank, the claims that every ``what`` follows
    single's loss curve (to 1e-10) and that every rank's bytes per step equal ``costs`` (``costs()["sent_per_step"]``).
    Returns the curves on rank 0, None on the others."""
    from dtrain.data import steps_per_epoch

    curves, training_ok, bytes_ok = None, True, True
    if checks.comm.Get_rank() == 0:
        epochs = len(single["epochs"])
        steps = epochs * steps_per_epoch(single["dataset"]["train_samples"], single["config"]["batch_size"])
        curves = {"single": [e["train_loss"] for e in single["epochs"]]}
        curves.update({label: [e["train_loss"] for e in metrics["epochs"]] for label, metrics in runs.items()})
        table(["epoch", *curves], [[f"{e + 1}", *(f"{curves[label][e]:.14f}" for label in curves)]
                                   for e in range(epochs)], left=())  # fmt: skip
        worst = max(abs(a - b) / abs(b) for c in curves.values() for a, b in zip(c, curves["single"]))
        training_ok = worst < 1e-10
        say(f"largest relative difference from single: {worst:.1e}")
        print()
        say("bytes sent per step by each rank (the tracer), and whether they equal costs() on every rank:")
        cells = []
        for label, metrics in runs.items():
            sent = [sum(o["bytes_sent"] for name, o in mine["operations"].items() if name.startswith(prefixes))
                    / steps for mine in metrics["communication"]["per_rank"]]  # fmt: skip
            exact = sent == metrics["costs"]["sent_per_step"]
            bytes_ok = bytes_ok and exact
            cells.append([label, *(f"{s:,.0f}" for s in sent), "yes" if exact else "NO"])
        ranks = len(cells[0]) - 2
        table(["", *(f"rank {r}" for r in range(ranks)), "= costs()"], cells, left=(0, ranks + 1))
        say(why)
    checks.ok(f"every {what} follows single's loss curve", training_ok)
    checks.ok(f"every rank's bytes per step equal {costs}", bytes_ok)
    return curves

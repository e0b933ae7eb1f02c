"""``dtrain tour``: the whole subject in one command.

The tour trains one model, the MLP 64-64-64-64-10, on the shipped 8x8 digits with every paradigm in turn, each a
job of its own on ``--ranks`` ranks (4 by default) started with this environment's ``mpiexec``: ``single`` on one
process first (the reference), then ddp with a ring all-reduce and with a hierarchical one over 2 emulated nodes,
central storage, synchronous and asynchronous parameter servers (the latter with a straggler), local SGD, gossip,
ZeRO stage 3, tensor parallelism, a 1F1B pipeline, a grid of tensor-parallel pipeline stages, and spmd's
dp-megatron layouts on a 2-axis mesh (their collectives derived, not written). Every run has the
same model, seed, epochs and global batch (a multiple of the ranks and of the parameter servers' workers), so their
curves compare. Then one table says, per paradigm, what it bought and what it paid:

* the final test accuracy and the run's wall time (its samples/s are in tour.json);
* its measured time per training step (the median of its epochs' after the first) beside the planner's prediction
  for the same configuration on this machine (``step_time()``, :mod:`dtrain.plan`), and, once every run is done, a
  line that says whether the planner's first choice among the runs that make single's updates was the measured
  fastest;
* the bytes the busiest rank sent per step, measured by the tracer (training traffic only: not evaluation's, not a
  checkpoint's, not the initial broadcast of the weights), beside the paradigm's own prediction (``costs()``);
* the messages the busiest rank sent per step;
* the bytes of parameters, gradients and optimizer state the fullest rank held, read off its arrays, beside
  ``costs()``'s prediction;
* what to notice, in a line.

Everything lands in one folder (``runs/tour/`` by default): each run's ``metrics.json`` and output, the table as
``tour.txt``, the numbers as ``tour.json`` and a figure, ``tour.png``. A run that fails shows its error in its row;
the tour goes on, and ends with a non-zero status. Each job has ``--timeout`` seconds, its ranks' watchdog half of
that, so nothing hangs; Ctrl-C stops the job that runs and the tour.

``--hostfile FILE`` runs every job on FILE's hosts (:mod:`dtrain.launch.hosts`), a cluster's from ``dtrain cluster
up`` among them: its nodes are reached as ``dtrain launch --hostfile`` reaches them, and the hierarchical all-reduce's
nodes are the hosts the ranks land on. The header line says where the jobs ran; ``plan ms`` is the planner's for
those machines (``dtrain plan --hostfile``: a cluster's link between its nodes, this machine inside each).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtrain import backend, kernels, parallel, report, terminal
from dtrain.config import TrainConfig, flag_words
from dtrain.course import tour_notes
from dtrain.errors import ConfigError, MissingPackage, UserError
from dtrain.launch import cluster, flavours, jobs, mpiexec
from dtrain.launch.hosts import Host, parse_hostfile, total_slots

HIDDEN = (64, 64, 64)  # one model for every run: four Linear layers, so a pipeline can cut four stages
COMMON = {"dataset": "digits", "hidden": HIDDEN, "seed": 0}
DEFAULT_RANKS, DEFAULT_EPOCHS, DEFAULT_TIMEOUT_S = 4, 20, 120.0
KERNELS = kernels.ENV_VAR  # NumPy's reductions unless said otherwise: Numba's start-up would be most of a short job
EPOCH_LINE = re.compile(r"^epoch\s+(\d+)/")  # what rank 0 prints at the end of each epoch


@dataclass
class Entry:
    """One run of the tour: its name (for ``--paradigms``), its row's label, its flags and its ranks."""

    name: str
    label: str
    options: dict  # TrainConfig's fields and paradigm flags, as a TrainConfig takes them
    ranks: int
    skip: str | None = None  # why it cannot run on these ranks
    explicit: bool = False  # asked for by name

    def config(self, batch: int, epochs: int) -> TrainConfig:
        return TrainConfig(**COMMON, batch_size=batch, epochs=epochs, **self.options)

    def flags(self, batch: int, epochs: int) -> list[str]:
        """The ``dtrain train`` command line of :meth:`config`."""
        return flag_words({**COMMON, "batch_size": batch, "epochs": epochs, **self.options})


def entries(ranks: int, hosts: list[Host] | None = None) -> dict[str, Entry]:
    """The tour on ``ranks`` ranks (on ``hosts``, if given), in the lessons' order; an entry that cannot fit them
    says why (``skip``)."""
    per_node = -(-ranks // 2)  # two emulated nodes
    nodes = f"2 nodes of {per_node}" + ("" if ranks == 2 * per_node else f" and {ranks - per_node}")
    landed = placement(ranks, hosts)
    if len(landed) > 1:  # the ranks land on several hosts: those are the nodes (blocks of per_node where they are)
        per_node = landed[0] if max(landed[:-1]) == min(landed[:-1]) >= landed[-1] else None  # (None: MPI's nodes)
        nodes = f"{len(landed)} nodes of " + (str(landed[0]) if len(set(landed)) == 1 else
                                               ", ".join(map(str, landed[:-1])) + f" and {landed[-1]}")  # fmt: skip
    stages = max(d for d in range(1, 5) if ranks % d == 0)  # a pipeline of up to four stages, one Linear layer each
    tp = ranks & -ranks  # the largest power of two that divides the ranks (the widths, 64, must divide by it)
    workers = ranks - 1
    straggler = {"slow_rank": 1, "slow_factor": 3} if workers >= 2 else {}
    e = [
        Entry("single", "single (1 process)", {"paradigm": "single"}, 1),
        Entry("ddp-ring", "ddp ring", {"paradigm": "ddp", "allreduce": "ring"}, ranks),
        Entry("ddp-hier", f"ddp hierarchical ({nodes if ranks > 1 else '1 node'})",
              {"paradigm": "ddp", "allreduce": "hierarchical", **({"ranks_per_node": per_node} if per_node else {})},
              ranks),
        Entry("central-storage", "central-storage", {"paradigm": "central-storage"}, ranks),
        Entry("ps-sync", f"ps-sync (1 server, {workers} worker{'s' * (workers > 1)})" if workers else "ps-sync",
              {"paradigm": "ps-sync"}, ranks),
        Entry("ps-async", "ps-async (rank 1 3x slower)" if straggler else "ps-async",
              {"paradigm": "ps-async", **straggler}, ranks),
        Entry("ddp-fp16", "ddp fp16", {"paradigm": "ddp", "compress": "fp16"}, ranks),
        Entry("ddp-topk", "ddp top-k 1%", {"paradigm": "ddp", "compress": "topk", "compress_ratio": 0.01}, ranks),
        Entry("ddp-powersgd", "ddp PowerSGD r=2", {"paradigm": "ddp", "compress": "powersgd", "powersgd_rank": 2},
              ranks),
        Entry("local-sgd", "local-sgd (H = 8)", {"paradigm": "local-sgd", "sync_every": 8}, ranks),
        Entry("gossip", "gossip (ring)", {"paradigm": "gossip", "topology": "ring"}, ranks),
        Entry("zero-3", "zero stage 3", {"paradigm": "zero", "zero_stage": 3}, ranks),
        Entry("tp", "tp" if tp == 1 else f"tp {tp}" if tp == ranks else f"tp (dp{ranks // tp} x tp{tp})",
              {"paradigm": "tp", "tp": tp}, ranks,
              None if tp > 1 else "tensor parallelism needs an even number of ranks (the widths are 64)"),
        Entry("pp", "pp 1f1b" + (f", {stages} stages" if stages > 1 else "") + (f" x dp{ranks // stages}" if
              1 < stages < ranks else ""), {"paradigm": "pp", "pp": stages, "schedule": "1f1b"}, ranks,
              None if stages > 1 else "a pipeline needs 2 ranks or more"),
        Entry("grid", f"grid dp{ranks // 4} x tp2 x pp2" if ranks % 4 == 0 else "grid tp2 x pp2",
              {"paradigm": "pp", "dp": ranks // 4, "tp": 2, "pp": 2}, ranks,
              None if ranks % 4 == 0 else "a grid of tp 2 x pp 2 needs a multiple of 4 ranks"),
        Entry("spmd", f"spmd dp-megatron (mesh x={ranks // 2},y=2)",
              {"paradigm": "spmd", "sharding": "dp-megatron", "mesh": f"x={ranks // 2},y=2"}, ranks,
              None if ranks % 2 == 0 else "a mesh of x by y=2 needs an even number of ranks"),
    ]  # fmt: skip
    return {entry.name: entry for entry in e}


def placement(ranks: int, hosts: list[Host] | None) -> list[int]:
    """How many of ``ranks`` ranks each host gets, filled in order as mpiexec fills them (the hosts used only)."""
    landed, left = [], ranks
    for host in hosts or ():
        if left > 0 and host.slots > 0:
            landed.append(min(host.slots, left))
            left -= landed[-1]
    return landed  # (more ranks than slots: refused before this is asked)


def on_hosts(hostfile: str) -> tuple[list[Host], str]:
    """The hosts of ``hostfile`` and where they are, in words, checked before any job starts: a hostfile, and, a
    cluster's, one that is up and that this mpiexec reaches (:func:`dtrain.launch.mpiexec.flags`; one line if not)."""
    hosts = parse_hostfile(hostfile)
    mpiexec.flags(hosts)
    if hosts[0].cluster is not None:
        c, slots = cluster.status(hosts[0].cluster), {h.slots for h in hosts}  # (a killed node: out of the file)
        each = f"x {hosts[0].slots}" if len(slots) == 1 else f"with {total_slots(hosts)}"
        return hosts, f"cluster {c.name} ({len(hosts)} node(s) {each} slot(s), link {c.link or 'unshaped'})"
    listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts[:4]) + (", ..." if len(hosts) > 4 else "")
    return hosts, f"the hosts of {hostfile} ({listed})"


def global_batch(ranks: int) -> int:
    """The batch every run splits: the multiple nearest 96 of the ranks, of the parameter servers' workers and of a
    pipeline's 4 micro-batches."""
    step = math.lcm(ranks, max(ranks - 1, 1), 4)
    return max(step, round(96 / step) * step)


def choose(names: list[str] | None, ranks: int, batch: int, epochs: int, hosts=None) -> list[Entry]:
    """The entries to run: the tour's (``names`` None) or those named, each checked by its paradigm for these ranks
    before anything is launched. A named one that cannot run is a :class:`UserError`; one of the tour's is skipped."""
    tour = entries(ranks, hosts)
    if names is None:
        chosen = list(tour.values())
    elif not names:
        raise UserError(f"--paradigms names none: give some of the tour's ({', '.join(tour)}), or leave it out for "
                        "the whole tour")  # fmt: skip
    else:
        chosen = []
        for name in names:
            if name not in tour and name not in parallel.names():
                raise UserError(f"--paradigms: {name!r} is neither one of the tour's ({', '.join(tour)}) nor a "
                                f"registered paradigm ({', '.join(parallel.names())})")  # fmt: skip
            entry = tour.get(name) or Entry(name, name, {"paradigm": name}, 1 if name == "single" else ranks)
            chosen.append(Entry(**{**vars(entry), "explicit": True}))
    for entry in chosen:
        if entry.skip is None:
            try:
                parallel.get(entry.options["paradigm"]).check(entry.config(batch, epochs), entry.ranks)
            except ConfigError as exc:
                entry.skip = str(exc)
        if entry.skip and entry.explicit:
            raise UserError(f"--paradigms {entry.name} cannot run on --ranks {ranks}: {entry.skip}")
    return chosen


@dataclass
class Run:
    """What became of one entry: its metrics, or why it did not run or failed."""

    entry: Entry
    metrics: dict | None = None
    error: str | None = None
    job_s: float = 0.0
    command: list[str] = field(default_factory=list)


def run_entry(entry: Entry, folder: Path, batch: int, epochs: int, timeout: float, env: dict, progress,
              hostfile: str | None = None, hosts: list[Host] | None = None) -> Run:  # fmt: skip
    """One job: ``dtrain train`` on the entry's ranks under ``mpiexec`` (on ``hosts``, read from ``hostfile``, if
    given), its output in ``folder``; stopped after ``timeout`` seconds (its ranks' watchdog after half of that, with
    a report)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in ("metrics.json", "stdout.txt", "stderr.txt"):
        (folder / old).unlink(missing_ok=True)
    target = ["-m", "dtrain", "train", *entry.flags(batch, epochs), f"--out={folder}", "--timeout",
              f"{timeout / 2:g}", "--no-progress"]  # fmt: skip  # (--out=: a folder named -x is no option)
    where = ["--hostfile", str(hostfile)] if hosts else []
    run = Run(entry, command=["dtrain", "launch", "-n", str(entry.ranks), *where, *target])
    env = mpiexec.environment(mpiexec.ranks_per_host(entry.ranks, hosts), env)
    cmd, started = mpiexec.command(entry.ranks, target, hosts=hosts, env=env), time.monotonic()
    with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
        with jobs.Job(cmd, "dtrain tour", env=env, stdout=out, stderr=err, text=True) as job:
            while job.process.poll() is None:  # (Ctrl-C: JobInterrupted from here; the Job stops every rank)
                if time.monotonic() - started > timeout:
                    job.stop(signal.SIGKILL)
                    run.error = f"timed out after {timeout:g} s"
                    break
                progress(sum(bool(EPOCH_LINE.match(line)) for line in (folder / "stdout.txt").open()))
                time.sleep(0.1)
    run.job_s = time.monotonic() - started
    if run.error is None and job.process.returncode != 0:
        run.error = one_line_error((folder / "stderr.txt").read_text(), job.process.returncode)
    elif run.error is None:
        run.metrics = report.load_metrics(folder)
    return run


def one_line_error(stderr: str, status: int) -> str:
    """Why a job failed, in a line: the watchdog's report's first line, else the last ``dtrain: error`` line, else
    the last line that names an exception (a traceback's), else its exit status."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for pick in (lambda s: s.startswith("dtrain watchdog:"), lambda s: re.search(r"dtrain( \w+)*: error", s)):
        found = [line for line in lines if pick(line)]
        if found:
            return found[0] if "watchdog" in found[0] else found[-1]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b.*", line)]
    return raised[-1] if raised else f"exited with status {status}"


def tour(ranks: int, names: list[str] | None, epochs: int, out: str, timeout: float, device: str = "cpu",
         hostfile: str | None = None) -> int:  # fmt: skip
    """The ``dtrain tour`` command: the runs, then the table (printed and written), tour.json and the figure.
    ``device="gpu"``: every run's arrays on the GPU (its ranks sharing the node's GPUs, ``rank % GPUs``).
    ``hostfile``: every job on its hosts (a cluster's too), ``ranks`` at most their slots."""
    if ranks < 1 or epochs < 1 or not 0 < timeout < math.inf:
        raise UserError(f"--ranks and --epochs must be >= 1 and --timeout > 0 (got {ranks}, {epochs}, {timeout:g})")
    if not str(out).strip():  # (Path("") is the working directory: every run's folder would land in it)
        raise UserError("--out has an empty name: give a folder (default runs/tour)")
    missing = backend.gpu_missing() if device == "gpu" else None
    if missing:
        raise UserError(missing)
    hosts, where = on_hosts(hostfile) if hostfile else (None, "this machine")
    if hosts and ranks > total_slots(hosts):
        raise UserError(f"--ranks {ranks} is more than the {total_slots(hosts)} slots of {where}: give --ranks "
                        f"{total_slots(hosts)} or fewer, or a hostfile with more slots")  # fmt: skip
    started, batch = time.monotonic(), global_batch(ranks)
    chosen = choose(names, ranks, batch, epochs, hosts)
    if device != "cpu":
        chosen = [dataclasses.replace(e, options={**e.options, "device": device}) for e in chosen]
    try:
        plt = report.pyplot()
    except MissingPackage as exc:  # the table and the metrics do not need it
        plt, no_figure = None, str(exc)
    folder, env = Path(out), {**os.environ}
    env.setdefault(KERNELS, "numpy")
    mpi_name = flavours.detect(mpiexec.path())
    mpiexec.flags(hosts)  # what this MPI needs said (run as root) is said now, not in a progress line
    print(terminal.paragraph(
        f"dtrain tour: digits, MLP {'-'.join(map(str, (64, *HIDDEN, 10)))}, global batch {batch}, {epochs} "
        f"epoch{'s' * (epochs != 1)}, {ranks} rank{'s' * (ranks != 1)}, {mpi_name}, {KERNELS}={env[KERNELS]}, on the "
        f"{device.upper()}" + (f", every job on {where}" if hosts else "") + f"; every run's metrics in {folder}/"
        + (". plan ms: the planner given the cluster's link" if hosts and hosts[0].cluster else ""),
        hanging="  "), flush=True)  # fmt: skip
    runs = []
    for i, entry in enumerate(chosen, 1):
        head = f"[{i}/{len(chosen)}] {entry.label}"
        if entry.skip:
            print(terminal.paragraph(f"{head} ... skipped: {entry.skip}", hanging="    "), flush=True)
            runs.append(Run(entry, error=entry.skip))
            continue
        bar = terminal.Bar(epochs, head, unit="epoch")  # (a terminal: a bar of the run's epochs while it runs)
        if bar.bar is None:
            print(head, end="", flush=True)  # (no bar: the line's start now, its end once the run is done)
        with bar:
            run = run_entry(entry, folder / entry.name, batch, epochs, timeout, env, bar.update, hostfile, hosts)
        runs.append(run)
        done = f"{100 * run.metrics['final']['test_accuracy']:.2f}%" if run.metrics else f"FAILED: {run.error}"
        line = f"{head if bar.bar else ''} ... {done} ({run.job_s:.1f} s)"
        print(terminal.paragraph(line, hanging="    ") if bar.bar else line, flush=True)
    summary, footnotes = rows(runs, planned_on(device, hostfile))
    print(f"\n{table(summary, footnotes)}\n\n(the tour took {time.monotonic() - started:.0f} s)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tour.txt").write_text(table(summary, footnotes, width=None) + "\n")  # (a file: full width)
    meta = {"ranks": ranks, "epochs": epochs, "batch_size": batch, "hidden": list(HIDDEN), "dataset": "digits",
            "device": device, "hostfile": hostfile, "where": where,
            "tour_s": time.monotonic() - started}  # fmt: skip
    (folder / "tour.json").write_text(json.dumps({**meta, "runs": summary}, indent=1, default=str) + "\n")
    written = [folder / "tour.txt", folder / "tour.json"]
    if plt is not None and any(r.metrics for r in runs):
        done = {r["label"]: r for r in summary if "error" not in r}
        written.append(report.plot_paradigms(plt, done, folder / "tour.png", reference=chosen[0].label))
    print(terminal.paragraph(f"wrote {', '.join(map(str, written))}" + ("" if plt else f" (no figure: {no_figure})"),
                             hanging="  "))  # fmt: skip
    failed = [r.entry.name for r in runs if r.error and not r.entry.skip]
    if failed:
        print(f"dtrain tour: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def planned_on(device: str, hostfile: str | None):
    """The hardware the planner prices the runs on: this machine's preset for ``device`` (None if it has none), as
    the hostfile's machines make it (``dtrain plan --hostfile``: a cluster's link between its nodes)."""
    from dtrain.plan import hostfile as hostfiles
    from dtrain.plan.hardware import for_device

    try:
        machine = for_device(device)
    except ConfigError:  # (no preset for this device: the table says "-")
        return None
    return hostfiles.machine(machine, hostfiles.read(hostfile)) if hostfile else machine


def rows(runs: list[Run], machine=None) -> tuple[list[dict], list[str]]:
    """tour.json's rows, each run's numbers (:func:`dtrain.report.run_summary`) and what to notice, or its error;
    and a footnote for each run whose measured bytes differ from its ``costs()``."""
    done = {run.entry.name: report.run_summary(run.metrics) for run in runs if run.metrics}
    context, out, footnotes = tour_notes.Context(done.get("single")), [], []
    for run in runs:
        status = "ok" if run.metrics else "skipped" if run.entry.skip else "FAILED"
        row = {"name": run.entry.name, "label": run.entry.label, "ranks": run.entry.ranks, "status": status}
        if run.metrics is None:
            row["error"] = run.error
        else:
            s = done[run.entry.name]
            row.update(s, note=tour_notes.note(run.entry.name, s, run.metrics, context), job_s=run.job_s,
                       command=" ".join(run.command), **step_times(run, machine))  # fmt: skip
            footnotes.append(tour_notes.footnote(run.entry.name, run.entry.label, s, run.metrics))
        out.append(row)
    return out, [f for f in footnotes if f]


def step_times(run: Run, machine=None) -> dict:
    """The run's measured seconds per training step (the median of its epochs' after the first, which warms up), the
    planner's prediction for its configuration on ``machine`` (:func:`planned_on`; None: none), and whether its
    steps are single's."""
    from dtrain.data import steps_per_epoch

    m = run.metrics
    steps = steps_per_epoch(m["dataset"]["train_samples"], m["config"]["batch_size"])
    times = [e["train_time_s"] / steps for e in m["epochs"]]
    kind = parallel.get(m["config"]["paradigm"])
    config = run.entry.config(m["config"]["batch_size"], len(m["epochs"]))
    sizes = [m["dataset"]["features"], *HIDDEN, m["dataset"]["classes"]]
    predicted = None if machine is None else sum(kind.step_time(sizes, run.entry.ranks, config, machine).values())
    return {"step_s": statistics.median(times[1:] or times), "predicted_step_s": predicted,
            "same_updates": kind.updates_like_single(config)}  # fmt: skip


def verdict(summary: list[dict]) -> str:
    """Whether the planner's first choice among the runs that make single's updates was the measured fastest."""
    ran = [r for r in summary if "step_s" in r and r["same_updates"] and r["predicted_step_s"] is not None]
    if len(ran) < 2:
        return ""
    chosen = min(ran, key=lambda r: r["predicted_step_s"])
    fastest = min(ran, key=lambda r: r["step_s"])
    if chosen is fastest:
        return (
            f"The planner's first choice among the runs that make single's updates, {chosen['label']}, was the "
            f"measured fastest ({chosen['step_s'] * 1e3:.2f} ms a step)."
        )
    return (f"The planner's first choice among the runs that make single's updates, {chosen['label']}, measured "
            f"{chosen['step_s'] / fastest['step_s'] - 1:.0%} slower than the fastest, {fastest['label']} "
            f"({fastest['step_s'] * 1e3:.2f} ms a step).")  # fmt: skip


LEGEND = (
    "step ms: the measured time of a training step (the median of the epochs after the first); plan ms: what dtrain "
    "plan predicts for the same configuration on this machine (dtrain/collectives/calibration.json; with --device "
    "gpu, the lent-h100 preset of dtrain/plan/hardware.json, or '-' where the device has none; with --hostfile, "
    "on its machines, as dtrain plan --hostfile prices them).",
    "sent B/step, msgs per step: what the busiest rank sent per training step (the tracer's count; not evaluation's, a "
    "checkpoint's or the initial broadcast of the weights); state B: the parameters, gradients and optimizer state "
    "the fullest rank held (read off its arrays); costs(): the paradigm's own prediction of the same. The run's wall "
    "time and samples/s are in tour.json.",
)


def table(summary: list[dict], footnotes: list[str], width: int | str | None = "auto") -> str:
    """The tour's table, fitted to ``width`` (:func:`dtrain.terminal.table`): a row per run (a failed or skipped
    one says why), what its columns are, the footnotes, the planner's verdict."""
    header = ["paradigm", "test acc", "step ms", "plan ms", "sent B/step", "costs()", "msgs per step", "state B",
              "costs()", "what to notice"]  # fmt: skip
    lines = []
    for r in summary:
        if "error" in r:
            lines.append([r["label"], *["-"] * 8, f"{r['status']}: {r['error']}"])
            continue
        held = f"{max(r['state_bytes']):,}" if r["state_bytes"] else "?"
        predicted = r["predicted_sent_per_step"]  # (None where costs() cannot say: a learner's all-reduce)
        predicted = "?" if None in predicted else f"{max(predicted):,.0f}"
        lines.append([r["label"], f"{100 * r['test_accuracy']:.2f}%", f"{r['step_s'] * 1e3:.2f}",
                      "-" if r["predicted_step_s"] is None else f"{r['predicted_step_s'] * 1e3:.2f}",
                      f"{max(r['sent_per_step']):,.0f}",
                      predicted, f"{max(r['messages_per_step']):.1f}", held,
                      f"{max(r['predicted_state_bytes']):,}", r["note"]])  # fmt: skip
    notes = [terminal.paragraph(text, hanging="  ", width=width) for text in LEGEND]
    if footnotes:
        notes += ["", "Where the measured bytes differ from costs():",
                  *(terminal.paragraph(f, "  ", "      ", width) for f in footnotes)]  # fmt: skip
    closing = verdict(summary)
    return "\n".join([terminal.table(header, lines, left=(0, 9), notes=9, width=width), "", *notes,
                      *(["", terminal.paragraph(closing, width=width)] if closing else [])])  # fmt: skip

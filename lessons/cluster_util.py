"""The lessons' parts that run on a cluster on this machine (``dtrain cluster``, dtrain/launch/cluster.py): nodes that
are network namespaces, each behind a link shaped to a rate, so that the bytes a job sends between nodes cross a slow
network for real, while the ranks of one node still share its memory.

A part makes its own small cluster (2 nodes x 2 ranks), trains on it through ``dtrain launch --hostfile`` (rank 0
of the lesson starts those jobs; the lesson's other ranks sleep meanwhile), reads each run's metrics.json, prices
the same steps with the cost model, and takes the cluster down again, whatever happens::

    add_cluster_flags(parser, "part 5")          # --cluster (run the part: it needs root) and --link RATE
    refuse_bad_arguments([..., link_problem(args)])
    heading("5. ...")
    measured = cluster_part(args, world, "5", lambda cluster: to_accuracy(cluster, RUNS, ...))

The part runs only when asked (``--cluster``): it makes network namespaces, links and a bridge on this machine, as
root. Where it cannot (not root, no ``ip`` or ``tc``: ``cluster.missing()``'s reason), it says why and the lesson
goes on. Times are the training time each run recorded (``epochs[].train_time_s``: the training loop, evaluation
left out), never mpiexec's start-up; the model's are the paradigm's own ``step_time`` on the cluster as the planner
would see it: this machine's calibrated compute, shared by all the cluster's ranks, and between nodes the link's
rate and the latency ``dtrain cluster up`` measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from lesson_util import say, sleeping_barrier, table

from dtrain import parallel, report, terminal
from dtrain.config import TrainConfig, flag_words
from dtrain.errors import UserError
from dtrain.launch import cluster as clusters
from dtrain.launch import mpiexec
from dtrain.plan import hardware
from dtrain.plan import hostfile as hostfiles

NODES, SLOTS, LINK = 2, 2, "100mbit"
# lessons 5 and 13: digits to 96% test accuracy with a model whose gradient the link feels (85,002 parameters)
DIGITS_RUN = {"dataset": "digits", "hidden": (256, 256), "batch_size": 64, "lr": 0.05, "momentum": 0.9}
DIGITS_EPOCHS, ACCURACY = 5, 0.96


def add_cluster_flags(parser, what: str) -> None:
    """``--cluster`` (run ``what``, "part 5", on a cluster the lesson makes) and ``--link RATE`` (its link)."""
    parser.add_argument("--cluster", action="store_true",
                        help=f"run {what}: make a cluster of {NODES} nodes x {SLOTS} ranks on this machine "
                        "(network namespaces, needs root), train across its link, take it down")  # fmt: skip
    parser.add_argument("--link", default=LINK, metavar="RATE",
                        help="with --cluster: each node's link, as tc spells a rate (default %(default)s)")  # fmt: skip


def link_problem(args) -> tuple[bool, str]:
    """(bad, why) for refuse_bad_arguments: --link must be a rate tc takes."""
    try:
        clusters.rate_bits_s(args.link)
        return False, ""
    except UserError as exc:
        return True, str(exc)


def rate_words(link: str) -> str:
    """``100mbit`` -> "100 Mbit/s"."""
    bits = clusters.rate_bits_s(link)
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def why_not() -> str | None:
    """Why this process cannot make a cluster (cluster.missing()'s reason, or it already runs inside a named network
    namespace: on a cluster's node), or None."""
    reason = clusters.missing("a cluster on this machine")
    if reason is None:
        mine = os.stat("/proc/self/ns/net").st_ino  # (what ``ip netns identify`` compares)
        inside = [path.name for path in Path("/run/netns").glob("*") if _inode(path) == mine]
        if inside:
            reason = f"rank 0 runs inside network namespace {inside[0]} (a cluster's node): run the lesson outside"
    return reason


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:  # (a namespace removed meanwhile)
        return None


def cluster_part(args, world, part: str, body, indent: str = "   "):
    """Part ``part``: on rank 0, ``body(cluster)`` on a cluster made for it (taken down after, whatever happens),
    while the other ranks sleep; or a line saying why it is skipped. On rank 0 ``{"cluster": its record, "runs":
    what body returned}`` (None elsewhere, and where skipped). ``indent``: of its lines (lesson 2's are flush left)."""
    hanging = indent + "  "
    rank = world.Get_rank()
    if not args.cluster:
        say(f"skipped: run the lesson with --cluster to make a cluster of {NODES} nodes x {SLOTS} ranks on this "
            "machine and measure this (network namespaces and a bridge, made and removed again: it needs root; "
            "about 15 s)", indent, hanging)  # fmt: skip
        return None
    reason = world.bcast(why_not() if rank == 0 else None, root=0)
    if reason is not None:
        say(f"skipped: {reason}", indent, hanging)
        return None
    result = None
    if rank == 0:
        name = f"l{part}p{os.getpid() % 10000}"  # (this run's own: never another's)
        before = signal.signal(signal.SIGTERM, _interrupted)  # (Ctrl-C already raises: either way, down below)
        try:
            try:
                cluster = clusters.up(name, NODES, SLOTS, args.link)
            except UserError as exc:  # (whatever up made is removed again)
                say(f"skipped: {exc}", indent, hanging)
            else:
                try:
                    say(about(cluster), indent, hanging)
                    result = {"cluster": dataclasses.asdict(cluster), "runs": body(cluster)}
                finally:
                    clusters.down(name)
                say(f"(cluster {name} taken down)", indent, hanging)
        finally:
            signal.signal(signal.SIGTERM, before)
    sleeping_barrier(world)  # (the other ranks slept meanwhile)
    return result


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def about(cluster: clusters.Cluster) -> str:
    return (f"cluster {cluster.name}: {cluster.nodes} nodes x {cluster.slots} ranks, link {cluster.link} each way; "
            f"measured node 1 -> node 2: {cluster.latency_us:.0f} us one way (TCP), a stream at "
            f"{cluster.measured_bits_s / 1e6:.1f} Mbit/s")  # fmt: skip


# === running, reading and pricing the runs


def train(cluster: clusters.Cluster, fields: dict, folder: Path) -> dict:
    """``dtrain launch -n N --hostfile HOSTFILE -m dtrain train FLAGS`` (``fields``: TrainConfig's) on the cluster,
    from rank 0 of the lesson's job (its process manager's variables left out): the run's metrics.json."""
    words = [*flag_words(fields), "--no-progress", "--quiet", "--out", str(folder)]
    command = [sys.executable, "-m", "dtrain", "launch", "-n", str(cluster.nodes * cluster.slots),
               "--hostfile", str(cluster.hostfile), "-m", "dtrain", "train", *words]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(mpiexec.A_RANKS_OWN)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[2:])} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads((folder / "metrics.json").read_text())


def hardware_of(cluster: clusters.Cluster) -> hardware.Hardware:
    """The cluster as ``dtrain plan --hostfile HOSTFILE`` prices it (dtrain/plan/hostfile.py): this machine's
    calibrated compute and links, with every rank of the cluster busy on its cores, and between nodes the link: its
    rate and the latency measured at up, one link a node shared by the flows that cross it."""
    return hostfiles.machine(hardware.Hardware.this(), hostfiles.read(cluster.hostfile))


def predicted(fields: dict, sizes, world: int, machine: hardware.Hardware) -> dict:
    """The paradigm's own step_time for ``fields`` on ``machine``: {"compute", "communication", "bubble"} seconds."""
    config = TrainConfig(**fields)
    return parallel.get(config.paradigm).step_time(list(sizes), world, config, machine)


# === the two measurements the lessons make


def digits_workload() -> tuple[list[int], int]:
    """DIGITS_RUN's layer widths and its steps an epoch."""
    from dtrain.data import load_dataset, steps_per_epoch

    digits = load_dataset("digits")
    sizes = [digits.n_features, *DIGITS_RUN["hidden"], digits.n_classes]
    return sizes, steps_per_epoch(len(digits.y_train), DIGITS_RUN["batch_size"])


def steps(
    cluster: clusters.Cluster, runs: dict, sizes, steps_per_epoch: int, baseline: str, indent: str = "   "
) -> dict:
    """Each of ``runs`` ({label: TrainConfig fields}, 2 epochs of ``steps_per_epoch`` steps) trained on the cluster:
    epoch 2's time a step (epoch 1 warms up) beside the model's, printed as a table; returns the figures."""
    world, machine = cluster.nodes * cluster.slots, hardware_of(cluster)
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, fields in runs.items():
            metrics = train(cluster, {**fields, "epochs": 2}, Path(tmp) / str(len(measured)))
            model = predicted(fields, sizes, world, machine)
            measured[label] = {"step_s": metrics["epochs"][-1]["train_time_s"] / steps_per_epoch,
                               "samples_per_s": metrics["epochs"][-1]["samples_per_s"],
                               "model_step_s": sum(model.values()), "model": model,
                               "sent_per_step": metrics["costs"]["sent_per_step"]}  # fmt: skip
    cells = [[label, f"{1e3 * m['step_s']:.0f}", f"{1e3 * m['model_step_s']:.0f}", f"{1e3 * m['model']['compute']:.0f}",
              f"{1e3 * m['model']['communication']:.0f}", f"{m['samples_per_s']:,.0f}",
              "(baseline)" if label == baseline else
              terminal.speed(m["step_s"], measured[baseline]["step_s"], None)]
             for label, m in measured.items()]  # fmt: skip
    table(
        ["", "step ms", "model ms", "compute", "exchange", "samples/s", f"vs {baseline}"],
        cells,
        left=(0, 6),
        indent=indent,
    )
    return measured


def to_accuracy(cluster: clusters.Cluster, runs: dict, sizes, steps_per_epoch: int, epochs: int, accuracy: float,
                baseline: str, indent: str = "   ") -> dict:  # fmt: skip
    """Each of ``runs`` ({label: TrainConfig fields}) trained for ``epochs`` on the cluster: the training time to
    ``accuracy`` test accuracy (the epochs up to the first that reaches it) beside the model's (those epochs' steps x
    the paradigm's step_time), printed as a table; returns the figures."""
    world, machine = cluster.nodes * cluster.slots, hardware_of(cluster)
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, fields in runs.items():
            metrics = train(cluster, {**fields, "epochs": epochs}, Path(tmp) / str(len(measured)))
            epoch, seconds = report.time_to_accuracy(metrics, accuracy)
            step = sum(predicted(fields, sizes, world, machine).values())
            later = metrics["epochs"][1:] or metrics["epochs"]
            measured[label] = {"epoch": epoch, "seconds": seconds, "model_step_s": step,
                               "model_seconds": None if epoch is None else epoch * steps_per_epoch * step,
                               "step_s": sum(e["train_time_s"] for e in later) / (len(later) * steps_per_epoch),
                               "accuracy": [e["test_accuracy"] for e in metrics["epochs"]],
                               "bytes_per_step": max(metrics["costs"]["sent_per_step"])}  # fmt: skip
    base = measured[baseline]["seconds"]
    cells = []
    for label, m in measured.items():
        versus = "(baseline)" if label == baseline else "-"
        if label != baseline and m["seconds"] and base:
            versus = terminal.speed(m["seconds"], base, None)
        cells.append([label, "never" if m["epoch"] is None else str(m["epoch"]),
                      "-" if m["seconds"] is None else f"{m['seconds']:.2f}",
                      "-" if m["model_seconds"] is None else f"{m['model_seconds']:.2f}", versus,
                      f"{1e3 * m['step_s']:.1f}", f"{1e3 * m['model_step_s']:.1f}"])  # fmt: skip
    table(
        ["", "epochs", "seconds", "model s", f"vs {baseline}", "step ms", "model ms"], cells, left=(0, 4), indent=indent
    )
    return measured

"""``dtrain plan``: which paradigm, which grid, how fast and how much memory, for a model on some hardware.

The planner runs nothing. It asks every registered paradigm for the ways it could run on the world
(:meth:`~dtrain.parallel.Paradigm.configurations`), whether each can (:meth:`~dtrain.parallel.Paradigm.check`, the
very check ``dtrain train`` makes), and then, from the paradigm's own formulas::

    bytes each rank sends per step        costs()        exact: the tests hold them against the tracer's counts
    state each rank holds                 costs()        parameters, gradients, optimizer state: exact, likewise
    activations kept for backward         activations()  what autograd keeps of one micro-batch
    seconds per step                      step_time()    compute + communication + bubble, from the hardware's
                                                         rates (dtrain.plan.hardware) and the cost model's formulas

A configuration fits when the memory its fullest rank needs is at most what a rank has. The best is the fastest
that fits *and makes single's updates* (ddp, ZeRO, parameter servers, tensor and pipeline parallelism: the same
steps as one process on the whole batch); local SGD, gossip and asynchronous servers send less but take other steps,
which may need more of them to reach the same loss, so they are shown, marked, and not chosen.

``--check K`` runs the K best that run here, a few steps each under ``mpiexec``, and prints the prediction beside
the measurement: the planner is held to its own runs.
"""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import numpy as np

from dtrain import parallel, terminal
from dtrain.backend import itemsize
from dtrain.config import MAX_SIZE, TrainConfig, flag_words
from dtrain.errors import ConfigError
from dtrain.plan import hardware as hw

GIB = 1 << 30
MAX_RANKS = 1 << 20  # more than any machine has; the planner's work grows with the ranks (per rank, per divisor)
MAX_LAYERS = 1000  # --layers: the planner prices every cut of them into pipeline stages
KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers")  # buffers: gossip's neighbours' weights


@dataclasses.dataclass
class Model:
    """What is trained: an MLP ``sizes`` (features, hidden..., classes) on a global batch."""

    sizes: list[int]
    batch_size: int
    dtype: str = "float32"
    optimizer: str = "sgd"
    momentum: float = 0.9
    device: str = "cpu"  # where each rank's arrays live: "gpu", one GPU per rank

    @property
    def parameters(self) -> int:
        return parallel.parameter_count(self.sizes)

    def config(self, paradigm: str, flags: dict) -> TrainConfig:
        return TrainConfig(paradigm=paradigm, dataset="synthetic", features=self.sizes[0], classes=self.sizes[-1],
                           hidden=tuple(self.sizes[1:-1]), batch_size=self.batch_size, dtype=self.dtype,
                           optimizer=self.optimizer, momentum=self.momentum, device=self.device,
                           **flags)  # fmt: skip

    def describe(self) -> str:
        widths = self.sizes if len(self.sizes) <= 8 else [*self.sizes[:3], "...", *self.sizes[-2:]]
        return (f"MLP {'-'.join(map(str, widths))} ({len(self.sizes) - 1} layers, {self.parameters:,} parameters, "
                f"{nbytes(self.parameters * itemsize(self.dtype))} of {self.dtype}), global batch "
                f"{self.batch_size}, {self.optimizer}" + (f" (momentum {self.momentum:g})" if self.optimizer == "sgd"
                                                           else ""))  # fmt: skip


@dataclasses.dataclass
class Row:
    """One configuration: what it is, and what the formulas say it costs (or why it cannot run)."""

    label: str
    paradigm: str
    flags: dict
    ranks: int
    same_updates: bool
    ruled_out: str | None = None  # the constraint that rules it out (its check's message), or "needs X, has Y"
    time: dict = dataclasses.field(default_factory=dict)  # compute, communication, bubble, total (s per step)
    sent_per_step: float = 0.0  # bytes the busiest rank sends per step
    memory: dict = dataclasses.field(default_factory=dict)  # of the fullest rank, by kind, and "total"
    state: list = dataclasses.field(default_factory=list)  # parameters + gradients + optimizer state, by rank
    fits: bool = False
    best: bool = False

    @property
    def total(self) -> float:
        return self.time.get("total", math.inf)

    def command(self, model: Model, hostfile=None) -> str:
        """The ``dtrain launch ... train`` command that runs it, as one line (:meth:`command_words`)."""
        return " ".join(self.command_words(model, hostfile))

    def command_words(self, model: Model, hostfile=None) -> list[str]:
        """The command's words: ``dtrain train`` on the digits when the model takes 8x8 images to 10 classes, else
        on synthetic data of its shape (``--dataset mnist --data-dir DIR`` for 784 -> 10 on real images); on the
        GPU (``--device gpu``) when the plan is for one; across the machines of ``hostfile`` when one is given."""
        data = {} if (model.sizes[0], model.sizes[-1]) == (64, 10) else {
            "dataset": "synthetic", "features": model.sizes[0], "classes": model.sizes[-1]}  # fmt: skip
        hidden = ",".join(map(str, model.sizes[1:-1])) or "none"
        shared = {"hidden": hidden, "batch_size": model.batch_size, "dtype": model.dtype, "optimizer": model.optimizer}
        if model.device != "cpu":
            shared["device"] = model.device
        words = flag_words({"paradigm": self.paradigm, **self.flags, **data, **shared})
        hosts = [] if hostfile is None else ["--hostfile", str(hostfile)]
        return ["dtrain", "launch", "-n", str(self.ranks), *hosts, "-m", "dtrain", "train", *words]


def plan(model: Model, world: int, machine: hw.Hardware, only=None, tp=None, pp=None, labels=None) -> list[Row]:
    """Every configuration of every registered paradigm (or of ``only``, a list of names; or only those whose labels
    are in ``labels``) on ``world`` ranks of ``machine``, priced, ruled out or not fitting, the best marked; the
    fastest first."""
    if not 1 <= world <= MAX_RANKS:
        raise ConfigError(f"--ranks must be >= 1 and at most {MAX_RANKS:,} (the planner lists every rank's memory), "
                          f"got {world}")  # fmt: skip
    for axis, value in (("tp", tp), ("pp", pp)):
        if value is not None and (value < 1 or world % value):
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ConfigError(f"--{axis} {value} does not divide --ranks {world}: the grid must cover the world "
                              f"exactly; choose --{axis} from {divisors}, or --ranks a multiple of {value}",
                              )  # fmt: skip
    names = parallel.names() if only is None else only
    rows = []
    for name in names:
        kind = parallel.get(name)
        for label, flags, ranks in kind.configurations(world, model.config(name, {}), machine):
            if (tp is not None and flags.get("tp", 1) != tp) or (pp is not None and flags.get("pp", 1) != pp):
                continue
            if labels is not None and label not in labels:
                continue
            rows.append(price(kind, label, flags, ranks, model, machine))
    if any(not math.isfinite(t) for r in rows for t in r.time.values()):
        raise ConfigError("a step would take forever on this hardware: give --flops, --intra-/--inter-bandwidth and "
                          "--intra-/--inter-latency values a machine can have")  # fmt: skip
    fitting = [r for r in rows if r.fits and r.same_updates]
    if fitting:  # (of two as fast, the one that needs less memory)
        min(fitting, key=lambda r: (r.total, r.memory["total"])).best = True
    return sorted(rows, key=lambda r: (r.ruled_out is not None, not r.fits, r.total, r.memory.get("total", 0)))


def labels(model: Model, world: int, machine: hw.Hardware, only=None) -> list[str]:
    """The labels of every configuration :func:`plan` would price (of ``only``'s paradigms), unpriced."""
    return [
        label
        for name in (parallel.names() if only is None else only)
        for label, _flags, _ranks in parallel.get(name).configurations(world, model.config(name, {}), machine)
    ]


def price(kind, label: str, flags: dict, ranks: int, model: Model, machine: hw.Hardware) -> Row:
    """One configuration's row: ruled out by its paradigm's check, or its time, bytes and memory."""
    config = model.config(kind.name, flags)
    row = Row(label, kind.name, flags, ranks, kind.updates_like_single(config))
    try:
        kind.check(config, ranks)
    except ConfigError as exc:
        row.ruled_out = str(exc)
        return row
    costs = kind.costs(model.sizes, ranks, config)
    held = {k: _per_rank(costs.get(k, 0), ranks) for k in ("parameters", "gradients", "optimizer")}
    # (a compressor's state, ddp --compress, is optimizer-like state: residuals, error feedback, warm starts)
    held["optimizer"] = [a + b for a, b in zip(held["optimizer"], _per_rank(costs.get("compression", 0), ranks))]
    held["activations"] = _per_rank(kind.activations(model.sizes, ranks, config), ranks)
    held["buffers"] = _per_rank(costs.get("receive_buffers", 0), ranks)
    totals = [sum(held[k][r] for k in KINDS) for r in range(ranks)]
    fullest = int(np.argmax(totals))
    row.memory = {**{k: held[k][fullest] for k in KINDS}, "total": totals[fullest]}
    row.state = [sum(held[k][r] for k in ("parameters", "gradients", "optimizer")) for r in range(ranks)]
    sent = [s for s in costs["sent_per_step"] if s is not None]
    row.sent_per_step = max(sent, default=0.0)
    row.time = {k: max(0.0, v) for k, v in kind.step_time(model.sizes, ranks, config, machine).items()}
    row.time["total"] = sum(row.time[k] for k in ("compute", "communication", "bubble"))
    available = machine.per_rank_memory(ranks)
    row.fits = row.memory["total"] <= available
    if not row.fits:
        row.ruled_out = f"needs {nbytes(row.memory['total'])} per rank, a rank has {nbytes(available)}"
    return row


def _per_rank(value, ranks: int) -> list[float]:
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * ranks


def nbytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _figure(value: float) -> str:
    """Three significant digits, without an exponent: 0.602, 6.49, 10.1, 336, 4,096."""
    if value == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{digits}f}"


# --- what the planner says -------------------------------------------------------------------------------------------
def why(rows: list[Row]) -> str:
    """Why the best is the best, in a sentence or two."""
    best = next((r for r in rows if r.best), None)
    if best is None:
        return "nothing that makes single's updates fits"
    single = next((r for r in rows if r.paradigm == "single" and r.time), None)
    t = best.time
    bubble = f", {100 * t['bubble'] / t['total']:.0f}% bubble" if t["bubble"] >= t["total"] / 200 else ""
    parts = [f"{best.label} is the fastest configuration that fits and makes single's updates: {_seconds(t['total'])}"
             f" a step, {100 * t['communication'] / t['total']:.0f}% of it communication{bubble}"]  # fmt: skip
    if single and best is not single:
        if single.fits:
            parts.append(f"{terminal.speed(best.total, single.total, 'single')} (predicted)")
        else:
            parts.append(f"single does not fit ({single.ruled_out})")
    elif single is best:
        others = [r for r in rows if r.fits and r.same_updates and r is not best]
        if others:
            other = others[0]
            parts.append(f"distributing does not pay here: the fastest on {other.ranks} ranks, {other.label}, would "
                         f"be {terminal.speed(other.total, best.total, 'single')} (its communication costs more than "
                         "the compute it saves)")  # fmt: skip
    quicker = [r for r in rows if r.fits and not r.same_updates and r.total < best.total]
    if quicker:
        parts.append(f"{quicker[0].label} is quicker per step ({_seconds(quicker[0].total)}) but takes other steps "
                     "than single's (it may need more of them)")  # fmt: skip
    return "; ".join(parts) + "."


def table(rows: list[Row], model: Model, world: int, machine: hw.Hardware, show_all: bool = False,
          width: int | str | None = "auto", hostfile=None) -> str:  # fmt: skip
    """The plan as text that fits ``width`` (:mod:`dtrain.terminal`): the configurations that fit, fastest first,
    then those that do not, then those ruled out (the best's command across ``hostfile``'s machines, if given)."""
    where = machine.about if machine.name == hw.THIS else f"{machine.name}: {machine.about}"
    lines = [terminal.paragraph(f"plan: {model.describe()}", hanging="  ", width=width),
             terminal.paragraph(f"on {world} rank(s) of {where}", "  ", "    ", width),
             f"  memory per rank: {nbytes(machine.per_rank_memory(world))}", ""]  # fmt: skip
    priced = [r for r in rows if r.time]
    shown = priced if show_all else priced[:20]
    unit, scale = ("ms", 1e3) if max((r.total for r in shown), default=0) < 10 else ("s", 1)
    header = ["", "configuration", f"step {unit}", f"compute {unit}", f"comm {unit}", f"bubble {unit}", "sent/step",
              "params", "grads", "optim", "activ", "memory", "fits"]  # fmt: skip
    cells = []
    for r in shown:
        t, m = r.time, r.memory
        mark = "*" if r.best else "" if r.same_updates else "~"
        times = [_figure(t[k] * scale) for k in ("total", "compute", "communication")]
        cells.append([mark, r.label, *times, _figure(t["bubble"] * scale) if t["bubble"] > 1e-9 else "-",
                      nbytes(r.sent_per_step), *(nbytes(m[k]) for k in ("parameters", "gradients", "optimizer",
                                                                          "activations")),
                      nbytes(m["total"]), "yes" if r.fits else "NO"])  # fmt: skip
    lines.append(terminal.table(header, cells, left=(0, 1), keys=2, groups=(2, 7), width=width))
    if len(priced) > len(shown):
        lines.append(f"  ... and {len(priced) - len(shown)} more (--all shows every one)")
    legend = ["* the best: the fastest that fits and makes single's updates; ~ sends less, but its steps are not "
              "single's.", "step = compute + comm (what compute does not hide) + bubble (a pipeline filling and "
              "draining); sent/step: the busiest rank's bytes; params, grads, optim (the optimizer's state), activ "
              "(activations kept for backward), memory (all of them, and a neighbour's weights for gossip): the "
              "fullest rank's."]  # fmt: skip
    lines += ["", *(terminal.paragraph(text, hanging="  ", width=width) for text in legend), "",
              terminal.paragraph("best: " + why(rows), hanging="  ", width=width)]  # fmt: skip
    best = next((r for r in rows if r.best), None)
    if best is not None:
        lines += ["  run it:", terminal.command(best.command_words(model, hostfile), "    ", width)]
    reasons = {}  # the same constraint rules out several configurations: said once
    for r in rows:
        if r.ruled_out and not r.time:
            reasons.setdefault(r.ruled_out, []).append(r.label)
    if reasons:
        lines += ["", "cannot run:"] + [terminal.paragraph(f"{', '.join(labels)}: {reason}", "  ", "      ", width)
                                        for reason, labels in reasons.items()]  # fmt: skip
    return "\n".join(lines)


def as_json(rows: list[Row], model: Model, world: int, machine: hw.Hardware) -> dict:
    return {"model": dataclasses.asdict(model), "parameters": model.parameters, "ranks": world,
            "machine": {"name": machine.name, "about": machine.about,
                        "memory_per_rank": machine.per_rank_memory(world)},
            "best": next((r.label for r in rows if r.best), None), "why": why(rows),
            "configurations": [dataclasses.asdict(r) for r in rows]}  # fmt: skip


def figure(rows: list[Row], path, title: str) -> Path:
    """A PNG: each configuration's predicted step (compute, communication, bubble) and its memory per rank by kind."""
    from dtrain.report import pyplot

    plt = pyplot()
    shown = [r for r in rows if r.time][:20][::-1]
    fig, (times, memory) = plt.subplots(1, 2, figsize=(15, 0.35 * len(shown) + 1.8), sharey=True)
    y = np.arange(len(shown))
    left = np.zeros(len(shown))
    for part, colour in (("compute", "tab:blue"), ("communication", "tab:orange"), ("bubble", "tab:gray")):
        widths = np.array([r.time[part] * 1e3 for r in shown])
        times.barh(y, widths, left=left, color=colour, label=part)
        left += widths
    times.set_yticks(y, [("* " if r.best else "~ " if not r.same_updates else "") + r.label for r in shown])
    times.set_xlabel("predicted ms per step")
    times.legend(loc="best")
    left = np.zeros(len(shown))
    for kind, colour in zip(KINDS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        widths = np.array([r.memory[kind] / (1 << 20) for r in shown])
        memory.barh(y, widths, left=left, color=colour, label=kind)
        left += widths
    memory.set_xlabel("MiB per rank (the fullest rank)")
    memory.legend(loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    terminal.write_output(path, png.getvalue())  # (a file, or "-": standard output)
    return Path(path)


# --- the command -----------------------------------------------------------------------------------------------------
def model_of(args) -> Model:
    if args.layers is not None or args.width is not None:
        if args.layers is None or args.width is None:
            raise ConfigError("--layers and --width go together: L hidden layers of width H")
        if not 0 <= args.layers <= MAX_LAYERS or args.width < 1:
            raise ConfigError(f"--layers must be >= 0 and at most {MAX_LAYERS} and --width >= 1, got {args.layers} and "
                              f"{args.width}")  # fmt: skip
        hidden = [args.width] * args.layers
    else:
        hidden = list(args.hidden)
    if any(h > MAX_SIZE for h in hidden):
        raise ConfigError(f"hidden widths must be at most {MAX_SIZE:,}, got {max(hidden)}")
    for name in ("features", "classes", "batch_size"):
        if not 1 <= getattr(args, name) <= MAX_SIZE:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 and at most {MAX_SIZE:,}, got "
                              f"{getattr(args, name)}")  # fmt: skip
    return Model([args.features, *hidden, args.classes], args.batch_size, args.dtype, args.optimizer, args.momentum,
                 device_of(args))  # fmt: skip


def device_of(args) -> str:
    """What the ranks compute on: ``--device``, else the machine's (a GPU preset's ranks are GPUs), else the CPU. A
    ``--device`` the machine does not have is refused: its rates would price another device."""
    if not args.machine:
        return args.device or "cpu"
    machine = hw.load(args.machine)
    if args.device is not None and args.device != machine.device:
        instead = f"--machine {hw.GPU_MEASURED} (a GPU measured by dtrain) or a GPU preset" if args.device == "gpu" \
            else f"--machine {hw.THIS} (this machine's CPUs)"  # fmt: skip
        raise ConfigError(f"--device {args.device} on {args.machine}, whose ranks compute on "
                          f"{machine.device.upper()}s: leave --device out, or give {instead}")  # fmt: skip
    return machine.device


def machine_of(args, world: int, hosts=None) -> hw.Hardware:
    """The preset, as the hostfile's world makes it (``hosts``: a :class:`dtrain.plan.hostfile.World`), with what the
    command line overrides (rates must be positive and finite)."""
    machine = hw.load(args.machine, args.dtype) if args.machine else hw.for_device(device_of(args), args.dtype)
    if hosts is not None:
        from dtrain.plan import hostfile

        machine = hostfile.machine(machine, hosts)
    changes = {}
    for option, value in (("flops", args.flops), ("memory", args.memory), ("ranks_per_node", args.ranks_per_node)):
        if value is None:
            continue
        if not (0 < value < math.inf):
            raise ConfigError(f"--{option.replace('_', '-')} must be a positive number, got {value:g}")
        changes[option] = value * GIB if option == "memory" else value
    for link in ("intra", "inter"):
        latency, bandwidth = getattr(args, f"{link}_latency"), getattr(args, f"{link}_bandwidth")
        for option, value in ((f"--{link}-latency", latency), (f"--{link}-bandwidth", bandwidth)):
            if value is not None and not (0 < value < math.inf):
                raise ConfigError(f"{option} must be a positive number, got {value:g}")
        if latency is not None or bandwidth is not None:
            old = getattr(machine, link)
            changes[link] = dataclasses.replace(old, alpha=latency * 1e-6 if latency else old.alpha,
                                                beta=1 / (bandwidth * 1e9) if bandwidth else old.beta)  # fmt: skip
            if not (machine.cluster and link == "inter"):  # (a cluster's link between nodes is its own already)
                changes["loaded"] = {}  # (a link given by hand replaces this machine's measured ones)
    if "memory" in changes and machine.cores:
        changes["memory"] *= machine.ranks_sharing(world)  # (--memory is per rank; this machine's is per node)
    return dataclasses.replace(machine, **changes) if changes else machine

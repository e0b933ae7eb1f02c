"""What a training run is asked to do, and the words that ask it: :class:`TrainConfig`, ``dtrain train``'s flags
(:func:`add_train_arguments`, :func:`train_parser`), and :func:`flag_words`, the way back from values to words.

Every command that names a training run reads it here: ``dtrain train`` itself, ``dtrain launch --max-restarts``
(which reads the target's flags as its ranks will), ``dtrain plan`` and ``dtrain tour`` (which print the command that
runs a configuration). A paradigm's own flags are declared in its file (:mod:`dtrain.parallel.flags`) and come here
through the registry, so a new paradigm's flags need nothing of this file.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from dtrain import backend, parallel
from dtrain.data import DATASETS
from dtrain.errors import ConfigError, UsageError
from dtrain.optim import OPTIMIZERS

DEFAULT_BATCH = 64  # the global batch when --batch-size is not given (see default_batch)
# The largest number of samples, features, classes, batch or hidden width: an array of two such dimensions still has
# fewer bytes than NumPy can count (beyond, it raises ValueError, not MemoryError); one that big does not fit memory.
MAX_SIZE = 10**9


@dataclass(init=False)
class TrainConfig:
    """What a run is asked to do: the fields every run shares, and the chosen paradigm's own flags in ``options``.

    A paradigm declares its flags itself (``flags`` in its file; see :mod:`dtrain.parallel.flags`), and they are
    given and read as if they were fields: ``TrainConfig(paradigm="ps-sync", servers=2).servers == 2``, and a flag
    not given reads as its default. A name that is neither a field nor a registered flag is a ``TypeError``.
    """

    paradigm: str = "single"
    dataset: str = "digits"
    data_dir: str | None = None
    samples: int = 10000  # synthetic/spirals only
    features: int = 784  # synthetic only
    classes: int = 10  # synthetic/spirals only
    epochs: int = 20
    # the global batch, split evenly over the ranks; None: DEFAULT_BATCH, or the size nearest it that the paradigm's
    # trainers split evenly (what `dtrain train` does when --batch-size is not given)
    batch_size: int | None = 64
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    hidden: tuple[int, ...] = (128, 128)
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    out: str | None = None
    trace: str | None = None  # write a Chrome/Perfetto trace of every rank's communication here
    timeout: float | None = None  # watchdog: end the job after this many seconds stalled in a wait (0: off)
    accumulate: int = 1  # micro-batches per step; gradients are communicated once, after the last
    # a straggler, for any paradigm
    slow_rank: int | None = None  # this rank takes slow_factor times its compute time per step
    slow_factor: float = 1.0
    # checkpoints
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)
    resume: bool = False  # go on from checkpoint_dir's checkpoint
    progress: bool = True  # rank 0's progress bar
    quiet: bool = False  # no per-epoch summary lines
    options: dict = field(default_factory=dict)  # the paradigms' flags that were given: name -> value

    def __init__(self, **given):
        flags = parallel.all_flags()
        options = dict(given.pop("options", {}))
        for f in fields(self):
            if f.name == "options":
                continue
            default = f.default_factory() if f.default is MISSING else f.default
            object.__setattr__(self, f.name, given.pop(f.name, default))
        for name in given:
            if name not in flags:
                raise TypeError(f"TrainConfig got an unexpected keyword argument {name!r}")
        object.__setattr__(self, "options", {**options, **given})

    def __getattr__(self, name):  # (only for names that are not fields: the paradigms' flags)
        flag = parallel.all_flags().get(name) if name != "options" else None
        if flag is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.options.get(name, flag.default)

    def __setattr__(self, name, value):
        if name in parallel.all_flags():
            self.options[name] = value
        else:
            object.__setattr__(self, name, value)

    def as_dict(self) -> dict:
        """Every field and every registered paradigm flag (given or default), flat: metrics.json's "config"."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        return {**shared, **{name: getattr(self, name) for name in parallel.all_flags()}, "hidden": list(self.hidden)}

    def validate(self) -> None:
        """Check every shared value before any data is read or any rank talks to another (the paradigm's own flags,
        and what they mean on a given number of ranks, the paradigm checks: ``train`` asks it before any message)."""
        parallel.get(self.paradigm)  # an unknown paradigm: the error lists the registered ones
        choices = {
            "dataset": DATASETS,
            "optimizer": tuple(OPTIMIZERS),
            "device": backend.DEVICES,
            "dtype": tuple(backend.DTYPES),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} {getattr(self, name)!r} is not one of: {', '.join(allowed)}")
        positive = {
            "epochs": self.epochs,
            "batch-size": DEFAULT_BATCH if self.batch_size is None else self.batch_size,
            "samples": self.samples,
            "features": self.features,
            "classes": self.classes,
            "accumulate": self.accumulate,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"--{name} must be >= 1, got {value}")
            if value > MAX_SIZE and name != "epochs":
                raise ConfigError(f"--{name} must be at most {MAX_SIZE:,} (it sizes arrays), got {value}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.weight_decay < math.inf:  # also refuses NaN
            raise ConfigError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.timeout is not None and not 0 <= self.timeout < math.inf:
            raise ConfigError(
                f"--timeout must be a number of seconds >= 0 (0 turns the watchdog off), got {self.timeout}"
            )
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out} is a file; give a folder (metrics.json is written inside it)")
        if self.trace is not None and Path(self.trace).is_dir():
            raise ConfigError(f"--trace {self.trace} is a folder; give a file name such as trace.json")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir DIR (where checkpoints live)")
        if self.checkpoint_dir is not None and Path(self.checkpoint_dir).is_file():
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir} is a file; give a folder")
        if not 1 <= self.slow_factor < math.inf:
            raise ConfigError(f"--slow-factor must be a number >= 1 (times slower), got {self.slow_factor}")
        if self.slow_rank is not None and self.slow_rank < 0:
            raise ConfigError(f"--slow-rank must be a rank (>= 0), got {self.slow_rank}")
        if any(not 1 <= h <= MAX_SIZE for h in self.hidden):
            given = ",".join(map(str, self.hidden))
            raise ConfigError(f"--hidden sizes must be >= 1 and at most {MAX_SIZE:,}, got {given}")


def default_batch(kind, config: TrainConfig, world: int) -> int:
    """The global batch when none is given: :data:`DEFAULT_BATCH`, or the size nearest it (the smaller of two as near)
    that the paradigm accepts on ``world`` ranks. Only the paradigm's own check decides, so a paradigm added later
    gets its default the same way. If no size near it passes, the default stays, and the check says why."""
    for size in sorted(range(1, 4 * DEFAULT_BATCH + 1), key=lambda b: (abs(b - DEFAULT_BATCH), b)):
        try:
            kind.check(replace(config, batch_size=size), world)
        except ConfigError:
            continue
        return size
    return DEFAULT_BATCH


# The watchdog's timeout when neither --timeout nor DTRAIN_TIMEOUT says otherwise: generous, so a slow step on a
# busy machine never trips it, yet a hung job ends within minutes with a report instead of never.
DEFAULT_TIMEOUT_S = 300.0


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help (said once however many ranks parse it)."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)", self.prog)


def hidden_sizes(text: str) -> tuple[int, ...]:
    if text.strip() in ("", "none"):
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 512,512, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"hidden sizes must be >= 1, got {text!r}")
    return sizes


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0 turns the watchdog off), got {text!r}")
    return value


TIMEOUT_HELP = (
    "watchdog: a rank stalled this many seconds in a collective or a paradigm's wait reports what it waits for and "
    f"ends the job (default: $DTRAIN_TIMEOUT, else {DEFAULT_TIMEOUT_S:g}; 0: off)"
)


def add_train_arguments(t: argparse.ArgumentParser) -> None:
    """``dtrain train``'s flags on the parser ``t``: every field of :class:`TrainConfig`, and each registered
    paradigm's own flags in a group of their own."""
    defaults = TrainConfig(batch_size=None)
    t.add_argument(
        "--paradigm",
        choices=parallel.names(),
        default=defaults.paradigm,
        help="; ".join(f"{name}: {parallel.get(name).summary}" for name in parallel.names())
        + " (default %(default)s; each paradigm's own flags are below)",
    )
    t.add_argument("--dataset", choices=DATASETS, default=defaults.dataset)
    t.add_argument("--data-dir", help="folder with the MNIST-format IDX files (mnist, fashion-mnist)")
    t.add_argument("--samples", type=int, default=defaults.samples, help="synthetic/spirals: number of samples")
    t.add_argument("--features", type=int, default=defaults.features, help="synthetic: number of features")
    t.add_argument("--classes", type=int, default=defaults.classes, help="synthetic/spirals: number of classes")
    t.add_argument("--epochs", type=int, default=defaults.epochs)
    t.add_argument(
        "--batch-size",
        type=int,
        help="the global batch, split into equal slices over the ranks; it must be divisible by the number of "
        "ranks (no uneven split: a rank with a smaller slice would weigh its samples more; the error suggests a "
        f"size that divides) (default {DEFAULT_BATCH}, or the nearest size that the paradigm's trainers divide, "
        "which the run's first line then names)",
    )
    t.add_argument(
        "--accumulate",
        type=int,
        default=defaults.accumulate,
        metavar="K",
        help="split each rank's slice into K micro-batches, accumulate their gradients, communicate once per step",
    )
    t.add_argument("--lr", type=float, default=defaults.lr, help="learning rate")
    t.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=defaults.optimizer)
    t.add_argument("--momentum", type=float, default=defaults.momentum, help="SGD momentum")
    t.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    t.add_argument(
        "--hidden",
        type=hidden_sizes,
        default=defaults.hidden,
        help="comma-separated hidden layer sizes, e.g. 512,512, or none for no hidden layer (default %(default)s)",
    )
    t.add_argument("--seed", type=int, default=defaults.seed)
    t.add_argument("--device", choices=backend.DEVICES, default=defaults.device)
    t.add_argument("--dtype", choices=tuple(backend.DTYPES), default=defaults.dtype)
    _add_paradigm_flags(t)
    slow = t.add_argument_group("a straggler (any paradigm)")
    slow.add_argument("--slow-rank", type=int, metavar="R", help="make rank R slower than the others")
    slow.add_argument(
        "--slow-factor",
        type=float,
        default=defaults.slow_factor,
        metavar="F",
        help="rank R takes F times its compute time per step (it sleeps the difference; default %(default)s)",
    )
    ckpt = t.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", metavar="DIR", help="write DIR/checkpoint.npz (atomically) at the end")
    ckpt.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="N", help="also every N steps (default: only at the end)"
    )
    ckpt.add_argument(
        "--resume",
        action="store_true",
        help="go on from DIR/checkpoint.npz; the same world size continues bit-identically, another one works too",
    )
    t.add_argument("--out", metavar="DIR", help="write DIR/metrics.json")
    t.add_argument(
        "--trace",
        metavar="FILE",
        help="write a Chrome/Perfetto trace of the communication (JSON; -: to "
        "stdout, what is printed for people to stderr)",
    )
    t.add_argument("--timeout", type=seconds, metavar="S", help=TIMEOUT_HELP)
    t.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    t.add_argument("--quiet", action="store_true", help="no per-epoch lines")


def train_parser() -> Parser:
    """A parser of ``dtrain train``'s flags alone (what follows ``-m dtrain train``)."""
    t = Parser(prog="dtrain train", description="Train the MLP and write DIR/metrics.json.")
    add_train_arguments(t)
    return t


def _add_paradigm_flags(train_parser) -> None:
    """One group of flags per paradigm, from what each declares (dtrain.parallel.flags): a flag several paradigms
    read is in the group of the first (in the paradigms' order), and names them all."""
    placed = set()
    for name in parallel.names():
        kind = parallel.get(name)
        own = [flag for flag in kind.flags if flag.name not in placed]
        if not own:
            continue
        group = train_parser.add_argument_group(f"--paradigm {name}: {kind.summary}")
        for flag in own:
            flag.add_to(group, parallel.readers(flag.name))
            placed.add(flag.name)


def flag_words(flags: dict) -> list[str]:
    """``dtrain train``'s words for ``flags`` (TrainConfig's names and values): ``--name value``, a switch alone
    when True, nothing when False, a tuple as commas (``--hidden 64,64``), a repeatable flag once per value
    (``--shard w1=_,y --shard b1=y``)."""
    words, repeated = [], {name for name, flag in parallel.all_flags().items() if flag.repeat}
    for name, value in flags.items():
        option = f"--{name.replace('_', '-')}"
        if name in repeated:  # (--shard w1=_,y --shard b1=y)
            words += [word for each in value or () for word in (option, str(each))]
            continue
        value = ",".join(map(str, value)) if isinstance(value, tuple) else value
        words += [] if value is False else [option] if value is True else [option, str(value)]
    return words

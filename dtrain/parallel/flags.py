"""A paradigm's own flags, declared once beside the paradigm that reads them.

A paradigm lists its flags as :class:`Flag` records (``flags = (SERVERS, STALENESS)``). From that one list:

* ``dtrain train --help`` shows them in the paradigm's group, and parses them (:meth:`Flag.add_to`);
* :class:`dtrain.config.TrainConfig` accepts them (``TrainConfig(paradigm="ps-sync", servers=2)``) and gives their
  defaults when they were not given (``config.servers``);
* a value out of range or not among the choices is refused before anything runs (:meth:`Flag.check`), and a flag
  of another paradigm (``--servers`` with ``ddp``) is refused rather than silently ignored.

A flag several paradigms read is declared once, where it belongs, and listed by each of them: the all-reduce's
flags here (a choice of the collectives, not of one paradigm), the rank grid's in ``grid.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from dtrain.collectives import ALGORITHMS
from dtrain.errors import ConfigError
from dtrain.loading import is_spec


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag of a paradigm: ``--ranks-per-node`` is ``Flag("ranks_per_node", ...)``."""

    name: str  # the config's attribute; the option is --name with "-" for "_"
    default: object
    help: str
    type: Callable | None = None  # int, float, str; a bool default (False) makes a switch with no value
    choices: tuple | None = None
    metavar: str | None = None
    at_least: float | None = None  # the smallest value allowed (and always a finite one)
    meaning: str = ""  # what the value counts, said when it is refused: "(steps a worker may run ahead)"
    not_a_choice: str = ""  # said of a value not among the choices, instead of listing them: "is not a ZeRO stage"
    accepts: Callable | None = None  # values it takes beyond the choices: accepts(value) is True for them
    otherwise: str = ""  # added when a value is refused: where else it would be taken
    repeat: bool = False  # given once per value (--shard w1=_,y --shard b1=y): its value is a tuple of them

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value) -> None:
        """A :class:`ConfigError` for a value this flag cannot take (None is "not given" when that is the default)."""
        if value is None and self.default is None:
            return
        if self.repeat:
            for each in value:
                dataclasses.replace(self, repeat=False).check(each)
            return
        if self.choices is not None and value not in self.choices and not (self.accepts and self.accepts(value)):
            if self.not_a_choice:
                raise ConfigError(f"{self.option} {value} {self.not_a_choice}")
            raise ConfigError(f"{self.option} {value!r} is not one of: {', '.join(map(str, self.choices))}"
                              f"{self.otherwise}")  # fmt: skip
        if self.at_least is not None and not self.at_least <= value < math.inf:  # (also refuses NaN)
            meaning = f" {self.meaning}" if self.meaning else ""
            raise ConfigError(f"{self.option} must be >= {self.at_least:g}{meaning}, got {value}")

    def add_to(self, group, readers: list[str]) -> None:
        """Add this flag to an argparse ``group``; ``readers``: the paradigms that read it (named when several)."""
        shared = f" [{', '.join(readers)}]" if len(readers) > 1 else ""
        if isinstance(self.default, bool):
            group.add_argument(self.option, action="store_true", help=self.help + shared)
            return
        if self.repeat:
            group.add_argument(self.option, action="append", type=self.type, metavar=self.metavar,
                               help=self.help + shared)  # fmt: skip
            return
        shown = "" if self.default is None or "default" in self.help else f" (default {self.default})"
        choices, metavar = self.choices, self.metavar
        if self.accepts is not None:  # argparse would refuse the values beyond the choices: check() decides
            choices, metavar = None, metavar or "{" + ",".join(map(str, self.choices)) + "}"
        group.add_argument(self.option, type=self.type, choices=choices, default=self.default,
                           metavar=metavar, help=self.help + shown + shared)  # fmt: skip


# The all-reduce every data-parallel paradigm uses for its gradients or weights, and its emulated nodes.
ALLREDUCE = Flag("allreduce", "auto", "the all-reduce algorithm (zero: its reduce-scatter and all-gather, ring or "
                 "rabenseifner; tp, pp: the tensor and dp groups' all-reduce)", choices=ALGORITHMS,
                 otherwise=" (your own all-reduce, FILE.py:FUNCTION, works with --paradigm ddp)")  # fmt: skip
SHARED_MEMORY = ("shm", "hierarchical_shm")  # --allreduce values that reduce host memory in a shared window: no GPU
# ddp's: the same, or your own all-reduce (dtrain/collectives/yours.py), e.g. a course exercise's ring
ALLREDUCE_OR_YOURS = dataclasses.replace(
    ALLREDUCE, accepts=is_spec, otherwise="", help=ALLREDUCE.help + ", or FILE.py:FUNCTION: your own "
    "fn(comm, buf) that sums buf in place (e.g. ex/ring.py:ring_allreduce, a course exercise)")  # fmt: skip
RANKS_PER_NODE = Flag("ranks_per_node", None, "emulate nodes of K ranks for the hierarchical all-reduces (default: "
                      "the real nodes)", type=int, metavar="K", at_least=1)  # fmt: skip

"""The rank grid: every rank's place in data x tensor x pipeline parallelism, and the sub-communicators it belongs to.

Model parallelism splits one replica of the model over several ranks; data parallelism then copies that replica.
The world of ``dp * tp * pp`` ranks is a 3-D grid, and a rank's coordinates say what it does::

    tp (tensor parallel)    ranks that share every layer of a stage, each holding a slice of each matrix; they
                            all-reduce activations inside every forward and backward (many messages per step)
    pp (pipeline parallel)  ranks that hold consecutive stages of the model; they pass activations forward and
                            gradients backward at stage boundaries (a few point-to-point messages per micro-batch)
    dp (data parallel)      ranks that hold the same shard of the same stage and train on different slices of the
                            batch; they average gradients once per step

**Which axis varies fastest** decides which ranks are neighbours (on one node, on the fastest link). The tensor
group talks most and on the critical path of every layer, so it varies fastest; then data parallelism; the pipeline,
which talks least, varies slowest (Megatron-LM's order, "tp-dp-pp")::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

    8 ranks, dp 2 x tp 2 x pp 2:    rank  0  1  2  3  4  5  6  7
                                    tp    0  1  0  1  0  1  0  1
                                    dp    0  0  1  1  0  0  1  1
                                    pp    0  0  0  0  1  1  1  1
    tp groups  [0 1] [2 3] [4 5] [6 7]      (same dp and pp: one stage of one replica)
    dp groups  [0 2] [1 3] [4 6] [5 7]      (same tp and pp: the same shard, different data)
    pp groups  [0 4] [1 5] [2 6] [3 7]      (same dp and tp: the stages of one replica's shard)

The grid is a device mesh (mesh.py) with the axes pp, dp, tp, the last varying fastest. Every group is one
``comm.Split(colour, key)`` of the world (:class:`Grid`, with the mesh's :func:`~dtrain.parallel.mesh.split_axes`),
so a sub-communicator carries the world's layers (tracer, staging, watchdog) and a rank's place in a group is its
coordinate on that axis. Nothing here sends a byte except the three ``Split`` calls; :func:`shape_of` checks a grid
against the world before those.
"""

from __future__ import annotations

import dataclasses

from dtrain import terminal
from dtrain.errors import ConfigError
from dtrain.parallel.flags import Flag
from dtrain.parallel.mesh import split_axes

AXES = ("dp", "tp", "pp")
# The grid's flags (shape_of checks them against the world; the paradigm whose own axis is left out fills it).
DP = Flag("dp", None, "data-parallel replicas of the model-parallel model (default: what the other sizes leave; 1 "
          "when the paradigm's own --tp or --pp is not given, which then takes every rank)", type=int,
          metavar="D")  # fmt: skip
TP = Flag("tp", None, "ranks that split each column-then-row pair of Linear layers (tensor parallel; default for tp: "
          "the ranks --dp leaves; for pp: 1)", type=int, metavar="T")  # fmt: skip
PP = Flag("pp", None, "pipeline stages (default: the ranks --dp and --tp leave)", type=int, metavar="P")
ROLES = {  # what the ranks of one group share, and what they send each other
    "tp": "split the layers of a stage; all-reduce activations",
    "dp": "hold the same shard; average gradients",
    "pp": "hold consecutive stages; send activations and gradients",
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A grid of ``dp * tp * pp`` ranks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def coordinates(self, rank: int) -> dict:
        """``{"dp": d, "tp": t, "pp": p}`` of ``rank`` (tp varies fastest, then dp, then pp)."""
        tp, rest = rank % self.tp, rank // self.tp
        return {"dp": rest % self.dp, "tp": tp, "pp": rest // self.dp}

    def rank_of(self, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def groups(self, axis: str) -> list[list[int]]:
        """The groups along ``axis``: lists of ranks that differ only in that coordinate, in coordinate order."""
        others = [a for a in AXES if a != axis]
        found: dict[tuple, list[int]] = {}
        for rank in range(self.size):
            at = self.coordinates(rank)
            found.setdefault(tuple(at[a] for a in others), []).append(rank)
        return list(found.values())

    def describe(self) -> str:
        """The printed map: every rank's coordinates, and which ranks share each group."""
        axes = [a for a in AXES if getattr(self, a) > 1] or ["dp"]
        ranks = range(self.size)
        lines = [f"rank grid: {self.size} rank(s) = " + " x ".join(f"{a} {getattr(self, a)}" for a in AXES)
                 + " (tp varies fastest, then dp, then pp)"]  # fmt: skip
        coordinates = [[axis, *(str(self.coordinates(r)[axis]) for r in ranks)] for axis in AXES]
        lines.append(terminal.table(["rank", *map(str, ranks)], coordinates, indent="  "))  # (many ranks: in pieces)
        for axis in axes:
            groups = " ".join("[" + "\xa0".join(map(str, g)) + "]" for g in self.groups(axis))  # (a group: unbroken)
            lines.append(
                terminal.paragraph(f"{axis} groups ({ROLES[axis]}): {groups}", "  ", "    ").replace("\xa0", " ")
            )
        return "\n".join(lines)


def shape_of(world: int, dp=None, tp=None, pp=None, fill: str = "dp") -> Shape:
    """The grid that ``--dp``, ``--tp`` and ``--pp`` ask for on ``world`` ranks, or a :class:`ConfigError`.

    An axis left as None is 1, except the ``fill`` axis, which takes what the others leave of the world (as Megatron
    infers the data-parallel size). No communication: every rank finds the same answer, or the same error.
    """
    given = {"dp": dp, "tp": tp, "pp": pp}
    for axis, value in given.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{axis} must be >= 1, got {value}")
        if value is not None and value > world:
            raise ConfigError(f"--{axis} {value} is more than the {world} rank(s) launched")
    fixed = 1
    for axis, value in given.items():
        if axis != fill or value is not None:
            fixed *= value or 1
    if given[fill] is None:
        if world % fixed:
            named = " x ".join(f"--{a} {v}" for a, v in given.items() if v is not None)
            what = (
                f"{named} = {fixed} rank(s) per replica"
                if fill == "dp"
                else f"{named} (the {fill} groups take the rest)"
            )
            raise ConfigError(f"{what} does not divide the {world} ranks launched: launch a multiple of {fixed} ranks")
        given[fill] = world // fixed
    shape = Shape(**{a: v or 1 for a, v in given.items()})
    if shape.size != world:
        raise ConfigError(
            f"--dp {shape.dp} x --tp {shape.tp} x --pp {shape.pp} = {shape.size} ranks, but {world} were launched: "
            f"the grid must cover the world exactly"
        )
    return shape


class Grid:
    """This rank's place in a :class:`Shape` over ``comm``, and its three groups as sub-communicators.

    ``grid.tp_comm``, ``grid.dp_comm``, ``grid.pp_comm``: in each, this rank's rank is its coordinate on that axis.
    Building it is a collective (three ``Split`` calls of ``comm``).
    """

    def __init__(self, comm, shape: Shape):
        if comm.Get_size() != shape.size:
            raise ConfigError(f"a grid of {shape.size} ranks cannot cover a world of {comm.Get_size()}")
        self.shape, self.rank = shape, comm.Get_rank()
        self.coordinates = shape.coordinates(self.rank)
        # a mesh's groups (mesh.py): colour, the other two coordinates; key, this axis's coordinate
        self.comms = split_axes(comm, self.coordinates, {axis: getattr(shape, axis) for axis in AXES})
        self.dp_comm, self.tp_comm, self.pp_comm = (self.comms[a] for a in AXES)
        self.dp_rank, self.tp_rank, self.pp_rank = (self.coordinates[a] for a in AXES)

    def free(self) -> None:
        for comm in self.comms.values():
            comm.Free()

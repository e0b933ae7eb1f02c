"""A device mesh: the ranks arranged in a grid whose axes have names, and one sub-communicator per axis.

A layout (layouts.py) says "this dimension is split over axis ``y``"; the mesh says which ranks that means. The world
of ``x * y`` ranks is laid out with the **last axis varying fastest** (as JAX and the rank grid's tensor axis do), so
the ranks that differ only in their last coordinate are neighbours (on one node, on the fastest link)::

    --mesh x=2,y=2       rank   0  1  2  3
                         x      0  0  1  1
                         y      0  1  0  1
    y groups  [0 1] [2 3]        (same x: a collective "over y" runs inside each)
    x groups  [0 2] [1 3]        (same y)

    rank = sum_a coordinate_a * (product of the sizes of the axes after a)

A collective over axis ``a`` runs on the communicator of the ranks that share every other coordinate, made by one
``comm.Split(colour, key)`` per axis: the colour numbers the other coordinates, the key is this rank's coordinate on
``a``, so a rank's place in its group is its coordinate. The rank grid of data x tensor x pipeline parallelism
(grid.py) is a mesh too, with the axes ``pp, dp, tp``, and makes its groups with the same :func:`split_axes`.
"""

from __future__ import annotations

import dataclasses
import math
import re

from dtrain import terminal
from dtrain.errors import ConfigError

NAME = re.compile(r"[a-z][a-z0-9]{0,7}\Z")  # (short: layouts print an axis name in every tensor's spec)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Named axes and their sizes, in order: the last varies fastest."""

    axes: tuple[tuple[str, int], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.axes)

    def size_of(self, axis: str) -> int:
        return dict(self.axes)[axis]

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{axis: coordinate}`` of ``rank`` (the last axis varies fastest)."""
        at = {}
        for name, n in reversed(self.axes):
            rank, at[name] = divmod(rank, n)
        return {name: at[name] for name in self.names}

    def rank_of(self, **coordinates) -> int:
        rank = 0
        for name, n in self.axes:
            rank = rank * n + coordinates.get(name, 0)
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """The groups along ``axis``: ranks that differ only in that coordinate, each in coordinate order."""
        found: dict[tuple, list[int]] = {}
        for rank in range(self.size):
            at = self.coordinates(rank)
            found.setdefault(tuple(at[a] for a in self.names if a != axis), []).append(rank)
        return list(found.values())

    def __str__(self) -> str:
        return ",".join(f"{name}={n}" for name, n in self.axes)

    def describe(self) -> str:
        """The printed map: every rank's coordinates, and the groups of each axis."""
        ranks = range(self.size)
        lines = [f"device mesh {self}: {self.size} rank(s), the last axis varying fastest"]
        rows = [[name, *(str(self.coordinates(r)[name]) for r in ranks)] for name in self.names]
        lines.append(terminal.table(["rank", *map(str, ranks)], rows, indent="  "))
        for name in self.names:
            # (a group's ranks joined by no-break spaces, so wrapping the line never splits a group)
            groups = " ".join("[" + "\xa0".join(map(str, g)) + "]" for g in self.groups(name))
            lines.append(terminal.paragraph(f"{name} groups: {groups}", "  ", "    ").replace("\xa0", " "))
        return "\n".join(lines)


def parse(text: str | None, world: int | None) -> MeshShape:
    """``--mesh NAME=SIZE[,NAME=SIZE]`` on ``world`` ranks (None: one axis ``x`` of the world), or a ConfigError.
    ``world`` None: whatever the mesh covers (a plan explained on one process)."""
    if text is None:
        return MeshShape((("x", world),))
    axes = []
    for part in text.split(","):
        name, equals, size = part.strip().partition("=")
        if not equals or not NAME.match(name) or not size.strip().isdigit() or int(size) < 1:
            raise ConfigError(f"--mesh {text}: each axis is NAME=SIZE (a lower-case name of up to 8 letters and "
                              "digits, a size >= 1), e.g. --mesh x=2,y=2")  # fmt: skip
        if name in dict(axes):
            raise ConfigError(f"--mesh {text} names the axis {name} twice")
        axes.append((name, int(size)))
    shape = MeshShape(tuple(axes))
    if world is not None and shape.size != world:
        sizes = " x ".join(str(n) for _, n in axes) + (f" = {shape.size}" if len(axes) > 1 else "")
        raise ConfigError(f"--mesh {text} has {sizes} ranks, but {world} were launched: the mesh must cover the "
                          f"world exactly (launch {shape.size}, or give a mesh of {world})")  # fmt: skip
    return shape


def split_axes(comm, coordinates: dict[str, int], sizes: dict[str, int]) -> dict:
    """One sub-communicator per axis (a collective: one ``Split`` per axis, in ``sizes``' order): the ranks that
    share every other coordinate, each ranked by its coordinate on the axis."""
    comms = {}
    for axis in sizes:
        colour = 0
        for other, n in sizes.items():  # the other coordinates, as one number
            if other != axis:
                colour = colour * n + coordinates[other]
        comms[axis] = comm.Split(colour, coordinates[axis])
    return comms


class Mesh:
    """This rank's place on a :class:`MeshShape` over ``comm``, and one communicator per axis (``mesh.comm("y")``).
    Building it is a collective."""

    def __init__(self, comm, shape: MeshShape):
        if comm.Get_size() != shape.size:
            raise ConfigError(f"a mesh of {shape.size} ranks cannot cover a world of {comm.Get_size()}")
        self.shape, self.rank = shape, comm.Get_rank()
        self.coordinates = shape.coordinates(self.rank)
        self.comms = split_axes(comm, self.coordinates, dict(shape.axes))

    def comm(self, axis: str):
        return self.comms[axis]

    def free(self) -> None:
        for comm in self.comms.values():
            comm.Free()

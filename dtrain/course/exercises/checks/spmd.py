"""Checks of lesson 14's layouts: the matmul propagation rule (14.1) and one redistribution on a mesh axis (14.2).

14.1 is graded in one process against dtrain's rule (:func:`dtrain.parallel.layouts.matmul`, with
:func:`~dtrain.parallel.layouts.moves` for the collectives it implies) over every pair of valid layouts of A and B
on a mesh with axes x and y: 7 x 7 cases, each named in A[I_x, J] notation with the rule's case (1 to 4). 14.2 runs on
every rank: each rank's returned block is compared with NumPy's answer on the whole tensor, and the bytes all ranks
sent with what a ring's reduce-scatter or all-gather sends (an all-reduce followed by a slice sends twice that).

The references (``Exercise.reference``) are thin adapters of the exercises' signatures over dtrain's own code, the
one source of truth: :func:`matmul_layouts` reads :func:`layouts.matmul`, :func:`redistribute` makes
:func:`layouts.moves`'s move with :meth:`dtrain.parallel.sharded.Program.collective`, as the spmd paradigm does.
"""

from __future__ import annotations

import itertools
import re

from dtrain.course.exercises.grading import MPI, Exercise
from dtrain.parallel import layouts
from dtrain.parallel.layouts import Layout

EXERCISES = (
    Exercise("14.1", "the matmul propagation rule (layouts in, C's layout and collectives out)", "spmd.py",
             "matmul_layouts", ("a", "b"), "dtrain.course.exercises.checks.spmd:matmul_layouts",
             "dtrain.course.exercises.checks.spmd:check_matmul",
             hint="(i, ja), (jb, k) = a, b. J: ja == jb leaves C partial over ja (None: whole); else each of ja, jb "
                  "that is not None is gathered (A's dim 1, B's dim 0). Then if i is not None and i == k, gather B's "
                  "columns (B's dim 1) over k. C's dims: (i, k after that)"),
    Exercise("14.2", "one redistribution on a mesh axis (all-reduce, reduce-scatter, all-gather)", "spmd.py",
             "redistribute", ("comm", "block", "source", "target", "dim"),
             "dtrain.course.exercises.checks.spmd:redistribute",
             "dtrain.course.exercises.checks.redistribution:check_redistribute", (2, 3, 4), MPI,
             "partial -> replicated: collectives.allreduce(comm, block.copy()); partial -> split: the blocks along "
             "dim made flat chunks (np.stack(np.split(block, p, axis=dim))), reduce_scatter, keep chunk r; split -> "
             "replicated: a (p, ...) buffer with your block at r, allgather, np.concatenate(list(buf), axis=dim)"),
)  # fmt: skip
AXES = ("x", "y")
LAYOUTS = tuple(d for d in itertools.product((None, *AXES), repeat=2) if d[0] is None or d[0] != d[1])
PAIRS = tuple(itertools.product(LAYOUTS, LAYOUTS))  # 49: every pair of valid layouts of A and B


# --- the references: dtrain's own code, in the exercises' signatures --------------------------------------------
def matmul_layouts(a, b):
    """Exercise 14.1 by dtrain's rule: ``(C's dims, its partial-sum axis or None, [("all-gather", "A" or "B", dim,
    axis), ...])``."""
    a, b = Layout(tuple(a)), Layout(tuple(b))
    use_a, use_b, out, _case = layouts.matmul(a, b)
    sent = [("A", move) for move in layouts.moves(a, use_a)] + [("B", move) for move in layouts.moves(b, use_b)]
    partial = out.partial[0][0] if out.partial else None
    return out.dims, partial, [(move.kind, name, move.dim, move.axis) for name, move in sent]


def redistribute(comm, block, source, target, dim):
    """Exercise 14.2 by dtrain's spmd machinery: the moves between the two layouts on one axis, each made by
    ``Program.collective`` on this rank's block with dtrain's collectives."""
    from dtrain.parallel.sharded import Program

    axis = "axis"
    program = Program({axis: comm.Get_size()}, {axis: comm.Get_rank()}, {axis: comm})
    for move in layouts.moves(on_axis(source, dim, axis), on_axis(target, dim, axis)):
        block = program.collective(move, block, "exercise 14.2")
    return block


def on_axis(state: str, dim, axis: str) -> Layout:
    """A 2-D tensor's layout on one mesh axis: "partial" (a sum over it), "replicated", or "split" along ``dim``."""
    if state == "partial":
        return Layout((None, None), ((axis, "sum"),))
    if state == "split":
        return Layout((None, None)).split(dim, axis)
    return Layout((None, None))


# --- 14.1 --------------------------------------------------------------------------------------------------------
def notation(name: str, letters: tuple[str, str], dims) -> str:
    """``A[I_x, J]``: a matrix in the lesson's notation."""
    return f"{name}[" + ", ".join(letter if axis is None else f"{letter}_{axis}" for letter, axis in
                                  zip(letters, dims)) + "]"  # fmt: skip


def rule_cases(case: str) -> list[str]:
    """The numbers of the rule's cases in dtrain's description of a matmul ("4: ..., then 2: ..." -> ["4", "2"])."""
    return re.findall(r"(?:^|then )(\d):", case)


def answer(grade, result):
    """The learner's result as ``(dims tuple, partial, sorted collectives)``, or None after a problem that says what
    came back."""
    shape = "(dims, partial, collectives), e.g. (('x', None), None, [('all-gather', 'B', 0, 'y')])"
    if not isinstance(result, tuple | list) or len(result) != 3:
        got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple | list) else "")
        grade.fail(f"matmul_layouts returned {got}; it must return a tuple of 3: {shape}")
        return None
    dims, partial, sent = result
    if not isinstance(dims, tuple | list) or len(dims) != 2 or any(d not in (None, *AXES) for d in dims):
        grade.fail(f"C's dims are {dims!r}: they must be a tuple of 2 entries, each 'x', 'y' or None")
        return None
    if partial not in (None, *AXES):
        grade.fail(f"C's partial-sum axis is {partial!r}: it must be 'x', 'y' or None")
        return None
    if not isinstance(sent, tuple | list) or not all(isinstance(c, tuple | list) and len(c) == 4 for c in sent):
        grade.fail(f"the collectives are {sent!r}: they must be a list of ('all-gather', operand, dim, axis)")
        return None
    return tuple(dims), partial, canonical(sent)


def canonical(sent) -> list[tuple]:
    """A list of collectives in one order (any order is right), each a tuple."""
    return sorted((tuple(c) for c in sent), key=repr)


def why(item: tuple, a, b) -> str:
    """Why the rule gathers ``item`` (one of its own collectives), in words."""
    _kind, operand, dim, axis = item
    if dim == 1 and operand == "B":
        return (f"A's rows and B's columns are both split over {axis}: C[I_{axis}, K_{axis}] cannot be (case 4): "
                f"gather B's columns over {axis}")  # fmt: skip
    which = "columns, dimension 1" if operand == "A" else "rows, dimension 0"
    name, other = ("B", b[0]) if operand == "A" else ("A", a[1])
    also = "is whole" if other is None else f"is split over {other}, another axis"
    return (f"{operand}'s J (its {which}) is split over {axis} and {name}'s {also} (case 2): gather {operand}'s J "
            f"over {axis}")  # fmt: skip


def impossible(item: tuple, a, b) -> str | None:
    """Why the learner's ``item`` cannot be gathered at all, or None if it can."""
    kind, operand, dim, axis = item
    if kind != "all-gather" or operand not in ("A", "B") or dim not in (0, 1) or axis not in AXES:
        return f"{item!r} is not ('all-gather', 'A' or 'B', 0 or 1, 'x' or 'y')"
    layout = a if operand == "A" else b
    if layout[dim] != axis:
        said = "whole" if layout[dim] is None else f"split over {layout[dim]}"
        return (f"{item!r} gathers {operand}'s dimension {dim} over {axis}, but that dimension is {said} here: only a "
                f"dimension split over an axis is gathered over it")  # fmt: skip
    return None


def check_matmul(fn, comm, grade) -> None:
    """``fn(a, b)`` for every pair of valid layouts on a mesh with axes x and y: C's dims, its partial-sum axis and
    the collectives, as dtrain's rule (:func:`matmul_layouts`) has them."""
    for number, (a, b) in enumerate(PAIRS, 1):
        expected = matmul_layouts(a, b)
        expected = (tuple(expected[0]), expected[1], canonical(expected[2]))
        case = layouts.matmul(Layout(a), Layout(b))[3]
        cases = rule_cases(case)
        product = f"{notation('A', ('I', 'J'), a)} @ {notation('B', ('J', 'K'), b)}"
        about = f"{product}: " + (f"the rule's case {cases[0]}" if len(cases) == 1 else f"cases {' and '.join(cases)}")
        with grade.step(number, about, len(PAIRS)):
            got = answer(grade, fn(a, b))
            if got is None or got == expected:
                continue
            call = f"matmul_layouts({a!r}, {b!r})"
            dims, partial, sent = got
            if partial != expected[1]:
                if expected[1] is not None:
                    grade.fail(f"{call}: C's partial-sum axis is {partial!r}, expected {expected[1]!r}: case 3: J is "
                               f"split over {expected[1]} in both A and B, so each rank multiplies its own blocks, "
                               f"nothing sent, and C is the sum of the products over the ranks of {expected[1]} (a "
                               "partial sum)")  # fmt: skip
                else:
                    grade.fail(f"{call}: C's partial-sum axis is {partial!r}, expected None: C is whole here; only "
                               "case 3 (J split over the same axis in both) leaves a partial sum")  # fmt: skip
            if sent != expected[2]:
                reasons = "; ".join(why(item, a, b) for item in expected[2]) or "nothing is sent"
                grade.fail(f"{call}: the collectives are {sent!r}, expected {expected[2]!r}: {reasons}")
                for item in sent:
                    said = impossible(item, a, b)
                    if said:
                        grade.note(said)
            if dims != expected[0]:
                grade.fail(f"{call}: C's dims are {dims!r}, expected {expected[0]!r}: C's rows take A's rows' axis, "
                           "its columns B's columns' axis, after the gathers (case 4 gathers B's columns)")  # fmt: skip

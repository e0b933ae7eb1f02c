"""What a pipeline rank does, one small record per kind: the words a schedule (schedules.py) is written in and the
pipeline's interpreter (pipeline.py) executes.

:class:`Forward`/:class:`Backward` (a :class:`Compute`) of a (virtual) stage on a micro-batch, in a phase;
:class:`Send`/:class:`Recv` (a :class:`Message`) of an activation or a gradient to or from a pipeline rank; and the
step's end, the same on every rank (:data:`END_OF_STEP`): :class:`WaitSends`, :class:`AllReduceGradients` (over the
stage's replicas) and :class:`OptimizerStep`.
"""

from __future__ import annotations

import dataclasses

KINDS = ("activation", "gradient")


class Instruction:
    """One thing a pipeline rank does: one small record per kind below. ``stage`` is the virtual stage (chunk c of
    rank r is stage c P + r); ``op`` names the kind (the interpreter's method for it, ``simulate``'s and ``check``'s
    tests)."""

    op = ""
    phase = ""  # (a forward's or backward's; the others are in none)

    def __str__(self) -> str:
        return self.op


@dataclasses.dataclass(frozen=True)
class Compute(Instruction):
    """A computation of stage ``stage`` on micro-batch ``micro``, in ``phase`` ("warm-up", "steady", "cool-down")."""

    stage: int
    micro: int
    phase: str = ""

    def __str__(self) -> str:
        return f"{self.op[0].upper()}{self.micro}" + (f"@{self.stage}" if self.stage else "")


class Forward(Compute):
    """The stage's forward of the micro-batch: its activations are kept until its backward."""

    op = "forward"


class Backward(Compute):
    """The stage's backward of the micro-batch: its gradients accumulate into the stage's."""

    op = "backward"


@dataclasses.dataclass(frozen=True)
class Message(Instruction):
    """The ``kind`` ("activation" forward, "gradient" backward) of stage ``stage`` for micro-batch ``micro``, to or
    from pipeline rank ``peer``."""

    stage: int
    micro: int
    kind: str
    peer: int

    def __str__(self) -> str:
        return f"{self.op} {self.kind} {self.micro} {'->' if self.op == 'send' else '<-'} {self.peer}"

    def message(self) -> tuple:
        """What it carries: (kind, the stage boundary it crosses, micro-batch); a send and its receive have the same
        message."""
        boundary = self.stage + 1 if (self.op == "send") == (self.kind == "activation") else self.stage
        return self.kind, boundary, self.micro


class Send(Message):
    """Send what the stage made (an ``Isend``: it does not wait for the receiver)."""

    op = "send"


class Recv(Message):
    """Receive what the stage needs (it waits for it)."""

    op = "recv"


@dataclasses.dataclass(frozen=True)
class WaitSends(Instruction):
    """Wait until this step's sends have left (their arrays may then be dropped)."""

    stage = micro = 0  # (every stage of the rank: a step's end)
    op = "wait"


@dataclasses.dataclass(frozen=True)
class AllReduceGradients(Instruction):
    """Average the stage's gradients with its replicas' (the dp group; nothing to do without data parallelism)."""

    stage = micro = 0  # (every stage of the rank: a step's end)
    op = "allreduce"


@dataclasses.dataclass(frozen=True)
class OptimizerStep(Instruction):
    """The optimizer's step on this rank's layers."""

    stage = micro = 0  # (every stage of the rank: a step's end)
    op = "step"


END_OF_STEP = (WaitSends(), AllReduceGradients(), OptimizerStep())  # every rank's program ends so
OPS = ("forward", "backward", "send", "recv", "wait", "allreduce", "step")

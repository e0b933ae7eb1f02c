"""Pipeline schedules as data: for every stage, the ordered list of small instructions it executes in one step.

A pipeline of P stages trains on M micro-batches per step. *When* each stage runs each micro-batch's forward (F) and
backward (B) is the schedule; everything else (what a forward computes, how a message travels) is the interpreter's
business (pipeline.py). So a schedule is a plain function returning lists of instruction records (instructions.py), and
this module can check it, time it and draw it without MPI::

    gpipe(P, M)              all M forwards, then all M backwards (GPipe): every stage keeps M micro-batches'
                             activations at its peak
    one_f_one_b(P, M)        stage s runs P - s - 1 forwards (warm-up), then alternates one forward, one backward
                             (steady state), then the backwards left (cool-down): at most P - s in flight
    interleaved_1f1b(P,M,V)  each rank holds V model chunks (virtual stages s, s + P, ...), so a micro-batch
                             crosses the ranks V times in smaller steps, and the bubble shrinks V-fold (Megatron)

    P = 4, M = 4, t_B = 2 t_F: F3/B3 is micro-batch 3's forward/backward, dots the bubble (drawn by text())
              GPipe                                           1F1B
    stage 0   F0F1F2F3..................B0B0B1B1B2B2B3B3      F0F1F2F3............B0B0..B1B1..B2B2..B3B3
    stage 1   ..F0F1F2F3............B0B0B1B1B2B2B3B3....      ..F0F1F2........B0B0F3B1B1..B2B2..B3B3....
    stage 2   ....F0F1F2F3......B0B0B1B1B2B2B3B3........      ....F0F1....B0B0F2B1B1F3B2B2..B3B3........
    stage 3   ......F0F1F2F3B0B0B1B1B2B2B3B3............      ......F0B0B0F1B1B1F2B2B2F3B3B3............

Both leave the same **bubble**: each stage idles for P - 1 forward-and-backward slots of the M + P - 1 in a step, a
fraction ``(P - 1) / (M + P - 1)``; interleaving with V chunks makes each slot V times shorter,
``(P - 1) / (V M + P - 1)``. What 1F1B saves is **memory**: a micro-batch's activations are kept from its forward
to its backward, and 1F1B starts backwards after P - s forwards where GPipe waits for all M.

**Instructions**, one small record per kind: :class:`Forward`/:class:`Backward` of (virtual) stage ``stage`` on
micro-batch ``micro``, each in a ``phase`` (warm-up, steady, cool-down); :class:`Recv`/:class:`Send` of an
``"activation"`` (forward, to the next stage) or a ``"gradient"`` (backward, to the previous one), with the ``peer``
pipeline rank; and the step's end, the same on every rank: :class:`WaitSends`, :class:`AllReduceGradients` (over the
stage's replicas) and :class:`OptimizerStep`. A receive is placed just before the computation that needs it and a
send just after the computation that makes it; sends do not wait for their receiver (``Isend``), receives do.
:func:`check` holds a schedule to its rules (every forward before its backward, sends and receives matched one to
one), :func:`simulate` runs the message order with given compute times (a deadlock is an error naming what every
stage waits for) and returns the timeline the lesson draws, :func:`in_flight` counts the activations each stage
keeps.
"""

from __future__ import annotations

import heapq

from dtrain.parallel.instructions import (
    END_OF_STEP,
    KINDS,
    OPS,
    AllReduceGradients,
    Backward,
    Compute,
    Forward,
    Instruction,
    Message,
    OptimizerStep,
    Recv,
    Send,
    WaitSends,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# the instruction records (instructions.py), for whoever reads a schedule
__all__ = ["END_OF_STEP", "KINDS", "OPS", "SCHEDULES", "AllReduceGradients", "Backward", "Compute", "Forward",
           "Instruction", "Message", "OptimizerStep", "Recv", "Send", "WaitSends", "bars", "bubble", "bubble_formula",
           "build", "check", "gpipe", "gpipe_order", "idle_fraction", "in_flight", "interleaved_1f1b", "one_f_one_b",
           "one_f_one_b_order", "simulate", "tag", "text", "with_messages"]  # fmt: skip


def tag(message: tuple, microbatches: int) -> int:
    """The MPI tag of a message: unique in a step, so messages of different micro-batches never match."""
    kind, boundary, micro = message
    return (boundary * microbatches + micro) * 2 + KINDS.index(kind)


def gpipe_order(stages: int, microbatches: int) -> list[list[Compute]]:
    """Each stage's computations in GPipe: all forwards, then all backwards (in the same order)."""
    _check_sizes(stages, microbatches, 1)
    return [[Forward(s, i, "warm-up") for i in range(microbatches)]
            + [Backward(s, i, "cool-down") for i in range(microbatches)] for s in range(stages)]  # fmt: skip


def gpipe(stages: int, microbatches: int) -> list[list[Instruction]]:
    """All forwards, then all backwards (in the same order), on every stage: :func:`gpipe_order`, with messages."""
    return with_messages(gpipe_order(stages, microbatches), stages)


def one_f_one_b_order(stages: int, microbatches: int) -> list[list[Compute]]:
    """Each stage's computations in 1F1B: warm-up (P - s - 1 forwards), steady state (one forward, one backward),
    cool-down (the backwards left)."""
    _check_sizes(stages, microbatches, 1)
    programs = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        order = [Forward(s, i, "warm-up") for i in range(warmup)]
        for k in range(microbatches - warmup):
            order += [Forward(s, warmup + k, "steady"), Backward(s, k, "steady")]
        order += [Backward(s, i, "cool-down") for i in range(microbatches - warmup, microbatches)]
        programs.append(order)
    return programs


def one_f_one_b(stages: int, microbatches: int) -> list[list[Instruction]]:
    """1F1B's computations (:func:`one_f_one_b_order`), with messages."""
    return with_messages(one_f_one_b_order(stages, microbatches), stages)


def interleaved_1f1b(stages: int, microbatches: int, virtual: int) -> list[list[Instruction]]:
    """Megatron-LM's interleaved 1F1B: rank r holds chunks r, r + P, ..., r + (V-1) P of a model cut into P V.

    The forwards go through the micro-batches in groups of P: chunk 0 on micro-batches 0..P-1, chunk 1 on the same,
    ..., then chunk 0 on P..2P-1, and so on; backwards likewise, last chunk first. Warm-up: 2 (P - r - 1) + (V - 1) P
    forwards (all of them when M = P). M must be a multiple of P.
    """
    _check_sizes(stages, microbatches, virtual)
    if stages < 2:
        raise ValueError("interleaving needs at least 2 stages: on one, every chunk would be on the same rank")
    if microbatches % stages:
        raise ValueError(f"interleaving needs the micro-batches ({microbatches}) to be a multiple of the stages "
                         f"({stages})")  # fmt: skip
    total = microbatches * virtual

    def unit(k: int, forward: bool) -> tuple[int, int]:  # the k-th forward (backward) of a rank: (chunk, micro)
        group, within = divmod(k, stages * virtual)
        chunk = within // stages
        return (chunk if forward else virtual - 1 - chunk), group * stages + within % stages

    programs = []
    for r in range(stages):
        warmup = total if microbatches == stages else min(2 * (stages - r - 1) + (virtual - 1) * stages, total)
        forwards = [(*unit(k, True), "warm-up" if k < warmup else "steady") for k in range(total)]
        backwards = [(*unit(k, False), "steady" if k < total - warmup else "cool-down") for k in range(total)]
        order = [("forward", *forwards[k]) for k in range(warmup)]
        for k in range(total - warmup):
            order += [("forward", *forwards[warmup + k]), ("backward", *backwards[k])]
        order += [("backward", *backwards[k]) for k in range(total - warmup, total)]
        programs.append([(Forward if op == "forward" else Backward)(chunk * stages + r, micro, phase)
                         for op, chunk, micro, phase in order])  # fmt: skip
    return with_messages(programs, stages, virtual)


def build(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Instruction]]:
    """The schedule called ``name`` ("gpipe", "1f1b" or "interleaved")."""
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "interleaved":
        return interleaved_1f1b(stages, microbatches, virtual)
    raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")


def _check_sizes(stages: int, microbatches: int, virtual: int) -> None:
    for what, value in (("stages", stages), ("micro-batches", microbatches), ("virtual stages", virtual)):
        if value < 1:
            raise ValueError(f"a schedule needs >= 1 {what}, got {value}")


def with_messages(programs: list[list[Compute]], stages: int, virtual: int = 1) -> list[list[Instruction]]:
    """Each rank's computations (:class:`Forward`/:class:`Backward`, in order) with a receive before each one whose
    input lives on another rank, a send after each one whose output does, and at the end: the sends awaited, the
    gradients averaged over the replicas, the optimizer step."""
    last = stages * virtual - 1
    result = []
    for rank, order in enumerate(programs):
        program = []
        for ins in order:
            forward = ins.op == "forward"
            source = ins.stage - 1 if forward else ins.stage + 1  # who makes this computation's input
            dest = ins.stage + 1 if forward else ins.stage - 1  # who needs its output
            kind = "activation" if forward else "gradient"
            if 0 <= source <= last and source % stages != rank:
                program.append(Recv(ins.stage, ins.micro, kind, source % stages))
            program.append(ins)
            if 0 <= dest <= last and dest % stages != rank:
                program.append(Send(ins.stage, ins.micro, kind, dest % stages))
        result.append([*program, *END_OF_STEP])
    return result


# --- checking, timing and counting, without MPI ------------------------------------------------------------------


def check(schedule: list[list[Instruction]], microbatches: int, virtual: int = 1) -> None:
    """Raise ValueError unless every (stage, micro-batch) runs one forward and then one backward, on the rank that
    holds the stage, and every send has exactly one matching receive on its peer (and the other way round)."""
    stages = len(schedule)
    expected = {(s, i) for s in range(stages * virtual) for i in range(microbatches)}
    sends, recvs = {}, {}
    for rank, program in enumerate(schedule):
        done = {"forward": set(), "backward": set()}
        for ins in program:
            if ins.op in done:
                key = (ins.stage, ins.micro)
                if ins.stage % stages != rank:
                    raise ValueError(
                        f"rank {rank} runs {ins} of stage {ins.stage}, which lives on {ins.stage % stages}"
                    )
                if key in done[ins.op]:
                    raise ValueError(f"rank {rank} runs {ins} twice")
                if ins.op == "backward" and key not in done["forward"]:
                    raise ValueError(f"rank {rank} runs {ins} before its forward")
                done[ins.op].add(key)
            elif ins.op in ("send", "recv"):
                book = sends if ins.op == "send" else recvs
                ends = (rank, ins.peer) if ins.op == "send" else (ins.peer, rank)
                if ins.message() in book:
                    raise ValueError(f"rank {rank}: {ins} is the second {ins.op} of {ins.message()}")
                book[ins.message()] = ends
        mine = {key for key in expected if key[0] % stages == rank}
        for op, seen in done.items():
            if seen != mine:
                raise ValueError(f"rank {rank} runs the {op} of {sorted(seen ^ mine)[:3]} wrongly (missing or extra)")
    if sends != recvs:
        unmatched = sorted(set(sends.items()) ^ set(recvs.items()))[:3]
        raise ValueError(f"sends and receives do not match one to one: {unmatched}")


def simulate(schedule: list[list[Instruction]], forward_s: float = 1.0, backward_s: float = 2.0, virtual: int = 1):
    """Run the message order with every forward taking ``forward_s`` and every backward ``backward_s`` (per whole
    stage: a chunk of an interleaved stage takes 1/V of it), sends and receives instantly. Returns
    ``[(rank, instruction, start, end), ...]`` of every computation; a deadlock raises RuntimeError naming each
    rank's wait."""
    cost = {"forward": forward_s / virtual, "backward": backward_s / virtual}
    position, clock = [0] * len(schedule), [0.0] * len(schedule)
    sent: dict[tuple, float] = {}  # message -> when it was sent
    timeline = []
    ready = [(0.0, rank) for rank in range(len(schedule))]  # ranks that may be able to go on, by their clock
    while ready:
        _, rank = heapq.heappop(ready)
        program = schedule[rank]
        while position[rank] < len(program):
            ins = program[position[rank]]
            if ins.op == "recv":
                if ins.message() not in sent:
                    break  # wait: the sender wakes this rank
                clock[rank] = max(clock[rank], sent[ins.message()])
            elif ins.op == "send":
                sent[ins.message()] = clock[rank]
                heapq.heappush(ready, (clock[rank], ins.peer))
            elif ins.op in cost:
                start = clock[rank]
                clock[rank] += cost[ins.op]
                timeline.append((rank, ins, start, clock[rank]))
            position[rank] += 1
    stuck = [f"rank {r} waits at {p[position[r]]}" for r, p in enumerate(schedule) if position[r] < len(p)]
    if stuck:
        raise RuntimeError("the schedule deadlocks: " + "; ".join(stuck))
    return sorted(timeline, key=lambda event: (event[2], event[0]))


def bars(timeline, stages: int) -> list[tuple]:
    """:func:`simulate`'s timeline as ``(rank, op, micro, start, end, chunk)`` tuples, for ``report.draw_timeline``."""
    return [(rank, ins.op, ins.micro, start, end, ins.stage // stages) for rank, ins, start, end in timeline]


def text(timeline, stages: int, unit: float = 1.0) -> list[str]:
    """:func:`simulate`'s timeline as lines of text, a line per rank, two characters per ``unit`` of time: ``F3``
    for micro-batch 3's forward, ``B3`` for its backward (as many pairs as it lasts; lower case for a later chunk of
    an interleaved rank), ``..`` idle: the bubble. Micro-batches past 9 are letters."""
    end = max(finish for *_, finish in timeline)
    rows = [["."] * round(2 * end / unit) for _ in range(stages)]
    for rank, ins, start, finish in timeline:
        letter = ins.op[0].upper() if ins.stage < stages else ins.op[0]
        cell = letter + "0123456789abcdefghijklmnopqrstuvwxyz"[ins.micro % 36]
        for k in range(round(start / unit), round(finish / unit)):
            rows[rank][2 * k : 2 * k + 2] = cell
    return ["".join(row) for row in rows]


def idle_fraction(spans) -> float:
    """The fraction of a step (first start to last end) the ranks spend idle, on average, from the ``(rank, start,
    end)`` of every computation: the bubble, of a simulated timeline or of one measured on real ranks."""
    spans = list(spans)
    ranks = {rank for rank, _, _ in spans}
    step = max(end for _, _, end in spans) - min(start for _, start, _ in spans)
    busy = sum(end - start for _, start, end in spans)
    return 1.0 - busy / (len(ranks) * step)


def bubble(timeline) -> float:
    """The idle fraction of :func:`simulate`'s timeline."""
    return idle_fraction((rank, start, end) for rank, _, start, end in timeline)


def bubble_formula(stages: int, microbatches: int, virtual: int = 1) -> float:
    """(P - 1) / (V M + P - 1): the idle fraction of a balanced pipeline (GPipe and 1F1B: V = 1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def in_flight(program: list[Instruction], weight=None) -> int:
    """The most (stage, micro-batch) activations a rank holds at once: forwards done whose backward is not.
    ``weight(stage)``: count each by its bytes instead (default 1 each)."""
    weight = weight or (lambda stage: 1)
    held = peak = 0
    for ins in program:
        if ins.op == "forward":
            held += weight(ins.stage)
            peak = max(peak, held)
        elif ins.op == "backward":
            held -= weight(ins.stage)
    return peak

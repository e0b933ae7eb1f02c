"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches flowing through them (GPipe, 1F1B).

**The idea.** Cut the MLP's Linear layers (each with the activation after it) into P *stages* and give stage s to
pipeline rank s. A micro-batch's activations travel forward from stage to stage as point-to-point messages, and the
gradients of those activations travel back; each rank holds, computes and updates only its own layers::

    stage 0 (rank 0)        stage 1 (rank 1)        stage 2 (rank 2)
    [ L0 relu L1 relu ] --a--> [ L2 relu ] --a--> [ L3 ] -> loss       a: activation (micro-batch x width), Isend
                        <--g--             <--g--                      g: its gradient, on the way back

One batch would keep all but one stage idle; so the replica's slice of the global batch is cut into M micro-batches
(``--microbatches``) and the stages work on different ones at once. *When* each stage runs which forward and
backward is the **schedule** (``--schedule gpipe|1f1b|interleaved``), which is data: schedules.py returns, for every
stage, its list of instructions (forward/backward of micro-batch i, send/receive an activation/gradient, the optimizer
step), and :meth:`Pipeline.step` is a small interpreter that executes its rank's list. The gradients of the M
micro-batches accumulate, so the step is exactly one step on the whole batch: ``pp`` follows ``single``.

**The cut** (printed at start; stages.py): contiguous stages *balanced by parameter count*, the cut that makes the
largest stage smallest. For a Linear layer forward and backward cost 2 and 4 times batch x its weights in FLOPs, so
balancing the parameters balances the compute, up to the biases and activations. Interleaving (``--virtual-stages
V``) cuts the model into P V chunks of equal numbers of layers (Megatron's rule), so P V must divide the layers; rank
r holds chunks r, r + P, ... and the micro-batches cross the ranks V times.

**Inside a stage, tensor parallelism** (``--tp T``): a stage's layers are split as tensor_parallel.py splits a
model, over the stage's tensor group; each tensor rank sends the whole activation to the same tensor rank of the next
stage. So that every stage has layers to split, the cut then falls only between column-then-row pairs of layers (as
Megatron cuts between transformer layers, each of which holds such pairs); the units above are pairs, not layers.
With ``--dp D`` every stage's ranks average their gradients with their replicas before each optimizer step. That is
the 3-D grid (grid.py): dp x tp x pp ranks.

**Cost per step** (M micro-batches of m = B / (D M) samples, b bytes per number; w_in(s), w_out(s): the widths
entering and leaving stage s)::

    sent by a rank of stage s   M m w_out(s) b  (activations, but the last stage)  +  M m w_in(s) b  (gradients,
                                but the first)  +  its tensor group's all-reduces  +  2 (D-1)/D n_s b (dp)
    activations held            (micro-batches in flight) x (stage s's intermediate results for one micro-batch,
                                and its received input): M in flight for GPipe, at most P - s for 1F1B
    bubble (idle fraction)      (P - 1) / (M + P - 1)           interleaved: (P - 1) / (V M + P - 1)

Exact figures: :meth:`Pipeline.costs` (bytes sent, state and peak activation bytes per rank, from the schedule),
held against the tracer and the interpreter's own count of the activations it keeps (tests/test_pipeline.py).
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from dtrain import collectives
from dtrain.autograd import Tensor, activation_bytes, softmax_cross_entropy
from dtrain.backend import array_module, resolve_dtype
from dtrain.comm import waitall, watchdog
from dtrain.comm.trace import EVALUATION, labelled
from dtrain.errors import ConfigError
from dtrain.nn import Sequential
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import parameter_count, register, schedules
from dtrain.parallel.flags import ALLREDUCE, Flag
from dtrain.parallel.grid import DP, PP, TP
from dtrain.parallel.model_parallel import ModelParallel
from dtrain.parallel.stages import cut, hidden_for, units
from dtrain.parallel.tensor_parallel import (
    TensorGroup,
    activation_elements,
    activations_sent,
    check_splittable,
    group_allreduce_bytes,
    local_parameters,
    plan,
    shard,
)


class PipelineForward:
    """The whole model's forward, for evaluation: each stage in turn on the whole test batch (no micro-batches), the
    activations passed on point to point, the logits broadcast from the last stage to every stage."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    def __call__(self, x: Tensor) -> Tensor:
        pipe = self.pipeline
        comm, last, rows = pipe.grid.pp_comm, pipe.stages - 1, x.shape[0]
        xp = array_module(x.data)
        with labelled(pipe.comm, EVALUATION):
            h = x
            for v in pipe.mine:
                if v > 0:
                    h = Tensor(pipe.receive(xp.empty((rows, pipe.width(v)), dtype=pipe.dtype), (v - 1) % pipe.P, v,
                                            f"stage {v}: waiting for the evaluation batch's activations"))  # fmt: skip
                h = pipe.chunks[v](h)
                if v < last:
                    waitall([comm.Isend(h.data, dest=(v + 1) % pipe.P, tag=v + 1)])
            logits = h.data if last in pipe.chunks else xp.empty((rows, pipe.sizes[-1]), dtype=pipe.dtype)
            collectives.broadcast(comm, logits, root=last % pipe.P)
        return Tensor(logits)


MICROBATCHES = Flag("microbatches", None, "micro-batches per step, each replica's slice of the batch cut into M "
                    "(default 4)", type=int, metavar="M", at_least=1)  # fmt: skip
SCHEDULE = Flag("schedule", None, "gpipe (all forwards, then all backwards), 1f1b (one forward, one backward) or "
                "interleaved (1f1b over --virtual-stages chunks per rank) (default 1f1b)",
                choices=schedules.SCHEDULES)  # fmt: skip
VIRTUAL_STAGES = Flag("virtual_stages", None, "interleaved: model chunks per rank (default 2)", type=int, metavar="V",
                      at_least=1)  # fmt: skip


@register
class Pipeline(ModelParallel):
    name = "pp"
    summary = "pipeline parallel: consecutive layers on --pp ranks, micro-batches flowing through them"
    lesson = 8
    flags = (DP, TP, PP, MICROBATCHES, SCHEDULE, VIRTUAL_STAGES, ALLREDUCE)
    fill = "pp"

    @staticmethod
    def settings(config) -> tuple[str, int, int]:
        """(schedule, micro-batches M, virtual stages V), the defaults filled in: 1f1b, 4, and V = 2 interleaved."""
        schedule = config.schedule or "1f1b"
        return schedule, config.microbatches or 4, config.virtual_stages or (2 if schedule == "interleaved" else 1)

    @classmethod
    def check(cls, config, world: int) -> None:
        if config.accumulate != 1:
            raise ConfigError("--accumulate is not for --paradigm pp: its --microbatches accumulate the gradients")
        super().check(config, world)
        shape, (schedule, m, v) = cls.shape_of(config, world), cls.settings(config)
        layers, stages = len(config.hidden) + 1, shape.pp * v
        available = len(units(layers, shape.tp)) - 1
        what = f"{layers} Linear layers" if shape.tp == 1 else (
            f"{available} column-then-row pair(s) of Linear layers to split over --tp {shape.tp} (with tensor "
            "parallelism a pipeline cuts between pairs, so that every stage has layers to split)")  # fmt: skip
        hidden = f"--hidden {','.join(map(str, config.hidden)) or 'none'}"
        if schedule == "interleaved":
            if v < 2 or shape.pp < 2:
                raise ConfigError(f"--schedule interleaved needs --virtual-stages >= 2 and --pp >= 2, got {v} and "
                                  f"{shape.pp}")  # fmt: skip
            if available % stages:
                raise ConfigError(f"--pp {shape.pp} x --virtual-stages {v} = {stages} chunks do not divide the "
                                  f"{what} ({hidden}): interleaving gives every chunk the same number; give "
                                  f"{hidden_for(-(-available // stages) * stages, shape.tp, config.hidden)} or another "
                                  "--virtual-stages")  # fmt: skip
            if m % shape.pp:
                raise ConfigError(f"--schedule interleaved needs --microbatches a multiple of --pp {shape.pp}, got {m}")
        elif v != 1:
            raise ConfigError(f"--virtual-stages {v} is for --schedule interleaved, not {schedule}")
        if stages > available:
            fewer = "--pp" if v == 1 else "--pp or --virtual-stages"
            raise ConfigError(f"{stages} pipeline stages but the model has {what} ({hidden}): every stage needs one; "
                              f"give {hidden_for(stages, shape.tp, config.hidden)}, or a smaller {fewer}")  # fmt: skip
        replica = config.batch_size // shape.dp
        if replica % m:
            raise ConfigError(f"--microbatches {m} must divide each replica's slice of the batch ({replica} = "
                              f"{config.batch_size} / {shape.dp} replicas)")  # fmt: skip
        check_splittable([1, *config.hidden, 1], shape.tp)  # the pairs' widths (the data's widths never split)

    def build(self, make_model, make_optimizer) -> None:
        whole = make_model()  # the whole model, from the seed: identical on every rank (then dropped)
        config, P = self.config, self.shape.pp
        self.schedule, self.M, self.V = self.settings(config)
        self.P, self.sizes, self.dtype, self.stages = P, list(whole.sizes), whole.flat_params.dtype, P * self.V
        self.bounds = cut(self.sizes, self.stages, equal=self.schedule == "interleaved", tp=self.shape.tp)
        self.mine = [v for v in range(self.stages) if v % P == self.grid.pp_rank]  # my stages, in order
        group = TensorGroup(self.grid.tp_comm, config.allreduce)
        self.chunks, pieces = {}, []
        for v in self.mine:
            modules, chunk_pieces = shard(whole, self.bounds[v], self.bounds[v + 1], group)
            self.chunks[v] = Sequential(modules)
            pieces += chunk_pieces
        local = Sequential(list(self.chunks.values()))
        local.flatten_(xp=array_module(whole.flat_params), dtype=self.dtype)  # one flat buffer for all my chunks
        starts = list(itertools.accumulate((a * b + b for a, b in itertools.pairwise(self.sizes)), initial=0))
        self.regions = [(v % P, starts[self.bounds[v]], starts[self.bounds[v + 1]]) for v in range(self.stages)]
        self.program = schedules.build(self.schedule, P, self.M, self.V)[self.grid.pp_rank]
        self.adopt(local, pieces, whole.flat_params.size, make_optimizer)
        self.delay = None  # (seconds per Linear layer forward, backward): a sleep-calibrated pipeline (benchmarks)
        self.held = self.peak = 0  # activation bytes kept for backward: now, and the most at once
        self.timeline, self.busy_s, self.step_s = [], 0.0, 0.0
        if self.rank == 0 and not config.quiet:
            print(self.describe(), flush=True)

    def describe(self) -> str:
        parts = []
        for v in range(self.stages):
            a, b = self.bounds[v], self.bounds[v + 1]
            n = parameter_count(self.sizes[a : b + 1])
            split = f" ({', '.join(plan(b - a))} over {self.shape.tp} tensor ranks)" if self.shape.tp > 1 else ""
            parts.append(f"  stage {v} (pipeline rank {v % self.P}): layers {a}-{b - 1}, "
                         f"{'-'.join(map(str, self.sizes[a : b + 1]))}, {n:,} parameters{split}")  # fmt: skip
        rule = "equal layers per chunk" if self.V > 1 else "balanced by parameter count"
        head = (f"pipeline: {self.stages} stages ({rule}), schedule {self.schedule}, {self.M} micro-batches "
                f"of {self.config.batch_size // (self.shape.dp * self.M)}; bubble (P-1)/(VM+P-1) = "
                f"{schedules.bubble_formula(self.P, self.M, self.V):.3f}")  # fmt: skip
        return "\n".join([head, *parts])

    def width(self, v: int) -> int:
        """The width of the activations entering stage ``v``."""
        return self.sizes[self.bounds[v]]

    # --- messages -----------------------------------------------------------------------------------------
    def receive(self, buf, source: int, tag: int, what: str):
        comm = self.grid.pp_comm
        with watchdog.watching(comm, f"pipeline {what}", peer=source, tag=tag):
            waitall([comm.Irecv(buf, source=source, tag=tag)])
        return buf

    # --- one step: the interpreter ------------------------------------------------------------------------
    def step(self, x, y) -> float:
        """Run this rank's instructions for one global step; the replica's mean loss on the last stage, else 0."""
        step_start = time.perf_counter()
        self.model.zero_grad()
        self.x, self.y, self.rows = x, y, len(y) // self.M
        self.inbox, self.outbox, self.saved, self.sending, self.losses, self.timeline = {}, {}, {}, [], [], []
        for ins in self.program:
            started = time.perf_counter()
            getattr(self, "_" + ins.op)(ins)
            if ins.op in ("forward", "backward"):
                self._computed(ins, started)
        self.step_s += time.perf_counter() - step_start
        return float(np.mean(self.losses)) if self.losses else 0.0

    def _micro(self, i: int) -> slice:
        return slice(i * self.rows, (i + 1) * self.rows)

    def _forward(self, ins) -> None:
        v, i = ins.stage, ins.micro
        if v == 0:
            inputs = Tensor(self.x[self._micro(i)])
        else:  # the received activations: a leaf whose gradient goes back to the previous stage
            inputs = Tensor(self.inbox.pop(("activation", v, i)), requires_grad=True)
        out = self.chunks[v](inputs)
        if v == self.stages - 1:
            out = softmax_cross_entropy(out, self.y[self._micro(i)])
            self.losses.append(float(out.data))
        kept = activation_bytes(out) + (inputs.data.nbytes if v > 0 else 0)
        self.saved[v, i] = (inputs, out, kept)
        self.held += kept
        self.peak = max(self.peak, self.held)

    def _backward(self, ins) -> None:
        inputs, out, kept = self.saved.pop((ins.stage, ins.micro))
        if ins.stage == self.stages - 1:  # each micro-batch's mean loss counts 1/M: the gradient of the batch's mean
            out.backward(array_module(out.data).full_like(out.data, 1.0 / self.M))
        else:
            out.backward(self.inbox.pop(("gradient", ins.stage, ins.micro)))
        self.held -= kept
        if ins.stage > 0:  # the gradient of the received activations, for the send instruction that names it
            self.outbox[ins.stage, ins.micro] = inputs.grad

    def _send(self, ins) -> None:
        key = (ins.stage, ins.micro)
        data = self.saved[key][1].data if ins.kind == "activation" else self.outbox.pop(key)
        with labelled(self.comm, f"pp/{ins.kind}s"):
            request = self.grid.pp_comm.Isend(data, dest=ins.peer, tag=schedules.tag(ins.message(), self.M))
        self.sending.append((request, data))  # (the array must live until the message has left)

    def _recv(self, ins) -> None:
        width = self.width(ins.stage) if ins.kind == "activation" else self.sizes[self.bounds[ins.stage + 1]]
        buf = array_module(self.model.flat_params).empty((self.rows, width), dtype=self.dtype)
        with labelled(self.comm, f"pp/{ins.kind}s"):
            what = f"stage {ins.stage}: waiting for the {ins.kind} of micro-batch {ins.micro} from rank {ins.peer}"
            self.receive(buf, ins.peer, schedules.tag(ins.message(), self.M), what)
        self.inbox[ins.kind, ins.stage, ins.micro] = buf

    def _step(self, ins) -> None:
        waiting = watchdog.watching(self.grid.pp_comm, "pipeline: sends in flight")
        with labelled(self.comm, "pp/sends-in-flight"), waiting:
            waitall([request for request, _ in self.sending])  # (already gone, all but always: a formality)
        self.sending = []
        self.average_gradients()
        self.optimizer.step()

    def _computed(self, ins, started: float) -> None:
        """Bookkeeping after a forward or backward: the sleep of a calibrated pipeline or a straggler, the timeline."""
        if self.delay is not None:
            layers = self.bounds[ins.stage + 1] - self.bounds[ins.stage]
            time.sleep(layers * self.delay[ins.op == "backward"])
        if self.rank == self.config.slow_rank:  # (with --tp, the computation's all-reduces are part of its time)
            time.sleep((self.config.slow_factor - 1.0) * (time.perf_counter() - started))
        ended = time.perf_counter()
        self.busy_s += ended - started
        self.timeline.append((ins.op, ins.stage, ins.micro, started, ended))
        if self.tracer is not None:
            self.tracer.span(f"{ins} ({ins.phase})", started, ended, stage=ins.stage, micro=ins.micro)

    # --- the rest of the seam -----------------------------------------------------------------------------
    def replica_loss(self, local_mean: float) -> float:
        return self.grid.pp_comm.bcast(local_mean, root=(self.stages - 1) % self.P)  # the last stage's loss

    def evaluation_model(self):
        return PipelineForward(self)

    def finish(self) -> dict:
        figures = super().finish()
        mine = {
            "peak_activation_bytes": self.peak,
            "idle_fraction": 1 - self.busy_s / self.step_s if self.step_s else 0,
        }
        return {**figures, "stages": self.bounds, "schedule": self.schedule, "microbatches": self.M,
                "virtual_stages": self.V, "per_rank": self.comm.allgather(mine)}  # fmt: skip

    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per rank (lists): bytes sent per step, the bytes held of parameters, gradients and optimizer state, and
        the peak bytes of activations kept for backward (from the schedule)."""
        shape, b = cls.shape_of(config, world), resolve_dtype(config.dtype).itemsize
        (schedule, M, V), P = cls.settings(config), shape.pp
        stages, rows = P * V, config.batch_size // (shape.dp * M)
        bounds = cut(sizes, stages, equal=schedule == "interleaved", tp=shape.tp)
        program = schedules.build(schedule, P, M, V)
        buffers = buffers_per_parameter(config.optimizer, config.momentum)

        def kept(v):  # one micro-batch's activations on stage v: its received input and its intermediate results
            first, stop = bounds[v], bounds[v + 1]
            received = rows * sizes[first] if v > 0 else 0
            return (received + activation_elements(sizes, first, stop, rows, shape.tp)) * b

        costs = {"sent_per_step": [], "parameters": [], "gradients": [], "optimizer": [], "activations": []}
        for rank in range(world):
            at = shape.coordinates(rank)
            mine = [v for v in range(stages) if v % P == at["pp"]]
            n = sum(local_parameters(sizes, shape.tp, bounds[v], bounds[v + 1]) for v in mine)
            sent = group_allreduce_bytes(config.allreduce, [n], b, shape.dp, at["dp"])
            for v in mine:
                first, stop = bounds[v], bounds[v + 1]
                sent += M * rows * sizes[stop] * b if v < stages - 1 else 0  # activations to the next stage
                sent += M * rows * sizes[first] * b if v > 0 else 0  # their gradients to the previous one
                forward, backward = activations_sent(sizes, first, stop, rows)
                sent += M * group_allreduce_bytes(config.allreduce, forward + backward, b, shape.tp, at["tp"])
            costs["sent_per_step"].append(sent)
            for kind, count in (("parameters", n), ("gradients", n), ("optimizer", buffers * n)):
                costs[kind].append(count * b)
            costs["activations"].append(schedules.in_flight(program[at["pp"]], kept))
        return costs

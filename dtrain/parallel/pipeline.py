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
stage, its list of instructions (forward/backward of micro-batch i, send/receive an activation/gradient; at the end
the gradients' all-reduce over the replicas and the optimizer step), and :meth:`Pipeline.step` is a small interpreter
that executes its rank's list. The gradients of the M
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

import dataclasses
import time

import numpy as np

from dtrain import terminal
from dtrain.autograd import Tensor, activation_bytes, softmax_cross_entropy
from dtrain.backend import array_module, host_or_device_loss, is_device_array
from dtrain.comm import waitall, watchdog
from dtrain.comm.trace import labelled
from dtrain.errors import ConfigError
from dtrain.layout import layer_starts
from dtrain.nn import Sequential
from dtrain.parallel import register, schedules, stages
from dtrain.parallel.flags import ALLREDUCE, Flag
from dtrain.parallel.grid import DP, PP, TP
from dtrain.parallel.instructions import AllReduceGradients, Backward, Forward, OptimizerStep, Recv, Send, WaitSends
from dtrain.parallel.model_parallel import ModelParallel
from dtrain.parallel.pipeline_evaluation import PipelineForward
from dtrain.parallel.stages import check_cut, costs_per_rank, cut
from dtrain.parallel.tensor_parallel import TensorGroup, check_splittable, shard


@dataclasses.dataclass
class Step:
    """What one step's instructions share: this rank's slice (x, y), in micro-batches of ``rows``; the messages
    received and to send; each micro-batch's activations until its backward; the sends in flight; the losses."""

    x: object
    y: object
    rows: int
    inbox: dict = dataclasses.field(default_factory=dict)
    outbox: dict = dataclasses.field(default_factory=dict)
    saved: dict = dataclasses.field(default_factory=dict)
    sending: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    timeline: list = dataclasses.field(default_factory=list)  # (op, stage, micro, start, end) of each computation

    def micro(self, i: int) -> slice:
        return slice(i * self.rows, (i + 1) * self.rows)


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
    order = 8  # where it comes in listings (--help, the planner): the course teaches it then
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
        check_cut(config.hidden, shape, schedule, m, v)
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
        starts = layer_starts(self.sizes)
        self.regions = [(v % P, starts[self.bounds[v]], starts[self.bounds[v + 1]]) for v in range(self.stages)]
        self.program = schedules.build(self.schedule, P, self.M, self.V)[self.grid.pp_rank]
        self.adopt(local, pieces, whole.flat_params.size, make_optimizer)
        self.delay = None  # (seconds per Linear layer forward, backward): a sleep-calibrated pipeline (benchmarks)
        self.held = self.peak = 0  # activation bytes kept for backward: now, and the most at once
        self.timeline, self.busy_s, self.step_s = [], 0.0, 0.0
        if self.rank == 0 and not config.quiet:
            print(terminal.wrapped(self.describe()), flush=True)

    def describe(self) -> str:
        """The cut and the schedule, as rank 0 prints them at the start (:func:`stages.describe`)."""
        rows = self.config.batch_size // (self.shape.dp * self.M)
        return stages.describe(self.sizes, self.bounds, self.P, self.shape.tp, self.schedule, self.M, self.V, rows)

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
        run = Step(x, y, len(y) // self.M)
        for ins in self.program:
            started = time.perf_counter()
            getattr(self, "_" + ins.op)(ins, run)  # _forward, _backward, _send, _recv, _wait, _allreduce, _step
            if ins.op in ("forward", "backward"):
                self._computed(ins, started, run)
        self.step_s += time.perf_counter() - step_start
        self.timeline = run.timeline  # the last step's, for the lesson to draw
        if not run.losses:
            return 0.0
        if is_device_array(run.losses[0]):  # (kept on the GPU: the driver reads losses a few steps at a time)
            return array_module(run.losses[0]).stack(run.losses).mean()
        return float(np.mean(run.losses))

    def _forward(self, ins: Forward, run: Step) -> None:
        v, rows = ins.stage, run.micro(ins.micro)
        if v == 0:
            inputs = Tensor(run.x[rows])
        else:  # the received activations: a leaf whose gradient goes back to the previous stage
            inputs = Tensor(run.inbox.pop(("activation", v, ins.micro)), requires_grad=True)
        out = self.chunks[v](inputs)
        if v == self.stages - 1:
            out = softmax_cross_entropy(out, run.y[rows])
            run.losses.append(host_or_device_loss(out.data))
        kept = activation_bytes(out) + (inputs.data.nbytes if v > 0 else 0)
        run.saved[v, ins.micro] = (inputs, out, kept)
        self.held += kept
        self.peak = max(self.peak, self.held)

    def _backward(self, ins: Backward, run: Step) -> None:
        inputs, out, kept = run.saved.pop((ins.stage, ins.micro))
        if ins.stage == self.stages - 1:  # each micro-batch's mean loss counts 1/M: the gradient of the batch's mean
            out.backward(array_module(out.data).full_like(out.data, 1.0 / self.M))
        else:
            out.backward(run.inbox.pop(("gradient", ins.stage, ins.micro)))
        self.held -= kept
        if ins.stage > 0:  # the gradient of the received activations, for the send instruction that names it
            run.outbox[ins.stage, ins.micro] = inputs.grad

    def _send(self, ins: Send, run: Step) -> None:
        key = (ins.stage, ins.micro)
        data = run.saved[key][1].data if ins.kind == "activation" else run.outbox.pop(key)
        with labelled(self.comm, f"pp/{ins.kind}s"):
            request = self.grid.pp_comm.Isend(data, dest=ins.peer, tag=schedules.tag(ins.message(), self.M))
        run.sending.append((request, data))  # (the array must live until the message has left)

    def _recv(self, ins: Recv, run: Step) -> None:
        width = self.width(ins.stage) if ins.kind == "activation" else self.sizes[self.bounds[ins.stage + 1]]
        buf = array_module(self.model.flat_params).empty((run.rows, width), dtype=self.dtype)
        with labelled(self.comm, f"pp/{ins.kind}s"):
            what = f"stage {ins.stage}: waiting for the {ins.kind} of micro-batch {ins.micro} from rank {ins.peer}"
            self.receive(buf, ins.peer, schedules.tag(ins.message(), self.M), what)
        run.inbox[ins.kind, ins.stage, ins.micro] = buf

    def _wait(self, ins: WaitSends, run: Step) -> None:
        waiting = watchdog.watching(self.grid.pp_comm, "pipeline: sends in flight")
        with labelled(self.comm, "pp/sends-in-flight"), waiting:
            waitall([request for request, _ in run.sending])  # (already gone, all but always: a formality)
        run.sending.clear()

    def _allreduce(self, ins: AllReduceGradients, run: Step) -> None:
        self.average_gradients()

    def _step(self, ins: OptimizerStep, run: Step) -> None:
        self.optimizer.step()

    def _computed(self, ins, started: float, run: Step) -> None:
        """Bookkeeping after a forward or backward: the sleep of a calibrated pipeline or a straggler, the timeline."""
        if self.delay is not None:
            layers = self.bounds[ins.stage + 1] - self.bounds[ins.stage]
            time.sleep(layers * self.delay[ins.op == "backward"])
        if self.rank == self.config.slow_rank:  # (with --tp, the computation's all-reduces are part of its time)
            time.sleep((self.config.slow_factor - 1.0) * (time.perf_counter() - started))
        ended = time.perf_counter()
        self.busy_s += ended - started
        run.timeline.append((ins.op, ins.stage, ins.micro, started, ended))
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

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per rank (lists): bytes sent per step, the bytes held of parameters, gradients and optimizer state, and
        the peak bytes of activations kept for backward (from the schedule): what each stage of the cut sends and
        holds (:func:`~dtrain.parallel.stages.costs_per_rank`)."""
        return costs_per_rank(sizes, world, cls.shape_of(config, world), *cls.settings(config), config)

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        """P stages (P dividing the world) x tp 1 or 2 x the dp the rest makes, GPipe and 1F1B, M = P and 4P
        micro-batches (:meth:`check` weighs each against the model's layers and the batch)."""
        chosen = []
        for tp in (1, 2):
            for P in (p for p in range(2, world // tp + 1) if world % (p * tp) == 0):
                dp = world // (P * tp)
                grid = "".join(f" x {axis}{n}" for axis, n in (("tp", tp), ("dp", dp)) if n > 1)
                chosen += [(f"pp{P}{grid} {s} M={m}", {"pp": P, "tp": tp, "dp": dp, "schedule": s, "microbatches": m},
                            world) for s in ("gpipe", "1f1b") for m in (P, 4 * P)]  # fmt: skip
        return chosen

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """The slowest pipeline rank's micro-batches, the bubble and the update (:func:`stages.step_time`)."""
        return stages.step_time(sizes, world, cls.shape_of(config, world), *cls.settings(config), config, hardware)

    @classmethod
    def activations(cls, sizes, world: int, config) -> list:
        return cls.costs(sizes, world, config)["activations"]  # (from the schedule: the micro-batches in flight)

"""SPMD: annotate how each tensor is split over a device mesh, and let the communication follow (GSPMD, DTensor).

Every other paradigm places its messages by hand: ddp's all-reduce, Megatron's f and g, ZeRO's gathers. Here the
model's code is one and the same for every run (shardings.forward: matmul, + bias, activation, ..., the loss); what
changes is a **layout** per tensor, given on the command line, and the communication is *derived* from the layouts
by a rule per op (layouts.py) and made by dtrain's own collectives over the mesh's axes (sharded.py)::

    --mesh x=2,y=2 --sharding dp-megatron          input[B_x, F]  w1[F, H_y]  b1[H_y]  w2[H_y, H]  ...
      layer 1   input[x,_] @ w1[_,y] -> z1[x,y]                 case 1: nothing sent
      layer 2   a1[x,y] @ w2[y,_]    -> z2[x,_] partial(y)      case 3: each rank multiplies its blocks
                z2 + b2              -> all-reduce over y       (Megatron's g, derived)
      loss      mean over rows split over x: each rank's own mean, averaged
      backward  the conjugate of every move: Megatron's f, FSDP's reduce-scatter, found the same way
      update    the gradients still partial (a replicated weight's, summed over the batch's axis): one fused
                all-reduce over x, as ddp's

**Data parallelism is batch sharding** (``--sharding dp``): only ``input``'s rows are split; every weight's gradient
is then a sum over the split rows, and one all-reduce (a mean: each rank's loss is its own rows' mean, as in ddp) of
the whole flat gradient makes it whole: ddp's bytes and, with its algorithm and one bucket, ddp's weights to the bit.
**Megatron is column-then-row sharding** (tp's bytes). **FSDP is weight sharding**: a weight split by rows over the
batch's axis is all-gathered before its matmul (case 2), released after forward and gathered again in backward where
backward needs it, and its gradient, partial over the batch's axis, is reduce-scattered back onto the rows (the
all-gather's conjugate); unlike ZeRO-3 (zero.py) the biases stay whole (all-reduced) and weights split only whole
rows, never uneven chunks of a flat buffer.

``--explain`` prints every op's layouts and every collective, like a database's query plan, and exits; every run
records the same list in metrics.json (``collectives_per_step``), each collective's traffic labelled by ``where``.

**Cost per step** is the list itself: each collective's bytes on its axis (an all-reduce of n elements over p ranks
sends 2 (p-1)/p n b on the ring; an all-gather or reduce-scatter (p-1)/p of the whole; an all-to-all (p-1)/p of it),
summed; a rank holds its blocks of the parameters, their gradients and the optimizer's state.
"""

from __future__ import annotations

import time

import numpy as np

from dtrain import terminal
from dtrain.backend import array_module, host_or_device_loss, itemsize
from dtrain.collectives import costmodel
from dtrain.comm.trace import CHECKPOINT, EVALUATION
from dtrain.data import widths
from dtrain.errors import ConfigError
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import Paradigm, auto_sharding, check_replicas, placement, pricing, register, shardings, spmd_plan
from dtrain.parallel.flags import ALLREDUCE, Flag
from dtrain.parallel.layouts import spec
from dtrain.parallel.mesh import Mesh, MeshShape, parse
from dtrain.parallel.sharded import Program

MESH = Flag("mesh", None, "the device mesh: named axes and their sizes, the last varying fastest; their product is "
            "the world (default: one axis x of every rank)", type=str, metavar="NAME=SIZE[,NAME=SIZE]")  # fmt: skip
SHARD = Flag("shard", None, "split one tensor: TENSOR is input, w1..wL or b1..bL (w1: the first layer's, inputs x "
             "outputs); SPEC one entry per dimension, a mesh axis or _ (whole), e.g. w1=_,y; repeat it; it overrides "
             "--sharding for that tensor", type=str, metavar="TENSOR=SPEC", repeat=True)  # fmt: skip
SHARDING = Flag("sharding", None, "a named layout of every tensor (default: dp, or none when --shard is given)",
                type=str, choices=shardings.PRESETS)  # fmt: skip
EXPLAIN = Flag("explain", False, "print every op's layouts and every collective the layouts call for, and exit "
               "without training (one process explains any --mesh)")  # fmt: skip
NOT_HERE = ("hierarchical", "hierarchical_rs", "hierarchical_shm")  # need --ranks-per-node, a ddp flag


@register
class SPMD(Paradigm):
    name = "spmd"
    summary = "layouts on a device mesh, the communication derived"
    order = 14  # where it comes in listings: the course's lesson 14
    flags = (MESH, SHARD, SHARDING, EXPLAIN, ALLREDUCE)

    @classmethod
    def world_of(cls, config, world: int) -> int:
        """The ranks the layouts are for: the world's, or, explaining on one process, the mesh's own."""
        return parse(config.mesh, None).size if config.explain and world == 1 and config.mesh else world

    @classmethod
    def sizes_of(cls, config) -> tuple[int, ...]:
        """The MLP's widths, the data's from its name (a layout over them is checked before the data is read)."""
        features, classes = widths(config.dataset, config.features, config.classes)
        return (features, *config.hidden, classes)

    @classmethod
    def words_of(cls, sizes, world: int, config) -> tuple[tuple[str, ...], str]:
        """(--shard words, the preset under them): --sharding auto becomes the words of the layout it chose."""
        sharding, words = shardings.sharding_of(config), tuple(config.shard or ())
        if sharding == "auto":  # (a tensor --shard names keeps the user's layout)
            chosen = auto_sharding.choose(tuple(sizes), world, config.mesh, config.batch_size, config.accumulate,
                                          config.dtype, config.optimizer, config.momentum)  # fmt: skip
            named = {w.partition("=")[0] for w in words}
            return tuple(w for w in chosen if w.partition("=")[0] not in named) + words, "none"
        return words, sharding

    @classmethod
    def layouts_of(cls, sizes, world: int, config) -> dict:
        """One layout per tensor (shardings.layouts_of), or a ConfigError naming what cannot be."""
        world = cls.world_of(config, world)
        words, sharding = cls.words_of(sizes, world, config)
        return shardings.layouts_of(tuple(sizes), world, config.mesh, words, sharding, config.batch_size,
                                    config.accumulate)  # fmt: skip

    @classmethod
    def check(cls, config, world: int) -> None:
        super().check(config, cls.world_of(config, world))  # (flags; the layouts, through shard_of; the batch)
        if config.allreduce in NOT_HERE:
            raise ConfigError(f"--allreduce {config.allreduce} needs nodes (--ranks-per-node, a ddp flag): choose "
                              "another for --paradigm spmd")  # fmt: skip

    @classmethod
    def shard_of(cls, rank: int, world: int, config) -> tuple[int, int]:
        """The slice of each batch a rank trains on: its block of ``input``'s rows (all of them if they are whole)."""
        shape = parse(config.mesh, cls.world_of(config, world))
        axis = cls.layouts_of(cls.sizes_of(config), world, config)["input"].dims[0]
        return (shape.coordinates(rank)[axis], shape.size_of(axis)) if axis else (0, 1)

    # --- the local model: this rank's block of every parameter --------------------------------------------
    def build(self, make_model, make_optimizer) -> None:
        """The whole model from the seed (kept for evaluation), this rank's blocks of it, and the mesh (the first
        communication: the layouts are checked against the data's widths before it)."""
        whole, config = make_model(), self.config
        self.sizes, self.whole = list(whole.sizes), whole
        if config.explain:  # (every rank alike: nothing sent)
            if self.rank == 0:
                print(spmd_plan.explain(type(self), self.sizes, self.world_of(config, self.world), config), flush=True)
            raise SystemExit(0)
        self.layouts = self.layouts_of(self.sizes, self.world, config)
        self.shape = parse(config.mesh, self.world)
        self.mesh, axis_sizes = Mesh(self.comm, self.shape), dict(self.shape.axes)
        self.model, self.params, self.pieces = shardings.local_model(
            self.layouts, self.sizes, config.batch_size, axis_sizes, self.mesh.coordinates,
            xp=array_module(whole.flat_params), dtype=whole.flat_params.dtype, whole=whole.flat_params)  # fmt: skip
        if len(set(self.comm.allgather(tuple(self.layouts.values())))) > 1:  # (auto on unlike machines could differ)
            raise ConfigError("the ranks chose different layouts (--sharding auto priced them on unlike machines): "
                              "give the layout with --sharding or --shard")  # fmt: skip
        self.optimizer = make_optimizer(self.model)
        self.whole_model = placement.Held(self.model, self.optimizer, self.pieces, self._gather)  # (the whole model)
        self.peer_pieces = self.comm.allgather(self.pieces)  # (a few numbers per parameter, once)
        self.program = Program(axis_sizes, self.mesh.coordinates, self.mesh.comms, config.allreduce)
        self.update_groups = None
        if self.rank == 0 and not config.quiet:
            print(terminal.wrapped(self.shape.describe()), flush=True)
            laid = "  ".join(f"{name}[{spec(layout.dims)}]" for name, layout in self.layouts.items())
            print(terminal.paragraph(f"layouts ({shardings.sharding_of(config)}): {laid}", "", "  "), flush=True)

    # --- one step -----------------------------------------------------------------------------------------
    def step(self, x, y) -> float:
        """Forward and backward (the collectives the layouts call for inside them), then the update phase: the
        parameters' gradients that are still partial made whole, one collective per group; then the update."""
        loss = self.gradients(x, y)
        if self.update_groups is None:  # (the gradients' layouts are the same every step: grouped once)
            self.update_groups = shardings.update_moves(self.params)
        self.program.update(self.model.flat_grads, self.model.param_slices, self.update_groups)
        self.optimizer.step()
        return loss

    def gradients(self, x, y) -> float:
        """Forward and backward of the sharded program over --accumulate micro-batches: this rank's mean loss (of
        its rows; whether the ranks' means average or agree, the loss's layout says; the driver averages them)."""
        program, k, started = self.program, self.config.accumulate, time.perf_counter()
        program.record, program.plan = [], []  # (one step's: metrics.json's collectives_per_step)
        self.model.zero_grad()
        size, rows, total = len(y) // k, self.config.batch_size // k, 0.0
        for i in range(k):
            program.phase = "forward"
            part = slice(i * size, (i + 1) * size)
            loss = shardings.forward(program, self.params, x[part], y[part], self.layouts["input"], rows)
            program.end_forward()
            loss.tensor.backward(np.full_like(loss.tensor.data, 1.0 / k) if k > 1 else None)
            total = total + host_or_device_loss(loss.tensor.data)
        if self.rank == self.config.slow_rank:  # a straggler: F times this step's forward and backward
            time.sleep((self.config.slow_factor - 1.0) * (time.perf_counter() - started))
        return total / k

    # --- the whole model, from the blocks -----------------------------------------------------------------
    def _gather(self, local, label=CHECKPOINT):
        return placement.gather(local, self.whole.flat_params.size, self.comm, self.peer_pieces, label=label)

    def full_parameters(self):
        return self.whole_model.parameters()

    def optimizer_state(self) -> dict:
        return self.whole_model.optimizer_state()

    def load(self, flat, optimizer_state: dict) -> None:
        self.whole_model.load(flat, optimizer_state)

    def evaluation_model(self):
        """The whole model, its weights gathered from the blocks (a collective, labelled evaluation's)."""
        self.whole.flat_params[...] = self._gather(self.model.flat_params, EVALUATION)
        return self.whole

    def finish(self) -> dict:
        """Ranks that hold the same blocks (those differing only on an axis a parameter is not split over) must
        hold the same values; this run's figures, with the collectives of one step."""
        flat = self.model.flat_params
        for axis in self.shape.names:
            kept = [flat[self.model.param_slices[n]] for n, p in self.params.items() if axis not in p.layout.dims]
            if kept and self.shape.size_of(axis) > 1:
                check_replicas(self.mesh.comm(axis), array_module(flat).concatenate(kept),
                               f"(the blocks every rank of an {axis} group holds) at the end of training")  # fmt: skip
        figures = {"mesh": str(self.shape), "coordinates": self.comm.allgather(self.mesh.coordinates),
                   "layouts": {name: spec(layout.dims) for name, layout in self.layouts.items()},
                   "collectives_per_step": self.program.record, **super().finish()}  # fmt: skip
        self.mesh.free()
        return figures

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def plan_of(cls, sizes, world: int, config) -> Program:
        """The program's dry run (shardings.dry_run) for these flags: its decisions, collectives and activations."""
        world = cls.world_of(config, world)
        words, sharding = cls.words_of(sizes, world, config)
        return shardings.dry_run(tuple(sizes), world, config.mesh, words, sharding, config.batch_size,
                                 config.accumulate, config.dtype)  # fmt: skip

    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per rank: the bytes of every collective of one step's list, on its axis, and the blocks it holds."""
        program, b = cls.plan_of(sizes, world, config), itemsize(config.dtype)
        shape = parse(config.mesh, cls.world_of(config, world))
        sent = [sum(bytes_of(c, shape, rank, b, config.allreduce) for c in program.record)
                for rank in range(shape.size)]  # fmt: skip
        n = program.parameters * b
        buffers = buffers_per_parameter(config.optimizer, config.momentum)
        return {"sent_per_step": sent, "parameters": n, "gradients": n, "optimizer": buffers * n}

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        """The named shardings on one axis of every rank, and dp-megatron on each mesh of two axes."""
        chosen = [(f"spmd {name}", {"sharding": name}, world) for name in ("dp", "megatron", "fsdp")]
        for model in range(2, world):
            if world % model == 0:
                mesh = f"x={world // model},y={model}"
                chosen.append((f"spmd dp-megatron {mesh}", {"sharding": "dp-megatron", "mesh": mesh}, world))
        return chosen

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """The local matmuls of the dry run (each rank computes its blocks), the update of its blocks, and every
        collective of the list on its axis's group (on the hardware's links)."""
        return shardings.step_time(cls.plan_of(sizes, world, config), world, config, hardware)

    @classmethod
    def activations(cls, sizes, world: int, config) -> int:
        return cls.plan_of(sizes, world, config).activations


def bytes_of(collective: dict, shape: MeshShape, rank: int, b: int, algorithm: str) -> int:
    """The bytes ``rank`` sends in one recorded collective over its axis (the ring's; an all-reduce's algorithm as
    the front door picks it)."""
    p, c, n = shape.size_of(collective["axis"]), shape.coordinates(rank)[collective["axis"]], collective["elements"]
    kind = collective["kind"]
    if kind == "all-reduce":
        return pricing.group_allreduce_bytes(algorithm, [n], b, p, c)
    if kind == "reduce-scatter":  # (the result is one block: the buffer reduced is p of them)
        return costmodel.bytes_sent("ring", n * p, b, p, c, collective="reduce_scatter")
    if kind == "all-gather":
        return costmodel.bytes_sent("ring", n, b, p, c, collective="allgather")
    return costmodel.bytes_sent("pairwise", n, b, p, c, collective="alltoall")

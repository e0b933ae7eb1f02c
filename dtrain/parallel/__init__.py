"""Paradigms: the ways of spreading one training run over ranks, one file each, behind one seam.

The driver (:mod:`dtrain.train`) owns what every paradigm shares: the config, the data, the epoch loop, evaluation,
metrics.json, checkpoints, the trace. A paradigm owns only what makes it different, its flags included. It is a
subclass of :class:`Paradigm` in a file of this package (or of a module named by ``$DTRAIN_PARADIGMS``), registered
under its ``--paradigm`` name with :func:`register`; the registry imports every such file itself, and the CLI builds
its flags from what each declares. Adding a paradigm is one new file, and the driver talks to it through the members
:class:`Paradigm` documents, alone (no ``if paradigm == ...`` anywhere else).

The paradigms: ``single`` (single.py), ``ddp`` (data_parallel.py; its gradient buckets in buckets.py, its compressors in
compression.py, their flags in compression_flags.py), ``zero`` (zero.py: ZeRO stages 1-3; its bookkeeping in
zero_shards.py), ``ps-sync`` and ``ps-async`` (parameter_server.py: the protocol; its two sides in ps_worker.py and
ps_server.py, its snapshots in ps_snapshot.py, what it prints and reports in ps_report.py), ``central-storage``
(central_storage.py), ``local-sgd`` (local_sgd.py) and ``gossip`` (gossip.py), whose replicas drift apart and are
averaged (replicas.py, with what every whole replica shares: its start), ``tp`` (tensor_parallel.py: Megatron-style) and
``pp`` (pipeline.py; its schedules in schedules.py and instructions.py, its cut and cost in stages.py, its forward for
evaluation in pipeline_evaluation.py); these two share model_parallel.py (a local model made of pieces of the whole,
placement.py) and the rank grid of dp x tp x pp (grid.py); ``spmd`` (spmd.py) derives its communication from a layout
per tensor on a device mesh (mesh.py, a generalised grid): the notation and the rules in layouts.py, the sharded tensors
that apply them in sharded.py, the MLP's tensors, named shardings and one forward in shardings.py, its --explain in
spmd_plan.py, --sharding auto in auto_sharding.py. The registry is registry.py, the flags' record flags.py; the
arithmetic several paradigms' prices share is pricing.py. Every paradigm's file reads as its algorithm and ends with its
price, under the same marked line: ``costs`` (held against the tracer) and what the planner asks.

Helpers any paradigm may use live here too: :func:`check_replicas` (replicas compare digests; a difference names the
ranks) and :class:`Evaluating` (a sharded model's traffic while evaluating is labelled evaluation's).
"""

from __future__ import annotations

import math
import time

import numpy as np

from dtrain.autograd import Tensor, softmax_cross_entropy
from dtrain.backend import host_or_device_loss, itemsize, weights_digest
from dtrain.comm.trace import EVALUATION, labelled
from dtrain.errors import ConfigError
from dtrain.layout import parameter_count
from dtrain.optim import buffers_per_parameter, state_bytes
from dtrain.parallel import pricing
from dtrain.parallel.flags import SHARED_MEMORY, Flag
from dtrain.parallel.registry import MODULES_VAR, all_flags, get, names, readers, register

__all__ = ["MODULES_VAR", "Evaluating", "Paradigm", "ReplicasDiverged", "all_flags", "check_replicas", "get", "names",
           "parameter_count", "readers", "register"]  # fmt: skip


class ReplicasDiverged(RuntimeError):
    """Ranks that should hold identical weights do not."""


def check_replicas(comm, flat, when: str) -> None:
    """Every rank's ``flat`` must be bit-identical (a collective); else :class:`ReplicasDiverged` names the ranks."""
    digests = comm.allgather(weights_digest(flat))
    if len(set(digests)) > 1:
        groups = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        listing = "; ".join(f"ranks {ranks} hold {d[:12]}" for d, ranks in groups.items())
        raise ReplicasDiverged(f"replicas differ {when}: {listing}")


class Evaluating:
    """A model whose traffic while evaluating (a sharded model's gathers) is labelled evaluation's, not training's."""

    def __init__(self, model, comm):
        self.model, self.comm = model, comm

    def __call__(self, x):
        with labelled(self.comm, EVALUATION):
            return self.model(x)


def _check_flags(cls, config) -> None:
    """This paradigm's flags hold values it can take; a flag of another paradigm (``--servers`` with ``ddp``) was
    not given (it is an error, not silently ignored). The first of :meth:`check`'s checks."""
    mine = {flag.name: flag for flag in cls.flags}  # (its own records: ddp's --allreduce takes a file too)
    for name, flag in sorted(all_flags().items()):
        value = getattr(config, name)
        if name in mine:
            mine[name].check(value)
            if name == "allreduce" and value in SHARED_MEMORY and config.device == "gpu":
                raise ConfigError(f"--allreduce {value} reduces host memory in a shared window; with --device gpu use "
                                  "--allreduce ring or auto (staged through host memory)")  # fmt: skip
        elif value != flag.default:
            raise ConfigError(f"{flag.option} is a flag of --paradigm {', '.join(readers(name))}, not of "
                              f"{cls.name}")  # fmt: skip


class Paradigm:
    """One rank's share of a training run, and itself a correct single-replica trainer. Its members, in three groups.

    **What the driver calls** (:mod:`dtrain.train`; the planner and the launcher check with ``check`` too)::

        name, summary, flags, order       its --paradigm name, what it is, its own flags (flags.py: parsed,
                                          defaulted, range-checked), where it comes in listings
        check(config, world)              before any communication: can it run so on so many ranks? (another
                                          paradigm's flag is refused)
        shard_of(rank, world, config)     (index, count): the slice of every global batch a rank trains on
        __init__(comm, config)            the one prepared communicator (tracer, staging, watchdog inside), kept as
                                          comm, config, rank, world, and batch_slice (shard_of's, this rank's);
                                          sub-communicators made from it are freed by the driver at the end
        build(make_model, make_optimizer) a replica, sharded layers, a pipeline stage, a server's shard: its model
                                          and optimizer
        run(epochs)                       the whole run on this rank: the driver's epoch loop, or a loop of its own
                                          for a rank with no batches (a parameter server)
        epoch(batches)                    one epoch on this rank's slices: the loss of each step it takes
        global_loss(local_mean)           the *global batch's* loss from every rank's mean (train_loss)
        full_parameters()                 the whole model's flat buffer: the weights digest, checkpoints
        optimizer_state()                 the optimizer's whole state, as one optimizer over that buffer holds it
        load(flat, optimizer_state)       the inverse of both: resuming from any paradigm's checkpoint
        restore_snapshot(snapshot, ...)   resume a snapshot a paradigm took itself (the parameter servers', whose
                                          run() turns the driver's checkpoints off); False: not its own
        evaluation_model()                something whose forward is the whole model's (the test set goes through it)
        finish()                          final averaging or checks; this paradigm's figures for metrics.json
        costs(sizes, world, config)       the bytes each rank sends per step and holds: the cost as code

    **The hooks of a step**, which a paradigm overrides to say what it adds to the plainest step (ddp: average the
    gradients before the update; central storage: reduce them to the storage rank, then take its weights; a
    parameter-server worker: push and pull instead of the update)::

        step(x, y)                        gradients(x, y), then the optimizer's step: this rank's mean loss
        gradients(x, y)                   forward and backward over --accumulate micro-batches (a straggler sleeps)
        before_backward(last)             before each micro-batch's backward (ddp arms its hooks for the last only)
        held_bytes()                      what this rank holds, read off its arrays (finish reports it)

    **What the planner asks** (:mod:`dtrain.plan`), beside ``costs``::

        updates_like_single(config)       whether its steps are single's (local SGD's, gossip's, ps-async's are not)
        configurations(world, config, hardware)   the ways it could run on so many ranks
        step_time(sizes, world, config, hardware) how long a step would take there (on dtrain.plan.hardware's rates)
        activations(sizes, world, config) what a rank keeps for backward
    """

    name = "base"
    summary = ""  # what it is, in a few words: --paradigm's help and the title of its flags in --help
    flags: tuple[Flag, ...] = ()  # its own flags (see flags.py); another paradigm's flag is refused
    order = math.inf  # where it comes in listings (the registry's order): the course's order, for dtrain's own
    # === what the driver calls ===================================================================================

    def __init__(self, comm, config):
        self.comm, self.config = comm, config
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.batch_slice = self.shard_of(self.rank, self.world, config)  # (index, count): this rank's of each batch
        self.model = self.optimizer = None

    @classmethod
    def check(cls, config, world: int) -> None:
        """Raise a :class:`ConfigError` for flags this paradigm cannot use on ``world`` ranks (no communication)."""
        _check_flags(cls, config)
        _index, count = cls.shard_of(0, world, config)
        local = config.batch_size // count if config.batch_size % count == 0 else None
        if config.batch_size < count:
            raise ConfigError(
                f"--batch-size {config.batch_size} is smaller than the {count} ranks that split it: every rank "
                f"needs at least one sample per step; use --batch-size {count} or more, or fewer ranks"
            )
        if config.batch_size % count:
            who = "ranks" if count == world else f"trainers (of {world} ranks)"  # (workers; a split model's replicas)
            raise ConfigError(
                f"--batch-size {config.batch_size} (the global batch) must split evenly over the {count} {who} that "
                f"train on it; try {max(count, config.batch_size // count * count)}"
            )
        if config.slow_rank is not None and not 0 <= config.slow_rank < world:
            raise ConfigError(f"--slow-rank {config.slow_rank} is not a rank: there are {world} (0 to {world - 1})")
        if local is not None and local % config.accumulate:
            raise ConfigError(
                f"--accumulate {config.accumulate} must divide each rank's share of the batch ({local} = "
                f"{config.batch_size} / {count} ranks)"
            )

    @classmethod
    def shard_of(cls, rank: int, world: int, config) -> tuple[int, int]:
        """(index, count) of the slice of each global batch that ``rank`` trains on: by default, one per rank.
        (A rank with no batches, such as a parameter server, still gets a valid slice; it never reads it.)"""
        return rank, world

    def build(self, make_model, make_optimizer) -> None:
        self.model = make_model()
        self.optimizer = make_optimizer(self.model)

    def run(self, epochs) -> None:
        """The whole run on this rank: the driver's epoch loop (``epochs.run()``, its steps from :meth:`epoch`)."""
        epochs.run()

    def epoch(self, batches):
        """One epoch on this rank: a :meth:`step` on each of ``batches`` (its slices of the epoch's global batches,
        from where a resume left off), yielding each step's loss."""
        for x, y in batches:
            yield self.step(x, y)

    def global_loss(self, local_mean: float) -> float:
        """The global batch's loss from this rank's mean over its slice (a collective): by default the mean over the
        ranks, whose slices are equal shares of the batch. A metric: an object all-reduce, which the tracer skips."""
        return self.comm.allreduce(local_mean) / self.world

    def full_parameters(self):
        return self.model.flat_params

    def optimizer_state(self) -> dict:
        """The optimizer's whole state (host arrays and numbers), as a checkpoint stores it."""
        return self.optimizer.state_dict()

    def load(self, flat, optimizer_state: dict) -> None:
        """Resume: the whole model's flat buffer and the optimizer's whole state (as :meth:`full_parameters` and
        :meth:`optimizer_state` gave them), each rank taking its part."""
        self.model.flat_params[...] = flat
        self.optimizer.load_state_dict(optimizer_state)

    def restore_snapshot(self, snapshot: dict, arrays: dict, position) -> bool:
        """Resume a snapshot of its own (False: not its kind: the driver drops the snapshot's own part)."""
        return False

    def evaluation_model(self):
        """A model whose forward is the whole model's, for evaluating on the test set."""
        return self.model

    def finish(self) -> dict:
        """At the end of training (a collective where ranks must agree); this paradigm's figures for metrics.json:
        here, what every rank holds (``held_bytes``, a list by rank)."""
        return {"held_bytes": self.comm.allgather(self.held_bytes())}

    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Bytes per rank: ``sent_per_step`` (a list, one entry per rank) and the peak ``parameters``,
        ``gradients`` and ``optimizer`` state a rank holds (a number: the same on every rank; a list: per rank)."""
        n = parameter_count(sizes) * itemsize(config.dtype)
        state = buffers_per_parameter(config.optimizer, config.momentum) * n
        return {"sent_per_step": [0] * world, "parameters": n, "gradients": n, "optimizer": state}

    # === the hooks of a step =====================================================================================

    def step(self, x, y) -> float:
        """One global step on this rank's slice ``x, y``: its gradients, then the update; this rank's mean loss."""
        loss = self.gradients(x, y)
        self.optimizer.step()
        return loss

    def gradients(self, x, y) -> float:
        """Forward and backward over ``--accumulate`` micro-batches (a straggler then sleeps); this rank's mean loss
        (on a GPU, a 0-d array there: see :func:`host_or_device_loss`). The step's gradients are then in
        ``self.model.flat_grads``."""
        model, k = self.model, self.config.accumulate
        started = time.perf_counter()
        model.zero_grad()
        total = 0.0
        size = len(y) // k
        for i in range(k):
            loss = softmax_cross_entropy(model(Tensor(x[i * size : (i + 1) * size])), y[i * size : (i + 1) * size])
            self.before_backward(last=i == k - 1)
            # each micro-batch's mean loss counts 1/k, so the gradient is that of the whole slice's mean loss
            loss.backward(np.full_like(loss.data, 1.0 / k) if k > 1 else None)
            total = total + host_or_device_loss(loss.data)
        # a straggler: F times this step's forward and backward (tensor parallelism's all-reduces inside them too; on a
        # GPU, the host's time to queue them, which the GPU may not have finished)
        if self.rank == self.config.slow_rank:
            time.sleep((self.config.slow_factor - 1.0) * (time.perf_counter() - started))
        return total / k

    def before_backward(self, last: bool) -> None:
        """Called before each micro-batch's backward; ``last`` for the one after which the gradients are final."""

    def held_bytes(self) -> dict:
        """What this rank holds for training, by kind, read off its arrays: the accounting :meth:`costs` is checked
        against (a paradigm that holds something more, or shards it, says so in its own)."""
        return {"parameters": self.model.flat_params.nbytes, "gradients": self.model.flat_grads.nbytes,
                "optimizer": state_bytes(self.optimizer)}  # fmt: skip

    # === what the planner asks ===================================================================================

    @classmethod
    def updates_like_single(cls, config) -> bool:
        """Whether a run with ``config`` takes single's steps on the global batch (to rounding): so by default; local
        SGD, gossip and ps-async take other steps, and ddp's --compress sends an approximation."""
        return True

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        """The ways the planner should weigh running it on ``world`` ranks of ``hardware``: (label, flags, ranks
        used) each, the flags as a TrainConfig takes them. The planner asks :meth:`check` whether each can run. By
        default: as it is, on every rank."""
        return [(cls.name, {}, world)]

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """Predicted seconds of one step on its slowest rank, on ``hardware`` (:class:`dtrain.plan.hardware.Hardware`):
        ``compute``, ``communication`` (what compute does not hide) and a pipeline's ``bubble``. By default a whole
        replica on its slice of the batch, and nothing to send."""
        return {"compute": pricing.replica_compute(cls, sizes, world, config, hardware), "communication": 0.0,
                "bubble": 0.0}  # fmt: skip

    @classmethod
    def activations(cls, sizes, world: int, config):
        """Peak bytes of activations a rank keeps for backward (a number, or a list by rank): one micro-batch of
        its slice through the whole model (as :func:`dtrain.autograd.activation_bytes` counts them)."""
        rows = config.batch_size // cls.shard_of(0, world, config)[1] // config.accumulate
        return pricing.activation_elements(sizes, 0, len(sizes) - 1, rows, 1) * itemsize(config.dtype)

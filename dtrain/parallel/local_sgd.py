"""Local SGD: every rank takes H optimizer steps on its own data, then the ranks average their *weights*.

Data parallelism averages gradients every step, so the replicas never differ. Local SGD lets them drift for H steps
and then pulls them back together (Lin et al., 2018, "Don't use large mini-batches, use local SGD"; PyTorch's
``PostLocalSGDOptimizer``)::

      step:     1       2       3       4   |  5       6       7       8   |
      rank 0:   w-->w0'-->w0''-->w0'''-->w0''''  avg  ...
      rank 1:   w-->w1'-->w1''-->w1'''-->w1''''  avg  ...     (H = 4: one average of the weights every 4 steps)
      rank 2:   w-->w2'-->w2''-->w2'''-->w2''''  avg  ...

Each rank trains on its own slice of every global batch, as in ``ddp``; the average (``--average-via allreduce``: the
all-reduce of ``--allreduce``; ``master``: everything sent to rank 0, averaged there and sent back, the seed
material's picture) moves n bytes of weights instead of n bytes of gradients, once every H steps instead of every
step: H times less traffic. It is *not* the same algorithm as big-batch SGD, except for H = 1 with SGD: then averaging
the weights after each step is averaging the gradients before it, because SGD's update is linear in the gradient.

**Momentum buffers stay local** (never averaged, never reset). With H = 1 that makes local SGD equal ``ddp`` to
rounding: each rank's velocity is v_r = mu v_r + g_r + wd w, and the mean of the v_r follows the same recursion as
ddp's v with the mean gradient, so the averaged step equals ddp's (tests/test_decentralized.py checks it). Averaging the
buffers too would give the same result at twice the bytes; resetting them would throw away the momentum at every
sync (and break the H = 1 equality). Adam's moments are kept local as well (Adam is not linear: no equality there).

**Post-local SGD** (``--warmup-sync-steps W``): the first W steps are ordinary ``ddp`` (gradients all-reduced every
step), then local SGD begins, the schedule Lin et al. recommend (the early, large-gradient phase benefits most from
exact averaging).

**What is evaluated.** Between averages the replicas differ; at the end of each epoch the driver evaluates their
average (one all-reduce into a second copy of the model, counted by the tracer under "evaluation", not as training
traffic), and the paradigm records how far the replicas are from it: the *consensus distance*, the mean over ranks
of ||w_r - w_avg|| / ||w_avg||. Training ends with one more average if the last step was not one, so every rank
holds the same final model (checked by digests).

**Checkpoints** are written at the end, after the final average, with the *average* of the ranks' momentum buffers
(for SGD that is what the averaged model's next steps follow; with H = 1 the resumed run is ddp's, to rounding). A
run resumed from one starts every rank from that model and those buffers, so for H > 1 it is not the run that would
have gone on uninterrupted (whose buffers were each rank's own); mid-run checkpoints are refused.

**Cost** (n bytes of weights, p ranks, ring): an average sends 2 (p-1)/p n per rank, so per step 2 (p-1)/p n / H;
the master variant sends n from every rank but 0 and (p-1) n from rank 0 per average. Exact per rank:
:meth:`LocalSGD.costs`. Memory: ddp's, plus the averaged copy of the parameters kept for evaluation.
"""

from __future__ import annotations

import numpy as np

from dtrain import collectives
from dtrain.backend import array_module, itemsize
from dtrain.collectives import costmodel
from dtrain.comm.trace import CHECKPOINT, EVALUATION, labelled
from dtrain.errors import ConfigError
from dtrain.layout import parameter_count
from dtrain.parallel import pricing, register
from dtrain.parallel.data_parallel import BUCKET_MB, DataParallel
from dtrain.parallel.flags import ALLREDUCE, RANKS_PER_NODE, Flag

AVERAGE_VIA = ("allreduce", "master")
SYNC_EVERY = Flag("sync_every", 1, "average every H steps", type=int, metavar="H", at_least=1,
                  meaning="(local steps between averages)")  # fmt: skip
AVERAGE_VIA_FLAG = Flag("average_via", "allreduce", "all-reduce the weights (--allreduce), or gather them on rank 0 "
                        "and send them back", choices=AVERAGE_VIA)  # fmt: skip
WARMUP_SYNC_STEPS = Flag("warmup_sync_steps", 0, "the first W steps average gradients, as ddp (post-local SGD)",
                         type=int, metavar="W", at_least=0)  # fmt: skip


def average_weights(comm, flat, via: str = "allreduce", algorithm: str = "ring", topology=None) -> None:
    """Replace every rank's ``flat`` by its average over the ranks, in place: one all-reduce (op "avg") with
    ``algorithm``, or (``via="master"``) everything summed on rank 0, scaled there and sent back."""
    if via == "master":  # gathered and summed on rank 0, sent back from there
        collectives.reduce(comm, flat, root=0, op="sum", algorithm="naive")
        if comm.Get_rank() == 0:
            flat *= 1.0 / comm.Get_size()
        collectives.broadcast(comm, flat, root=0, algorithm="naive")
    else:
        collectives.allreduce(comm, flat, "avg", algorithm, topology=topology)


def local_sgd_step(comm, flat, step: int, sync_every: int, average=None) -> bool:
    """Local SGD's communication after local step number ``step`` (1-based): every ``sync_every``-th step, average
    ``flat`` over the ranks in place; otherwise send nothing. Returns whether it averaged. ``average``: a callable
    that does the averaging instead (the paradigm's :meth:`LocalSGD.average`, with its --average-via, its all-reduce
    and its counts); by default :func:`average_weights` with the ring."""
    if step % sync_every:
        return False
    if average is None:
        average_weights(comm, flat)
    else:
        average()
    return True


@register
class LocalSGD(DataParallel):
    name = "local-sgd"
    summary = "decentralized: every rank trains alone, and the weights are averaged every H steps"
    order = 5  # where it comes in listings (--help, the planner): the course teaches it then
    flags = (ALLREDUCE, RANKS_PER_NODE, BUCKET_MB, SYNC_EVERY, AVERAGE_VIA_FLAG, WARMUP_SYNC_STEPS)

    @classmethod
    def check(cls, config, world: int) -> None:
        super().check(config, world)
        if config.checkpoint_every:
            raise ConfigError(
                f"--paradigm {cls.name} writes its checkpoint at the end of training only (between averages every "
                "rank holds a model of its own, and a checkpoint holds one); drop --checkpoint-every"
            )

    def build(self, make_model, make_optimizer) -> None:
        super().build(make_model, make_optimizer)  # ddp's: rank 0's weights everywhere, gradient buckets
        self.average_model = make_model()  # the replicas' average, evaluated at the end of each epoch
        self.average_algorithm = self.choose_algorithm(self.config, self.world, self.model.flat_params.nbytes)
        self.local_steps = 0  # optimizer steps since the last average
        self.averages = 0
        self.consensus = []  # consensus distance at the end of each epoch

    def warming_up(self) -> bool:
        """Still in post-local SGD's synchronous phase (this step is a ddp step)."""
        return self.steps < self.config.warmup_sync_steps

    # --- one step: ddp's while warming up, else local, with an average every H steps ---------------------------
    def step(self, x, y) -> float:
        """Post-local SGD's first W steps: a ddp step. After: this rank's own step on its own gradient (nothing is
        sent), and every H-th such step, the average of the weights."""
        if self.warming_up():
            return super().step(x, y)  # the gradients averaged, as ddp
        loss = self.gradients(x, y)
        self.optimizer.step()
        self.steps += 1
        self.local_steps += 1
        if local_sgd_step(self.grad_comm, self.model.flat_params, self.local_steps, self.config.sync_every,
                          self.average):  # fmt: skip
            if collectives.debug_enabled():
                self.check_replicas(f"after the average at step {self.steps}")
        return loss

    def average(self) -> None:
        """Replace every rank's weights by their average over the ranks (:func:`average_weights`)."""
        average_weights(self.grad_comm, self.model.flat_params, self.config.average_via, self.average_algorithm,
                        self.topology)  # fmt: skip
        self.local_steps = 0
        self.averages += 1

    # --- what is evaluated, and how far the replicas are from it ------------------------------------------------
    def evaluation_model(self):
        """The average of the replicas (a copy; the replicas go on as they are); records the consensus distance."""
        mean = self.replicas_average()
        self.consensus.append(self.consensus_distance(self.model.flat_params, mean))
        return self.average_model

    def replicas_average(self):
        """The replicas' average, into the evaluation copy (traffic counted under "evaluation", not training)."""
        mean = self.average_model.flat_params
        mean[...] = self.model.flat_params
        with labelled(self.grad_comm, EVALUATION):
            collectives.allreduce(self.grad_comm, mean, "avg", self.average_algorithm, topology=self.topology)
        return mean

    def consensus_distance(self, mine, mean) -> float:
        """Mean over ranks of ||w_r - w_avg||, relative to ||w_avg|| (a metric: the object all-reduce, untraced)."""
        xp = array_module(mine)
        distance = float(xp.linalg.norm(mine - mean))
        return self.comm.allreduce(distance) / self.world / max(float(xp.linalg.norm(mean)), 1e-30)

    def finish(self) -> dict:
        if self.local_steps:  # the last steps were local: one more average, so every rank ends with the same model
            self.average()
        if self.config.checkpoint_dir:
            self.final_optimizer_state = self.averaged_optimizer_state()
        figures = super().finish()  # (checks that the replicas are identical; held_bytes, read off the arrays)
        return {
            **figures,
            "averages": self.averages,
            "average_via": self.config.average_via,
            "consensus_distance": self.consensus,
        }

    def averaged_optimizer_state(self) -> dict:
        """The optimizer's state with each buffer averaged over the ranks (a collective), for the checkpoint."""
        state = self.optimizer.state_dict()
        with labelled(self.grad_comm, CHECKPOINT):
            for value in state.values():
                if isinstance(value, np.ndarray):
                    collectives.allreduce(self.grad_comm, value, "avg", "ring")
        return state

    def optimizer_state(self) -> dict:
        return getattr(self, "final_optimizer_state", None) or super().optimizer_state()

    def held_bytes(self) -> dict:
        """What every rank holds, and the copy the replicas' average is evaluated in."""
        held = super().held_bytes()
        return {**held, "parameters": held["parameters"] + self.average_model.flat_params.nbytes}

    # --- the cost as code ---------------------------------------------------------------------------------------
    @classmethod
    def average_bytes(cls, sizes, world: int, config) -> list[int]:
        """Bytes each rank sends in one average of the weights."""
        b, n = itemsize(config.dtype), parameter_count(sizes)
        if config.average_via == "master":
            return [
                sum(costmodel.bytes_sent("naive", n, b, world, r, collective=c) for c in ("reduce", "broadcast"))
                for r in range(world)
            ]
        algorithm = cls.choose_algorithm(config, world, n * b)
        return [costmodel.bytes_sent(algorithm, n, b, world, r, config.ranks_per_node) for r in range(world)]

    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per step after the warm-up: one average every H steps (``sent_per_step`` is its share, a fraction);
        ``sent_per_average`` and ``sent_per_warmup_step`` (ddp's) exactly."""
        ddp = super().costs(sizes, world, config)
        per_average = cls.average_bytes(sizes, world, config)
        return {
            **ddp,
            "sent_per_step": [b / config.sync_every for b in per_average],
            "sent_per_average": per_average,
            "sent_per_warmup_step": ddp["sent_per_step"],
            "parameters": 2 * ddp["parameters"],  # the replica, and the average evaluated at each epoch's end
        }

    # --- the plan ---------------------------------------------------------------------------------------------------
    @classmethod
    def updates_like_single(cls, config) -> bool:
        return False  # replicas drift apart between averages: fewer bytes, but not ddp's updates

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        return [(f"local-sgd H={h}", {"sync_every": h}, world) for h in (4, 16)]

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """A replica's own step, and a share (1/H) of an average of the weights (after any warm-up)."""
        n = parameter_count(sizes) * itemsize(config.dtype)
        if config.average_via == "master":
            average = sum(hardware.collective(c, "naive", n, range(world), world) for c in ("reduce", "broadcast"))
        else:
            algorithm = cls.choose_algorithm(config, world, n)
            average = hardware.allreduce(algorithm, n, range(world), world, config.ranks_per_node)
        compute = pricing.replica_compute(cls, sizes, world, config, hardware)
        return {"compute": compute, "communication": average / config.sync_every, "bubble": 0.0}

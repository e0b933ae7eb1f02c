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

from dtrain import collectives
from dtrain.backend import itemsize
from dtrain.collectives import costmodel
from dtrain.layout import parameter_count
from dtrain.parallel import Paradigm, check_replicas, pricing, register
from dtrain.parallel.buckets import allreduce_algorithm, gradient_buckets
from dtrain.parallel.data_parallel import BUCKET_MB, CHECK_EVERY, DataParallel
from dtrain.parallel.flags import ALLREDUCE, RANKS_PER_NODE, Flag
from dtrain.parallel.replicas import Replicas, average_weights

AVERAGE_VIA = ("allreduce", "master")
SYNC_EVERY = Flag("sync_every", 1, "average every H steps", type=int, metavar="H", at_least=1,
                  meaning="(local steps between averages)")  # fmt: skip
AVERAGE_VIA_FLAG = Flag("average_via", "allreduce", "all-reduce the weights (--allreduce), or gather them on rank 0 "
                        "and send them back", choices=AVERAGE_VIA)  # fmt: skip
WARMUP_SYNC_STEPS = Flag("warmup_sync_steps", 0, "the first W steps average gradients, as ddp (post-local SGD)",
                         type=int, metavar="W", at_least=0)  # fmt: skip


def local_sgd_step(comm, flat, step: int, sync_every: int, average=None) -> bool:
    """Local SGD's communication after local step number ``step`` (1-based): every ``sync_every``-th step, average
    ``flat`` over the ranks in place; otherwise send nothing. Returns whether it averaged. ``average``: a callable
    that does the averaging instead (the paradigm's :meth:`LocalSGD.average`, with its --average-via, its all-reduce
    and its counts); by default :func:`~dtrain.parallel.replicas.average_weights` with the ring."""
    if step % sync_every:
        return False
    if average is None:
        average_weights(comm, flat)
    else:
        average()
    return True


@register
class LocalSGD(Paradigm):
    name = "local-sgd"
    summary = "decentralized: every rank trains alone, and the weights are averaged every H steps"
    order = 5  # where it comes in listings (--help, the planner): the course teaches it then
    flags = (ALLREDUCE, RANKS_PER_NODE, BUCKET_MB, SYNC_EVERY, AVERAGE_VIA_FLAG, WARMUP_SYNC_STEPS)

    @classmethod
    def check(cls, config, world: int) -> None:
        super().check(config, world)
        Replicas.check(cls.name, config, world)  # the nodes; no checkpoint while the replicas differ

    def __init__(self, comm, config):
        super().__init__(comm, config)
        self.replicas = Replicas(comm, config)  # the weights' communicator, their average, its copy (replicas.py)
        self.steps = 0
        self.local_steps = 0  # optimizer steps since the last average
        self.averages = 0

    def build(self, make_model, make_optimizer) -> None:
        super().build(lambda: self.replicas.share(make_model()), make_optimizer)  # (--allreduce shm: shared weights)
        self.replicas.start(self.model, make_model)  # rank 0's weights everywhere; a copy for their average
        self.warmup = None  # post-local SGD's first W steps are ddp's: its gradient buckets (buckets.py), only then
        if self.config.warmup_sync_steps:
            self.warmup = gradient_buckets(self.replicas.comm, self.model, self.config, self.replicas.topology)

    def warming_up(self) -> bool:
        """Still in post-local SGD's synchronous phase (this step is a ddp step)."""
        return self.steps < self.config.warmup_sync_steps

    # --- one step: ddp's while warming up, else local, with an average every H steps ---------------------------
    def step(self, x, y) -> float:
        """Post-local SGD's first W steps: a ddp step. After: this rank's own step on its own gradient (nothing is
        sent), and every H-th such step, the average of the weights."""
        if self.warming_up():
            return self.ddp_step(x, y)
        loss = self.gradients(x, y)
        self.optimizer.step()
        self.steps += 1
        self.local_steps += 1
        if local_sgd_step(self.replicas.comm, self.model.flat_params, self.local_steps, self.config.sync_every,
                          self.average):  # fmt: skip
            if collectives.debug_enabled():
                check_replicas(self.comm, self.model.flat_params, f"after the average at step {self.steps}")
        return loss

    def average(self) -> None:
        """Replace every rank's weights by their average over the ranks (``--average-via``: an all-reduce, or
        through rank 0; :func:`~dtrain.parallel.replicas.average_weights`)."""
        self.replicas.average(self.model.flat_params, self.config.average_via)
        self.local_steps = 0
        self.averages += 1

    def ddp_step(self, x, y) -> float:
        """A warm-up step: the gradients averaged (ddp's buckets), then the same optimizer step on every rank."""
        loss = self.gradients(x, y)
        if self.world > 1:
            self.warmup.finish()
        self.optimizer.step()
        self.steps += 1
        if collectives.debug_enabled() and self.steps % CHECK_EVERY == 0:
            check_replicas(self.comm, self.model.flat_params, f"after step {self.steps}")
        return loss

    def before_backward(self, last: bool) -> None:
        if last and self.warming_up():  # (accumulation: only the last micro-batch's backward starts the buckets)
            self.warmup.arm()

    # --- what is evaluated: the replicas' average; at the end, one more average -------------------------------
    def evaluation_model(self):
        """The average of the replicas (a copy; the replicas go on as they are); records the consensus distance."""
        return self.replicas.evaluated(self.model.flat_params)

    def finish(self) -> dict:
        if self.local_steps:  # the last steps were local: one more average, so every rank ends with the same model
            self.average()
        figures = self.replicas.finish(self.model.flat_params, self.optimizer)  # (checks the replicas are identical)
        if self.warmup is not None:
            figures["warmup"] = {"bucket_bytes": [int(b.nbytes) for b in self.warmup.slices],
                                 "allreduce": self.warmup.algorithm, **self.warmup.timing}  # fmt: skip
        return {**figures, "averages": self.averages, "average_via": self.config.average_via, **super().finish()}

    def optimizer_state(self) -> dict:
        return self.replicas.final_state or super().optimizer_state()  # (the checkpoint's: averaged at the end)

    def held_bytes(self) -> dict:
        """What every rank holds, and the copy the replicas' average is evaluated in."""
        held = super().held_bytes()
        return {**held, "parameters": held["parameters"] + self.replicas.copy.flat_params.nbytes}

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per step after the warm-up: one average every H steps (``sent_per_step`` is its share, a fraction);
        ``sent_per_average`` and ``sent_per_warmup_step`` (ddp's) exactly."""
        ddp = DataParallel.costs(sizes, world, config)
        per_average = cls.average_bytes(sizes, world, config)
        return {
            **ddp,
            "sent_per_step": [b / config.sync_every for b in per_average],
            "sent_per_average": per_average,
            "sent_per_warmup_step": ddp["sent_per_step"],
            "parameters": 2 * ddp["parameters"],  # the replica, and the average evaluated at each epoch's end
        }

    @staticmethod
    def average_bytes(sizes, world: int, config) -> list[int]:
        """Bytes each rank sends in one average of the weights."""
        b, n = itemsize(config.dtype), parameter_count(sizes)
        if config.average_via == "master":
            return [
                sum(costmodel.bytes_sent("naive", n, b, world, r, collective=c) for c in ("reduce", "broadcast"))
                for r in range(world)
            ]
        return [pricing.group_allreduce_bytes(config.allreduce, [n], b, world, r, config.ranks_per_node)
                for r in range(world)]  # fmt: skip

    @classmethod
    def updates_like_single(cls, config) -> bool:
        return False  # replicas drift apart between averages: fewer bytes, but not ddp's updates

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        return [(f"local-sgd H={h}", {"sync_every": h}, world) for h in (4, 8, 16)]

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """A replica's own step, and a share (1/H) of an average of the weights (after any warm-up)."""
        n = parameter_count(sizes) * itemsize(config.dtype)
        if config.average_via == "master":
            average = sum(hardware.collective(c, "naive", n, range(world), world) for c in ("reduce", "broadcast"))
        else:
            algorithm = allreduce_algorithm(config, world, n)
            average = hardware.allreduce(algorithm, n, range(world), world, config.ranks_per_node)
        compute = pricing.replica_compute(cls, sizes, world, config, hardware)
        return {"compute": compute, "communication": average / config.sync_every, "bubble": 0.0}

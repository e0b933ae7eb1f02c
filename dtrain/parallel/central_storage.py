"""Central storage (TensorFlow's CentralStorageStrategy): one process holds the variables and applies the update.

Every rank computes the gradient of its slice of the global batch, as in ``ddp``. The gradients are *reduced* to rank
0, the storage rank, which alone holds the optimizer state and takes the optimizer step; it then *broadcasts* the new
weights, and every rank computes the next step on them::

      rank 0 (storage, computes too):  g0 --+                                   +--> w'
      rank 1:                          g1 --+-- reduce to 0 --> step on 0 --> broadcast --> w'
      rank 2:                          g2 --+   g = (g0+g1+g2)/p               +--> w'

In TensorFlow the storage is the host's memory and the replicas are the GPUs of one machine; here the storage is one
rank's memory and the replicas are ranks. The reduce and the broadcast are the hand-written binomial trees of
:mod:`dtrain.collectives.tree` (``log2 p`` rounds each).

**How it differs from** ``ps-sync``: no rank is set aside to serve; the storage rank trains like the others. The
traffic is two collectives rather than point-to-point messages through one server's link, so no link carries p
copies in one go (the tree spreads them over ``log2 p`` rounds), but nothing is sharded either: one rank updates the
whole model. **From** ``ddp``: only rank 0 holds optimizer state and takes the step (ddp: every rank updates its own
replica after an all-reduce), so the other ranks save the optimizer's memory, and rank 0's update is on the critical
path of every step. The weights that come back are rank 0's, so the replicas are identical by construction.

**Cost per step** (n bytes of gradient and of weights, p ranks, binomial trees): every rank but 0 sends its partial sum
once in the reduce (n); in the broadcast rank 0 sends n to ``ceil(log2 p)`` ranks and a rank that forwards sends
n per child. Exact per rank: :meth:`CentralStorage.costs` (from ``costmodel.bytes_sent``). Memory: parameters and
gradients everywhere, optimizer state on rank 0 only.
"""

from __future__ import annotations

from dtrain import collectives
from dtrain.backend import itemsize
from dtrain.collectives import costmodel
from dtrain.layout import parameter_count
from dtrain.parallel import Paradigm, pricing, register

STORAGE = 0  # the rank that holds the variables


class NoOptimizer:
    """The optimizer of a rank that is not the storage: it holds no state (the storage rank steps)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to load: the storage rank holds the state."""


@register
class CentralStorage(Paradigm):
    name = "central-storage"
    summary = "rank 0 holds the variables; every rank computes gradients on its slice"
    order = 4  # where it comes in listings (--help, the planner): the course teaches it then

    def build(self, make_model, make_optimizer) -> None:
        self.model = make_model()
        self.optimizer = make_optimizer(self.model) if self.rank == STORAGE else NoOptimizer()
        collectives.broadcast(self.comm, self.model.flat_params, root=STORAGE)  # the storage's weights, everywhere

    def step(self, x, y) -> float:
        """Every rank's gradient summed on the storage rank, which takes the step; then its weights to every rank."""
        loss = self.gradients(x, y)
        grads = self.model.flat_grads
        collectives.reduce(self.comm, grads, root=STORAGE, op="sum", algorithm="tree")
        if self.rank == STORAGE:
            grads *= 1.0 / self.world  # the global batch's gradient: the mean of the slices'
            self.optimizer.step()
        collectives.broadcast(self.comm, self.model.flat_params, root=STORAGE, algorithm="tree")
        return loss

    def finish(self) -> dict:
        return {"storage_rank": STORAGE, **super().finish()}  # (held_bytes: the optimizer's on rank 0 only)

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per rank: a tree reduce of the gradient and a tree broadcast of the weights; optimizer state on rank 0."""
        base = super().costs(sizes, world, config)
        b, n = itemsize(config.dtype), parameter_count(sizes)
        sent = [
            sum(
                costmodel.bytes_sent("tree", n, b, world, rank, collective=c, root=STORAGE)
                for c in ("reduce", "broadcast")
            )
            for rank in range(world)
        ]
        optimizer = [base["optimizer"]] + [0] * (world - 1)
        return {**base, "sent_per_step": sent, "optimizer": optimizer}

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """Every rank's forward and backward; the gradient's tree reduce, the storage rank's update, the weights'
        tree broadcast (the others wait for both)."""
        nbytes = parameter_count(sizes) * itemsize(config.dtype)
        compute = pricing.replica_compute(cls, sizes, world, config, hardware)
        send = sum(hardware.collective(c, "tree", nbytes, range(world), world) for c in ("reduce", "broadcast"))
        return {"compute": compute, "communication": send, "bubble": 0.0}

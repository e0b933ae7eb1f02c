"""Parameter servers: the parameters live on server ranks; workers pull weights, compute gradients, push them back.

The picture of DistBelief's Downpour SGD, ps-lite and TensorFlow's ParameterServerStrategy. With ``--servers S`` the
last S ranks are servers and the first W = p - S are workers (rank 0 is always a worker, so it prints and writes
metrics.json like in every other paradigm). Server s owns shard s of the flat parameter buffer and the optimizer
state of that shard; workers hold the whole model for forward and backward, and no optimizer state at all.

The messages (tags on a communicator of their own), for one worker and one server::

      worker w                                    server s (shard s: n_s of the model's n bytes)
         |  PULL (0 bytes)                            |   before the first push: the servers' weights (the same
         |                                            |   as the worker's own at the start; after a resume too)
         |------------------------------------------->|
         |  WEIGHTS (n_s)                             |
         |<-------------------------------------------|
         |  forward, backward on its slice            |
         |  PUSH: gradient of shard s (n_s)           |
         |------------------------------------------->|   ps-sync:  waits for all W pushes of the step, averages
         |                                            |             them (in worker order), one optimizer step
         |                                            |   ps-async: an optimizer step with this gradient / W now
         |  WEIGHTS (n_s)                             |   --staleness K: the reply waits while w is more than K
         |<-------------------------------------------|             steps ahead of the slowest worker
         |  ... every step ...                        |
         |  END (n_s): the weights, and the epoch is  |   the coordinator (server 0), once W x steps pushes are in;
         |  over (the worker passes END, 0 bytes, on  |   a worker then evaluates and starts the next epoch
         |  to the other servers)                     |
         |  ... every epoch ...                       |
         |  DONE (0 bytes)                            |   when all W workers are done, the server leaves its loop
         |------------------------------------------->|

The two sides are two classes, a file each: :class:`~dtrain.parallel.ps_worker.Worker` (ps_worker.py) and
:class:`~dtrain.parallel.ps_server.Server` (ps_server.py, with its loop); the paradigm gives each rank the side its rank
calls for, and gathers the servers' state at the end. Checkpoints in the middle of training (``--checkpoint-every``) are
consistent snapshots, taken while the servers serve (Chandy-Lamport: ps_snapshot.py). A worker pushes to and pulls from
all S servers at once (non-blocking: every shard in flight together), so its wait is for the slowest shard. The server's
loop takes messages from any worker in the order they come (``Probe(ANY_SOURCE)``, then the receive into the buffer the
tag calls for).

**Bytes per step** (n bytes of parameters, W workers, S servers, shard n_s ~ n/S)::

    worker:    sends n (its gradient, in S pieces),  receives n (the new weights)
    server s:  sends W n_s,                          receives W n_s           (S = 1: W n each way)

A ring all-reduce sends 2 (p-1)/p n per rank, whatever p. One server's link carries W times what a worker's does:
the bottleneck that sharding (S > 1) divides by S. Exact per rank: :meth:`ParameterServer.costs`.

**Sharding.** The shards are contiguous, balanced slices of the flat buffer (``chunk_bounds``: sizes differ by at most
one element), not whole layers: by layer, the 64x128 weight matrix and the 10 biases of the last layer would sit on
servers whose loads differ 800-fold. Cutting a layer in two is harmless because every optimizer here is elementwise
(SGD, momentum, weight decay, Adam), so a server's update of its slice is exactly that slice of the whole update.

**Synchronous** (``ps-sync``): the average of the W slice gradients is the global batch's gradient (as for ``ddp``), so
ps-sync follows single-process training with the same global batch to rounding. **Asynchronous** (``ps-async``): each
push is applied on arrival, as an optimizer step with the learning rate divided by W: a worker's slice is 1/W of the
global batch, so W pushes move the weights about as far as one synchronous step (weight decay included, since it
rides on the same step; Adam normalises its steps, so for Adam only the rate's 1/W does this). The worker then
computes its next gradient on weights that others may have changed since. Its *staleness*, the number of updates the
server applied between the weights a worker was sent and the arrival of the gradient computed from them, is recorded
for every update. With momentum, every push is an optimizer step: the momentum decays per push, not per round
(asynchrony itself acts like extra momentum: Mitliagkas et al., 2016). **Stale-synchronous** (``--staleness K``, Ho et
al., 2013): as async, but a worker more than K steps ahead of the slowest is not answered until the slowest catches
up. K = 0 makes every worker wait for every other at each step; for plain SGD (no momentum, no weight decay) that is
ps-sync up to the order of the additions (weight decay would act on weights the round's earlier pushes already
moved: a difference of order (lr wd)^2).

**Epochs.** In ps-sync every worker takes its slice of each of the epoch's global batches, as in ``ddp``. In ps-async
an epoch is a budget of W x steps pushes shared by the workers: each cycles through its own slices until the
coordinator answers END, so a fast worker takes more steps and a straggler fewer (TensorFlow's coordinator likewise
hands the next step to whichever worker is free). A push already on its way when the budget is reached is still
applied, so an epoch may hold up to W - 1 more. The price: a fast worker goes round its own slices again while the
straggler's are partly skipped, so an asynchronous epoch leans towards the fast workers' data (each worker's slices are
its own, as in Downpour SGD). At the end of an epoch each worker pulls the servers' weights (counted under
"evaluation"), so the accuracy reported is that of the servers' model, the one the digest and checkpoint hold.
"""

from __future__ import annotations

import numpy as np

from dtrain import terminal
from dtrain.backend import itemsize, weights_digest
from dtrain.collectives import chunk_bounds
from dtrain.comm.trace import EVALUATION
from dtrain.errors import ConfigError
from dtrain.layout import parameter_count
from dtrain.optim import buffers_per_parameter
from dtrain.parallel import Paradigm, pricing, ps_report, ps_snapshot, register
from dtrain.parallel.flags import Flag
from dtrain.parallel.ps_server import DONE, END, PULL, PUSH, WEIGHTS, Server
from dtrain.parallel.ps_worker import Worker

__all__ = ["DONE", "END", "PULL", "PUSH", "WEIGHTS", "AsyncParameterServer", "ParameterServer", "Server", "Worker",
           "shards"]  # fmt: skip

SERVERS = Flag("servers", 1, "the last S ranks serve, each owning a slice of the parameters", type=int, metavar="S",
               at_least=1)  # fmt: skip
STALENESS = Flag("staleness", None, "ps-async: a worker more than K steps ahead of the slowest waits "
                 "(stale-synchronous; default: unbounded)", type=int, metavar="K", at_least=0,
                 meaning="(steps a worker may run ahead)")  # fmt: skip


def shards(n: int, servers: int) -> list[tuple[int, int]]:
    """(start, stop) of each server's slice of an n-element flat buffer: contiguous and balanced."""
    return chunk_bounds(n, servers)


@register
class ParameterServer(Paradigm):
    name = "ps-sync"
    summary = "parameter servers: workers push gradients, pull weights; the servers wait for every worker"
    order = 4  # where it comes in listings (--help, the planner): the course teaches it then
    flags = (SERVERS, STALENESS)
    synchronous = True

    @classmethod
    def check(cls, config, world: int) -> None:
        servers = config.servers
        if world < 2:
            raise ConfigError(f"--paradigm {cls.name} needs at least 2 ranks (a server and a worker), got {world}; "
                              "launch with dtrain launch -n 2 or more")  # fmt: skip
        if not 1 <= servers < world:
            raise ConfigError(f"--servers {servers} must be at least 1 and leave a worker: 1 to {world - 1} on {world} "
                              "ranks")  # fmt: skip
        workers = world - servers
        if config.slow_rank is not None and not 0 <= config.slow_rank < workers:
            raise ConfigError(f"--slow-rank {config.slow_rank} is not a worker: with --servers {servers} on {world} "
                              f"ranks the workers are ranks 0 to {workers - 1}")  # fmt: skip
        if config.staleness is not None and cls.synchronous:
            raise ConfigError(f"--staleness applies to ps-async (stale-synchronous parallel); {cls.name} is "
                              "synchronous")  # fmt: skip
        super().check(config, world)

    @classmethod
    def shard_of(cls, rank: int, world: int, config) -> tuple[int, int]:
        workers = world - config.servers
        return (rank if rank < workers else 0), workers  # a server's slice is never read

    def __init__(self, comm, config):
        super().__init__(comm, config)
        self.workers = self.world - config.servers
        self.server_ranks = list(range(self.workers, self.world))
        # The protocol gets a communicator of its own: a server's "any source, any tag" sees nothing else.
        self.ps_comm = comm.Dup()
        self.workers_comm = comm.Split(0 if self.rank < self.workers else 1, self.rank)  # the global loss
        self.side: Worker | Server | None = None  # this rank's side of the protocol (build makes it)
        self.snapshot_comm = comm.Dup() if config.checkpoint_every else None  # the recordings' own
        self.resumed = None  # a server's recording at the cut a resume goes on from
        self.gathered_params = self.gathered_optimizer = None
        if self.rank == 0 and not config.quiet:
            print(terminal.wrapped(ps_report.roles(self.name, config.staleness, self.workers, self.server_ranks)),
                  flush=True)  # fmt: skip

    def build(self, make_model, make_optimizer) -> None:
        """A worker: the whole model. A server: its shard of it and that shard's optimizer."""
        model = make_model()  # the same initial weights everywhere (same seed); a server keeps its slice only
        flat = model.flat_params
        self.bounds = shards(flat.size, self.config.servers)
        if self.rank < self.workers:
            self.model = model
            self.side = Worker(self.ps_comm, model, list(zip(self.server_ranks, self.bounds)))
            if self.snapshot_comm is not None:
                self.side.snapshots = ps_snapshot.WorkerSnapshots(self.ps_comm, self.snapshot_comm, self.side.served,
                                                                  PUSH, self.config.checkpoint_every)  # fmt: skip
        else:
            self.side = Server(self.ps_comm, flat, self.bounds, self.rank - self.workers, make_optimizer,
                               workers=self.workers, synchronous=self.synchronous,
                               bound=self.config.staleness)  # fmt: skip

    # --- a server answers the workers; a worker runs the epochs ------------------------------------------------
    def run(self, epochs) -> None:
        """A server: answer the workers until every one has said DONE (an epoch is ``epochs.steps_per_epoch``
        global steps). A worker: the driver's epochs, keeping its own place in them (ps-async's each have theirs)."""
        if isinstance(self.side, Server):
            self.side.serve(epochs.steps_per_epoch, self.config.lr, done=epochs.resumed_steps,
                            start=epochs.position.step, snapshots=self.snapshot_comm,
                            every=self.config.checkpoint_every, injector=epochs.injector,
                            resumed=self.resumed)  # fmt: skip
            return
        position, side = epochs.position, self.side
        epochs.checkpoint_every = 0  # (the driver's: this paradigm takes its own, consistent snapshots)
        if side.snapshots is not None:
            side.snapshots.driver = epochs  # (rank 0 records the epochs' figures and time too)
        if position.done:  # another paradigm's checkpoint (or a run without snapshots): the same place for everyone
            side.carried, side.start_at = (position.done, position.done_loss * position.done), position.done
            position.done, position.done_loss = 0, 0.0
        epochs.run()
        if side.snapshots is not None:
            side.snapshots.close()

    def epoch(self, batches):
        """ps-sync: a step on each of this worker's slices of the epoch's global batches. ps-async: the same, going
        round them again until the coordinator says the epoch's W x steps pushes are in, so a fast worker takes more
        steps and a slow one fewer (``Worker.epoch``)."""
        return self.side.epoch(batches, self.gradients, once=self.synchronous)

    def global_loss(self, local_mean: float) -> float:
        """The mean over every step the workers took this epoch (async: weighted by each worker's step count),
        those before a resume included."""
        (steps0, sum0), steps = self.side.carried, self.side.steps
        self.side.carried = (0, 0.0)
        total, steps = self.workers_comm.allreduce(np.array([local_mean * steps + sum0, steps + steps0]))
        return float(total / steps)

    restore_snapshot = ps_snapshot.restore  # (a resume from a snapshot: the cut's state, the pushes in flight)

    def evaluation_model(self):
        """ps-async: the servers' weights, pulled after every worker has ended the epoch (the driver asks after the
        epoch's global loss), so an epoch's accuracy is that of the model the servers hold: after the last epoch, the
        final model of the digest and the checkpoint. (ps-sync: every worker already holds it.)"""
        if not self.synchronous:
            self.side.pull(EVALUATION)
        return self.model

    # --- the end: every rank gets the final model --------------------------------------------------------------
    def finish(self) -> dict:
        everyone = self.comm.allgather(self.side.done())
        servers = everyone[self.workers :]
        self.gathered_params = np.concatenate([s["params"] for s in servers])
        states = [s["optimizer"] for s in servers]
        self.gathered_optimizer = {k: np.concatenate([st[k] for st in states]) if isinstance(v, np.ndarray) else v
                                   for k, v in states[0].items()}  # fmt: skip
        if self.synchronous and isinstance(self.side, Worker):  # every worker's last reply is the final model
            if weights_digest(self.model.flat_params) != weights_digest(self.gathered_params):
                raise RuntimeError(f"ps-sync: worker {self.rank}'s weights differ from the servers' at the end")
        return ps_report.figures(everyone, self.workers, self.bounds)  # (ps_report.py)

    def held_bytes(self) -> dict:
        """What this rank holds for training, by kind (the accounting :meth:`costs` is checked against)."""
        return self.side.held_bytes()

    # --- the whole model ---------------------------------------------------------------------------------------
    def full_parameters(self):
        """The final model once training is over; before, a worker's copy (or a server's own shard)."""
        if self.gathered_params is not None:
            return self.gathered_params
        return self.side.parameters()

    def optimizer_state(self) -> dict:
        """The servers' state, gathered once training is over (in the middle of it, checkpoints are snapshots);
        before, a server's own shard's."""
        if self.gathered_optimizer is not None:
            return self.gathered_optimizer
        return self.side.optimizer.state_dict() if isinstance(self.side, Server) else {}

    def load(self, flat, optimizer_state: dict) -> None:
        """Resume: a worker takes the whole model, a server its shard of the model and of the optimizer state."""
        self.side.load(flat, optimizer_state)

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per rank (lists, workers first): bytes sent per step, and parameters, gradients and optimizer state held."""
        b, n = itemsize(config.dtype), parameter_count(sizes)
        workers = world - config.servers
        shard = [stop - start for start, stop in shards(n, config.servers)]
        per_element = buffers_per_parameter(config.optimizer, config.momentum)
        gradient_copies = workers + 1 if cls.synchronous else 1  # ps-sync: a slot per worker and their average
        return {
            "sent_per_step": [n * b] * workers + [workers * m * b for m in shard],
            "parameters": [n * b] * workers + [m * b for m in shard],
            "gradients": [n * b] * workers + [gradient_copies * m * b for m in shard],
            "optimizer": [0] * workers + [per_element * m * b for m in shard],
        }

    @classmethod
    def updates_like_single(cls, config) -> bool:
        return cls.synchronous  # (ps-async: a gradient computed on weights others have moved since)

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        """S = 1, 2, 4 servers, as long as they leave as many workers (the servers' links are what a step waits on)."""
        counts = [s for s in (1, 2, 4) if s <= world - s] if cls.synchronous else [1]
        return [(f"{cls.name} S={s} ({world - s} workers)", {"servers": s}, world) for s in counts]

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """A worker's forward and backward on its slice; each server receives every worker's push of its shard,
        sums them, updates the shard and answers every pull, one worker after another on its link. ps-async: no
        waiting for the others, but the servers still serve every worker's push (with an update each)."""
        b, workers = itemsize(config.dtype), world - config.servers
        shard = parameter_count(sizes) / config.servers
        link = hardware.link([0, world - 1], world)  # a worker and a server
        per_worker = 2 * (link.alpha + shard * b * link.beta) + shard * b * link.gamma  # push in, pull out, summed
        update = hardware.slowdown(world) * hardware.update_time(
            shard, b, buffers_per_parameter(config.optimizer, config.momentum))  # fmt: skip
        compute = pricing.replica_compute(cls, sizes, world, config, hardware, updated=0)  # (no update: the servers')
        if cls.synchronous:
            return {"compute": compute, "communication": workers * per_worker + update, "bubble": 0.0}
        serving = workers * (per_worker + update)  # per round of one step from every worker
        return {"compute": compute, "communication": max(0.0, serving - compute), "bubble": 0.0}


@register
class AsyncParameterServer(ParameterServer):
    name = "ps-async"
    summary = "parameter servers applying each worker's gradient as it comes (--staleness bounds how far ahead)"
    synchronous = False  # (its policy: ps_server.py's; its price: ParameterServer's, for synchronous = False)

"""What tensor and pipeline parallelism share: the rank grid, a local model made of pieces of the whole, and the rest.

Under ``tp`` (tensor_parallel.py) and ``pp`` (pipeline.py) a rank holds only part of the model: a *local* model with
its own flat buffers, each of its parameters a :class:`~dtrain.parallel.placement.Piece` of the whole model's.
Everything else a paradigm must do is the same for both, and lives here:

* **the grid** (grid.py): ``--dp``, ``--tp``, ``--pp`` checked against the world before any communication, the
  sub-communicators split once, and the map printed on rank 0;
* **the data**: the ranks of one replica (one dp coordinate) train on the same slice of every global batch;
* **data parallelism across replicas**: after backward, each rank averages its local gradients with the ranks that
  hold the same pieces (its dp group: one all-reduce of the local flat buffer), so replicas take identical steps;
* **the whole model**, for the weights digest, checkpoints and resuming: gathered from the pieces
  (:func:`~dtrain.parallel.placement.gather`), and scattered back into them; the optimizer's buffers likewise, so
  a checkpoint of ``tp`` or ``pp`` is the flat format every paradigm writes and reads;
* **the checks at the end**: dp replicas hold identical local buffers, and the replicated parameters (a row-parallel
  layer's bias, a layer that is not split) are identical across the tensor group;
* **the bookkeeping**: the bytes a rank holds of each kind, read off its (local) arrays as every paradigm's are
  (:meth:`~dtrain.parallel.Paradigm.held_bytes`), to hold against ``costs()``.

A subclass builds ``self.model`` (its local model), ``self.pieces``, ``self.regions`` (with a pipeline) and says how
a step runs; ``fill`` names the grid axis a missing flag takes the rest of the world for.
"""

from __future__ import annotations

from dtrain import collectives, terminal
from dtrain.backend import array_module
from dtrain.comm.trace import CHECKPOINT, labelled
from dtrain.errors import ConfigError
from dtrain.parallel import Evaluating, Paradigm, check_replicas, grid, placement

NOT_HERE = ("hierarchical", "hierarchical_rs", "hierarchical_shm")  # need --ranks-per-node, a ddp flag


class ModelParallel(Paradigm):
    fill = "dp"  # the grid axis that takes what the given flags leave of the world

    @classmethod
    def shape_of(cls, config, world: int) -> grid.Shape:
        """The grid ``config`` asks for on ``world`` ranks (a ConfigError if it does not fit): the ``fill`` axis
        takes the rest of the world when its flag is missing; else ``--dp`` does."""
        fill = cls.fill if getattr(config, cls.fill) is None else "dp"
        return grid.shape_of(world, config.dp, config.tp, config.pp, fill)

    @classmethod
    def shard_of(cls, rank: int, world: int, config) -> tuple[int, int]:
        """Every rank of one replica trains on its replica's slice: (dp coordinate, dp size)."""
        shape = cls.shape_of(config, world)
        return shape.coordinates(rank)["dp"], shape.dp

    @classmethod
    def check(cls, config, world: int) -> None:
        super().check(config, world)  # flags, then the grid (through shard_of), then the batch over the replicas
        if config.allreduce in NOT_HERE or config.allreduce not in collectives.ALGORITHMS:
            allowed = [a for a in collectives.ALGORITHMS if a not in NOT_HERE]
            raise ConfigError(f"--allreduce {config.allreduce} is not available to --paradigm {cls.name}: choose one "
                              f"of {', '.join(allowed)}")  # fmt: skip

    def __init__(self, comm, config):
        super().__init__(comm, config)
        self.shape = self.shape_of(config, self.world)
        self.grid = grid.Grid(comm, self.shape)
        if self.rank == 0 and not config.quiet:
            print(terminal.wrapped(self.shape.describe()), flush=True)
        self.tracer = getattr(comm, "tracer", None)
        self.gathered = None  # the whole model, gathered once training is over
        self.regions = ()  # pipeline: (pp rank, start, stop) of each stage's part of the whole flat buffer

    def adopt(self, local_model, pieces, total: int, make_optimizer) -> None:
        """Take ``local_model`` (flattened; its parameters are ``pieces`` of a whole model of ``total`` elements)."""
        self.model, self.pieces, self.total = local_model, pieces, total
        if sum(p.size for p in pieces) != local_model.flat_params.size:
            raise AssertionError("the pieces do not cover the local model's flat buffer")
        self.optimizer = make_optimizer(local_model)
        self.whole_model = placement.Held(local_model, self.optimizer, pieces, self._gather)  # (from the pieces)
        self.peer_pieces = self.grid.tp_comm.allgather(pieces)  # (a few numbers per layer, once)

    # --- data parallelism across replicas -----------------------------------------------------------------
    def average_gradients(self) -> None:
        """Average the local gradients over the dp group: every replica's pieces take the same step."""
        if self.shape.dp > 1:
            with labelled(self.comm, "dp/allreduce-gradients"):
                collectives.allreduce(self.grid.dp_comm, self.model.flat_grads, "avg", self.config.allreduce)

    def step(self, x, y) -> float:
        """Forward and backward through the local model (its collectives inside), the gradients averaged over the
        replicas, then the update of this rank's pieces."""
        loss = self.gradients(x, y)
        self.average_gradients()
        self.optimizer.step()
        return loss

    def global_loss(self, local_mean: float) -> float:
        """The mean over replicas (every rank of a replica knows its replica's loss: see replica_loss)."""
        return self.grid.dp_comm.allreduce(self.replica_loss(local_mean)) / self.shape.dp

    def replica_loss(self, local_mean: float) -> float:
        return local_mean

    # --- the whole model, from the pieces -----------------------------------------------------------------
    def _gather(self, local):
        return placement.gather(local, self.total, self.grid.tp_comm, self.peer_pieces, self.regions,
                                self.grid.pp_comm, CHECKPOINT)  # fmt: skip

    def full_parameters(self):
        return self.gathered if self.gathered is not None else self.whole_model.parameters()

    def optimizer_state(self) -> dict:
        return self.whole_model.optimizer_state()

    def load(self, flat, optimizer_state: dict) -> None:
        self.whole_model.load(flat, optimizer_state)

    def evaluation_model(self):
        return Evaluating(self.model, self.comm)

    # --- the end ------------------------------------------------------------------------------------------
    def finish(self) -> dict:
        flat = self.model.flat_params
        check_replicas(self.grid.dp_comm, flat, "(the same pieces on every replica) at the end of training")
        replicated, offset = [], 0
        for piece in self.pieces:  # the parameters every rank of the tensor group holds whole must agree
            if piece.whole:
                replicated.append(flat[offset : offset + piece.size])
            offset += piece.size
        if replicated and self.shape.tp > 1:
            check_replicas(self.grid.tp_comm, array_module(flat).concatenate(replicated),
                           "(the replicated parameters of a tensor group) at the end of training")  # fmt: skip
        self.gathered = self.full_parameters()
        return {
            "grid": {"dp": self.shape.dp, "tp": self.shape.tp, "pp": self.shape.pp},
            "coordinates": self.comm.allgather(self.grid.coordinates),
            **super().finish(),  # held_bytes: its pieces of the parameters, gradients and optimizer state
        }

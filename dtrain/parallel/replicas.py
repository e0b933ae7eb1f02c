"""Whole replicas, one on every rank (ddp, local SGD, gossip): started identical, on their nodes, and averaged.

Every data-parallel paradigm starts its replicas from rank 0's weights (:func:`start`: a broadcast, then a check by
digests), and may run its all-reduces over emulated or real nodes (:func:`nodes`, :func:`check_nodes`: the
hierarchical all-reduces of ``--allreduce``). ddp's replicas then take identical steps and never differ.

Local SGD's and gossip's do differ: each rank steps on its own gradient, and the replicas agree only after an average
of their *weights* (local SGD: every H steps; gossip: never exactly while training, its neighbours' averages only
shrink the spread). Both need the same things around that, composed as one :class:`Replicas` each:

* :func:`average_weights`: every rank's weights replaced by their average, in place: one all-reduce (op "avg"), or
  (``--average-via master``) everything summed on rank 0, scaled there and sent back;
* a second copy of the model, into which the replicas' average is taken at the end of each epoch, for evaluation
  (its all-reduce counted under "evaluation", not as training traffic), and the *consensus distance*, the mean over
  ranks of ||w_r - w_avg|| / ||w_avg||;
* the end: the optimizer's buffers averaged for a checkpoint, the final replicas checked identical by digests.
"""

from __future__ import annotations

import numpy as np

from dtrain import collectives
from dtrain.backend import array_module
from dtrain.collectives import hierarchical, shm
from dtrain.comm.trace import CHECKPOINT, EVALUATION, labelled
from dtrain.errors import ConfigError
from dtrain.parallel import check_replicas
from dtrain.parallel.buckets import allreduce_algorithm

HIERARCHICAL = ("hierarchical", "hierarchical_rs", "hierarchical_shm")


def check_nodes(config, world: int) -> None:
    """Before any message: ``--allreduce hierarchical_rs`` needs emulated nodes of equal size."""
    k = config.ranks_per_node
    if config.allreduce == "hierarchical_rs" and k is not None and world % k:
        sizes = list(hierarchical.node_sizes(world, k))
        raise ConfigError(
            f"--allreduce hierarchical_rs needs nodes of equal size; {world} ranks with --ranks-per-node {k} "
            f"make nodes of {sizes}: use --allreduce hierarchical, or a rank count divisible by {k}"
        )


def nodes(comm, config):
    """The nodes of ``comm`` that the hierarchical all-reduces run over (a collective), or None for the others; real
    nodes of different sizes are refused for hierarchical_rs (known only now)."""
    if config.allreduce not in HIERARCHICAL:
        return None
    topology = hierarchical.topology(comm, config.ranks_per_node)
    if config.allreduce == "hierarchical_rs" and not topology.equal:
        raise ConfigError(
            f"--allreduce hierarchical_rs needs nodes of equal size, these are {list(topology.node_sizes)}"
            ": use --allreduce hierarchical"
        )
    return topology


def start(comm, flat) -> None:
    """Every rank's ``flat`` becomes rank 0's (a broadcast), checked by digests."""
    collectives.broadcast(comm, flat, root=0)
    check_replicas(comm, flat, "after the initial broadcast")


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


class Replicas:
    """Replicas that drift apart (local SGD's, gossip's): the weights' own communicator and nodes, the all-reduce
    that averages them, the copy their average is evaluated in, how far apart they were at each epoch's end."""

    @staticmethod
    def check(name: str, config, world: int) -> None:
        """Before any message: the nodes, and no checkpoint in the middle of training."""
        check_nodes(config, world)
        if config.checkpoint_every:
            raise ConfigError(
                f"--paradigm {name} writes its checkpoint at the end of training only (between averages every "
                "rank holds a model of its own, and a checkpoint holds one); drop --checkpoint-every"
            )

    def __init__(self, comm, config):
        self.outer, self.config = comm, config  # (the paradigm's communicator: the start, the checks, metrics)
        self.comm = comm.Dup()  # the weights' traffic gets a communicator of its own
        self.topology = nodes(self.comm, config)
        self.copy = self.algorithm = self.final_state = None
        self.consensus = []  # the consensus distance at the end of each epoch

    def share(self, model):
        """Choose the all-reduce that averages the weights; with a shared-memory one, ``model``'s weights move into a
        window on the ranks that share it (zero copy). Before the optimizer takes the buffers. Returns ``model``."""
        flat = model.flat_params
        self.algorithm = allreduce_algorithm(self.config, self.outer.Get_size(), flat.nbytes, self.comm)
        if self.algorithm in shm.ALGORITHMS and self.outer.Get_size() > 1:
            node = self.topology.node if self.algorithm == "hierarchical_shm" else self.comm
            model.move_flat_params(shm.buffer(node, flat.size, flat.dtype))
        return model

    def start(self, model, make_model) -> None:
        """Rank 0's weights everywhere; a copy of the model for the average."""
        start(self.outer, model.flat_params)
        self.copy = make_model()  # the replicas' average, evaluated at the end of each epoch

    def average(self, flat, via: str = "allreduce") -> None:
        """Every rank's ``flat`` replaced by the replicas' average (:func:`average_weights`)."""
        average_weights(self.comm, flat, via, self.algorithm, self.topology)

    def evaluated(self, flat):
        """The model to evaluate: the replicas' average, in the copy (the replicas go on as they are); records the
        consensus distance."""
        self.consensus.append(self.distance(flat, self.mean(flat)))
        return self.copy

    def mean(self, flat):
        """The replicas' average, into the evaluation copy (traffic counted under "evaluation", not training)."""
        mean = self.copy.flat_params
        mean[...] = flat
        with labelled(self.comm, EVALUATION):
            collectives.allreduce(self.comm, mean, "avg", self.algorithm, topology=self.topology)
        return mean

    def distance(self, mine, mean) -> float:
        """Mean over ranks of ||w_r - w_avg||, relative to ||w_avg|| (a metric: the object all-reduce, untraced)."""
        xp = array_module(mine)
        distance = float(xp.linalg.norm(mine - mean))
        return self.outer.allreduce(distance) / self.outer.Get_size() / max(float(xp.linalg.norm(mean)), 1e-30)

    def finish(self, flat, optimizer) -> dict:
        """Once averaged: the optimizer's buffers averaged too when a checkpoint is written (for SGD, what the
        averaged model's next steps follow), every replica checked identical, the communicators freed."""
        if self.config.checkpoint_dir:
            self.final_state = optimizer.state_dict()
            with labelled(self.comm, CHECKPOINT):
                for value in self.final_state.values():
                    if isinstance(value, np.ndarray):
                        collectives.allreduce(self.comm, value, "avg", "ring")
        check_replicas(self.outer, flat, "at the end of training")  # (a shared window lives on: train.py frees it)
        if self.topology is not None:
            self.topology.free()
        self.comm.Free()
        return {"allreduce": self.algorithm, "consensus_distance": self.consensus}

"""Gossip (decentralized SGD, after D-PSGD: Lian et al., 2017): no master and no global average, only neighbours.

After each local optimizer step, every rank replaces its weights by a weighted average of its own and its
neighbours' weights, exchanged point to point (non-blocking; no collective): x <- W (x - lr g(x)), the
"adapt, then combine" order (D-PSGD as published combines first, x <- W x - lr g(x); both converge alike, and this
order lets the step be the same optimizer step as every other paradigm's)::

    ring of 6:      0 --- 1 --- 2          x_r  <-  1/3 x_(r-1) + 1/3 x_r + 1/3 x_(r+1)
                    |                |
                    5 --- 4 --- 3

Written as a matrix, one round is x <- W x with W the *mixing matrix*: W[r, j] is the weight rank r gives rank j. W
here is symmetric and doubly stochastic (every row and every column sums to 1), so a round keeps the average of the
replicas exactly where it is and only shrinks their spread; the spread shrinks by the factor |lambda_2(W)| per round
(the second-largest eigenvalue modulus), so the *spectral gap* 1 - |lambda_2| says how fast a graph mixes
(:func:`mixing_matrix`, :func:`spectral_gap`).

The topologies (``--topology``), each rank giving the same weight 1 / (d + 1) to itself and to each of its d
distinct neighbours (every graph below is regular, so W is symmetric and doubly stochastic):

============== ================================================ ============================================
``ring``       r - 1 and r + 1 (mod p)                           d = 2 (1 for p = 2); mixes slowly: gap ~ 1/p^2
``torus``      the 4 neighbours on an a x b grid that wraps      d <= 4; needs p = a b with a, b >= 2
``exponential`` r +- 1, 2, 4, ... (mod p)                        d ~ 2 log2 p; mixes in a few rounds
``random``     a new random pairing every step (same seed on    d = 1: weights 1/2, 1/2 (the odd one out, if
               every rank), each pair averages                  p is odd, keeps its weights)
============== ================================================ ============================================

The replicas never agree exactly while training. At the end of each epoch the driver evaluates their average (as
for local SGD, one all-reduce into a copy, counted under "evaluation"), and the consensus distance (mean over ranks of
||x_r - x_avg|| / ||x_avg||) is recorded. **The final model** is one exact all-reduce average of the replicas, stated
here and in metrics.json: training itself uses no collective, the last step does.

**Cost per step** (n bytes of weights): d n sent by each rank (random: n), whatever p; the receive buffers hold d n
more. Exact per rank: :meth:`Gossip.costs`.
"""

from __future__ import annotations

import math

import numpy as np

from dtrain.backend import array_module, itemsize
from dtrain.comm import waitall, watchdog
from dtrain.comm.trace import labelled
from dtrain.errors import ConfigError
from dtrain.layout import parameter_count
from dtrain.parallel import Paradigm, pricing, register
from dtrain.parallel.flags import ALLREDUCE, RANKS_PER_NODE, Flag
from dtrain.parallel.replicas import Replicas

TOPOLOGIES = ("ring", "torus", "exponential", "random")
TOPOLOGY = Flag("topology", "ring", "the graph each rank averages over", choices=TOPOLOGIES)
TAG = 7


def torus_shape(p: int) -> tuple[int, int]:
    """(rows, columns) of the squarest grid of p ranks with both sides >= 2, or a ConfigError."""
    rows = max((a for a in range(2, math.isqrt(p) + 1) if p % a == 0), default=None)
    if rows is None:
        raise ConfigError(
            f"--topology torus needs a rank count that is a product a x b with a, b >= 2 (4, 6, 8, 9, ...); "
            f"{p} is not: use another topology or rank count"
        )
    return rows, p // rows


def neighbours(topology: str, p: int, rank: int, step: int = 0, seed: int = 0) -> list[int]:
    """The distinct ranks ``rank`` averages with at ``step`` (only "random" depends on the step)."""
    p, rank = int(p), int(rank)
    if topology == "ring":
        return sorted({(rank - 1) % p, (rank + 1) % p} - {rank})
    if topology == "torus":
        rows, cols = torus_shape(p)
        i, j = divmod(rank, cols)
        around = {((i - 1) % rows) * cols + j, ((i + 1) % rows) * cols + j, i * cols + (j - 1) % cols,
                  i * cols + (j + 1) % cols}  # fmt: skip
        return sorted(around - {rank})
    if topology == "exponential":
        hops = [1 << k for k in range(max(1, (p - 1).bit_length()))]
        return sorted({(rank + h) % p for h in hops} | {(rank - h) % p for h in hops} - {rank})
    if topology == "random":
        order = np.random.default_rng([seed, step]).permutation(p)  # the same pairing on every rank
        position = int(np.flatnonzero(order == rank)[0])
        partner = position ^ 1
        return [int(order[partner])] if partner < p else []
    raise ConfigError(f"--topology {topology!r} is not one of: {', '.join(TOPOLOGIES)}")


def mixing_matrix(topology: str, p: int, step: int = 0, seed: int = 0) -> np.ndarray:
    """W[r, j]: the weight rank r gives rank j's weights in one round (symmetric, doubly stochastic)."""
    w = np.zeros((p, p))
    for r in range(p):
        around = neighbours(topology, p, r, step, seed)
        w[r, [r, *around]] = 1.0 / (len(around) + 1)
    return w


def expected_mixing_matrix(topology: str, p: int, seed: int = 0, rounds: int = 256) -> np.ndarray:
    """The mixing matrix of a round on average (for "random", estimated over ``rounds`` pairings; a single random
    pairing splits the ranks into pairs and has no gap at all). For "random" its gap is a rate *in expectation*, not
    comparable with a fixed graph's per-round gap (which is why metrics.json reports none for "random")."""
    if topology != "random":
        return mixing_matrix(topology, p)
    return sum(mixing_matrix(topology, p, step, seed) for step in range(rounds)) / rounds


def spectral_gap(w: np.ndarray) -> float:
    """1 - |lambda_2(W)|: the fraction of the replicas' spread one round removes (at least)."""
    moduli = np.sort(np.abs(np.linalg.eigvalsh(w)))[::-1]
    return float(1.0 - moduli[1]) if len(moduli) > 1 else 1.0


def gossip_step(comm, flat, around, inbox=None) -> None:
    """One gossip round, in place: send ``flat`` to each neighbour in ``around``, receive theirs (into ``inbox``, one
    buffer per neighbour; made here if None), and set ``flat = (flat + sum of theirs) / (d + 1)``, d = len(around):
    the row of W for this rank. No neighbours: nothing is sent and ``flat`` stays as it is."""
    if not around:
        return
    inbox = inbox or [array_module(flat).empty_like(flat) for _ in around]
    with watchdog.watching(comm, f"gossip: weights from ranks {around}"):
        requests = [comm.Irecv(inbox[i], peer, TAG) for i, peer in enumerate(around)]
        requests += [comm.Isend(flat, peer, TAG) for peer in around]
        waitall(requests)
    weight = 1.0 / (len(around) + 1)
    flat *= weight
    for i in range(len(around)):  # in neighbour order: the same sums on every run
        flat += weight * inbox[i]


@register
class Gossip(Paradigm):
    name = "gossip"
    summary = "decentralized: every rank averages its weights with its neighbours' every step"
    order = 6  # where it comes in listings (--help, the planner): the course teaches it then
    flags = (ALLREDUCE, RANKS_PER_NODE, TOPOLOGY)

    @classmethod
    def check(cls, config, world: int) -> None:
        super().check(config, world)
        Replicas.check(cls.name, config, world)  # the final average's nodes; no checkpoint while the replicas differ
        if world < 2:
            raise ConfigError(f"--paradigm gossip needs at least 2 ranks (neighbours to average with), got {world}")
        neighbours(config.topology, world, 0)  # an unknown topology, or a torus on a prime: one clear error

    def __init__(self, comm, config):
        super().__init__(comm, config)
        self.replicas = Replicas(comm, config)  # the weights' communicator, their average, its copy (replicas.py)
        self.steps = 0

    def build(self, make_model, make_optimizer) -> None:
        super().build(lambda: self.replicas.share(make_model()), make_optimizer)  # (the averaging all-reduce)
        self.replicas.start(self.model, make_model)  # rank 0's weights everywhere; a copy for their average
        flat = self.model.flat_params
        self.inbox = [array_module(flat).empty_like(flat) for _ in range(self.degree(self.config, self.world))]

    def step(self, x, y) -> float:
        """This rank's own step on its own gradient, then one gossip round with its neighbours."""
        loss = self.gradients(x, y)
        self.optimizer.step()
        self.steps += 1
        self.mix()
        return loss

    def mix(self) -> None:
        """One gossip round with this step's neighbours (:func:`gossip_step`), counted under "gossip/<topology>"."""
        flat, comm = self.model.flat_params, self.replicas.comm
        around = neighbours(self.config.topology, self.world, self.rank, self.steps, self.config.seed)
        if not around:  # (random pairing, odd p: the odd one out; no operation to count)
            return
        with labelled(comm, f"gossip/{self.config.topology}", flat.nbytes):
            gossip_step(comm, flat, around, self.inbox)

    def evaluation_model(self):
        """The average of the replicas (a copy; the replicas go on as they are); records the consensus distance."""
        return self.replicas.evaluated(self.model.flat_params)

    def finish(self) -> dict:
        flat, replicas = self.model.flat_params, self.replicas
        before = replicas.distance(flat, replicas.mean(flat))
        replicas.average(flat)  # the final model: one exact all-reduce average of the replicas
        figures = replicas.finish(flat, self.optimizer)  # (checks that the replicas are identical)
        fixed = self.config.topology != "random"  # (a random pairing has no gap of its own: see expected_mixing_matrix)
        gap = spectral_gap(mixing_matrix(self.config.topology, self.world)) if fixed else None
        return {**figures, "topology": self.config.topology, "final_average": "one all-reduce",
                "consensus_before_final_average": before, "spectral_gap": gap, **super().finish()}  # fmt: skip

    def optimizer_state(self) -> dict:
        return self.replicas.final_state or super().optimizer_state()  # (the checkpoint's: averaged at the end)

    def held_bytes(self) -> dict:
        """What every rank holds, the copy the replicas' average is evaluated in, and the neighbours' weights."""
        held = super().held_bytes()
        return {**held, "parameters": held["parameters"] + self.replicas.copy.flat_params.nbytes,
                "receive_buffers": sum(b.nbytes for b in self.inbox)}  # fmt: skip

    @staticmethod
    def degree(config, world: int) -> int:
        """The most neighbours any rank has in one round (receive buffers)."""
        if config.topology == "random":
            return 1
        return max(len(neighbours(config.topology, world, r)) for r in range(world))

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Per rank: its weights to each neighbour every step (random with odd p: the expected value);
        ``sent_per_average``: the final all-reduce; ``parameters``: the replica and the copy its average is
        evaluated in; ``receive_buffers``: the neighbours' weights held."""
        base = super().costs(sizes, world, config)
        b, n = itemsize(config.dtype), parameter_count(sizes)
        if config.topology == "random":
            sent = [n * b * (world - world % 2) / world] * world
        else:
            sent = [len(neighbours(config.topology, world, r)) * n * b for r in range(world)]
        final = [pricing.group_allreduce_bytes(config.allreduce, [n], b, world, r, config.ranks_per_node)
                 for r in range(world)]  # fmt: skip
        return {**base, "sent_per_step": sent, "sent_per_average": final, "parameters": 2 * base["parameters"],
                "receive_buffers": cls.degree(config, world) * n * b}  # fmt: skip

    @classmethod
    def updates_like_single(cls, config) -> bool:
        return False  # replicas that never quite agree: not ddp's updates

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        return [(f"gossip {t}", {"topology": t}, world) for t in ("ring", "exponential")]

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """A replica's own step, then its weights to each of d neighbours and theirs averaged in, all at once
        (the d messages share the rank's link)."""
        n = parameter_count(sizes) * itemsize(config.dtype)
        d = cls.degree(config, world)
        link = hardware.link(range(world), world)
        mix = d * (link.alpha + n * link.beta + n * link.gamma)
        compute = pricing.replica_compute(cls, sizes, world, config, hardware)
        return {"compute": compute, "communication": mix, "bubble": 0.0}

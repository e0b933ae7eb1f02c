"""Lesson 6: gossip on real MPI ranks. No global average while training: every rank averages with its neighbours.

After each local optimizer step every rank sends its weights to its neighbours in a graph, receives theirs, and
replaces its own by a weighted average (D-PSGD, dtrain/parallel/gossip.py, ``dtrain train --paradigm gossip
--topology ring|torus|exponential|random``). One round is x <- W x, with W the graph's mixing matrix:

    dtrain launch -n 4 lessons/06_gossip.py
    dtrain launch -n 6 lessons/06_gossip.py
    dtrain launch -n 8 lessons/06_gossip.py
`--device gpu` runs the same on GPUs (one per rank, rank % GPUs); the graphs' matrices (sections 1-2) stay on the CPU.

What you will see:
  1. the graphs: each rank's neighbours on a ring and on the exponential graph (r +- 1, 2, 4, ...), their mixing
     matrices, symmetric and doubly stochastic (rows and columns sum to 1);
  2. the spectral gap 1 - |lambda_2(W)|, computed, for ring, exponential, torus and random pairings on 4 to 64 ranks,
     against the closed form (1 + 2 cos(2 pi / p)) / 3 for the ring's |lambda_2| and the eigenvalues of a circulant;
  3. one gossip round on these ranks, with random weights: the average stays where it is (to rounding), the result
     is W x, and the spread shrinks by at least |lambda_2|; then rounds after rounds, against |lambda_2|^t;
  4. training: how far the replicas are from their average, step by step and at each epoch's end, ring against
     exponential graph; the final model (one all-reduce of the replicas) and its test accuracy, against ddp's;
  5. bytes per step: each rank sends its weights to each neighbour, degree x n, against ddp's ring all-reduce,
     2(p-1)/p n in 2(p-1) messages one after the other.

Every check compares with an independent oracle (a formula, NumPy's matrix product, MPI's own all-reduce, the tracer's
counts) and prints an OK line (FAIL if it does not hold); the last line says whether all passed (the exit status is
non-zero if not). Accuracies are measurements, printed and never checked.

Things to try:
  * dtrain launch -n 8: the exponential graph is no longer complete; on 4 ranks (and 5) it is, and one round of it is
    an exact average: gossip on it is local SGD with H = 1, i.e. ddp, at twice the bytes of a ring all-reduce (p = 4);
  * --batch-size 24: four times the steps, so four times the rounds of mixing per epoch (and the bytes);
  * dtrain train --paradigm gossip --topology ring --out run: metrics.json's consensus_distance and spectral_gap.

Exercises (`dtrain exercises init ex` once copies the stubs into ex/):
  6.1  one gossip round, gossip_step(comm, flat, neighbours) in ex/gossip.py:
       exchange the weights with each neighbour and keep 1/(d + 1) of each:
       dtrain exercises check 6.1 --path ex
It is checked against the mixing matrix applied to all ranks' weights (ring,
torus, exponential graph, random pairings), the mean over ranks kept, and
messages only to neighbours.
"""

import argparse
import math
import statistics
from fractions import Fraction

import numpy as np
from lesson_util import (
    Checks,
    add_device_flag,
    conclude,
    heading,
    lesson_xp,
    parse_and_start,
    refuse_bad_arguments,
    say,
    table,
)

from dtrain import terminal
from dtrain.autograd import Tensor, no_grad
from dtrain.backend import to_host, weights_digest
from dtrain.comm import mpi
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import ShardedLoader, load_dataset, steps_per_epoch
from dtrain.errors import ConfigError
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import parameter_count
from dtrain.parallel.data_parallel import DataParallel
from dtrain.parallel.gossip import Gossip, expected_mixing_matrix, mixing_matrix, neighbours, spectral_gap
from dtrain.train import train

parser = argparse.ArgumentParser(description="Lesson 6: gossip on MPI ranks")
parser.add_argument("--epochs", type=int, default=8, help="epochs of the training runs (default %(default)s)")
parser.add_argument("--batch-size", type=int, default=96, help="global batch on digits (default %(default)s)")
parser.add_argument("--rounds", type=int, default=12, help="gossip rounds of section 3 (default %(default)s)")
parser.add_argument("--json", metavar="PATH", help="write every measurement to this file")
add_device_flag(parser)

args, world, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
from mpi4py import MPI  # for MPI.IN_PLACE, MPI.SUM (MPI has started by now)

digits = load_dataset("digits")
train_samples = len(digits.y_train)
refuse_bad_arguments([
    (p < 3, f"launch 3 ranks or more (dtrain launch -n 4 ...), not {p}: on 2 every graph is one edge"),
    (args.batch_size % p or not 0 < args.batch_size <= train_samples,
     f"--batch-size {args.batch_size} must be divisible by the {p} ranks, and at most {train_samples} (the digits)"),
    (args.epochs < 1, "--epochs must be >= 1"),
    (args.rounds < 1, "--rounds must be >= 1"),
])  # fmt: skip
xp = lesson_xp(args, world)  # numpy, or cupy on this rank's GPU (--device gpu)


def valid(topology: str, k: int) -> bool:
    try:
        neighbours(topology, k, 0)
        return True
    except ConfigError:  # a torus on a prime number of ranks
        return False


B = args.batch_size
SIZES = [digits.n_features, 32, digits.n_classes]  # 64-32-10: 2,410 parameters
N = parameter_count(SIZES) * 4  # bytes of float32 weights
PER_EPOCH = steps_per_epoch(train_samples, B)
STEPS = args.epochs * PER_EPOCH
TOPOLOGIES = ["ring", "exponential", *(["torus"] if valid("torus", p) else []), "random"]
results = {"world": p, "sizes": SIZES, "n_bytes": N, "steps": STEPS, "topologies": TOPOLOGIES}


checks = Checks(world)  # each claim checked on every rank, and printed: checks.ok(claim, flag)


def second_modulus(w: np.ndarray) -> float:
    """|lambda_2(W)|, the factor by which one round shrinks the spread (at least)."""
    return 1.0 - spectral_gap(w)


def config(**overrides) -> TrainConfig:
    base = dict(paradigm="gossip", epochs=args.epochs, hidden=tuple(SIZES[1:-1]), batch_size=B, lr=0.05,
                momentum=0.9, allreduce="ring", progress=False, quiet=True, device=args.device)  # fmt: skip
    return TrainConfig(**{**base, **overrides})


mpi.print0(terminal.paragraph(f"Lesson 6: gossip on {p} ranks; topologies {', '.join(TOPOLOGIES)}"))
if args.device == "gpu":
    mpi.print0("\n" + terminal.paragraph("(--device gpu: the weights of sections 3-4 are on the GPUs, the matrices of"
                                         " sections 1-2 on the CPU)"))  # fmt: skip

# ---------------------------------------------------------------------------------------- 1. graphs and matrices
# Rank r gives weight 1/(d+1) to itself and to each of its d neighbours: W[r, j] = 1/(d+1) for j = r and j a
# neighbour, else 0. Every rank has the same d (the graphs are regular) and "j is a neighbour of r" is symmetric, so
# W is symmetric and every row and every column sums to 1 (doubly stochastic): a round is a weighted average that
# keeps the average of all the replicas where it is.
heading(f"1. Who averages with whom, and the mixing matrix W of one round, on {p} ranks")
if rank == 0:
    graphs = [(t, step) for t in TOPOLOGIES for step in ((0, 1) if t == "random" else (0,))]
    say("Each rank's neighbours:")
    table(["rank", *(f"{t}, step {step}" if t == "random" else t for t, step in graphs)],
          [[str(r), *(", ".join(map(str, neighbours(t, p, r, step))) for t, step in graphs)] for r in range(p)],
          left=range(1, 1 + len(graphs)), wrap=())  # fmt: skip
    for topology in ("ring", "exponential"):
        w = mixing_matrix(topology, p)
        say(f"W, {topology} ('.' is 0), row r: what rank r keeps of each rank's weights:")
        fractions = [[str(Fraction(v).limit_denominator(64)) if v else "." for v in row] for row in w]
        table(["r", *map(str, range(p))], [[str(r), *row] for r, row in enumerate(fractions)], indent="      ", left=())
matrix_ok = True
for topology in TOPOLOGIES:
    for step in range(4 if topology == "random" else 1):
        w = mixing_matrix(topology, p, step)
        linked = np.array([[j in neighbours(topology, p, r, step) for j in range(p)] for r in range(p)])
        matrix_ok &= bool(
            np.array_equal(w, w.T) and np.array_equal(linked, linked.T) and (w >= 0).all()
            and np.allclose(w.sum(axis=0), 1, rtol=0, atol=1e-15) and np.allclose(w.sum(axis=1), 1, rtol=0, atol=1e-15)
            and np.array_equal(w > 0, linked | np.eye(p, dtype=bool))
        )  # fmt: skip
degrees = {t: len(neighbours(t, p, 0)) for t in TOPOLOGIES}
say(
    "Degrees: " + ", ".join(f"{t} {d}" for t, d in degrees.items())
    + (f". On {p} ranks the exponential graph links every rank to every other: W is the all-{Fraction(1, p)} matrix,"
       " and one round is the exact average." if degrees["exponential"] == p - 1 else ".")
)  # fmt: skip
checks.ok("every W is symmetric, non-negative, doubly stochastic, and non-zero exactly on the edges", matrix_ok)

# --------------------------------------------------------------------------------------------- 2. spectral gap
# W's largest eigenvalue is 1 (the all-ones vector: the average). Whatever is not the average lies in the span of
# the other eigenvectors, and one round multiplies it by their eigenvalues: the spread shrinks at least by the factor
# |lambda_2|, the second-largest modulus, so the gap 1 - |lambda_2| is the fraction a round removes. Ring and
# exponential graph are circulant (rank r's neighbours are r + fixed offsets), and the eigenvalues of a circulant
# matrix are the Fourier transform of its first row: lambda_k = sum_j W[0, j] cos(2 pi j k / p). For the ring that
# is (1 + 2 cos(2 pi k / p)) / 3, the largest below 1 at k = 1: gap ~ 4 pi^2 / (3 p^2), a quarter when p doubles.
WORLDS = sorted({4, 5, 6, 8, 12, 16, 32, 64, p})
heading("2. Spectral gap 1 - |lambda_2(W)| (eigvalsh), and the rounds that shrink the spread 1000-fold")


def circulant_moduli(topology: str, k: int) -> list:
    first = mixing_matrix(topology, k)[0]
    waves = [sum(first[j] * math.cos(2 * math.pi * j * m / k) for j in range(k)) for m in range(k)]
    return sorted((abs(v) for v in waves), reverse=True)


def rounds_for(gap: float, factor: float = 1e-3) -> str:
    return "1" if gap >= 1 - 1e-12 else f"{math.ceil(math.log(factor) / math.log(1 - gap))}"


gaps, gap_ok, cells = {}, True, []
for k in WORLDS:
    row = {t: spectral_gap(expected_mixing_matrix(t, k)) for t in ("ring", "exponential", "torus", "random")
           if valid(t, k)}  # fmt: skip
    closed = 1 - (1 + 2 * math.cos(2 * math.pi / k)) / 3
    gap_ok &= abs(row["ring"] - closed) < 1e-12 and row["exponential"] >= row["ring"] - 1e-12
    gap_ok &= all(abs(row[t] - (1 - circulant_moduli(t, k)[1])) < 1e-12 for t in ("ring", "exponential"))
    gaps[k] = {**row, "ring_closed_form": closed}
    cells.append([str(k), f"{row['ring']:.4f}", f"{closed:.4f}", f"{row['exponential']:.4f}",
                  str(len(neighbours("exponential", k, 0))), f"{row['torus']:.4f}" if "torus" in row else "-",
                  f"{row['random']:.4f}", f"{rounds_for(row['ring'])}, {rounds_for(row['exponential'])}"])  # fmt: skip
table(["ranks", "ring", "closed form", "exponential", "degree", "torus", "random*",
       "rounds for 1/1000: ring, exponential"], cells, left=())  # fmt: skip
say(
    "(* random: the gap of the expected W over 256 pairings, what a round does on average; one pairing alone splits"
    " the ranks into pairs and has no gap at all.) The ring's gap falls as 1/p^2: on 64 ranks a round removes"
    f" {100 * gaps[64]['ring']:.2f}% of the spread, and shrinking it 1000-fold takes {rounds_for(gaps[64]['ring'])}"
    f" rounds. The exponential graph pays for its log2(p) neighbours with a gap that stays large"
    f" ({gaps[64]['exponential']:.2f} on 64 ranks)."
)
results["spectral_gap"] = {str(k): v for k, v in gaps.items()}
checks.ok(
    "the ring's gap equals 1 - (1 + 2 cos(2 pi/p))/3, ring and exponential equal their circulant eigenvalues,"
    " exponential >= ring",
    gap_ok,
)

# ---------------------------------------------------------------------------------------- 3. one round, for real
# Gossip.mix() on these ranks: Isend my weights to each neighbour, Irecv theirs, average. Random weights on every
# rank (a model of 2,410 float64 parameters), so the rows of X are far apart; the oracle is NumPy: X' = W X.
heading(f"3. Gossip rounds on these {p} ranks, from random weights (float64)")


def gossiper(topology: str) -> Gossip:
    g = Gossip(prepare(world, device=args.device), config(topology=topology, dtype="float64"))  # (GPU: staged)
    g.build(lambda: MLP(SIZES, seed=0, dtype=np.float64, xp=xp), lambda model: make_optimizer("sgd", model, 0.05))
    flat = g.model.flat_params
    flat[...] = xp.asarray(np.random.default_rng(100 + rank).normal(size=flat.size))  # every rank its own weights
    return g


def spread(x: np.ndarray) -> float:
    return float(np.linalg.norm(x - x.mean(axis=0)))


round_ok, rounds = True, {}
for topology in TOPOLOGIES:
    g = gossiper(topology)
    before = np.array(world.allgather(to_host(g.model.flat_params).copy()))  # (GPU weights: host copies)
    history = [spread(before)]
    for t in range(args.rounds):
        g.steps = t  # the step number (random pairings change with it; Gossip.step calls mix() after the update)
        x = np.array(world.allgather(to_host(g.model.flat_params).copy()))
        g.mix()
        after = np.array(world.allgather(to_host(g.model.flat_params).copy()))
        w = mixing_matrix(topology, p, t)
        scale = np.abs(x).max()
        round_ok &= bool(
            np.abs(after.mean(axis=0) - x.mean(axis=0)).max() <= 1e-14 * scale  # the average stays
            and np.abs(after - w @ x).max() <= 1e-14 * scale  # what NumPy says one round is
            and spread(after) <= second_modulus(w) * spread(x) + 1e-14 * np.linalg.norm(x)  # one round's bound
        )  # fmt: skip
        history.append(spread(after))
    g.finish()  # the final average of the run (and the communicator it used)
    envelope = second_modulus(expected_mixing_matrix(topology, p))
    rounds[topology] = {"spread": history, "lambda2": envelope}
    if topology != "random":  # the same W every round: after t rounds, at most |lambda_2|^t of the spread
        round_ok &= all(s <= (envelope**t + 1e-12) * history[0] for t, s in enumerate(history))
if rank == 0:
    shown = [t for t in range(args.rounds + 1) if t <= 4 or t % 4 == 0 or t == args.rounds]
    say("The spread after t rounds, relative to the start, and |lambda_2|^t, which it stays under:")
    cells = []
    for t in shown:
        cells.append([str(t)])
        for top in TOPOLOGIES:
            spreads = rounds[top]["spread"]
            cells[-1] += [f"{spreads[t] / spreads[0]:.2e}", f"{rounds[top]['lambda2'] ** t:.1e}"]
    table(["t", *(f"{top}{what}" for top in TOPOLOGIES for what in ("", " |lambda_2|^t"))], cells, left=(),
          groups=tuple(range(1, 1 + 2 * len(TOPOLOGIES), 2)))  # fmt: skip
    say(
        "A round is an exact weighted average, so the mean of the replicas moves only by rounding; the spread"
        " shrinks by |lambda_2| or more per round (more where the starting point has little of the slowest"
        " eigenvector). Random pairings: |lambda_2| of their expected W describes the mean squared spread, not each"
        " round (a pair that just averaged has nothing left to exchange)."
    )
results["rounds"] = rounds
checks.ok(
    "every round keeps the average (to 1e-14), equals W x, and shrinks the spread by |lambda_2| or more;"
    " t rounds by |lambda_2|^t",
    round_ok,
)

# --------------------------------------------------------------------------------------------- 4. training
# The driver, train(config), on the digits, against ddp; then each gossip run again step by step with the driver's
# loop, to measure the replicas' distance from their average after every step (the mean over ranks of
# ||x_r - x_avg|| / ||x_avg||, computed here with MPI's own all-reduce in float64) and to evaluate the final model.
heading(f"4. Training 64-32-10 on digits, global batch {B}, {args.epochs} epochs ({STEPS} steps)")


def trained(cfg: TrainConfig) -> dict:
    """``train(cfg)`` on all ranks; its metrics on every rank (the per-rank figures are gathered on rank 0)."""
    return world.bcast(train(cfg, world), root=0)


def consensus(flat) -> float:
    flat = to_host(flat)  # (GPU weights: measured on a host copy)
    mean = np.array(flat, dtype=np.float64)
    world.Allreduce(MPI.IN_PLACE, mean, op=MPI.SUM)
    mean /= p
    return world.allreduce(float(np.linalg.norm(flat - mean))) / p / float(np.linalg.norm(mean))


def by_hand(cfg: TrainConfig):
    """dtrain.train's loop for ``cfg``, step by step: the distance after every step, then the final model's test
    accuracy (computed here) and weights digest."""
    paradigm = Gossip(prepare(world, device=cfg.device), cfg)
    paradigm.build(
        lambda: MLP(SIZES, seed=cfg.seed, xp=xp),
        lambda model: make_optimizer(cfg.optimizer, model, cfg.lr, cfg.momentum, cfg.weight_decay),
    )
    loader = ShardedLoader(
        digits.x_train,
        digits.y_train,
        B,
        *paradigm.batch_slice,
        cfg.seed,
        xp,
    )
    distances = []
    for epoch in range(1, cfg.epochs + 1):
        for x, y in loader.epoch(epoch):
            paradigm.step(x, y)
            distances.append(consensus(paradigm.model.flat_params))
    figures = paradigm.finish()  # the final model: one all-reduce average of the replicas
    with no_grad():
        predicted = to_host(paradigm.model(Tensor(xp.asarray(digits.x_test))).data.argmax(axis=1))
    accuracy = float((predicted == digits.y_test).mean())
    return distances, accuracy, weights_digest(paradigm.model.flat_params), figures


runs = {"ddp": (config(paradigm="ddp"), trained(config(paradigm="ddp")))}
runs.update({t: (config(topology=t), trained(config(topology=t))) for t in TOPOLOGIES})
training, training_ok = {}, True
for topology in ("ring", "exponential"):
    cfg, metrics = runs[topology]
    distances, accuracy, digest, figures = by_hand(cfg)
    driver = metrics["communication"]["per_rank"][0]["paradigm"]
    at_ends = distances[PER_EPOCH - 1 :: PER_EPOCH]
    training_ok &= all(abs(a - b) <= 1e-6 + 1e-3 * b for a, b in zip(driver["consensus_distance"], at_ends))
    training_ok &= digest == metrics["weights_sha256"] and accuracy == metrics["final"]["test_accuracy"]
    training[topology] = {"per_step": distances, "driver_per_epoch": driver["consensus_distance"],
                          "before_final_average": driver["consensus_before_final_average"],
                          "spectral_gap": driver["spectral_gap"], "test_accuracy": accuracy}  # fmt: skip
if rank == 0:
    say("consensus distance (mean over ranks of ||x_r - x_avg|| / ||x_avg||), ring against exponential, the mean"
        " over each epoch's steps and the driver's figure at its end:")  # fmt: skip
    cells = []
    for e in range(args.epochs):
        cells.append([str(e + 1)])
        for topology in ("ring", "exponential"):
            epoch = training[topology]["per_step"][e * PER_EPOCH : (e + 1) * PER_EPOCH]
            cells[-1] += [f"{statistics.mean(epoch):.2e}", f"{training[topology]['driver_per_epoch'][e]:.2e}"]
    table(["epoch", "ring: mean", "at end", "exponential: mean", "at end"], cells, left=(), groups=(1, 3))
    print()
    reference = 100 * runs["ddp"][1]["final"]["test_accuracy"]
    cells = []
    for name, (_, metrics) in runs.items():
        figures = metrics["communication"]["per_rank"][0]["paradigm"]
        gap = f"{figures['spectral_gap']:.4f}" if figures.get("spectral_gap") is not None else "-"
        before = f"{figures['consensus_before_final_average']:.2e}" if name != "ddp" else "0 (identical)"
        accuracy = 100 * metrics["final"]["test_accuracy"]
        cells.append([name, gap, before, f"{accuracy:.2f}%", f"{accuracy - reference:+.2f}"])
        training.setdefault(name, {})["driver_test_accuracy"] = metrics["final"]["test_accuracy"]
    table(["run", "spectral gap", "distance before the final average", "test accuracy", "vs ddp"], cells)
    ring, exponential = (statistics.mean(training[t]["per_step"]) for t in ("ring", "exponential"))
    say(
        f"Averaged over the {STEPS} steps, the replicas sit {ring:.1e} (ring) and {exponential:.1e} (exponential) of"
        " their norm away from their average: each step's gradients push them apart, each round pulls them together"
        " by the graph's gap. The final model is one exact all-reduce average of the replicas (training itself used"
        " none); its accuracy, computed here from the final weights, is the driver's."
    )
results["training"] = training
checks.ok(
    "the driver's distances at the epochs' ends are the ones measured here, its final weights these,"
    " its accuracy the final model's",
    training_ok,
)

# ----------------------------------------------------------------------------------------------- 5. bytes
# Per step each rank sends its n bytes of weights to each of its d neighbours (d messages, posted at once, one
# latency); the ring all-reduce of ddp sends 2(p-1)/p n in 2(p-1) messages, each waiting for the one before.
heading(f"5. Bytes and messages each rank sends per step, n = {N:,} bytes of weights")


def operation(metrics, label: str, key: str) -> list:
    return [r["operations"].get(label, {}).get(key, 0) for r in metrics["communication"]["per_rank"]]


bytes_ok, sent = True, {}
ddp_metrics = runs["ddp"][1]
ddp_bytes = operation(ddp_metrics, "allreduce/ring", "bytes_sent")
ddp_messages = operation(ddp_metrics, "allreduce/ring", "messages_sent")
bytes_ok &= ddp_bytes == [STEPS * b for b in DataParallel.costs(SIZES, p, runs["ddp"][0])["sent_per_step"]]
bytes_ok &= ddp_messages == [STEPS * 2 * (p - 1)] * p
cells = [["ddp (ring)", "-", f"{ddp_bytes[0] / STEPS:,.0f}", f"{ddp_bytes[0] / STEPS / N:.2f}",
          f"{ddp_messages[0] / STEPS:.0f}", "yes" if bytes_ok else "NO", "-"]]  # fmt: skip
for topology in TOPOLOGIES:
    cfg, metrics = runs[topology]
    measured = operation(metrics, f"gossip/{topology}", "bytes_sent")
    messages = operation(metrics, f"gossip/{topology}", "messages_sent")
    final = operation(metrics, "allreduce/ring", "bytes_sent")
    costs = Gossip.costs(SIZES, p, cfg)
    if topology == "random":  # a new pairing every step; with p odd one rank sits out: count over all ranks
        formula = [STEPS * (p - p % 2) * N]
        right = [sum(measured)] == formula and math.isclose(sum(measured), STEPS * sum(costs["sent_per_step"]))
    else:
        formula = [STEPS * len(neighbours(topology, p, r)) * N for r in range(p)]
        right = measured == formula == [STEPS * b for b in costs["sent_per_step"]]
        right &= messages == [STEPS * len(neighbours(topology, p, r)) for r in range(p)]
    right &= final == costs["sent_per_average"]
    bytes_ok &= right
    sent[topology] = {"measured": measured, "messages": messages, "final_allreduce": final}
    degree = "1" if topology == "random" else str(degrees[topology])
    cells.append([topology, degree, f"{measured[0] / STEPS:,.0f}", f"{measured[0] / STEPS / N:.2f}",
                  f"{messages[0] / STEPS:.1f}", "yes" if right else "NO", f"{final[0]:,d}"])  # fmt: skip
table(["run", "degree", "bytes per step (rank 0)", "/ n", "messages per step", "= costs()", "final all-reduce"], cells)
sent["ddp"] = {"measured": ddp_bytes, "messages": ddp_messages}
ring_allreduce = 2 * (p - 1) / p
say(
    f"Gossip does not send fewer bytes than a ring all-reduce: d n per step against 2(p-1)/p n < 2n, so the ring of"
    f" neighbours (d = 2) sends {2 / ring_allreduce:.2f} times ddp's bytes and the exponential graph"
    f" (d = {degrees['exponential']} here) {degrees['exponential'] / ring_allreduce:.2f} times. What it saves is the"
    f" global step: a rank waits only for its d neighbours, all at once, instead of 2(p-1) = {2 * (p - 1)} messages in"
    " sequence that involve every rank, so a slow rank or link holds back its neighbours, not the world, and the"
    " cost per step does not grow with p. The price is the drift of section 4, set by the graph's spectral gap, and"
    " one exact average at the end."
)
results["bytes"] = sent
checks.ok("bytes and messages per rank: degree x n and degree per step, as the tracer counted and costs() says;"
          " the final all-reduce is one average", bytes_ok)  # fmt: skip

mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
conclude(args.json, results, checks)

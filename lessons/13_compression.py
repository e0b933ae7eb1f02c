"""Lesson 13: sending fewer bytes. Gradient compression for data parallelism, on real MPI ranks.

ddp all-reduces the whole gradient every step: 2 (p-1)/p x n bytes a rank, however slow the link. Lesson 5 sent less
often; this lesson sends less each time. ``dtrain train --paradigm ddp --compress fp16|bf16|topk|powersgd``
(dtrain/parallel/compression.py, read its docstring first) makes every rank compress its own gradient, exchange the
compressed forms, and end with the same approximate average: in half precision (2 bytes an element), as the k entries
of largest magnitude (--compress-ratio k/n), or as rank-r factors of each weight matrix (PowerSGD, --powersgd-rank r).
The last two keep what a step did not send and add it to the next step's gradient (error feedback,
--compress-feedback on|off):

    dtrain launch -n 4 lessons/13_compression.py
    dtrain launch -n 4 lessons/13_compression.py --quick          # 4 epochs, 1 seed, fewer timings: ~10 s
    dtrain launch -n 2 lessons/13_compression.py --ratio 0.001 --rank 1
    dtrain launch -n 4 lessons/13_compression.py --quick --cluster  # + section 6, on a cluster (root)
It runs on the CPU only (no --device flag): the compressors run on a GPU too (dtrain train --device gpu --compress
...), but what this lesson measures, bytes, accuracy and the arithmetic a compressor adds, it measures on this machine.

What you will see:
  1. why a gradient is compressible: the digits MLP trained with ddp, then the gradient of the next batch: how much
     of each weight matrix's squared Frobenius norm its top 1, 2 and 4 singular values hold (against a random
     matrix of the same shape), why a rank's own gradient has rank at most its rows, and what share of the squared
     norm the 1% of entries of largest magnitude hold (against random numbers);
  2. the methods side by side on p ranks, each trained on the digits for the same epochs (--seeds seeds): fp16,
     bf16, top-k at 1%, PowerSGD rank 2 and ddp's ring: bytes per rank per step (the tracer's count beside costs()),
     messages, the state each keeps, the final test accuracy and its difference to ddp's in points;
  3. why error feedback is needed: top-k 1% and PowerSGD rank 1 with --compress-feedback on and off: the training
     loss, the test accuracy, and for top-k how many weights never moved at all;
  4. fp16 against bf16: the trained gradient scaled down (x 1e-4 ... x 1e-8) and up through each format: how many
     entries flush to zero or overflow, and what loss scaling saves;
  5. when compression pays: bytes saved against arithmetic added, in the cost model (dtrain.plan.hardware,
     dtrain.collectives.costmodel): the predicted step of each method on this machine and on a slow link
     (1 Gbit/s, 50 us a message, one rank a node), for the digits MLP and an MNIST-sized one, and the link
     bandwidth below which each method's step is the shorter;
  6. with --cluster (as root): across a 100 Mbit/s link, measured. The lesson makes a cluster on this machine
     (dtrain cluster: 2 nodes that are network namespaces, 2 ranks each, each node's link shaped to --link),
     trains ddp's ring, top-k (--ratio) and PowerSGD (--rank) on the digits across it (a wider MLP,
     64-256-256-10, so that the link counts) and prints each one's training time to 96% test accuracy beside the
     cost model's; then takes the cluster down (without root: it says why and goes on).

Every check compares with an independent oracle (the tracer's counts, closed forms, the formats' definitions, the
driver's own weights) and prints an OK line (FAIL if it does not hold); the last line says whether all passed (the exit
status is non-zero if not). Accuracies and timings are measurements, printed and never checked (but for section 3's:
dropping what a step did not send ends at a higher training loss): with more ranks than cores (4 ranks on 2 cores) a
rank often waits for a core rather than for a message.

Things to try:
  * --ratio 0.001 (4 entries of the digits MLP's 3,466 a rank a step) and --rank 1: how far can they go?
  * --cluster --link 1gbit (or 10mbit): where does top-k stop paying on a real link?
  * --hidden 128,128: a wider model; do 2 singular values of its gradients still hold as much?
  * dtrain train --paradigm ddp --compress powersgd --powersgd-rank 1 --compress-feedback off --epochs 20: does the
    gap to error feedback close with more epochs?
  * notebooks/13_compression.ipynb: the same on simulated ranks, with figures.

Exercises (`dtrain exercises init ex` once copies the stubs into ex/):
  13.1  topk_step(comm, flat, residual, k) in ex/compression.py: section 3's
        top-k with error feedback: send your k largest entries of gradient +
        residual as (index, value) pairs in one ring all-gather, keep the rest:
          dtrain exercises check 13.1 --path ex
  13.2  powersgd_step(comm, matrices, errors, qs) in ex/compression.py: one
        PowerSGD step, P = M Q all-reduced and orthonormalised, Q = M^T P
        all-reduced, the error kept:
          dtrain exercises check 13.2 --path ex
They are checked on simulated ranks and under mpiexec, their bytes counted
against the compressed sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
from typing import NamedTuple

import cluster_util
import numpy as np
from cluster_util import add_cluster_flags, cluster_part, link_problem, rate_words
from lesson_util import (
    Checks,
    conclude,
    heading,
    parse_and_start,
    refuse_bad_arguments,
    say,
    sleeping_barrier,
    table,
    whole_numbers,
)

from dtrain import parallel, report, terminal
from dtrain.backend import weights_digest
from dtrain.collectives.costmodel import Machine
from dtrain.comm import mpi, sim
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import ShardedLoader, load_dataset, steps_per_epoch
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel import compression, pricing
from dtrain.parallel.data_parallel import DataParallel
from dtrain.plan import hardware
from dtrain.train import evaluate, train

TOPS = (1, 2, 4)  # section 1: the singular values counted
SCALES = (1e4, 1.0, 1e-4, 1e-6, 1e-8)  # section 4: the gradient times these
FP16_MAX, FP16_FLUSH, FP16_OVERFLOW = 65504.0, 2.0**-25, 65520.0  # largest; magnitudes <= FLUSH round to 0, >= inf
SLOW_ALPHA, SLOW_BANDWIDTH = 50e-6, 1e9 / 8  # section 5's slow link: 50 us a message, 1 Gbit/s (bytes/s)
MNIST = ([784, 512, 512, 10], 256)  # section 5's second model and its global batch


# ------------------------------------------------------------------------------------------ the runs compared
def config(hidden, batch: int, epochs: int, **flags) -> TrainConfig:
    """The run every section varies: ddp with the ring on the digits, SGD with momentum; ``flags``: --compress ..."""
    return TrainConfig(paradigm="ddp", allreduce="ring", dataset="digits", hidden=tuple(hidden), batch_size=batch,
                       epochs=epochs, lr=0.05, momentum=0.9, progress=False, quiet=True, **flags)  # fmt: skip


def methods(ratio: float, rank: int) -> dict[str, dict]:
    """Section 2's contenders: a label and the flags that make it, ddp's ring first."""
    return {"ddp ring": {}, "fp16": {"compress": "fp16"}, "bf16": {"compress": "bf16"},
            f"top-k {100 * ratio:g}%": {"compress": "topk", "compress_ratio": ratio},
            f"PowerSGD r={rank}": {"compress": "powersgd", "powersgd_rank": rank}}  # fmt: skip


def shapes_of(sizes) -> list[tuple]:
    """An MLP's parameter shapes in its flat buffer's order: each Linear layer's (inputs, outputs) weights, its bias."""
    return [shape for a, b in itertools.pairwise(sizes) for shape in ((a, b), (b,))]


def pieces(flat, shapes) -> list:
    """``flat`` cut into arrays of ``shapes``, in order (views: what the model's parameters are)."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[offset : offset + size].reshape(shape))
        offset += size
    return out


def trained(comm, cfg: TrainConfig, data):
    """dtrain.train's loop without its bookkeeping: ``cfg.epochs`` epochs of steps on ``comm`` (the same model, data
    order and slices as ``train(cfg, comm)``, so the same weights, to the bit). Returns the paradigm (not finished:
    the caller calls ``finish()``), this rank's loader, the weights before the first step, and what the driver reports
    at the end: the global batch's training loss over the last epoch, the test loss and accuracy."""
    kind = parallel.get(cfg.paradigm)
    kind.check(cfg, comm.Get_size())
    paradigm = kind(prepare(comm), cfg)
    sizes = [data.n_features, *cfg.hidden, data.n_classes]
    paradigm.build(
        lambda: MLP(sizes, seed=cfg.seed),
        lambda model: make_optimizer(cfg.optimizer, model, cfg.lr, cfg.momentum, cfg.weight_decay),
    )
    loader = ShardedLoader(
        data.x_train,
        data.y_train,
        cfg.batch_size,
        *paradigm.batch_slice,
        cfg.seed,
    )
    start = paradigm.model.flat_params.copy()
    for epoch in range(1, cfg.epochs + 1):
        losses = [paradigm.step(x, y) for x, y in loader.epoch(epoch)]
    train_loss = paradigm.global_loss(float(np.mean(losses)))
    test_loss, test_accuracy = evaluate(paradigm.evaluation_model(), data, np)
    return paradigm, loader, start, {"train_loss": train_loss, "test_loss": test_loss, "test_accuracy": test_accuracy}


# ------------------------------------------------------------------------------ 1. why a gradient compresses
def gradient_after_training(comm, cfg: TrainConfig, data) -> tuple:
    """Train ``cfg``, then the gradient of the next global batch (the first of epoch ``cfg.epochs + 1``): this rank's
    own (of its slice of the batch) and the average over the ranks (what ddp applies), flat; and the trained weights'
    digest."""
    paradigm, loader, _, _ = trained(comm, cfg, data)
    digest = weights_digest(paradigm.full_parameters())
    x, y = next(iter(loader.epoch(cfg.epochs + 1)))
    paradigm.gradients(x, y)
    own = paradigm.model.flat_grads.copy()
    paradigm.average_gradients()
    average = paradigm.model.flat_grads.copy()
    paradigm.finish()
    return own, average, digest


def top_shares(matrix, tops=TOPS) -> list[float]:
    """The share of ``||matrix||_F^2`` that its r largest singular values hold, for each r of ``tops``: sum of the r
    largest s_i^2 over the sum of all. (The best rank-r approximation's error is ||M||_F sqrt(1 - share).)"""
    s = np.linalg.svd(np.asarray(matrix, dtype=np.float64), compute_uv=False)
    energy = s**2 / np.sum(s**2)
    return [float(np.sum(energy[:r])) for r in tops]


def largest_share(vector, fraction: float = 0.01) -> float:
    """The share of ``||vector||^2`` that its ceil(fraction n) entries of largest magnitude hold (what top-k sends)."""
    squares = np.sort(np.asarray(vector, dtype=np.float64).ravel() ** 2)[::-1]
    k = max(1, math.ceil(fraction * squares.size))
    return float(squares[:k].sum() / squares.sum())


# -------------------------------------------------------------------------------------- 2. side by side
def traffic_per_step(metrics: dict) -> tuple[list, list]:
    """Bytes and messages each rank sent per training step, as the tracer counted them (all it sent, but the initial
    broadcast of the weights and the evaluation: :func:`dtrain.report.training_traffic`)."""
    steps = report.training_steps(metrics)
    sent, messages = report.training_traffic(metrics), report.training_traffic(metrics, "messages_sent")
    return [b / steps for b in sent], [m / steps for m in messages]


# ---------------------------------------------------------------------------------------- 4. fp16 and bf16
def through(codec: str, x):
    """``x`` (float32) encoded in 2 bytes an element and decoded back, as ``--compress codec`` sends it."""
    encode, decode = {"fp16": (compression.encode_fp16, compression.decode_fp16),
                      "bf16": (compression.encode_bf16, compression.decode_bf16)}[codec]  # fmt: skip
    return decode(encode(np.ascontiguousarray(x, dtype=np.float32), np), np)


def damage(x, codec: str) -> dict:
    """What a trip through ``codec`` does to ``x``'s entries: how many nonzero ones flush to zero, how many become
    infinite, and the largest relative error of the others."""
    x = np.asarray(x, dtype=np.float32)
    back = through(codec, x)
    kept = (x != 0) & (back != 0) & np.isfinite(back)
    error = np.abs(back[kept].astype(np.float64) - x[kept]) / np.abs(x[kept].astype(np.float64))
    return {"flushed": int(np.sum((x != 0) & (back == 0))), "overflowed": int(np.sum(~np.isfinite(back))),
            "worst_relative_error": float(error.max()) if error.size else 0.0}  # fmt: skip


def loss_scale(x) -> float:
    """The largest power of two that keeps ``x``'s largest magnitude within fp16's range (dynamic loss scaling
    searches for it; here it is computed)."""
    return 2.0 ** math.floor(math.log2(FP16_MAX / float(np.max(np.abs(x)))))


# ------------------------------------------------------------------------------------- 5. when it pays
def arithmetic_seconds(cfg: TrainConfig, sizes, repeats: int) -> float:
    """Seconds of a compressor's own arithmetic per step, the median of ``repeats``: its exchange on a world of one
    rank (simulated: nothing to send), on a gradient of the model's shapes. ddp (no compressor): 0."""
    if cfg.compress == "none":
        return 0.0
    shapes = shapes_of(sizes)
    gradient = np.random.default_rng(0).standard_normal(sum(math.prod(s) for s in shapes)).astype(np.float32)
    flat = np.empty_like(gradient)
    compressor = compression.make(cfg, sim.solo(), pieces(flat, shapes))
    seconds = []
    for _ in range(repeats + 1):  # (the first warms the caches up)
        flat[...] = gradient
        started = time.perf_counter()
        compressor.exchange(flat)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def exchange_seconds(cfg: TrainConfig, sizes, p: int, machine) -> float:
    """Seconds of one step's exchange on ``machine`` (a :class:`dtrain.plan.hardware.Hardware`): the alpha-beta-gamma
    time
    of dtrain's ring (dtrain.collectives.costmodel's formulas, on the machine's link) at the sizes the method sends:
    ddp, an all-reduce of n elements of s bytes; fp16/bf16, of n elements of 2 bytes; top-k, an all-gather of p x 2k
    elements (an index and a value each); PowerSGD, all-reduces of the P's, the Q's and the biases."""
    s, shapes, ranks = np.dtype(cfg.dtype).itemsize, shapes_of(sizes), range(p)
    n = sum(math.prod(shape) for shape in shapes)
    if cfg.compress == "none":
        return machine.allreduce("ring", n * s, ranks, p)
    if cfg.compress in ("fp16", "bf16"):
        return machine.allreduce("ring", n * 2, ranks, p)
    if cfg.compress == "topk":
        k = max(1, min(n, math.ceil(cfg.compress_ratio * n)))
        return machine.collective("allgather", "ring", p * 2 * k * s, ranks, p)
    r, matrices = cfg.powersgd_rank, [shape for shape in shapes if len(shape) == 2]
    counts = (sum(a * r for a, _ in matrices), sum(b * r for _, b in matrices), n - sum(a * b for a, b in matrices))
    return sum(machine.allreduce("ring", c * s, ranks, p) for c in counts if c)


def step_seconds(cfg: TrainConfig, sizes, p: int, machine, arithmetic: float) -> dict:
    """A step's predicted seconds on ``machine``: a replica's forward, backward and update on its slice of the batch
    (:func:`pricing.replica_compute`, with the machine's slowdown when ranks share cores), the compressor's
    ``arithmetic`` (measured on one free core, slowed down alike), and the exchange (:func:`exchange_seconds`)."""
    compute = pricing.replica_compute(DataParallel, sizes, p, cfg, machine)
    added = machine.slowdown(p) * arithmetic
    communication = exchange_seconds(cfg, sizes, p, machine)
    return {"compute": compute, "arithmetic": added, "communication": communication,
            "total": compute + added + communication}  # fmt: skip


def slow_link(machine, alpha: float = SLOW_ALPHA, bandwidth: float = SLOW_BANDWIDTH):
    """``machine``'s compute, one rank a node (no core shared), the nodes joined by a link of ``alpha`` seconds a
    message and ``bandwidth`` bytes/s (a reduction's gamma: the machine's, its cores do it)."""
    gamma = machine.link(range(2), 2).gamma
    link = Machine(alpha=alpha, beta=1.0 / bandwidth, gamma=gamma)
    about = f"{bandwidth * 8 / 1e9:g} Gbit/s, {alpha * 1e6:g} us"
    return dataclasses.replace(machine, name="slow link", intra=link, inter=link, loaded={}, slowdowns={},
                               ranks_per_node=1, about=about)  # fmt: skip


def with_bandwidth(machine, bandwidth: float):
    """``machine`` with its links' bandwidth (bytes/s) changed, alpha and gamma kept (inf: no time per byte)."""
    if machine.loaded:  # this machine: its links as measured, by ranks
        loaded = {p: dataclasses.replace(m, beta=1.0 / bandwidth) for p, m in machine.loaded.items()}
        return dataclasses.replace(machine, loaded=loaded)
    return dataclasses.replace(machine, intra=dataclasses.replace(machine.intra, beta=1.0 / bandwidth),
                               inter=dataclasses.replace(machine.inter, beta=1.0 / bandwidth))  # fmt: skip


def break_even(cfg: TrainConfig, base: TrainConfig, sizes, p: int, machine, arithmetic: float) -> float:
    """The link bandwidth (bytes/s, ``machine``'s latency kept) below which ``cfg``'s predicted step is shorter than
    ``base``'s: inf if it is shorter on every link, 0 if on none. A step's time is linear in the seconds per byte
    beta, so the saving a + b beta is found from two bandwidths and solved for zero."""

    def saving(bandwidth: float) -> float:
        m = with_bandwidth(machine, bandwidth)
        return step_seconds(base, sizes, p, m, 0.0)["total"] - step_seconds(cfg, sizes, p, m, arithmetic)["total"]

    a = saving(math.inf)  # beta = 0
    b = saving(1.0) - a  # per second a byte
    if b <= 0:  # it sends no fewer bytes than base: the link's speed cannot make it pay
        return math.inf if a > 0 else 0.0
    return math.inf if a >= 0 else b / -a


def speed(bandwidth: float | None) -> str:
    """A break-even bandwidth (bytes/s) as the lesson prints it."""
    if bandwidth is None:
        return "-"
    if bandwidth == math.inf:
        return "any"
    if bandwidth == 0:
        return "never"
    return f"{bandwidth * 8 / 1e9:.3g} Gbit/s"


# ------------------------------------------------------------------------------------------------ the lesson
class Setup(NamedTuple):
    """What every section works on, from the arguments: the ranks, the digits MLP, how each run trains it, and the
    methods compared."""

    world: object  # the ranks (MPI.COMM_WORLD)
    digits: object  # the dataset (dtrain.data.load_dataset)
    hidden: tuple[int, ...]  # the MLP's hidden widths (--hidden)
    batch: int  # B, the global batch (--batch-size)
    epochs: int  # E, of every training run (--epochs)
    ratio: float  # top-k's fraction of the entries a rank sends (--ratio)
    powersgd_rank: int  # PowerSGD's rank in section 2 (--rank)
    seeds: list[int]  # of every training run in sections 2 and 3 (--seeds)
    repeats: int  # timed exchanges per compressor in section 5 (--repeats)

    @property
    def p(self) -> int:
        return self.world.Get_size()

    @property
    def rank(self) -> int:
        """This process's rank (PowerSGD's is ``powersgd_rank``)."""
        return self.world.Get_rank()

    @property
    def sizes(self) -> list[int]:
        """The MLP's widths, pixels to classes."""
        return [self.digits.n_features, *self.hidden, self.digits.n_classes]

    @property
    def shapes(self) -> list[tuple]:
        return shapes_of(self.sizes)

    @property
    def n(self) -> int:
        """The MLP's parameters: N, the elements of its gradient."""
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def steps(self) -> int:
        """The steps of a training run: E epochs of the digits in global batches of B."""
        return self.epochs * steps_per_epoch(len(self.digits.y_train), self.batch)

    @property
    def methods(self) -> dict[str, dict]:
        return methods(self.ratio, self.powersgd_rank)

    @property
    def k(self) -> int:
        """The entries top-k sends a rank a step."""
        return max(1, math.ceil(self.ratio * self.n))

    @property
    def topk_label(self) -> str:
        return f"top-k {100 * self.ratio:g}%"


def arguments() -> tuple[argparse.Namespace, Setup]:
    """The lesson's flags: parsed before MPI starts (so --help needs no ranks), then checked on every rank, a bad one
    refused before any work (exit status 2, said once)."""
    parser = argparse.ArgumentParser(description="Lesson 13: gradient compression on MPI ranks")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of every training run (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=48, help="global batch on digits (default %(default)s)")
    parser.add_argument("--hidden", default="32,32", help="the digits MLP's hidden widths (default %(default)s)")
    parser.add_argument("--ratio", type=float, default=0.01,
                        help="top-k: the fraction of entries a rank sends (default %(default)s)")  # fmt: skip
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD's rank in section 2 (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds of every training run in sections 2 and 3 (default %(default)s)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=30,
                        help="section 5: timed exchanges per compressor (default %(default)s)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="4 epochs, 1 seed, 5 timed exchanges (a test's run)")
    parser.add_argument("--json", metavar="PATH", help="write every measurement to this file")
    add_cluster_flags(parser, "section 6")
    args, world, p, _ = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
    if args.quick:
        args.epochs, args.seeds, args.repeats = min(args.epochs, 4), 1, min(args.repeats, 5)

    digits = load_dataset("digits")
    hidden = whole_numbers(args.hidden)
    train_samples = len(digits.y_train)
    narrowest = min([*hidden, digits.n_classes]) if hidden and min(hidden) >= 1 else 0
    refuse_bad_arguments([
        (p < 2, f"compression is about what ranks send each other: launch 2 ranks or more (-n 4), not {p}"),
        (not hidden or min(hidden) < 1, f"--hidden {args.hidden!r} must be whole numbers >= 1, such as 32,32"),
        (args.batch_size % p or not 0 < args.batch_size <= train_samples,
         f"--batch-size {args.batch_size} must be divisible by the {p} ranks, and at most {train_samples}"),
        (args.epochs < 1 or args.seeds < 1 or args.repeats < 1, "--epochs, --seeds and --repeats must be >= 1"),
        (not 0 < args.ratio <= 1, f"--ratio {args.ratio} must be in (0, 1]: the fraction of entries a rank sends"),
        (not 1 <= args.rank <= narrowest,
         f"--rank {args.rank} must be >= 1 and at most the smaller side of every weight matrix ({narrowest})"),
        link_problem(args),
    ])  # fmt: skip
    return args, Setup(world, digits, hidden, args.batch_size, args.epochs, args.ratio, args.rank,
                       list(range(args.seeds)), args.repeats)  # fmt: skip


def introduction(setup: Setup) -> dict:
    """The model and its training, in one paragraph; returns what --json says of them."""
    p, B, E, N, STEPS, SIZES = setup.p, setup.batch, setup.epochs, setup.n, setup.steps, setup.sizes
    say(f"The digits MLP {'-'.join(map(str, SIZES))}: {N:,} parameters, {4 * N:,} bytes of float32 gradient; {p} "
        f"ranks, global batch {B} ({B // p} rows a rank), {E} epochs of {STEPS // E} steps", "", "   ")  # fmt: skip
    return {"world": p, "sizes": SIZES, "batch_size": B, "epochs": E, "steps": STEPS, "parameters": N,
            "ratio": setup.ratio, "rank": setup.powersgd_rank, "seeds": setup.seeds}  # fmt: skip


def section_1_why_a_gradient_compresses(setup: Setup, checks: Checks, results: dict) -> tuple:
    """The digits MLP trained with ddp, then the gradient of the next batch: how much of each weight matrix's norm
    its top singular values hold, why a rank's own gradient has rank at most its rows, and how much its largest
    entries hold, each against random numbers. Returns the averaged gradient (section 4 scales it) and the trained
    weights' digest (section 2 holds the driver's to it)."""
    # Train with plain ddp, then take the next batch's gradient. A Linear layer's weight gradient on a batch of B
    # rows is X^T D: (inputs x B) times (B x outputs), a sum of B outer products, so its rank is at most B, whatever
    # the layer's size. A rank's own gradient is over B/p rows; the average over ranks over B.
    world, p, B, E, N, SHAPES = setup.world, setup.p, setup.batch, setup.epochs, setup.n, setup.shapes
    hidden, digits, ratio = setup.hidden, setup.digits, setup.ratio
    heading(f"1. Why a gradient is compressible: the gradient after {E} epochs of ddp, the next global batch")
    own, average, trained_digest = gradient_after_training(world, config(hidden, B, E), digits)
    rows = B // p
    rng = np.random.default_rng(0)
    spectrum, rank_ok, low_rank_ok = {}, True, True
    say(f"share of ||G||_F^2 in the top {', '.join(map(str, TOPS))} singular values, each weight matrix:")
    cells = []
    for i, (g_avg, g_own, shape) in enumerate(zip(pieces(average, SHAPES), pieces(own, SHAPES), SHAPES)):
        if len(shape) != 2:
            continue
        noise = rng.standard_normal(shape)
        row = {"shape": list(shape), "average": top_shares(g_avg), "own": top_shares(g_own),
               "random": top_shares(noise)}  # fmt: skip
        s = np.linalg.svd(g_own.astype(np.float64), compute_uv=False)
        bounded = min(shape) > rows  # a rank's gradient has more singular values than rows: those past rows are 0
        row["beyond_rows"] = float(s[rows] / s[0]) if bounded else None
        rank_ok &= not bounded or row["beyond_rows"] < 1e-4
        low_rank_ok &= row["average"][-1] > row["random"][-1]
        spectrum[f"layer {i // 2 + 1}"] = row
        shares = ["/".join(f"{100 * v:.0f}" for v in row[k]) + "%" for k in ("average", "own", "random")]
        beyond = f"{row['beyond_rows']:.1e}" if bounded else f"(only {min(shape)} values)"
        cells.append(["x".join(map(str, shape)), *shares, beyond])
    table(["layer", "the averaged gradient", f"one rank ({rows} rows)", "a random matrix",
           f"s_{rows + 1} / s_1, one rank"], cells, left=(4,))  # fmt: skip
    results["spectrum"] = spectrum
    first = next(iter(spectrum.values()))
    say(
        f"The first layer's averaged gradient keeps {100 * first['average'][1]:.0f}% of its squared norm in 2 of its"
        f" {min(first['shape'])} singular values (a random matrix of its shape: {100 * first['random'][1]:.0f}%), so"
        " its best rank-2 approximation, which PowerSGD's power iteration approaches, is off by sqrt(1 - share) ="
        f" {math.sqrt(1 - first['average'][1]):.2f} of the gradient's norm; error feedback sends the rest in later"
        f" steps. A rank's own gradient is a sum of {rows} outer products, one per row of its slice: past the"
        f" {rows}th, its singular values are float32 rounding."
    )
    checks.ok(f"a rank's weight gradient on {rows} rows has rank <= {rows} (s_{rows + 1} / s_1 < 1e-4)", rank_ok)
    checks.ok(f"every averaged weight gradient holds more in its top {TOPS[-1]} singular values than a random matrix",
              low_rank_ok)  # fmt: skip

    magnitudes = {f"{f:g}": {"gradient": largest_share(average, f), "random": largest_share(rng.standard_normal(N), f)}
                  for f in (ratio, 0.1)}  # fmt: skip
    top = magnitudes[f"{ratio:g}"]
    scale = np.abs(average[average != 0]) / np.abs(average).max()
    decades = {f"1e-{d}": float(np.mean(scale < 10.0**-d)) for d in (1, 2, 3, 4)}
    results["magnitudes"] = {**magnitudes, "below_largest": decades}
    say(
        f"Magnitudes: the {100 * ratio:g}% of the {N:,} entries of largest magnitude"
        f" ({max(1, math.ceil(ratio * N))} entries) hold {100 * top['gradient']:.0f}% of the squared norm"
        f" ({100 * top['random']:.1f}% for random normal numbers); the largest 10% hold"
        f" {100 * magnitudes['0.1']['gradient']:.0f}% ({100 * magnitudes['0.1']['random']:.0f}%). Of the nonzero"
        " entries, "
        + ", ".join(f"{100 * v:.0f}% are under {k} of the largest" for k, v in decades.items())
        + ": most of the gradient is small, which is what top-k leaves in the residual for later steps."
    )
    checks.ok(f"the top {100 * ratio:g}% of the gradient's entries hold more of its squared norm than of random"
              " numbers", top["gradient"] > top["random"])  # fmt: skip
    return average, trained_digest


def section_2_side_by_side(setup: Setup, trained_digest: str, checks: Checks, results: dict) -> dict:
    """fp16, bf16, top-k and PowerSGD beside ddp's ring, each trained by the driver on the ranks, --seeds seeds each:
    the bytes every rank sent per step against costs() and the closed forms, the messages, the state each compressor
    keeps, the test accuracy against ddp's. Returns the runs (label -> figures), which sections 3 and 5 compare with."""
    # Each method trained by the driver, train(config, world), as `dtrain train --paradigm ddp --compress ...` runs,
    # with --seeds seeds. The tracer counts what every rank sent; report.training_traffic leaves out the initial
    # broadcast of the weights (once a run) and the evaluation at each epoch's end (a metric). costs() predicts it.
    world, p, rank, B, E, STEPS = setup.world, setup.p, setup.rank, setup.batch, setup.epochs, setup.steps
    hidden, digits, METHODS, SEEDS = setup.hidden, setup.digits, setup.methods, setup.seeds
    heading(f"2. Side by side: {E} epochs on {p} ranks, seeds {SEEDS}; bytes each rank sent per step (the tracer)")
    runs, bytes_ok, state_ok = {}, True, True
    for label, flags in METHODS.items():
        row = {"flags": flags, "test_accuracies": [], "train_losses": [], "steps_s": []}
        for seed in SEEDS:
            metrics = world.bcast(train(config(hidden, B, E, seed=seed, **flags), world), root=0)  # (rank 0's figures)
            sent, messages = traffic_per_step(metrics)
            held, predicted = report.state_bytes(metrics)
            bytes_ok &= sent == metrics["costs"]["sent_per_step"]
            state_ok &= held == predicted
            row["test_accuracies"].append(100 * metrics["final"]["test_accuracy"])
            row["train_losses"].append(metrics["final"]["train_loss"])
            row["steps_s"].append(sum(e["train_time_s"] for e in metrics["epochs"]) / STEPS)
            if seed == SEEDS[0]:
                row.update(measured=sent, costs=metrics["costs"]["sent_per_step"], messages=messages,
                           state_bytes=metrics["costs"].get("compression", 0),
                           weights=metrics["weights_sha256"])  # fmt: skip
        row.update(test_accuracy=statistics.mean(row["test_accuracies"]),
                   train_loss=statistics.mean(row["train_losses"]), step_s=statistics.mean(row["steps_s"]))  # fmt: skip
        runs[label] = row
    ddp = runs["ddp ring"]
    for row in runs.values():
        row["difference_points"] = row["test_accuracy"] - ddp["test_accuracy"]
        row["of_ddp"] = row["measured"][0] / ddp["measured"][0]
    k, topk_label, power_label = setup.k, setup.topk_label, f"PowerSGD r={setup.powersgd_rank}"
    if rank == 0:
        cells = []
        for label, row in runs.items():
            same = "yes" if row["measured"] == row["costs"] else "NO"
            spread = f"{min(row['test_accuracies']):.2f}-{max(row['test_accuracies']):.2f}"
            cells.append([label, f"{row['measured'][0]:,.0f}", same, f"{row['of_ddp']:.1%}",
                          f"{row['messages'][0]:.0f}", f"{row['state_bytes']:,d}", f"{row['test_accuracy']:.2f}%",
                          f"{row['difference_points']:+.2f}", spread, f"{row['train_loss']:.4f}",
                          f"{1e3 * row['step_s']:.2f}"])  # fmt: skip
        table(["method", "bytes per step", "= costs()", "of ddp's bytes", "messages", "state kept, bytes",
               "test accuracy", "against ddp, points", "over the seeds", "train loss", "ms per step"], cells,
              left=(0, 2), groups=(6,))  # fmt: skip
        topk, power = runs[topk_label], runs[power_label]
        spread = max(ddp["test_accuracies"]) - min(ddp["test_accuracies"])
        worse = [label for label, row in runs.items() if row["difference_points"] < -spread]
        say(
            f"(bytes: rank 0's, of the first seed's run; every rank's equal costs() in every run. Test accuracy: the"
            f" mean over the seeds on {len(digits.y_test)} images, one image is {100 / len(digits.y_test):.2f} points;"
            " train loss: the last epoch's, mean over the seeds; ms per step: rank 0's training time per step here.)"
        )
        say(
            f"fp16 and bf16 send each element in 2 bytes: half the ring's bytes, in its 2(p-1) = {2 * (p - 1)}"
            f" messages. Top-k sends k = {k} (index, value) pairs a rank, all-gathered: (p-1) 2k x 4 ="
            f" {(p - 1) * 2 * k * 4:,} bytes in {p - 1} messages, {topk['of_ddp']:.1%} of ddp's; it keeps a residual"
            f" of the whole gradient ({topk['state_bytes']:,} bytes). PowerSGD sends the factors P and Q of each"
            f" matrix and the biases in three ring all-reduces ({3 * 2 * (p - 1)} messages): {power['of_ddp']:.1%} of"
            f" ddp's bytes, and keeps each matrix's error and Q ({power['state_bytes']:,} bytes). Test accuracy against"
            " ddp's: "
            + ", ".join(f"{label} {row['difference_points']:+.2f}" for label, row in runs.items() if row is not ddp)
            + f" points; the seeds alone move ddp's over {spread:.2f} points"
            + (f" ({len(SEEDS)} seeds): " if len(SEEDS) > 1 else " (one seed: run more, --seeds 3, to see): ")
            + (", ".join(worse) + " lose more than that." if worse else "no method loses more than that.")
        )
    results["runs"] = runs
    half = [b / 2 for b in ddp["measured"]]
    formulas = {"fp16": half, "bf16": half, topk_label: [(p - 1) * 2 * k * 4] * p}
    checks.ok("every rank's bytes per step, counted by the tracer, equal costs() in every run", bytes_ok)
    checks.ok("fp16 and bf16 send exactly half of ddp ring's bytes on every rank, top-k (p-1) 2k x 4",
              all(runs[label]["measured"] == want for label, want in formulas.items()))  # fmt: skip
    checks.ok("the state every compressor held (residual; error and Q) equals costs()['compression']", state_ok)
    checks.ok("section 1's own training loop ended on the driver's ddp weights, to the bit",
              trained_digest == ddp["weights"])  # fmt: skip
    return runs


def section_3_why_error_feedback(setup: Setup, runs: dict, checks: Checks, results: dict) -> None:
    """Top-k and PowerSGD rank 1 with error feedback on and off: the training loss, the test accuracy, and for top-k
    the weights that never moved at all."""
    # Without error feedback, what a step does not send is lost. Top-k then sends, every step, the entries that are
    # large in *this* step's gradient alone: an entry that is always small is never sent, its weight never moves.
    # With it, an entry's residual grows step after step until it is among the k largest. PowerSGD without it applies
    # only the rank-r part of each step's gradient: the rest of the gradient never reaches the weights.
    world, rank, B, E, N, STEPS = setup.world, setup.rank, setup.batch, setup.epochs, setup.n, setup.steps
    hidden, digits, ratio, SIZES, SEEDS = setup.hidden, setup.digits, setup.ratio, setup.sizes, setup.seeds
    k, topk_label, ddp = setup.k, setup.topk_label, runs["ddp ring"]  # (section 2's)
    heading(f"3. Why error feedback: top-k {100 * ratio:g}% and PowerSGD rank 1, feedback on and off")
    feedback = {}
    for label, flags in {topk_label: {"compress": "topk", "compress_ratio": ratio},
                         "PowerSGD r=1": {"compress": "powersgd", "powersgd_rank": 1}}.items():  # fmt: skip
        for on in ("on", "off"):
            seeds = []
            for seed in SEEDS:
                cfg = config(hidden, B, E, seed=seed, compress_feedback=on, **flags)
                paradigm, _, start, figures = trained(world, cfg, digits)
                weights = paradigm.model.flat_params
                seeds.append({**figures, "never_moved": float(np.mean(weights == start)),
                              "weights": weights_digest(weights)})  # fmt: skip
                paradigm.finish()
            feedback[f"{label}, {on}"] = {
                "train_loss": statistics.mean(s["train_loss"] for s in seeds),
                "test_loss": statistics.mean(s["test_loss"] for s in seeds),
                "test_accuracy": statistics.mean(100 * s["test_accuracy"] for s in seeds),
                "never_moved": statistics.mean(s["never_moved"] for s in seeds),
                "weights": seeds[0]["weights"],
            }
    # the weights of a pixel that is 0 in every training image get a zero gradient at every step: none can move
    blank = int(np.sum(np.all(digits.x_train == 0, axis=0)))
    stuck = blank * SIZES[1] / N
    for row in feedback.values():
        row["difference_points"] = row["test_accuracy"] - ddp["test_accuracy"]
    if rank == 0:
        cells = [["ddp ring", f"{ddp['train_loss']:.4f}", "", f"{ddp['test_accuracy']:.2f}%", "", ""]]
        cells += [[label, f"{row['train_loss']:.4f}", f"{row['test_loss']:.4f}", f"{row['test_accuracy']:.2f}%",
                   f"{row['difference_points']:+.2f}", f"{row['never_moved']:.1%}"]
                  for label, row in feedback.items()]  # fmt: skip
        table(["run", "train loss", "test loss", "test accuracy", "against ddp, points", "weights never moved"],
              cells)  # fmt: skip
        on, off = feedback[f"{topk_label}, on"], feedback[f"{topk_label}, off"]
        p_on, p_off = feedback["PowerSGD r=1, on"], feedback["PowerSGD r=1, off"]
        say(
            f"(means over the seeds. Weights never moved: equal to their initial value after the {STEPS} steps. Of"
            f" them, {stuck:.1%} ({blank} blank pixels x {SIZES[1]}) are first-layer weights of a pixel that is 0 in"
            " every training image: their gradient is always 0, no method moves them.)"
        )
        say(
            f"Without error feedback top-k never moved {off['never_moved']:.1%} of the weights (with it:"
            f" {on['never_moved']:.1%}): their gradient was never among the {k} largest of a step on any rank, and"
            f" what was not sent was dropped. Its training loss ends at {off['train_loss']:.4f} against"
            f" {on['train_loss']:.4f}, its test accuracy {off['test_accuracy'] - on['test_accuracy']:+.2f} points."
            f" PowerSGD rank 1 leaves only {p_off['never_moved']:.1%} unmoved either way (a rank-1 matrix is dense),"
            " but without error feedback"
            " each step applies only the top direction of its gradient, and the rest is lost: training loss"
            f" {p_off['train_loss']:.4f} against {p_on['train_loss']:.4f}, test accuracy"
            f" {p_off['test_accuracy'] - p_on['test_accuracy']:+.2f} points."
        )
    results["feedback"] = {**feedback, "blank_pixels": blank, "stuck_fraction": stuck}
    checks.ok("without error feedback the training loss ends higher, for top-k and for PowerSGD rank 1",
              all(feedback[f"{m}, off"]["train_loss"] > feedback[f"{m}, on"]["train_loss"]
                  for m in (topk_label, "PowerSGD r=1")))  # fmt: skip
    checks.ok("without error feedback top-k leaves more weights unmoved than with it (and either, at least the"
              " blank pixels' weights)", feedback[f"{topk_label}, off"]["never_moved"]
              > feedback[f"{topk_label}, on"]["never_moved"] >= stuck)  # fmt: skip
    checks.ok("section 3's loop with error feedback ended on section 2's top-k weights, to the bit (the driver's)",
              feedback[f"{topk_label}, on"]["weights"] == runs[topk_label]["weights"])  # fmt: skip


def section_4_fp16_against_bf16(average, checks: Checks, results: dict) -> None:
    """Section 1's averaged gradient scaled down and up through each 2-byte format: the entries that flush to zero
    or overflow, the largest error of the others, and what loss scaling saves."""
    # fp16: 5 exponent bits, 10 of mantissa. Its smallest subnormal is 2^-24 = 6.0e-8, so rounding to nearest sends
    # every magnitude <= 2^-25 to 0; its largest number is 65504, and >= 65520 rounds to infinity. bf16: float32's 8
    # exponent bits, 7 of mantissa: nothing a float32 holds flushes or overflows, and every entry is within 2^-8.
    heading("4. fp16 against bf16: the averaged gradient of section 1, scaled, through each format")
    underflow, formats_ok, cells = {}, True, []
    nonzero = int(np.sum(average != 0))
    for s in SCALES:
        x = (average.astype(np.float64) * s).astype(np.float32)
        row = {codec: damage(x, codec) for codec in ("fp16", "bf16")}
        magnitude = np.abs(x[x != 0])
        fp16_right = (row["fp16"]["flushed"] == int(np.sum(magnitude <= FP16_FLUSH))
                      and row["fp16"]["overflowed"] == int(np.sum(magnitude >= FP16_OVERFLOW)))  # fmt: skip
        bf16_right = row["bf16"]["flushed"] == row["bf16"]["overflowed"] == 0
        formats_ok &= fp16_right and bf16_right and row["bf16"]["worst_relative_error"] <= 2.0**-8
        underflow[f"{s:g}"] = row
        f, b = row["fp16"], row["bf16"]
        f_error = f"{f['worst_relative_error']:.1e}" if f["flushed"] + f["overflowed"] < nonzero else "(none left)"
        cells.append([f"{s:.0e}", f"{float(np.abs(x).max()):.1e}", f"{f['flushed']:,d}", f"{f['overflowed']:,d}",
                      f_error, f"{b['flushed']:,d}", f"{b['overflowed']:,d}",
                      f"{b['worst_relative_error']:.1e}"])  # fmt: skip
    table(["scale", "largest", "fp16 flushed", "fp16 to inf", "fp16 worst relative error", "bf16 flushed",
           "bf16 to inf", "bf16 worst relative error"], cells, left=(), groups=(5,))  # fmt: skip
    tiny = (average.astype(np.float64) * SCALES[-1]).astype(np.float32)
    factor = loss_scale(tiny)
    rescued = damage(tiny * np.float32(factor), "fp16")
    underflow["loss_scaled"] = {"scale": SCALES[-1], "factor": factor, **rescued}
    results["underflow"] = {"nonzero": nonzero, **underflow}
    worst = underflow[f"{SCALES[-1]:g}"]["fp16"]["flushed"]
    say(
        f"Of the gradient's {nonzero:,} nonzero entries, scaled by {SCALES[-1]:g} fp16 flushes {worst:,}"
        f" ({worst / nonzero:.0%}) to zero, every one of magnitude <= 2^-25; bf16 flushes none at any scale, and"
        f" keeps every entry within 2^-8 = {2.0**-8:.1e} of itself. Before an entry flushes, it loses precision:"
        " fp16's subnormals have fewer significant bits, hence the worst relative errors. Loss scaling, fp16's"
        f" remedy: multiply the loss (so the gradient) by 2^{int(math.log2(factor))}, the largest power of two"
        f" that keeps the largest entry under 65504, before encoding, and divide after: {rescued['flushed']:,} flush."
        " Training in fp16 needs that scale, chosen and adjusted as it goes; bf16 needs none."
    )
    checks.ok("fp16 flushes to zero exactly the entries <= 2^-25 and overflows exactly those >= 65520; bf16 neither,"
              " and is within 2^-8, at every scale", formats_ok)  # fmt: skip
    checks.ok(f"scaled by {SCALES[-1]:g}, fp16 flushes entries to zero; the loss-scaled gradient flushes fewer",
              rescued["flushed"] < worst)  # fmt: skip


def section_5_when_it_pays(setup: Setup, runs: dict, checks: Checks, results: dict) -> None:
    """Bytes saved against arithmetic added, in the cost model: each method's predicted step on this machine and on
    a slow link, for the digits MLP and an MNIST-sized one, beside section 2's measured steps, and the link bandwidth
    below which each method's step is the shorter."""
    # A step's time in the cost model: compute + the compressor's arithmetic + the exchange. The compute is a
    # replica's (pricing.replica_compute, from this machine's calibration); the arithmetic is measured here on
    # rank 0 (the others sleep); the exchange is dtrain's ring priced on a link (Hardware.allreduce, .collective:
    # the costmodel's alpha-beta-gamma formulas). Two links: this machine's, as scripts/calibrate.py measured it
    # with p ranks busy, and a slow one: p nodes of one rank each, joined by 1 Gbit/s with 50 us a message.
    world, p, rank, B = setup.world, setup.p, setup.rank, setup.batch
    SIZES, METHODS, repeats = setup.sizes, setup.methods, setup.repeats
    here = hardware.Hardware.this()
    slow = slow_link(here)
    link = here.link(range(p), p)
    heading(f"5. When compression pays: predicted step times, on this machine (alpha {link.alpha * 1e6:.0f} us,"
            f" {1 / link.beta / 1e9:.1f} GB/s) and on a slow link ({slow.about} a message, one rank a"
            " node)")  # fmt: skip
    labels = list(METHODS)
    arithmetic = {}
    if rank == 0:
        for model, (sizes, batch) in {"digits": (SIZES, B), "MNIST-sized": MNIST}.items():
            arithmetic[model] = {label: arithmetic_seconds(config(sizes[1:-1], batch, 1, **METHODS[label]), sizes,
                                                           repeats) for label in labels}  # fmt: skip
    sleeping_barrier(world)  # (the other ranks slept while rank 0 timed the compressors)
    arithmetic = world.bcast(arithmetic, root=0)
    cost_model, consistent, flips = {}, True, True
    for model, (sizes, batch) in {"digits": (SIZES, B), "MNIST-sized": MNIST}.items():
        cfgs = {label: config(sizes[1:-1], batch, 1, **METHODS[label]) for label in labels}
        base = cfgs["ddp ring"]
        rows_of = {}
        for label, cfg in cfgs.items():
            added = arithmetic[model][label]
            planner = DataParallel.step_time(sizes, p, cfg, here)  # (the planner's: the same formulas, no arithmetic)
            compressed = cfg is not base
            row = {"bytes": DataParallel.costs(sizes, p, cfg)["sent_per_step"], "arithmetic_s": added,
                   "here": step_seconds(cfg, sizes, p, here, added), "slow": step_seconds(cfg, sizes, p, slow, added),
                   "break_even_here": break_even(cfg, base, sizes, p, here, added) if compressed else None,
                   "break_even_slow": break_even(cfg, base, sizes, p, slow, added) if compressed else None}  # fmt: skip
            consistent &= math.isclose(planner["communication"], row["here"]["communication"], rel_tol=1e-12)
            consistent &= math.isclose(planner["compute"], row["here"]["compute"], rel_tol=1e-12)
            for machine, key in ((here, "break_even_here"), (slow, "break_even_slow")):
                bandwidth = row[key]
                if bandwidth is not None and 0 < bandwidth < math.inf:  # the sign of the saving changes there
                    below = with_bandwidth(machine, bandwidth * 0.9)
                    above = with_bandwidth(machine, bandwidth * 1.1)
                    flips &= (step_seconds(cfg, sizes, p, below, added)["total"]
                              < step_seconds(base, sizes, p, below, 0.0)["total"])  # fmt: skip
                    flips &= (step_seconds(cfg, sizes, p, above, added)["total"]
                              > step_seconds(base, sizes, p, above, 0.0)["total"])  # fmt: skip
            rows_of[label] = row
        if model == "digits":
            for label, row in rows_of.items():
                row["measured_here_s"] = runs[label]["step_s"]
        cost_model[model] = {"sizes": sizes, "batch": batch, "methods": rows_of}
        if rank == 0:
            n = sum(math.prod(s) for s in shapes_of(sizes))
            print()
            say(f"{model}: {'-'.join(map(str, sizes))}, {n:,} parameters, global batch {batch} ({batch // p} rows a "
                "rank); ms per step (compute + arithmetic + exchange)")  # fmt: skip
            measured = model == "digits"
            cells = [[label, f"{max(row['bytes']):,d}", f"{1e3 * row['here']['arithmetic']:.3f}",
                      f"{1e3 * row['here']['compute']:.3f}", f"{1e3 * row['here']['communication']:.3f}",
                      f"{1e3 * row['here']['total']:.3f}",
                      *([f"{1e3 * row['measured_here_s']:.2f}"] if measured else []),
                      f"{1e3 * row['slow']['communication']:.3f}", f"{1e3 * row['slow']['total']:.3f}",
                      speed(row["break_even_here"]), speed(row["break_even_slow"])]
                     for label, row in rows_of.items()]  # fmt: skip
            slow_at = 7 if measured else 6  # (where the slow link's columns begin)
            table(["method", "bytes per step", "arithmetic", "compute", "exchange", "step here",
                   *(["measured"] if measured else []), "slow link: exchange", "slow link: step", "pays below (here)",
                   "pays below (slow link)"], cells, groups=(slow_at,))  # fmt: skip
    results["cost_model"] = cost_model
    results["links"] = {"here": {"alpha": link.alpha, "beta": link.beta, "gamma": link.gamma},
                        "slow": {"alpha": SLOW_ALPHA, "bandwidth": SLOW_BANDWIDTH}}  # fmt: skip
    if rank == 0:
        digits_rows, big_rows = cost_model["digits"]["methods"], cost_model["MNIST-sized"]["methods"]
        slowdown = here.slowdown(p)
        say(
            f"(bytes per step: the busiest rank's, from costs(). Here: arithmetic is the compressor's own, measured"
            f" on one free core, times {slowdown:.2f}, how much slower a rank computes when {p} ranks share this"
            f" machine's {here.cores} cores (calibrated), and so is compute; on the slow link every rank has a node, so"
            " a core, of its own. measured: section 2's ms per step. pays below: the link bandwidth, its latency kept,"
            " under which the method's predicted step is shorter than ddp's; 'any': on every link; 'never': on none.)"
        )
        whole = max(digits_rows["ddp ring"]["bytes"])
        predicted_order = sorted(digits_rows, key=lambda m: digits_rows[m]["here"]["total"])
        measured_order = sorted(digits_rows, key=lambda m: digits_rows[m]["measured_here_s"])
        ratios = [r["measured_here_s"] / r["here"]["total"] for r in digits_rows.values()]
        say(
            f"Here, the digits MLP: its whole gradient is {whole:,} bytes a rank, {1e3 * link.beta * whole:.3f} ms at"
            f" this link's bandwidth, against {2 * (p - 1)} latencies of {1e6 * link.alpha:.0f} us for the ring: the"
            " exchange is latency, and fewer bytes save next to nothing. What counts is messages: top-k's all-gather"
            f" has {p - 1}, PowerSGD's three all-reduces {3 * 2 * (p - 1)}. Predicted order, fastest first: "
            + ", ".join(predicted_order)
            + "; measured: "
            + ", ".join(measured_order)
            + f" (the measured steps are {min(ratios):.1f} to {max(ratios):.1f} times the predicted ones: lesson 11"
            " holds the planner to measurements)."
        )
        big = big_rows["ddp ring"]["slow"]
        fastest = min(big_rows, key=lambda m: big_rows[m]["slow"]["total"])
        whole_big = max(big_rows["ddp ring"]["bytes"])
        pays = {m: 8 * (whole_big - max(big_rows[m]["bytes"])) / big_rows[m]["arithmetic_s"] / 1e9 for m in labels[1:]}
        fp16_than_bf16 = terminal.speed(big_rows["fp16"]["arithmetic_s"], big_rows["bf16"]["arithmetic_s"], "bf16's")
        say(
            f"On the slow link, the MNIST-sized MLP: ddp's {whole_big:,} bytes a rank take"
            f" {1e3 * big['communication']:.1f} ms of a {1e3 * big['total']:.1f} ms step; "
            + ", ".join(f"{m} {1e3 * big_rows[m]['slow']['total']:.1f} ms" for m in labels[1:])
            + f": the fastest is {fastest}. Where bytes saved pay for arithmetic added: were the latencies the same, a"
            " method would pay on every link slower than the bytes it saves over the seconds of arithmetic it adds: "
            + ", ".join(f"{m} {v:.2f} Gbit/s" for m, v in pays.items())
            + "; the last column adds the latencies it adds or saves. The same bytes cost fp16 and bf16 different"
            f" arithmetic: here fp16's conversion was {fp16_than_bf16}. And the bigger the model,"
            " the more a low rank saves: PowerSGD sends"
            f" {max(digits_rows[labels[-1]]['bytes']) / whole:.1%} of ddp's bytes for the digits MLP,"
            f" {max(big_rows[labels[-1]]['bytes']) / whole_big:.1%} for the MNIST-sized one."
        )
    checks.ok("the cost model's compute and exchange equal the planner's (DataParallel.step_time) for every method",
              consistent)  # fmt: skip
    checks.ok("at each break-even bandwidth the faster method changes (10% below: the compressor, 10% above: ddp)",
              flips)  # fmt: skip


def section_6_across_a_slow_link(args, setup: Setup, results: dict) -> None:
    """ddp's ring, top-k and PowerSGD trained on the digits across a cluster's slow link (a wider MLP than the
    lesson's): each one's training time to 96% beside the cost model's (rank 0 runs them; the others sleep)."""
    runs = {"ddp ring": {"allreduce": "ring"}, f"top-k {100 * setup.ratio:g}%": {"compress": "topk",
            "compress_ratio": setup.ratio}, f"PowerSGD r={setup.powersgd_rank}": {"compress": "powersgd",
            "powersgd_rank": setup.powersgd_rank}}  # fmt: skip
    runs = {label: {**cluster_util.DIGITS_RUN, "paradigm": "ddp", **flags} for label, flags in runs.items()}
    accuracy, epochs = cluster_util.ACCURACY, cluster_util.DIGITS_EPOCHS

    def measure(cluster) -> dict:
        sizes, per_epoch = cluster_util.digits_workload()
        measured = cluster_util.to_accuracy(cluster, runs, sizes, per_epoch, epochs, accuracy, "ddp ring")
        base = measured["ddp ring"]
        say(f"(MLP {'-'.join(map(str, sizes))}, global batch {cluster_util.DIGITS_RUN['batch_size']} ({per_epoch}"
            f" steps an epoch), {epochs} epochs; epochs: to {100 * accuracy:g}% test accuracy; seconds: their"
            " training time, from metrics.json; model s: those epochs' steps x DataParallel.step_time, this"
            " machine's compute shared by all the cluster's ranks and the link's rate and latency, the compressors'"
            " own arithmetic left out as in section 5; step ms: training time a step, epochs 2 on)")  # fmt: skip
        faster = [f"{label} {terminal.speed(m['seconds'], base['seconds'], None)}" for label, m in measured.items()
                  if label != "ddp ring" and m["seconds"] and base["seconds"]]  # fmt: skip
        say("Bytes a rank sends a step (costs()): " + ", ".join(f"{label} {m['bytes_per_step']:,d}" for label, m
            in measured.items()) + f". At {rate_words(cluster.link)} the bytes are what a step waits for, not"
            " the latencies that decided section 5 on this machine's memory: a method that sends a fraction of ddp's"
            " bytes takes a fraction of its step (step ms), even where it needs an epoch or two more (epochs)."
            + (f" To {100 * accuracy:g}%: " + ", ".join(faster) + "." if faster else ""))  # fmt: skip
        return measured

    heading(f"6. Across a {rate_words(args.link)} link: ddp, top-k and PowerSGD, the time to {100 * accuracy:g}%"
            " test accuracy on a cluster")  # fmt: skip
    measured = cluster_part(args, setup.world, "13", measure)
    if setup.rank == 0:
        results["cluster"] = measured


def main() -> None:
    """The lesson: its arguments, then its six sections in order (each hands on what a later one compares with),
    then the exercises and the verdict."""
    args, setup = arguments()
    checks = Checks(setup.world)  # each claim checked on every rank, and printed: checks.ok(claim, flag)
    results = introduction(setup)
    average, trained_digest = section_1_why_a_gradient_compresses(setup, checks, results)
    runs = section_2_side_by_side(setup, trained_digest, checks, results)
    section_3_why_error_feedback(setup, runs, checks, results)
    section_4_fp16_against_bf16(average, checks, results)
    section_5_when_it_pays(setup, runs, checks, results)
    section_6_across_a_slow_link(args, setup, results)
    # the docstring's Exercises section, as it is (it keeps to 80 columns: it is printed)
    mpi.print0("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
    conclude(args.json, results, checks)


if __name__ == "__main__":
    main()

"""The training loop: data → model → loss → backward → optimizer step, with evaluation and metrics.

One step on one device::

    x, y   = next batch (this rank's shard of the global batch)
    logits = model(x)                                  forward: builds the autograd graph
    loss   = softmax_cross_entropy(logits, y)
    model.zero_grad(); loss.backward()                 gradients land in model.flat_grads
    optimizer.step()                                   updates model.flat_params in place

Distributed paradigms change what happens between ``backward`` and ``step`` (average the gradients, talk to a
parameter server, ...); the rest of this loop stays as it is.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from dataclasses import replace

import numpy as np

from dtrain import backend, checkpoint, faults, kernels, parallel, report, terminal
from dtrain.autograd import Tensor, no_grad, softmax_cross_entropy
from dtrain.collectives import shm_windows
from dtrain.comm.names import COMM_TYPE_SHARED
from dtrain.comm.prepare import layers, prepare
from dtrain.comm.staging import StagedComm
from dtrain.comm.trace import NOT_TRAINING, gather_events, write_chrome_trace
from dtrain.config import DEFAULT_BATCH, TrainConfig, default_batch
from dtrain.data import Dataset, ShardedLoader, load_dataset
from dtrain.errors import ConfigError, TrainingDiverged
from dtrain.nn import MLP
from dtrain.optim import make_optimizer

# On a GPU the driver reads the steps' losses this many at a time: reading one makes the CPU wait for the GPU to
# finish every kernel queued so far, so reading each step's would keep the CPU from queueing the next step's
# kernels while the GPU runs this one's. A run that diverges stops at most this many steps late.
LOSSES_READ_TOGETHER = 16


def train(config: TrainConfig, comm=None) -> dict:
    """Train as ``config`` says; return (and, with ``config.out``, write) the metrics dictionary.

    ``comm``: the world to train on (default ``MPI.COMM_WORLD``; a simulated one works too). The run prepares it
    once (:func:`dtrain.comm.prepare.prepare`: GPU staging, the tracer, the watchdog) and uses nothing else.
    """
    started = time.perf_counter()
    config.validate()
    kernels.check_environment()  # DTRAIN_KERNELS=numba without Numba: refused before any message, not mid-run
    kind = parallel.get(config.paradigm)
    xp = backend.get_xp(config.device)  # (a missing CuPy is reported before anything else happens)
    # Every rank's traffic is counted (bytes, messages, time per operation) and summarised into metrics.json.
    comm = prepare(comm, device=config.device, timeout=config.timeout, events=bool(config.trace))
    world, rank = comm.Get_size(), comm.Get_rank()
    planned = faults.from_env(world, config.checkpoint_dir, checkpoint_every=config.checkpoint_every)  # DTRAIN_FAULT
    if config.batch_size is None:
        config = replace(config, batch_size=default_batch(kind, config, world))
        if config.batch_size != DEFAULT_BATCH and rank == 0 and not config.quiet:
            print(terminal.paragraph(
                f"--batch-size {config.batch_size}: the size nearest the default {DEFAULT_BATCH} that --paradigm "
                f"{config.paradigm} splits evenly on {world} ranks (give --batch-size to choose another)",
                hanging="  "), flush=True)  # fmt: skip
    kind.check(config, world)  # the paradigm's own flags, before any rank talks to another
    check_same_config(comm, config)
    gpu = select_rank_gpu(comm) if config.device == "gpu" else None  # (before the first array is made on it)
    dtype = backend.resolve_dtype(config.dtype)

    data = dataset_of(config)
    # The loader checks the batch size against the training set and the world before anything else is built.
    index, count = kind.shard_of(rank, world, config)
    loader = ShardedLoader(data.x_train, data.y_train, config.batch_size, index, count, config.seed, xp)
    faults.check_reachable(planned, config.epochs * len(loader))
    sizes = [data.n_features, *config.hidden, data.n_classes]
    identity = checkpoint.identity(config, sizes, data)
    if world > 1 and config.device == "cpu":  # Numba's start-up now, not inside any paradigm's first timed step
        kernels.load(dtype)
    paradigm = kind(comm, config)
    paradigm.build(
        lambda: MLP(sizes, seed=config.seed, xp=xp, dtype=dtype),
        lambda model: make_optimizer(config.optimizer, model, config.lr, config.momentum, config.weight_decay),
    )
    setup = comm.tracer.summary()["totals"]  # what building sent (ddp's broadcast of rank 0's weights): not a step's
    position = checkpoint.resume(paradigm, comm, config, identity) if config.resume else checkpoint.Position()
    injector = faults.Injector(planned, rank, config.checkpoint_dir, start_step=position.step)
    epochs_run = Epochs(paradigm, loader, data, config, identity, position, xp, injector)
    try:
        paradigm.run(epochs_run)  # (a server: a loop of its own)
    finally:
        epochs_run.progress.close()
    injector.check_fired()
    epochs = position.epochs
    own_figures = paradigm.finish()
    if config.checkpoint_dir:  # the final state, so a later --resume with more --epochs goes on from here
        checkpoint.write(paradigm, config, identity, position, position.done, position.done_loss)

    wall = time.perf_counter() - started
    train_time = sum(e["train_time_s"] for e in epochs)
    metrics = {
        "config": config.as_dict(),
        "world_size": world,
        "model": {"sizes": sizes, "parameters": int(paradigm.full_parameters().size)},
        "dataset": data.describe(),
        "epochs": epochs,
        "final": {k: epochs[-1][k] for k in ("train_loss", "test_loss", "test_accuracy")} if epochs else {},
        "samples_per_s": len(epochs) * len(loader) * config.batch_size / train_time if train_time else 0.0,
        "wall_time_s": wall,
        "weights_sha256": backend.weights_digest(paradigm.full_parameters()),
        "environment": report.environment(),
        "costs": kind.costs(sizes, world, resolved(config, own_figures)),
    }
    if (attempts := faults.attempts()) is not None:  # started by dtrain launch --max-restarts: the failures before
        metrics["restarts"] = attempts
    mine = {**comm.tracer.summary(), "paradigm": own_figures, "train_time_s": train_time,
            "setup": {k: setup[k] for k in ("bytes_sent", "messages_sent", "time_s")}}  # fmt: skip
    totals = mine["totals"]
    # time in communication operations, their waits included (a server's reply, a slower rank); not evaluation's, and
    # not the build's (ddp's first broadcast waits for every rank to start: on a busy machine, longer than training)
    outside = setup["time_s"] + sum(mine["operations"].get(label, {}).get("time_s", 0.0) for label in NOT_TRAINING)
    mine["comm_time_s"] = totals["time_s"] - outside
    mine["compute_time_s"] = max(0.0, train_time - mine["comm_time_s"])
    metrics["communication"] = {
        "layers": [type(layer).__name__ for layer in layers(comm)],
        "per_rank": comm.gather(mine, root=0),
    }
    if gpu is not None:
        metrics["gpu"] = {**gpu, "staging": comm.gather(staging_figures(comm), root=0)}
    if config.trace:
        events = gather_events(comm.tracer, comm)
        if rank == 0:
            write_chrome_trace(config.trace, events)
    if config.out and rank == 0:
        report.write_metrics(config.out, metrics)
    shm_windows.release_mine()  # the shared windows (after everything that reads the buffers in them)
    comm.free_made()  # the paradigm's sub-communicators (after the final checkpoint, which may gather over them)
    return metrics


def resolved(config: TrainConfig, figures: dict) -> TrainConfig:
    """``config`` with ``--allreduce auto`` replaced by what the paradigm chose at run time (it may take shared memory
    on a real node, which the cost functions, told only "auto", cannot know): the costs of what ran."""
    chosen = figures.get("allreduce")
    if config.allreduce == "auto" and isinstance(chosen, str) and chosen in ("shm", "hierarchical_shm"):
        return replace(config, allreduce=chosen)
    return config


def dataset_of(config: TrainConfig) -> Dataset:
    """The dataset ``config`` names, as this run reads it."""
    dtype = backend.resolve_dtype(config.dtype)
    return load_dataset(config.dataset, config.data_dir, samples=config.samples, features=config.features,
                        classes=config.classes, seed=config.seed, dtype=dtype)  # fmt: skip


def select_rank_gpu(comm) -> dict:
    """Give this rank GPU ``local rank % GPUs`` (:func:`dtrain.backend.select_gpu`); the local rank is its place
    among the ranks that share its machine's memory (MPI's ``COMM_TYPE_SHARED``), whatever launched them."""
    node = comm.Split_type(COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    return {**backend.select_gpu(local_rank), "local_rank": local_rank, "ranks_on_node": local_size}


def staging_figures(comm) -> dict:
    """This rank's GPU staging: whether MPI took device buffers as they were (and why), the bytes copied each way
    through pinned host memory and the seconds those copies took (the stream synchronisations before them too)."""
    staged = next((c for c in layers(comm) if isinstance(c, StagedComm)), None)
    if staged is None:
        return {}
    return {"cuda_aware": staged.cuda_aware, "why": staged.cuda_aware_reason,
            "bytes_to_host": staged.staged_bytes_to_host, "bytes_to_device": staged.staged_bytes_to_device,
            "seconds": staged.staging_seconds, "pinned_bytes": staged.pinned_bytes_allocated}  # fmt: skip


class Epochs:
    """The driver's loop over epochs on a rank that trains on batches: each epoch's steps, the global loss, evaluation,
    checkpoints, with ``position`` kept current. A paradigm's :meth:`~dtrain.parallel.Paradigm.run` calls
    :meth:`run`; a rank with a loop of its own reads :attr:`steps_per_epoch` instead."""

    def __init__(self, paradigm, loader, data, config, identity, position, xp, injector=None):
        self.paradigm, self.loader, self.data, self.config = paradigm, loader, data, config
        self.identity, self.position, self.xp = identity, position, xp
        self.steps_per_epoch = len(loader)
        # the first epoch's steps done before a resume (for a loop of its own); a checkpoint written at an epoch's last
        # step leaves that epoch with nothing to run, and the next starts from 0
        self.resumed_steps = position.done if position.done < len(loader) else 0
        self.injector = injector or faults.Injector(None, paradigm.rank)
        self.checkpoint_every = config.checkpoint_every  # the driver's checkpoints (0: a paradigm writes its own)
        self.progress = faults.ProgressMark(paradigm.rank)  # (for a launcher that restarts the job: steps lost)

    def run(self) -> None:
        paradigm, loader, config, position = self.paradigm, self.loader, self.config, self.position
        show = config.progress and not config.quiet and paradigm.rank == 0
        for epoch in range(position.epoch, config.epochs + 1):
            position.epoch = epoch
            self.epoch_start = epoch_start = time.perf_counter() - position.train_time_s
            losses = []  # this rank's loss of each step it runs of this epoch
            unread = []  # losses still on the GPU (on the CPU each is read at once)
            read_every = 1 if self.xp is np else LOSSES_READ_TOGETHER
            # resuming: the steps already done are skipped
            steps = paradigm.epoch(EpochBatches(loader, epoch, position.done))
            for loss in terminal.progress(steps, len(loader) - position.done, f"epoch {epoch}/{config.epochs}", show):
                unread.append(loss)
                position.step += 1
                self.progress.at_step(position.step)
                self.injector.at_step(position.step)  # DTRAIN_FAULT: this rank may die here, on purpose
                checkpoint_now = self.checkpoint_every and position.step % self.checkpoint_every == 0
                if len(unread) >= read_every or checkpoint_now:
                    self.read(unread, losses, epoch)
                if checkpoint_now:
                    position.train_time_s = time.perf_counter() - epoch_start
                    done_loss = epoch_loss(paradigm, position, losses)  # (a collective, before the write's gathers)
                    checkpoint.write(paradigm, config, self.identity, position, position.done + len(losses), done_loss,
                                     during_write=self.injector.during_write(position.step))  # fmt: skip
            self.read(unread, losses, epoch)
            train_loss = epoch_loss(paradigm, position, losses)  # (a collective: every trainer has ended the epoch)
            train_time = time.perf_counter() - epoch_start
            test_loss, test_accuracy = evaluate(paradigm.evaluation_model(), self.data, self.xp)
            position.epochs.append(
                {
                    "epoch": epoch,
                    "train_loss": train_loss,  # the global batch's, averaged over steps
                    "test_loss": test_loss,
                    "test_accuracy": test_accuracy,
                    "samples_per_s": len(loader) * config.batch_size / train_time,  # an epoch: every sample once
                    "train_time_s": train_time,
                }
            )
            position.epoch, position.done, position.done_loss, position.train_time_s = epoch + 1, 0, 0.0, 0.0
            if paradigm.rank == 0 and not config.quiet:
                e = position.epochs[-1]
                print(
                    f"epoch {epoch:3d}/{config.epochs}  loss {e['train_loss']:.4f}  test loss {e['test_loss']:.4f}  "
                    f"test acc {100 * e['test_accuracy']:6.2f}%  {e['samples_per_s']:,.0f} samples/s",
                    flush=True,
                )

    def time_in_epoch(self) -> float:
        """The train time of the epoch so far (a checkpoint in its middle records it)."""
        return time.perf_counter() - self.epoch_start

    def write_snapshot(self, params, optimizer_state: dict, where: dict, snapshot: dict, arrays: dict) -> None:
        """Rank 0 of a paradigm that takes its own checkpoints (consistent snapshots) writes one through here."""
        during_write = self.injector.during_write(where["global_step"])
        checkpoint.write_state(self.config, self.identity, self.paradigm.world, where, params, optimizer_state,
                               snapshot, arrays, during_write)  # fmt: skip

    def read(self, unread: list, losses: list, epoch: int) -> None:
        """Move the ``unread`` losses into ``losses`` as Python floats (GPU ones in one copy), stopping a run whose
        loss is no longer finite."""
        first = self.position.done + len(losses)  # the epoch's steps before the first unread one
        for i, loss in enumerate(backend.read_losses(unread)):
            if not math.isfinite(loss):
                lr = self.config.lr
                raise TrainingDiverged(
                    f"the loss became {loss} at epoch {epoch}, step {first + i + 1}: training diverged; lower the "
                    f"learning rate (--lr {lr:g} → try {lr / 10:g})"
                )
            losses.append(loss)
        unread.clear()


class EpochBatches:
    """This rank's slices of one epoch's global batches, from the ``skip``-th on; iterating again starts again (an
    asynchronous worker goes round its slices until its paradigm says the epoch is over)."""

    def __init__(self, loader, epoch: int, skip: int = 0):
        self.loader, self.epoch, self.skip = loader, epoch, skip

    def __iter__(self):
        return itertools.islice(self.loader.epoch(self.epoch), self.skip, None)

    def __len__(self) -> int:
        return len(self.loader) - self.skip


def epoch_loss(paradigm, position, losses) -> float:
    """The global batch's loss averaged over the epoch's steps: those before a resume (``position.done``, already
    global) and this rank's ``losses`` since, made global by the paradigm (a collective; also with no losses when
    no steps are behind: a parameter-server worker resumed where its epoch was over keeps its own)."""
    if not losses and position.done:
        return position.done_loss
    new = paradigm.global_loss(float(np.mean(losses)) if losses else 0.0)
    if not position.done:
        return new
    return (position.done_loss * position.done + new * len(losses)) / (position.done + len(losses))


def check_same_config(comm, config: TrainConfig) -> None:
    """Every rank hashes its configuration; ranks started with different flags get one clear error, on every rank."""
    mine = hashlib.sha256(json.dumps(config.as_dict(), sort_keys=True, default=str).encode()).hexdigest()
    digests = comm.allgather(mine)
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise ConfigError(
            f"the ranks were started with different flags: rank(s) {odd} differ from rank 0; launch every rank with "
            f"the same command line"
        )


def evaluate(model, data: Dataset, xp, batch: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on the test split."""
    total_loss, correct, n = 0.0, 0, len(data.y_test)
    with no_grad():
        for start in range(0, n, batch):
            x = xp.asarray(data.x_test[start : start + batch])
            y = xp.asarray(data.y_test[start : start + batch])
            logits = model(Tensor(x))
            total_loss += float(softmax_cross_entropy(logits, y).data) * len(y)
            correct += int((logits.data.argmax(axis=1) == y).sum())
    return total_loss / n, correct / n

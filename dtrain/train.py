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

import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dtrain import backend, report
from dtrain.autograd import Tensor, no_grad, softmax_cross_entropy
from dtrain.comm.trace import TracedComm, Tracer, gather_events, gather_summaries, write_chrome_trace
from dtrain.data import DATASETS, Dataset, ShardedLoader, load_dataset
from dtrain.errors import ConfigError, TrainingDiverged
from dtrain.nn import MLP
from dtrain.optim import OPTIMIZERS, make_optimizer

PARADIGMS = ("single",)


@dataclass
class TrainConfig:
    paradigm: str = "single"
    dataset: str = "digits"
    data_dir: str | None = None
    samples: int = 10000  # synthetic/spirals only
    features: int = 784  # synthetic only
    classes: int = 10  # synthetic/spirals only
    epochs: int = 20
    batch_size: int = 64  # the global batch, split evenly over the ranks
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    hidden: tuple[int, ...] = (128, 128)
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    out: str | None = None
    trace: str | None = None  # write a Chrome/Perfetto trace of every rank's communication here
    progress: bool = True  # rank 0's progress bar
    quiet: bool = False  # no per-epoch summary lines

    def validate(self) -> None:
        """Check every value before any data is read or any rank talks to another."""
        choices = {
            "paradigm": PARADIGMS,
            "dataset": DATASETS,
            "optimizer": tuple(OPTIMIZERS),
            "device": backend.DEVICES,
            "dtype": tuple(backend.DTYPES),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} {getattr(self, name)!r} is not one of: {', '.join(allowed)}")
        positive = {
            "epochs": self.epochs,
            "batch-size": self.batch_size,
            "samples": self.samples,
            "features": self.features,
            "classes": self.classes,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"--{name} must be >= 1, got {value}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.weight_decay < math.inf:  # also refuses NaN
            raise ConfigError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out} is a file; give a folder (metrics.json is written inside it)")
        if self.trace is not None and Path(self.trace).is_dir():
            raise ConfigError(f"--trace {self.trace} is a folder; give a file name such as trace.json")
        if any(h < 1 for h in self.hidden):
            raise ConfigError(f"--hidden sizes must be >= 1, got {','.join(map(str, self.hidden))}")


def train(config: TrainConfig, comm=None) -> dict:
    """Train as ``config`` says; return (and, with ``config.out``, write) the metrics dictionary."""
    started = time.perf_counter()
    config.validate()
    world, rank = (comm.Get_size(), comm.Get_rank()) if comm is not None else (1, 0)
    if config.paradigm == "single" and world != 1:
        raise ConfigError(
            f"--paradigm single trains on one rank, but {world} were launched; "
            f"run without mpiexec or choose a distributed paradigm"
        )
    # Every rank's traffic is counted (bytes, messages, time per operation) and summarised into metrics.json.
    tracer = Tracer(rank)
    if comm is not None:
        comm = TracedComm(comm, tracer)
    xp = backend.get_xp(config.device)
    dtype = backend.resolve_dtype(config.dtype)

    data = load_dataset(
        config.dataset,
        config.data_dir,
        samples=config.samples,
        features=config.features,
        classes=config.classes,
        seed=config.seed,
        dtype=dtype,
    )
    # The loader checks the batch size against the training set and the world before anything else is built.
    loader = ShardedLoader(data.x_train, data.y_train, config.batch_size, rank, world, config.seed, xp)
    model = MLP([data.n_features, *config.hidden, data.n_classes], seed=config.seed, xp=xp, dtype=dtype)
    optimizer = make_optimizer(config.optimizer, model, config.lr, config.momentum, config.weight_decay)

    show = config.progress and not config.quiet and rank == 0
    epochs = []
    for epoch in range(1, config.epochs + 1):
        epoch_start = time.perf_counter()
        losses = []
        for x, y in _progress(loader.epoch(epoch), len(loader), f"epoch {epoch}/{config.epochs}", show):
            model.zero_grad()
            loss = softmax_cross_entropy(model(Tensor(x)), y)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.data))
            if not math.isfinite(losses[-1]):
                raise TrainingDiverged(
                    f"the loss became {losses[-1]} at epoch {epoch}, step {len(losses)}: training diverged; "
                    f"lower the learning rate (--lr {config.lr:g} → try {config.lr / 10:g})"
                )
        train_time = time.perf_counter() - epoch_start
        test_loss, test_accuracy = evaluate(model, data, xp)
        epochs.append(
            {
                "epoch": epoch,
                "train_loss": float(np.mean(losses)),
                "test_loss": test_loss,
                "test_accuracy": test_accuracy,
                "samples_per_s": len(losses) * config.batch_size / train_time,
                "train_time_s": train_time,
            }
        )
        if rank == 0 and not config.quiet:
            e = epochs[-1]
            print(
                f"epoch {epoch:3d}/{config.epochs}  loss {e['train_loss']:.4f}  test loss {test_loss:.4f}  "
                f"test acc {100 * test_accuracy:6.2f}%  {e['samples_per_s']:,.0f} samples/s",
                flush=True,
            )

    wall = time.perf_counter() - started
    metrics = {
        "config": {**asdict(config), "hidden": list(config.hidden)},
        "world_size": world,
        "model": {"sizes": model.sizes, "parameters": model.num_parameters()},
        "dataset": data.describe(),
        "epochs": epochs,
        "final": {
            "train_loss": epochs[-1]["train_loss"],
            "test_loss": epochs[-1]["test_loss"],
            "test_accuracy": epochs[-1]["test_accuracy"],
        },
        "samples_per_s": len(epochs) * len(loader) * config.batch_size / sum(e["train_time_s"] for e in epochs),
        "wall_time_s": wall,
        "weights_sha256": report.weights_digest(model.flat_params),
        "environment": report.environment(),
    }
    metrics["communication"] = {"per_rank": gather_summaries(tracer, comm) if comm is not None else [tracer.summary()]}
    if config.trace:
        events = gather_events(tracer, comm) if comm is not None else [tracer.events]
        if rank == 0:
            write_chrome_trace(config.trace, events)
    if config.out and rank == 0:
        report.write_metrics(config.out, metrics)
    return metrics


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


def _progress(iterable, total: int, desc: str, show: bool):
    if not show or not sys.stderr.isatty():  # a bar is for a person at a terminal, not for a log or a pipe
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)

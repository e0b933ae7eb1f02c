"""Checkpoints: everything needed to go on training as if nothing had stopped, in one file any paradigm can read.

A checkpoint is one ``.npz`` file holding the **full flat parameter buffer** (whatever the paradigm: a sharded one
gathers it first), the optimizer's state (its flat buffers: momentum, Adam's m and v, and its step count), where
training stood (epoch, steps done in it, global step) and how the data were being drawn (the seed: each epoch's
shuffle is drawn from ``(seed, epoch)``, so the position is the whole data-order state), plus the metrics of the
epochs already done. The optimizer's learning rate is stored but not restored: the resumed run's ``--lr`` applies.
A small JSON header says which model, dataset, dtype, optimizer and paradigm wrote it; a model, dataset, dtype or
optimizer that differ are refused with a clear message instead of loading nonsense, and another paradigm's checkpoint
is resumed (a ZeRO run's by ddp, a ddp run's by single).

**Written atomically.** Rank 0 writes ``checkpoint.npz.tmp``, flushes it to the disk (``fsync``), renames it over
``checkpoint.npz`` (a rename within a folder is atomic on POSIX) and fsyncs the folder: a crash at any moment leaves
either the previous checkpoint or the new one, never half of one.

**Read once, by rank 0,** which checks it and broadcasts it (or the reason it cannot be used) to every rank, so all
ranks fail with the same one-line error, and no rank needs the file on its own disk.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtrain import backend, terminal
from dtrain.backend import to_host
from dtrain.errors import ConfigError
from dtrain.optim import buffer_names

FORMAT = "dtrain.checkpoint/1"
FILENAME = "checkpoint.npz"


_DAMAGED = (
    "--resume: {path} is damaged or not a dtrain checkpoint: give --checkpoint-dir a folder with a checkpoint "
    "written by dtrain, or train without --resume to start afresh"
)


class CheckpointError(ConfigError):
    """A checkpoint that is missing, damaged, or written for another model, dtype or optimizer."""


def path_in(folder) -> Path:
    return Path(folder) / FILENAME


def save(folder, params, optimizer_state: dict, meta: dict, during_write=None) -> Path:
    """Write the checkpoint atomically (see the module docstring); return its path.

    ``during_write``: called with half of the temporary file on the disk (the fault injector's ``checkpoint``
    fault, :mod:`dtrain.faults`, kills the rank there, to show that the previous checkpoint survives)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"params": to_host(params)}
    scalars = {}
    for name, value in optimizer_state.items():
        if isinstance(value, np.ndarray):
            arrays[f"optimizer.{name}"] = value
        else:
            scalars[name] = value
    header = {"format": FORMAT, **meta, "optimizer_scalars": scalars}
    buffer = io.BytesIO()
    np.savez(buffer, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
    final = path_in(folder)
    tmp = final.with_name(FILENAME + ".tmp")
    data = buffer.getbuffer()
    with open(tmp, "wb") as f:
        if during_write is not None:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            during_write()
        f.write(data[f.tell() :])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself reaches the disk
    finally:
        os.close(directory)
    return final


def load(folder) -> dict:
    """``{"meta", "params", "optimizer"}`` from the checkpoint in ``folder``, or a :class:`CheckpointError`."""
    path = path_in(folder)
    if not path.exists():
        raise CheckpointError(f"--resume: no checkpoint in {folder} (expected {path}); train without --resume first")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(data["header"].tobytes().decode())
            params = data["params"]
            optimizer = {k.split(".", 1)[1]: data[k] for k in data.files if k.startswith("optimizer.")}
            optimizer.update(header.pop("optimizer_scalars"))
    except OSError as exc:
        if exc.errno is not None:  # the disk or the permissions, not the content
            raise CheckpointError(f"--resume: cannot read {path}: {exc.strerror}") from None
        raise CheckpointError(_DAMAGED.format(path=path)) from None
    except (ValueError, KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError):
        # Not NumPy's own message: for a file holding pickled objects it advises loading them, which would run
        # whatever code the file carries. A checkpoint never holds pickles, so this one is simply not ours.
        raise CheckpointError(_DAMAGED.format(path=path)) from None
    if header.get("format") != FORMAT:
        raise CheckpointError(f"--resume: {path} is not a {FORMAT} file (format {header.get('format')!r})")
    return {"meta": header, "params": params, "optimizer": optimizer}


def check_compatible(meta: dict, expected: dict, path) -> None:
    """Refuse a checkpoint whose model, dataset, dtype or optimizer differ from this run's, naming the difference.
    (Another paradigm's is welcome: every paradigm writes the same full flat buffers.)"""
    for key, flag in (("sizes", "model sizes"), ("dataset", "--dataset"), ("dtype", "--dtype"),
                      ("optimizer", "--optimizer"),
                      ("optimizer_buffers", "optimizer state (--momentum 0 keeps none)")):  # fmt: skip
        if key == "dataset" and key not in meta:  # (written before checkpoints named their data)
            continue
        theirs, ours = meta.get(key), expected[key]
        if theirs != ours:
            if isinstance(theirs, dict) and isinstance(ours, dict):  # the dataset: name only what differs
                differ = [k for k in ours if theirs.get(k) != ours[k]]
                theirs = ", ".join(f"{k} {theirs.get(k)}" for k in differ)
                ours = ", ".join(f"{k} {ours[k]}" for k in differ)
            raise CheckpointError(
                f"--resume: {path} was written with {flag} {theirs}, this run has {ours}; "
                f"resume with the same settings, or start afresh without --resume"
            )


def check_position(meta: dict, config, path) -> None:
    """Refuse to resume where the run could not go on from the checkpoint's position without repeating steps."""
    if meta["epoch"] > config.epochs + 1:
        raise CheckpointError(
            f"--resume: {path} has trained {meta['epoch'] - 1} epoch(s), more than --epochs {config.epochs}; "
            f"give --epochs {meta['epoch'] - 1} or more"
        )
    if meta["done"] and meta["batch_size"] != config.batch_size:
        raise CheckpointError(
            f"--resume: {path} stopped in the middle of epoch {meta['epoch']} with --batch-size {meta['batch_size']}; "
            f"go on with --batch-size {meta['batch_size']} (another size may start at the next epoch's checkpoint)"
        )


# --- a run's checkpoint: where training stands, written by rank 0 and read back on every rank ---------------------
@dataclass
class Position:
    """Where training stands: the epoch to run next, global steps done, the epochs' metrics so far, and, inside a
    half-done epoch, its steps done, their global mean loss and its train time so far."""

    epoch: int = 1
    step: int = 0
    epochs: list = field(default_factory=list)
    done: int = 0
    done_loss: float = 0.0
    train_time_s: float = 0.0


def identity(config, sizes, data) -> dict:
    """What a checkpoint records of the run that wrote it, and what a run that resumes it must share: the model's
    sizes, the dataset (its name, splits and shape), dtype, optimizer and the optimizer's buffers."""
    return {"sizes": list(sizes), "dataset": data.describe(), "dtype": config.dtype, "optimizer": config.optimizer,
            "optimizer_buffers": buffer_names(config.optimizer, config.momentum)}  # fmt: skip


def write(paradigm, config, identity: dict, position: Position, done: int, done_loss: float, during_write=None) -> None:
    """Rank 0 writes where training stands: ``position``, with ``done`` steps of the current epoch behind it and
    ``done_loss`` their global mean loss (a collective: a sharded paradigm gathers its parameters first).
    ``during_write``: see :func:`save`."""
    params, optimizer_state = paradigm.full_parameters(), paradigm.optimizer_state()
    if paradigm.rank != 0:
        return
    meta = {
        "paradigm": config.paradigm,
        **identity,
        "optimizer_buffers": sorted(k for k, v in optimizer_state.items() if isinstance(v, np.ndarray)),  # (held)
        "world_size": paradigm.world,
        "seed": config.seed,
        "batch_size": config.batch_size,
        "epoch": position.epoch,
        "done": done,
        "done_loss": done_loss,
        "global_step": position.step,
        "train_time_s": position.train_time_s,
        "epochs": position.epochs,
    }
    save(config.checkpoint_dir, params, optimizer_state, meta, during_write)


def resume(paradigm, comm, config, identity: dict) -> Position:
    """Load the checkpoint on rank 0, broadcast it (or its error) to every rank, and put the paradigm back in it.

    The optimizer's state comes back, but not its learning rate: ``--lr`` of this run applies from here on (so a run
    that diverged can go on from its last checkpoint with a smaller one).
    """
    state, error = None, None
    if comm.Get_rank() == 0:
        try:
            state = load(config.checkpoint_dir)
            path = path_in(config.checkpoint_dir)
            check_compatible(state["meta"], identity, path)
            check_position(state["meta"], config, path)
        except CheckpointError as exc:
            state, error = None, str(exc)
    state, error = comm.bcast((state, error), root=0)
    if error is not None:
        raise CheckpointError(error)
    meta = state["meta"]
    flat = backend.to_device(state["params"], backend.get_xp(config.device))
    paradigm.load(flat, {**state["optimizer"], "lr": config.lr})
    if meta["world_size"] != comm.Get_size() and comm.Get_rank() == 0:
        print(terminal.paragraph(
            f"resuming a checkpoint written by {meta['world_size']} rank(s) on {comm.Get_size()}: every global batch "
            f"is the same, but it is split differently across ranks, so results will not be bit-identical to an "
            f"uninterrupted run on {meta['world_size']}", hanging="  "), flush=True)  # fmt: skip
    if meta["paradigm"] != config.paradigm and comm.Get_rank() == 0:
        print(terminal.paragraph(f"resuming a checkpoint written by --paradigm {meta['paradigm']} with "
                                 f"{config.paradigm}", hanging="  "), flush=True)  # fmt: skip
    if meta["seed"] != config.seed and comm.Get_rank() == 0:
        print("resuming with another --seed: the data order from here on changes", flush=True)
    return Position(meta["epoch"], meta["global_step"], meta["epochs"], meta["done"], meta["done_loss"],
                    meta["train_time_s"])  # fmt: skip

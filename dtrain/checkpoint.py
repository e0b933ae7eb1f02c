"""Checkpoints: everything needed to go on training as if nothing had stopped, in one file any paradigm can read.

A checkpoint is one ``.npz`` file holding the **full flat parameter buffer** (whatever the paradigm: a sharded one
gathers it first), the optimizer's state (its flat buffers: momentum, Adam's m and v, and its step count), where
training stood (epoch, steps done in it, global step) and how the data were being drawn (the seed: each epoch's
shuffle is drawn from ``(seed, epoch)``, so the position is the whole data-order state), plus the metrics of the
epochs already done. The optimizer's learning rate is stored but not restored: the resumed run's ``--lr`` applies.
A small JSON header says which model, dataset, dtype, optimizer and paradigm wrote it; a model, dataset, dtype or
optimizer that differ are refused with a clear message instead of loading nonsense, and another paradigm's checkpoint
is resumed (a ZeRO run's by ddp, a ddp run's by single).

**Written atomically, straight into the file.** Rank 0 writes ``checkpoint.npz.tmp`` from the arrays' own memory
(no copy of the file is assembled in memory first: see "the .npz, written straight into the file" below), flushes it
to the disk (``fsync``), renames it over ``checkpoint.npz`` (a rename within a folder is atomic on POSIX) and fsyncs
the folder: a crash at any moment leaves either the previous checkpoint or the new one, never half of one. (A write
that fails removes its temporary file; a killed one leaves it, and the next write replaces it.)

**Read once, by rank 0,** which checks it and broadcasts it (or the reason it cannot be used) to every rank, so all
ranks fail with the same one-line error, and no rank needs the file on its own disk.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
import zlib
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


# --- the .npz, written straight into the file -----------------------------------------------------------------------
# An .npz is a zip archive of .npy files, stored (not compressed). :func:`save` writes it itself rather than through
# :mod:`zipfile` (whose writer goes back to each member's header to put its CRC-32 there, through a buffered file,
# in many small writes): the CRCs are computed first, then the headers and the arrays' own memory go to the kernel
# in one ``os.writev`` (no copy made in Python). The records are those numpy.savez writes (zip64, as its
# ``force_zip64``), described in the zip specification (PKWARE's APPNOTE.TXT), sections 4.3.7 (local file header),
# 4.3.12 (central directory header), 4.3.14 to 4.3.16 (the zip64 end of the central directory, its locator, the
# end) and 4.5.3 (the zip64 extra field). (A thread computing the CRCs while the bytes were written made a 100 MB
# write about 1.1x faster, but 4 writes of 10 MB in 9 2-4x slower on a 2-core machine: docs/benchmarks.md.)
_LOCAL = struct.Struct("<4s2B4HL2L2H")  # signature, version needed, (0), flags, method, time, date, crc, sizes, lengths
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # ... as local, + version made by, comment, disk, attributes, offset
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_END = struct.Struct("<4s4H2LH")
_IN_ZIP64 = 0xFFFFFFFF  # a 32-bit size or offset field: "read it from the zip64 extra field"
_ZIP64_VERSION = 45  # version 4.5 of the specification: zip64
_WHEN = (0, 1 << 5 | 1)  # the members' time and date, MS-DOS style: 1 January 1980, 00:00 (as zipfile's, so as savez's)


def _local_header(name: bytes, size: int, crc: int) -> bytes:
    """A member's local file header: its sizes in the zip64 extra field (stored: the same size twice)."""
    extra = struct.pack("<2H2Q", 1, 16, size, size)
    fields = (_ZIP64_VERSION, 0, 0, zipfile.ZIP_STORED, *_WHEN, crc, _IN_ZIP64, _IN_ZIP64, len(name), len(extra))
    return _LOCAL.pack(b"PK\x03\x04", *fields) + name + extra


def _central_header(name: bytes, size: int, crc: int, offset: int) -> bytes:
    """A member's entry in the central directory (made on Unix, mode rw-------, as zipfile writes it)."""
    extra = struct.pack("<2H3Q", 1, 24, size, size, offset)
    made, needed = (_ZIP64_VERSION, 3), (_ZIP64_VERSION, 0)  # (3: Unix)
    fields = (0, zipfile.ZIP_STORED, *_WHEN, crc, _IN_ZIP64, _IN_ZIP64, len(name), len(extra), 0, 0, 0, 0o600 << 16)
    return _CENTRAL.pack(b"PK\x01\x02", *made, *needed, *fields, _IN_ZIP64) + name + extra


def _end_records(count: int, directory_at: int, directory_size: int) -> bytes:
    """The zip64 end of the central directory, its locator, and the end record that points to them."""
    versions, counts = (_ZIP64_VERSION, _ZIP64_VERSION), (count, count)
    zip64_end = _ZIP64_END.pack(b"PK\x06\x06", _ZIP64_END.size - 12, *versions, 0, 0, *counts, directory_size,
                                directory_at)  # fmt: skip
    locator = _ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, directory_at + directory_size, 1)
    few = min(count, 0xFFFF)
    return zip64_end + locator + _END.pack(b"PK\x05\x06", 0, 0, few, few, _IN_ZIP64, _IN_ZIP64, 0)


def _write_all(fd: int, pieces: list) -> None:
    """Write ``pieces`` (bytes or memoryviews) one after the other at the file's position, however many calls it
    takes (a ``writev`` may write less than it was given, and takes at most 1024 pieces)."""
    pieces = [piece for piece in pieces if len(piece)]
    while pieces:
        written = os.writev(fd, pieces[:1024])
        while pieces and written >= len(pieces[0]):
            written -= len(pieces.pop(0))
        if written:
            pieces[0] = memoryview(pieces[0])[written:]


def _split(pieces: list, at: int) -> tuple[list, list]:
    """``pieces`` cut at byte ``at``: those before it and those after (a piece across it in two)."""
    for i, piece in enumerate(pieces):
        if at <= len(piece):
            return [*pieces[:i], memoryview(piece)[:at]], [memoryview(piece)[at:], *pieces[i + 1 :]]
        at -= len(piece)
    return pieces, []


def _write_npz(fd: int, arrays: dict, during_write=None) -> None:
    """Write ``arrays`` as an .npz (see the comment above) into the empty file ``fd``: each one's member is the file
    :func:`numpy.save` writes, its .npy header then its bytes, a view of the array's own memory. ``during_write``:
    see :func:`save`."""
    pieces, directory, at = [], [], 0
    for name, array in arrays.items():
        array = array if array.flags.c_contiguous else array.copy(order="C")  # (not ascontiguousarray: keeps 0-d)
        npy = io.BytesIO()
        np.lib.format.write_array_header_1_0(npy, np.lib.format.header_data_from_array_1_0(array))
        header, data, name = npy.getvalue(), memoryview(array.reshape(-1).view(np.uint8)), f"{name}.npy".encode()
        size, crc = len(header) + len(data), zlib.crc32(data, zlib.crc32(header))
        local = _local_header(name, size, crc)
        pieces += [local, header, data]
        directory.append(_central_header(name, size, crc, at))
        at += len(local) + size
    directory = b"".join(directory)
    pieces += [directory, _end_records(len(arrays), at, len(directory))]
    if during_write is not None:
        before, pieces = _split(pieces, sum(len(piece) for piece in pieces) // 2)
        _write_all(fd, before)
        os.fsync(fd)
        during_write()
    _write_all(fd, pieces)


def save(folder, params, optimizer_state: dict, meta: dict, during_write=None, arrays=None) -> Path:
    """Write the checkpoint atomically (see the module docstring); return its path.

    The arrays go from their own memory straight into the temporary file (:func:`_write_npz`: the .npz that
    :func:`numpy.savez` would write, with no copy of it in memory).

    ``during_write``: called with half of the temporary file on the disk (the fault injector's ``checkpoint``
    fault, :mod:`dtrain.faults`, kills the rank there, to show that the previous checkpoint survives)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"params": to_host(params), **{name: to_host(a) for name, a in (arrays or {}).items()}}  # (a paradigm's)
    scalars = {}
    for name, value in optimizer_state.items():
        if isinstance(value, np.ndarray):
            arrays[f"optimizer.{name}"] = value
        else:
            scalars[name] = value
    header = {"format": FORMAT, **meta, "optimizer_scalars": scalars}
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays}
    final = path_in(folder)
    tmp = final.with_name(FILENAME + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            _write_npz(fd, arrays, during_write)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself reaches the disk
    finally:
        os.close(directory)
    return final


def load(folder) -> dict:
    """``{"meta", "params", "optimizer", "arrays"}`` from the checkpoint in ``folder`` (``arrays``: a paradigm's own,
    beside the flat buffers), or a :class:`CheckpointError`."""
    path = path_in(folder)
    if not path.exists():
        raise CheckpointError(f"--resume: no checkpoint in {folder} (expected {path}); train without --resume first")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(data["header"].tobytes().decode())
            params = data["params"]
            optimizer = {k.split(".", 1)[1]: data[k] for k in data.files if k.startswith("optimizer.")}
            optimizer.update(header.pop("optimizer_scalars"))
            arrays = {k: data[k] for k in data.files
                      if k not in ("header", "params") and not k.startswith("optimizer.")}  # fmt: skip
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
    return {"meta": header, "params": params, "optimizer": optimizer, "arrays": arrays}


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
    where = {"epoch": position.epoch, "done": done, "done_loss": done_loss, "global_step": position.step,
             "train_time_s": position.train_time_s, "epochs": position.epochs}  # fmt: skip
    write_state(config, identity, paradigm.world, where, params, optimizer_state, during_write=during_write)


def write_state(config, identity: dict, world: int, where: dict, params, optimizer_state: dict, snapshot=None,
                arrays=None, during_write=None) -> None:  # fmt: skip
    """Rank 0 writes a checkpoint from its parts: ``where`` training stands (epoch, done, done_loss, global_step,
    train_time_s, epochs), the full flat buffers, and a paradigm's ``snapshot`` of its own with its ``arrays``
    (the parameter servers' consistent cut: :mod:`dtrain.parallel.ps_snapshot`)."""
    meta = {
        "paradigm": config.paradigm,
        **identity,
        "optimizer_buffers": sorted(k for k, v in optimizer_state.items() if isinstance(v, np.ndarray)),  # (held)
        "world_size": world,
        "seed": config.seed,
        "batch_size": config.batch_size,
        **where,
        **({"snapshot": snapshot} if snapshot is not None else {}),
    }
    save(config.checkpoint_dir, params, optimizer_state, meta, during_write, arrays=arrays)


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
    position = Position(meta["epoch"], meta["global_step"], meta["epochs"], meta["done"], meta["done_loss"],
                        meta["train_time_s"])  # fmt: skip
    snapshot = meta.get("snapshot")
    if snapshot is not None and not paradigm.restore_snapshot(snapshot, state["arrays"], position):
        if comm.Get_rank() == 0:
            print(terminal.paragraph(
                f"resuming a snapshot of {meta['paradigm']} taken on {snapshot['layout'][0]} worker(s) and "
                f"{snapshot['layout'][1]} server(s): its pushes in flight are dropped, and every worker starts from "
                "one place (only the same paradigm on as many workers and servers replays them)",
                hanging="  "), flush=True)  # fmt: skip
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
    return position

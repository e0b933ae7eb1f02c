"""A rank's side of failures: the fault injector, which makes one rank die at a chosen step on purpose (so that
restarting can be tested and taught), and the marks a supervising launcher reads (``dtrain launch --max-restarts``,
:mod:`dtrain.launch.restarts`): the last step done, and the attempts before this one.

    DTRAIN_FAULT=RANK:STEP[:SIGNAL[:WHERE]]     e.g. DTRAIN_FAULT=2:7, 1:12:TERM, 0:8:KILL:checkpoint

Rank RANK sends itself SIGNAL (a name, ``KILL`` or ``SIGKILL``, or a number; KILL by default) when it has finished
global step STEP, its update done and before that step's checkpoint is written. SIGKILL is what the kernel's
out-of-memory killer and a rebooting node do: no handler runs, no ``finally``, no message; the process is simply gone,
and MPI ends the rest of the job. WHERE ``checkpoint`` kills rank 0 halfway through writing step STEP's checkpoint
(half the temporary file on the disk, the rename not done): what a crash during a write would leave.

**Once per run.** Before it dies, the rank writes ``faults.json`` into the checkpoint folder (flushed to the disk), so
the job that ``dtrain launch --max-restarts`` starts again from the last checkpoint goes past STEP without dying a
second time. Without a checkpoint folder there is nowhere to remember it, and the fault fires on every run.

A fault on a rank that never takes a step of its own (a parameter server answers the workers' steps) is a mistake,
reported at the end of the run. A malformed DTRAIN_FAULT, or a RANK the job does not have, is refused before any
rank talks to another.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError

ENV_VAR = "DTRAIN_FAULT"
RECORD = "faults.json"  # in the checkpoint folder: the faults that have fired
WHERES = ("step", "checkpoint")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    signum: int = int(signal.SIGKILL)
    where: str = "step"

    @property
    def spec(self) -> str:
        return f"{self.rank}:{self.step}:{signal.Signals(self.signum).name[3:]}:{self.where}"

    def describe(self) -> str:
        if self.where == "checkpoint":
            at = f"halfway through writing step {self.step}'s checkpoint"
        else:
            at = f"after global step {self.step}"
        return f"rank {self.rank} sent itself {signal.Signals(self.signum).name} {at}"


def parse(text: str) -> Fault:
    """``RANK:STEP[:SIGNAL[:WHERE]]`` as a :class:`Fault`, or a :class:`ConfigError` that shows the form."""
    form = f"{ENV_VAR}={text!r}: expected RANK:STEP[:SIGNAL[:WHERE]], e.g. 2:7 or 1:12:TERM or 0:8:KILL:checkpoint"
    parts = text.strip().split(":")
    if not 2 <= len(parts) <= 4:
        raise ConfigError(form)
    try:
        rank, step = int(parts[0]), int(parts[1])
    except ValueError:
        raise ConfigError(form) from None
    if rank < 0 or step < 1:
        raise ConfigError(f"{ENV_VAR}={text!r}: RANK must be >= 0 and STEP >= 1 (global steps count from 1)")
    signum = _signal_number(parts[2], text) if len(parts) > 2 and parts[2] else int(signal.SIGKILL)
    where = parts[3].lower() if len(parts) > 3 else "step"
    if where not in WHERES:
        raise ConfigError(f"{ENV_VAR}={text!r}: WHERE must be one of {', '.join(WHERES)}, got {parts[3]!r}")
    if where == "checkpoint" and rank != 0:
        raise ConfigError(f"{ENV_VAR}={text!r}: only rank 0 writes checkpoints, so a fault in one names rank 0")
    return Fault(rank, step, signum, where)


def _signal_number(word: str, text: str) -> int:
    word = word.strip().upper()
    try:
        if word.isdigit():
            return int(signal.Signals(int(word)))
        return int(signal.Signals[word if word.startswith("SIG") else "SIG" + word])
    except (KeyError, ValueError):
        raise ConfigError(
            f"{ENV_VAR}={text!r}: {word!r} is not a signal (a name such as KILL or TERM, or a number)"
        ) from None


def from_env(world: int, folder=None, environ=None, checkpoint_every: int = 0) -> Fault | None:
    """The fault ``DTRAIN_FAULT`` asks for, checked against a job of ``world`` ranks (and, for a fault in a checkpoint's
    write, against the run's checkpoints: ``folder``, every ``checkpoint_every`` steps); None if it asks for none, or
    if it has fired already (recorded in ``folder``: a restart, which may have fewer ranks)."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not text:
        return None
    fault = parse(text)
    if folder is not None and any(f.get("spec") == fault.spec for f in fired(folder)):
        return None
    if fault.rank >= world:
        raise ConfigError(f"{ENV_VAR}={text!r}: rank {fault.rank} does not exist in a job of {world} rank(s)")
    written = folder is not None and checkpoint_every and fault.step % checkpoint_every == 0
    if fault.where == "checkpoint" and not written:
        raise ConfigError(
            f"{ENV_VAR}={text!r}: no checkpoint is written after step {fault.step} (--checkpoint-dir DIR "
            f"--checkpoint-every N writes one every N steps): name a step where one is"
        )
    return fault


def check_reachable(fault: Fault | None, steps: int) -> None:
    """A fault after the run's last global step would never fire: refused, with the run's number of steps."""
    if fault is not None and fault.step > steps:
        raise ConfigError(f"{ENV_VAR}: step {fault.step} is past the run's last global step ({steps}); name one before")


def fired(folder) -> list[dict]:
    """The faults recorded in ``folder`` (those that have already fired, oldest first)."""
    path = Path(folder) / RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


class Injector:
    """One rank's armed fault (or none): :meth:`at_step` after each global step, :meth:`during_write` inside a
    checkpoint's write. ``folder``: the checkpoint folder, where the firing is recorded (None: nowhere)."""

    def __init__(self, fault: Fault | None, rank: int, folder=None):
        mine = fault is not None and fault.rank == rank
        already = folder is not None and mine and any(f.get("spec") == fault.spec for f in fired(folder))
        self.fault = fault if mine and not already else None
        self.folder = folder
        self.last_step = 0

    @property
    def armed(self) -> bool:
        return self.fault is not None

    def at_step(self, step: int) -> None:
        self.last_step = step
        if self.fault is not None and self.fault.where == "step" and step == self.fault.step:
            self._fire(step)

    def during_write(self, step: int):
        """The hook :func:`dtrain.checkpoint.save` calls with the half-written temporary file (None: no fault)."""
        if self.fault is None or self.fault.where != "checkpoint" or step != self.fault.step:
            return None
        return lambda: self._fire(step)

    def check_fired(self) -> None:
        """At the end of a run: a fault armed for a rank that took no step is a mistake in what was asked."""
        if self.fault is not None and self.fault.where == "step" and self.last_step == 0:
            raise ConfigError(
                f"{ENV_VAR}: rank {self.fault.rank} took no training steps of its own (a parameter server answers the "
                "workers'), so it was never killed: name a rank that trains"
            )

    def _fire(self, step: int) -> None:
        fault = self.fault
        if self.folder is not None:
            record = [*fired(self.folder), {"spec": fault.spec, "rank": fault.rank, "step": step,
                                            "signal": signal.Signals(fault.signum).name, "where": fault.where,
                                            "pid": os.getpid()}]  # fmt: skip
            write_synced(Path(self.folder) / RECORD, json.dumps(record, indent=1))
        os.kill(os.getpid(), fault.signum)  # (a signal Python handles, such as INT, acts at its next instruction)


def write_synced(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, on the disk before the rename (as a checkpoint is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- what a supervising launcher reads and writes (dtrain.launch.restarts) ------------------------------------------
PROGRESS_ENV = "DTRAIN_PROGRESS"  # a file where rank 0 keeps the number of the last global step it finished
ATTEMPTS_ENV = "DTRAIN_ATTEMPTS"  # a JSON file: the launcher's record of the attempts before this one


class ProgressMark:
    """Rank 0 writes the global step it has just finished into the file ``DTRAIN_PROGRESS`` names: 8 bytes written in
    place (no fsync: the page cache outlives a killed process, and a rebooted node's count is lost with its steps),
    a few microseconds a step. The launcher reads it after a failure: the steps lost are those since the checkpoint."""

    def __init__(self, rank: int, environ=None):
        path = (os.environ if environ is None else environ).get(PROGRESS_ENV, "")
        self.fd = None
        if path and rank == 0:
            try:  # bookkeeping, never a reason to fail (rank 0 on a machine without the launcher's folder)
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:
                pass

    def at_step(self, step: int) -> None:
        if self.fd is not None:
            os.pwrite(self.fd, int(step).to_bytes(8, "little"), 0)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_progress(path) -> int | None:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return int.from_bytes(data[:8], "little") if len(data) >= 8 else None


def attempts(environ=None) -> dict | None:
    """The launcher's record of this job's attempts so far (metrics.json's ``restarts``), or None when no
    supervising launcher started this run."""
    path = (os.environ if environ is None else environ).get(ATTEMPTS_ENV, "")
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None

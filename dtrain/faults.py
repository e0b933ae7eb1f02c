"""A rank's side of failures: the fault injector, which makes ranks die at chosen steps on purpose (so that
restarting can be tested and taught), and the marks a supervising launcher reads (``dtrain launch --max-restarts``,
:mod:`dtrain.launch.restarts`): the last step done, and the attempts before this one.

    DTRAIN_FAULT=FAULT[,FAULT...]       FAULT = RANK:STEP[:SIGNAL[:WHERE]][@ATTEMPT]
    DTRAIN_FAULT=2:7                    rank 2 dies (SIGKILL) after global step 7
    DTRAIN_FAULT=1:12:TERM,3:12         ranks 1 (SIGTERM) and 3 after step 12: two ranks die together
    DTRAIN_FAULT=1:7,2:9@2              rank 1 after step 7; rank 2 after step 9 of the restarted job
    DTRAIN_FAULT=0:8:KILL:checkpoint    rank 0 halfway through writing step 8's checkpoint

Rank RANK sends itself SIGNAL (a name, ``KILL`` or ``SIGKILL``, or a number; KILL by default) when it has finished
global step STEP, its update done and before that step's checkpoint is written. SIGKILL is what the kernel's
out-of-memory killer and a rebooting node do: no handler runs, no ``finally``, no message; the process is simply gone,
and MPI ends the rest of the job. WHERE ``checkpoint`` kills rank 0 halfway through writing step STEP's checkpoint
(half the temporary file on the disk, the rename not done): what a crash during a write would leave.

**A parameter server** takes no steps of its own: for a server, STEP counts the pushes it has applied since training
began, divided by the number of workers W (integer division). It dies once it has applied STEP x W pushes, at about
the workers' global step STEP (a resumed run counts on from the checkpoint's step).

**Attempts.** ``@ATTEMPT`` binds a fault to one attempt of a job run by ``dtrain launch --max-restarts``: 1 is the
first run, 2 the first restart, and so on (the launcher's record, ``DTRAIN_ATTEMPTS``; without a launcher every run
is attempt 1). A fault without ``@`` fires in whichever attempt first reaches it.

**Once per run, per fault.** Before it dies, the rank adds the fault's spec (``@ATTEMPT`` included) to ``faults.json``
in the checkpoint folder (on the disk, under a lock: two ranks may die at once), and the restarted job goes past every
fault that fired. A fault bound to an attempt that has passed without it firing (MPI ended that attempt first, for
another rank's death) is simply skipped; so is a fault without ``@`` whose step lies before the checkpoint a restart
resumes from. Without a checkpoint folder there is nowhere to remember: every fault fires on every run.

**Refused before any rank talks to another**, one line naming the item: a malformed item, two faults of one rank at
one step (and attempt), a RANK the job does not have, a STEP past the run's last, a checkpoint fault at a step that
writes none, an ATTEMPT past 1 with no launcher to restart the job. **At the end of a run**, a fault that could not
fire is a mistake, reported: its rank neither took a step nor applied a push, or it is bound to this attempt and the
attempt resumed from a checkpoint past its step.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.errors import ConfigError

ENV_VAR = "DTRAIN_FAULT"
RECORD = "faults.json"  # in the checkpoint folder: the faults that have fired
WHERES = ("step", "checkpoint")
FORM = "RANK:STEP[:SIGNAL[:WHERE]][@ATTEMPT], e.g. 2:7 or 1:12:TERM or 0:8:KILL:checkpoint or 2:9@2"


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    signum: int = int(signal.SIGKILL)
    where: str = "step"
    attempt: int | None = None  # the one attempt it fires in (None: the first to reach it)
    label: str = field(default="", compare=False, repr=False)  # how errors name it: DTRAIN_FAULT='2:7', or an item

    @property
    def spec(self) -> str:
        """The fault, written out in full (what faults.json records): ``2:7:KILL:step``, ``2:9:KILL:step@2``."""
        bound = f"@{self.attempt}" if self.attempt is not None else ""
        return f"{self.rank}:{self.step}:{signal.Signals(self.signum).name[3:]}:{self.where}{bound}"

    @property
    def named(self) -> str:
        return self.label or f"{ENV_VAR}={self.spec!r}"

    def describe(self, workers: int = 0) -> str:
        """What it does, in words; ``workers``: W when the rank is a parameter server (0: a rank that trains)."""
        name = signal.Signals(self.signum).name
        if self.where == "checkpoint":
            said = f"rank {self.rank} sent itself {name} halfway through writing step {self.step}'s checkpoint"
        elif workers:
            said = (f"server rank {self.rank} sent itself {name} after applying {self.step * workers} pushes "
                    f"(global step {self.step})")  # fmt: skip
        else:
            said = f"rank {self.rank} sent itself {name} after global step {self.step}"
        return said + (f", in attempt {self.attempt}" if self.attempt is not None else "")


def parse(text: str, label: str = "") -> Fault:
    """One fault, ``RANK:STEP[:SIGNAL[:WHERE]][@ATTEMPT]``, as a :class:`Fault`, or a :class:`ConfigError` that shows
    the form. ``label``: how the error names it (default ``DTRAIN_FAULT='TEXT'``)."""
    label = label or f"{ENV_VAR}={text!r}"
    body, at, bound = text.strip().partition("@")
    parts = body.split(":")
    if not 2 <= len(parts) <= 4:
        raise ConfigError(f"{label}: expected {FORM}")
    try:
        rank, step = int(parts[0]), int(parts[1])
        attempt = int(bound) if at else None
    except ValueError:
        raise ConfigError(f"{label}: expected {FORM}") from None
    if rank < 0 or step < 1:
        raise ConfigError(f"{label}: RANK must be >= 0 and STEP >= 1 (global steps count from 1)")
    if attempt is not None and attempt < 1:
        raise ConfigError(f"{label}: ATTEMPT must be >= 1 (1: the job's first run, 2: its first restart)")
    signum = _signal_number(parts[2], label) if len(parts) > 2 and parts[2] else int(signal.SIGKILL)
    where = parts[3].strip().lower() if len(parts) > 3 else "step"
    if where not in WHERES:
        raise ConfigError(f"{label}: WHERE must be one of {', '.join(WHERES)}, got {parts[3]!r}")
    if where == "checkpoint" and rank != 0:
        raise ConfigError(f"{label}: only rank 0 writes checkpoints, so a fault in one names rank 0")
    return Fault(rank, step, signum, where, attempt, label)


def parse_all(text: str) -> tuple[Fault, ...]:
    """Every fault of ``FAULT[,FAULT...]``, in order; two faults of one rank at one step (and attempt) are refused."""
    items = [item.strip() for item in text.strip().split(",")]
    if len(items) == 1:
        return (parse(items[0]),)
    found, seen = [], {}
    for item in items:
        label = f"{ENV_VAR} item {item!r}"
        if not item:
            raise ConfigError(f"{ENV_VAR}={text!r}: an empty item (faults are separated by single commas)")
        fault = parse(item, label)
        key = (fault.rank, fault.step, fault.where, fault.attempt)
        if key in seen:
            raise ConfigError(f"{label}: rank {fault.rank} at step {fault.step} is named already ({seen[key]!r}); a "
                              "rank dies once at a place")  # fmt: skip
        seen[key] = item
        found.append(fault)
    return tuple(found)


def _signal_number(word: str, label: str) -> int:
    word = word.strip().upper()
    try:
        if word.isdigit():
            return int(signal.Signals(int(word)))
        return int(signal.Signals[word if word.startswith("SIG") else "SIG" + word])
    except (KeyError, ValueError):
        raise ConfigError(f"{label}: {word!r} is not a signal (a name such as KILL or TERM, or a number)") from None


def _listed(faults) -> tuple[Fault, ...]:
    """None, one :class:`Fault` or several, as a tuple."""
    if faults is None:
        return ()
    return (faults,) if isinstance(faults, Fault) else tuple(faults)


def from_env(world: int, folder=None, environ=None, checkpoint_every: int = 0) -> tuple[Fault, ...]:
    """The faults ``DTRAIN_FAULT`` asks for that are still to come: not fired yet (recorded in ``folder``), not bound
    to an attempt that has passed (the launcher's record in ``environ``). Each is checked against a job of ``world``
    ranks (and a fault in a checkpoint's write against the run's checkpoints: ``folder``, every ``checkpoint_every``
    steps); those of later attempts too, so a mistake shows in the first. Empty if none."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_VAR, "").strip()
    if not text:
        return ()
    listed = parse_all(text)
    done = {f.get("spec") for f in fired(folder)} if folder is not None else set()
    attempt, launched = attempt_number(environ), attempts(environ) is not None
    coming = []
    for fault in listed:
        if fault.spec in done or (fault.attempt is not None and fault.attempt < attempt):
            continue  # (fired already, or its attempt passed: a restart, which may have fewer ranks)
        if fault.rank >= world:
            raise ConfigError(f"{fault.named}: rank {fault.rank} does not exist in a job of {world} rank(s)")
        written = folder is not None and checkpoint_every and fault.step % checkpoint_every == 0
        if fault.where == "checkpoint" and not written:
            raise ConfigError(
                f"{fault.named}: no checkpoint is written after step {fault.step} (--checkpoint-dir DIR "
                f"--checkpoint-every N writes one every N steps): name a step where one is"
            )
        if fault.attempt is not None and fault.attempt > 1 and not launched:
            raise ConfigError(f"{fault.named}: attempt {fault.attempt} never comes: only dtrain launch "
                              "--max-restarts N restarts a job (without it every run is attempt 1)")  # fmt: skip
        coming.append(fault)
    return tuple(coming)


def check_reachable(faults, steps: int) -> None:
    """A fault after the run's last global step would never fire: refused, with the run's number of steps.
    ``faults``: None, one :class:`Fault` or several (:func:`from_env`)."""
    for fault in _listed(faults):
        if fault.step > steps:
            raise ConfigError(
                f"{fault.named}: step {fault.step} is past the run's last global step ({steps}); name one before"
            )


def fired(folder) -> list[dict]:
    """The faults recorded in ``folder`` (those that have already fired, oldest first)."""
    path = Path(folder) / RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def record_fired(folder, entry: dict) -> None:
    """Add ``entry`` to ``folder``'s faults.json, on the disk before this returns; under a lock on the folder, so
    that two ranks dying at once both stay recorded (each reads, adds and writes the whole list)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        write_synced(folder / RECORD, json.dumps([*fired(folder), entry], indent=1))
    finally:
        os.close(fd)  # (and the lock with it)


class Injector:
    """One rank's armed faults (or none): :meth:`at_step` after each global step of a rank that trains,
    :meth:`at_pushes` after each push a parameter server applies, :meth:`during_write` inside a checkpoint's write.
    ``faults``: None, one :class:`Fault` or several (:func:`from_env`); those of this ``rank`` and this ``attempt``
    (default: the launcher's record, :func:`attempt_number`) not yet fired are armed. ``folder``: the checkpoint
    folder, where a firing is recorded (None: nowhere); ``start_step``: the global step the run resumed from."""

    def __init__(self, faults, rank: int, folder=None, *, attempt: int | None = None, start_step: int = 0):
        self.attempt = attempt_number() if attempt is None else attempt
        done = {f.get("spec") for f in fired(folder)} if folder is not None else set()
        self.faults = [f for f in _listed(faults)
                       if f.rank == rank and f.spec not in done and f.attempt in (None, self.attempt)]  # fmt: skip
        self.folder, self.start_step = folder, start_step
        self.last_step = 0  # the last global step this rank finished (a rank that trains)
        self.applied, self.workers = 0, 0  # pushes applied in this run, and W (a parameter server)

    @property
    def armed(self) -> bool:
        return bool(self.faults)

    def at_step(self, step: int) -> None:
        """A rank that trains has finished global ``step``: a fault there fires."""
        self.last_step = step
        for fault in self.faults:
            if fault.where == "step" and fault.step == step:
                self._fire(fault, step)
                return

    def at_pushes(self, applied: int, workers: int) -> None:
        """A parameter server has applied ``applied`` pushes in this run (those replayed after a resume included) from
        ``workers`` workers: a fault fires once the global step start_step + applied // workers reaches its STEP."""
        self.applied, self.workers = applied, workers
        step = self.start_step + applied // workers
        for fault in self.faults:
            if fault.where == "step" and self.start_step < fault.step <= step:
                self._fire(fault, fault.step)
                return

    def during_write(self, step: int):
        """The hook :func:`dtrain.checkpoint.save` calls with the half-written temporary file (None: no fault)."""
        for fault in self.faults:
            if fault.where == "checkpoint" and fault.step == step:
                return lambda: self._fire(fault, step)
        return None

    def check_fired(self) -> None:
        """At the end of a run: a fault armed here that could never have fired is a mistake in what was asked."""
        for fault in self.faults:
            if fault.where != "step":
                continue
            if fault.step <= self.start_step:
                if fault.attempt is not None:
                    raise ConfigError(
                        f"{fault.named}: attempt {fault.attempt} resumed from global step {self.start_step}, past "
                        f"step {fault.step}, so rank {fault.rank} was never killed: name a later step"
                    )
                continue  # (resumed past it: skipped, module docstring)
            if self.last_step == 0 and self.applied == 0:
                raise ConfigError(
                    f"{fault.named}: rank {fault.rank} neither took a training step nor applied a push, so it was "
                    "never killed: name a rank that trains or serves"
                )
            reached = self.start_step + self.applied // self.workers if self.workers else self.last_step
            raise ConfigError(
                f"{fault.named}: rank {fault.rank} reached only step {reached}, so it was never killed (a ps-async "
                "worker counts its own steps, and a slow one takes fewer than the run's): name an earlier step"
            )

    def _fire(self, fault: Fault, step: int) -> None:
        self.faults.remove(fault)
        if self.folder is not None:
            entry = {"spec": fault.spec, "rank": fault.rank, "step": step, "signal": signal.Signals(fault.signum).name,
                     "where": fault.where, "attempt": self.attempt, "pid": os.getpid()}  # fmt: skip
            if self.workers:  # a parameter server: the pushes the rule counts (module docstring)
                entry["pushes"] = fault.step * self.workers
            record_fired(self.folder, entry)
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


def attempt_number(environ=None) -> int:
    """This run's attempt: 1 for a job's first run, 2 for its first restart, ... (the launcher's record holds the
    attempts before this one); 1 when no supervising launcher started it."""
    record = attempts(environ)
    return 1 if record is None else int(record.get("count", 0)) + 1

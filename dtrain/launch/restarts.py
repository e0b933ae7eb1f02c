"""Surviving a dead rank: ``dtrain launch --max-restarts K --checkpoint-dir DIR`` starts the job again from its last
checkpoint, and the run ends with the very weights of a run that never failed.

In a real cluster a rank dies: the out-of-memory killer picks it, its node reboots, a link drops. MPI cannot go on
without it (every collective needs every rank), so the whole job ends. The launcher then does what a person would::

    attempt 1   ranks 0-3 train, checkpoint at steps 10, 20, 30 ...   rank 2 killed after step 37: MPI ends the job
                launcher: "rank 2 was killed by SIGKILL; the last checkpoint is step 30: 7 steps lost"
                (waits --restart-delay seconds: whatever killed it may need a moment, a node to come back)
    attempt 2   ranks 0-3 start again with --resume: step 31 ... the end      metrics.json: "restarts": 1 (7 lost)

Why the bits are the same: a checkpoint holds the full flat buffer, the optimizer's state and where training stood
(the epoch, the steps done in it, the data order's seed), so ``--resume`` continues exactly the computation the dead
run was doing; the steps since the checkpoint are done again, the same way. (torchrun's ``--max-restarts`` restarts
the job, and leaves the checkpoint to the script; here the checkpoint is dtrain's, so the promise can be kept.)

What is, and is not, restarted:

* a rank killed by a signal, a rank's uncaught exception, the watchdog's report of a stalled wait, a whole node lost
  (mpiexec's proxy there gone with its ranks), any other non-zero exit: restarted, up to K times, each time from the
  last complete checkpoint (none yet: from the start);
* a mistake in what was asked (exit 2: a bad flag, a diverging loss): never; it would fail again the same way;
* Ctrl-C (or SIGTERM, SIGHUP) sent to the launcher: the person stopping it; everything stops, nothing restarts.

**The folder is the job's.** The launcher writes the target's flags into it (``job.json``). A launch whose
``--checkpoint-dir`` already holds a checkpoint of this same job goes on from it (so launching the same command
again after the launcher itself died, or gave up, continues the run; ``--epochs`` may grow); a checkpoint of another
model or dataset is refused before anything starts, and one of another run (other flags, or written without the
launcher) too, unless the target says ``--resume`` (go on from it anyway: a new ``--lr``, say).

**Elastic** (``--min-ranks M``, with ``--hostfile``): before a restart, the hostfile is read again; if it now lists
fewer slots (a scheduler took a failed node out), the job goes on with as many ranks as fit, at least M, and as the
paradigm accepts. The global batch stays the same, so the curve still compares with single's (the bits do not: the
batch is summed over other slices). ``dtrain cluster kill`` does to a node of a cluster on this machine what the
scheduler would: every process on it killed, the node out of the hostfile (lessons/10_debugging.py, part 7).

The checkpoint folder must be one the launcher and rank 0 both see (one machine, or a shared file system): the
launcher reads the checkpoint's step, and rank 0's progress mark, from it.

**What a checkpoint interval costs.** Checkpointing every T seconds costs C/T of the time (C: one checkpoint's
write); a failure costs on average T/2 of redone work, plus the restart R. With failures every M seconds on average,
the waste C/T + (T/2 + R)/M is smallest at T = sqrt(2 C M) (Young, 1974; Daly, 2006, adds terms for T near M).

The ranks' side (the fault injector, the progress mark, the attempts record) is :mod:`dtrain.faults`.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dtrain import checkpoint, faults, terminal
from dtrain.config import TrainConfig, default_batch, train_parser
from dtrain.errors import EXIT_USER_ERROR, ConfigError, UsageError, UserError
from dtrain.launch import cluster, launcher
from dtrain.launch import hosts as hostlists

DEFAULT_RESTART_DELAY_S = 2.0
ATTEMPTS_FILE = "attempts.json"  # in the checkpoint folder: this launch's attempts so far (metrics.json "restarts")
PROGRESS_FILE = "progress"  # in the checkpoint folder: the last global step rank 0 finished (8 bytes)
JOB_FILE = "job.json"  # in the checkpoint folder: the flags of the job whose checkpoints these are
MPI_LOG = "mpi.log"  # in the checkpoint folder: what MPI said when an attempt ended (kept off the terminal)
GONE_S = 1.0  # a rank whose process ended this long before the job did had gone before the watchdog's report
# flags a job may change and still be the same job (how long, where its outputs go, how it is watched)
NOT_THE_JOB = ("epochs", "resume", "checkpoint_dir", "out", "trace", "progress", "quiet", "timeout")
TRAIN_MODULES = ("dtrain", "dtrain.cli")


@dataclass
class Attempt:
    """One start of the job and how it ended."""

    number: int  # 1 for the first start
    ranks: int
    resumed_from_step: int | None  # the checkpoint's global step it started from (None: from the beginning)
    started: float = field(default_factory=time.time)
    seconds: float = 0.0
    exit_status: int | None = None
    ended: str = "running"  # what happened, in words
    rank: int | None = None  # the rank that failed, where known
    signal: str | None = None
    node: str | None = None  # the dtrain cluster's node that was lost, or that the stalled ranks waited on
    reached_step: int | None = None  # the last global step rank 0 finished
    steps_lost: int | None = None  # reached - the step the next attempt resumes from


@dataclass
class Job:
    """What to run, how often to try, and on what."""

    ranks: int
    target: list[str]
    folder: Path
    max_restarts: int
    min_ranks: int
    delay_s: float = DEFAULT_RESTART_DELAY_S
    hostfile: str | None = None
    hosts_text: str | None = None
    oversubscribe: bool = False
    env: dict = field(default_factory=dict)
    train_config: object = None  # the TrainConfig when the target is `-m dtrain train` (else None)
    fresh: bool = True  # no checkpoint of this job in the folder yet: the folder's leftovers are cleared
    finished: str | None = None  # the folder's checkpoint is this job's last: how far it went, in words


def prepare(ranks: int, target: list[str], folder, max_restarts: int, min_ranks: int | None, delay_s: float,
            hostfile=None, hosts_text=None, oversubscribe=False, env=None) -> Job:  # fmt: skip
    """Check everything before anything starts (one line each: :class:`UserError`), and return the job.

    For a ``-m dtrain train`` target: its flags are read as the ranks will read them, the checkpoint folder is given
    to it (``--checkpoint-dir``, which it must not name otherwise), and a checkpoint already in the folder must be of
    this model and dataset. Any other target is restarted as it is, and finds DTRAIN_RESTART (0, 1, ...) and
    DTRAIN_CHECKPOINT_DIR in its environment: going on from a checkpoint is then up to it.
    """
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {max_restarts}")
    if folder is None and is_train(target):  # (given to dtrain train instead: the launcher takes it from there)
        folder = _train_args(target).checkpoint_dir
    if folder is not None and not str(folder).strip():  # (Path("") is the working directory)
        raise UserError("--checkpoint-dir has an empty name: give a folder for the job's checkpoints")
    if folder is None:
        shown = shlex.join(target[:3]) + (" ..." if len(target) > 3 else "")
        raise UserError(
            "--max-restarts needs --checkpoint-dir DIR, given to dtrain launch before the target (dtrain launch -n "
            f"{ranks} --max-restarts {max_restarts} --checkpoint-dir DIR {shown}): a restart goes on from the last "
            "checkpoint there"
        )
    min_ranks = ranks if min_ranks is None else min_ranks
    if not 1 <= min_ranks <= ranks:
        raise UserError(f"--min-ranks {min_ranks} must be between 1 and the ranks asked for (-n {ranks})")
    if not 0 <= delay_s < math.inf:
        raise UserError(f"--restart-delay must be a number of seconds >= 0, got {delay_s}")
    if min_ranks < ranks and not hostfile:
        raise UserError(
            "--min-ranks below -n needs --hostfile FILE: before a restart the launcher reads the hostfile again, and "
            "goes on with fewer ranks if it lists fewer slots (on this machine alone, or with --hosts, every slot is "
            "always there)"
        )
    folder = Path(folder)
    if folder.is_file():
        raise UserError(f"--checkpoint-dir {folder} is a file; give a folder")
    job = Job(ranks, list(target), folder, max_restarts, min_ranks, delay_s, hostfile, hosts_text, oversubscribe,
              dict(env or {}))  # fmt: skip
    if is_train(target):
        job.target, job.train_config = _train_target(target, folder, ranks)
        for size in (ranks, min_ranks):
            _check_paradigm(job.train_config, size)
        job.fresh = not _check_folder(job.train_config, folder, explicit_resume="--resume" in target[3:])
        job.finished = None if job.fresh else _finished(job.train_config, folder)
    elif checkpoint.path_in(folder).exists() or (folder / JOB_FILE).exists():
        job.fresh = False  # (another program's folder: what is in it is its business)
    return job


def is_train(target: list[str]) -> bool:
    return len(target) >= 3 and target[0] == "-m" and target[1] in TRAIN_MODULES and target[2] == "train"


def _train_args(target: list[str]):
    """The ``dtrain train`` flags of a ``-m dtrain train ...`` target, read as its ranks will read them."""
    try:
        return train_parser().parse_args([w for w in target[3:] if w != "--resume"])
    except UsageError as exc:
        raise UserError(f"the target's flags: {exc}") from None


def _train_target(target: list[str], folder: Path, ranks: int):
    """The target's train flags, read as its ranks will read them; it gets ``--checkpoint-dir``, never ``--resume``
    (the launcher adds that to the attempts that go on from a checkpoint), and ``--batch-size`` if it has none: the
    default batch depends on the number of ranks, and a restart on fewer must keep the global batch."""
    from dtrain import parallel

    words = [w for w in target[2:] if w != "--resume"]
    given = {k: v for k, v in vars(_train_args(target)).items() if k not in ("command", "func")}
    if given.get("checkpoint_dir") is not None:
        if Path(given["checkpoint_dir"]).resolve() != folder.resolve():
            raise UserError(
                f"dtrain train --checkpoint-dir {given['checkpoint_dir']} differs from the launcher's --checkpoint-dir "
                f"{folder}: give it once, to dtrain launch"
            )
    else:
        words += [f"--checkpoint-dir={folder}"]  # (one word: a folder named -x is no option to argparse)
    given["checkpoint_dir"], given["resume"] = str(folder), False
    asked = TrainConfig(**given)
    asked.validate()
    if asked.batch_size is None:
        asked.batch_size = default_batch(parallel.get(asked.paradigm), asked, ranks)
        words += ["--batch-size", str(asked.batch_size)]
    return [*target[:2], *words], asked


def job_flags(config) -> dict:
    """What makes a run the same job: every flag but :data:`NOT_THE_JOB`, as JSON has them."""
    return json.loads(json.dumps({k: v for k, v in config.as_dict().items() if k not in NOT_THE_JOB}, default=str))


def _check_folder(config, folder: Path, explicit_resume: bool) -> bool:
    """Whether the folder holds a checkpoint to go on from: none (False), or one of this job, or one the target asks
    to go on from with ``--resume`` (True). Another model's or dataset's, or another run's, is refused."""
    if not checkpoint.path_in(folder).exists():
        return False
    from dtrain.train import dataset_of

    data = dataset_of(config)
    sizes = [data.n_features, *config.hidden, data.n_classes]
    try:
        state = checkpoint.load(folder)
        checkpoint.check_compatible(state["meta"], checkpoint.identity(config, sizes, data), checkpoint.path_in(folder))
        checkpoint.check_position(state["meta"], config, checkpoint.path_in(folder))
    except checkpoint.CheckpointError as exc:
        why = str(exc).removeprefix("--resume: ")
        raise UserError(
            f"--checkpoint-dir {folder} holds a checkpoint this job cannot go on from ({why}); give another folder, or "
            "remove that one"
        ) from None
    if explicit_resume:
        return True
    try:
        recorded = json.loads((folder / JOB_FILE).read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded == job_flags(config):
        return True
    if recorded is None:
        whose = "a run not started by dtrain launch --max-restarts"
    else:
        ours = job_flags(config)
        differ = sorted(k for k in ours.keys() | recorded.keys() if ours.get(k) != recorded.get(k))
        whose = "another run (" + ", ".join(f"--{k.replace('_', '-')} {recorded.get(k)} there, {ours.get(k)} here"
                                            for k in differ[:3]) + ")"  # fmt: skip
    raise UserError(
        f"--checkpoint-dir {folder} holds a checkpoint of {whose}: give the target --resume to go on from it anyway, "
        "or another folder"
    )


def _finished(config, folder: Path) -> str | None:
    """How far the job went, if it has finished: the folder's checkpoint is its end (every one of ``--epochs``
    done) and what the run writes after it (metrics.json, the trace) is there and newer; else None (a run that died
    between its last checkpoint and its metrics goes on from that checkpoint, and writes them)."""
    meta = checkpoint.load(folder)["meta"]
    if meta["epoch"] <= config.epochs:
        return None
    written = checkpoint.path_in(folder).stat().st_mtime
    outputs = [Path(config.out) / "metrics.json"] if config.out else []
    outputs += [Path(config.trace)] if config.trace and config.trace != "-" else []
    if any(not out.exists() or out.stat().st_mtime < written for out in outputs):
        return None
    epochs = meta["epoch"] - 1
    return f"{epochs} epoch{'s' * (epochs != 1)}, global step {meta['global_step']}"


def _check_paradigm(config, world: int) -> None:
    from dtrain import parallel

    try:
        parallel.get(config.paradigm).check(config, world)
    except ConfigError as exc:
        raise UserError(f"on {world} ranks: {exc}") from None


# --- running it --------------------------------------------------------------------------------------------------
def run(job: Job) -> int:
    """Start the job, and again after each failure, up to ``job.max_restarts`` times; the exit status of the last try
    (0 once one succeeds). Ctrl-C on the launcher raises :class:`~dtrain.launch.jobs.JobInterrupted`: no restart.
    A job whose folder holds its last checkpoint has finished: that is said, and nothing runs."""
    if job.finished is not None:
        terminal.tell(f"dtrain launch: the job in {job.folder} has already finished ({job.finished}): nothing to run; "
                      f"to start afresh remove {job.folder} or give another --checkpoint-dir (more --epochs goes on "
                      "from it)")  # fmt: skip
        return 0
    if job.train_config is not None and not job.train_config.checkpoint_every:
        terminal.tell(
            "dtrain launch: the target writes no checkpoint before the end (no --checkpoint-every), so a restart "
            "starts from the beginning; --checkpoint-every N keeps the work a failure costs to N steps"
        )
    job.folder.mkdir(parents=True, exist_ok=True)
    record = job.folder / ATTEMPTS_FILE
    progress = job.folder / PROGRESS_FILE
    if job.fresh:  # an earlier job's leftovers would disarm a fault or count its attempts as this job's
        for leftover in (faults.RECORD, ATTEMPTS_FILE, PROGRESS_FILE):
            (job.folder / leftover).unlink(missing_ok=True)
    if job.train_config is not None:
        faults.write_synced(job.folder / JOB_FILE, json.dumps(job_flags(job.train_config), indent=1))
    attempts: list[Attempt] = []
    try:
        return _attempts(job, attempts, record, progress)
    except UserError:  # between two attempts (the hostfile gone, too few slots): the attempts so far, then the why
        _write_record(record, [a for a in attempts if a.ended != "running"])
        if any(a.ended != "running" for a in attempts):
            terminal.tell(report([a for a in attempts if a.ended != "running"]))
        raise


def _attempts(job: Job, attempts: list, record: Path, progress: Path) -> int:
    ranks = job.ranks
    while True:
        resumed_from, _ = _last_step(job.folder)
        attempt = Attempt(len(attempts) + 1, ranks, resumed_from)
        attempts.append(attempt)
        _write_record(record, attempts[:-1])
        if len(attempts) > 1 or resumed_from is not None:
            where = "the beginning" if resumed_from is None else f"the checkpoint at global step {resumed_from}"
            terminal.tell(
                f"dtrain launch: attempt {attempt.number} of {job.max_restarts + 1}, on {ranks} ranks, from {where}"
            )
        env = {**job.env, "DTRAIN_RESTART": str(attempt.number - 1), "DTRAIN_CHECKPOINT_DIR": str(job.folder),
               faults.PROGRESS_ENV: str(progress), faults.ATTEMPTS_ENV: str(record)}  # fmt: skip
        target = job.target + (["--resume"] if job.train_config is not None and resumed_from is not None else [])
        before = len(faults.fired(job.folder))
        progress.unlink(missing_ok=True)
        watched = launcher.launch_watched(ranks, target, _hosts(job), job.oversubscribe, env)
        attempt.seconds, attempt.exit_status = watched.seconds, watched.returncode
        log, title = job.folder / MPI_LOG, f"attempt {attempt.number}, exit status {watched.returncode}"
        if watched.returncode == 0:
            attempt.ended = "finished"
            keep_banners(watched, False, log, title)
            if len(attempts) > 1:
                terminal.tell(report(attempts))
            return 0
        keep_banners(watched, _explain(attempt, watched, faults.fired(job.folder)[before:]).known, log, title)
        attempt.reached_step = faults.read_progress(progress)
        if watched.returncode == EXIT_USER_ERROR:
            attempt.ended += " (exit 2: a mistake in what was asked, which a restart would repeat: not restarted)"
            _write_record(record, attempts)
            terminal.tell(report(attempts))
            return EXIT_USER_ERROR
        restart_from, rank0_from = _last_step(job.folder)
        if attempt.reached_step is not None:
            attempt.steps_lost = attempt.reached_step - (rank0_from or 0)
        if len(attempts) > job.max_restarts:
            _write_record(record, attempts)
            failed = f"{len(attempts)} attempt{'s' if len(attempts) > 1 else ''} failed"
            terminal.tell(
                report(attempts) + f"\ndtrain launch: {failed} (--max-restarts {job.max_restarts}); giving up"
            )
            return watched.returncode
        lost = "" if attempt.steps_lost is None else f"; {attempt.steps_lost} step(s) lost"
        where = f"the checkpoint at global step {restart_from}" if restart_from is not None else "the beginning"
        told = f"; MPI's own report is in {log}" if watched.banners else ""
        terminal.tell(f"dtrain launch: {attempt.ended}{lost}{told}. Restarting in {job.delay_s:g} s from {where} "
             f"(restart {len(attempts)} of {job.max_restarts})")  # fmt: skip
        time.sleep(job.delay_s)
        ranks = _ranks_now(job, ranks)


def _hosts(job: Job):
    """The hosts, read again before every attempt: a hostfile may have changed since the last (elastic)."""
    if job.hostfile:
        return hostlists.parse_hostfile(job.hostfile)
    if job.hosts_text:
        return hostlists.parse_hosts(job.hosts_text)
    return None


def _ranks_now(job: Job, ranks: int) -> int:
    """As many ranks as the hosts' slots hold now, at most -n and at least --min-ranks, that the paradigm accepts."""
    hosts = _hosts(job)
    if hosts is None or job.oversubscribe or job.min_ranks == job.ranks:
        return job.ranks
    slots = hostlists.total_slots(hosts)
    for size in range(min(job.ranks, slots), job.min_ranks - 1, -1):
        if job.train_config is None or _accepts(job.train_config, size):
            if size != ranks:
                terminal.tell(f"dtrain launch: the hosts list {slots} slot(s) now: going on with {size} ranks "
                              f"(--min-ranks {job.min_ranks}); the global batch stays {_batch(job)}")  # fmt: skip
            return size
    raise UserError(
        f"the hosts list {slots} slot(s) now, fewer than --min-ranks {job.min_ranks} (or no size from there up that "
        f"the paradigm accepts): not restarting"
    )


def _accepts(config, world: int) -> bool:
    try:
        _check_paradigm(config, world)
    except UserError:
        return False
    return True


def _batch(job: Job):
    return job.train_config.batch_size if job.train_config is not None else "the same"


def _last_step(folder: Path) -> tuple[int | None, int | None]:
    """The global step of the checkpoint in ``folder``, and rank 0's own steps there, what its progress mark counts
    (the same, but in a parameter-server snapshot: a worker's own pushes); (None, None): none, or unreadable."""
    try:
        meta = checkpoint.load(folder)["meta"]
    except checkpoint.CheckpointError:
        return None, None
    step = int(meta["global_step"])
    return step, int(meta["snapshot"]["workers"][0]["seq"]) if "snapshot" in meta else step


# --- saying what happened ----------------------------------------------------------------------------------------
_EXIT_STRING = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")  # MPICH's hydra: the signal that ended the first rank
_OPEN_MPI = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_WATCHDOG = re.compile(r"dtrain watchdog: rank (\d+) of \d+[^\n]*? has waited")
_EXCEPTION = re.compile(r"uncaught exception \(rank (\d+)\)")
_ABORT = re.compile(r"MPI_Abort\(MPI_COMM_WORLD, \d+\) - process (\d+)|MPI_ABORT was invoked on rank (\d+)")
_WAITS_FOR = re.compile(r"dtrain watchdog: rank (\d+) waits for rank (\d+)(?: \(world rank (\d+)\))?:")
# MPICH's hydra, when the connection to one of its proxies (one a node, the parent of the ranks there) closes
# without a word: the node's proxy was killed, and its ranks with it (a node lost, its processes killed)
_LOST_PROXY = re.compile(r"\[mpiexec@[^\]]*\] control_cb \(\S+:\d+\): assert \(!closed\) failed")


@dataclass
class Ending:
    """How a failed job ended, as far as the launcher can tell: ``cause`` is "signal" (a rank was killed), "exception"
    or "watchdog" (dtrain's own report, a traceback or the watchdog's, said it already), "abort" (a rank called
    MPI_Abort and said nothing more), "node" (mpiexec lost a whole node: its proxy ended, with every rank there) or
    "exit" (ranks exited with a failing status: what they printed says why)."""

    how: str  # in words: "rank 1 was killed by SIGKILL", "the watchdog found rank 2 stalled", ...
    cause: str
    rank: int | None = None
    signal: str | None = None
    node: str | None = None  # on a dtrain cluster: the node lost, or the node of the rank the stalled ones wait for

    @property
    def reported(self) -> bool:
        """dtrain's own report, or the ranks' own words, said what happened."""
        return self.cause in ("exception", "watchdog", "exit")

    @property
    def known(self) -> bool:
        """Somebody (dtrain, MPI's report of a signal, hydra's of a lost proxy) said what happened: MPI's banners
        add nothing."""
        return self.cause != "exit"


def ending(watched, fired: list[dict] = ()) -> Ending:
    """Which rank failed and how, from what is known for sure: the fault injector's record (``fired``), dtrain's own
    report (an exception, the watchdog), MPI's report of a signal or of an abort, and the order the ranks' processes
    ended in (:class:`~dtrain.launch.endings.Endings`); the first of these that speaks is believed. A rank is named
    from that order only when one was killed: ranks that all exit by themselves end in no telling order.

    On a ``dtrain cluster`` (the ranks' nodes known: ``watched.nodes``) two more things can be said. A node killed
    whole (``dtrain cluster kill``: its proxy and its ranks) ends the job through hydra's lost connection to that
    proxy; the node is the one whose ranks all ended before any other node's. A node cut off (``--cut-link``) says
    nothing: the ranks elsewhere wait until the watchdog ends the job, and its reports, followed from rank to rank
    (rank 1 waits for 0, which waits for 2), lead to the rank that never answered, and so to its node."""
    tail, status = watched.tail, watched.returncode
    nodes = getattr(watched, "nodes", None) or {}
    reports = ((_WATCHDOG, "the watchdog found rank {} stalled", "watchdog"),
               (_EXCEPTION, "rank {} raised an exception", "exception"),
               (_ABORT, "rank {} aborted the job", "abort"))  # fmt: skip
    if not fired and _LOST_PROXY.search(tail):  # (first: what the ranks left behind said next is its consequence)
        lost = lost_node(watched.ended, nodes, getattr(watched, "ended_before_s", None) or {}) or killed_node(nodes)
        if lost is None:
            return Ending("mpiexec lost a node (its proxy there ended, and the ranks on it)", "node")
        node, ranks = lost
        return Ending(f"mpiexec lost node {node} (its proxy ended with every rank on it: "
                      f"{', '.join(map(str, ranks))})", "node", node=node)  # fmt: skip
    if not fired:
        for pattern, how, cause in reports:
            if found := pattern.search(tail):
                rank = int(next(g for g in found.groups() if g is not None))
                if cause == "watchdog":
                    return _stalled(tail, rank, nodes, getattr(watched, "ended_before_s", None) or {})
                return Ending(how.format(rank), cause, rank)
    rank, signum = None, None
    if found := _OPEN_MPI.search(tail):
        rank, signum = int(found.group(1)), int(found.group(2))
    elif found := _EXIT_STRING.search(tail):
        signum = int(found.group(1))
    elif status > 128 and status - 128 in signal.valid_signals():
        signum = status - 128
    name = signal.Signals(signum).name if signum is not None else None
    if fired:
        rank, name = fired[-1]["rank"], fired[-1]["signal"]
    if name is None:
        return Ending(f"the job's ranks exited with a failing status ({status})", "exit")
    if rank is None:
        rank = watched.first_to_end
    who = f"rank {rank}" if rank is not None else "a rank (MPI's report does not say which)"
    how = f"{who} was killed by {name}"
    if fired:
        how += f" ({injected(fired)})"
    return Ending(how, "signal", rank, name)


def injected(fired: list[dict]) -> str:
    """The fault injector's faults that fired in an attempt (``faults.json``'s entries, oldest first), the last
    first: "the fault injector, DTRAIN_FAULT=2:7:KILL:step, at global step 7; also rank 1: 1:7:KILL:step, ..."."""
    said = []
    for f in reversed(fired):
        at = f"at global step {f['step']}"
        if f.get("pushes") is not None:  # a parameter server (its STEP counts pushes: dtrain/faults.py)
            at = f"a server, after {f['pushes']} pushes: {at}"
        said.append(f"{faults.ENV_VAR}={f['spec']}, {at}" if not said else f"rank {f['rank']}: {f['spec']}, {at}")
    return "the fault injector, " + "; also ".join(said)


def _stalled(tail: str, rank: int, nodes: dict[int, str], ended_before: dict[int, float]) -> Ending:
    """The watchdog's report of ``rank``, followed along the other reports' "rank A waits for rank B" to the rank at
    the end (a rank that reported too only passed the stall on); and the ranks whose processes had ended well before
    the job did (``ended_before``: rank -> seconds), the ones that never answered, if this machine saw them end.
    "Well before" is counted from the reporting rank's own end, not the job's: a slow teardown must not make the
    reporter itself look gone."""
    waits = {}
    for found in _WAITS_FOR.finditer(tail):
        waits.setdefault(int(found[1]), int(found[3] or found[2]))
    chain = [rank]
    while chain[-1] in waits and waits[chain[-1]] not in chain:
        chain.append(waits[chain[-1]])
    how = f"the watchdog found rank {rank} stalled"
    reported_end = ended_before.get(rank, 0.0)
    before = {r: seconds - reported_end for r, seconds in ended_before.items()}  # how long before the reporter ended
    gone = sorted(r for r, seconds in before.items() if seconds >= GONE_S)
    if chain[-1] in waits and not gone:  # back to a rank in the chain: every one of them waits for the next
        circle = " -> ".join(map(str, [*chain, waits[chain[-1]]]))
        return Ending(f"{how}, the ranks waiting in a circle ({circle}): a deadlock", "watchdog", rank)
    node = None
    if len(chain) > 1:
        how += f", waiting for rank {chain[-1]}"
        node = nodes.get(chain[-1]) if not gone else None
        how += f" on node {node}" if node else ""
        if len(chain) > 2:
            how += f" (through rank{'s' * (len(chain) > 3)} {', '.join(map(str, chain[1:-1]))})"
    if gone:
        where = {nodes.get(r) for r in gone}
        node = where.pop() if len(where) == 1 else None
        whole = node is not None and gone == sorted(r for r, n in nodes.items() if n == node)
        who = f"rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))}"
        who = f"node {node}'s {who}" if whole else who + (f" (on node {node})" if node else "")
        how += f": {who} had ended {max(before[r] for r in gone):.1f} s before rank {rank} did"
    return Ending(how, "watchdog", rank, node=node)


def lost_node(ended: list[int], nodes: dict[int, str], ended_before: dict[int, float] | None = None):
    """The node whose ranks all ended before any rank of another node did (``ended``: the ranks in the order their
    processes ended; ``nodes``: rank -> node), and its ranks; None if the order does not single one out.
    ``ended_before`` (rank -> seconds before the job ended) tells ranks seen ending at the same look apart from
    the rest: their order among themselves is unknown, so a node whose last rank ended at the same look as another
    node's first is not singled out."""
    order = [rank for rank in ended if rank in nodes]
    if not order:
        return None
    node = nodes[order[0]]
    first = itertools.takewhile(lambda rank: nodes[rank] == node, order)
    on_it = sorted(rank for rank, where in nodes.items() if where == node)
    if sorted(first) != on_it:
        return None
    if ended_before:
        last_of_it = min(ended_before.get(r, 0.0) for r in on_it)
        others = [seconds for r, seconds in ended_before.items() if nodes.get(r, node) != node]
        if others and max(others) >= last_of_it:  # (the same look, or later: not told apart)
            return None
    return node, on_it


def killed_node(nodes: dict[int, str]) -> tuple[str, list[int]] | None:
    """On a ``dtrain cluster``, when the order of the ends did not tell: the one node of the job that its cluster's
    record says ``dtrain cluster kill`` took down, and its ranks (None: not a cluster's, or not exactly one)."""
    names = {node.rsplit("-n", 1)[0] for node in nodes.values()}
    try:
        record = cluster.load(names.pop()) if len(names) == 1 else None
    except UserError:  # (not a cluster's name after all, or its record unreadable: nothing to go by)
        record = None
    killed = sorted({node for node in nodes.values() if record is not None and node in record.killed})
    if len(killed) != 1:
        return None
    return killed[0], sorted(rank for rank, node in nodes.items() if node == killed[0])


def _explain(attempt: Attempt, watched, fired: list[dict]) -> Ending:
    """Fill in which rank failed and how (:func:`ending`)."""
    found = ending(watched, fired)
    attempt.ended, attempt.rank, attempt.signal, attempt.node = found.how, found.rank, found.signal, found.node
    return found


def keep_banners(watched, known: bool, log: Path | None = None, title: str = "") -> None:
    """MPI's own banners on how a job ended (:class:`~dtrain.launch.banners.Banners`): appended to ``log`` (the run's
    folder's ``mpi.log``) if there is one, and shown on stderr only if nothing else explained the ending."""
    if not watched.banners:
        return
    if log is not None:
        with open(log, "a") as f:
            f.write(f"--- {title}\n{watched.banners.rstrip()}\n")
    if not known:
        sys.stderr.write(watched.banners)
        sys.stderr.flush()


def report(attempts: list[Attempt]) -> str:
    """Every attempt, a line each."""
    lines = ["dtrain launch: the attempts"]
    for a in attempts:
        start = "the beginning" if a.resumed_from_step is None else f"step {a.resumed_from_step}"
        reached = "" if a.reached_step is None else f", reached step {a.reached_step}"
        lost = "" if a.steps_lost is None else f", {a.steps_lost} step(s) lost"
        lines.append(f"  {a.number}. {a.ranks} ranks from {start}, {a.seconds:.1f} s{reached}: {a.ended}{lost}")
    return "\n".join(lines)


def summary(attempts: list[Attempt]) -> dict:
    """metrics.json's ``restarts``: how many, the steps lost, and every failed attempt."""
    return {
        "count": len(attempts),
        "steps_lost": sum(a.steps_lost or 0 for a in attempts),
        "seconds_lost": sum(a.seconds for a in attempts),
        "attempts": [asdict(a) for a in attempts],
    }


def _write_record(path: Path, failed: list[Attempt]) -> None:
    faults.write_synced(path, json.dumps(summary(failed), indent=1))

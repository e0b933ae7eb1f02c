"""A soak of random faults: ``dtrain launch --max-restarts`` against a hundred ranks killed at random.

Each case draws (seeded) a paradigm, a world size, and one of five kinds of fault, sets ``DTRAIN_FAULT``
(:mod:`dtrain.faults`) and runs the job under ``dtrain launch -n N --max-restarts K --restart-delay 0.2``, on digits
with a hidden layer of 32, 2 epochs (44 global steps), a checkpoint every 5 steps, so a case takes a few seconds:

* **rank**: one training rank (a worker of a parameter-server job) killed after a random step (a ps-async worker's
  in the first half of the run: its own steps count, and a slow worker takes fewer of an epoch's pushes);
* **server**: a parameter server killed (its step: the pushes it has applied / the workers, faults.py);
* **checkpoint**: rank 0 killed halfway through writing a checkpoint (``0:STEP:SIG:checkpoint``, STEP a multiple of 5);
* **restart**: a rank killed, and another (or the same) killed again in the restarted job (``...,R:S@2``, S at or
  after the first fault's step, so the restart always reaches it; ``--max-restarts 2``);
* **two**: two ranks killed after the same step (``1:7,2:7``; ``--max-restarts 2``: MPI may end the second before it
  gets there, and it then dies in the next attempt).

The paradigms: those that write checkpoints during training, ddp, zero (stages 1-3), tp (``--tp 2`` on 2 or 4 ranks,
``--tp 4``), pp (``--pp 2`` on 2 or 4 ranks: the model has 2 layers), central-storage, spmd, ps-sync and ps-async
(1 server and 2-3 workers, or 2 and 2). local-sgd and gossip are left out: they refuse ``--checkpoint-every`` (between
averages every rank holds a model of its own). World sizes are 2-4, and every drawn configuration passes the
paradigm's own ``check``. The signals: KILL (weighted 2), TERM, SEGV, ABRT and INT; ``dtrain launch`` restarts on
every one of them (a rank ended by any signal, or by INT's quiet exit 130, is a failure, not the person's Ctrl-C,
which reaches the launcher, not a rank; only exit 2 is never restarted).

**The checks**, for each case:

1. *recovered*: ``dtrain launch`` exits 0, metrics.json's ``restarts.count`` >= 1, and every fault asked for is in
   the folder's faults.json (it fired), or legitimately could not fire (``skipped`` in the raw results, with why): a
   fault without ``@`` whose step the restart resumed from or past (the second of two ranks that MPI ended before it
   got there, faults.py's rule), or one of a ps-async worker that took fewer steps of its own than its STEP;
2. *same bits* (every synchronous paradigm, ps-sync included): the final weights_sha256 equals the uninterrupted run
   of the same configuration (run once per configuration, plain ``dtrain launch -n N``, kept for the soak);
   *exactly once* (ps-sync and ps-async): metrics.json's ``pushes``: ``exactly_once``, every server's ``applied``
   equal to ``sent``; the pushes sent are also compared with the uninterrupted run's, none lost and none doubled
   (ps-sync: each worker's; ps-async: their sum, since how a run's pushes split among its workers varies from run to
   run; ``sent_as_uninterrupted`` in the raw results);
3. *no process left*: while the case runs, the launcher's process tree is looked at every 0.1 s (PID and start time,
   :func:`dtrain.launch.processes.tree`); after it ends, every process on the machine whose command line names the
   case's folder or whose environment holds the case's tag (``DTRAIN_SOAK_TAG``, inherited by mpiexec, its proxies and
   the ranks) is found by a scan of /proc. One second after the launcher has exited, any of them still running (same
   PID and start time, not a zombie) is left behind: counted, then killed by PID;
4. *no /dev/shm segment left*: /dev/shm is listed before and after the case. Other jobs on the machine make segments
   too (and old ``mpich_shm_*`` files from earlier days are there), so a new file counts only if it is the case's:
   mapped by one of its processes while the case ran (their /proc/PID/maps, read at each look), or named after one of
   their PIDs (``mpich_shm_<pid in hex>_0``: what MPICH names a singleton's segment, as the launcher's own). New files
   that nothing ties to the case are reported apart (``shm_unattributed``), not counted.

A case that runs past ``--limit-s`` is a **hang**: the launcher is sent SIGTERM (it stops its job), 5 s later its
process group and every process of the case is killed.

    python scripts/soak.py --faults 100                  # docs/bench/soak/soak.txt, .json and .jsonl (each case)
    python scripts/soak.py --faults 100 --only 17        # case 17 of that draw, alone (printed with each case)
    python scripts/soak.py --case 'ps-async-1/3/5/1/2:20:KILL:step'    # VARIANT/RANKS/EVERY/MAX_RESTARTS/FAULTS

Exits non-zero if any target is missed: every fault recovered, the same bits, exactly once, 0 hangs, 0 processes and
0 segments left. Until faults.py takes several faults (``A,B``, ``@ATTEMPT``) and a server's rank, the kinds it cannot
express are not drawn (said at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import mpi4py

mpi4py.rc.initialize = False  # dtrain's imports bring mpi4py.MPI: no MPI here (it would make a segment in /dev/shm)
mpi4py.rc.finalize = False

import numpy as np
from bench_util import run_meta

from dtrain import faults, parallel, terminal
from dtrain.config import TrainConfig, default_batch, train_parser
from dtrain.data import ShardedLoader
from dtrain.errors import ConfigError
from dtrain.launch import processes
from dtrain.train import dataset_of

MODEL = ["--dataset", "digits", "--hidden", "32", "--epochs", "2", "--quiet", "--no-progress"]
VARIANTS = {  # name: the paradigm's flags
    "ddp": ["--paradigm", "ddp"],
    "zero-1": ["--paradigm", "zero", "--zero-stage", "1"],
    "zero-2": ["--paradigm", "zero", "--zero-stage", "2"],
    "zero-3": ["--paradigm", "zero", "--zero-stage", "3"],
    "tp-2": ["--paradigm", "tp", "--tp", "2"],
    "tp-4": ["--paradigm", "tp", "--tp", "4"],
    "pp-2": ["--paradigm", "pp", "--pp", "2"],
    "central-storage": ["--paradigm", "central-storage"],
    "spmd": ["--paradigm", "spmd"],
    "ps-sync-1": ["--paradigm", "ps-sync", "--servers", "1"],
    "ps-sync-2": ["--paradigm", "ps-sync", "--servers", "2"],
    "ps-async-1": ["--paradigm", "ps-async", "--servers", "1"],
    "ps-async-2": ["--paradigm", "ps-async", "--servers", "2"],
}
KINDS = {"rank": 3, "server": 2, "checkpoint": 2, "restart": 2, "two": 2}  # kind: weight in the draw
SIGNALS = {"KILL": 2, "TERM": 1, "SEGV": 1, "ABRT": 1, "INT": 1}
WORLDS = (2, 3, 4)
EVERY = 5
DELAY_S = 0.2
LOOK_S = 0.1  # how often a running case's processes are looked at
LEFT_AFTER_S = 1.0  # a case's process still running this long after the launcher exited is left behind
TAG = "DTRAIN_SOAK_TAG"


# --- what can be drawn --------------------------------------------------------------------------------------------
def capabilities() -> dict:
    """What this tree's fault injector takes: several faults and attempts (``A,B@2``), and a server's rank."""
    parse = getattr(faults, "parse_all", faults.parse)
    try:
        parse("0:1@1,1:2")
        several = True
    except (ConfigError, ValueError):
        several = False
    return {"several": several, "server": hasattr(faults.Injector, "at_pushes")}


def paradigm_of(variant: str) -> str:
    return VARIANTS[variant][1]


def servers_of(variant: str) -> int:
    flags = VARIANTS[variant]
    return int(flags[flags.index("--servers") + 1]) if "--servers" in flags else 0


def config_of(variant: str, ranks: int, every: int) -> TrainConfig:
    """The TrainConfig the ranks will read (the batch the launcher gives it), or a ConfigError."""
    args = train_parser().parse_args([*VARIANTS[variant], *MODEL, "--checkpoint-every", str(every),
                                      "--checkpoint-dir", "unused"])  # fmt: skip
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})
    config.validate()
    kind = parallel.get(config.paradigm)
    config.batch_size = default_batch(kind, config, ranks)
    kind.check(config, ranks)
    return config


_STEPS: dict = {}


def total_steps(variant: str, ranks: int, every: int) -> int:
    """The run's global steps (rank 0's loader: a worker's, under a parameter server)."""
    key = (variant, ranks, every)
    if key not in _STEPS:
        config = config_of(variant, ranks, every)
        data = dataset_of(config)
        index, count = parallel.get(config.paradigm).shard_of(0, ranks, config)
        loader = ShardedLoader(data.x_train, data.y_train, config.batch_size, index, count, config.seed, np)
        _STEPS[key] = config.epochs * len(loader)
    return _STEPS[key]


def worlds_of(variant: str, every: int) -> list[int]:
    """The world sizes the paradigm accepts (a parameter server's with at least 2 workers)."""
    ok = []
    for ranks in WORLDS:
        if servers_of(variant) and ranks - servers_of(variant) < 2:
            continue
        try:
            config_of(variant, ranks, every)
        except ConfigError:
            continue
        ok.append(ranks)
    return ok


@dataclass
class Case:
    variant: str
    ranks: int
    every: int
    max_restarts: int
    faults: list[str]  # DTRAIN_FAULT's parts

    @property
    def spec(self) -> str:
        return f"{self.variant}/{self.ranks}/{self.every}/{self.max_restarts}/{','.join(self.faults)}"

    @classmethod
    def parse(cls, spec: str) -> Case:
        try:
            variant, ranks, every, restarts, text = spec.split("/", 4)
            case = cls(variant, int(ranks), int(every), int(restarts), text.split(","))
        except ValueError:
            raise SystemExit(f"--case {spec!r}: expected VARIANT/RANKS/EVERY/MAX_RESTARTS/FAULTS") from None
        if variant not in VARIANTS:
            raise SystemExit(f"--case {spec!r}: {variant!r} is not one of {', '.join(VARIANTS)}")
        return case

    @property
    def workers(self) -> int:
        return self.ranks - servers_of(self.variant)

    @property
    def kind(self) -> str:
        parts = [f.split("@")[0].split(":") for f in self.faults]
        if any(len(p) > 3 and p[3] == "checkpoint" for p in parts):
            return "checkpoint"
        if any("@" in f and f.split("@")[1] != "1" for f in self.faults):
            return "restart"
        if len(self.faults) > 1:
            return "two"
        return "server" if int(parts[0][0]) >= self.workers else "rank"

    @property
    def synchronous(self) -> bool:
        return paradigm_of(self.variant) != "ps-async"


def draw(rng: random.Random, caps: dict, every: int) -> Case:
    """One random case (module docstring)."""
    kinds = [k for k in KINDS if (k not in ("restart", "two") or caps["several"]) and (k != "server" or caps["server"])]
    kind = rng.choices(kinds, [KINDS[k] for k in kinds])[0]
    variants = [v for v in VARIANTS if caps["server"] or not servers_of(v)]
    if kind == "server":
        variants = [v for v in variants if servers_of(v)]
    paradigm = rng.choice(sorted({paradigm_of(v) for v in variants}))
    variant = rng.choice([v for v in variants if paradigm_of(v) == paradigm])
    ranks = rng.choice(worlds_of(variant, every))
    steps, workers = total_steps(variant, ranks, every), ranks - servers_of(variant)
    anyone = ranks if caps["server"] else workers  # (a server's rank can die too, once faults.py says how)

    def sig() -> str:
        return rng.choices(list(SIGNALS), list(SIGNALS.values()))[0]

    def last(*who: int) -> int:
        """The last step to draw for a fault of these ranks: the run's last but one, or, for a ps-async worker, half
        the run: its own steps count, and a fast worker takes more of an epoch's pushes than a slow one (29 and 61 of
        a run's 90 were seen), so a slow one may never reach a late step."""
        return steps // 2 if paradigm == "ps-async" and any(r < workers for r in who) else steps - 1

    if kind == "rank":
        rank = rng.randrange(workers)
        return Case(variant, ranks, every, 1, [f"{rank}:{rng.randint(1, last(rank))}:{sig()}"])
    if kind == "server":
        rank = rng.randrange(workers, ranks)
        return Case(variant, ranks, every, 1, [f"{rank}:{rng.randint(1, last(rank))}:{sig()}"])
    if kind == "checkpoint":
        step = every * rng.randint(1, (steps - 1) // every)
        return Case(variant, ranks, every, 1, [f"0:{step}:{sig()}:checkpoint"])
    if kind == "restart":
        a, b = rng.randrange(anyone), rng.randrange(anyone)
        first = rng.randint(1, last(a, b) - 1)
        # at or after the first fault's step, so that the restart (from a checkpoint at or before it) reaches it; the
        # same step only where no checkpoint is written (rank 0 may write that one before MPI ends the job)
        same = rng.random() < 0.25 and first % every
        second = first if same else rng.randint(first + (first % every == 0), last(b))
        tail = "@1" if rng.random() < 0.5 else ""
        return Case(variant, ranks, every, 2, [f"{a}:{first}:{sig()}{tail}", f"{b}:{second}:{sig()}@2"])
    a, b = rng.sample(range(anyone), 2)
    step = rng.randint(1, last(a, b))
    return Case(variant, ranks, every, 2, [f"{a}:{step}:{sig()}", f"{b}:{step}:{sig()}"])


def draw_all(count: int, seed: int, caps: dict, every: int) -> list[Case]:
    rng = random.Random(seed)
    return [draw(rng, caps, every) for _ in range(count)]


# --- watching a case's processes and shared memory ---------------------------------------------------------------
@dataclass
class Watch:
    """Every process of a case seen so far (pid -> start time) and the /dev/shm files they mapped."""

    root: int
    folder: str
    tag: str
    seen: dict = field(default_factory=dict)
    mapped: set = field(default_factory=set)

    def look(self) -> None:
        for pid, started in processes.tree(self.root).items():
            if started:
                self.seen.setdefault(pid, started)
        for pid, started in self.seen.items():
            if processes.running(pid, started):
                self.mapped |= shm_mapped_by(pid)

    def tied(self) -> dict[int, int]:
        """Every process on the machine now whose command line names the case's folder or whose environment holds
        its tag (pid -> start time)."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read()
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                continue
            if self.folder.encode() in argv or f"{TAG}={self.tag}".encode() in environ.split(b"\0"):
                stat = processes.stat_of(pid)
                if stat is not None:
                    found[pid] = stat[2]
        return found

    def left(self) -> dict[int, int]:
        """The case's processes still running (seen while it ran, or tied to it now)."""
        everyone = {**self.seen, **self.tied()}
        return {pid: started for pid, started in everyone.items() if processes.running(pid, started)}

    def ours(self, new: set[str]) -> set[str]:
        """Which of the new /dev/shm files are the case's (module docstring, check 4)."""
        named = {f"mpich_shm_{pid:x}_0" for pid in self.seen}
        return {name for name in new if name in self.mapped or name in named}


def shm_mapped_by(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except OSError:
        return set()
    return {line.split("/dev/shm/", 1)[1].split()[0] for line in text.splitlines() if "/dev/shm/" in line}


def shm_listing() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


# --- running a case ------------------------------------------------------------------------------------------------
def launch_command(case: Case, folder: Path, restarts: bool) -> list[str]:
    out, ck = folder / "out", folder / "ck"
    train = ["-m", "dtrain", "train", *VARIANTS[case.variant], *MODEL, "--checkpoint-every", str(case.every),
             "--out", str(out)]  # fmt: skip
    launch = [sys.executable, "-m", "dtrain", "launch", "-n", str(case.ranks)]
    if restarts:
        return [*launch, "--max-restarts", str(case.max_restarts), "--restart-delay", str(DELAY_S),
                "--checkpoint-dir", str(ck), *train]  # fmt: skip
    return [*launch, *train, "--checkpoint-dir", str(ck)]


def run_watched(command: list[str], folder: Path, fault: str | None, limit_s: float) -> dict:
    """Run ``command`` (a ``dtrain launch``) with its output in ``folder``/log, watched (module docstring)."""
    tag = f"{os.getpid()}-{folder.name}"
    env = {k: v for k, v in os.environ.items() if k != faults.ENV_VAR}
    env[TAG] = tag
    if fault is not None:
        env[faults.ENV_VAR] = fault
    before = shm_listing()
    started = time.monotonic()
    with open(folder / "log", "wb") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                    start_new_session=True)  # fmt: skip
    watch = Watch(launcher.pid, str(folder), tag)
    hang = False
    while launcher.poll() is None:
        watch.look()
        if time.monotonic() - started > limit_s:
            hang = True
            stop_hung(launcher, watch)
            break
        time.sleep(LOOK_S)
    seconds = time.monotonic() - started
    deadline = time.monotonic() + LEFT_AFTER_S
    while (left := watch.left()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left_commands = {pid: command_of(pid) for pid in left}
    for pid, started_at in left.items():  # (counted: now out of the next case's way)
        processes.send(pid, started_at, signal.SIGKILL)
    new = shm_listing() - before
    ours = watch.ours(new)
    still = {name for name in ours if (Path("/dev/shm") / name).exists()}
    for name in still:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    return {"exit": launcher.returncode, "hang": hang, "seconds": seconds, "processes": sorted(watch.seen),
            "left": [f"{pid} {cmd}" for pid, cmd in left_commands.items()], "shm_left": sorted(still),
            "shm_unattributed": sorted(new - ours), "shm_mapped": sorted(watch.mapped)}  # fmt: skip


def stop_hung(launcher: subprocess.Popen, watch: Watch) -> None:
    """SIGTERM to the launcher (it stops its job); 5 s later, SIGKILL to its process group and every process of the
    case."""
    watch.look()
    try:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid, started in {**watch.seen, **watch.tied()}.items():
        processes.send(pid, started, signal.SIGKILL)
    launcher.wait()


def metrics_of(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "out" / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def pushes_of(metrics: dict | None) -> dict | None:
    try:
        return metrics["communication"]["per_rank"][0]["paradigm"]["pushes"]
    except (KeyError, IndexError, TypeError):
        return None


def log_tail(folder: Path, lines: int = 25) -> str:
    try:
        return "\n".join((folder / "log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Baselines:
    """The uninterrupted run of each configuration, run once (plain ``dtrain launch -n N``): its weights_sha256 and
    pushes."""

    def __init__(self, work: Path, limit_s: float):
        self.work, self.limit_s, self.known = work, limit_s, {}

    def get(self, case: Case) -> dict:
        key = (case.variant, case.ranks, case.every)
        if key not in self.known:
            folder = self.work / f"whole-{case.variant}-{case.ranks}-{case.every}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            ran = run_watched(launch_command(case, folder, restarts=False), folder, None, self.limit_s)
            metrics = metrics_of(folder)
            self.known[key] = {"sha": metrics and metrics["weights_sha256"], "pushes": pushes_of(metrics),
                               "seconds": ran["seconds"], "ok": ran["exit"] == 0 and metrics is not None,
                               "tail": "" if ran["exit"] == 0 else log_tail(folder), "hang": ran["hang"],
                               "left": ran["left"], "shm_left": ran["shm_left"],
                               "shm_unattributed": ran["shm_unattributed"]}  # fmt: skip
            return {**self.known[key], "fresh": True}
        return {**self.known[key], "fresh": False}


_ATTEMPT = re.compile(r"attempt (\d+) of \d+, on \d+ ranks, from (?:the beginning|the checkpoint at global step (\d+))")


def not_fired(case: Case, fired: list[dict], folder: Path, pushes: dict | None) -> dict[str, str | None]:
    """The faults asked for that did not fire, each with the reason it legitimately could not (faults.py's rules),
    or None: a fault without ``@`` whose step a restart resumed from (or past), or one bound to an attempt that
    never came."""
    started = {int(n): int(step or 0) for n, step in _ATTEMPT.findall((folder / "log").read_text(errors="replace"))}
    done = {f.get("spec") for f in fired}
    out = {}
    for text in case.faults:
        fault = faults.parse(text)
        if fault.spec in done:
            continue
        later = {n: step for n, step in started.items() if n >= 2 and (fault.attempt in (None, n))}
        past = [n for n, step in later.items() if step >= fault.step]
        own = (pushes or {}).get("sent") or []
        if not case.synchronous and fault.rank < len(own) and own[fault.rank] < fault.step:
            out[text] = (
                f"worker {fault.rank} took {own[fault.rank]} steps of its own, fewer than {fault.step} (ps-async)"
            )
        elif fault.attempt is not None and fault.attempt not in started and fault.attempt > 1:
            out[text] = f"attempt {fault.attempt} never came"
        elif fault.attempt is None and past:
            out[text] = f"skipped: attempt {past[0]} resumed from step {later[past[0]]}, at or past its step"
        else:
            out[text] = None
    return out


def run_case(number: int, case: Case, work: Path, baselines: Baselines, limit_s: float, rerun: str) -> dict:
    """Run one case and check it; its result (one line of the raw results)."""
    whole = baselines.get(case)
    folder = work / f"case-{number:03d}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ran = run_watched(launch_command(case, folder, restarts=True), folder, ",".join(case.faults), limit_s)
    if whole["fresh"]:  # (the uninterrupted run was made for this case: what it left counts here too)
        ran["hang"] = ran["hang"] or whole["hang"]
        ran["left"] += [f"uninterrupted run: {p}" for p in whole["left"]]
        ran["shm_left"] += [f"uninterrupted run: {name}" for name in whole["shm_left"]]
        ran["shm_unattributed"] += whole["shm_unattributed"]
    metrics = metrics_of(folder)
    fired = faults.fired(folder / "ck")
    restarts = (metrics or {}).get("restarts") or {}
    count = restarts.get("count", 0)
    why = []
    if ran["hang"]:
        why.append(f"hung: still running after {limit_s:g} s")
    elif ran["exit"] != 0:
        why.append(f"dtrain launch exited {ran['exit']}")
    elif metrics is None:
        why.append("no metrics.json")
    if metrics is not None and count < 1:
        why.append("metrics.json says no restart")
    skipped = not_fired(case, fired, folder, pushes_of(metrics))
    if any(reason is None for reason in skipped.values()):
        why.append(f"{len(fired)} of {len(case.faults)} fault(s) fired")
    recovered = not why
    same_bits = exactly_once = sent_same = None
    if not whole["ok"]:
        why.append("the uninterrupted run failed" + (" (hung)" if whole["hang"] else "") + ": " + whole["tail"][-300:])
    if metrics is not None and case.synchronous and whole["ok"]:
        same_bits = metrics["weights_sha256"] == whole["sha"]
        if not same_bits:
            why.append(f"weights {metrics['weights_sha256'][:12]} != uninterrupted {whole['sha'][:12]}")
    pushes = pushes_of(metrics)
    if metrics is not None and servers_of(case.variant):
        exactly_once = (
            bool(pushes)
            and bool(pushes.get("exactly_once"))
            and all(a == pushes["sent"] for a in pushes.get("applied", [None]))
        )
        if not exactly_once:
            why.append(f"pushes not exactly once: {json.dumps(pushes)[:300]}")
        if whole["pushes"] is not None and pushes is not None:  # (ps-async: how they split among workers varies)
            mine, theirs = pushes.get("sent") or [], whole["pushes"].get("sent") or []
            sent_same = mine == theirs if case.synchronous else sum(mine) == sum(theirs)
            if not sent_same:
                why.append(f"pushes sent {mine} != uninterrupted {theirs}")
    if ran["left"]:
        why.append(f"{len(ran['left'])} process(es) left")
    if ran["shm_left"]:
        why.append(f"{len(ran['shm_left'])} /dev/shm segment(s) left")
    attempts = restarts.get("attempts", [])
    return {
        "case": number, "spec": case.spec, "kind": case.kind, "variant": case.variant,
        "paradigm": paradigm_of(case.variant), "ranks": case.ranks, "every": case.every,
        "max_restarts": case.max_restarts, "fault": ",".join(case.faults), "rerun": rerun,
        "exit": ran["exit"], "hang": ran["hang"], "seconds": round(ran["seconds"], 3),
        "uninterrupted_seconds": round(whole["seconds"], 3), "recovered": recovered,
        "fired": [f.get("spec") for f in fired], "skipped": skipped, "restarts": count,
        "seconds_lost": restarts.get("seconds_lost"), "steps_lost": restarts.get("steps_lost"),
        "endings": [a.get("ended") for a in attempts],
        "same_bits": same_bits, "exactly_once": exactly_once, "sent_as_uninterrupted": sent_same, "pushes": pushes,
        "processes_seen": ran["processes"], "processes_left": ran["left"], "shm_left": ran["shm_left"],
        "shm_unattributed": ran["shm_unattributed"], "shm_mapped": ran["shm_mapped"], "ok": not why, "why": why,
        "log_tail": "" if not why else log_tail(folder),
    }  # fmt: skip


# --- the summary ---------------------------------------------------------------------------------------------------
def fraction(results: list[dict], key: str) -> str:
    checked = [r[key] for r in results if r[key] is not None]
    return f"{sum(checked)}/{len(checked)}" if checked else "-"


def lost_per_fault(results: list[dict]) -> list[float]:
    return [r["seconds_lost"] / len(r["fired"]) for r in results if r["seconds_lost"] is not None and r["fired"]]


def summary_rows(results: list[dict]) -> list[dict]:
    rows = []
    for kind in [*KINDS, "all"]:
        mine = [r for r in results if kind in ("all", r["kind"])]
        if not mine:
            continue
        lost = lost_per_fault(mine)
        rows.append({"kind": kind, "faults": len(mine), "kills": sum(len(r["fired"]) for r in mine),
                     "recovered": sum(r["recovered"] for r in mine), "same_bits": fraction(mine, "same_bits"),
                     "exactly_once": fraction(mine, "exactly_once"), "hangs": sum(r["hang"] for r in mine),
                     "processes_left": sum(len(r["processes_left"]) for r in mine),
                     "shm_left": sum(len(r["shm_left"]) for r in mine),
                     "lost_median_s": statistics.median(lost) if lost else None,
                     "lost_max_s": max(lost) if lost else None})  # fmt: skip
    return rows


LEGEND = terminal.paragraph(
    "same bits: synchronous runs (ps-sync too) whose final weights_sha256 is the uninterrupted run's; exactly once: "
    "ps-sync and ps-async runs whose servers applied every push sent once; procs, shm left: processes and /dev/shm "
    "segments of the case still there after it; median s, max s: metrics.json's restarts.seconds_lost per kill "
    "fired (a failed attempt's whole time)",
    width=80,
)


def summary_table(rows: list[dict], width=80) -> str:
    header = ["kind", "faults", "recovered", "same bits", "exactly once", "hangs", "procs left", "shm left",
              "median s", "max s"]  # fmt: skip
    cells = [[r["kind"], str(r["faults"]), f"{r['recovered']}/{r['faults']}", r["same_bits"], r["exactly_once"],
              str(r["hangs"]), str(r["processes_left"]), str(r["shm_left"]),
              *(["-", "-"] if r["lost_median_s"] is None else [f"{r['lost_median_s']:.2f}", f"{r['lost_max_s']:.2f}"])]
             for r in rows]  # fmt: skip
    return terminal.table(header, cells, left=(0,), width=width)


def paradigm_table(results: list[dict], width=80) -> str:
    header = ["paradigm", "faults", "kills", "ranks", "kinds", "recovered", "checks ok"]
    cells = []
    for paradigm in sorted({r["paradigm"] for r in results}):
        mine = [r for r in results if r["paradigm"] == paradigm]
        checks = [r["same_bits"] if r["same_bits"] is not None else r["exactly_once"] for r in mine]
        checks = [c for c in checks if c is not None]
        ranks, kinds = sorted({r["ranks"] for r in mine}), sorted({r["kind"] for r in mine})
        cells.append([paradigm, str(len(mine)), str(sum(len(r["fired"]) for r in mine)), ",".join(map(str, ranks)),
                      " ".join(kinds), f"{sum(r['recovered'] for r in mine)}/{len(mine)}",
                      f"{sum(checks)}/{len(checks)}"])  # fmt: skip
    return terminal.table(header, cells, left=(0, 4), width=width)


def missed(rows: list[dict]) -> list[str]:
    total = rows[-1]
    out = []
    if total["recovered"] != total["faults"]:
        out.append(f"recovered {total['recovered']} of {total['faults']}")
    for key, what in (("same_bits", "same bits"), ("exactly_once", "exactly once")):
        if total[key] != "-" and len(set(total[key].split("/"))) > 1:
            out.append(f"{what} {total[key]}")
    for key in ("hangs", "processes_left", "shm_left"):
        if total[key]:
            out.append(f"{key.replace('_', ' ')}: {total[key]}")
    return out


# --- main ----------------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--faults", type=int, default=100, help="cases to draw (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (default %(default)s)")
    parser.add_argument("--limit-s", type=float, default=120.0, help="a case's wall-clock limit (default %(default)s)")
    parser.add_argument("--every", type=int, default=EVERY, help="--checkpoint-every (default %(default)s)")
    parser.add_argument("--only", type=int, help="run only case N (1-based) of the draw")
    parser.add_argument("--case", help="run this one case: VARIANT/RANKS/EVERY/MAX_RESTARTS/FAULTS")
    parser.add_argument("--out", help="folder for soak.txt, .json, .jsonl (default docs/bench/soak/; a run of one "
                                      "case writes only if given)")  # fmt: skip
    parser.add_argument("--work", help="folder for the cases' runs (default: a temporary one, removed at the end "
                                       "unless a case failed)")  # fmt: skip
    args = parser.parse_args()
    caps = capabilities()
    if args.case:
        cases = [(1, Case.parse(args.case))]
    else:
        drawn = draw_all(args.faults, args.seed, caps, args.every)
        if args.only is not None and not 1 <= args.only <= len(drawn):
            parser.error(f"--only {args.only}: the draw has cases 1 to {len(drawn)}")
        cases = [(args.only, drawn[args.only - 1])] if args.only else list(enumerate(drawn, 1))
    alone = bool(args.case or args.only)
    out = Path(args.out) if args.out else (None if alone else Path("docs/bench/soak"))
    not_drawn = [k for k, ok in (("restart and two (several faults)", caps["several"]),
                                 ("server, and parameter-server paradigms", caps["server"])) if not ok]  # fmt: skip
    if not_drawn and not args.case:
        print(terminal.paragraph(f"soak: faults.py cannot express these yet, not drawn: {'; '.join(not_drawn)}"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dtrain-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    baselines = Baselines(work, args.limit_s)
    results = []
    started = time.monotonic()
    for number, case in cases:
        rerun = (f"python scripts/soak.py --case {shlex.quote(case.spec)}" if args.case else
                 f"python scripts/soak.py --faults {args.faults} --seed {args.seed} --only {number}"
                 + (f" --every {args.every}" if args.every != EVERY else ""))  # fmt: skip
        result = run_case(number, case, work, baselines, args.limit_s, rerun)
        results.append(result)
        verdict = "ok" if result["ok"] else "FAIL"
        print(f"{number:3d} {case.kind:10s} {case.spec:44s} {result['seconds']:5.1f} s  {verdict}", flush=True)
        for why in result["why"]:
            print(terminal.paragraph(why, "      ", "        "), flush=True)
        if not result["ok"]:
            print(f"      again: {rerun}", flush=True)
    took = time.monotonic() - started
    rows = summary_rows(results)
    text = "\n".join([summary_table(rows), LEGEND, "", paradigm_table(results)])
    print()
    print(text)
    unattributed = sorted({name for r in results for name in r["shm_unattributed"]})
    stayed = [name for name in unattributed if (Path("/dev/shm") / name).exists()]
    failed = missed(rows)
    print(terminal.paragraph(
        f"{len(results)} case(s) in {took:.0f} s ({len(baselines.known)} uninterrupted runs among them); "
        f"{sum(len(r['fired']) for r in results)} kills; "
        f"{sum(len(r['skipped']) for r in results)} fault(s) that legitimately did not fire (raw results: skipped); "
        f"/dev/shm files new during a case that nothing tied to it "
        f"(other jobs): {len(unattributed)}, {len(stayed)} of them still there"))  # fmt: skip
    sent = [r["sent_as_uninterrupted"] for r in results if r["sent_as_uninterrupted"] is not None]
    bad = [r for r in results if not r["ok"]]
    verdict = "all met" if not failed else "MISSED: " + "; ".join(failed)
    verdict += f"; pushes sent as in the uninterrupted run (ps): {sum(sent)}/{len(sent)}"
    verdict += "".join(f"\n  case {r['case']} FAILED ({r['spec']}): {'; '.join(r['why'])}" for r in bad)
    print("\n".join([terminal.paragraph("targets: " + verdict.split("\n")[0]), *verdict.split("\n")[1:]]))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        meta = run_meta(seed=args.seed, faults=len(results), limit_s=args.limit_s, every=args.every,
                        capabilities=caps, seconds=round(took, 1), load=os.getloadavg())  # fmt: skip
        (out / "soak.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
        (out / "soak.json").write_text(json.dumps({**meta, "summary": rows, "missed": failed,
                                                   "failed_cases": [r["case"] for r in bad],
                                                   "shm_unattributed": unattributed,
                                                   "shm_unattributed_stayed": stayed}, indent=1))  # fmt: skip
        whole = "\n".join([summary_table(rows, None), LEGEND, "", paradigm_table(results, None)])
        (out / "soak.txt").write_text(
            f"{meta['command']}   # {meta['date']}, {meta['machine']}, "
            f"{meta['cpu_count']} cores, {took:.0f} s\n\n{whole}\n\ntargets: {verdict}\n"
        )
        print(f"wrote {out}/soak.txt, soak.json and soak.jsonl")
    if args.work is None and not failed and all(r["ok"] for r in results):
        shutil.rmtree(work, ignore_errors=True)
    elif not all(r["ok"] for r in results):
        print(f"the failed cases' folders are in {work}")
    return 1 if failed or not all(r["ok"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Starting a job on N ranks, and stopping it: every process of it, whatever ends the launcher.

What ``mpiexec -n 3 python -m dtrain.comm.run script.py`` starts (MPICH's hydra; Open MPI's prterun looks alike)::

    dtrain launch ── mpiexec ── hydra_pmi_proxy ─┬─ rank 0     each box below the launcher is a session of its own
                    (session)   (session)        ├─ rank 1     (setsid): no one signal, and no process group,
                                                 └─ rank 2     reaches them all

Three things a learner meets here, handled once:

1. **The machine.** One BLAS/Numba thread per rank, MPICH's yielding wait when ranks outnumber cores, and the
   ``mpiexec`` installed beside this Python (:func:`mpiexec_path`): one from another MPI on PATH would start N
   independent worlds of one rank each.
2. **Ctrl-C must stop every rank.** The terminal's Ctrl-C reaches the launcher only. The launcher forwards the signal
   (SIGINT, SIGTERM, SIGHUP) to mpiexec, which passes it on to the ranks; a rank stuck inside an MPI call cannot act on
   it, and hydra's mpiexec exits at once without waiting for its ranks, so after a grace period the launcher kills every
   process of the job it can still find: it keeps the job's process tree (by PID and start time, never by name) from the
   moment the signal came. ``dtrain launch`` then ends by that same signal, so the shell reports 128 + its number (130
   for Ctrl-C) and a script that ran it stops as well. The same happens on any other way out of :func:`launch` (its
   timeout, an exception), and on Linux mpiexec is told when the launcher itself dies (``PR_SET_PDEATHSIG``), even by
   SIGKILL, which nothing can catch.
3. **A crash on one rank hangs the others.** The target runs under ``python -m dtrain.comm.run``: a failure on any
   rank ends the whole job, and says why once (see :mod:`dtrain.comm.run` and :mod:`dtrain.comm.mpi`).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dtrain import terminal
from dtrain.comm import flavours, usable_cores
from dtrain.comm.banners import WAIT_S, Banners
from dtrain.comm.flavours import Flavour, Mpich
from dtrain.comm.hosts import Host, check_fits
from dtrain.errors import UserError

# One thread per rank for every threaded library a rank may load: BLAS (OpenBLAS, MKL), OpenMP, Numba.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
# How long the ranks have to end on their own after the signal is forwarded, before they are killed. Long enough for
# a rank to write its last lines; short enough that a person at the terminal never wonders whether Ctrl-C worked.
GRACE_S = 3.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class JobInterrupted(KeyboardInterrupt):
    """The launcher was sent ``signum`` and has stopped the whole job; a shell's exit status for it is 128 + signum.

    A KeyboardInterrupt, so a notebook cell or a script that launched the job is interrupted as by Ctrl-C.
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_status = 128 + signum


def mpiexec_path() -> Path:
    """The ``mpiexec`` that belongs to this Python's environment, else the first on PATH; an error if neither."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return local
    found = shutil.which("mpiexec")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "no mpiexec found beside this Python or on PATH: install dtrain into a virtualenv "
        "(pip install -e .), which brings the mpich wheel and its mpiexec"
    )


def launch_env(nranks: int, base: dict | None = None, flavour: Flavour | None = None) -> dict:
    """The environment for ``nranks`` ranks on this machine: one thread each, yielding waits when oversubscribed,
    and the launcher's terminal's width as ``COLUMNS`` (what the ranks print is fitted to it, :mod:`dtrain.terminal`).

    ``flavour`` says how the MPI spells the yielding wait (by default: that of :func:`mpiexec_path`'s MPI). Values
    already set by the user win (``setdefault``), so ``OMP_NUM_THREADS=4 dtrain launch ...`` still works.
    """
    env = dict(os.environ if base is None else base)
    for name in THREAD_VARIABLES:
        env.setdefault(name, "1")
    # a rank's stdout is a pipe to mpiexec: tell it how wide the terminal at the end of the launcher's is
    width = terminal.columns(sys.stdout) or terminal.columns(sys.stderr)
    if width is not None:
        env.setdefault("COLUMNS", str(width))
    if nranks > usable_cores():  # the same test as dtrain.comm.wait_mode's, so both agree on 'oversubscribed'
        for name, value in (flavour or _flavour()).yield_env().items():
            env.setdefault(name, value)
    return env


def mpiexec_command(
    nranks: int,
    target: list[str],
    cwd=None,
    hosts: list[Host] | None = None,
    oversubscribe: bool = False,
    env: dict | None = None,
) -> list[str]:
    """The command line that runs ``target`` (a script and its args, or ``-m module ...``) on ``nranks`` ranks.

    The target runs under ``python -m dtrain.comm.run`` (:mod:`dtrain.comm.run`), so a failure on any rank ends the
    whole job, said once. A script that does not exist is refused here, in one line, before mpiexec starts N Pythons
    to say so N times (``cwd``: the folder the ranks start in, where a relative path is looked up).

    ``hosts`` (:mod:`dtrain.comm.hosts`) places the ranks on those machines, at most their slots unless
    ``oversubscribe``; without it every rank runs here, as many as asked. The flags are spelled for the MPI this
    ``mpiexec`` belongs to (:mod:`dtrain.comm.flavours`); ``env`` is the job's environment, whose dtrain settings
    must reach the other machines' ranks too (:func:`forwarded`).
    """
    if nranks < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {nranks}")
    if not target:
        raise ValueError("nothing to launch: give a script path or -m module")
    script = target[0]
    path = Path(cwd or ".") / script
    if not script.startswith("-") and not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"{script} {what}: give a Python script, or -m MODULE to run a module")
    if hosts is not None:
        check_fits(nranks, hosts, oversubscribe, "the hosts given")
    flags = mpiexec_flags(hosts, oversubscribe, forwarded(os.environ if env is None else env))
    return [str(mpiexec_path()), "-n", str(nranks), *flags, sys.executable, "-m", "dtrain.comm.run", *target]


FORWARDED_TOO = ("PYTHONPATH", "COLUMNS")


def forwarded(env: dict) -> list[str]:
    """The variables of ``env`` a rank on another machine must see: the threads per rank, dtrain's settings
    (``DTRAIN_TIMEOUT``, ``DTRAIN_DEBUG`` ...), ``PYTHONPATH`` and the terminal's width. (MPICH's hydra passes
    every variable on by itself; Open MPI passes only its own ``OMPI_MCA_*`` unless each other one is named.)"""
    return sorted(
        name for name in env if name in THREAD_VARIABLES or name.startswith("DTRAIN_") or name in FORWARDED_TOO
    )


def mpiexec_flags(hosts: list[Host] | None = None, oversubscribe: bool = False, forward=()) -> list[str]:
    """What goes between ``mpiexec -n N`` and the program, in the spelling of :func:`mpiexec_path`'s MPI: the hosts
    and the variables to ``forward`` to them, oversubscription (always on this machine alone), and what running as
    root needs (said on stderr, once)."""
    flavour = flavours.detect(mpiexec_path())
    flags = []
    if hosts is not None:
        flags += flavour.hosts_args(hosts) + flavour.forward_args(forward)
    if hosts is None or oversubscribe:  # one machine: as many ranks as asked, as MPICH's hydra always allows
        flags += flavour.oversubscribe_args()
    if flavour.root_args() and flavours.running_as_root():
        flags += flavour.root_args()
        _say_once(f"dtrain launch: running as root, so {flavour.name} is given {' '.join(flavour.root_args())}")
    return flags


def _flavour() -> Flavour:
    try:
        return flavours.detect(mpiexec_path())
    except FileNotFoundError:  # no mpiexec at all: whoever launches will say so; the environment is MPICH's
        return Mpich("MPICH")


def ranks_per_host(nranks: int, hosts: list[Host] | None) -> int:
    """The most ranks any one machine gets: all of them without hosts; hosts fill their slots in order, then wrap."""
    if hosts is None:
        return nranks
    placed = [0] * len(hosts)
    left = nranks
    while left > 0:
        for i, host in enumerate(hosts):
            take = min(max(host.slots, 1), left)
            placed[i] += take
            left -= take
            if left == 0:
                break
    return max(placed)


def launch(
    nranks: int,
    target: list[str],
    timeout: float | None = None,
    capture: bool = False,
    hosts: list[Host] | None = None,
    oversubscribe: bool = False,
    **kwargs,
):
    """Run ``target`` on ``nranks`` ranks (on ``hosts``, see :func:`mpiexec_command`) and return the
    ``subprocess.CompletedProcess``.

    ``timeout`` (seconds) kills the whole job if it has not finished, so a bug is a failure, not a hang. SIGINT,
    SIGTERM or SIGHUP sent to this process stop the whole job (module docstring) and raise :class:`JobInterrupted`,
    which carries what the job wrote (``output``, ``stderr``) when ``capture`` is on.
    """
    env = launch_env(ranks_per_host(nranks, hosts), kwargs.pop("env", None))
    cmd = mpiexec_command(nranks, target, kwargs.get("cwd"), hosts, oversubscribe, env)
    pipe = subprocess.PIPE if capture else None
    with Job(cmd, env=env, stdout=pipe, stderr=pipe, text=True, **kwargs) as job:
        try:
            out, err = job.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.stop(signal.SIGKILL)
            out, err = job.process.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        except JobInterrupted as interrupted:
            job.stop(interrupted.signum)
            interrupted.output, interrupted.stderr = job.process.communicate()  # what it wrote before it ended
            raise
    return subprocess.CompletedProcess(cmd, job.process.returncode, out, err)


@dataclass
class Watched:
    """How a job watched by :func:`launch_watched` ended: its exit status, the end of what it wrote (stdout and stderr
    together, as they came), and which process was which rank (pid -> rank, for the ranks seen on this machine)."""

    returncode: int
    tail: str  # the end of its stdout, then the end of its stderr (MPI's banners included)
    ranks: dict[int, int]
    seconds: float
    ended: list[int]  # the ranks in the order their processes ended (the first: the one that died, if one did)
    first_to_end: int | None  # the rank that ended first, if that is known for sure (see Endings)
    banners: str = ""  # MPI's own words on how the job ended, kept off the terminal (dtrain.comm.banners)


TAIL_BYTES = 64 * 1024  # enough for MPI's report of a dead rank and the tracebacks before it


def launch_watched(nranks: int, target: list[str], hosts=None, oversubscribe: bool = False, env=None) -> Watched:
    """:func:`launch`, for a launcher that must say afterwards how the job ended (``dtrain launch``): what the job
    writes goes on to this process's stdout and stderr as it comes, but for MPI's own banners about the ending
    (:class:`Banners`, returned for the caller to explain or show), and its end is kept; every moment the job runs,
    its processes are looked at for the rank MPI gave them (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK`` in their
    environment), since a dead rank can no longer say who it was, and MPICH's report names only its PID.

    SIGINT, SIGTERM and SIGHUP stop the whole job and raise :class:`JobInterrupted`, as with :func:`launch`, after
    one line that says the job has ended (MPI's own lines about it are not shown)."""
    env = launch_env(ranks_per_host(nranks, hosts), env)
    cmd = mpiexec_command(nranks, target, None, hosts, oversubscribe, env)
    tails = (bytearray(), bytearray())
    banners = (Banners(), Banners())  # (stdout's and stderr's)

    reader_gone = threading.Event()  # stdout's reader has gone (``dtrain launch ... | head``)

    def echo(fd, sink, tail, banner):
        """Copy what comes on ``fd`` to ``sink`` as it comes, but MPI's banners, keeping its end; until the job
        closes the pipe."""

        def show(data: bytes) -> None:
            if not data:
                return
            try:  # a closed terminal, or a stream without bytes, must not stop the reading (the job would block)
                if hasattr(sink, "buffer"):
                    sink.buffer.write(data)
                else:
                    sink.write(data.decode(errors="replace"))
                sink.flush()
            except BrokenPipeError:
                if sink is sys.stdout:  # nobody reads what the job prints: it stops, as under mpiexec alone
                    reader_gone.set()
            except Exception:
                pass

        try:
            while True:
                if not select.select([fd], [], [], WAIT_S)[0]:
                    show(banner.due(time.monotonic()))
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                show(banner.feed(chunk, time.monotonic()))
                tail.extend(chunk)
                del tail[:-TAIL_BYTES]
            show(banner.finish())
        finally:
            os.close(fd)

    started = time.monotonic()
    with Job(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as job, Endings() as endings:
        # The readers own copies of the pipes' descriptors: however the job ends, Popen closing its own never pulls
        # a descriptor from under a reader.
        streams = ((job.process.stdout, sys.stdout, tails[0], banners[0]),
                   (job.process.stderr, sys.stderr, tails[1], banners[1]))  # fmt: skip
        readers = [threading.Thread(target=echo, args=(os.dup(pipe.fileno()), sink, tail, banner), daemon=True)
                   for pipe, sink, tail, banner in streams]  # fmt: skip
        for reader in readers:
            reader.start()
        try:
            while job.process.poll() is None:
                if len(job.ranks) < nranks:  # (until every rank has been seen: then nothing is left to look for)
                    for pid in job.note_ranks():
                        endings.watch(pid, job.ranks[pid])
                if reader_gone.is_set():
                    job.stop(signal.SIGTERM)
                    raise BrokenPipeError("the reader of stdout has gone")  # (dtrain's main: exit 0, quietly)
                time.sleep(0.1)
        except JobInterrupted as interrupted:
            job.stop(interrupted.signum)
            for reader in readers:
                reader.join(timeout=5)
            name = signal_name(interrupted.signum)
            left = job.left(within=GRACE_S)  # (a process killed a moment ago may take that moment to end)
            _say(f"dtrain launch: stopped by {name}; every rank ended" if not left else
                 f"dtrain launch: stopped by {name}; processes {left} could not be ended")  # fmt: skip
            raise
        for reader in readers:
            reader.join(timeout=5)  # (what the ranks wrote last is still in the pipes)
    text = "\n".join(bytes(tail).decode(errors="replace") for tail in tails)
    held = "".join(bytes(b.held).decode(errors="replace") for b in banners)
    seconds = time.monotonic() - started
    return Watched(job.process.returncode, text, dict(job.ranks), seconds, list(endings.order),
                   endings.first(nranks), held)  # fmt: skip


class Endings:
    """The order in which the ranks' processes end, seen from outside the job.

    When one rank dies, MPI's process manager kills the others, and its report names one of the processes it
    reaped, often not the one that died first. A thread here sleeps in ``poll`` on a Linux ``pidfd`` of each rank's
    process (readable when that process ends, whoever its parent is), so it wakes the moment the first one ends,
    before the process manager has even begun to kill the rest. The first is known for sure only if every rank was
    watched, alive, before it ended (a rank that dies in its first tenth of a second, or one on another machine,
    leaves it unknown; so do systems without pidfds)."""

    def __init__(self):
        self.order: list[int] = []
        self._fds: dict[int, int] = {}  # pidfd -> rank
        self._wake_read = self._wake_write = None
        self.watched = 0  # ranks watched while alive
        self.watched_at_first_end: int | None = None
        self.late = False  # a rank was seen only once it had ended
        self.first_together: list[int] = []  # the ranks seen ending first, all at once
        self._poll = select.poll() if hasattr(os, "pidfd_open") else None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if self._poll is not None:
            self._wake_read, self._wake_write = os.pipe()
            self._poll.register(self._wake_read, select.POLLIN)
            self._thread.start()
        return self

    def watch(self, pid: int, rank: int) -> None:
        if self._poll is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # it has ended already (or pidfds are not allowed here)
            return
        stat = _stat(pid)
        if stat is None or stat[0] == "Z":
            self.late = True
        else:
            self.watched += 1
        self._fds[fd] = rank
        self._poll.register(fd, select.POLLIN)
        os.write(self._wake_write, b"x")  # (poll's set changed: look again)

    def first(self, nranks: int) -> int | None:
        """The rank that ended first, if every one of the ``nranks`` was watched alive before it did."""
        if len(self.first_together) == 1 and not self.late and self.watched_at_first_end == nranks:
            return self.first_together[0]
        return None

    def _run(self) -> None:
        while not self._closed:
            together = []  # ranks that ended between two looks: their order is not known
            for fd, _ in self._poll.poll():
                if fd == self._wake_read:
                    os.read(fd, 4096)
                    continue
                together.append(self._fds.pop(fd))
                self._poll.unregister(fd)
                os.close(fd)
            if together and not self.order:
                self.watched_at_first_end, self.first_together = self.watched, sorted(together)
            self.order += together

    def __exit__(self, *exc_info):
        if self._poll is None:
            return
        self._closed = True
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # (never seen): its descriptors stay open rather than be closed under it
            return
        for fd in [*self._fds, self._wake_read, self._wake_write]:
            os.close(fd)


class Job:
    """``mpiexec`` started as a job that always ends whole: a context manager around ``subprocess.Popen``.

    Inside the ``with`` block (in the main thread), SIGINT, SIGTERM and SIGHUP raise :class:`JobInterrupted`, and
    leaving the block that way or any other stops whatever is left of the job. :meth:`stop` is the one way it ends.
    A signal this process ignores (``nohup`` ignores SIGHUP) stays ignored.
    """

    def __init__(self, cmd: list[str], who: str = "dtrain launch", **popen_kwargs):
        self._cmd, self._popen_kwargs, self.who = cmd, popen_kwargs, who  # (who: the command that speaks)
        self.process: subprocess.Popen | None = None
        self._known: dict[int, int] = {}  # every process of the job seen so far: pid -> its start time
        self._hurry = False
        self._previous = {}
        self.received: int | None = None  # the signal that interrupted the job, if one did
        self._started = time.time()
        self.ranks: dict[int, int] = {}  # pid -> rank, for the processes note_ranks has seen

    def __enter__(self):
        self._started = time.time()
        if threading.current_thread() is threading.main_thread():  # (Python lets only the main thread catch signals)
            for signum in FORWARDED:  # before mpiexec starts: no moment when a signal finds the job unguarded
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._interrupted)
        try:
            self.process = subprocess.Popen(  # its own session: a Ctrl-C at the terminal reaches the launcher only
                self._cmd, start_new_session=True, preexec_fn=_die_with_parent(), **self._popen_kwargs
            )
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc_info):
        try:
            if self.process.poll() is None or self._alive():
                self.stop(self.received or signal.SIGTERM)
        finally:
            self._restore()
            self.process.__exit__(*exc_info)
            if self.process.returncode != 0:  # killed or aborted: its ranks never removed their shared memory
                free_shared_memory(self._started)

    def _interrupted(self, signum, frame):
        self.received = signum
        self._hurry_on_next_signal()  # from here on, a second signal cuts the grace short: it never skips the cleanup
        _say(f"{self.who}: {signal_name(signum)}: stopping every rank ({GRACE_S:g} s to end, then killed; Ctrl-C "
             "again: now)")  # fmt: skip
        raise JobInterrupted(signum)  # unwinds communicate(); the caller or __exit__ stops the job

    def stop(self, signum: int) -> None:
        """Send ``signum`` to mpiexec, give the job :data:`GRACE_S` to end, then SIGKILL every process left of it.

        A second signal during the grace period means: now.
        """
        self._hurry_on_next_signal()
        self._known.update(_tree(self.process.pid))  # the tree is whole only until mpiexec ends: see it first
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signum)  # mpiexec's process group (its own session: itself, at least)
            except OSError:  # it ended in between
                pass
        deadline = time.monotonic() + (0 if signum == signal.SIGKILL else GRACE_S)
        while not self._hurry and time.monotonic() < deadline and self._alive():
            self.process.poll()  # reap mpiexec as soon as it ends (a zombie would count as alive)
            time.sleep(0.02)
        for pid, started in self._known.items():
            _signal(pid, started, signal.SIGKILL)
        self.process.wait()

    def left(self, within: float = 0.0) -> list[int]:
        """The job's processes still running after waiting up to ``within`` seconds for them to end."""
        deadline = time.monotonic() + within
        while True:
            left = [pid for pid, started in self._known.items() if _running(pid, started)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)

    def note_ranks(self) -> list[int]:
        """Look at the job's processes now, note the rank of each new one MPI started as a rank; return those pids.

        A process that is not a rank yet may still become one (forked by MPI's proxy, its program not started), so
        it is looked at again next time; a rank's own children inherit its environment and are not ranks."""
        if self.process.poll() is None:
            self._known.update(_tree(self.process.pid))
        new = []
        for pid in self._known.keys() - self.ranks.keys():
            stat = _stat(pid)
            rank = _rank_of(pid) if stat is not None and stat[1] not in self.ranks else None
            if rank is not None:
                self.ranks[pid] = rank
                new.append(pid)
        return new

    def _hurry_on_next_signal(self) -> None:
        for signum in self._previous:
            signal.signal(signum, self._now)

    def _now(self, signum, frame):
        self._hurry = True

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _alive(self) -> bool:
        if self.process.poll() is None:  # while mpiexec lives, what it starts belongs to the job
            self._known.update(_tree(self.process.pid))
        return any(_running(pid, started) for pid, started in self._known.items())


def signal_name(signum: int) -> str:
    """A signal as a person at a terminal calls it: "Ctrl-C" for SIGINT, else its name ("SIGTERM")."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


_said: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        _say(text)


def _say(text: str) -> None:
    """One line on stderr, if stderr can still take it (a closed terminal or pipe must not stop the cleanup)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


# ----------------------------------------------------------------------------------------------------------------
# The job's processes, by PID and start time. Linux's /proc gives both; elsewhere `ps` gives the tree (no start times,
# so a PID reused within the grace period would be mistaken for the job's: a risk of seconds, on systems without /proc).
# ----------------------------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid`` from /proc, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (command name)", which may hold spaces
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def _tree(root: int) -> dict[int, int]:
    """``root`` and all its descendants now: pid -> start time (0 where unknown)."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := _stat(int(entry))) is not None:
                children.setdefault(stat[1], []).append(int(entry))
                started[int(entry)] = stat[2]
    else:
        try:
            listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        for line in listing.splitlines():
            pid, ppid = map(int, line.split())
            children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = started.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return tree


RANK_VARIABLES = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=")  # MPICH's hydra, Open MPI


def _rank_of(pid: int) -> int | None:
    """The rank MPI gave process ``pid`` (from its environment, in /proc), or None if it is not a rank."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = f.read().split(b"\0")
    except OSError:
        return None
    for variable in variables:
        if variable.startswith(RANK_VARIABLES) and variable.split(b"=", 1)[1].isdigit():
            return int(variable.split(b"=", 1)[1])
    return None


def _running(pid: int, started: int) -> bool:
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started  # a zombie has ended; another start: reused PID


def _signal(pid: int, started: int, signum: int) -> None:
    if _running(pid, started):
        try:
            os.kill(pid, signum)
        except OSError:  # it ended in between
            pass


SHARED_MEMORY = Path("/dev/shm")
SHARED_MEMORY_GRACE_S = 2.0  # how long an aborted job's ranks may take to let go of their segment


def free_shared_memory(since: float) -> None:
    """Remove the shared-memory segments (``/dev/shm/mpich_shm_*``, ~3 MB each) that MPICH's ranks made since
    ``since`` and that no process maps any more.

    The ranks on a machine share one segment; the last to attach removes its name, so a job that ends normally leaves
    nothing. A job killed or aborted before that leaves it, in memory, until the machine restarts: a test suite that
    aborts jobs on purpose left 2.3 GB here in a day. A segment another job still uses is mapped by its ranks
    (``/proc/PID/maps`` names it), so it is kept.
    """
    try:
        mine = [(path, path.stat()) for path in SHARED_MEMORY.glob("mpich_shm_*")]
        made = {path for path, stat in mine if stat.st_ctime >= since - 1 and stat.st_uid == os.getuid()}
        made -= _mapped(made, [Path("/proc/self/maps")])  # this process's own (importing mpi4py made one)
    except OSError:  # no /dev/shm (not Linux), or a segment removed while we looked
        return
    # mpiexec may end a moment before the ranks it killed have unmapped the segment: look again for a little while.
    deadline = time.monotonic() + SHARED_MEMORY_GRACE_S
    while made:
        mapped = _mapped(made)
        for path in made - mapped:
            try:
                path.unlink()
            except OSError:  # removed in between
                pass
        if not mapped or time.monotonic() > deadline:
            return
        made = mapped
        time.sleep(0.05)


def _mapped(paths: set[Path], maps_files=None) -> set[Path]:
    """Those of ``paths`` that a process maps now (as ``/proc/PID/maps`` says; ``maps_files``: only those)."""
    found = set()
    for maps in Path("/proc").glob("[0-9]*/maps") if maps_files is None else maps_files:
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        found |= {path for path in paths if str(path) in text}
    return found


def _die_with_parent():
    """A preexec_fn asking Linux to send mpiexec SIGTERM if the launcher dies, even by SIGKILL; None elsewhere, and
    None in a process with threads (a notebook's kernel), where Python warns that a preexec_fn may deadlock.

    The libc function is looked up here, in the parent, so the child only calls it. A launcher that died before the
    call was made is caught by comparing the parent's PID after it.
    """
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, launcher = 1, os.getpid()

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != launcher:  # it died already: the request came too late to be honoured
            os._exit(1)

    return preexec

"""A job that always ends whole: ``mpiexec`` and every process it started, whatever ends the launcher.

**Ctrl-C must stop every rank.** The terminal's Ctrl-C reaches the launcher only. The launcher forwards the signal
(SIGINT, SIGTERM, SIGHUP) to mpiexec, which passes it on to the ranks; a rank stuck inside an MPI call cannot act on
it, and hydra's mpiexec exits at once without waiting for its ranks, so after a grace period the launcher kills every
process of the job it can still find: it keeps the job's process tree (:mod:`dtrain.launch.processes`) from the moment
the signal came. ``dtrain launch`` then ends by that same signal, so the shell reports 128 + its number (130 for
Ctrl-C) and a script that ran it stops as well. The same happens on any other way out of a :class:`Job` (a timeout,
an exception), and on Linux mpiexec is told when the launcher itself dies (``PR_SET_PDEATHSIG``), even by SIGKILL,
which nothing can catch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from dtrain import terminal
from dtrain.launch import processes

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
            if self.process.returncode != 0 or self.received:  # killed, aborted or stopped: its ranks may not have
                # removed their shared memory
                processes.free_shared_memory(self._started)

    def _interrupted(self, signum, frame):
        self.received = signum
        self._hurry_on_next_signal()  # from here on, a second signal cuts the grace short: it never skips the cleanup
        terminal.tell(f"{self.who}: {signal_name(signum)}: stopping every rank ({GRACE_S:g} s to end, then killed; "
                      "Ctrl-C again: now)")  # fmt: skip
        raise JobInterrupted(signum)  # unwinds communicate(); the caller or __exit__ stops the job

    def stop(self, signum: int) -> None:
        """Send ``signum`` to mpiexec, give the job :data:`GRACE_S` to end, then SIGKILL every process left of it.

        A second signal during the grace period means: now.
        """
        self._hurry_on_next_signal()
        self._known.update(processes.tree(self.process.pid))  # the tree is whole only until mpiexec ends: see it first
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
            processes.send(pid, started, signal.SIGKILL)
        self.process.wait()

    def left(self, within: float = 0.0) -> list[int]:
        """The job's processes still running after waiting up to ``within`` seconds for them to end."""
        deadline = time.monotonic() + within
        while True:
            left = [pid for pid, started in self._known.items() if processes.running(pid, started)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)

    def note_ranks(self) -> list[int]:
        """Look at the job's processes now, note the rank of each new one MPI started as a rank; return those pids.

        A process that is not a rank yet may still become one (forked by MPI's proxy, its program not started), so
        it is looked at again next time; a rank's own children inherit its environment and are not ranks."""
        if self.process.poll() is None:
            self._known.update(processes.tree(self.process.pid))
        new = []
        for pid in self._known.keys() - self.ranks.keys():
            stat = processes.stat_of(pid)
            rank = processes.rank_of(pid) if stat is not None and stat[1] not in self.ranks else None
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
            self._known.update(processes.tree(self.process.pid))
        return any(processes.running(pid, started) for pid, started in self._known.items())


def signal_name(signum: int) -> str:
    """A signal as a person at a terminal calls it: "Ctrl-C" for SIGINT, else its name ("SIGTERM")."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


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

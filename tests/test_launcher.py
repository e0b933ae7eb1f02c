"""``dtrain launch`` stops the whole job: Ctrl-C, SIGTERM or SIGHUP to the launcher leave no process of it behind.

Each test starts the launcher as a user does, waits until the job is really running (every rank started, and for a
training run its first epoch printed), records every process of the job by PID and start time (read from /proc:
never by name, which would also match other jobs), signals the launcher only, and then checks that each of those
processes has ended within a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dtrain.launch import jobs, launcher, processes
from dtrain.launch.banners import WAIT_S, Banners

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc"),
]

RANKS = 4
# mpiexec and hydra's proxy, then the ranks
JOB_PROCESSES = RANKS + 2
ENDED_WITHIN_S = jobs.GRACE_S + 5

TRAIN = ["-m", "dtrain", "train", "--paradigm", "ddp", "--epochs", "1000", "--no-progress"]
HUNG = """
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
print("ready", comm.Get_rank(), flush=True)
comm.Recv(np.zeros(1), source=(comm.Get_rank() + 1) % comm.Get_size())  # never sent: every rank waits forever
"""


class Started:
    """The launcher running ``args``, with its output read as it comes (so a full pipe never blocks the job).

    ``shell``: started by a bash script that goes on after it (``"$@"; echo continued``), in a session of its own,
    as a terminal runs a script. ``ignore``: signals the launcher inherits as ignored, as under ``nohup``.
    ``stderr_gone``: its stderr is a pipe nobody reads any more (writing to it fails), as after a terminal closed.
    """

    def __init__(self, args, cwd, shell: bool = False, ignore=(), stderr_gone: bool = False):
        command = [sys.executable, "-m", "dtrain", "launch", "-n", str(RANKS), *map(str, args)]
        if shell:
            command = ["bash", "-c", '"$@"; echo continued', "script", *command]

        def as_a_terminal_starts_it():
            # a job started in the background without job control inherits SIGINT ignored (`.ci/run &`); a terminal's
            # foreground job never does, and that is the case these tests are about
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN if signum in ignore else signal.SIG_DFL)

        unread, stderr = os.pipe() if stderr_gone else (None, subprocess.PIPE)
        self.process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                        start_new_session=shell, preexec_fn=as_a_terminal_starts_it)  # fmt: skip
        if stderr_gone:
            os.close(unread)
            os.close(stderr)
        self.stdout, self.stderr = [], []
        streams = [(self.process.stdout, self.stdout)] + [(self.process.stderr, self.stderr)] * (not stderr_gone)
        self._readers = [
            threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True) for s, into in streams
        ]
        for reader in self._readers:
            reader.start()

    def wait_until(self, ready, limit: float = 120) -> dict[int, int]:
        """Wait until ``ready(stdout text)`` and every process of the job is up; return the job's processes."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the job ended early:\n{''.join(self.stdout)}{''.join(self.stderr)}"
            tree = processes.tree(self.process.pid)
            if len(tree) >= 1 + JOB_PROCESSES and ready("".join(self.stdout)):
                return tree
            time.sleep(0.2)
        self.process.kill()
        raise AssertionError(f"the job did not start within {limit} s:\n{''.join(self.stdout)}{''.join(self.stderr)}")

    def finish(self, limit: float) -> int:
        status = self.process.wait(limit)
        for reader in self._readers:
            reader.join(5)
        return status


def left_of(tree: dict[int, int], within: float) -> list[int]:
    """The processes of ``tree`` still running after waiting up to ``within`` seconds for them to end."""
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid, started in tree.items() if processes.running(pid, started)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_all(tree):
    for pid, started in tree.items():
        processes.send(pid, started, signal.SIGKILL)


@pytest.mark.parametrize(
    ("job", "signum"),
    [("training", signal.SIGINT), ("training", signal.SIGTERM), ("hung", signal.SIGINT), ("hung", signal.SIGTERM),
     ("hung", signal.SIGHUP)],
    ids=["training-SIGINT", "training-SIGTERM", "hung-SIGINT", "hung-SIGTERM", "hung-SIGHUP"],
)  # fmt: skip
def test_a_signal_to_the_launcher_stops_every_process_of_the_job(tmp_path, job, signum):
    if job == "training":
        args, ready = TRAIN, lambda out: "epoch   1/1000" in out
    else:  # ranks blocked inside MPI_Recv, which no signal handler of Python's can interrupt; no watchdog either
        (tmp_path / "hung.py").write_text(HUNG)
        args, ready = ["--timeout", "0", tmp_path / "hung.py"], lambda out: out.count("ready") == RANKS
    started = Started(args, tmp_path)
    tree = started.wait_until(ready)
    try:
        started.process.send_signal(signum)
        status = started.finish(ENDED_WITHIN_S)
        assert status == -signum, "".join(started.stderr)  # it ends by the signal: a shell says 128 + signum
        assert not left_of(tree, ENDED_WITHIN_S), f"still running after {ENDED_WITHIN_S} s"
        assert "Traceback" not in "".join(started.stderr), "".join(started.stderr)
        # the launcher's own words as it starts and when it is done, and not hydra's ("Press Ctrl-C again ...")
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        assert "".join(started.stderr).splitlines()[-2:] == [
            f"dtrain launch: {name}: stopping every rank (3 s to end, then killed; Ctrl-C again: now)",
            f"dtrain launch: stopped by {name}; every rank ended"]  # fmt: skip
        assert "[mpiexec@" not in "".join(started.stdout + started.stderr)
    finally:
        kill_all(tree)


def test_ctrl_c_in_a_script_stops_the_job_and_the_script(tmp_path):
    """A terminal's Ctrl-C goes to the script and the launcher (their process group). The launcher ends by the
    signal, not with exit 130, so bash stops the script too instead of going on to its next line."""
    (tmp_path / "hung.py").write_text(HUNG)
    started = Started(["--timeout", "0", tmp_path / "hung.py"], tmp_path, shell=True)
    tree = started.wait_until(lambda out: out.count("ready") == RANKS)
    try:
        os.killpg(started.process.pid, signal.SIGINT)
        started.finish(ENDED_WITHIN_S)
        assert "continued" not in "".join(started.stdout), "".join(started.stdout)
        assert not left_of(tree, ENDED_WITHIN_S), f"still running after {ENDED_WITHIN_S} s"
    finally:
        kill_all(tree)


def test_under_nohup_a_hangup_leaves_the_job_running(tmp_path):
    (tmp_path / "hung.py").write_text(HUNG)
    started = Started(["--timeout", "0", tmp_path / "hung.py"], tmp_path, ignore=[signal.SIGHUP])
    tree = started.wait_until(lambda out: out.count("ready") == RANKS)
    try:
        started.process.send_signal(signal.SIGHUP)
        time.sleep(2)
        assert started.process.poll() is None and len(left_of(tree, 0)) == len(tree), "SIGHUP was not ignored"
        started.process.send_signal(signal.SIGINT)
        assert started.finish(ENDED_WITHIN_S) == -signal.SIGINT
        assert not left_of(tree, ENDED_WITHIN_S)
    finally:
        kill_all(tree)


def test_a_hangup_with_stderr_gone_still_stops_the_job(tmp_path):
    """When the terminal or the pipe behind stderr is gone, the launcher cannot say what it does, but still does it."""
    (tmp_path / "hung.py").write_text(HUNG)
    started = Started(["--timeout", "0", tmp_path / "hung.py"], tmp_path, stderr_gone=True)
    tree = started.wait_until(lambda out: out.count("ready") == RANKS)
    try:
        started.process.send_signal(signal.SIGHUP)
        assert started.process.wait(ENDED_WITHIN_S) == -signal.SIGHUP
        assert not left_of(tree, ENDED_WITHIN_S), f"still running after {ENDED_WITHIN_S} s"
    finally:
        kill_all(tree)


def test_a_launcher_killed_outright_still_takes_its_job_down(tmp_path):
    """SIGKILL cannot be caught: Linux tells mpiexec instead (PR_SET_PDEATHSIG), and mpiexec ends its ranks."""
    (tmp_path / "hung.py").write_text(HUNG)
    started = Started(["--timeout", "0", tmp_path / "hung.py"], tmp_path)
    tree = started.wait_until(lambda out: out.count("ready") == RANKS)
    try:
        started.process.kill()
        started.finish(10)
        assert not left_of(tree, ENDED_WITHIN_S), f"still running after {ENDED_WITHIN_S} s"
    finally:
        kill_all(tree)


def test_the_launchers_timeout_stops_every_process_of_the_job(tmp_path):
    (tmp_path / "hung.py").write_text(HUNG)
    seen = {}

    def watch():  # the tree as it is while the job runs (the launcher holds the main thread)
        while not seen.get("done"):
            tree = {pid: t for pid, t in processes.tree(os.getpid()).items() if pid != os.getpid()}
            if len(tree) >= JOB_PROCESSES:
                seen.setdefault("tree", tree)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            env = {**os.environ, "DTRAIN_TIMEOUT": "0"}
            launcher.launch(RANKS, [str(tmp_path / "hung.py")], timeout=15, capture=True, env=env)
    finally:
        seen["done"] = True
        watcher.join(5)
    assert "tree" in seen, "the job never had all its processes running"
    try:
        assert not left_of(seen["tree"], 2), "the timeout left processes of the job running"
    finally:
        kill_all(seen["tree"])


def test_a_missing_script_is_one_line_before_anything_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dtrain", "launch", "-n", "4", "nowhere.py"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "dtrain: error: nowhere.py does not exist: give a Python script, or -m MODULE to run a module"
    ], result.stderr


ABORTS = """
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Allreduce(MPI.IN_PLACE, np.ones(1 << 18))  # through the ranks' shared-memory segment
comm.Barrier()
comm.Abort(3)
"""


def test_an_aborted_job_leaves_no_shared_memory_behind(tmp_path, monkeypatch):
    """MPICH's ranks remove their /dev/shm segment when they end normally; after an Abort the launcher does.

    First the same job with the cleanup turned off, to see that there is something to clean up: the segment is there.
    """
    shm = processes.SHARED_MEMORY
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    script = tmp_path / "aborts.py"
    script.write_text(ABORTS)
    free = processes.free_shared_memory

    def aborted_job_leaves(**patch) -> set:
        before, started = set(shm.glob("mpich_shm_*")), time.time()
        with monkeypatch.context() as m:
            for name, value in patch.items():
                m.setattr(processes, name, value)  # (the Job calls processes.free_shared_memory)
            result = launcher.launch(2, [str(script)], timeout=60, capture=True)
        assert result.returncode != 0, result
        left = set(shm.glob("mpich_shm_*")) - before
        free(started)  # whatever this job left, for the next test
        return left

    if not aborted_job_leaves(free_shared_memory=lambda since: None):
        pytest.skip("this MPI leaves no segment in /dev/shm when a job aborts")
    assert not aborted_job_leaves(), "an aborted job's segment was left in /dev/shm"


# --- MPI's banners: held back when the launcher says how the job ended -------------------------------------------
MPICH_BOX = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 8389 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
"""
OPEN_MPI_FRAME = """--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""


def filtered(data: bytes, chunk: int, pause_after: bytes | None = None) -> tuple[bytes, bytes]:
    """What a :class:`Banners` lets through of ``data`` fed ``chunk`` bytes at a time, and what it held; with
    ``pause_after``, the stream goes quiet for longer than WAIT_S after that piece."""
    banners, shown, now = Banners(), b"", 100.0
    for i in range(0, len(data), chunk):
        piece = data[i : i + chunk]
        shown += banners.feed(piece, now)
        if pause_after is not None and (data[: i + chunk]).endswith(pause_after):
            now += WAIT_S + 0.01
            shown += banners.due(now)
    return shown + banners.finish(), bytes(banners.held)


OURS = b"epoch   1/2  loss 0.8766\n= not MPI's: one equals sign\n\n[1/4] a line of ours\nno newline at the end"


@pytest.mark.parametrize("chunk", [1, 7, 4096])  # however the pipe happens to cut it
def test_mpis_banners_are_held_and_everything_else_passes_whole(chunk):
    data = OURS.replace(b"[1/4]", MPICH_BOX.encode() + b"[1/4]") + b"\n" + OPEN_MPI_FRAME.encode()
    data += b"[mpiexec@vm] Sending Ctrl-C to processes as requested\n[mpiexec@vm] Press Ctrl-C again to force abort"
    shown, held = filtered(data, chunk)
    assert shown == OURS + b"\n"
    assert held.startswith(b"\n=====") and b"YOU CAN IGNORE" in held and b"exited on signal 9" in held
    assert held.endswith(b"Press Ctrl-C again to force abort")


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_a_learners_rules_separators_and_bytes_pass_unchanged(chunk):
    """Rules of = and of dashes, blank lines, a progress bar redrawn with \\r, CRLF and bytes that are not text:
    everything a rank prints that is not MPI's own words goes out byte for byte."""
    ours = (b"=" * 40 + b"\r\n\r\n" + b"-" * 60 + b"\nresults\n" + b"-" * 60 + b"\n[####    ] 40%\r[########] 80%\r"
            + bytes(range(256)) + b"\n=   not a box\n" + b"=" * 30 + b"\n\n\n")  # fmt: skip
    assert filtered(ours, chunk) == (ours, b"")


def test_nothing_waits_long_held_back():
    """A line that might begin a banner waits at most WAIT_S: a rule with nothing after it, a prompt without its
    newline, a bar redrawn in place."""
    banners, t = Banners(), 10.0
    assert banners.feed(b"=" * 40 + b"\n", t) == b""  # (the box may follow)
    assert banners.due(t + WAIT_S / 2) == b"" and banners.due(t + WAIT_S + 0.01) == b"=" * 40 + b"\n"
    assert banners.feed(b"[step 3 of 9] ", t) == b""  # (a partial line: "[mpiexec@" would begin like this)
    assert banners.due(t + WAIT_S + 0.01) == b"[step 3 of 9] "
    assert banners.feed(b"going on\n", t + 1) == b"going on\n"  # the rest of the line follows at once
    assert banners.feed(b"Type a number: ", t + 2) == b"Type a number: "  # cannot be MPI's: out at once


def test_a_frame_of_dashes_that_is_not_about_the_ending_is_shown():
    notice = b"-" * 74 + b"\nA notice from Open MPI about something else.\n" + b"-" * 74 + b"\n"
    assert filtered(notice, 5) == (notice, b"")


def test_a_rank_killed_under_dtrain_launch_is_one_line_of_the_launchers(tmp_path):
    env = {**os.environ, "DTRAIN_FAULT": "1:3"}
    done = subprocess.run([sys.executable, "-m", "dtrain", "launch", "-n", "2", "-m", "dtrain", "train", "--paradigm",
                           "ddp", "--epochs", "1", "--quiet", "--no-progress"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 9 and done.stdout == "", done.stdout
    assert done.stderr == "dtrain launch: rank 1 was killed by SIGKILL; the job ended with mpiexec's exit status 9\n"


def test_a_ranks_exception_is_its_traceback_without_mpis_abort_line(tmp_path):
    (tmp_path / "boom.py").write_text("from mpi4py import MPI\nif MPI.COMM_WORLD.Get_rank() == 1:\n    raise "
                                      "ValueError('boom')\nMPI.COMM_WORLD.Barrier()\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "dtrain", "launch", "-n", "2", "boom.py"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith("uncaught exception (rank 1), ending the job:\nTraceback")
    assert done.stderr.endswith("ValueError: boom\n") and "Abort(" not in done.stdout + done.stderr


def test_ranks_that_all_exit_failing_are_their_own_words_only(tmp_path):
    """sys.exit("why") on every rank: "why", once (dtrain.comm.run), and no line of the launcher's, which would
    have to guess a culprit among ranks that all ended by themselves."""
    (tmp_path / "why.py").write_text("import sys\nsys.exit('why')\n")
    done = subprocess.run([sys.executable, "-m", "dtrain", "launch", "-n", "2", "why.py"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (1, "", "why\n")


def test_a_reader_that_goes_away_stops_the_job(tmp_path):
    """``dtrain launch ... | head -2``: once nobody reads, the job stops (as mpiexec alone stops on a closed pipe)
    and the launcher ends quietly, instead of training on for nobody."""
    (tmp_path / "talk.py").write_text("import os, time\nfor i in range(600):\n"
                                      "    if os.environ.get('PMI_RANK') == '0':  # (one rank: lines whole)\n"
                                      "        print(i, flush=True)\n    time.sleep(0.05)\n")  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(f"{sys.executable} -m dtrain launch -n 2 talk.py | head -2", shell=True, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout.splitlines() == ["0", "1"] and time.monotonic() - started < 15, done.stderr
    assert "Traceback" not in done.stderr

"""The watchdog: a rank stalled in a wait reports whom it waits for and ends the job, under mpiexec and simulated.

Under ``mpiexec -n 3`` rank 1 never joins (it sleeps) while ranks 0 and 2 wait for it: in a ring all-reduce on a
plain ``MPI.COMM_WORLD``, inside MPI's own ``Allreduce``, and in a point-to-point receive. The job must end within
``S + 10`` seconds with a non-zero status and a report on stderr naming a waiting rank, the operation, the peer
where one is known, and the call number. The same on the simulator; and nothing fires when nothing is stalled.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from mpi_util import run_mpi_code

from dtrain.collectives import ring
from dtrain.comm import sim, watchdog
from dtrain.comm.wrapper import layers

S = 3  # seconds: the timeout of the MPI tests
HEADLINE = re.compile(
    r"dtrain watchdog: (?:simulated )?rank (\d+) of 3.*? has waited ([\d.]+) s in (.*); "
    r"one wait may last at most DTRAIN_TIMEOUT=([\d.]+) s: aborting the job"
)


@pytest.fixture(autouse=True)
def disarmed():
    """Every test starts and ends with the watchdog off in this process."""
    watchdog.configure(None)
    yield
    watchdog.configure(None)


def reports(stderr: str) -> list[tuple[int, str]]:
    """(rank, what it waited in) of every report's headline."""
    return [(int(m.group(1)), m.group(3)) for m in HEADLINE.finditer(stderr)]


# --- under mpiexec ----------------------------------------------------------------------------------------------
SCRIPT = """
import time
import numpy as np
from mpi4py import MPI
from dtrain import collectives
from dtrain.collectives import ring
from dtrain.comm import watchdog
from dtrain.comm.watchdog import WatchedComm

comm = MPI.COMM_WORLD
buf = np.ones(1024, dtype=np.float32)  # 4 KiB

def step(case):
    if case == "front door ring":
        collectives.allreduce(comm, buf, algorithm="ring")
    elif case == "ring":
        token = watchdog.begin(comm, "allreduce/ring")
        try:
            ring.allreduce(comm, buf)
        finally:
            watchdog.end(token)
    elif case == "front door mpi":
        collectives.allreduce(comm, buf, algorithm="mpi")
    elif case == "mpi":
        with watchdog.watching(comm, "allreduce/mpi"):
            comm.Allreduce(MPI.IN_PLACE, buf)
    elif case == "WatchedComm mpi":
        WatchedComm(comm).Allreduce(MPI.IN_PLACE, buf)
    elif case in ("recv", "WatchedComm recv"):
        peer = WatchedComm(comm) if case == "WatchedComm recv" else comm
        if comm.Get_rank() == 0:
            with watchdog.watching(comm, "waiting for a gradient from worker 1", peer=1, tag=7):
                peer.Recv(buf, source=1, tag=7)
        elif comm.Get_rank() == 1:
            comm.Send(buf, dest=0, tag=7)

step(CASE)  # call #1: everyone is there
comm.Barrier()
if comm.Get_rank() == 1:
    time.sleep(SLEEP)  # rank 1 does not come to call #2 (for SLEEP seconds)
step(CASE)
"""


def run_stalled(case: str, tmp_path, monkeypatch, timeout: float = S, sleep: float = 60):
    """Run SCRIPT on 3 ranks with DTRAIN_TIMEOUT=timeout; return (result, wall seconds)."""
    monkeypatch.setenv(watchdog.ENV_VAR, f"{timeout:g}")
    code = SCRIPT.replace("step(CASE)", f"step({case!r})").replace("SLEEP", repr(sleep))
    start = time.monotonic()
    result = run_mpi_code(3, code, tmp_path, timeout=S + 12, check=False)
    return result, time.monotonic() - start


def assert_ended_with_a_report(result, elapsed: float) -> list[tuple[int, str]]:
    assert elapsed < S + 10, f"the job took {elapsed:.1f} s, more than S + 10 = {S + 10} s\n{result.stderr}"
    assert result.returncode != 0, result.stderr
    found = reports(result.stderr)
    assert found, f"no watchdog report on stderr:\n{result.stderr}"
    assert "To wait longer set DTRAIN_TIMEOUT=S or --timeout S; 0 turns the watchdog off" in result.stderr
    for rank, _ in found:
        assert rank in (0, 2), f"rank {rank} reported, but rank 1 is the one that never came:\n{result.stderr}"
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["ring", "front door ring"])
def test_a_ring_allreduce_on_comm_world_waiting_for_a_rank_that_never_comes(case, tmp_path, monkeypatch):
    result, elapsed = run_stalled(case, tmp_path, monkeypatch)
    for rank, what in assert_ended_with_a_report(result, elapsed):
        # Rank 0 waits for its left neighbour 2 (which waits for 1), rank 2 for its left neighbour 1.
        assert what.startswith("allreduce/ring (call #2)"), result.stderr
        assert f"Sendrecv from rank {(rank - 1) % 3}" in what, result.stderr
        assert f"rank {rank} waits for rank {(rank - 1) % 3}" in result.stderr
        assert f"rank {rank} is at dtrain/collectives/ring.py:" in result.stderr  # where in the code it waits


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["mpi", "front door mpi", "WatchedComm mpi"])
def test_mpis_own_blocking_allreduce_waiting_for_a_rank_that_never_comes(case, tmp_path, monkeypatch):
    result, elapsed = run_stalled(case, tmp_path, monkeypatch)
    expected = "Allreduce (call #2)" if case == "WatchedComm mpi" else "allreduce/mpi (call #2)"
    for rank, what in assert_ended_with_a_report(result, elapsed):
        assert what.startswith(expected), result.stderr
        assert f"rank {rank} waits for the other ranks of" in result.stderr  # no peer is known inside MPI


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["recv", "WatchedComm recv"])
def test_a_point_to_point_wait_names_its_peer_and_tag(case, tmp_path, monkeypatch):
    result, elapsed = run_stalled(case, tmp_path, monkeypatch)
    found = assert_ended_with_a_report(result, elapsed)
    assert [rank for rank, _ in found] == [0], result.stderr  # only rank 0 waits
    what = found[0][1]
    assert what.startswith("waiting for a gradient from worker 1 (call #2, peer rank 1, tag 7)"), what
    if case == "WatchedComm recv":  # the wrapper's own wait, nested: the call, its peer and tag
        assert what.endswith(" > Recv from rank 1 (tag 7)"), what
    assert "rank 0 waits for rank 1" in result.stderr


@pytest.mark.mpi
def test_a_wait_that_ends_before_the_timeout_does_not_fire(tmp_path, monkeypatch):
    result, _ = run_stalled("ring", tmp_path, monkeypatch, timeout=2, sleep=1.0)
    assert result.returncode == 0, result.stderr
    assert "dtrain watchdog" not in result.stderr


# --- on the simulator -------------------------------------------------------------------------------------------
def stalled_ring(comm, release: threading.Event, released: dict, sleeper: int = 1, joins: bool = False):
    """A watched ring all-reduce that rank ``sleeper`` joins only after ``release`` (``joins``), or never."""
    buf = np.ones(1000)
    if comm.Get_rank() == sleeper:
        release.wait(30)  # in Python code, not in a communication call: no deadlock for the simulator to find
        if not joins:
            return None
    token = watchdog.begin(comm, "allreduce/ring")
    try:
        ring.allreduce(comm, buf)
    finally:
        watchdog.end(token)
        released[comm.Get_rank()] = time.monotonic()  # when the wait ended (here: unwound by the abort)
    return buf


def run_until_aborted(fn, release, after: float) -> None:
    """Run ``fn`` on 3 simulated ranks, expecting the watchdog to abort the run; ``release`` frees the sleeping rank
    ``after`` seconds in (so that a failing run still ends) or as soon as the run is over."""
    timer = threading.Timer(after, release.set)
    timer.start()
    try:
        with pytest.raises(sim.SimAbort):
            sim.SimWorld(3, timeout=60).run(fn)
    finally:
        release.set()
        timer.cancel()


def rank_0_waits_for_rank_1(receive, after: float) -> None:
    """On 3 simulated ranks, rank 0 calls ``receive(comm, buf)`` (a receive from rank 1, tag 7) while rank 1 is still
    computing (asleep until ``after`` seconds in): the watchdog must abort the run."""
    release = threading.Event()

    def fn(comm):
        if comm.Get_rank() == 0:
            receive(comm, np.zeros(4))
        elif comm.Get_rank() == 1:
            release.wait(30)  # the peer is still computing

    run_until_aborted(fn, release, after)


def test_the_simulator_reports_a_stalled_rank_and_aborts_the_run(capfd):
    limit = 2
    watchdog.configure(limit)
    release, released = threading.Event(), {}
    timer = threading.Timer(limit + 4, release.set)  # the sleeper comes much later (SimWorld.run waits for it)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(sim.SimAbort) as excinfo:
            sim.SimWorld(3, timeout=60).run(stalled_ring, release, released)
    finally:
        release.set()
        timer.cancel()
    assert excinfo.value.errorcode == watchdog.EXIT_CODE
    assert sorted(released) == [0, 2]
    assert max(released.values()) - start < limit + 3, "the waiting ranks were not ended soon after the timeout"
    err = capfd.readouterr().err
    found = reports(err)
    assert len(found) == 1, f"one report per run, got:\n{err}"
    rank, what = found[0]
    assert rank in (0, 2)
    assert what.startswith("allreduce/ring (call #1) > Sendrecv from rank"), what
    assert f"Sendrecv from rank {(rank - 1) % 3}" in what
    assert f"rank {rank} waits for rank {(rank - 1) % 3}" in err


def test_the_simulated_run_ends_within_the_timeout_when_a_rank_never_comes(capfd):
    """Like MPI_Abort, the simulated Abort ends the whole run, also when a rank is busy (here: asleep) in Python."""
    limit = 2
    watchdog.configure(limit)
    release = threading.Event()
    timer = threading.Timer(limit + 11, release.set)  # only so that a failing run still ends
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(sim.SimAbort):
            sim.SimWorld(3, timeout=60).run(stalled_ring, release, {})
        elapsed = time.monotonic() - start
    finally:
        release.set()
        timer.cancel()
    assert elapsed < limit + 10, f"SimWorld.run returned {elapsed:.1f} s after the start: it waited for the sleeper"
    assert reports(capfd.readouterr().err)


def test_a_later_simulated_run_is_watched_too(capfd):
    watchdog.configure(0.5)
    for sleeper in (1, 2):
        release = threading.Event()
        timer = threading.Timer(2.5, release.set)
        timer.start()
        try:
            with pytest.raises(sim.SimAbort):
                sim.SimWorld(3, timeout=60).run(stalled_ring, release, {}, sleeper=sleeper)
        finally:
            release.set()
            timer.cancel()
        found = reports(capfd.readouterr().err)
        assert len(found) == 1 and found[0][0] != sleeper, found


def test_a_paradigm_wait_around_a_watched_receive_reports_the_whole_stack(capfd):
    watchdog.configure(1)

    def parameter_server(comm, buf):
        with watchdog.watching(comm, "parameter server: waiting for a gradient from worker 1", peer=1, tag=7):
            watchdog.WatchedComm(comm).Recv(buf, source=1, tag=7)

    rank_0_waits_for_rank_1(parameter_server, after=3)
    err = capfd.readouterr().err
    stack = "parameter server: waiting for a gradient from worker 1 (call #1, peer rank 1, tag 7) > Recv from rank 1"
    assert reports(err) == [(0, stack + " (tag 7)")], err
    assert "rank 0 waits for rank 1" in err


def test_a_bare_receive_on_a_watched_comm_is_a_wait_of_its_own(capfd):
    watchdog.configure(0.5)

    def stage(comm, buf):
        watchdog.WatchedComm(comm).Recv(buf, source=1, tag=7)  # no wait open around it

    rank_0_waits_for_rank_1(stage, after=2)
    assert reports(capfd.readouterr().err) == [(0, "Recv from rank 1 (call #1, tag 7)")]


def test_a_note_details_the_innermost_wait(capfd):
    watchdog.configure(0.5)
    release = threading.Event()

    def pipeline(comm):
        if comm.Get_rank() == 0:
            with watchdog.watching(comm, "pipeline: waiting for activations"):
                watchdog.note("polling", peer=2, tag=3)
                release.wait(30)  # a wait of our own that no Python-level exchange shows

    run_until_aborted(pipeline, release, after=2)
    assert reports(capfd.readouterr().err) == [
        (0, "pipeline: waiting for activations (call #1) > polling (peer rank 2, tag 3)")
    ]


# --- nothing stalled --------------------------------------------------------------------------------------------
def test_armed_and_nothing_stalled_nothing_fires(capfd):
    watchdog.configure(1)

    def many(comm):
        buf = np.empty(1000)
        for i in range(200):
            buf[:] = comm.Get_rank() + i
            with watchdog.watching(comm, "allreduce/ring"):
                ring.allreduce(comm, buf)
        return buf.copy()

    results = sim.SimWorld(3, timeout=60).run(many)
    for buf in results:
        assert np.all(buf == 0 + 1 + 2 + 3 * 199)
    assert "dtrain watchdog" not in capfd.readouterr().err


def test_a_simulated_wait_that_ends_before_the_timeout_does_not_fire(capfd):
    limit = 2
    watchdog.configure(limit)
    release = threading.Event()
    threading.Timer(1.0, release.set).start()
    results = sim.SimWorld(3, timeout=60).run(stalled_ring, release, {}, joins=True)
    assert all(np.all(buf == 3) for buf in results)
    time.sleep(watchdog._tick(limit))  # one more look by the monitor
    assert "dtrain watchdog" not in capfd.readouterr().err


def test_disarmed_begin_returns_none_and_note_and_end_do_nothing():
    assert watchdog.timeout() is None
    assert watchdog.begin(object(), "allreduce/ring") is None
    watchdog.note("Sendrecv", peer=3, tag=0)
    watchdog.end(None)
    with watchdog.watching(object(), "anything"):
        pass


def test_configure_arms_and_zero_or_none_disarms():
    watchdog.configure(2.5)
    assert watchdog.timeout() == 2.5
    token = watchdog.begin(object(), "allreduce/ring")
    assert token is not None
    watchdog.end(token)
    watchdog.configure(0)
    assert watchdog.timeout() is None
    assert watchdog.begin(object(), "allreduce/ring") is None
    with pytest.raises(ValueError, match="not a timeout"):
        watchdog.configure(-1)


@pytest.mark.parametrize(("value", "expected"), [("", None), ("0", None), (" 7 ", 7.0), ("0.5", 0.5)])
def test_the_environment_variable_is_read_on_first_use(monkeypatch, value, expected):
    monkeypatch.setattr(watchdog, "_timeout", watchdog._UNREAD)  # as if configure() had never been called
    monkeypatch.setenv(watchdog.ENV_VAR, value)
    assert watchdog.timeout() == expected
    token = watchdog.begin(object(), "x")
    assert (token is None) == (expected is None)
    watchdog.end(token)


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan"])
def test_a_bad_environment_value_is_a_clear_error(monkeypatch, value):
    monkeypatch.setattr(watchdog, "_timeout", watchdog._UNREAD)
    monkeypatch.setenv(watchdog.ENV_VAR, value)
    with pytest.raises(ValueError, match=rf"DTRAIN_TIMEOUT='{re.escape(value)}' is not a timeout.*0 to turn"):
        watchdog.timeout()
    with pytest.raises(ValueError, match="DTRAIN_TIMEOUT"):
        watchdog.begin(object(), "allreduce/ring")  # the first wait reads it too


def test_sub_communicators_of_a_watched_comm_stay_watched():
    def split(comm):
        watched = watchdog.WatchedComm(comm)
        sub = watched.Split(comm.Get_rank() % 2, 0)
        return type(sub).__name__, len(layers(sub)), sub.allgather(comm.Get_rank())

    results = sim.run(4, split)
    assert results == [("WatchedComm", 2, [0, 2]), ("WatchedComm", 2, [1, 3])] * 2

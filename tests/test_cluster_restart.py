"""A whole machine dies and the job goes on: ``dtrain launch --max-restarts 1 --min-ranks 2`` on a cluster of 2 nodes
x 2 ranks (``dtrain cluster``), one node killed whole in the middle of training (its proxy and both its ranks), the
job restarted from its checkpoint on the other node's 2 slots, the only ones its hostfile still lists.

The oracles are outside the launcher: the kernel's own lists (``ip netns pids``: no process left on the surviving
node; /proc/PID/maps: every shared-memory segment the job's processes had mapped is gone), the cluster's record of
what was killed, the run's metrics.json, and MPICH's own words about the lost node in the checkpoint folder's
mpi.log (never on the terminal). As root with ``ip`` and ``tc`` only; elsewhere those tests skip, saying why. What
the launcher concludes from what it saw (MPICH's words, the ranks' nodes, the order and times their processes ended)
is tested everywhere, on made-up endings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dtrain import faults
from dtrain.launch import cluster, restarts
from dtrain.launch.banners import Banners

WHY_NOT = cluster.missing()
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
NAME = f"r{os.getpid() % 10**7}"  # (this test run's own: never another's)
EVERY, KILL_AT = 20, 30  # a checkpoint every 20 steps; the node killed once rank 0 has done step 30 (of 88)


@pytest.fixture
def two_nodes():
    """A 2 x 2 cluster at 100 Mbit/s, always taken down again."""
    try:
        yield cluster.up(NAME, 2, 2, "100mbit")
    finally:
        cluster.down(NAME)


def shared_memory(pids) -> set[str]:
    """The /dev/shm segments these processes map now."""
    found = set()
    for pid in pids:
        try:
            found |= set(re.findall(r"/dev/shm/\S+", Path(f"/proc/{pid}/maps").read_text()))
        except OSError:  # it ended in between
            pass
    return found


def launch(made: cluster.Cluster, tmp_path: Path, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "4", "--hostfile", str(made.hostfile),
               "--max-restarts", "1", "--min-ranks", "2", "--restart-delay", "0.2", "--checkpoint-dir",
               str(tmp_path / "ck"), *flags, "-m", "dtrain", "train", "--paradigm", "ddp", "--dataset", "digits",
               "--epochs", "4", "--checkpoint-every", str(EVERY), "--quiet", "--no-progress", "--out",
               str(tmp_path / "out")]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(job: subprocess.Popen) -> None:
    """A launcher still running when the test fails: SIGTERM, so that it ends its job too (a SIGKILL would leave
    mpiexec to its death signal alone), then SIGKILL if it does not end."""
    if job.poll() is None:
        job.terminate()
        try:
            job.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()


def wait_for_step(progress: Path, step: int, job: subprocess.Popen, deadline_s: float = 90) -> int:
    """Wait until rank 0 has done ``step`` (the progress mark the launcher reads, restarts.PROGRESS_FILE)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and job.poll() is None:
        done = faults.read_progress(progress) or 0
        if done >= step:
            return done
        time.sleep(0.01)
    raise AssertionError(f"rank 0 never reached step {step} (exit status {job.poll()})")


def shared_memory_of_the_second_attempt(folder: Path, node: str, job: subprocess.Popen) -> set[str]:
    """Once the launcher has recorded the first attempt's failure: the segments the second attempt's ranks map."""
    count = None
    while count != 1 and job.poll() is None:
        time.sleep(0.01)
        try:
            count = json.loads((folder / restarts.ATTEMPTS_FILE).read_text())["count"]
        except (OSError, ValueError, KeyError):  # (not yet written: it is replaced whole when it is)
            pass
    found = set()
    while not found and job.poll() is None:
        time.sleep(0.02)
        found = shared_memory(cluster.processes_in(node))
    return found


@pytest.mark.mpi
@needs_root
def test_a_node_killed_whole_mid_run_and_the_job_goes_on_with_the_other_node(two_nodes, tmp_path):
    nodes = two_nodes.names
    job = launch(two_nodes, tmp_path)
    try:
        wait_for_step(tmp_path / "ck" / restarts.PROGRESS_FILE, 1, job)  # (every rank has its shared memory now)
        used = shared_memory([job.pid, *cluster.processes_in(nodes[0]), *cluster.processes_in(nodes[1])])
        wait_for_step(tmp_path / "ck" / restarts.PROGRESS_FILE, KILL_AT, job)
        killed = cluster.kill(NAME, nodes[1])
        second = shared_memory_of_the_second_attempt(tmp_path / "ck", nodes[0], job)
        out, err = job.communicate(timeout=120)
    finally:
        stop(job)
    assert job.returncode == 0, err
    assert len(killed) >= 3  # the node's proxy and its two ranks
    # what the terminal showed: one line on the lost node, none of MPICH's own; then 2 ranks from the checkpoint
    said = f"dtrain launch: mpiexec lost node {nodes[1]} (its proxy ended with every rank on it: 2, 3); "
    assert sum(line.startswith(said) for line in err.splitlines()) == 1, err
    assert "[mpiexec@" not in out + err and "assert (!closed)" not in out + err
    assert "assert (!closed) failed" in (tmp_path / "ck" / restarts.MPI_LOG).read_text()
    # the run's own record: two attempts, the first on 4 ranks until the node was lost, the second on 2, finished
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and len(metrics["epochs"]) == 4
    assert metrics["config"]["batch_size"] == 64  # the global batch of the 4 ranks, kept
    assert metrics["epochs"][-1]["test_accuracy"] > 0.9
    first, *others = metrics["restarts"]["attempts"]
    assert metrics["restarts"]["count"] == 1 and not others
    assert (first["ranks"], first["node"], first["resumed_from_step"]) == (4, nodes[1], None)
    checkpointed = first["reached_step"] // EVERY * EVERY  # (20, unless the kill came late: a checkpoint each 20)
    assert first["reached_step"] >= KILL_AT and first["steps_lost"] == first["reached_step"] - checkpointed
    assert f"attempt 2 of 2, on 2 ranks, from the checkpoint at global step {checkpointed}" in err
    assert json.loads((tmp_path / "ck" / restarts.ATTEMPTS_FILE).read_text()) == metrics["restarts"]
    # nothing left: no process on the surviving node, no shared memory of the job's
    deadline = time.monotonic() + 2
    while cluster.processes_in(nodes[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.processes_in(nodes[0]) == []
    assert used and second and not [segment for segment in used | second if Path(segment).exists()]


@pytest.mark.mpi
@needs_root
def test_a_node_cut_off_ends_at_the_watchdog_which_names_the_rank_waited_for(two_nodes, tmp_path):
    """A power failure: the node's link goes first, so nobody is told; the ranks left wait until the watchdog
    (--timeout 3) ends the job, and the launcher follows its reports to the rank that never answered."""
    nodes = two_nodes.names
    job = launch(two_nodes, tmp_path, "--timeout", "3")
    try:
        wait_for_step(tmp_path / "ck" / restarts.PROGRESS_FILE, KILL_AT, job)
        cluster.kill(NAME, nodes[1], cut_link=True)
        _, err = job.communicate(timeout=120)
    finally:
        stop(job)
    assert job.returncode == 0, err
    # (the rank waited for may be one that was itself waiting, and was ended before it could say so)
    said = re.search(r"^dtrain launch: the watchdog found rank [01] stalled(, waiting for rank [0-3])?"
                     rf"( \(through rank [01]\))?: node {nodes[1]}'s ranks 2, 3 had ended (\d+\.\d) s before "
                     r"rank [01] did; \d+ step\(s\) lost", err, re.M)  # fmt: skip
    assert said and float(said[3]) >= 3, err  # (at least the watchdog's 3 s before the reporter ended)
    first = json.loads((tmp_path / "out" / "metrics.json").read_text())["restarts"]["attempts"][0]
    checkpointed = first["reached_step"] // EVERY * EVERY
    assert f"attempt 2 of 2, on 2 ranks, from the checkpoint at global step {checkpointed}" in err
    assert (first["ranks"], first["node"], first["exit_status"]) == (4, nodes[1], 14)
    assert first["seconds"] > 3  # (the watchdog's 3 s at least)


# --- everywhere: what the launcher concludes from what it saw -------------------------------------------------------
HYDRA = (  # MPICH 5.0.2's hydra when a proxy's connection closes without a word (the node killed whole)
    "[mpiexec@vm] control_cb (/mpich-5.0.2/src/pm/hydra/mpiexec/pmiserv_cb.c:280): assert (!closed) failed\n"
    "[mpiexec@vm] HYDT_dmxu_poll_wait_for_event (/mpich-5.0.2/src/pm/hydra/lib/tools/demux/demux_poll.c:76): "
    "callback returned error status\n"
    "[mpiexec@vm] HYD_pmci_wait_for_completion (/mpich-5.0.2/src/pm/hydra/mpiexec/pmiserv_pmci.c:180): error waiting "
    "for event\n"
    "[mpiexec@vm] main (/mpich-5.0.2/src/pm/hydra/mpiexec/mpiexec.c:270): process manager error waiting for completion"
)  # fmt: skip
ON_TWO = {0: "c-n1", 1: "c-n1", 2: "c-n2", 3: "c-n2"}


def ended(tail, status=255, order=(), nodes=ON_TWO, before=None):
    watched = SimpleNamespace(tail=tail, returncode=status, first_to_end=None, ended=list(order), nodes=nodes,
                              ended_before_s=before or {})  # fmt: skip
    return restarts.ending(watched)


def test_hydras_words_on_a_lost_proxy_are_held_back_whole():
    banners = Banners()
    shown = banners.feed(b"epoch 3 loss 0.1\n" + HYDRA.encode(), 0.0) + banners.finish()
    assert shown == b"epoch 3 loss 0.1\n" and banners.held.decode() == HYDRA  # (its last line without a newline)


@pytest.mark.parametrize(
    ("order", "said", "node"),
    [
        ([3, 2, 0, 1], "mpiexec lost node c-n2 (its proxy ended with every rank on it: 2, 3)", "c-n2"),
        ([2, 3, 0], "mpiexec lost node c-n2 (its proxy ended with every rank on it: 2, 3)", "c-n2"),
        # a rank of the other node ended in between: the order does not single a node out
        ([2, 0, 3, 1], "mpiexec lost a node (its proxy there ended, and the ranks on it)", None),
        ([], "mpiexec lost a node (its proxy there ended, and the ranks on it)", None),
    ],
)
def test_a_lost_proxy_names_the_node_whose_ranks_all_ended_first(order, said, node):
    found = ended(HYDRA, order=order)
    assert (found.how, found.cause, found.node, found.known) == (said, "node", node, True)


def test_ranks_of_two_nodes_seen_ending_at_the_same_look_single_out_no_node():
    found = ended(HYDRA, order=[2, 3, 0, 1], before={2: 0.5, 3: 0.5, 0: 0.5, 1: 0.2})
    assert (found.how, found.node) == ("mpiexec lost a node (its proxy there ended, and the ranks on it)", None)
    found = ended(HYDRA, order=[2, 3, 0, 1], before={2: 0.5, 3: 0.5, 0: 0.3, 1: 0.2})
    assert found.node == "c-n2"


def test_where_the_order_does_not_tell_the_cluster_s_record_of_a_killed_node_does(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "ROOT", tmp_path)
    (tmp_path / "c").mkdir()
    record = {"name": "c", "nodes": 2, "slots": 2, "link": None, "subnet": "198.18.0.0/24", "ready": True}
    (tmp_path / "c" / "cluster.json").write_text(json.dumps({**record, "killed": ["c-n2"]}))
    found = ended(HYDRA, order=[2, 0, 3, 1])
    assert (found.how, found.node) == ("mpiexec lost node c-n2 (its proxy ended with every rank on it: 2, 3)", "c-n2")
    (tmp_path / "c" / "cluster.json").write_text(json.dumps(record))  # (no node killed: nothing to go by)
    assert ended(HYDRA, order=[2, 0, 3, 1]).node is None


def test_a_lost_proxy_is_the_cause_even_if_a_rank_left_behind_raised_after_it():
    found = ended("uncaught exception (rank 0), ending the job:\n" + HYDRA, order=[2, 3, 0, 1])
    assert found.cause == "node" and found.node == "c-n2"


def watchdog(rank, waits_for=None, world=None):
    line = f"dtrain watchdog: rank {rank} of 4 (host c-n1, pid 1) has waited 3.0 s in allreduce/ring (call #9)\n"
    if waits_for is not None:
        line += f"dtrain watchdog: rank {rank} waits for rank {waits_for}{f' (world rank {world})' if world else ''}: "
        line += f"look at what rank {waits_for} is doing\n"
    return line


@pytest.mark.parametrize(
    ("tail", "before", "said", "node"),
    [
        (watchdog(0), {}, "the watchdog found rank 0 stalled", None),
        (watchdog(0, 2), {}, "the watchdog found rank 0 stalled, waiting for rank 2 on node c-n2", "c-n2"),
        # a ring passes a stall on: 1 waits for 0, which waits for 2, which said nothing
        (watchdog(1, 0) + watchdog(0, 2), {}, "the watchdog found rank 1 stalled, waiting for rank 2 on node c-n2 "
         "(through rank 0)", "c-n2"),
        (watchdog(1, 0, world=3), {}, "the watchdog found rank 1 stalled, waiting for rank 3 on node c-n2", "c-n2"),
        (watchdog(0, 1) + watchdog(1, 0), {}, "the watchdog found rank 0 stalled, the ranks waiting in a circle "
         "(0 -> 1 -> 0): a deadlock", None),
        # the node cut off: its ranks' processes had ended seconds before the job (the others: as it ended)
        (watchdog(0, 1), {2: 3.4, 3: 3.4, 0: 0.01, 1: -0.1}, "the watchdog found rank 0 stalled, waiting for rank 1: "
         "node c-n2's ranks 2, 3 had ended 3.4 s before rank 0 did", "c-n2"),
        # a slow teardown: every rank ended well before the job, but only 2 and 3 well before the reporter
        (watchdog(0, 1), {2: 4.9, 3: 4.9, 0: 1.5, 1: 1.5}, "the watchdog found rank 0 stalled, waiting for rank 1: "
         "node c-n2's ranks 2, 3 had ended 3.4 s before rank 0 did", "c-n2"),
        (watchdog(0, 2), {2: 2.0}, "the watchdog found rank 0 stalled, waiting for rank 2: rank 2 (on node c-n2) had "
         "ended 2.0 s before rank 0 did", "c-n2"),
    ],
)  # fmt: skip
def test_the_watchdog_s_reports_are_followed_to_the_rank_that_never_answered(tail, before, said, node):
    found = ended(tail, status=14, before=before)
    assert (found.how, found.cause, found.node) == (said, "watchdog", node)


def test_off_a_cluster_the_ranks_that_had_ended_are_named_without_a_node():
    found = ended(watchdog(0, 1), status=14, nodes={}, before={1: 2.5})
    assert (
        found.how == "the watchdog found rank 0 stalled, waiting for rank 1: rank 1 had ended 2.5 s before rank 0 did"
    )

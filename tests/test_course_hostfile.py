"""``dtrain tour --hostfile FILE`` and ``dtrain exercises check ID --hostfile FILE``: every mpiexec job of theirs gets
FILE's hosts (a plain hostfile naming this machine shows the plumbing anywhere), a bad FILE is one line before
anything starts, and, as root, both run across a cluster of 2 nodes x 2 slots (``dtrain cluster up``), their ranks
seen inside both nodes' namespaces while they run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.course import exercises, tour
from dtrain.course.exercises import checker
from dtrain.errors import UserError
from dtrain.launch import cluster, launcher, mpiexec
from dtrain.launch.hosts import Host

NAME = f"c{os.getpid() % 10**7}"  # this test run's own cluster (nobody else's is touched)


def dtrain(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "dtrain", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def reference_folder(folder: Path) -> Path:
    """A learner's folder whose ring.py hands over dtrain's own ring all-reduce (exercise 2.1)."""
    folder.mkdir(exist_ok=True)
    (folder / "ring.py").write_text("from dtrain.collectives.ring import allreduce as ring_allreduce  # noqa: F401\n")
    return folder


def hostfile(tmp_path, text: str, name: str = "hosts") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- the plumbing: a plain hostfile naming this machine -------------------------------------------------------------
def test_entries_take_the_hosts_nodes_for_the_hierarchical_all_reduce():
    def hier(ranks, hosts):
        entry = tour.entries(ranks, hosts)["ddp-hier"]
        return entry.label, entry.options.get("ranks_per_node")

    assert hier(4, None) == ("ddp hierarchical (2 nodes of 2)", 2)  # emulated, as without a hostfile
    assert hier(4, [Host("localhost", 4)]) == ("ddp hierarchical (2 nodes of 2)", 2)  # one host: still emulated
    assert hier(4, [Host("a", 2), Host("b", 2)]) == ("ddp hierarchical (2 nodes of 2)", 2)
    assert hier(5, [Host("a", 2), Host("b", 2), Host("c", 2)]) == ("ddp hierarchical (3 nodes of 2, 2 and 1)", 2)
    assert hier(4, [Host("a", 1), Host("b", 3)]) == ("ddp hierarchical (2 nodes of 1 and 3)", None)  # MPI's nodes
    assert tour.placement(3, [Host("a", 3), Host("b", 3)]) == [3]


@pytest.mark.mpi
def test_every_tour_job_gets_the_hosts_of_the_hostfile(tmp_path, monkeypatch, capsys):
    seen = []
    command = mpiexec.command

    def recording(nranks, target, cwd=None, hosts=None, oversubscribe=False, env=None):
        seen.append((nranks, hosts, oversubscribe))
        return command(nranks, target, cwd, hosts, oversubscribe, env)

    monkeypatch.setattr(mpiexec, "command", recording)
    monkeypatch.delenv("COLUMNS", raising=False)
    path = hostfile(tmp_path, "localhost:4\n")
    out = tmp_path / "tour"
    assert tour.tour(2, ["single", "ddp-ring"], 1, str(out), 60.0, hostfile=str(path)) == 0
    assert seen == [(1, [Host("localhost", 4)], False), (2, [Host("localhost", 4)], False)]
    said = " ".join(capsys.readouterr().out.split())
    assert f"every job on the hosts of {path} (localhost:4)" in said
    meta = json.loads((out / "tour.json").read_text())
    assert meta["hostfile"] == str(path) and meta["where"] == f"the hosts of {path} (localhost:4)"
    assert all(f"dtrain launch -n {r['ranks']} --hostfile {path} -m dtrain train" in r["command"] for r in meta["runs"])
    assert all(r["status"] == "ok" for r in meta["runs"])


@pytest.mark.mpi
@pytest.mark.parametrize("slots", [4, 3])
def test_every_mpiexec_part_of_a_check_gets_the_hosts_and_those_too_large_are_skipped(slots, tmp_path, monkeypatch,
                                                                                      capsys):  # fmt: skip
    seen = []
    launch = launcher.launch

    def recording(nranks, target, *args, **kwargs):
        seen.append((nranks, kwargs.get("hosts")))
        return launch(nranks, target, *args, **kwargs)

    monkeypatch.setattr(launcher, "launch", recording)
    monkeypatch.delenv("COLUMNS", raising=False)
    folder = reference_folder(tmp_path / "ex")
    path = hostfile(tmp_path, f"localhost:{slots}\n")
    assert checker.check("2.1", folder, hostfile=str(path)) == 0, capsys.readouterr().out
    assert exercises.get("2.1").mpi_ranks == (2, 3, 4)
    assert seen == [(p, [Host("localhost", slots)]) for p in (2, 3, 4) if p <= slots]
    said = capsys.readouterr().out
    lines = said.splitlines()
    assert " ".join(said.split()).startswith(f"the mpiexec parts run on the hosts of {path} (localhost:{slots})")
    parts = [line.split() for line in lines if line.startswith("  mpiexec -n")]
    assert [words[2] for words in parts] == ["2", "3", "4"]
    assert all(line.endswith("pass") for line in lines if line.startswith("  mpiexec -n") and "skipped" not in line)
    status = json.loads((folder / checker.PROGRESS).read_text())["2.1"]["status"]
    if slots == 4:
        assert status == "passing" and not any("skipped" in line for line in lines)
    else:  # the part of 4 ranks: said on its own line and in the status, and not launched
        (skipped,) = [line for line in lines if "skipped" in line and line.startswith("  mpiexec")]
        assert skipped.startswith("  mpiexec -n 4 on the hostfile's hosts") and skipped.endswith(
            "skipped: only 3 slots"
        )
        assert status == "passing (mpiexec -n 4 skipped)"
    assert all(len(line) <= 80 for line in lines if str(tmp_path) not in line)  # (a path is never cut)


def test_a_shared_memory_exercise_runs_its_parts_on_one_host(tmp_path):
    """2.6's ranks must share one node's memory: on several hosts its parts run on the first with the most slots, and
    one larger than that host is skipped, said so; a hostfile where none fits is refused."""
    on = checker.OnHosts("hosts", [Host("a", 2), Host("b", 3), Host("c", 3)], "somewhere", "the hostfile's hosts")
    shm, ring = exercises.get("2.6"), exercises.get("2.1")
    assert [on.part(shm, p, tmp_path)[0] for p in (2, 3, 4)] == ["mpiexec -n 2 on b", "mpiexec -n 3 on b",
                                                                 "mpiexec -n 4 on b"]  # fmt: skip
    assert callable(on.part(shm, 3, tmp_path)[1]) and on.part(shm, 4, tmp_path)[1] == "skipped: one node has 3 slots"
    assert on.room(shm) == ([Host("b", 3)], 3, "b") and on.room(ring) == (on.hosts, 8, "the hostfile's hosts")
    assert on.part(ring, 9, tmp_path) == ("mpiexec -n 9 on the hostfile's hosts", "skipped: only 8 slots")
    path = hostfile(tmp_path, "a:1\nb:1\n")
    (tmp_path / "shm.py").write_text("")
    with pytest.raises(UserError, match=r"1 slot\(s\) on one host \(its ranks share one node's memory\)"):
        checker.check("2.6", tmp_path, hostfile=str(path))


def _bad_inputs(tmp_path):
    """(command, the start of its one line): each refused before anything starts."""
    plain = hostfile(tmp_path, "localhost:4\n")
    one = hostfile(tmp_path, "localhost:1\n", "one")
    typo = hostfile(tmp_path, "localhost slot=4\n", "typo")
    empty = hostfile(tmp_path, "# nothing\n", "empty")
    stale = hostfile(tmp_path, "# dtrain cluster zzz: 2 node(s) x 2 slot(s)\nzzz-n1:2\nzzz-n2:2\n", "stale")
    ex = ["exercises", "check", "2.1", "--path", "ex", "--hostfile"]
    return [
        (["tour", "--hostfile", "nope"], "hostfile nope does not exist"),
        (["tour", "--hostfile", "."], "hostfile . is a folder"),
        (["tour", "--hostfile", typo], f"{typo}, line 1: 'slot=4' in 'localhost slot=4' is not slots=N"),
        (["tour", "--hostfile", empty], f"hostfile {empty} names no hosts"),
        (["tour", "--hostfile", plain, "--ranks", 5], f"--ranks 5 is more than the 4 slots of the hosts of {plain}"),
        (["tour", "--hostfile", stale], "" if cluster.missing() else "no cluster named zzz"),
        ([*ex, "nope"], "hostfile nope does not exist"),
        ([*ex, typo], f"{typo}, line 1: 'slot=4'"),
        ([*ex, one], f"--hostfile {one}: 1 slot(s), and the mpiexec parts need 2 ranks or more (2, 3, 4)"),
        ([*ex, stale], "" if cluster.missing() else "no cluster named zzz"),
        (["exercises", "check", "1.1", "--path", "ex", "--hostfile", plain], "exercise 1.1 is checked in one "
         "process, without mpiexec: nothing would use --hostfile"),
        (["exercises", "check", "2.1", "--path", "ex", "--sim-only", "--hostfile", plain], "--sim-only runs no "
         "mpiexec part, so nothing would use --hostfile"),
    ]  # fmt: skip


def test_a_bad_hostfile_is_one_line_and_nothing_starts(tmp_path):
    reference_folder(tmp_path / "ex")
    (tmp_path / "ex" / "backward.py").write_text("")
    for args, message in _bad_inputs(tmp_path):
        done = dtrain(*args, "--out", "tour", cwd=tmp_path) if args[0] == "tour" else dtrain(*args, cwd=tmp_path)
        said = done.stderr
        assert done.returncode == 2 and said.count("\n") == 1, (args, said)
        assert said.startswith(f"dtrain: error: {message}"), (args, said)
        if "stale" in map(str, args):  # not root: the cluster's launcher needs root, said so with the cluster's name
            assert "zzz" in said, said
        assert done.stdout == "" and not (tmp_path / "tour").exists(), args
    assert not (tmp_path / "ex" / checker.PROGRESS).exists()  # no check was made


# --- as root: across a cluster of 2 nodes x 2 slots ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_hostfile():
    """This run's cluster: 2 nodes x 2 slots, a 100 Mbit/s link; always taken down again."""
    why = cluster.missing()
    if why:
        pytest.skip(why)
    try:
        up = dtrain("cluster", "up", "--nodes", 2, "--slots", 2, "--link", "100mbit", "--name", NAME, timeout=120)
        assert up.returncode == 0, up.stderr
        yield Path(up.stdout.strip().splitlines()[-1])
    finally:
        dtrain("cluster", "down", "--name", NAME, timeout=120)
        assert f"{NAME}-n" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not (cluster.ROOT / NAME).exists()


def run_and_watch(args, marker: str, cwd) -> tuple[subprocess.CompletedProcess, dict[str, set[int]], float]:
    """Run ``dtrain ARGS`` and, while it runs, the processes of each of the cluster's nodes whose command line has
    ``marker`` (its ranks): the finished process, {node: PIDs seen} and the seconds it took."""
    env = {**os.environ, "COLUMNS": "80"}  # (as a terminal of 80 columns)
    seen = {f"{NAME}-n{i}": set() for i in (1, 2)}
    started = time.monotonic()
    with subprocess.Popen([sys.executable, "-m", "dtrain", *map(str, args)], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:  # fmt: skip
        while process.poll() is None:
            for node, pids in seen.items():
                for pid in cluster.processes_in(node):
                    try:
                        if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                            pids.add(pid)
                    except OSError:  # (it ended in between)
                        pass
            time.sleep(0.02)
        out, err = process.communicate(timeout=300)
    seconds = time.monotonic() - started
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), seen, seconds


def test_the_tour_runs_its_ddp_job_across_the_clusters_two_nodes(cluster_hostfile, tmp_path):
    args = ["tour", "--hostfile", cluster_hostfile, "--paradigms", "ddp", "--ranks", 4, "--epochs", 1, "--out", "t"]
    done, seen, seconds = run_and_watch(args, "--paradigm\0ddp\0", tmp_path)  # (ddp's ranks; not single's process)
    print(f"dtrain tour --paradigms ddp --ranks 4 --epochs 1 on 2 nodes x 2 slots (100mbit): {seconds:.1f} s")
    assert done.returncode == 0, done.stderr
    assert {node: len(pids) for node, pids in seen.items()} == {f"{NAME}-n1": 2, f"{NAME}-n2": 2}, seen
    where = f"cluster {NAME} (2 node(s) x 2 slot(s), link 100mbit)"
    assert f"every job on {where}" in " ".join(done.stdout.split())
    meta = json.loads((tmp_path / "t" / "tour.json").read_text())
    (run,) = meta["runs"]
    assert meta["where"] == where and run["status"] == "ok" and run["test_accuracy"] > 0.5, run
    assert max(map(len, done.stdout.splitlines())) <= 80, done.stdout  # the table too


def test_an_exercise_check_runs_its_mpiexec_parts_across_the_cluster(cluster_hostfile, tmp_path):
    reference_folder(tmp_path / "ex")
    args = ["exercises", "check", "2.1", "--path", "ex", "--hostfile", cluster_hostfile]
    done, seen, seconds = run_and_watch(args, "dtrain.course.exercises.run", tmp_path)
    print(f"dtrain exercises check 2.1 (mpiexec -n 2, 3, 4) on 2 nodes x 2 slots (100mbit): {seconds:.1f} s")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[-1] for line in lines if line.startswith("  mpiexec -n")] == ["pass"] * 3, done.stdout
    assert all(f"on cluster {NAME}" in line for line in lines if line.startswith("  mpiexec -n"))
    assert all(seen.values()), seen  # (-n 3 and -n 4 reach node 2)


def test_the_shared_memory_exercise_stays_on_one_node_of_the_cluster(cluster_hostfile, tmp_path):
    (tmp_path / "shm.py").write_text("from dtrain.collectives.shm import allreduce as shm_allreduce  # noqa: F401\n")
    args = ["exercises", "check", "2.6", "--path", ".", "--hostfile", cluster_hostfile]
    done, seen, _ = run_and_watch(args, "dtrain.course.exercises.run", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = [line.split(maxsplit=5)[4:] for line in done.stdout.splitlines() if line.startswith("  mpiexec -n")]
    assert parts == [[f"{NAME}-n1", "pass"], *[[f"{NAME}-n1", "skipped: one node has 2 slots"]] * 2], done.stdout
    assert seen[f"{NAME}-n1"] and not seen[f"{NAME}-n2"], seen

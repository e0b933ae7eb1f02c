"""Past one machine: hostfiles and --hosts read and checked, each MPI's spelling, and ranks placed by a hostfile.

The oracles: the hostfile formats as MPICH and Open MPI document them; ``mpiexec --version`` texts as each prints
them; and for the real run, MPI's own ``Split_type(COMM_TYPE_SHARED)`` (which MPICH takes from the hosts its process
manager was given) against the placement the hostfile asked for.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.errors import UserError
from dtrain.launch import flavours, hosts, launcher, mpiexec
from dtrain.launch.hosts import Host
from tests.mpi_util import LESSONS

MPICH_VERSION = """HYDRA build details:
    Version:                                 4.2.0
    Release Date:                            Fri Feb  9 12:29:21 CST 2024
"""
OPENMPI_5 = "mpiexec (Open MPI) 5.0.6\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
OPENMPI_4 = "mpiexec (OpenRTE) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
INTEL = "Intel(R) MPI Library for Linux* OS, Version 2021.11 Build 20231005 (id: 74c4a23)\n"


def test_a_hostfile_in_either_spelling_with_comments(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the cluster\nnode1:4\nnode2 slots=2 max_slots=8  # Open MPI's way\n\nnode3\nnode1:2\n")
    assert hosts.parse_hostfile(f) == [Host("node1", 6), Host("node2", 2), Host("node3", 1)]  # node1 twice: added


def test_hosts_on_the_command_line():
    assert hosts.parse_hosts("a,b:2, c:4") == [Host("a", 1), Host("b", 2), Host("c", 4)]
    assert hosts.parse_hosts("a:0,b:2") == [Host("b", 2)]  # a host of no slots takes no rank, and is not passed on
    with pytest.raises(UserError, match="is not slots=N"):
        hosts.parse_hosts("a b")
    assert hosts.host_list(hosts.parse_hosts("a,b:2")) == "a:1,b:2"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "does not exist"),
        ("", "names no hosts"),
        ("# only a comment\n", "names no hosts"),
        ("a:0\nb slots=0\n", "gives no slots"),
        ("a:2 slots=3\n", "gives the slots twice"),
        ("a:x\n", "cannot read"),
        ("node1 slot=4\n", "'slot=4' in 'node1 slot=4' is not slots=N"),
        ("node1 :4\n", "is not slots=N"),
    ],
)
def test_a_bad_hostfile_is_one_clear_error(tmp_path, content, says):
    f = tmp_path / "hosts"
    if content is not None:
        f.write_text(content)
    with pytest.raises(UserError, match=says):
        hosts.parse_hostfile(f)


def test_more_ranks_than_slots_needs_oversubscribe():
    two = [Host("a", 2), Host("b", 2)]
    hosts.check_fits(4, two, oversubscribe=False, source="h")
    hosts.check_fits(9, two, oversubscribe=True, source="h")
    with pytest.raises(UserError, match=r"-n 5 is more ranks than the 4 slots of h \(a:2, b:2\).*--oversubscribe"):
        hosts.check_fits(5, two, oversubscribe=False, source="h")


def test_ranks_per_host_fills_each_host_then_wraps():
    assert mpiexec.ranks_per_host(6, None) == 6
    assert mpiexec.ranks_per_host(4, [Host("a", 2), Host("b", 2)]) == 2
    assert mpiexec.ranks_per_host(5, [Host("a", 2), Host("b", 2)]) == 3
    assert mpiexec.ranks_per_host(3, [Host("a", 4), Host("b", 4)]) == 3


@pytest.mark.parametrize(
    ("text", "kind", "name", "version"),
    [
        (MPICH_VERSION, flavours.Mpich, "MPICH", "4.2.0"),
        (OPENMPI_5, flavours.OpenMpi, "Open MPI", "5.0.6"),
        (OPENMPI_4, flavours.OpenMpi, "Open MPI", "4.1.6"),
        (INTEL, flavours.Mpich, "Intel MPI", "2021.11"),
        ("Some MPI launcher 1.0\n", flavours.Flavour, "Some MPI launcher 1.0", ""),
    ],
)
def test_which_mpi_an_mpiexec_belongs_to(text, kind, name, version):
    found = flavours.read_version(text)
    assert (type(found), found.name, found.version) == (kind, name, version)


def test_the_environments_own_mpiexec_is_detected():
    found = flavours.detect(mpiexec.path())
    assert type(found) in (flavours.Mpich, flavours.OpenMpi), found


def _command(monkeypatch, text, *, root=False, **kwargs):
    monkeypatch.setattr(flavours, "detect", lambda path: flavours.read_version(text))
    monkeypatch.setattr(flavours, "running_as_root", lambda: root)
    return mpiexec.command(4, ["-m", "dtrain.launch.where"], **kwargs)


def test_each_mpi_gets_its_own_spelling(monkeypatch):
    two = [Host("a", 2), Host("b", 2)]
    env = {"OMP_NUM_THREADS": "1", "DTRAIN_TIMEOUT": "5", "HOME": "/root"}  # dtrain's two must reach other machines
    cmd = _command(monkeypatch, MPICH_VERSION, root=True, hosts=two, env=env)
    assert cmd[1:5] == ["-n", "4", "-hosts", "a:2,b:2"] and cmd[5] == sys.executable  # hydra passes every variable
    cmd = _command(monkeypatch, OPENMPI_5, root=True, hosts=two, env=env)
    assert cmd[1:11] == ["-n", "4", "--host", "a:2,b:2", "-x", "DTRAIN_TIMEOUT", "-x", "OMP_NUM_THREADS",
                         "--allow-run-as-root", sys.executable]  # fmt: skip
    cmd = _command(monkeypatch, OPENMPI_5, root=False, hosts=two, oversubscribe=True, env={})
    assert cmd[3:8] == ["--host", "a:2,b:2", "--map-by", ":OVERSUBSCRIBE", sys.executable]
    cmd = _command(monkeypatch, OPENMPI_4, env=env)  # one machine: as many ranks as asked; every rank has env
    assert cmd[3:5] == ["--oversubscribe", sys.executable]
    cmd = _command(monkeypatch, "Some MPI launcher 1.0\n", root=True, hosts=two, env=env)
    assert cmd[3:6] == ["-host", "a:2,b:2", sys.executable]


def test_each_mpi_gets_its_own_yielding_wait():
    many = 64  # more ranks than this machine's cores
    assert mpiexec.environment(many, {}, flavours.Mpich("MPICH"))["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    env = mpiexec.environment(many, {}, flavours.OpenMpi("Open MPI", "5.0.6"))
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1" and "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in env
    assert "OMPI_MCA_mpi_yield_when_idle" not in mpiexec.environment(1, {}, flavours.OpenMpi("Open MPI", "5.0.6"))


def test_an_unknown_mpiexec_is_said_once_and_the_launch_goes_on(tmp_path, capsys):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'Frobnicator MPI 0.1'\n")
    fake.chmod(0o755)
    found = flavours.detect(fake)
    assert found.name == "Frobnicator MPI 0.1"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither MPICH nor Open MPI" in err and "Frobnicator" in err


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "dtrain", "launch", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--hostfile", "missing", "-n", "2"], "hostfile missing does not exist"),
        (["--hosts", "a:1,b:1", "-n", "3"], "-n 3 is more ranks than the 2 slots"),
        (["--oversubscribe", "-n", "3"], "--oversubscribe needs --hostfile or --hosts"),
        (["--hosts", ":2", "-n", "1"], "cannot read"),
    ],
)
def test_bad_placement_is_one_line_and_exit_2(tmp_path, args, says):
    result = run_cli(*args, "-m", "dtrain.launch.where", cwd=tmp_path)
    assert result.returncode == 2, result
    assert says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""


def test_dry_run_prints_the_command_and_starts_nothing(tmp_path):
    result = run_cli("--dry-run", "--hosts", "a:2,b:2", "-n", "4", "-m", "dtrain.launch.where", cwd=tmp_path)
    assert result.returncode == 0, result
    command, *env = result.stdout.splitlines()
    assert command.startswith(str(mpiexec.path())) and " -n 4 " in command and "a:2,b:2" in command
    assert "  OMP_NUM_THREADS=1" in env


# ---------------------------------------------------------------------------------------------- real ranks


@pytest.fixture
def this_machine_twice(tmp_path) -> Path:
    """A hostfile that names this machine twice: MPICH's hydra starts a group of ranks for each name."""
    f = tmp_path / "hostfile"
    f.write_text(f"localhost:2\n{socket.gethostname()}:2\n")
    return f


def _launch(nranks, target, hostfile, **kwargs):
    found = hosts.parse_hostfile(hostfile)
    result = launcher.launch(nranks, target, timeout=120, capture=True, hosts=found, **kwargs)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


@pytest.mark.mpi
def test_where_shows_the_ranks_placed_by_the_hostfile(tmp_path, this_machine_twice):
    if type(flavours.detect(mpiexec.path())) is not flavours.Mpich:
        pytest.skip("MPICH's hydra makes one shared-memory node per host name; another MPI may not")
    out = tmp_path / "where.json"
    result = _launch(4, ["-m", "dtrain.launch.where", "--json", str(out)], this_machine_twice, cwd=tmp_path)
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    # the hostfile's first name gets ranks 0-1, its second 2-3: MPI's nodes follow
    assert [(r["node_leader"], r["node_rank"], r["node_size"]) for r in ranks] == [(0, 0, 2), (0, 1, 2), (2, 0, 2),
                                                                                     (2, 1, 2)]  # fmt: skip
    assert [r["mpiexec_local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert "sharing memory (MPI's nodes): 0-1 | 2-3" in result.stdout
    assert "MPI sees 2 nodes on the one machine" in result.stdout

    out.unlink()
    dealt = _launch(4, ["-m", "dtrain.launch.where", "--json", str(out)], this_machine_twice, cwd=tmp_path,
                    oversubscribe=True)  # fmt: skip
    assert "4 ranks on 1 machine" in dealt.stdout


@pytest.mark.mpi
def test_a_lesson_runs_on_the_nodes_a_hostfile_makes(tmp_path, this_machine_twice):
    """Lesson 2's hierarchical all-reduce on real nodes (MPI's, not emulated): right values, the formula's bytes."""
    if type(flavours.detect(mpiexec.path())) is not flavours.Mpich:
        pytest.skip("MPICH's hydra makes one shared-memory node per host name; another MPI may not")
    flags = ["--size-mib", "0.25", "--repeats", "2", "--algorithms", "hierarchical,hierarchical_rs,ring,mpi",
             "--shm-mib", "0.25"]  # fmt: skip
    out = _launch(4, [str(LESSONS / "02_allreduce.py"), *flags], this_machine_twice, cwd=tmp_path).stdout
    assert "hierarchical: the real nodes, as MPI reports them (Split_type): sizes [2, 2]" in out
    assert "bytes copied match the formulas on every rank: yes" in out, out  # shared memory: on rank 0's node alone
    assert re.search(r"^ring, sent\s+2\(p-1\)/p n\s+262,144\s+262,144\s+=$", out, re.M), out  # p = 2 there
    assert "all algorithms agree with MPI_Allreduce: yes" in out, out
    assert "bytes sent match costmodel.bytes_sent on every rank: yes" in out, out
    n = 262_144  # bytes: a leader receives its node's sum, sends n in the ring of 2 leaders and n down; a member n up
    leader, member = 2 * n, n
    assert re.search(rf"^hierarchical\s+{leader / 1024:.1f}\s+{member / 1024:.1f}\s+{leader / 1024:.1f}", out, re.M), (
        out
    )


def test_what_follows_the_module_is_the_modules_even_when_it_looks_like_launchs(tmp_path):
    result = run_cli(
        "--dry-run", "-n", "2", "-m", "dtrain.launch.where", "--json", "w.json", "--hosts", "x", cwd=tmp_path
    )
    assert result.returncode == 0, result
    assert result.stdout.splitlines()[0].endswith("-m dtrain.launch.where --json w.json --hosts x")


def test_launchs_own_options_after_the_module_and_a_scripts_own_m_are_left_alone(tmp_path):
    result = run_cli("--dry-run", "-m", "dtrain.launch.where", "-n", "3", cwd=tmp_path)  # as argparse always read it
    assert result.returncode == 0 and " -n 3 " in result.stdout, result
    script = tmp_path / "s.py"
    script.write_text("")
    result = run_cli("--dry-run", "-n", "2", str(script), "-m", "foo", cwd=tmp_path)  # the script's own -m
    assert result.returncode == 0 and result.stdout.splitlines()[0].endswith(f"{script} -m foo"), result

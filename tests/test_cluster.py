"""``dtrain cluster``: nodes as network namespaces, their links shaped, MPI across them for real.

Everywhere: names, rates and hostfiles are read and refused as the command promises (one line, exit 2), and a job
given a cluster's hostfile reaches the cluster's own launcher or is refused in one line. As root with ``ip`` and
``tc`` (CI, developers): one 2 x 2 cluster with a 100 Mbit/s link is made for the module, and the tests hold it to
independent oracles: MPI's own ``Split_type`` and the launcher's node names for where ranks run, arithmetic for what
the link's rate allows, single-process training for ddp across the nodes, and the kernel's own lists (``ip netns``,
``ip link``, /proc) for what ``down`` must leave behind: nothing. Elsewhere those tests skip, saying why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_util import train_cli

from dtrain.errors import UserError
from dtrain.launch import cluster, flavours, hosts, mpiexec

REPO = Path(__file__).resolve().parents[1]
WHY_NOT = cluster.missing()
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
NAME = f"t{os.getpid() % 10**7}"  # (one test run's own cluster: never another's)
RATE = "100mbit"


def dtrain(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, **kwargs)  # fmt: skip


def refused(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and re.match(r"dtrain[a-z ]*: error: ", done.stderr), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in done.stderr


def nothing_left(name: str) -> None:
    """The kernel's own lists: no namespace, link or folder of cluster ``name`` is left."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"{name}-n" not in namespaces
    assert f"dtb-{name}:" not in links and f"dtv-{name}-" not in links
    assert not (cluster.ROOT / name).exists()


# === everywhere: what is read, and what is refused


@pytest.mark.parametrize("text, bits", [("100mbit", 1e8), ("1gbit", 1e9), ("1.5Mbit", 1.5e6), ("2500kbit", 2.5e6)])
def test_a_rate_is_read_as_tc_spells_it(text, bits):
    assert cluster.rate_bits_s(text) == bits


@pytest.mark.parametrize("text", ["100m", "100", "fast", "-1gbit", "100 mbit", "0mbit", "500kbit", "101gbit"])
def test_a_rate_tc_would_not_take_or_too_slow_or_fast_is_refused(text):
    with pytest.raises(UserError, match=r"give a rate as tc spells it|from 1mbit to 100gbit"):
        cluster.rate_bits_s(text)


@pytest.mark.parametrize("name", ["", "Dtrain", "9nodes", "toolongname", "a-b", "a b"])
def test_a_name_that_would_not_fit_a_link_name_is_refused(name):
    with pytest.raises(UserError, match="lowercase letters and digits"):
        cluster.check_name(name)


def test_the_longest_names_fit_linux_s_15_characters():
    c = cluster.Cluster("a" * 8, cluster.MAX_NODES, 1, None, "198.18.0.0/24")
    assert max(len(c.bridge), len(c.veth(cluster.MAX_NODES))) <= 15


@pytest.mark.parametrize("args, words", [
    (["--nodes", "0", "--slots", "2"], ["--nodes 0"]),
    (["--nodes", "2", "--slots", "0"], ["--slots 0"]),
    (["--nodes", "2", "--slots", "2", "--link", "fast"], ["--link 'fast'"]),
    (["--nodes", "2", "--slots", "2", "--name", "Big"], ["cluster name 'Big'"]),
    (["--nodes", "two", "--slots", "2"], ["--nodes"]),
])  # fmt: skip
def test_up_refuses_bad_input_in_one_line_before_touching_anything(args, words, tmp_path):
    done = dtrain("cluster", "up", *args, env={**os.environ, "DTRAIN_CLUSTER_ROOT": str(tmp_path)})
    refused(done, *words)
    assert list(tmp_path.iterdir()) == []


def test_without_root_or_tools_it_says_which_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cluster.missing("dtrain cluster up") == (
        "dtrain cluster up needs root (network namespaces and links are made by root)"
    )
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool, path=None: None if tool == "tc" else f"/usr/sbin/{tool}")
    assert "needs tc (iproute2, util-linux), not found on PATH nor in /usr/sbin, /sbin" in cluster.missing()


@pytest.mark.parametrize("routes, addresses, subnet", [
    ("default via 192.0.2.1 dev eth0\n192.0.2.0/24 dev eth0", "2: eth0 inet 192.0.2.2/24 brd", "198.18.0.0/24"),
    ("unreachable 198.18.0.0/24\nlocal 198.18.1.7 dev lo table local", "", "198.18.2.0/24"),
    ("198.16.0.0/12 via 192.0.2.1 dev eth0", "", None),  # (a real network there: every candidate would shadow it)
    ("", "3: wlan0 inet 198.18.0.9/16 brd", None),
])  # fmt: skip
def test_a_cluster_takes_a_subnet_no_route_or_address_of_the_machine_touches(routes, addresses, subnet, monkeypatch):
    said = {"route": routes, "addr": addresses}
    monkeypatch.setattr(cluster, "_run", lambda *words: subprocess.CompletedProcess(words, 0, said[words[3]], ""))
    if subnet is None:
        with pytest.raises(UserError, match="no free subnet"):
            cluster._free_subnet()
    else:
        assert cluster._free_subnet() == subnet


def test_a_cluster_s_hostfile_is_known_by_its_first_line(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(hosts.cluster_comment("lab", "2 node(s) x 2 slot(s)") + "\nlab-n1:2\nlab-n2:2\n")
    assert hosts.parse_hostfile(path) == [hosts.Host("lab-n1", 2, "lab"), hosts.Host("lab-n2", 2, "lab")]
    path.write_text("# my machines\nnode1:2\n" + hosts.cluster_comment("lab", "not first") + "\n")
    assert hosts.parse_hostfile(path) == [hosts.Host("node1", 2)]  # (only the first line names a cluster)


def test_a_job_on_a_cluster_that_is_not_up_is_refused_in_one_line(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(hosts.cluster_comment("nosuch", "gone") + "\nnosuch-n1:2\nnosuch-n2:2\n")
    done = dtrain("launch", "-n", "4", "--hostfile", str(path), "-m", "dtrain.launch.where")
    refused(done, "nosuch")


def test_open_mpi_is_refused_on_a_cluster_with_the_reason(monkeypatch):
    monkeypatch.setattr(flavours, "detect", lambda path: flavours.OpenMpi("Open MPI", "5.0.6"))
    nodes = [hosts.Host("lab-n1", 2, "lab"), hosts.Host("lab-n2", 2, "lab")]
    with pytest.raises(UserError, match=r"MPICH's hydra .* this mpiexec is Open MPI 5\.0\.6"):
        mpiexec.flags(nodes)


# === as root: a real cluster


@pytest.fixture(scope="module")
def lab():
    """A 2 x 2 cluster with 100 Mbit/s links for the module; removed at the end, whatever happened, and checked."""
    if WHY_NOT is not None:
        pytest.skip(WHY_NOT)
    try:
        made = cluster.up(NAME, 2, 2, RATE)
        yield made
    finally:
        cluster.down(NAME)
        nothing_left(NAME)


@needs_root
def test_up_writes_a_hostfile_and_says_its_path_last(lab):
    assert lab.hostfile.read_text().splitlines() == [
        hosts.cluster_comment(NAME, f"2 node(s) x 2 slot(s), link {RATE}"), f"{NAME}-n1:2", f"{NAME}-n2:2"]  # fmt: skip
    done = dtrain("cluster", "status", "--name", NAME)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"hostfile: {lab.hostfile}"
    assert all(len(line) <= 80 for line in done.stdout.splitlines())
    assert [cluster.shaping(lab, i) for i in (1, 2)] == [("100Mbit", "100Mbit")] * 2  # (tc's own words, each way)
    # up measured its own link: a TCP stream no faster than the rate, and not far below it
    assert 0.6 * 1e8 < lab.measured_bits_s <= 1.02e8


@needs_root
def test_up_over_a_cluster_of_the_same_name_refuses(lab):
    refused(dtrain("cluster", "up", "--nodes", "2", "--slots", "2", "--name", NAME), f"cluster {NAME} is up")


@needs_root
def test_a_node_reaches_the_other_nodes_and_nothing_else(lab):
    node = lab.node(1)
    routes = subprocess.run(["ip", "-n", node, "route"], capture_output=True, text=True).stdout
    assert "default" not in routes and routes.split()[0] == lab.subnet
    addresses = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout.splitlines()
    outside = [line.split()[3].split("/")[0] for line in addresses if " lo " not in line and "dtb-" not in line]
    probe = "import socket,sys\ntry:\n socket.create_connection((sys.argv[1], 22), timeout=2)\nexcept OSError as e:\n" \
            " print(e.errno)\nelse:\n print('connected')"  # fmt: skip
    for address in [*outside, "1.1.1.1"]:
        said = subprocess.run(["ip", "netns", "exec", node, sys.executable, "-c", probe, address],
                              capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
        assert said == "101", f"{node} -> {address}: {said} (101: network unreachable)"


@needs_root
def test_the_bridge_forwards_nothing_out_and_no_link_speaks_ipv6(lab):
    def setting(path: str, node: str | None = None) -> str:
        read = ["ip", "netns", "exec", node, "cat", path] if node else ["cat", path]
        return subprocess.run(read, capture_output=True, text=True).stdout.strip()

    assert setting(f"/proc/sys/net/ipv4/conf/{lab.bridge}/forwarding") == "0"
    if Path("/proc/sys/net/ipv6").exists():
        for device in (lab.bridge, lab.veth(1), lab.veth(2)):
            assert setting(f"/proc/sys/net/ipv6/conf/{device}/disable_ipv6") == "1", device
        for node in lab.names:
            assert setting("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", node) == "1", node


@needs_root
def test_a_hostfile_naming_a_host_that_is_not_a_live_node_is_refused(lab, tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(lab.hostfile.read_text() + f"{NAME}-n3:2\n")
    refused(dtrain("launch", "-n", "4", "--hostfile", str(path), "-m", "dtrain.launch.where"), f"{NAME}-n3")


@needs_root
def test_up_and_down_leave_alone_what_dtrain_did_not_make():
    name = f"s{os.getpid() % 10**7}"
    subprocess.run(["ip", "netns", "add", f"{name}-n5"], check=True)  # someone else's, named as ours would be
    try:
        refused(dtrain("cluster", "up", "--nodes", "2", "--slots", "1", "--name", name), "no record")
        refused(dtrain("cluster", "down", "--name", name), "not removed")
        assert f"{name}-n5" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "delete", f"{name}-n5"])
        shutil.rmtree(cluster.ROOT / name, ignore_errors=True)


@pytest.mark.mpi
@needs_root
def test_where_names_each_rank_s_node_as_the_launcher_does(lab, tmp_path):
    done = dtrain("launch", "-n", "4", "--hostfile", str(lab.hostfile), "-m", "dtrain.launch.where", "--json",
                  str(tmp_path / "where.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    ranks = json.loads((tmp_path / "where.json").read_text())["ranks"]
    assert [r["host"] for r in ranks] == [lab.node(1)] * 2 + [lab.node(2)] * 2
    assert [(r["node_rank"], r["node_size"]) for r in ranks] == [(0, 2), (1, 2)] * 2  # MPI's Split_type agrees


@pytest.mark.mpi
@needs_root
def test_the_link_slows_an_allreduce_between_nodes_and_not_within_one(lab):
    done = dtrain("launch", "-n", "4", "--hostfile", str(lab.hostfile), "tests/mpi_scripts/check_cluster_link.py",
                  str(cluster.rate_bits_s(RATE)))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 checks, 0 failures" in done.stdout, done.stdout


@pytest.mark.mpi
@needs_root
def test_ddp_across_the_nodes_follows_single_on_one_process(lab, tmp_path):
    common = ["--dataset", "digits", "--epochs", "2", "--dtype", "float64", "--batch-size", "64", "--seed", "3"]
    single = train_cli(tmp_path / "single", 1, *common, "--paradigm", "single")
    flags = ["--paradigm", "ddp", "--allreduce", "hierarchical", "--out", str(tmp_path / "ddp")]
    done = dtrain("launch", "-n", "4", "--hostfile", str(lab.hostfile), "-m", "dtrain", "train", *common, *flags,
                  timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    ddp = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert ddp["world_size"] == 4
    for ours, theirs in zip(ddp["epochs"], single["epochs"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-10)
        assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-10)


@needs_root
def test_down_cleans_a_cluster_whose_up_was_killed_and_up_refuses_it_first():
    name = f"k{os.getpid() % 10**7}"
    up = subprocess.Popen([sys.executable, "-m", "dtrain", "cluster", "up", "--nodes", "40", "--slots", "1", "--name",
                           name], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while f"{name}-n2" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline and up.poll() is None, "up ended before making its second node"
            time.sleep(0.01)
        up.send_signal(signal.SIGKILL)  # a half-made cluster: some nodes, no hostfile
        up.wait()
        assert any(cluster.present(cluster.load(name)).values())
        refused(dtrain("cluster", "up", "--nodes", "2", "--slots", "1", "--name", name), "half made")
    finally:
        done = dtrain("cluster", "down", "--name", name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"cluster {name} removed: ")
    nothing_left(name)
    assert dtrain("cluster", "down", "--name", name).stdout == f"no cluster named {name}: nothing to remove\n"


@needs_root
def test_up_from_the_command_line_prints_the_hostfile_s_path_last_within_80_columns():
    name = f"u{os.getpid() % 10**7}"
    try:
        done = dtrain("cluster", "up", "--nodes", "2", "--slots", "1", "--link", "1gbit", "--name", name,
                      env={**os.environ, "COLUMNS": "80"})  # fmt: skip
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[-1] == str(cluster.ROOT / name / "hostfile") and Path(lines[-1]).is_file()
        assert all(len(line) <= 80 for line in lines), lines
    finally:
        cluster.down(name)
    nothing_left(name)


@needs_root
def test_down_ends_every_process_left_on_the_nodes():
    name = f"p{os.getpid() % 10**7}"
    made = cluster.up(name, 2, 1, None)
    try:
        sleeper = subprocess.Popen(["ip", "netns", "exec", made.node(2), "sleep", "600"])
        deadline = time.monotonic() + 10
        while not cluster.processes_in(made.node(2)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pids = cluster.processes_in(made.node(2))
    finally:
        cluster.down(name)
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    nothing_left(name)


def test_a_job_launched_from_a_rank_does_not_inherit_its_process_manager_s_variables():
    base = {"PMI_FD": "3", "HYDI_CONTROL_FD": "4", "MPI_LOCALRANKID": "0", "PMIX_RANK": "0", "HYDRA_IFACE": "eth1",
            "OMPI_MCA_btl": "tcp", "DTRAIN_TIMEOUT": "9"}  # fmt: skip
    env = mpiexec.environment(2, base)
    assert {"HYDRA_IFACE", "OMPI_MCA_btl", "DTRAIN_TIMEOUT"} <= set(env)  # (a person's settings stay)
    assert not {"PMI_FD", "HYDI_CONTROL_FD", "MPI_LOCALRANKID", "PMIX_RANK"} & set(env)


def test_every_rank_of_a_cluster_counts_against_this_machine_s_cores():
    nodes = [hosts.Host("lab-n1", 2, "lab"), hosts.Host("lab-n2", 2, "lab")]
    assert mpiexec.ranks_per_host(4, nodes) == 4  # (the nodes are namespaces of one machine)
    assert mpiexec.ranks_per_host(4, [hosts.Host("a", 2), hosts.Host("b", 2)]) == 2


def test_time_to_accuracy_adds_the_training_time_of_the_epochs_up_to_the_first_that_reaches_it():
    from dtrain.report import time_to_accuracy

    epochs = [{"epoch": i + 1, "train_time_s": t, "test_accuracy": a} for i, (t, a) in
              enumerate([(1.0, 0.90), (0.5, 0.96), (0.25, 0.99)])]  # fmt: skip
    assert time_to_accuracy({"epochs": epochs}, 0.96) == (2, 1.5)
    assert time_to_accuracy({"epochs": epochs}, 0.995) == (None, None)

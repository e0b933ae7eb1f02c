"""``dtrain plan --hostfile FILE``: the planner given a hostfile's world, and a dtrain cluster's link.

Everywhere: a fake cluster's folder (cluster.json and hostfile, under a ROOT of the test's own) gives the planner its
ranks, its ranks a node and its link between nodes, held to the arithmetic of the link's rate (``100mbit``: 1e8 bits/s,
12.5e6 bytes/s each way) and of its measured latency; flags given by hand still win; a plain hostfile gives ranks and
nodes and says the link is the preset's; and an all-reduce on a cluster is priced by the bytes that cross a node's
one link, written out here for 2 nodes x 2 ranks. As root (CI, developers): one ``--check`` of ddp ring on a real
2 x 2 cluster at 100 Mbit/s, whose predicted step is within 1.5x of the measured; the cluster is always taken down.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain import cli, parallel
from dtrain.collectives.costmodel import Machine
from dtrain.launch import cluster
from dtrain.launch.hosts import cluster_comment
from dtrain.plan import hardware, hostfile, planner

REPO = Path(__file__).resolve().parents[1]
MODEL = planner.Model([784, 512, 512, 10], 256)
N = parallel.parameter_count(MODEL.sizes) * 4  # the gradient's bytes


def fake_cluster(root: Path, name="fake", link="100mbit", latency_us=9.3, measured=95.5e6, nodes=2, slots=2) -> Path:
    """A cluster's folder as ``dtrain cluster up`` writes it (nothing made in the kernel); its hostfile's path."""
    folder = root / name
    folder.mkdir(parents=True)
    record = {"name": name, "nodes": nodes, "slots": slots, "link": link, "subnet": "10.213.9.0/24", "ready": True,
              "killed": [], "latency_us": latency_us, "measured_bits_s": measured}  # fmt: skip
    (folder / "cluster.json").write_text(json.dumps(record))
    lines = [cluster_comment(name, f"{nodes} node(s) x {slots} slot(s), link {link or 'unshaped'}")]
    (folder / "hostfile").write_text("\n".join([*lines, *(f"{name}-n{i}:{slots}" for i in range(1, nodes + 1))]) + "\n")
    return folder / "hostfile"


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "ROOT", tmp_path / "clusters")
    return tmp_path / "clusters"


def plan_args(*words: str):
    return cli.build_parser().parse_args(["plan", *words])


def machine_for(*words: str):
    args = plan_args(*words)
    world = hostfile.read(args.hostfile) if args.hostfile else None
    ranks = args.ranks if args.ranks is not None else world.ranks
    return planner.machine_of(args, ranks, world), ranks


def test_a_cluster_s_hostfile_gives_its_ranks_nodes_and_link(root):
    path = fake_cluster(root, slots=3)
    machine, ranks = machine_for("--hostfile", str(path))
    assert ranks == 6 and machine.ranks_per_node == 3 and machine.cluster == "fake"
    assert machine.inter.beta == pytest.approx(1 / (1e8 / 8))  # 100 Mbit/s: 12.5e6 bytes a second each way
    assert machine.inter.alpha == pytest.approx(9.3e-6)
    this = hardware.load(hardware.THIS)
    assert machine.loaded == this.loaded and machine.flops == this.flops  # inside a node: this machine's numbers
    assert machine.slowdown(6) == this.slowdown(6)  # every rank of the world shares this machine's cores


def test_flags_given_by_hand_still_win(root):
    path = fake_cluster(root)
    machine, ranks = machine_for("--hostfile", str(path), "--ranks", "2", "--ranks-per-node", "1",
                                 "--inter-bandwidth", "0.5", "--inter-latency", "40")  # fmt: skip
    assert ranks == 2 and machine.ranks_per_node == 1
    assert machine.inter.beta == pytest.approx(1 / 0.5e9) and machine.inter.alpha == pytest.approx(40e-6)
    assert machine.loaded  # (the link between nodes given by hand: inside a node is still this machine's)


def test_an_unshaped_cluster_is_priced_at_the_rate_its_link_was_measured(root):
    path = fake_cluster(root, link=None, measured=8.8e8)
    world = hostfile.read(path)
    assert world.inter_bytes_s == pytest.approx(8.8e8 / 8)
    assert "TCP stream reached" in world.source and "110 MB/s" in world.source


def test_the_link_on_a_cluster_prices_ddp_ring(root):
    """ddp ring over 2 nodes x 2: compute on 4 busy ranks, and the ring's formula on the link between nodes (every
    step crosses it), with this machine's rate of reducing."""
    machine, _ = machine_for("--hostfile", str(fake_cluster(root)))
    row = next(r for r in planner.plan(MODEL, 4, machine, only=["ddp"]) if r.label == "ddp ring")
    gamma = hardware.load(hardware.THIS).link(range(4), 4).gamma
    ring = 6 * 9.3e-6 + 1.5 * N / 12.5e6 + 0.75 * N * gamma
    assert row.time["communication"] == pytest.approx(ring)
    here = next(r for r in planner.plan(MODEL, 4, hardware.load(hardware.THIS), only=["ddp"]) if r.label == "ddp ring")
    assert row.time["compute"] == pytest.approx(here.time["compute"])  # (4 ranks on this machine's cores either way)


def test_a_node_s_one_link_is_shared_by_the_ranks_that_cross_at_once():
    """2 nodes x 2 ranks, a free link inside a node and one of beta s/byte between nodes: each all-reduce costs the
    bytes its busiest node's link carries one way, at the link's rate. Ring: 6 steps, one message of n/4 out of
    each node in each; hierarchical: the leaders' ring over 2 nodes, n/2 twice; hierarchical_rs: two such rings of
    n/2 at once; doubling: one crossing step, both ranks sending n; Rabenseifner: two, both ranks sending n/2; the
    tree: two, one rank sending n."""
    free, beta = Machine(alpha=0.0, beta=0.0, gamma=0.0, fence=0.0, copy=0.0), 1e-8
    m = hardware.Hardware(name="t", flops=1e9, layer_s=0, step_s=0, memory_bandwidth=1e9, memory=1e12, intra=free,
                          inter=Machine(alpha=0.0, beta=beta, gamma=0.0), ranks_per_node=2, cluster="t")  # fmt: skip
    n = 1 << 20
    crossing = {"ring": 1.5 * n, "hierarchical": n, "hierarchical_shm": n, "hierarchical_rs": n, "doubling": 2 * n,
                "rabenseifner": 2 * n, "tree": 2 * n, "mpi": n}  # fmt: skip
    for algorithm, carried in crossing.items():
        assert m.allreduce(algorithm, n, range(4), 4, 2) == pytest.approx(carried * beta, rel=1e-9), algorithm


def test_a_plain_hostfile_gives_ranks_and_nodes_and_says_the_link_is_the_preset_s(tmp_path, capsys):
    path = tmp_path / "hosts"
    path.write_text("alpha:3\nbeta slots=3\n")
    machine, ranks = machine_for("--hostfile", str(path), "--machine", "dgx-h100")
    assert ranks == 6 and machine.ranks_per_node == 3 and machine.cluster is None
    assert machine.inter == hardware.load("dgx-h100").inter
    words = ["--machine", "dgx-h100", "--paradigms", "ddp", "--batch-size", "240"]  # (240: 6 ranks divide it)
    assert cli.main(["plan", "--hostfile", str(path), *words]) == 0
    out = capsys.readouterr().out
    assert "the link between machines is the preset's" in out and "on 6 rank(s)" in out
    assert f"--hostfile {path}" in out  # (the best's command runs across them)


@pytest.mark.parametrize(
    ("words", "says"),
    [
        (["--machine", "dgx-h100"], "plan it on --machine this"),
        (["--check", "--ranks", "8"], "--ranks 8 would not fit"),
        (["--configuration", "ddp rnig"], "--configuration 'ddp rnig' is not one of this plan's: 'ddp ring'"),
    ],
)
def test_bad_input_is_one_line(root, capsys, words, says):
    path = fake_cluster(root)
    assert cli.main(["plan", "--hostfile", str(path), *words]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_cluster_that_is_not_up_is_refused(root, capsys):
    path = fake_cluster(root)
    (path.parent / "cluster.json").unlink()
    assert cli.main(["plan", "--hostfile", str(path)]) == 2
    assert "cluster fake's, which is not up" in capsys.readouterr().err


# === as root: the planner against a real cluster

WHY_NOT = cluster.missing()
NAME = f"p{os.getpid() % 10**7}"  # (this test run's own cluster: never another's)


@pytest.fixture(scope="module")
def lab():
    """A 2 x 2 cluster with 100 Mbit/s links; taken down at the end, whatever happened."""
    if WHY_NOT is not None:
        pytest.skip(WHY_NOT)
    try:
        yield cluster.up(NAME, 2, 2, "100mbit")
    finally:
        cluster.down(NAME)


@pytest.mark.mpi
def test_check_on_a_cluster_predicts_ddp_ring_within_1_5x(lab):
    done = subprocess.run([sys.executable, "-m", "dtrain", "plan", "--hostfile", str(lab.hostfile), "--check",
                           "--configuration", "ddp ring"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "COLUMNS": "80"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    said = " ".join(done.stdout.split())  # (its paragraphs wrapped to 80 columns)
    assert "between nodes its 100mbit link (12.5 MB/s each way)" in said
    assert all(len(line) <= 80 for line in done.stdout.splitlines()), done.stdout
    found = re.search(r"ddp ring: predicted ([\d.]+) ms, measured ([\d.]+) ms", said)
    assert found, done.stdout
    predicted, measured = map(float, found.groups())
    assert 1 / 1.5 <= measured / predicted <= 1.5, done.stdout

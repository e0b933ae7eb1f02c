"""Local SGD and gossip against their oracles.

Local SGD with H = 1 and SGD (momentum, weight decay) must equal ddp to rounding (averaging weights after a linear
update is averaging gradients before it, with the momentum buffers kept local); with the warm-up covering every step
it *is* ddp, bit for bit. After every average the replicas are identical. Gossip's mixing matrices are symmetric and
doubly stochastic with the ring's closed-form spectral gap, a round keeps the replicas' average, and the final
all-reduce leaves every rank with the same model. Traced bytes and held bytes equal the cost functions.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from test_data_parallel import SIZES, batches, relative, run

from dtrain import checkpoint, collectives, parallel
from dtrain.comm import sim
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.errors import ConfigError
from dtrain.nn import MLP
from dtrain.optim import make_optimizer
from dtrain.parallel.gossip import TOPOLOGIES, expected_mixing_matrix, mixing_matrix, neighbours, spectral_gap
from dtrain.parallel.local_sgd import LocalSGD
from dtrain.train import train

BATCH = 24


def config(**overrides) -> TrainConfig:
    base = dict(paradigm="local-sgd", dtype="float64", lr=0.1, momentum=0.9, weight_decay=1e-3, batch_size=BATCH,
                timeout=0, quiet=True)  # fmt: skip
    return TrainConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def data64():
    return batches(np.float64) * 4  # 12 steps


def valid(topology: str, p: int) -> bool:
    try:
        neighbours(topology, p, 0)
        return True
    except ConfigError:
        return False


# --- local SGD -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("via", ["allreduce", "master"])
def test_h1_with_sgd_equals_ddp(p, via, data64):
    ddp = sim.run(p, run, config(paradigm="ddp", weight_decay=1e-3), data64)[0][0]
    for params, _, _ in sim.run(p, run, config(sync_every=1, average_via=via), data64):
        assert relative(params, ddp) < 1e-12


def test_h1_in_float32_stays_within_rounding_of_ddp():
    """Both sides round each of the ~10 operations of a step to 2^-24 relative; over 12 steps of a contracting
    optimisation the difference stays within a few hundred ulps of the weights: 1e-5 relative is a loose bound."""
    data32 = batches(np.float32) * 4
    ddp = sim.run(3, run, config(paradigm="ddp", dtype="float32"), data32)[0][0]
    mine = sim.run(3, run, config(dtype="float32"), data32)[0][0]
    assert 0 < relative(mine, ddp) < 1e-5  # (not bit-identical: the sums are different sums)


def test_a_warmup_covering_every_step_is_ddp_bit_for_bit(data64):
    ddp = sim.run(3, run, config(paradigm="ddp"), data64)[0][0]
    post_local = sim.run(3, run, config(sync_every=4, warmup_sync_steps=len(data64)), data64)[0][0]
    assert np.array_equal(post_local, ddp)


def test_after_every_average_the_replicas_are_identical_and_momentum_stays_local(data64):
    cfg = config(sync_every=3)

    def fn(comm):
        collectives.set_debug(True)  # every average is followed by a digest comparison of all replicas
        try:
            paradigm = LocalSGD(prepare(comm, timeout=0), cfg)
            paradigm.build(lambda: MLP(SIZES, seed=3, dtype=np.float64),
                           lambda m: make_optimizer("sgd", m, cfg.lr, cfg.momentum, cfg.weight_decay))  # fmt: skip
            index = comm.Get_rank()
            local = BATCH // comm.Get_size()
            for step, (x, y) in enumerate(data64[:7], 1):
                paradigm.step(x[index * local : (index + 1) * local], y[index * local : (index + 1) * local])
                if step % 3 == 0:
                    assert paradigm.local_steps == 0
            params = paradigm.model.flat_params.copy()  # after step 7: one local step since the last average
            velocity = paradigm.optimizer_state()["velocity"]
            paradigm.finish()
            return params, velocity, paradigm.model.flat_params.copy()
        finally:
            collectives.set_debug(False)

    results = sim.run(3, fn)
    assert not np.array_equal(results[0][0], results[1][0])  # a local step later, the replicas differ
    assert all(np.array_equal(r[2], results[0][2]) for r in results)  # the final average: identical
    velocities = [r[1] for r in results]
    assert not np.array_equal(velocities[0], velocities[1])  # kept local: never averaged ...
    assert all(np.abs(v).max() > 0 for v in velocities)  # ... and never reset


@pytest.mark.parametrize(("via", "warmup"), [("allreduce", 0), ("master", 0), ("allreduce", 4)])
def test_traced_bytes_equal_the_cost_function(via, warmup, data64):
    cfg = config(sync_every=4, average_via=via, warmup_sync_steps=warmup)
    p, steps = 4, len(data64)
    costs = LocalSGD.costs(SIZES, p, cfg)
    averages = (steps - warmup) // 4
    for rank, (_, summary, figures) in enumerate(sim.run(p, run, cfg, data64)):
        ops = summary["operations"]
        assert figures["averages"] == averages
        if via == "master":
            sent = ops["reduce/naive"]["bytes_sent"] + ops["broadcast/naive"]["bytes_sent"]
        else:
            sent = ops[f"allreduce/{figures['allreduce']}"]["bytes_sent"]
        assert sent == averages * costs["sent_per_average"][rank] + warmup * costs["sent_per_warmup_step"][rank]
        assert costs["sent_per_step"][rank] == costs["sent_per_average"][rank] / 4


@pytest.mark.parametrize("paradigm", ["local-sgd", "gossip"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_held_bytes_equal_the_cost_function(paradigm, optimizer, data64):
    cfg = config(paradigm=paradigm, optimizer=optimizer, sync_every=1)
    predicted = parallel.get(paradigm).costs(SIZES, 4, cfg)
    for held in sim.run(4, run, cfg, data64[:2])[0][2]["held_bytes"]:
        assert [held[k] for k in ("parameters", "gradients", "optimizer")] == [
            predicted[k] for k in ("parameters", "gradients", "optimizer")
        ]
        assert held.get("receive_buffers", 0) == predicted.get("receive_buffers", 0)


# --- gossip ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(2, 11))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_mixing_matrices_are_symmetric_and_doubly_stochastic(topology, p):
    if not valid(topology, p):
        pytest.skip(f"{topology} needs another rank count than {p}")
    for step in range(3):
        w = mixing_matrix(topology, p, step, seed=5)
        assert np.allclose(w, w.T) and np.allclose(w.sum(axis=0), 1) and np.allclose(w.sum(axis=1), 1)
        assert (w >= 0).all()


@pytest.mark.parametrize("p", range(3, 11))
def test_the_rings_spectral_gap_is_the_closed_form(p):
    """The ring's W is circulant with eigenvalues (1 + 2 cos(2 pi k / p)) / 3; the second largest modulus is k = 1's
    (or, for p = 3 and 4, a smaller one)."""
    moduli = sorted((abs(1 + 2 * math.cos(2 * math.pi * k / p)) / 3 for k in range(p)), reverse=True)
    assert spectral_gap(mixing_matrix("ring", p)) == pytest.approx(1 - moduli[1], abs=1e-12)
    assert spectral_gap(mixing_matrix("exponential", p)) >= spectral_gap(mixing_matrix("ring", p)) - 1e-12
    assert 0 < spectral_gap(expected_mixing_matrix("random", p, seed=1)) < 1


def test_torus_on_a_prime_and_unknown_topologies_are_one_clear_error():
    with pytest.raises(ConfigError, match="--topology torus needs a rank count that is a product"):
        parallel.get("gossip").check(config(paradigm="gossip", topology="torus", batch_size=28), 7)
    with pytest.raises(ConfigError, match="--topology 'star' is not one of"):
        parallel.get("gossip").check(config(paradigm="gossip", topology="star"), 4)


def test_a_gossip_round_keeps_the_average_and_shrinks_the_spread():
    cfg = config(paradigm="gossip", topology="ring")

    def fn(comm):
        paradigm = parallel.get("gossip")(prepare(comm, timeout=0), cfg)
        paradigm.build(lambda: MLP(SIZES, seed=3, dtype=np.float64),
                       lambda m: make_optimizer("sgd", m, 0.1))  # fmt: skip
        flat = paradigm.model.flat_params
        flat[...] = np.random.default_rng(comm.Get_rank()).normal(size=flat.size)
        before = flat.copy()
        paradigm.mix()
        return before, flat.copy()

    results = sim.run(5, fn)
    before = np.array([r[0] for r in results])
    after = np.array([r[1] for r in results])
    assert np.allclose(after.mean(axis=0), before.mean(axis=0), rtol=0, atol=1e-14)
    spread = [np.linalg.norm(x - x.mean(axis=0)) for x in (before, after)]
    assert spread[1] <= spread[0] * (1 - spectral_gap(mixing_matrix("ring", 5))) + 1e-9


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_gossip_runs_on_every_world_its_topology_allows_and_ends_identical(topology, p):
    if not valid(topology, p):
        pytest.skip(f"{topology} needs another rank count than {p}")
    cfg = config(paradigm="gossip", topology=topology, batch_size=60)
    results = sim.run(p, run, cfg, batches(np.float64))
    assert all(np.array_equal(r[0], results[0][0]) for r in results)
    per_step = parallel.get("gossip").costs(SIZES, p, cfg)["sent_per_step"]
    for rank, (_, summary, _) in enumerate(results):
        if topology != "random":
            assert summary["operations"][f"gossip/{topology}"]["bytes_sent"] == 3 * per_step[rank]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"sync_every": 0}, "--sync-every must be >= 1"),
        ({"average_via": "carrier-pigeon"}, "--average-via 'carrier-pigeon' is not one of"),
        ({"warmup_sync_steps": -1}, "--warmup-sync-steps must be >= 0"),
        ({"paradigm": "gossip", "sync_every": 4}, "--sync-every is a flag of --paradigm local-sgd, not of gossip"),
        ({"topology": "torus"}, "--topology is a flag of --paradigm gossip, not of local-sgd"),
    ],
)
def test_bad_flags_are_one_clear_error_before_any_communication(flags, message):
    cfg = config(**flags)
    with pytest.raises(ConfigError, match=message):
        parallel.get(cfg.paradigm).check(cfg, 4)


# --- real ranks ------------------------------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("paradigm", "p", "flags"),
    [
        ("gossip", 4, ["--topology", "ring"]),
        ("gossip", 3, ["--topology", "exponential", "--epochs", "3"]),
        ("gossip", 5, ["--topology", "random", "--epochs", "3"]),
        ("gossip", 6, ["--topology", "torus", "--epochs", "3"]),
        ("local-sgd", 4, ["--sync-every", "8"]),
        (
            "local-sgd",
            2,
            ["--sync-every", "4", "--average-via", "master", "--warmup-sync-steps", "10", "--epochs", "3"],
        ),
    ],
)
def test_under_mpiexec(paradigm, p, flags, tmp_path):
    """Gossip on a ring of 4 learns the digits (>= 94% in 20 epochs) and ends in consensus; the others run."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dtrain", "launch", "-n", str(p), "-m", "dtrain", "train", "--paradigm", paradigm,
               "--batch-size", "60", "--no-progress", "--quiet", "--out", str(out), *flags]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    figures = metrics["communication"]["per_rank"][0]["paradigm"]
    assert len(figures["consensus_distance"]) == len(metrics["epochs"])
    if "--epochs" not in flags:
        assert metrics["final"]["test_accuracy"] >= 0.94
    if paradigm == "gossip":
        assert figures["consensus_before_final_average"] < 0.05


def test_a_ring_of_three_is_a_complete_graph_so_gossip_is_local_sgd_with_h1(data64):
    """With 3 ranks each one's two neighbours are everyone: a round is the exact average, as local SGD's with H = 1."""
    ddp = sim.run(3, run, config(paradigm="ddp"), data64)[0][0]
    for params, _, _ in sim.run(3, run, config(paradigm="gossip", topology="ring"), data64):
        assert relative(params, ddp) < 1e-12


def test_resuming_local_sgd_with_h1_follows_the_uninterrupted_run(tmp_path):
    """The checkpoint holds the averaged model and the averaged momentum buffers: with H = 1 (SGD) that is all the
    next steps depend on, so a resumed run is the uninterrupted one to rounding."""
    fast = dict(paradigm="local-sgd", hidden=(16,), batch_size=48, dtype="float64", progress=False, quiet=True,
                timeout=0)  # fmt: skip
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    sim.run(3, lambda comm: train(TrainConfig(**fast, epochs=2, checkpoint_dir=str(whole)), comm))
    sim.run(3, lambda comm: train(TrainConfig(**fast, epochs=1, checkpoint_dir=str(resumed)), comm))
    sim.run(3, lambda comm: train(TrainConfig(**fast, epochs=2, checkpoint_dir=str(resumed), resume=True), comm))
    assert relative(checkpoint.load(resumed)["params"], checkpoint.load(whole)["params"]) < 1e-12

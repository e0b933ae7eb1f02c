"""Parameter servers and central storage against their oracles.

ps-sync (1 or 2 servers, 1 to 3 workers) and central-storage must follow one process training on the whole global
batch to ~1e-12 in float64; ps-async with a staleness bound of 0 must equal ps-sync for plain SGD (its W updates per
round add the same gradients in another order). Each rank's traced bytes per step and the bytes it holds equal the
paradigm's cost functions. Every role layout terminates, on the simulator and on real ranks; bad input is one clear
error, and a rank that raises ends every rank.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import run_mpi_code
from test_data_parallel import BATCH, SIZES, STEPS, relative, run

from dtrain import checkpoint, parallel
from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.data import load_dataset
from dtrain.errors import ConfigError
from dtrain.nn import MLP
from dtrain.parallel import parameter_count
from dtrain.parallel.parameter_server import ParameterServer
from dtrain.train import evaluate, train

LAYOUTS = [(1, 1), (1, 3), (2, 2), (3, 1)]  # (servers, workers)


def config(**overrides) -> TrainConfig:
    base = dict(paradigm="ps-sync", dtype="float64", lr=0.1, momentum=0.9, batch_size=BATCH, timeout=0, quiet=True)
    return TrainConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def expected64(data64):
    return sim.run(1, run, config(paradigm="single"), data64)[0][0]


@pytest.mark.parametrize(("servers", "workers"), [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)])
def test_ps_sync_follows_one_process_with_the_same_global_batch(servers, workers, data64, expected64):
    results = sim.run(servers + workers, run, config(servers=servers), data64)
    for params, _, _ in results:  # every rank ends with the servers' final model
        assert relative(params, expected64) < 1e-12


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_central_storage_follows_one_process(p, data64, expected64):
    for params, _, _ in sim.run(p, run, config(paradigm="central-storage"), data64):
        assert relative(params, expected64) < 1e-12


def test_ps_sync_twice_is_bit_identical(data64):
    first = sim.run(4, run, config(servers=2), data64)
    second = sim.run(4, run, config(servers=2), data64)
    assert np.array_equal(first[0][0], second[0][0])


@pytest.mark.parametrize("servers", [1, 2])
def test_staleness_zero_is_ps_sync_for_plain_sgd(servers, data64):
    """K = 0: every worker waits for every other each step; with no momentum the W updates of a round sum to the
    synchronous step (in another order, so to rounding)."""
    sync = sim.run(servers + 3, run, config(servers=servers, momentum=0.0), data64)[0][0]
    ssp = sim.run(servers + 3, run, config(paradigm="ps-async", servers=servers, staleness=0, momentum=0.0), data64)
    assert relative(ssp[0][0], sync) < 1e-12
    assert ssp[0][2]["staleness"]["max"] <= 2  # W - 1: the round's other updates land first


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_staleness_stays_within_what_the_bound_allows(bound, data64):
    """A worker at most K steps ahead of the slowest sees at most (2K + 1) pushes of each other worker between its
    pull and its push; a straggler makes the others run ahead as far as they may."""
    cfg = config(paradigm="ps-async", staleness=bound, slow_rank=0, slow_factor=4.0)
    figures = sim.run(4, run, cfg, data64 * 3)[0][2]  # 3 workers, 1 server
    staleness = figures["staleness"]
    assert sum(staleness["histogram"].values()) == 3 * STEPS * 3  # every push recorded once
    assert staleness["max"] <= 2 * (2 * bound + 1)


@pytest.mark.parametrize(
    ("paradigm", "servers", "p"),
    [("ps-sync", 1, 4), ("ps-sync", 2, 4), ("ps-async", 1, 3), ("ps-async", 3, 4), ("central-storage", 0, 3)],
)
def test_traced_bytes_per_step_equal_the_cost_function(paradigm, servers, p, data64):
    cfg = config(paradigm=paradigm, servers=max(servers, 1))
    predicted = parallel.get(paradigm).costs(SIZES, p, cfg)["sent_per_step"]
    n = parameter_count(SIZES) * 8
    for rank, (_, summary, _) in enumerate(sim.run(p, run, cfg, data64)):
        ops, sent = summary["operations"], summary["totals"]["bytes_sent"]
        if paradigm == "central-storage":  # and the first broadcast of rank 0's weights
            first = ops["broadcast/tree"]["bytes_sent"] // (STEPS + 1)
            assert sent == STEPS * predicted[rank] + first
            assert ops["reduce/tree"]["calls"] == STEPS
        elif rank < p - servers:  # a worker: its pushes (the first pull sends 0 bytes)
            assert ops["ps/push"]["bytes_sent"] == sent == STEPS * predicted[rank]
            assert ops["ps/push"]["calls"] == STEPS
        else:  # a server: the weights after every step, and once more for the first pull
            assert sent == (STEPS + 1) * predicted[rank]
    if servers:  # the servers' shards make the whole model, sent to each of the W workers
        assert sum(predicted[p - servers :]) == (p - servers) * n


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(("paradigm", "servers"), [("ps-sync", 2), ("ps-async", 1), ("central-storage", 1)])
def test_held_bytes_equal_the_cost_function(paradigm, servers, optimizer, data64):
    cfg = config(paradigm=paradigm, servers=servers, optimizer=optimizer)
    p = 4
    predicted = parallel.get(paradigm).costs(SIZES, p, cfg)
    held = sim.run(p, run, cfg, data64)[0][2]["held_bytes"]
    for kind in ("parameters", "gradients", "optimizer"):
        expected = predicted[kind] if isinstance(predicted[kind], list) else [predicted[kind]] * p
        assert [h[kind] for h in held] == expected, kind
    if paradigm != "central-storage":  # workers hold no optimizer state; the servers hold it all, once
        per_element = {"sgd": 1, "adam": 2}[optimizer]
        assert sum(h["optimizer"] for h in held) == per_element * held[0]["parameters"]


@pytest.mark.parametrize("paradigm", ["ps-sync", "ps-async"])
@pytest.mark.parametrize(("servers", "workers"), LAYOUTS)
def test_every_role_layout_terminates_on_the_simulator(paradigm, servers, workers, data64):
    cfg = config(paradigm=paradigm, servers=servers)
    results = sim.SimWorld(servers + workers, timeout=60).run(lambda comm: run(comm, cfg, data64))
    figures = results[0][2]
    assert figures["roles"] == ["worker"] * workers + ["server"] * servers
    assert sum(figures["server_updates"]) == servers * STEPS * (1 if paradigm == "ps-sync" else workers)


def test_resuming_ps_sync_equals_an_uninterrupted_run(tmp_path):
    fast = dict(paradigm="ps-sync", servers=2, hidden=(16,), batch_size=48, progress=False, quiet=True, timeout=0)
    whole = sim.run(4, lambda comm: train(TrainConfig(**fast, epochs=3), comm))[0]
    sim.run(4, lambda comm: train(TrainConfig(**fast, epochs=1, checkpoint_dir=str(tmp_path)), comm))
    resumed = sim.run(4, lambda comm: train(TrainConfig(**fast, epochs=3, checkpoint_dir=str(tmp_path), resume=True),
                                            comm))[0]  # fmt: skip
    assert resumed["weights_sha256"] == whole["weights_sha256"]


@pytest.mark.parametrize("paradigm", ["ps-sync", "ps-async"])
def test_a_checkpoint_written_on_an_epochs_last_step_is_resumed_with_whole_epochs_after_it(tmp_path, paradigm):
    """29 steps an epoch, a checkpoint at step 29 (ps-sync's own, or ddp's for ps-async): the servers start the next
    epoch's count from 0, so it has its 29 steps (not 1, as when the servers counted the finished epoch's pushes)."""
    fast = dict(servers=1, hidden=(16,), batch_size=48, progress=False, quiet=True, timeout=0)
    writer = dict(paradigm="ps-sync", checkpoint_every=29) if paradigm == "ps-sync" else dict(paradigm="ddp")
    save = checkpoint.save

    def keep_step_29(folder, params, state, meta, during_write=None, arrays=None):
        path = save(folder, params, state, meta, during_write, arrays=arrays)
        if meta["global_step"] == 29 and not (tmp_path / "at29").exists():
            shutil.copytree(folder, tmp_path / "at29")
        return path

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "save", keep_step_29)
        sim.run(3, lambda comm: train(TrainConfig(**{**fast, **writer}, epochs=1, checkpoint_dir=str(tmp_path / "w")),
                                      comm))  # fmt: skip
    resumed = sim.run(3, lambda comm: train(TrainConfig(**fast, paradigm=paradigm, epochs=3, resume=True,
                                                        checkpoint_dir=str(tmp_path / "at29")), comm))[0]  # fmt: skip
    updates = resumed["communication"]["per_rank"][0]["paradigm"]["server_updates"]
    if paradigm == "ps-sync":
        assert updates == [3 * 29]  # the snapshot's 29 (its servers' count goes on), then epochs 2 and 3, whole
    else:  # a push per worker step, and up to W - 1 = 1 push an epoch already on its way when the budget is spent
        assert 2 * 29 * 2 <= updates[0] <= 2 * 29 * 2 + 2
    if paradigm == "ps-sync":
        whole = sim.run(3, lambda comm: train(TrainConfig(**fast, paradigm="ps-sync", epochs=3), comm))[0]
        assert resumed["weights_sha256"] == whole["weights_sha256"]


@pytest.mark.parametrize(
    ("world", "flags", "message"),
    [
        (1, {}, "needs at least 2 ranks"),
        (3, {"servers": 3}, "--servers 3 must be at least 1 and leave a worker"),
        (3, {"paradigm": "ps-async", "staleness": -1}, "--staleness must be >= 0"),
        (3, {"staleness": 2}, "--staleness applies to ps-async"),
        (3, {"slow_rank": 2}, "--slow-rank 2 is not a worker"),
        (3, {"paradigm": "ddp", "servers": 2}, "--servers is a flag of --paradigm ps-sync, ps-async, not of ddp"),
        (3, {"overlap": True}, "--overlap is a flag of --paradigm ddp, not of ps-sync"),
    ],
)
def test_bad_flags_are_one_clear_error_before_any_communication(world, flags, message):
    cfg = config(**flags)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parallel.get(cfg.paradigm).check(cfg, world)


def test_costs_say_the_server_link_carries_w_times_a_workers_bytes():
    cfg = config(servers=1)
    sent = ParameterServer.costs(SIZES, 5, cfg)["sent_per_step"]
    assert sent[4] == 4 * sent[0]  # 4 workers' replies through one server
    two = ParameterServer.costs(SIZES, 6, config(servers=2))["sent_per_step"]
    assert max(two[4:]) - min(two[4:]) <= 4 * 8  # balanced shards: within one element per worker


# --- real ranks ------------------------------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(("servers", "workers"), LAYOUTS)
def test_every_role_layout_terminates_under_mpiexec(servers, workers, tmp_path):
    """And the same configuration on the simulator gives the same weights (ps-sync is deterministic)."""
    cfg = dict(paradigm="ps-sync", servers=servers, hidden=(32,), epochs=2, batch_size=48, progress=False,
               quiet=True, timeout=60, dtype="float64")  # fmt: skip
    expected = sim.run(servers + workers, lambda comm: train(TrainConfig(**cfg), comm))[0]["weights_sha256"]
    code = f"""
        from mpi4py import MPI
        from dtrain.config import TrainConfig
        from dtrain.train import evaluate, train
        for paradigm in ("ps-sync", "ps-async"):
            metrics = train(TrainConfig(**{{**{cfg!r}, "paradigm": paradigm}}), MPI.COMM_WORLD)
            if MPI.COMM_WORLD.Get_rank() == 0:
                print(paradigm, metrics["weights_sha256"], flush=True)
    """
    result = run_mpi_code(servers + workers, code, tmp_path, timeout=120)
    assert f"ps-sync {expected}" in result.stdout and "ps-async " in result.stdout


@pytest.mark.mpi
def test_ps_async_learns_the_digits_with_three_workers(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "4", "-m", "dtrain", "train", "--paradigm", "ps-async",
               "--epochs", "20", "--batch-size", "60", "--no-progress", "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ps-async: workers = ranks 0-2, servers = rank 3" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["final"]["test_accuracy"] >= 0.94
    staleness = metrics["communication"]["per_rank"][0]["paradigm"]["staleness"]
    budget = 3 * (1438 // 60)  # pushes in an epoch: W x steps, and at most W - 1 more already on their way
    assert 20 * budget <= sum(staleness["histogram"].values()) <= 20 * (budget + 2)


@pytest.mark.mpi
@pytest.mark.parametrize("who", ["worker", "server"])
def test_a_rank_that_raises_ends_every_rank_with_its_traceback(who, tmp_path):
    code = f"""
        from mpi4py import MPI
        from dtrain.parallel import parameter_server as ps
        from dtrain.config import TrainConfig
        from dtrain.train import evaluate, train

        if "{who}" == "worker":
            original = ps.Worker.push_and_pull
            calls = []

            def push_and_pull(self):
                calls.append(1)
                if self.comm.Get_rank() == 1 and len(calls) == 5:
                    raise RuntimeError("worker 1 broke at step 5")
                return original(self)

            ps.Worker.push_and_pull = push_and_pull
        else:
            def serve(self, steps_per_epoch, lr, done=0, **_):
                raise RuntimeError("server broke before serving")

            ps.Server.serve = serve
        train(TrainConfig(paradigm="ps-sync", epochs=3, hidden=(16,), progress=False, quiet=True, timeout=60),
              MPI.COMM_WORLD)
    """
    result = run_mpi_code(3, code, tmp_path, timeout=60, check=False)
    assert result.returncode != 0
    assert "RuntimeError: " + ("worker 1 broke at step 5" if who == "worker" else "server broke") in result.stderr


@pytest.mark.parametrize(("servers", "bound"), [(1, None), (2, 1), (3, 0)])
def test_asynchronous_epochs_through_the_driver_share_their_budget(servers, bound):
    """Driven as by dtrain train: every epoch ends for every worker (END from the coordinator, passed on to the other
    servers), each epoch holds W x steps pushes (and at most W - 1 more already on their way), and a straggler takes
    fewer of them."""
    cfg = TrainConfig(paradigm="ps-async", servers=servers, staleness=bound, slow_rank=0, slow_factor=4.0,
                      hidden=(16,), batch_size=60, epochs=2, progress=False, quiet=True, timeout=0)  # fmt: skip
    metrics = sim.SimWorld(servers + 3, timeout=120).run(lambda comm: train(cfg, comm))[0]
    figures = metrics["communication"]["per_rank"][0]["paradigm"]
    budget = 3 * (1438 // 60)
    pushes = figures["server_updates"][0]
    assert 2 * budget <= pushes <= 2 * (budget + 2)
    assert figures["server_updates"] == [pushes] * servers  # every push reaches every server
    assert sum(figures["staleness"]["histogram"].values()) == servers * pushes  # counted once per server
    assert len(metrics["epochs"]) == 2


def test_the_accuracy_reported_for_ps_async_is_that_of_the_final_model(tmp_path):
    """Each epoch's evaluation pulls the servers' weights once every worker has ended it, so the last epoch's
    accuracy and loss are those of the final model, the one in the checkpoint."""
    cfg = TrainConfig(paradigm="ps-async", slow_rank=1, slow_factor=3.0, hidden=(16,), batch_size=60, epochs=2,
                      dtype="float64", progress=False, quiet=True, timeout=0, checkpoint_dir=str(tmp_path))  # fmt: skip
    metrics = sim.run(4, lambda comm: train(cfg, comm))[0]
    for mine in metrics["communication"]["per_rank"][:3]:  # each worker pulled once per epoch for its evaluation
        assert mine["operations"]["evaluation"]["calls"] == 2
    data = load_dataset("digits", dtype=np.float64)
    model = MLP([data.n_features, 16, data.n_classes], dtype=np.float64)
    model.flat_params[...] = checkpoint.load(tmp_path)["params"]
    loss, accuracy = evaluate(model, data, np)
    assert (loss, accuracy) == (metrics["final"]["test_loss"], metrics["final"]["test_accuracy"])


def test_a_servers_answers_to_evaluation_pulls_are_not_counted_as_training():
    """ps-async's epoch-end pulls: the servers' replies go under "evaluation", so their training bytes stay W n a
    push (the first pull of each worker excepted)."""
    cfg = TrainConfig(paradigm="ps-async", hidden=(16,), batch_size=60, epochs=3, progress=False, quiet=True,
                      timeout=0)  # fmt: skip
    metrics = sim.run(4, lambda comm: train(cfg, comm))[0]
    server = metrics["communication"]["per_rank"][3]["operations"]
    n = metrics["model"]["parameters"] * 4
    assert server["evaluation"]["bytes_sent"] == 3 * 3 * n  # 3 workers, 3 epochs
    assert server["ps/pull"]["bytes_sent"] == 3 * n  # the first weights of each worker

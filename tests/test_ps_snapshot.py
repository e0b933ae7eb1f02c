"""Consistent snapshots of parameter-server runs (dtrain/parallel/ps_snapshot.py), on simulated ranks.

Oracles: an uninterrupted run's weights (ps-sync, deterministic), the servers' own counts of each worker's pushes
against the workers' sequence numbers (ps-async: every push applied exactly once across a resume), and the
checkpoint's arrays against what the resumed servers hold before and after replaying the pushes in flight.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from dtrain import checkpoint
from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.parallel import ps_snapshot
from dtrain.train import train

FAST = dict(hidden=(16,), batch_size=48, progress=False, quiet=True, timeout=0)  # digits: 29 steps an epoch


def run(world, **flags):
    return sim.run(world, lambda comm: train(TrainConfig(**FAST, **flags), comm))[0]


def keep_snapshots(monkeypatch, tmp_path, steps):
    """Copy the checkpoint folder aside whenever a snapshot of one of ``steps`` (None: any) is written."""
    save = checkpoint.save

    def keep(folder, params, state, meta, during_write=None, arrays=None):
        path = save(folder, params, state, meta, during_write, arrays=arrays)
        kept = tmp_path / f"at{meta['global_step']}"
        if "snapshot" in meta and (steps is None or meta["global_step"] in steps) and not kept.exists():
            shutil.copytree(folder, kept)
        return path

    monkeypatch.setattr(checkpoint, "save", keep)


@pytest.mark.parametrize(("optimizer", "at"), [("sgd", 7), ("adam", 7), ("sgd", 29)])
def test_ps_sync_resumes_a_snapshot_to_the_bit(tmp_path, monkeypatch, optimizer, at):
    """A snapshot in the middle of an epoch (7) and at its last step (29, every worker's reply is END): resumed, the
    run ends with the weights of one never stopped; ps-sync's cut has nothing in flight."""
    flags = dict(paradigm="ps-sync", servers=2, optimizer=optimizer)
    whole = run(4, **flags, epochs=2)
    keep_snapshots(monkeypatch, tmp_path, {at})
    every = run(4, **flags, epochs=1, checkpoint_every=at, checkpoint_dir=str(tmp_path / "run"))
    saved = checkpoint.load(tmp_path / f"at{at}")
    snapshot = saved["meta"]["snapshot"]
    assert [s["seq"] for s in snapshot["workers"]] == [at, at]
    assert all(len(a) == 0 for a in saved["arrays"].values())  # nothing in flight
    assert [s["epoch_over"] for s in snapshot["workers"]] == [at == 29] * 2
    resumed = run(4, **flags, epochs=2, checkpoint_dir=str(tmp_path / f"at{at}"), resume=True)
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    assert [e["train_loss"] for e in resumed["epochs"]] == pytest.approx([e["train_loss"] for e in whole["epochs"]])
    pushes = resumed["communication"]["per_rank"][0]["paradigm"]["pushes"]
    assert pushes["sent"] == [58, 58] and pushes["exactly_once"]
    plain = run(4, **flags, epochs=1)

    def training_bytes(metrics):  # the snapshots' traffic is the checkpoint's, not a step's
        return [r["totals"]["bytes_sent"] - r["operations"].get("checkpoint", {}).get("bytes_sent", 0)
                for r in metrics["communication"]["per_rank"]]  # fmt: skip

    assert training_bytes(every) == training_bytes(plain)


def test_ps_async_snapshot_replays_every_push_in_flight_exactly_once(tmp_path, monkeypatch):
    """ps-async, 3 workers (one slowed) and 2 servers, a snapshot every 5 global steps: the cut holds, for each server
    and worker, the pushes the worker counts as sent (in the shard or in flight); a resume from one restores the
    cut's state, replays the pushes in flight, and every push is applied exactly once to the end."""
    flags = dict(paradigm="ps-async", servers=2, slow_rank=1, slow_factor=2.0)
    keep_snapshots(monkeypatch, tmp_path, None)
    first = run(5, **flags, epochs=2, checkpoint_every=5, checkpoint_dir=str(tmp_path / "run"))
    assert first["communication"]["per_rank"][0]["paradigm"]["pushes"]["exactly_once"]
    in_flight = {}
    taken = sorted(int(folder.name[2:]) for folder in tmp_path.glob("at*"))
    # one every 5 global steps, unless the last is still being taken (rank 0, which writes, then takes fewer steps)
    # or workers are between two epochs: then at the next multiple
    assert len(taken) >= 3 and all(at % 5 == 0 for at in taken), taken
    for at in taken:
        saved = checkpoint.load(tmp_path / f"at{at}")
        snapshot = saved["meta"]["snapshot"]
        sent = [w["seq"] for w in snapshot["workers"]]
        for server in snapshot["servers"]:
            pushes = [w for kind, w, _ in server["in_flight"] if kind == "push"]
            assert [server["clock"][w] + pushes.count(w) for w in range(3)] == sent
            assert len(saved["arrays"][f"ps.in_flight.{server['server']}"]) == len(pushes)
            in_flight[at] = in_flight.get(at, 0) + len(pushes)
    at = max(in_flight, key=in_flight.get)  # the snapshot with the most pushes in flight
    assert in_flight[at] > 0, in_flight
    saved = checkpoint.load(tmp_path / f"at{at}")
    seen = []
    real_replay = ps_snapshot.replay

    def watched(loop, header, rows, ended):
        before = (loop.params.copy(), list(loop.clock))
        count = real_replay(loop, header, rows, ended)
        seen.append((loop.server, before, list(loop.clock), count))
        return count

    monkeypatch.setattr(ps_snapshot, "replay", watched)
    import dtrain.parallel.ps_server as ps_server

    monkeypatch.setattr(ps_server, "replay", watched)
    resumed = run(5, **flags, epochs=2, checkpoint_every=5, checkpoint_dir=str(tmp_path / f"at{at}"), resume=True)
    sent_at_cut = [w["seq"] for w in saved["meta"]["snapshot"]["workers"]]
    bounds = resumed["communication"]["per_rank"][0]["paradigm"]["shards"]
    for server, (params, clock_before), clock_after, count in sorted(seen):
        a, b = bounds[server]
        np.testing.assert_array_equal(params, saved["params"][a:b])  # the cut's shard, restored
        assert clock_before == [0, 0, 0]  # (replay restores the counters too)
        assert clock_after == sent_at_cut  # the cut's counts, then the pushes in flight replayed: each once
        assert count == len(saved["arrays"][f"ps.in_flight.{server}"])
    pushes = resumed["communication"]["per_rank"][0]["paradigm"]["pushes"]
    assert pushes["exactly_once"], pushes
    assert pushes["replayed"] == [len(saved["arrays"][f"ps.in_flight.{s}"]) for s in range(2)]
    assert len(resumed["epochs"]) == 2 and resumed["final"]["test_accuracy"] > 0.8


def test_another_paradigm_resumes_a_ps_async_snapshot_and_says_what_it_drops(tmp_path, monkeypatch, capsys):
    keep_snapshots(monkeypatch, tmp_path, {10})
    run(4, paradigm="ps-async", servers=1, epochs=1, checkpoint_every=10, checkpoint_dir=str(tmp_path / "run"))
    FAST["quiet"] = False
    try:
        resumed = run(3, paradigm="ddp", epochs=1, checkpoint_dir=str(tmp_path / "at10"), resume=True)
    finally:
        FAST["quiet"] = True
    assert "pushes in flight are dropped" in " ".join(capsys.readouterr().out.split())
    assert resumed["final"]["test_accuracy"] > 0.5


def test_a_push_slow_on_the_wire_can_cross_a_cut_with_the_next_one(tmp_path, monkeypatch):
    """Workers 1 and 2 late to the servers after the coordinator: a push the coordinator took before it recorded can
    reach a server that recorded earlier (at another worker's marker) together with the next one, which the marked
    reply answers: two a worker in flight (ps_snapshot.recording_rows). A snapshot every step, and every cut holds."""
    from dtrain.parallel import ps_worker

    most = []
    original_send, original_start = ps_snapshot.ServerRecording.send, ps_worker.start_push_and_pull

    def send(self, comm, server, workers):
        pushes = [w for kind, w, _ in self.in_flight if kind == "push"]
        most.append(max((pushes.count(w) for w in set(pushes)), default=0))
        return original_send(self, comm, server, workers)

    def late(comm, params, grads, servers):
        if comm.Get_rank() != 0:
            time.sleep(0.003)
        return original_start(comm, params, grads, servers)

    monkeypatch.setattr(ps_snapshot.ServerRecording, "send", send)
    monkeypatch.setattr(ps_worker, "start_push_and_pull", late)
    metrics = run(5, paradigm="ps-async", servers=2, epochs=1, checkpoint_every=1, checkpoint_dir=str(tmp_path))
    assert metrics["communication"]["per_rank"][0]["paradigm"]["pushes"]["exactly_once"]
    assert most and max(most) <= 2, most

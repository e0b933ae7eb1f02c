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
    """ps-async, 3 workers (one slowed) and 2 servers, plain SGD in float64, a snapshot every 5 global steps. Each
    cut holds, for each server and worker, the pushes the worker counts as sent (in the shard or in flight), and its
    shards are what the servers recorded. Resumed from the cut with the most pushes in flight, the final weights are
    the cut's minus lr / W times the sum of every push in flight and every push the workers sent since: each push
    applied once, its data, not only its count (SGD's update is a sum, so the order does not matter)."""
    from dtrain.parallel import ps_worker

    flags = dict(paradigm="ps-async", servers=2, slow_rank=1, slow_factor=2.0, dtype="float64", momentum=0.0)
    recorded = {}
    original_recording = ps_snapshot.ServerRecording.__init__

    def recording(self, loop, ordinal, number=None):
        original_recording(self, loop, ordinal, number)
        recorded[(loop.server, ordinal)] = self.params.copy()

    monkeypatch.setattr(ps_snapshot.ServerRecording, "__init__", recording)
    keep_snapshots(monkeypatch, tmp_path, None)
    run(5, **flags, epochs=2, checkpoint_every=5, checkpoint_dir=str(tmp_path / "run"))
    in_flight, taken = {}, sorted(int(folder.name[2:]) for folder in tmp_path.glob("at*"))
    # one every 5 global steps, unless the last is still being taken (rank 0, which writes, then takes fewer steps)
    # or workers are between two epochs: then at the next multiple
    assert len(taken) >= 3 and all(at % 5 == 0 for at in taken), taken
    for at in taken:
        saved = checkpoint.load(tmp_path / f"at{at}")
        snapshot = saved["meta"]["snapshot"]
        sent = [w["seq"] for w in snapshot["workers"]]
        assert all(0 <= w["cursor"] < 29 for w in snapshot["workers"])  # (29 slices a pass: the next starts at 0)
        for server in snapshot["servers"]:
            pushes = [w for kind, w, _ in server["in_flight"] if kind == "push"]
            assert [server["clock"][w] + pushes.count(w) for w in range(3)] == sent
            assert len(saved["arrays"][f"ps.in_flight.{server['server']}"]) == len(pushes)
            shard = recorded[(server["server"], server["ordinal"])]
            np.testing.assert_array_equal(saved["params"][_bounds(saved, server["server"])], shard)
            in_flight[at] = in_flight.get(at, 0) + len(pushes)
    at = max(in_flight, key=in_flight.get)  # the snapshot with the most pushes in flight
    assert in_flight[at] > 0, in_flight
    saved = checkpoint.load(tmp_path / f"at{at}")

    sent_since = []
    original_push = ps_worker.Worker.push_and_pull

    def push_and_pull(self):
        sent_since.append(self.model.flat_grads.copy())
        return original_push(self)

    monkeypatch.setattr(ps_worker.Worker, "push_and_pull", push_and_pull)
    resumed = run(5, **flags, epochs=2, checkpoint_dir=str(tmp_path / f"at{at}"), resume=True)
    pushes = resumed["communication"]["per_rank"][0]["paradigm"]["pushes"]
    assert pushes["exactly_once"] and pushes["replayed"] == [len(saved["arrays"][f"ps.in_flight.{s}"]) for s in (0, 1)]
    assert 2 * 3 * 29 <= sum(pushes["sent"]) <= 2 * (3 * 29 + 2)  # 2 epochs of W x 29 pushes, W - 1 more at most
    applied = np.sum(sent_since, axis=0)
    for server in (0, 1):
        applied[_bounds(saved, server)] += saved["arrays"][f"ps.in_flight.{server}"].sum(axis=0)
    expected = saved["params"] - 0.05 / 3 * applied  # (lr 0.05, each push at lr / W)
    final = checkpoint.load(tmp_path / f"at{at}")["params"]  # (the resumed run's final checkpoint)
    np.testing.assert_allclose(final, expected, rtol=0, atol=1e-12)
    assert resumed["final"]["test_accuracy"] > 0.6  # (plain SGD, 2 epochs)


def _bounds(saved, server: int) -> slice:
    """Server ``server``'s slice of the flat buffer (2 servers: chunk_bounds' balanced halves)."""
    from dtrain.parallel.parameter_server import shards

    a, b = shards(saved["params"].size, 2)[server]
    return slice(a, b)


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
    reply answers: two a worker in flight (ps_snapshot.ServerRecording). A snapshot every step, and every cut holds."""
    from dtrain.parallel import ps_worker

    most = []
    original_send, original_start = ps_snapshot.ServerRecording.send, ps_worker.start_push_and_pull

    def send(self, comm, server):
        pushes = [w for kind, w, _ in self.in_flight if kind == "push"]
        most.append(max((pushes.count(w) for w in set(pushes)), default=0))
        return original_send(self, comm, server)

    def late(comm, params, grads, servers):
        if comm.Get_rank() != 0:
            time.sleep(0.003)
        return original_start(comm, params, grads, servers)

    monkeypatch.setattr(ps_snapshot.ServerRecording, "send", send)
    monkeypatch.setattr(ps_worker, "start_push_and_pull", late)
    metrics = run(5, paradigm="ps-async", servers=2, epochs=1, checkpoint_every=1, checkpoint_dir=str(tmp_path))
    assert metrics["communication"]["per_rank"][0]["paradigm"]["pushes"]["exactly_once"]
    assert most and max(most) <= 2, most


def test_two_snapshots_open_at_once_on_a_server(tmp_path, monkeypatch):
    """Worker 2 late between its markers to the coordinator and to server 1: the coordinator, with all three, begins
    the next snapshot, and another worker's marker of it reaches server 1 before worker 2's of the last. A marker is
    its sender's k-th, snapshot k's: server 1 keeps both recordings open, and every cut still holds (a recording put
    together wrongly is refused as inconsistent when it is written)."""
    original_record = ps_snapshot.WorkerSnapshots.record

    class LateMarkers:
        def __init__(self, comm):
            self.comm, self.first = comm, True

        def Isend(self, buf, dest, tag):
            if buf.size == 0 and not self.first:
                time.sleep(0.02)
            self.first = False
            return self.comm.Isend(buf, dest, tag)

        def __getattr__(self, name):
            return getattr(self.comm, name)

    def record(self, worker, epoch, epoch_over):
        if self.rank == 2:
            self.comm = LateMarkers(self.comm)
        try:
            return original_record(self, worker, epoch, epoch_over)
        finally:
            self.comm = getattr(self.comm, "comm", self.comm)

    monkeypatch.setattr(ps_snapshot.WorkerSnapshots, "record", record)
    keep_snapshots(monkeypatch, tmp_path, None)
    metrics = run(5, paradigm="ps-async", servers=2, epochs=1, checkpoint_every=1, checkpoint_dir=str(tmp_path / "r"))
    assert metrics["communication"]["per_rank"][0]["paradigm"]["pushes"]["exactly_once"]
    assert len(list(tmp_path.glob("at*"))) >= 2

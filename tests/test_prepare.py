"""The prepared communicator: which layers a run gets, in which order, and that each one does its job through it.

Checked against independent counts: the tracer counts the algorithm's own bytes (buffer sizes), the staging counts
the copies it made (the same buffers, once each way), and a run without MPI trains on a simulated one-rank world
to the same weights as a run on MPI's one-rank world.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from test_gpu_staging import FakeDevice, FakeGpuArray

from dtrain.comm import sim, watchdog
from dtrain.comm.prepare import layers, prepare, world
from dtrain.comm.staging import StagedComm
from dtrain.comm.trace import Tracer
from dtrain.config import TrainConfig
from dtrain.train import train


@pytest.fixture
def no_watchdog():
    watchdog.configure(0)
    yield
    watchdog.configure(None)


def kinds(comm) -> list[str]:
    return [type(layer).__name__ for layer in layers(comm)]


def test_a_cpu_run_is_traced_and_nothing_else(no_watchdog):
    def fn(comm):
        prepared = prepare(comm)
        buf = np.arange(6, dtype=np.float64)
        prepared.Sendrecv(buf, (comm.Get_rank() + 1) % 2, recvbuf=np.empty(6), source=(comm.Get_rank() + 1) % 2)
        return kinds(prepared), prepared.tracer.summary()["totals"]["bytes_sent"]

    for names, sent in sim.run(2, fn):
        assert names == ["TracedComm", "SimComm"] and sent == 48


def test_the_tracer_can_be_given(no_watchdog):
    tracer = Tracer()
    comm = prepare(sim.solo(), tracer=tracer)
    assert comm.tracer is tracer and tracer.rank == 0


def test_gpu_buffers_are_staged_under_the_tracer(no_watchdog):
    """--device gpu: staging is innermost, so the tracer counts the algorithm's bytes and staging its own copies."""

    def fn(comm):
        prepared = prepare(comm, device="gpu", gpu=FakeDevice())
        peer = 1 - comm.Get_rank()
        send = FakeGpuArray(np.full(5, comm.Get_rank() + 1.0, dtype=np.float32))
        recv = FakeGpuArray(np.zeros(5, dtype=np.float32))
        prepared.Sendrecv(send, peer, recvbuf=recv, source=peer)
        return (
            kinds(prepared),
            recv.get().tolist(),
            prepared.tracer.summary()["totals"]["bytes_sent"],
            (prepared.staged_bytes_to_host, prepared.staged_bytes_to_device),
        )

    for rank, (names, got, traced, staged) in enumerate(sim.run(2, fn)):
        assert names == ["TracedComm", "StagedComm", "SimComm"]
        assert got == [2.0 - rank] * 5  # the peer's values arrived on the "device"
        assert traced == 20 and staged == (20, 20)


def test_sub_communicators_keep_every_layer(no_watchdog):
    def fn(comm):
        prepared = prepare(comm, device="gpu", gpu=FakeDevice())
        half = prepared.Split(comm.Get_rank() % 2, comm.Get_rank())
        return kinds(half), half.tracer is prepared.tracer

    for names, same_tracer in sim.run(4, fn):
        assert names == ["TracedComm", "StagedComm", "SimComm"] and same_tracer


def test_the_watchdog_layer_is_outermost_when_a_timeout_is_in_force(no_watchdog):
    comm = prepare(sim.solo(), timeout=30)
    try:
        assert kinds(comm) == ["WatchedComm", "TracedComm", "SimComm"]
        assert watchdog.timeout() == 30
        assert comm.tracer.rank == 0  # reached through the watchdog layer
    finally:
        watchdog.configure(0)
    assert kinds(prepare(sim.solo())) == ["TracedComm", "SimComm"]


def test_staging_follows_the_communicators_own_word(no_watchdog):
    # the simulator holds NumPy arrays only, so its staging never hands device buffers through
    comm = prepare(sim.solo(), device="gpu", gpu=FakeDevice())
    staged = next(layer for layer in layers(comm) if isinstance(layer, StagedComm))
    assert staged.cuda_aware is False


def test_without_mpi_the_world_is_a_simulated_rank(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now fails
    comm = world()
    assert isinstance(comm, sim.SimComm) and comm.Get_size() == 1


def test_training_without_mpi_matches_training_on_mpis_single_rank(monkeypatch, no_watchdog):
    config = TrainConfig(epochs=1, hidden=(16,), progress=False, quiet=True)
    on_mpi = train(config)
    assert on_mpi["communication"]["layers"] == ["TracedComm", "Intracomm"]
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    without = train(TrainConfig(epochs=1, hidden=(16,), progress=False, quiet=True))
    assert without["communication"]["layers"] == ["TracedComm", "SimComm"]
    assert without["weights_sha256"] == on_mpi["weights_sha256"]
    assert isinstance(without["communication"]["per_rank"], list) and len(without["communication"]["per_rank"]) == 1

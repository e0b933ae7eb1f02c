"""How ranks wait for messages (dtrain.comm.waitall / wait_mode / sendrecv), and the launcher's environment."""

import numpy as np
import pytest
from mpi_util import run_mpi

import dtrain.comm as dc
from dtrain.comm import sim
from dtrain.launch import mpiexec


@pytest.fixture
def fresh_wait_mode():
    dc.wait_mode.cache_clear()
    yield
    dc.wait_mode.cache_clear()


@pytest.mark.parametrize(
    ("local_ranks", "cores", "expected"), [(None, 2, "block"), ("2", 2, "block"), ("3", 2, "poll"), ("8", 16, "block")]
)
def test_auto_polls_exactly_when_this_node_has_more_ranks_than_cores(
    monkeypatch, fresh_wait_mode, local_ranks, cores, expected
):
    monkeypatch.delenv("DTRAIN_WAIT", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    if local_ranks is None:
        monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    else:
        monkeypatch.setenv("MPI_LOCALNRANKS", local_ranks)
    monkeypatch.setattr(dc, "usable_cores", lambda: cores)
    assert dc.wait_mode() == expected


def test_open_mpi_local_size_is_read_too(monkeypatch):
    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "6")
    assert dc.ranks_on_this_node() == 6


@pytest.mark.parametrize(("tasks", "node", "expected"), [("4", "0", 4), ("4(x2),3", "1", 4), ("4(x2),3", "2", 3),
                                                         ("4(x2),3", "7", 1), ("garbled(", "0", 1)])  # fmt: skip
def test_slurm_srun_tasks_per_node_are_read_too(monkeypatch, tasks, node, expected):
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_NODEID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", tasks)
    monkeypatch.setenv("SLURM_NODEID", node)
    assert dc.ranks_on_this_node() == expected


@pytest.mark.parametrize("mode", ["block", "poll"])
def test_the_environment_overrides_the_wait_mode(monkeypatch, fresh_wait_mode, mode):
    monkeypatch.setenv("DTRAIN_WAIT", mode)
    assert dc.wait_mode() == mode


def test_an_unknown_wait_mode_is_a_clear_error(monkeypatch, fresh_wait_mode):
    monkeypatch.setenv("DTRAIN_WAIT", "spin")
    with pytest.raises(ValueError, match="DTRAIN_WAIT='spin' is not one of: auto, block, poll"):
        dc.wait_mode()


def test_sendrecv_on_the_simulator_matches_a_ring_shift():
    def shift(comm):
        p, r = comm.Get_size(), comm.Get_rank()
        out, got = np.full(3, float(r)), np.empty(3)
        dc.sendrecv(comm, out, (r + 1) % p, got, (r - 1) % p)
        return got

    results = sim.run(4, shift)
    for r, got in enumerate(results):
        np.testing.assert_array_equal(got, np.full(3, float((r - 1) % 4)))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["block", "poll"])
def test_collectives_under_mpiexec_are_correct_with_either_wait(monkeypatch, mode):
    # the exchange-based algorithms, p = 3 (non-power-of-two fix-ups too), against MPI's own Allreduce
    monkeypatch.setenv("DTRAIN_WAIT", mode)
    code = (
        "import numpy as np\nfrom mpi4py import MPI\nfrom dtrain.collectives import allreduce\n"
        "from dtrain.comm import wait_mode\n"
        "comm = MPI.COMM_WORLD\n"
        f"assert wait_mode() == {mode!r}\n"
        "for alg in ('ring', 'doubling', 'rabenseifner'):\n"
        "    if alg == 'rabenseifner' and comm.size & (comm.size - 1): continue\n"
        "    for n in (0, 1, 7, 100003):\n"
        "        x = np.random.default_rng(comm.rank).integers(-9, 9, n).astype(np.float64)\n"
        "        want = x.copy(); comm.Allreduce(MPI.IN_PLACE, want)\n"
        "        allreduce(comm, x, algorithm=alg)\n"
        "        assert np.array_equal(x, want), (alg, n)\n"
        "print('ok', comm.rank)\n"
    )
    for p in (3, 4):
        result = run_mpi(p, ["-c", code], timeout=120)
        assert result.stdout.count("ok") == p


def test_launch_env_gives_one_thread_per_rank_and_yields_when_oversubscribed():
    env = mpiexec.environment(64, base={})
    assert all(env[name] == "1" for name in mpiexec.THREAD_VARIABLES)
    assert env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in mpiexec.environment(1, base={})
    assert mpiexec.environment(64, base={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"  # the user's choice wins


def test_launch_refuses_zero_ranks_before_starting_anything():
    with pytest.raises(ValueError, match="number of ranks must be >= 1"):
        mpiexec.command(0, ["x.py"])


def test_requests_wrapped_by_the_tracer_are_polled_not_blocked_on(monkeypatch):
    # real MPI requests (a rank sending to itself) inside TracedRequest wrappers: in poll mode, waitall must Test
    # them (and sleep between tests), never call their blocking Wait
    from mpi4py import MPI

    from dtrain.comm.trace import TracedComm, Tracer

    calls = []

    class Spy(TracedComm):
        def Isend(self, buf, dest, tag=0):
            return _spied(super().Isend(buf, dest, tag), calls)

        def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
            return _spied(super().Irecv(buf, source, tag), calls)

    monkeypatch.setattr(dc, "wait_mode", lambda: "poll")
    comm = Spy(MPI.COMM_SELF, Tracer())
    got = np.zeros(4)
    dc.sendrecv(comm, np.arange(4.0), 0, got, 0)
    np.testing.assert_array_equal(got, np.arange(4.0))
    assert "Test" in calls and "Wait" not in calls
    assert comm.tracer.summary()["totals"]["bytes_sent"] == 32


def _spied(request, calls):
    class SpiedRequest(type(request)):
        def Test(self, status=None):
            calls.append("Test")
            return super().Test(status)

        def Wait(self, status=None):
            calls.append("Wait")
            return super().Wait(status)

    request.__class__ = SpiedRequest
    return request


@pytest.mark.parametrize("mode", ["block", "poll"])
def test_simulated_requests_always_use_their_own_wait(monkeypatch, mode):
    # the simulator's blocking Wait is what makes its deadlock detection exact: waitall must not poll it
    monkeypatch.setattr(dc, "wait_mode", lambda: mode)
    with pytest.raises(sim.SimDeadlock):
        sim.run(2, lambda comm: dc.waitall([comm.Irecv(np.zeros(1), source=1 - comm.Get_rank())]))

"""All-to-all (dtrain/collectives/alltoall.py, "pairwise"): values, traffic, bad sizes, and MPI's own Alltoall.

The oracle is MPI's definition of ``MPI_Alltoall`` written out with NumPy, send buffer by send buffer: the j-th block
of rank i's receive buffer is the i-th block of rank j's send buffer. It runs on simulated ranks whose every send is
a rendezvous (the strictest setting: an exchange in the wrong order deadlocks there, and the simulator says so), and
once under mpiexec against mpi4py's ``comm.Alltoall`` itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_util import run_mpi_code

from dtrain import collectives
from dtrain.collectives import costmodel
from dtrain.comm import sim
from dtrain.comm.trace import TracedComm, Tracer

DTYPES = (np.float32, np.float64)


def mpi_alltoall(sendbufs: list[np.ndarray]) -> list[np.ndarray]:
    """``MPI_Alltoall`` with every rank's send buffer given: block j of rank i's result is block i of rank j's."""
    p = len(sendbufs)
    block = sendbufs[0].size // p
    results = []
    for i in range(p):
        recv = np.empty_like(sendbufs[i])
        for j in range(p):
            recv[j * block : (j + 1) * block] = sendbufs[j][i * block : (i + 1) * block]
        results.append(recv)
    return results


def inputs(n, p, dtype, seed=7):
    """Every rank's send buffer: random normals, distinct per rank and per element (a misplaced block shows)."""
    return [np.random.default_rng([seed, rank, n]).standard_normal(n).astype(dtype) for rank in range(p)]


def traced_alltoall(comm, xs):
    """Run the all-to-all on this rank's copy of its input through a tracer; return (buffer, returned, stats)."""
    tracer = Tracer()
    buf = xs[comm.Get_rank()].copy()
    out = collectives.alltoall(TracedComm(comm, tracer), buf)
    stats = tracer.stats.get("alltoall/pairwise")
    sent = (stats.messages_sent, stats.bytes_sent) if stats else (0, 0)
    return buf, out, sent


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_alltoall_matches_mpi_semantics_and_the_cost_model(p, dtype):
    for block in (0, 1, 3, 17, 250):
        n = block * p
        xs = inputs(n, p, dtype)
        want = mpi_alltoall(xs)
        results = sim.SimWorld(p, eager_limit=0, timeout=30).run(traced_alltoall, xs)
        for rank, (buf, out, sent) in enumerate(results):
            what = f"p={p} n={n} {dtype.__name__} rank {rank}"
            assert out is buf, what
            assert buf.dtype == dtype and np.array_equal(buf, want[rank]), what  # copied, so bit for bit
            itemsize = np.dtype(dtype).itemsize
            assert sent == costmodel.traffic("pairwise", n, itemsize, p, rank, collective="alltoall"), what
            assert sent == ((p - 1, (p - 1) * block * itemsize) if n else (0, 0)), what


def test_alltoall_with_eager_sends_and_twice_in_a_row_is_the_identity():
    p, n = 4, 4 * 1000  # above and below the simulator's eager limit, a reused scratch buffer on the second call
    xs = inputs(n, p, np.float64)

    def fn(comm):
        buf = xs[comm.Get_rank()].copy()
        collectives.alltoall(comm, buf)
        once = buf.copy()
        collectives.alltoall(comm, buf, algorithm="pairwise")
        return once, buf

    results = sim.run(p, fn)
    want = mpi_alltoall(xs)
    assert all(
        np.array_equal(once, want[r]) and np.array_equal(twice, xs[r]) for r, (once, twice) in enumerate(results)
    )


def test_alltoall_treats_any_shape_as_flat():
    p = 3

    def fn(comm):
        buf = np.full((p, 2), float(comm.Get_rank()))  # row j (two elements) goes to rank j
        buf[:, 1] = np.arange(p)
        collectives.alltoall(comm, buf)
        return buf

    for rank, buf in enumerate(sim.run(p, fn)):
        assert buf.shape == (p, 2)
        assert buf[:, 0].tolist() == [0.0, 1.0, 2.0] and buf[:, 1].tolist() == [float(rank)] * p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_cost_model_counts_p_minus_1_messages_of_n_over_p(p):
    n, itemsize = 840 * p, 4
    for rank in range(p):
        assert costmodel.bytes_sent("pairwise", n, itemsize, p, rank, collective="alltoall") == (p - 1) * 840 * 4
        assert costmodel.messages_sent("pairwise", n, itemsize, p, rank, collective="alltoall") == p - 1
    assert costmodel.bytes_sent("pairwise", 0, itemsize, p, 0, collective="alltoall") == 0
    machine = costmodel.Machine(alpha=1e-5, beta=1e-9, gamma=1.0)  # gamma: no reduction, so it must not show
    nbytes = n * itemsize
    assert costmodel.alltoall_time(nbytes, p, machine) == pytest.approx((p - 1) * 1e-5 + (p - 1) / p * nbytes * 1e-9)
    assert costmodel.alltoall_time(nbytes, 1, machine) == 0.0 and costmodel.alltoall_time(0, p, machine) == 0.0
    with pytest.raises(ValueError, match="no traffic model"):
        costmodel.traffic("ring", n, itemsize, p, 0, collective="alltoall")


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug-mode"])
def test_an_indivisible_buffer_is_a_value_error_on_every_rank_before_any_message(debug):
    p = 3

    def fn(comm):
        tracer = Tracer()
        buf = np.arange(7, dtype=np.float32)
        try:
            collectives.alltoall(TracedComm(comm, tracer), buf)
        except ValueError as exc:
            return exc, tracer.summary()["totals"]["messages_sent"], buf
        return None, None, buf

    collectives.set_debug(debug)
    try:
        results = sim.SimWorld(p, eager_limit=0, timeout=30).run(fn)
    finally:
        collectives.set_debug(None)
    for error, messages, buf in results:
        assert type(error) is ValueError and "divides evenly into p = 3 chunks" in str(error), error
        assert "pad it to 9 elements" in str(error)
        if not debug:  # (debug mode's comparison of calls is itself an object all-gather)
            assert messages == 0
        assert np.array_equal(buf, np.arange(7, dtype=np.float32))  # untouched


def test_alltoall_argument_errors_name_the_choices():
    world = sim.SimWorld(2)
    with pytest.raises(sim.SimRankError, match="choose one of pairwise"):
        world.run(lambda c: collectives.alltoall(c, np.zeros(4, np.float32), algorithm="ring"))
    with pytest.raises(sim.SimRankError, match="float32 or float64"):
        world.run(lambda c: collectives.alltoall(c, np.zeros(4, np.int64)))
    assert collectives.ALLTOALL_ALGORITHMS == ("pairwise",) and "alltoall" in collectives.__all__
    assert collectives.TABLE["alltoall"]["pairwise"].label == "alltoall/pairwise"


def test_debug_mode_catches_ranks_that_disagree_on_the_size():
    def fn(comm):
        collectives.alltoall(comm, np.zeros(4 if comm.Get_rank() else 6, np.float32))

    collectives.set_debug(True)
    try:
        results = sim.SimWorld(2, eager_limit=0, timeout=30).run(_error_of, fn)
    finally:
        collectives.set_debug(None)
    assert all(isinstance(e, collectives.CollectiveMismatchError) for e in results), results
    assert "collective='alltoall'" in str(results[0]) and "count=6" in str(results[0])


def _error_of(comm, fn):
    """Run ``fn(comm)``; return the exception it raised, or None."""
    try:
        fn(comm)
    except Exception as exc:  # the test inspects it
        return exc
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 4])
def test_alltoall_under_mpiexec_equals_mpi4pys_alltoall(p, tmp_path):
    code = """
        import sys
        import numpy as np
        from mpi4py import MPI
        from dtrain import collectives
        from dtrain.collectives import costmodel
        from dtrain.comm.trace import TracedComm, Tracer

        comm = MPI.COMM_WORLD
        p, rank = comm.Get_size(), comm.Get_rank()
        bad = []
        for dtype in (np.float32, np.float64):
            for block in (0, 1, 5, 1000, 1 << 16):
                n = block * p
                mine = np.random.default_rng([3, rank, n]).standard_normal(n).astype(dtype)
                theirs = np.empty_like(mine)
                comm.Alltoall(mine, theirs)
                tracer = Tracer()
                buf = mine.copy()
                collectives.alltoall(TracedComm(comm, tracer), buf)
                stats = tracer.stats.get("alltoall/pairwise")
                sent = (stats.messages_sent, stats.bytes_sent) if stats else (0, 0)
                want = costmodel.traffic("pairwise", n, buf.itemsize, p, rank, collective="alltoall")
                if not np.array_equal(buf, theirs):
                    bad.append(f"n={n} {dtype.__name__}: differs from MPI's Alltoall")
                if sent != want:
                    bad.append(f"n={n} {dtype.__name__}: sent {sent}, cost model says {want}")
        try:
            collectives.alltoall(comm, np.zeros(p + 1, np.float32))
            bad.append("an indivisible buffer raised nothing")
        except ValueError:
            pass
        comm.Barrier()
        for line in bad:
            print(f"rank {rank}: FAIL {line}", flush=True)
        total = comm.allreduce(len(bad))
        if rank == 0:
            print(f"alltoall p={p}: {total} failures", flush=True)
        sys.exit(1 if total else 0)
    """
    result = run_mpi_code(p, code, tmp_path, timeout=120)
    assert f"alltoall p={p}: 0 failures" in result.stdout, result.stdout + result.stderr

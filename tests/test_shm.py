"""Shared-memory collectives (dtrain/collectives/shm.py on dtrain/comm/windows.py): values, bits, copies, bad input.

The oracle on simulated ranks is NumPy: every rank's input summed in float64, in rank order. Floating-point addition
is not associative, so a sum in another order is not "wrong", only bounded: each of the p - 1 additions rounds by at
most eps/2 of a partial sum, and no partial sum exceeds sum_i |x_i|, so *any* order is within
``(p-1)/2 * eps * sum_i |x_i|`` of the exact sum, elementwise, and two orders (shm's and the oracle's, or shm's and
the ring's) are within ``(p-1) * eps * sum_i |x_i|`` of each other. An average adds the rounding of 1/p and of the
product: ``(p+1)/p * eps * sum_i |x_i|``. A maximum, and every copy (all-gather), must be exact.

Under mpiexec ``tests/mpi_scripts/check_shm.py`` holds every algorithm against MPI's own Allreduce, once per p, and
the tests look at /dev/shm before and after. The bytes a rank copies are held against ``shm.bytes_copied`` and the
bytes it sends against the cost model, as counted by the tracer.

"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest
from mpi_util import run_mpi

from dtrain import collectives, kernels
from dtrain.collectives import costmodel, hierarchical, shm, shm_windows
from dtrain.comm import sim, windows
from dtrain.comm.trace import TracedComm, Tracer
from dtrain.comm.wrapper import innermost

SCRIPT = Path(__file__).parent / "mpi_scripts" / "check_shm.py"
_spec = importlib.util.spec_from_file_location("check_shm", SCRIPT)
check_shm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_shm)

DTYPES = (np.float32, np.float64)
SIZES = (0, 1, 7, 13, 1000)  # 7 and 13: chunks of unequal length for p = 2..5
PS = (1, 2, 3, 4, 5)
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
K = 2  # ranks per emulated node: p = 3 and 5 have a last node of one rank


def inputs(n, p, dtype, seed=11):
    """Every rank's input: random normals, distinct per rank and element (a misplaced chunk shows)."""
    return [np.random.default_rng([seed, rank, n]).standard_normal(n).astype(dtype) for rank in range(p)]


def oracle(xs, op):
    """(the reduction of every rank's input in float64, rank by rank in order; sum_i |x_i|)."""
    if op == "max":
        return np.maximum.reduce([x.astype(np.float64) for x in xs]), None
    total, abs_sum = np.zeros(xs[0].size), np.zeros(xs[0].size)
    for x in xs:
        total += x
        abs_sum += np.abs(x)
    return (total / len(xs) if op == "avg" else total), abs_sum


def assert_close(got, want, abs_sum, op, p, dtype, what):
    """``got`` equals the oracle: a max exactly, a sum or average within the reduction-order bound (module doc) for
    ``dtype``'s eps."""
    got = np.asarray(got, dtype=np.float64)
    if op == "max":
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{what}: {bad.size} elements differ from the oracle, first at {bad[:1]}"
        return
    eps = np.finfo(dtype).eps
    tol = (p + 1) / p * eps * abs_sum if op == "avg" else (p - 1) * eps * abs_sum
    bad = np.flatnonzero(np.abs(got - want) > tol)
    assert bad.size == 0, f"{what}: {bad.size} elements beyond the reduction-order bound, first at {bad[:1]}"


def run(p, fn, *args, timeout=60):
    """Run ``fn(comm, *args)`` on p simulated ranks (every send a rendezvous, the strictest setting)."""
    return sim.SimWorld(p, eager_limit=0, timeout=timeout).run(fn, *args)


def call(collective, comm, buf, op, door):
    """One shm collective through the front door or straight into shm.py; what it returns."""
    if door == "front":
        if collective == "allgather":
            return collectives.allgather(comm, buf, algorithm="shm")
        return getattr(collectives, collective)(comm, buf, op, algorithm="shm")
    if collective == "allgather":
        return shm.allgather(comm, buf)
    return getattr(shm, collective)(comm, buf, op)


# --- values against NumPy, on simulated ranks ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("p", PS)
def test_allreduce_reduce_scatter_allgather_equal_a_numpy_oracle(p, dtype):
    name = np.dtype(dtype).name

    def rank_main(comm):
        r, results = comm.Get_rank(), {}
        zero = shm.buffer(comm, max(SIZES), dtype)  # prefixes of it: zero copy, the same place on every rank
        for n in SIZES:
            x = inputs(n, p, dtype)[r]
            lo, hi = collectives.chunk_bounds(n, p)[r]
            for place in ("zero-copy", "copy-in"):
                buf = zero[:n] if place == "zero-copy" else np.empty(n, dtype)
                for door in ("front", "direct"):
                    for op in collectives.OPS:
                        buf[...] = x
                        out = call("allreduce", comm, buf, op, door)
                        results["allreduce", n, place, door, op] = (out is buf, buf.copy())
                        buf[...] = x
                        shard = call("reduce_scatter", comm, buf, op, door)
                        view = shard.size == hi - lo and (hi == lo or np.shares_memory(shard, buf[lo:hi]))
                        results["reduce_scatter", n, place, door, op] = (view, shard.copy())
                    buf[...] = np.nan  # every chunk but mine is garbage before the all-gather
                    buf[lo:hi] = inputs(n, p, dtype)[0][lo:hi]
                    out = call("allgather", comm, buf, None, door)
                    results["allgather", n, place, door, None] = (out is buf, buf.copy())
        shm.release(comm)
        return results

    per_rank = run(p, rank_main)
    for n in SIZES:
        xs = inputs(n, p, dtype)
        for rank, results in enumerate(per_rank):
            lo, hi = collectives.chunk_bounds(n, p)[rank]
            for (collective, size, place, door, op), (returned, got) in results.items():
                if size != n:
                    continue
                what = f"{collective}/shm {door} {place} p={p} n={n} {name} {op} rank {rank}"
                assert got.dtype == dtype, what
                if collective == "allgather":
                    assert returned and np.array_equal(got, xs[0]), what  # copies: bit for bit
                    continue
                want, abs_sum = oracle(xs, op)
                if collective == "reduce_scatter":
                    want, abs_sum = want[lo:hi], None if abs_sum is None else abs_sum[lo:hi]
                assert returned, f"{what}: did not return its buffer (or chunk r of it, a view)"
                assert_close(got, want, abs_sum, op, p, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("p", PS)
def test_hierarchical_shm_equals_a_numpy_oracle(p, dtype):
    """Nodes of K = 2 ranks (p odd: a last node of one): zero copy in a window on the node, copy-in, through the
    front door with a topology or with ranks_per_node alone, and straight into shm.hierarchical_allreduce."""
    name = np.dtype(dtype).name

    def rank_main(comm):
        r, results = comm.Get_rank(), {}
        topo = hierarchical.topology(comm, K)
        zero = shm.buffer(topo.node, max(SIZES), dtype)
        for n in SIZES:
            x = inputs(n, p, dtype)[r]
            for op in collectives.OPS:
                ways = {
                    "zero-copy": (zero[:n], lambda b, op=op: collectives.allreduce(
                        comm, b, op, "hierarchical_shm", topology=topo)),
                    "copy-in": (np.empty(n, dtype), lambda b, op=op: collectives.allreduce(
                        comm, b, op, "hierarchical_shm", topology=topo)),
                    "ranks_per_node": (np.empty(n, dtype), lambda b, op=op: collectives.allreduce(
                        comm, b, op, "hierarchical_shm", ranks_per_node=K)),
                    "direct": (np.empty(n, dtype), lambda b, op=op: shm.hierarchical_allreduce(topo, b, op)),
                }  # fmt: skip
                for way, (buf, allreduce) in ways.items():
                    buf[...] = x
                    out = allreduce(buf)
                    results[n, way, op] = (out is buf, buf.copy())
        shm.release(topo.node)
        topo.free()
        return results

    for rank, results in enumerate(run(p, rank_main)):
        for (n, way, op), (returned, got) in results.items():
            what = f"allreduce/hierarchical_shm {way} p={p} n={n} {name} {op} rank {rank}"
            want, abs_sum = oracle(inputs(n, p, dtype), op)
            assert returned, what
            assert_close(got, want, abs_sum, op, p, dtype, what)


def test_the_oracle_comparison_can_fail():
    """A sum off by more than the reduction-order bound fails, and so does a maximum off in one element."""
    xs = inputs(1000, 4, np.float32)
    want, abs_sum = oracle(xs, "sum")
    wrong = want + 4 * np.finfo(np.float32).eps * abs_sum
    with pytest.raises(AssertionError, match="beyond the reduction-order bound"):
        assert_close(wrong, want, abs_sum, "sum", 4, np.float32, "sum")
    with pytest.raises(AssertionError, match="differ from the oracle"):
        assert_close(want + (np.arange(1000) == 999), want, None, "max", 4, np.float32, "max")


def test_a_wrong_reduction_fails_the_value_test(monkeypatch):
    real = kernels.sum_scale_
    monkeypatch.setattr(kernels, "sum_scale_", lambda out, bufs, factor: real(out[1:], [b[1:] for b in bufs], factor))
    with pytest.raises(AssertionError, match="allreduce/shm"):
        test_allreduce_reduce_scatter_allgather_equal_a_numpy_oracle(3, np.float64)


# --- determinism -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 5])
def test_the_same_inputs_give_the_same_bits_and_the_ring_agrees_within_the_bound(p):
    """shm sums each chunk once, in a fixed order (its own chunk first, then the others in rank order), and copies the
    sum: the same bits on every run, on every rank, zero copy or not. The ring adds in another order; both are within
    (p-1)/2 * eps * sum_i |x_i| of the exact sum, so within (p-1) * eps * sum_i |x_i| of each other."""
    n = 1001

    def rank_main(comm):
        x = inputs(n, p, np.float32)[comm.Get_rank()]
        zero = shm.buffer(comm, n, np.float32)
        got = []
        for buf in (zero, np.empty(n, np.float32), zero, np.empty(n, np.float32)):
            buf[...] = x
            collectives.allreduce(comm, buf, algorithm="shm")
            got.append(buf.copy())
        ring = x.copy()
        collectives.allreduce(comm, ring, algorithm="ring")
        shm.release(comm)
        return got, ring

    results = run(p, rank_main)
    first = results[0][0][0]
    for rank, (got, ring) in enumerate(results):
        for i, bits in enumerate(got):
            assert bits.tobytes() == first.tobytes(), f"rank {rank}, call {i}: other bits than rank 0's first call"
        _, abs_sum = oracle(inputs(n, p, np.float32), "sum")
        assert_close(ring, first.astype(np.float64), abs_sum, "sum", p, np.float32, f"ring vs shm, rank {rank}")
    want, abs_sum = oracle(inputs(n, p, np.float32), "sum")
    assert_close(first, want, abs_sum, "sum", p, np.float32, "shm vs the oracle")


# --- what the tracer counts: bytes copied (shm.bytes_copied) and bytes sent (the cost model) --------------------


def traced_counts(comm, collective, n, dtype, copy_in, algorithm="shm"):
    """Run one traced call on this rank's input: (bytes copied, bytes sent, messages sent) under its label, and for
    hierarchical_shm (this rank's node's size, its rank there)."""
    tracer = Tracer()
    tcomm = TracedComm(comm, tracer)
    label = f"{collective}/{algorithm}"
    if algorithm == "hierarchical_shm":
        topo = hierarchical.topology(tcomm, K)
        buf = np.empty(n, dtype) if copy_in else shm.buffer(topo.node, n, dtype)
        buf[...] = inputs(n, comm.Get_size(), dtype)[comm.Get_rank()]
        tracer.reset()
        collectives.allreduce(tcomm, buf, algorithm=algorithm, topology=topo)
        node = (topo.node.Get_size(), topo.node.Get_rank())
        shm.release(topo.node)
        topo.free()
    else:
        buf = np.empty(n, dtype) if copy_in else shm.buffer(tcomm, n, dtype)
        buf[...] = inputs(n, comm.Get_size(), dtype)[comm.Get_rank()]
        call(collective, tcomm, buf, "sum", "front")
        node = None
        shm.release(tcomm)
    stats = tracer.stats.get(label)
    counts = (stats.bytes_copied, stats.bytes_sent, stats.messages_sent) if stats else (0, 0, 0)
    return (*counts, node)


@pytest.mark.parametrize(
    "collective, copy_in",
    [
        ("allreduce", False),
        ("allreduce", True),
        ("reduce_scatter", False),
        ("reduce_scatter", True),
        ("allgather", False),
        ("allgather", True),
    ],
)
def test_the_bytes_copied_are_what_shm_bytes_copied_says(collective, copy_in):
    for p in PS:
        for n in SIZES:
            for dtype in DTYPES:
                itemsize = np.dtype(dtype).itemsize
                results = run(p, traced_counts, collective, n, dtype, copy_in)
                for rank, (copied, *_) in enumerate(results):
                    want = shm.bytes_copied(collective, n, itemsize, p, rank, copy_in)
                    what = f"{collective}/shm copy_in={copy_in} p={p} n={n} {np.dtype(dtype).name} rank {rank}"
                    assert copied == want, f"{what}: the tracer counted {copied} bytes copied, the model {want}"


@pytest.mark.parametrize("copy_in", [False, True], ids=["zero-copy", "copy-in"])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_shm_sends_nothing(collective, copy_in):
    for p in PS:
        for n in (1, 13):
            results = run(p, traced_counts, collective, n, np.float32, copy_in)
            for rank, (copied, sent, messages, _) in enumerate(results):
                model = costmodel.traffic("shm", n, 4, p, rank, collective=collective)
                assert model == (0, 0) and (messages, sent) == model, f"{collective} p={p} n={n} rank {rank}"
                assert sent == costmodel.bytes_sent("shm", n, 4, p, rank, collective=collective)
                assert copied > 0 or not n >= p > 1, "nothing copied either: no work was counted at all"


# A node of one rank (p odd with ranks_per_node 2, or p = 1) copies a copy-in buffer into its scratch and back out.
@pytest.mark.parametrize(
    "p, copy_in",
    [(p, False) for p in PS] + [(p, True) for p in PS],
)
def test_hierarchical_shm_copies_and_sends_what_the_models_say(p, copy_in):
    for n in SIZES:
        for dtype in DTYPES:
            itemsize = np.dtype(dtype).itemsize
            results = run(p, traced_counts, "allreduce", n, dtype, copy_in, "hierarchical_shm")
            for rank, (copied, sent, _, (node_size, local)) in enumerate(results):
                what = f"hierarchical_shm copy_in={copy_in} p={p} n={n} {np.dtype(dtype).name} rank {rank}"
                want = costmodel.bytes_sent("hierarchical_shm", n, itemsize, p, rank, K)
                assert sent == want, f"{what}: sent {sent} bytes, the cost model says {want}"
                assert (sent > 0) == (local == 0 and p > K and n > 0), f"{what}: only leaders send"
                want = shm.bytes_copied("hierarchical_shm", n, itemsize, node_size, local, copy_in)
                assert copied == want, f"{what}: the tracer counted {copied} bytes copied, the model {want}"


def test_a_wrong_copy_model_fails_the_copy_test(monkeypatch):
    real = shm.bytes_copied
    monkeypatch.setattr(shm, "bytes_copied", lambda c, n, i, p, r, copy_in=False: real(c, n, i, p, r, copy_in) + i)
    with pytest.raises(AssertionError, match="bytes copied"):
        test_the_bytes_copied_are_what_shm_bytes_copied_says("allgather", False)


# --- bad input: the same error on every rank, never a hang, never a wrong sum -------------------------------------


def errors_on_each_rank(p, fn, debug=False):
    """Run ``fn(comm)`` on p simulated ranks (in debug mode or not); each rank's exception, or None."""

    def rank_main(comm):
        try:
            fn(comm)
        except Exception as exc:  # the test inspects it
            return exc
        finally:
            shm.release(comm)
        return None

    collectives.set_debug(debug)
    try:
        return run(p, rank_main, timeout=30)
    finally:
        collectives.set_debug(None)


def _zero(comm, n=16):
    buf = shm.buffer(comm, n, np.float64)
    buf[...] = 1.0
    return buf


MISMATCHES = {
    "op": lambda comm, r: shm.allreduce(comm, _zero(comm), "max" if r == 0 else "sum"),  # (the front door's checks
    # compare ops only in debug mode: shm's own announcement catches it always)
    "size": lambda comm, r: collectives.allreduce(comm, _zero(comm)[: 5 + r], algorithm="shm"),
    "offset": lambda comm, r: collectives.allreduce(comm, _zero(comm)[r : r + 5], algorithm="shm"),
    "collective": lambda comm, r: (collectives.allgather if r else collectives.allreduce)(
        comm, _zero(comm), algorithm="shm"
    ),
    "reduce_scatter size": lambda comm, r: collectives.reduce_scatter(comm, _zero(comm)[: 9 - r], algorithm="shm"),
    "copy-in size": lambda comm, r: collectives.allreduce(comm, np.ones(10 + r % 2), algorithm="shm"),  # same scratch
    "hierarchical size": lambda comm, r: collectives.allreduce(
        comm, np.ones(6 + r), algorithm="hierarchical_shm", ranks_per_node=3
    ),
}
# Calls that would hang if a rank allocated or grew the copy-in scratch (a collective) on its own: the ranks compare
# their calls in the control window after fence 1, before any of them allocates (shm_windows.py).
HANGS = {
    "copy-in sizes, first call": lambda comm, r: collectives.allreduce(comm, np.ones(8 + 8 * r), algorithm="shm"),
    "copy-in grows on some ranks": lambda comm, r: [
        collectives.allreduce(comm, np.ones(n), algorithm="shm") for n in (8, 8 + 8 * r)
    ],
    "zero copy on some ranks, copy-in on others": lambda comm, r: collectives.allreduce(
        comm, (_zero(comm), np.ones(16))[r == 0], algorithm="shm"
    ),
}


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("case", [*MISMATCHES, *HANGS])
def test_a_call_that_differs_on_one_rank_is_a_value_error_on_every_rank(case, p):
    mismatch = {**MISMATCHES, **HANGS}[case]
    errors = errors_on_each_rank(p, lambda comm: mismatch(comm, comm.Get_rank()))
    assert all(type(e) is ValueError for e in errors), errors
    assert all("every rank must make the same call" in str(e) for e in errors), errors


@pytest.mark.parametrize("p", [2, 3])
def test_after_a_mismatch_the_next_call_is_right(p):
    def rank_main(comm):
        zero = _zero(comm)
        try:
            collectives.allreduce(comm, zero[: 3 + comm.Get_rank()], algorithm="shm")
        except ValueError:
            pass
        zero[...] = comm.Get_rank() + 1
        collectives.allreduce(comm, zero, algorithm="shm")
        shm.release(comm)
        return zero.copy()

    assert all(np.array_equal(got, np.full(16, p * (p + 1) / 2)) for got in run(p, rank_main))


class FakeCupyArray(np.ndarray):
    """A NumPy array that dtrain.backend takes for a CuPy one (it looks at the type's module)."""

    __module__ = "cupy_stand_in"


class FakeDeviceBuffer:
    """A device buffer that is no ndarray at all: what the front door's checks read, and CUDA's interface."""

    def __init__(self, n):
        self._host = np.zeros(n, np.float32)
        self.dtype, self.flags, self.ndim, self.size, self.nbytes = (
            self._host.dtype, self._host.flags, 1, n, self._host.nbytes)  # fmt: skip
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (0, False), "version": 3}

    def reshape(self, *shape):
        return self


@pytest.mark.parametrize("make", [lambda n: np.zeros(n, np.float32).view(FakeCupyArray), FakeDeviceBuffer],
                         ids=["ndarray-subclass", "no-ndarray"])  # fmt: skip
@pytest.mark.parametrize("door", ["front", "direct"])
@pytest.mark.parametrize("collective", [*COLLECTIVES, "hierarchical_shm"])
def test_a_device_array_is_a_clear_error_on_every_rank(collective, door, make):
    def fn(comm):
        buf = make(8)
        if collective == "hierarchical_shm":
            if door == "front":
                collectives.allreduce(comm, buf, algorithm="hierarchical_shm", ranks_per_node=2)
            else:
                topo = hierarchical.topology(comm, 2)
                try:
                    shm.hierarchical_allreduce(topo, buf)
                finally:
                    topo.free()
        else:
            call(collective, comm, buf, "sum", door)

    errors = errors_on_each_rank(3, fn)
    name = type(make(1)).__name__
    for error in errors:
        assert type(error) is ValueError, errors
        assert "host memory" in str(error) and name in str(error) and "ring" in str(error), str(error)


@pytest.mark.parametrize(
    "mismatch",
    [
        lambda comm, r: collectives.allreduce(comm, _zero(comm)[: 5 + r], algorithm="shm"),
        lambda comm, r: collectives.allreduce(comm, np.ones(8 + 8 * r), algorithm="shm"),  # (compared before shm)
        lambda comm, r: collectives.allreduce(comm, _zero(comm), algorithm="shm" if r else "ring"),
        lambda comm, r: collectives.reduce_scatter(comm, _zero(comm), "max" if r else "sum", algorithm="shm"),
        lambda comm, r: collectives.allreduce(comm, _zero(comm), algorithm="hierarchical_shm", ranks_per_node=1 + r),
    ],
    ids=["zero-copy size", "copy-in size", "algorithm", "op", "ranks_per_node"],
)
def test_debug_mode_turns_a_mismatch_into_the_same_collective_mismatch_error(mismatch):
    errors = errors_on_each_rank(3, lambda comm: mismatch(comm, comm.Get_rank()), debug=True)
    assert all(isinstance(e, collectives.CollectiveMismatchError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1


# --- the windows: release, the copy-in scratch ---------------------------------------------------------------------


@pytest.fixture
def allocated(monkeypatch):
    """Every SharedWindow allocated while the test runs, with the innermost communicator it was allocated on."""
    made, real = [], windows.allocate

    def recording(comm, nbytes):
        window = real(comm, nbytes)
        made.append((innermost(comm), window))
        return window

    monkeypatch.setattr(windows, "allocate", recording)
    return made


def test_release_frees_every_window_and_a_second_release_is_harmless(allocated):
    def rank_main(comm):
        zero = shm.buffer(comm, 10, np.float64)
        zero[...] = 1.0
        collectives.allreduce(comm, zero, algorithm="shm")
        collectives.allreduce(comm, np.ones(10), algorithm="shm")  # the scratch window
        mine = [w for inner, w in allocated if inner is innermost(comm)]
        before = [w.freed for w in mine]
        shm.release(comm)
        after = [w.freed for w in mine]
        shm.release(comm)  # nothing left: no error, no collective call
        again = np.full(10, 2.0)  # after release: a new scratch window, the right sum
        collectives.allreduce(comm, again, algorithm="shm")
        shm.release(comm)
        return before, after, again, [w.freed for inner, w in allocated if inner is innermost(comm)]

    for before, after, again, finally_freed in run(3, rank_main):  # (the control window, the buffer, the scratch)
        assert before == [False, False, False] and after == [True, True, True]
        assert np.array_equal(again, np.full(10, 6.0))
        assert len(finally_freed) == 5 and all(finally_freed)


def test_the_scratch_window_grows_when_a_bigger_buffer_comes(allocated):
    def rank_main(comm):
        mine = lambda: [w for inner, w in allocated if inner is innermost(comm)]  # noqa: E731
        zero = shm.buffer(comm, 4, np.float64)
        steps = []
        for n in (10, 5, 100, 100, 7):
            buf = np.full(n, comm.Get_rank() + 1.0)
            collectives.allreduce(comm, buf, algorithm="shm")
            steps.append(np.array_equal(buf, np.full(n, 6.0)))
            steps.append([(w.nbytes, w.freed) for w in mine()])
        result = steps, zero.copy()
        shm.release(comm)
        return result

    for steps, zero in run(3, rank_main):
        assert all(steps[0::2]), "a copy-in all-reduce went wrong"
        after = steps[1::2]  # (the control window, the zero-copy buffer, the scratch, ...)
        assert len(after[0]) == 3 and len(after[1]) == 3, "a smaller buffer made a new window"
        assert len(after[2]) == 4 and after[2][2][1] and not any(w[1] for w in after[2][:2]), "the old scratch only"
        assert after[2][3][0] >= 100 * 8 and not after[2][3][1]
        assert after[4] == after[3] == after[2], "the grown scratch is used again"
        assert np.array_equal(zero, np.zeros(4)), "the zero-copy window was touched"


# hierarchical_shm with ranks_per_node and no topology builds a topology for the call and frees it afterwards
# (collectives._run): Topology.free releases the windows on its communicators first.
def test_a_per_call_topology_leaves_no_window_behind(allocated):
    def rank_main(comm):
        buf = np.ones(100)
        for _ in range(3):
            collectives.allreduce(comm, buf, algorithm="hierarchical_shm", ranks_per_node=2)

    run(4, rank_main)
    assert allocated and all(w.freed for _, w in allocated), "windows left allocated"


# --- under mpiexec: against MPI's own Allreduce; /dev/shm; a rank that fails inside -------------------------------


DEV_SHM = Path("/dev/shm")


def in_use(names):
    """Those of ``names`` (in /dev/shm) that some process maps now: another job's, not ours to judge."""
    found = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        found |= {name for name in names if f"/dev/shm/{name}" in text}
    return found


def left_in_dev_shm(before, grace=3.0):
    """What appeared in /dev/shm since ``before`` and nobody maps (a segment our job left), after ``grace`` seconds
    (an aborted job's ranks may take a moment to let go of theirs, and the launcher to remove it)."""
    deadline = time.monotonic() + grace
    while True:
        new = set(os.listdir(DEV_SHM)) - before
        left = new - in_use(new)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.skipif(not DEV_SHM.is_dir(), reason="no /dev/shm here")
def test_the_dev_shm_check_sees_what_is_left_and_not_what_another_process_maps():
    before = set(os.listdir(DEV_SHM))
    left, mapped = DEV_SHM / f"dtrain_test_shm_{os.getpid()}_left", DEV_SHM / f"dtrain_test_shm_{os.getpid()}_mapped"
    try:
        left.write_bytes(b"x" * 4096)
        mapped.write_bytes(b"x" * 4096)
        with mapped.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
            assert left_in_dev_shm(before, grace=0.2) == {left.name}
    finally:
        left.unlink(missing_ok=True)
        mapped.unlink(missing_ok=True)


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_shm_collective_under_mpiexec_equals_mpis_allreduce_and_leaves_nothing(p):
    before = set(os.listdir(DEV_SHM)) if DEV_SHM.is_dir() else None
    result = run_mpi(p, [str(SCRIPT)], timeout=120)
    assert f"check_shm p={p}:" in result.stdout and " 0 failures" in result.stdout, result.stdout
    if before is not None:
        assert not left_in_dev_shm(before), "the job left shared memory behind in /dev/shm"


@pytest.mark.mpi
def test_a_rank_that_fails_inside_a_shm_collective_ends_the_job_at_once():
    before = set(os.listdir(DEV_SHM)) if DEV_SHM.is_dir() else None
    started = time.monotonic()
    result = run_mpi(3, [str(SCRIPT), "--fail-on-rank", "1"], timeout=120, check=False)
    took = time.monotonic() - started
    assert result.returncode != 0
    assert result.stderr.count("uncaught exception (rank 1), ending the job:") == 1, result.stderr
    assert "RuntimeError: rank 1 fails inside the shm all-reduce" in result.stderr
    assert "left the all-reduce" not in result.stdout, "a rank went on past a fence its peer never reached"
    assert took < 60, f"{took:.0f} s: the waiting ranks were not aborted (the watchdog's default is 300 s)"
    if before is not None:
        assert not left_in_dev_shm(before), "the aborted job left shared memory behind in /dev/shm"


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_the_mpi_checker_passes_on_the_simulator(p):
    results = run(p, check_shm.run_checks, timeout=120)
    failures = [line for _, lines in results for line in lines]
    assert sum(count for count, _ in results) > 1000 and not failures, "\n".join(failures[:20])


def test_the_mpi_checker_catches_a_wrong_sum_and_a_wrong_copy_count(monkeypatch):
    real_sum, real_copied = kernels.sum_scale_, shm.bytes_copied
    monkeypatch.setattr(kernels, "sum_scale_", lambda out, bufs, f: real_sum(out[:-1], [b[:-1] for b in bufs], f))
    monkeypatch.setattr(shm, "bytes_copied", lambda *args: real_copied(*args) + 1)
    failures = [line for _, lines in run(3, check_shm.run_checks, timeout=120) for line in lines]
    assert any("allreduce/shm" in f and "elements" in f for f in failures)
    assert any("reduce_scatter/shm" in f for f in failures)
    assert any("hierarchical_shm" in f for f in failures)
    assert any("shm.bytes_copied" in f or "the models say" in f for f in failures)


# --- the cost model ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("machine", [None, costmodel.Machine()], ids=["calibrated", "defaults"])
def test_predicted_times_are_positive_and_finite(machine):
    for p in (2, 3, 4, 5, 8, 16):
        for nbytes in (1, 4, 1000, 1 << 20, 1 << 30):
            for algorithm, k in (("shm", None), ("hierarchical_shm", None), ("hierarchical_shm", 2)):
                t = costmodel.predict_time(algorithm, nbytes, p, machine, ranks_per_node=k)
                assert math.isfinite(t) and t > 0, (algorithm, nbytes, p, k, t)
            for collective in (*COLLECTIVES, "hierarchical_shm"):
                m = machine or costmodel.default_machine(p)
                for copy_in in (False, True):
                    t = shm.predict_time(collective, nbytes, p, m, copy_in)
                    assert math.isfinite(t) and t > 0, (collective, nbytes, p, copy_in, t)
    assert costmodel.predict_time("shm", 0, 4) == costmodel.predict_time("shm", 100, 1) == 0.0
    # more bytes never cost less; a copy-in never costs less than zero copy
    m = costmodel.Machine()
    times = [costmodel.predict_time("shm", 1 << e, 4, m) for e in range(0, 30, 3)]
    assert times == sorted(times)
    assert shm.predict_time("allreduce", 1 << 20, 4, m, True) > shm.predict_time("allreduce", 1 << 20, 4, m)


def test_shm_traffic_is_zero_for_every_rank():
    for collective in COLLECTIVES:
        for p in PS:
            for n in (0, 1, 7, 1000):
                for rank in range(p):
                    assert costmodel.traffic("shm", n, 8, p, rank, collective=collective) == (0, 0)
                    assert costmodel.bytes_sent("shm", n, 8, p, rank, collective=collective) == 0


def test_shm_threshold_is_none_for_a_rank_count_not_calibrated(tmp_path, monkeypatch):
    calibrated = json.loads(costmodel.CALIBRATION.read_text()) if costmodel.CALIBRATION.exists() else {}
    measured = {int(k) for k in calibrated.get("by_ranks", {})}
    absent = next(p for p in range(2, 1000) if p not in measured)
    assert costmodel.shm_threshold(absent) is None
    # a calibration that measured shm for 4 ranks: 4 has a threshold, 5 (not measured) and 2 (never faster) none
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"by_ranks": {"4": {"shm_from_bytes": 65536}, "2": {"shm_from_bytes": None}}}))
    monkeypatch.setattr(costmodel, "CALIBRATION", path)
    costmodel._shm_thresholds.cache_clear()
    try:
        assert costmodel.shm_threshold(4) == 65536
        assert costmodel.shm_threshold(5) is None and costmodel.shm_threshold(2) is None
    finally:
        monkeypatch.undo()
        costmodel._shm_thresholds.cache_clear()


def test_release_mine_frees_this_ranks_windows_on_every_communicator_and_no_other_ranks(allocated):
    """The driver's end of a run: every window this rank made, on any communicator, and none of another rank's
    (simulated ranks are threads of one process: their windows are all in one table)."""

    def rank_main(comm):
        sub = comm.Dup()
        zero = shm.buffer(comm, 8, np.float32)
        collectives.allreduce(sub, np.ones(8), algorithm="shm")
        comm.Barrier()  # every rank has made its windows
        if comm.Get_rank() == 0:
            shm_windows.release_mine()
        comm.Barrier()
        freed = [w.freed for inner, w in allocated if inner in (innermost(comm), innermost(sub))]
        comm.Barrier()
        if comm.Get_rank():
            shm_windows.release_mine()
        return freed, zero

    results = run(3, rank_main)
    assert all(results[0][0]) and len(results[0][0]) == 4  # (2 communicators: a control window and one more each)
    assert not any(results[1][0]) and not any(results[2][0]), "rank 0 freed another rank's windows"

"""GPU buffers at the communicator boundary, tested on the CPU with a stand-in device.

``FakeGpuArray`` plays a CuPy array: it keeps its data to itself and exposes no buffer, so if staging ever let one
through to the simulator or to MPI, they would reject it. ``FakeDevice`` is the adapter :class:`StagedComm` uses for
device operations; it counts pinned allocations and stream synchronisations. Checked: a CUDA-aware MPI gets the
device buffers themselves (no staging), otherwise every device buffer is staged with exact byte counts and the right
data arrives, on a recording communicator, on the simulator and under ``mpiexec``; host buffers are never touched;
the environment override and the library query behave.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from mpi_util import run_mpi_code

from dtrain.comm import cuda_aware, names, sim, staging, waitall
from dtrain.comm.staging import StagedComm
from dtrain.comm.trace import TracedComm


class FakeGpuArray:
    """Stands in for a CuPy array: data held privately, no buffer protocol, the few attributes staging reads."""

    def __init__(self, values):
        self._data = np.array(values)  # a private copy

    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    nbytes = property(lambda self: self._data.nbytes)
    size = property(lambda self: self._data.size)

    def get(self) -> np.ndarray:
        return self._data.copy()


class FakeDevice:
    """The device adapter for FakeGpuArray; counts what it is asked to do."""

    def __init__(self):
        self.allocations: list[int] = []
        self.synchronizations = 0

    def is_device(self, buf) -> bool:
        return isinstance(buf, FakeGpuArray)

    def alloc_pinned(self, nbytes, dtype):
        self.allocations.append(nbytes)
        return np.empty(nbytes // dtype.itemsize, dtype=dtype)

    def to_host(self, buf, host):
        assert type(host) is np.ndarray and host.shape == buf.shape and host.dtype == buf.dtype
        host[...] = buf._data

    def to_device(self, host, buf):
        assert type(host) is np.ndarray and host.shape == buf.shape
        buf._data[...] = host

    def synchronize(self):
        self.synchronizations += 1


class RecordingComm:
    """A one-rank communicator that records every buffer handed to it and 'receives' the value 7 into receives."""

    def __init__(self, rank: int = 0):
        self.calls: list[tuple] = []
        self.rank = rank

    def Get_rank(self):
        return self.rank

    def _received(self, buf):
        if isinstance(buf, np.ndarray):
            buf[...] = 7
        return buf

    def Send(self, buf, dest, tag=0):
        self.calls.append(("Send", buf))

    def Recv(self, buf, source=-2, tag=-1, status=None):
        self.calls.append(("Recv", self._received(buf)))

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=-2, recvtag=-1, status=None):
        self.calls.append(("Sendrecv", sendbuf, self._received(recvbuf)))

    def Isend(self, buf, dest, tag=0):
        self.calls.append(("Isend", buf))
        return types.SimpleNamespace(Wait=lambda status=None: True, Test=lambda status=None: True, tag="isend")

    def Irecv(self, buf, source=-2, tag=-1):
        self.calls.append(("Irecv", buf))
        return types.SimpleNamespace(Wait=lambda status=None: self._received(buf) is not None, tag="irecv")

    def Allreduce(self, sendbuf, recvbuf, op=None):
        self.calls.append(("Allreduce", sendbuf, self._received(recvbuf)))

    def Bcast(self, buf, root=0):
        self.calls.append(("Bcast", self._received(buf) if root != self.rank else buf))


def gpu_array(n, value=1.0, dtype=np.float32):
    return FakeGpuArray(np.full(n, value, dtype=dtype))


# ----------------------------------------------------------------------------------------------------------------
# Passthrough, staging and counting, on the recording communicator
# ----------------------------------------------------------------------------------------------------------------


def test_cuda_aware_passes_device_buffers_straight_through():
    inner, device = RecordingComm(), FakeDevice()
    comm = StagedComm(inner, cuda_aware=True, device=device)
    a, b = gpu_array(4), gpu_array(4)
    comm.Send(a, 1)
    comm.Recv(b, 1)
    comm.Sendrecv(a, 1, recvbuf=b, source=1)
    request = comm.Isend(a, 1)
    comm.Allreduce(a, b)
    comm.Bcast(a, root=0)
    assert request.tag == "isend"  # the wrapped communicator's own request, not a wrapper
    assert [c[0] for c in inner.calls] == ["Send", "Recv", "Sendrecv", "Isend", "Allreduce", "Bcast"]
    assert all(buf is a or buf is b for call in inner.calls for buf in call[1:])
    assert comm.staged_bytes_to_host == comm.staged_bytes_to_device == 0
    assert device.allocations == []
    assert device.synchronizations == 6  # once per call: MPI must find the data complete


def test_host_buffers_are_never_touched():
    inner, device = RecordingComm(), FakeDevice()
    comm = StagedComm(inner, cuda_aware=False, device=device)
    a, b = np.arange(4.0), np.zeros(4)
    comm.Send(a, 1)
    comm.Sendrecv(a, 1, recvbuf=b)
    request = comm.Irecv(b, 1)
    assert request.tag == "irecv"
    assert inner.calls[0][1] is a and inner.calls[1][1] is a and inner.calls[1][2] is b and inner.calls[2][1] is b
    assert comm.staged_bytes_to_host == comm.staged_bytes_to_device == 0
    assert device.allocations == [] and device.synchronizations == 0


def test_not_aware_stages_both_ways_with_exact_counts():
    inner, device = RecordingComm(), FakeDevice()
    comm = StagedComm(inner, cuda_aware=False, device=device)
    send, recv = FakeGpuArray(np.arange(10, dtype=np.float32)), gpu_array(6, 0.0, np.float64)

    comm.Send(send, 1)
    (_, host), *_ = inner.calls
    assert type(host) is np.ndarray and np.array_equal(host, np.arange(10))
    assert (comm.staged_bytes_to_host, comm.staged_bytes_to_device) == (40, 0)

    comm.Recv(recv, 1)
    assert np.array_equal(recv.get(), np.full(6, 7.0))
    assert (comm.staged_bytes_to_host, comm.staged_bytes_to_device) == (40, 48)

    comm.Sendrecv(send, 1, recvbuf=gpu_array(3), source=1)
    assert (comm.staged_bytes_to_host, comm.staged_bytes_to_device) == (80, 60)

    comm.Allreduce(send, gpu_array(10))
    assert (comm.staged_bytes_to_host, comm.staged_bytes_to_device) == (120, 100)
    assert all(type(buf) is np.ndarray for call in inner.calls for buf in call[1:])


def test_in_place_allreduce_copies_the_buffer_down_and_back_up():
    inner, device = RecordingComm(), FakeDevice()
    comm = StagedComm(inner, cuda_aware=False, device=device)
    buf = FakeGpuArray(np.arange(5, dtype=np.float32))
    comm.Allreduce(names.IN_PLACE, buf)
    _, sendbuf, _ = inner.calls[0]
    assert sendbuf is names.IN_PLACE
    assert np.array_equal(buf.get(), np.full(5, 7.0))
    assert (comm.staged_bytes_to_host, comm.staged_bytes_to_device) == (20, 20)


def test_bcast_stages_down_on_the_root_and_up_elsewhere():
    for rank, expected in ((0, (16, 0)), (1, (0, 16))):
        comm = StagedComm(RecordingComm(rank), cuda_aware=False, device=FakeDevice())
        comm.Bcast(gpu_array(4), root=0)
        assert (comm.staged_bytes_to_host, comm.staged_bytes_to_device) == expected


def test_irecv_copies_up_only_when_the_request_completes():
    inner, device = RecordingComm(), FakeDevice()
    comm = StagedComm(inner, cuda_aware=False, device=device)
    buf = gpu_array(8, 0.0)
    request = comm.Irecv(buf, 1)
    assert isinstance(request, staging.StagedRequest) and request.tag == "irecv"  # other attributes are forwarded
    assert comm.staged_bytes_to_device == 0 and np.array_equal(buf.get(), np.zeros(8))
    waitall([request])
    assert comm.staged_bytes_to_device == 32 and np.array_equal(buf.get(), np.full(8, 7.0))
    request.Wait()  # a second Wait copies nothing more
    assert comm.staged_bytes_to_device == 32


def test_buffer_lists_keep_their_datatype_and_count():
    inner = RecordingComm()
    comm = StagedComm(inner, cuda_aware=False, device=FakeDevice())
    comm.Send([gpu_array(4), 3, "FLOAT"], 1)
    (_, spec), *_ = inner.calls
    assert isinstance(spec, list) and type(spec[0]) is np.ndarray and spec[1:] == [3, "FLOAT"]


def test_pinned_buffers_are_reused_by_size_and_dtype():
    device = FakeDevice()
    comm = StagedComm(RecordingComm(), cuda_aware=False, device=device)
    for _ in range(5):
        comm.Send(gpu_array(100), 1)
    assert device.allocations == [400]
    comm.Send(gpu_array(100, dtype=np.float64), 1)  # another dtype: another buffer
    comm.Send(gpu_array(50), 1)  # another size: another buffer
    assert device.allocations == [400, 800, 200]
    first, second = comm.Isend(gpu_array(100), 1), comm.Isend(gpu_array(100), 1)  # both in flight: two buffers
    assert device.allocations == [400, 800, 200, 400]
    waitall([first, second])
    comm.Send(gpu_array(100), 1)
    assert device.allocations == [400, 800, 200, 400] and comm.pinned_bytes_allocated == 1800


def test_a_failed_call_returns_its_pinned_buffer_and_copies_nothing():
    class Failing(RecordingComm):
        def Recv(self, buf, source=-2, tag=-1, status=None):
            raise RuntimeError("network down")

    device = FakeDevice()
    comm = StagedComm(Failing(), cuda_aware=False, device=device)
    with pytest.raises(RuntimeError, match="network down"):
        comm.Recv(gpu_array(4), 1)
    comm.Send(gpu_array(4), 1)  # the same size again: the buffer came back to the pool
    assert device.allocations == [16] and comm.staged_bytes_to_device == 0


def test_everything_else_is_forwarded():
    inner = RecordingComm(rank=3)
    comm = StagedComm(inner, cuda_aware=False, device=FakeDevice())
    assert comm.Get_rank() == 3 and comm.rank == 3 and comm.comm is inner
    assert "cuda_aware=False" in repr(comm)


# ----------------------------------------------------------------------------------------------------------------
# On the simulator: two ranks really exchange staged data
# ----------------------------------------------------------------------------------------------------------------


def exchange(comm, device, cuda_aware=None):
    """Every staged call between two ranks; returns what arrived and the counters."""
    staged = StagedComm(comm, cuda_aware=cuda_aware, device=device)
    assert not staged.cuda_aware
    rank, other = staged.Get_rank(), 1 - staged.Get_rank()
    mine, got = FakeGpuArray(np.arange(6, dtype=np.float32) + 10 * rank), gpu_array(6, 0.0)
    results = {}
    if rank == 0:
        staged.Send(mine, 1, tag=5)
        staged.Recv(got, 1, tag=6)
    else:
        staged.Recv(got, 0, tag=5)
        staged.Send(mine, 0, tag=6)
    results["send/recv"] = got.get()
    staged.Sendrecv(mine, other, recvbuf=got, source=other)
    results["sendrecv"] = got.get()
    requests = [staged.Irecv(got, other), staged.Isend(mine, other)]
    waitall(requests)
    results["isend/irecv"] = got.get()
    total = gpu_array(6, 0.0)
    staged.Allreduce(mine, total)
    results["allreduce"] = total.get()
    staged.Allreduce(names.IN_PLACE, mine)
    results["allreduce in place"] = mine.get()
    shared = FakeGpuArray(np.full(3, 42.0 if rank == 1 else 0.0))
    staged.Bcast(shared, root=1)
    results["bcast"] = shared.get()
    reduced = gpu_array(3, 0.0, np.float64)
    staged.Reduce(shared, reduced, root=0)  # only the root's receive buffer is staged (and filled)
    results["reduce"] = reduced.get()
    return results, staged.staged_bytes_to_host, staged.staged_bytes_to_device


def expected_counts(rank: int) -> tuple[int, int]:
    """(bytes to host, bytes to device) that ``exchange`` stages on ``rank``.

    All buffers are 24 bytes. Point to point: 3 sent (down) and 3 received (up). Each all-reduce: 1 down and 1 up.
    Bcast: down on its root (rank 1), up elsewhere. Reduce: down everywhere, up on its root (rank 0).
    """
    bcast_down, bcast_up, reduce_up = (24, 0, 0) if rank == 1 else (0, 24, 24)
    return 3 * 24 + 2 * 24 + bcast_down + 24, 3 * 24 + 2 * 24 + bcast_up + reduce_up


def test_staged_exchange_on_the_simulator():
    devices = [FakeDevice(), FakeDevice()]
    outcomes = sim.run(2, lambda comm: exchange(comm, devices[comm.Get_rank()]))
    for rank, (results, to_host, to_device) in enumerate(outcomes):
        theirs = np.arange(6) + 10 * (1 - rank)
        for name in ("send/recv", "sendrecv", "isend/irecv"):
            assert np.array_equal(results[name], theirs), name
        assert np.array_equal(results["allreduce"], 2 * np.arange(6) + 10)
        assert np.array_equal(results["allreduce in place"], 2 * np.arange(6) + 10)
        assert np.array_equal(results["bcast"], np.full(3, 42.0))
        assert np.array_equal(results["reduce"], np.full(3, 84.0 if rank == 0 else 0.0))
        assert (to_host, to_device) == expected_counts(rank)


def test_split_and_dup_stay_staged_and_share_the_counters():
    def run(comm):
        device = FakeDevice()
        staged = StagedComm(TracedComm(comm), device=device)  # the tracer is seen through: still the simulator
        assert not staged.cuda_aware
        half = staged.Split(color=comm.Get_rank() % 2)
        nobody = staged.Split(color=names.UNDEFINED)
        twin = staged.Dup()
        assert isinstance(half, StagedComm) and isinstance(twin, StagedComm) and nobody is None
        got = gpu_array(4, 0.0)
        twin.Sendrecv(gpu_array(4, comm.Get_rank()), 1 - comm.Get_rank(), recvbuf=got, source=1 - comm.Get_rank())
        return staged.staged_bytes_to_host, half.staged_bytes_to_device, got.get()[0]

    assert sim.run(2, run) == [(16, 16, 1.0), (16, 16, 0.0)]


class StandInCupyArray:
    """Enough of a CuPy array for CupyDevice: its type lives in a "cupy" module, and it has get/set with a stream."""

    __module__ = "cupy._core.core"

    def __init__(self, values, log):
        self.data, self.log = np.array(values), log
        self.shape, self.dtype, self.nbytes, self.size = (
            self.data.shape,
            self.data.dtype,
            self.data.nbytes,
            self.data.size,
        )

    def get(self, stream=None, out=None):
        self.log.append(("get", stream))
        out[...] = self.data

    def set(self, arr, stream=None):
        self.log.append(("set", stream))
        self.data[...] = arr


def test_cupy_device_adapter_with_a_stand_in_cupy(monkeypatch):
    """The default adapter, driven through a stand-in ``cupy`` module: copies on the current stream, then a sync."""
    log = []
    stream = types.SimpleNamespace(synchronize=lambda: log.append("synchronize"))
    cuda = types.SimpleNamespace(
        alloc_pinned_memory=lambda nbytes: bytearray(nbytes), get_current_stream=lambda: stream
    )
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))

    def run(comm):
        staged = StagedComm(comm)  # the default device adapter: CupyDevice
        assert isinstance(staged.device, staging.CupyDevice)
        rank = comm.Get_rank()
        mine = StandInCupyArray(np.full(4, rank + 1.0, dtype=np.float32), log)
        theirs = StandInCupyArray(np.zeros(4, dtype=np.float32), log)
        staged.Sendrecv(mine, 1 - rank, recvbuf=theirs, source=1 - rank)
        return theirs.data.tolist(), staged.staged_bytes_to_host, staged.staged_bytes_to_device

    assert sim.run(2, run) == [([2.0] * 4, 16, 16), ([1.0] * 4, 16, 16)]
    assert log.count(("get", stream)) == log.count(("set", stream)) == 2 and log.count("synchronize") == 4
    device = staging.CupyDevice()
    pinned = device.alloc_pinned(24, np.dtype(np.float64))
    assert type(pinned) is np.ndarray and pinned.shape == (3,) and pinned.dtype == np.float64


# ----------------------------------------------------------------------------------------------------------------
# Detecting CUDA-awareness
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), (" 1\n", True)])
def test_environment_override(monkeypatch, value, expected):
    monkeypatch.setenv(cuda_aware.ENV_VAR, value)
    monkeypatch.setattr(cuda_aware, "_ask_mpi_library", lambda: pytest.fail("the library must not be asked"))
    assert cuda_aware.cuda_aware_mpi() is expected
    assert cuda_aware.ENV_VAR in cuda_aware.cuda_awareness_reason()
    assert StagedComm(RecordingComm(), device=FakeDevice()).cuda_aware is expected


@pytest.mark.parametrize("value", ["yes", "true", "2", "-1"])
def test_environment_override_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv(cuda_aware.ENV_VAR, value)
    with pytest.raises(ValueError, match=rf"{cuda_aware.ENV_VAR}=.*use 1 .* 0 "):
        cuda_aware.cuda_aware_mpi()


def test_the_installed_mpi_library_is_asked_once(monkeypatch):
    monkeypatch.delenv(cuda_aware.ENV_VAR, raising=False)
    monkeypatch.setattr(cuda_aware, "_library_answer", None)
    aware = cuda_aware.cuda_aware_mpi()
    reason = cuda_aware.cuda_awareness_reason()
    assert isinstance(aware, bool) and reason
    monkeypatch.setattr(cuda_aware, "_ask_mpi_library", lambda: pytest.fail("asked twice"))
    assert cuda_aware.cuda_aware_mpi() is aware
    from mpi4py import MPI

    if "pypi.org/p/mpich" in MPI.Get_library_version():  # the mpich wheel: built without CUDA, and it says so
        assert not aware
        assert "MPIX_Query_cuda_support() in" in reason and "libmpi" in reason and "returned 0" in reason


def test_any_failure_means_not_aware(monkeypatch):
    monkeypatch.delenv(cuda_aware.ENV_VAR, raising=False)
    monkeypatch.setattr(cuda_aware, "_library_answer", None)

    def broken():
        raise OSError("cannot map library")

    monkeypatch.setattr(cuda_aware, "_ask_mpi_library", broken)
    assert cuda_aware.cuda_aware_mpi() is False
    assert "failed" in cuda_aware.cuda_awareness_reason() and "cannot map library" in cuda_aware.cuda_awareness_reason()


class FakeFunction:
    """A ctypes-like foreign function: accepts argtypes/restype, returns a fixed answer."""

    def __init__(self, body):
        self.body = body

    def __call__(self, *args):
        return self.body(*args)


def test_query_functions_are_read_correctly():
    open_mpi_style = types.SimpleNamespace(MPIX_Query_cuda_support=FakeFunction(lambda: 1))
    assert cuda_aware._query_cuda_support(open_mpi_style) == (True, "MPIX_Query_cuda_support()")

    def gpu_query(kind, flag_pointer):
        assert kind == cuda_aware.MPIX_GPU_SUPPORT_CUDA
        flag_pointer._obj.value = 1  # what the C function does through its int* argument
        return 0

    mpich_style = types.SimpleNamespace(MPIX_GPU_query_support=FakeFunction(gpu_query))
    assert cuda_aware._query_cuda_support(mpich_style) == (True, "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)")
    failing = types.SimpleNamespace(MPIX_GPU_query_support=FakeFunction(lambda kind, flag: 1))
    assert cuda_aware._query_cuda_support(failing)[0] is False
    libc = ctypes.util.find_library("c")
    if libc:
        assert cuda_aware._query_cuda_support(ctypes.CDLL(libc)) is None  # the C library has no MPI in it


def test_loaded_mpi_libraries_are_found():
    from mpi4py import MPI  # noqa: F401  (loads the library)

    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps on this platform")
    assert any("libmpi" in Path(p).name for p in cuda_aware._loaded_mpi_libraries())


# ----------------------------------------------------------------------------------------------------------------
# Under mpiexec
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_staged_exchange_under_mpiexec(tmp_path):
    """Two real ranks: the staged buffers travel through MPICH as pinned-host stand-ins and arrive on the 'device'."""
    code = f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import numpy as np
        from mpi4py import MPI
        from test_gpu_staging import FakeDevice, exchange, expected_counts

        results, to_host, to_device = exchange(MPI.COMM_WORLD, FakeDevice(), cuda_aware=False)
        rank = MPI.COMM_WORLD.Get_rank()
        theirs = np.arange(6) + 10 * (1 - rank)
        for name in ("send/recv", "sendrecv", "isend/irecv"):
            assert np.array_equal(results[name], theirs), name
        assert np.array_equal(results["allreduce"], 2 * np.arange(6) + 10)
        assert np.array_equal(results["bcast"], np.full(3, 42.0))
        assert np.array_equal(results["reduce"], np.full(3, 84.0 if rank == 0 else 0.0))
        assert (to_host, to_device) == expected_counts(rank)
        print(f"rank {{rank}} ok", flush=True)
    """
    result = run_mpi_code(2, code, tmp_path, timeout=120)
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout

"""GPU buffers on an MPI that is not CUDA-aware: staged through pinned host memory, at the communicator boundary.

Algorithms never special-case devices: a ring all-reduce calls ``comm.Isend(buf[a:b], ...)`` whether ``buf`` is a
NumPy or a CuPy array. Wrap the communicator in :class:`StagedComm` and GPU buffers work on any MPI::

    comm = StagedComm(MPI.COMM_WORLD)     # asks dtrain.comm.cuda_aware whether MPI takes device buffers
    ring.allreduce(comm, grads_on_gpu)
    comm.staged_bytes_to_host, comm.staged_bytes_to_device

(:func:`dtrain.comm.prepare` does this for ``dtrain train --device gpu`` when MPI is not CUDA-aware.)

**The detour.** Without CUDA-awareness (:mod:`dtrain.comm.cuda_aware`) each GPU message goes through host memory: the
sender copies it to a host buffer and sends from there, the receiver receives into a host buffer and copies it up::

    sender GPU --PCIe--> host buffer --network/shm--> host buffer --PCIe--> receiver GPU
              (to_host)                                          (to_device)

**The cost.** Two extra copies over PCIe per message, one on each side (about 25 GB/s each way for PCIe 4 x16, an
order of magnitude below NVLink), plus a stream synchronisation before each, which stalls the GPU's queue of work.
:class:`StagedComm` counts the bytes it copies (``staged_bytes_to_host``, ``staged_bytes_to_device``), so a lesson can
set them beside the bytes the algorithm sent. The host buffers are *pinned* (page-locked): the GPU's copy engine
reads and writes them directly by DMA, whereas ordinary pageable memory costs the driver an extra copy through a
pinned bounce buffer of its own. Pinning is slow (the OS must lock every page), so pinned buffers are kept in a small
pool keyed by size and dtype and reused: collectives send the same chunk sizes step after step.

**How it plugs in.** :class:`StagedComm` is a :class:`~dtrain.comm.wrapper.CommWrapper`: every point-to-point call
and every MPI collective reaches it as a record, whose device buffers it swaps for pinned host ones before handing
the record on; received data goes back up when the call (or the request's ``Wait``) completes. Host buffers pass
through untouched, and with a CUDA-aware MPI device buffers do too (after the stream is synchronised).

**Testing without a GPU.** Every device operation goes through a small adapter (:class:`CupyDevice`): ``is_device``,
``alloc_pinned``, ``to_host``, ``to_device``, ``synchronize``. Tests hand :class:`StagedComm` a stand-in whose
"device arrays" keep their data private and expose no buffer (so the simulator or MPI would reject one that slipped
through unstaged), and check the staging (which buffers, how many bytes, the data that arrives) on a simulated or
real communicator.
"""

from __future__ import annotations

import time

import numpy as np

from dtrain.backend import is_device_array
from dtrain.comm.cuda_aware import cuda_aware_mpi, cuda_awareness_reason
from dtrain.comm.names import IN_PLACE
from dtrain.comm.wrapper import Collective, CommWrapper, PointToPoint, RequestWrapper, forward, innermost


class CupyDevice:
    """The device operations staging needs, done with CuPy (imported on first use, so this file loads without it).

    Copies run on CuPy's current stream, so they come after the kernels that computed the data, and are waited for:
    MPI reads the host buffer as soon as ``to_host`` returns, and a pinned buffer goes back to the pool (to be
    overwritten) as soon as ``to_device`` returns.
    """

    def is_device(self, buf) -> bool:
        return is_device_array(buf)

    def alloc_pinned(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """A 1-D NumPy array over ``nbytes`` of new page-locked host memory (kept alive by the array)."""
        import cupy

        memory = cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, dtype=dtype, count=nbytes // dtype.itemsize)

    def to_host(self, buf, host: np.ndarray) -> None:
        import cupy

        stream = cupy.cuda.get_current_stream()
        buf.get(stream=stream, out=host)
        stream.synchronize()

    def to_device(self, host: np.ndarray, buf) -> None:
        import cupy

        stream = cupy.cuda.get_current_stream()
        buf.set(host, stream=stream)
        stream.synchronize()

    def synchronize(self) -> None:
        """Wait for the GPU work queued so far: a CUDA-aware MPI reads device memory outside CuPy's stream."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class PinnedPool:
    """Pinned host buffers, reused: a few free ones are kept per (size in bytes, dtype).

    One pool belongs to one rank's communicators (it is not locked: the simulator's ranks are threads, each with its
    own). A buffer in use by an unfinished ``Isend``/``Irecv`` is out of the pool until its request completes.
    """

    def __init__(self, device, keep: int = 4):
        self._device, self._keep = device, keep
        self._free: dict[tuple, list] = {}
        self.allocated_bytes = 0  # pinned memory allocated so far (freed buffers beyond ``keep`` are not subtracted)

    def take(self, nbytes: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        free = self._free.get((nbytes, dtype.str))
        if free:
            return free.pop()
        if nbytes == 0:
            return np.empty(0, dtype=dtype)
        self.allocated_bytes += nbytes
        return self._device.alloc_pinned(nbytes, dtype)

    def give(self, flat: np.ndarray) -> None:
        free = self._free.setdefault((flat.nbytes, flat.dtype.str), [])
        if flat.nbytes and len(free) < self._keep:
            free.append(flat)


def _array_in(spec):
    """The array a buffer argument names: the argument itself, or the first item of ``[array, datatype]`` forms."""
    return spec[0] if isinstance(spec, (list, tuple)) and spec else spec


def _with_array(spec, array):
    """The buffer argument ``spec`` with its array replaced by ``array`` (counts and datatypes kept)."""
    return type(spec)([array, *spec[1:]]) if isinstance(spec, (list, tuple)) else array


class _Shared:
    """What a communicator and the sub-communicators split from it share: counters and pinned buffers.

    Staging costs belong to the process (one PCIe link), not to one communicator, so the counts of a world and of
    the rows and columns split from it add up in one place.
    """

    def __init__(self, device):
        self.pool = PinnedPool(device)
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.seconds = 0.0  # in the copies and the stream synchronisations before MPI touches a buffer


class _Transfer:
    """The staging of one communication call.

    ``send(spec)`` and ``recv(spec)`` return the buffer argument to hand to the wrapped communicator: unchanged for a
    host array or a CUDA-aware MPI, else a pinned host buffer (filled from the device for ``send``; remembered, to be
    copied back to the device, for ``recv``). ``complete()`` runs once the communication has finished: it copies the
    received data up and returns the pinned buffers to the pool.
    """

    def __init__(self, comm: StagedComm):
        self._comm = comm
        self._copy_back: list[tuple] = []  # (host view, device array)
        self._held: list[np.ndarray] = []  # pinned buffers to give back
        self._synchronized = False

    def _device_array(self, spec):
        array = _array_in(spec)
        return array if self._comm.device.is_device(array) else None

    def _pinned_like(self, array) -> np.ndarray:
        flat = self._comm._shared.pool.take(array.nbytes, array.dtype)
        self._held.append(flat)
        return flat.reshape(array.shape)

    def _passthrough(self, spec):
        if not self._synchronized:  # once per call: the data must be complete before MPI touches it
            started = time.perf_counter()
            self._comm.device.synchronize()
            self._comm._shared.seconds += time.perf_counter() - started
            self._synchronized = True
        return spec

    def send(self, spec):
        array = self._device_array(spec)
        if array is None:
            return spec
        if self._comm.cuda_aware:
            return self._passthrough(spec)
        host = self._pinned_like(array)
        started = time.perf_counter()
        self._comm.device.to_host(array, host)
        self._comm._shared.seconds += time.perf_counter() - started
        self._comm._shared.bytes_to_host += array.nbytes
        return _with_array(spec, host)

    def recv(self, spec, keep_contents: bool = False):
        """``keep_contents``: the buffer is read as well as written (an ``IN_PLACE`` reduction), so copy it down too."""
        array = self._device_array(spec)
        if array is None:
            return spec
        if self._comm.cuda_aware:
            return self._passthrough(spec)
        if keep_contents:
            host_spec = self.send(spec)
            host = _array_in(host_spec)
        else:
            host = self._pinned_like(array)
            host_spec = _with_array(spec, host)
        self._copy_back.append((host, array))
        return host_spec

    def complete(self) -> None:
        shared = self._comm._shared
        for host, array in self._copy_back:
            started = time.perf_counter()
            self._comm.device.to_device(host, array)
            shared.seconds += time.perf_counter() - started
            shared.bytes_to_device += array.nbytes
        self._copy_back = []
        self.release()

    def release(self) -> None:
        for flat in self._held:
            self._comm._shared.pool.give(flat)
        self._held = []

    def request(self, request):
        """The request to hand back from ``Isend``/``Irecv``: the wrapped one, or one that completes the staging."""
        return StagedRequest(request, self) if (self._copy_back or self._held) else request


class StagedRequest(RequestWrapper):
    """A request from a staged ``Isend``/``Irecv``: when it completes, received data is copied up to the device and
    the pinned buffer returns to the pool. Anything else is forwarded to the wrapped request."""

    def __init__(self, request, transfer: _Transfer):
        super().__init__(request)
        self._transfer = transfer

    def completed(self) -> None:
        if self._transfer is not None:
            self._transfer.complete()
            self._transfer = None


class StagedComm(CommWrapper):
    """A communicator that makes GPU (CuPy) buffers work on any MPI; host buffers pass through untouched.

    ``cuda_aware``: True hands device buffers straight to ``comm`` (after synchronising the GPU stream), False stages
    them through pinned host memory, None decides: a communicator that says itself whether it takes device buffers
    (the simulator holds NumPy arrays only: ``cuda_aware = False``) is believed, any other asks :func:`cuda_aware_mpi`.
    ``device`` is the adapter for device operations (:class:`CupyDevice` by default; tests pass a stand-in).

    Staged: ``Send``, ``Recv``, ``Sendrecv``, ``Isend``, ``Irecv`` (the copy up happens in the request's ``Wait`` or
    successful ``Test``), ``Allreduce``, ``Reduce``, ``Bcast``. ``Split``, ``Split_type`` and ``Dup`` return staged
    sub-communicators sharing this one's counters and pinned pool. Everything else is forwarded to ``comm``.

    A staged receive copies the whole buffer up to the device, so it assumes the message fills the buffer, as every
    dtrain algorithm's receives do (a shorter message would leave stale host data in the rest of the buffer).
    """

    def __init__(self, comm, cuda_aware: bool | None = None, device=None, _shared: _Shared | None = None):
        super().__init__(comm)
        self.device = device if device is not None else CupyDevice()
        declared = getattr(innermost(comm), "cuda_aware", None)
        if cuda_aware is not None:
            self.cuda_aware, self.cuda_aware_reason = bool(cuda_aware), f"given: cuda_aware={bool(cuda_aware)}"
        elif declared is not None:
            self.cuda_aware, self.cuda_aware_reason = bool(declared), f"the communicator says cuda_aware={declared}"
        else:
            self.cuda_aware, self.cuda_aware_reason = cuda_aware_mpi(), cuda_awareness_reason()
        self._shared = _shared if _shared is not None else _Shared(self.device)

    def __getattr__(self, name):
        if name == "_shared":  # not yet set (copying, unpickling): avoid recursing
            raise AttributeError(name)
        return super().__getattr__(name)

    def __repr__(self) -> str:
        return f"StagedComm({self.comm!r}, cuda_aware={self.cuda_aware})"

    def sibling(self, comm):
        """A staged sub-communicator sharing this one's counters and pinned pool."""
        return StagedComm(comm, self.cuda_aware, self.device, self._shared)

    @property
    def staged_bytes_to_host(self) -> int:
        """Bytes copied from device to host so that MPI could send (or reduce) them."""
        return self._shared.bytes_to_host

    @property
    def staged_bytes_to_device(self) -> int:
        """Bytes copied from host to device after MPI had received them."""
        return self._shared.bytes_to_device

    @property
    def staging_seconds(self) -> float:
        """Seconds spent copying between device and pinned host buffers (each copy waits for the GPU's queue of
        work first), or, with a CUDA-aware MPI, in the stream synchronisations before MPI reads device memory."""
        return self._shared.seconds

    @property
    def pinned_bytes_allocated(self) -> int:
        return self._shared.pool.allocated_bytes

    def p2p(self, call: PointToPoint):
        transfer = _Transfer(self)
        try:
            if call.sends:
                call.sendbuf = transfer.send(call.sendbuf)
            if call.receives:
                call.recvbuf = transfer.recv(call.recvbuf)
            result = forward(self.comm, call)
        except BaseException:  # the call failed: nothing arrived to copy back
            transfer.release()
            raise
        if call.name in ("Isend", "Irecv"):  # staging completes when the request does
            return transfer.request(result)
        transfer.complete()
        return result

    def collective(self, call: Collective):
        transfer = _Transfer(self)
        try:
            is_root = call.root is not None and self.comm.Get_rank() == call.root
            if call.name == "Bcast":
                call.recvbuf = transfer.send(call.recvbuf) if is_root else transfer.recv(call.recvbuf)
            elif call.name == "Reduce" and not is_root:  # the receive buffer means nothing off the root
                call.sendbuf, call.recvbuf = transfer.send(call.sendbuf), None
            elif call.sendbuf is IN_PLACE:  # Allreduce, or Reduce on the root: the buffer is read and written
                call.recvbuf = transfer.recv(call.recvbuf, keep_contents=True)
            elif call.name != "Barrier":
                call.sendbuf, call.recvbuf = transfer.send(call.sendbuf), transfer.recv(call.recvbuf)
            forward(self.comm, call)
        except BaseException:
            transfer.release()
            raise
        transfer.complete()

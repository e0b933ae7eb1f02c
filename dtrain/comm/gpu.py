"""GPU buffers at the communicator boundary: straight to a CUDA-aware MPI, or staged through pinned host memory.

Algorithms never special-case devices: a ring all-reduce calls ``comm.Isend(buf[a:b], ...)`` whether ``buf`` is a
NumPy or a CuPy array. Wrap the communicator in :class:`StagedComm` and this file makes GPU buffers work either way::

    comm = StagedComm(MPI.COMM_WORLD)     # asks the MPI library whether it is CUDA-aware (or DTRAIN_CUDA_AWARE)
    ring.allreduce(comm, grads_on_gpu)
    comm.staged_bytes_to_host, comm.staged_bytes_to_device

**Why GPU buffers need staging.** mpi4py hands MPI the *address* of a buffer; for a CuPy array that is an address in
GPU memory. A CUDA-aware MPI (Open MPI or MPICH built with CUDA, over UCX or libfabric) recognises it and moves the
data itself: GPU to GPU over NVLink, or NIC to GPU memory directly (GPUDirect RDMA). Any other MPI reads that address
as host memory, which crashes the process or sends garbage. So without CUDA-awareness each GPU message makes a detour:
the sender copies it to host memory and sends from there, the receiver receives into host memory and copies it up::

    sender GPU --PCIe--> host buffer --network/shm--> host buffer --PCIe--> receiver GPU
              (to_host)                                          (to_device)

**The cost.** Two extra copies over PCIe per message, one on each side (about 25 GB/s each way for PCIe 4 x16, an
order of magnitude below NVLink), plus a stream synchronisation before each, which stalls the GPU's queue of work.
:class:`StagedComm` counts the bytes it copies (``staged_bytes_to_host``, ``staged_bytes_to_device``), so a lesson can
set them beside the bytes the algorithm sent. The host buffers are *pinned* (page-locked): the GPU's copy engine
reads and writes them directly by DMA, whereas ordinary pageable memory costs the driver an extra copy through a
pinned bounce buffer of its own. Pinning is slow (the OS must lock every page), so pinned buffers are kept in a small
pool keyed by size and dtype and reused: collectives send the same chunk sizes step after step.

**How CUDA-awareness is detected** (:func:`cuda_aware_mpi`, the reason in :func:`cuda_awareness_reason`):

1. ``DTRAIN_CUDA_AWARE=1`` or ``0`` decides, for when you know better than the library (empty counts as unset, any
   other value is an error);
2. otherwise the MPI library that mpi4py loaded is asked through ctypes: ``MPIX_Query_cuda_support()`` (Open MPI's
   extension, also exported by MPICH), else MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``. The
   library is found among the shared objects already mapped into the process (``/proc/self/maps``; mpi4py loads it
   privately, so its symbols are not in the global namespace), then in the global namespace;
3. no such function, or anything going wrong on the way: not CUDA-aware, which is always safe (staging works with
   every MPI, just slower). The answer is asked once per process.

The ``mpich`` wheel that ``pip install dtrain`` brings (MPICH 5.0.2, ch4 over UCX/libfabric) exports both query
functions, and both answer 0: it is built without CUDA support, so GPU runs on it stage every message.

**Testing without a GPU.** Every device operation goes through a small adapter (:class:`CupyDevice`): ``is_device``,
``alloc_pinned``, ``to_host``, ``to_device``, ``synchronize``. Tests hand :class:`StagedComm` a stand-in whose
"device arrays" keep their data private and expose no buffer (so the simulator or MPI would reject one that slipped
through unstaged), and check the staging (which buffers, how many bytes, the data that arrives) on a simulated or
real communicator.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from dtrain.backend import is_device_array
from dtrain.comm.sim import ANY_SOURCE, ANY_TAG, IN_PLACE, SUM, SimComm
from dtrain.comm.trace import untraced

ENV_VAR = "DTRAIN_CUDA_AWARE"
MPIX_GPU_SUPPORT_CUDA = 0  # from MPICH's mpi.h (ZE is 1, HIP is 2)

# ----------------------------------------------------------------------------------------------------------------
# Is the MPI library CUDA-aware?
# ----------------------------------------------------------------------------------------------------------------

_library_answer: tuple[bool, str] | None = None  # (aware, reason), once the library has been asked


def cuda_aware_mpi() -> bool:
    """True if GPU buffers can be handed to MPI as they are (see the module docstring for how this is decided)."""
    return _answer()[0]


def cuda_awareness_reason() -> str:
    """Why :func:`cuda_aware_mpi` says what it says, in one line (for a lesson to print)."""
    return _answer()[1]


def _answer() -> tuple[bool, str]:
    global _library_answer
    value = os.environ.get(ENV_VAR, "").strip()
    if value:  # set and not empty
        if value not in ("0", "1"):
            raise ValueError(
                f"{ENV_VAR}={value!r}: use 1 (MPI is CUDA-aware: hand it GPU buffers), 0 (stage them through "
                "host memory), or leave it unset to ask the MPI library"
            )
        return value == "1", f"{ENV_VAR}={value} in the environment (the MPI library was not asked)"
    if _library_answer is None:
        try:
            _library_answer = _ask_mpi_library()
        except Exception as exc:  # never let a question about speed crash a run: staging always works
            _library_answer = (False, f"asking the MPI library failed ({type(exc).__name__}: {exc}): assuming no")
    return _library_answer


def _ask_mpi_library() -> tuple[bool, str]:
    try:
        from mpi4py import MPI  # loads the library (and initialises MPI, as any use of it would)
    except Exception as exc:
        return False, f"mpi4py cannot be imported ({exc}): no MPI library to ask"
    version = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())  # "MPICH Version: 5.0.2"
    places = [(path, path) for path in _loaded_mpi_libraries()] + [("the global namespace", None)]
    for where, path in places:
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if path else ctypes.CDLL(None)
            found = _query_cuda_support(library)
        except Exception:  # not loaded after all, or a platform without RTLD_NOLOAD or /proc: try the next place
            continue
        if found is not None:
            aware, function = found
            return aware, f"{version}: {function} in {where} returned {int(aware)}"
    return False, (
        f"{version}: the loaded MPI library has neither MPIX_Query_cuda_support nor MPIX_GPU_query_support, "
        "so it cannot say; assuming it is not CUDA-aware"
    )


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the shared objects called ``libmpi*.so*`` mapped into this process (Linux; elsewhere none)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {fields[5].strip() for fields in (line.split(None, 5) for line in maps) if len(fields) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libmpi") and ".so" in os.path.basename(p))


def _query_cuda_support(library) -> tuple[bool, str] | None:
    """(aware, which function said so) from one library, or None if it has neither query function."""
    if hasattr(library, "MPIX_Query_cuda_support"):
        query = library.MPIX_Query_cuda_support
        query.argtypes, query.restype = [], ctypes.c_int
        return bool(query()), "MPIX_Query_cuda_support()"
    if hasattr(library, "MPIX_GPU_query_support"):
        query = library.MPIX_GPU_query_support
        query.argtypes, query.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        flag = ctypes.c_int(0)
        error = query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag))
        return error == 0 and bool(flag.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)"
    return None


# ----------------------------------------------------------------------------------------------------------------
# The device operations, and the pool of pinned host buffers
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------------------------------------


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
            self._comm.device.synchronize()
            self._synchronized = True
        return spec

    def send(self, spec):
        array = self._device_array(spec)
        if array is None:
            return spec
        if self._comm.cuda_aware:
            return self._passthrough(spec)
        host = self._pinned_like(array)
        self._comm.device.to_host(array, host)
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
            self._comm.device.to_device(host, array)
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

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.complete()
        else:  # the call failed: nothing arrived to copy back
            self.release()


class StagedRequest:
    """A request from a staged ``Isend``/``Irecv``: when it completes, received data is copied up to the device and
    the pinned buffer returns to the pool. Anything else is forwarded to the wrapped request."""

    def __init__(self, request, transfer: _Transfer):
        self.request, self._transfer = request, transfer

    def __getattr__(self, name):
        if name == "request":  # not yet set (copying, unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.request, name)

    def _finish(self) -> None:
        if self._transfer is not None:
            self._transfer.complete()
            self._transfer = None

    def Wait(self, status=None):
        result = self.request.Wait(status)
        self._finish()
        return result

    def Test(self, status=None):
        done = self.request.Test(status)
        if done:
            self._finish()
        return done


class StagedComm:
    """A communicator that makes GPU (CuPy) buffers work on any MPI; host buffers pass through untouched.

    ``cuda_aware``: True hands device buffers straight to ``comm`` (after synchronising the GPU stream), False stages
    them through pinned host memory, None decides: a simulated communicator (which holds NumPy arrays only) is never
    CUDA-aware, any other asks :func:`cuda_aware_mpi`. ``device`` is the adapter for device operations
    (:class:`CupyDevice` by default; tests pass a stand-in).

    Staged: ``Send``, ``Recv``, ``Sendrecv``, ``Isend``, ``Irecv`` (the copy up happens in the request's ``Wait`` or
    successful ``Test``), ``Allreduce``, ``Reduce``, ``Bcast``. ``Split``, ``Split_type`` and ``Dup`` return staged
    sub-communicators sharing this one's counters and pinned pool. Everything else is forwarded to ``comm``.

    A staged receive copies the whole buffer up to the device, so it assumes the message fills the buffer, as every
    dtrain algorithm's receives do (a shorter message would leave stale host data in the rest of the buffer).
    """

    def __init__(self, comm, cuda_aware: bool | None = None, device=None, _shared: _Shared | None = None):
        self.comm = comm
        self.device = device if device is not None else CupyDevice()
        if cuda_aware is not None:
            self.cuda_aware, self.cuda_aware_reason = bool(cuda_aware), f"given: cuda_aware={bool(cuda_aware)}"
        elif isinstance(untraced(comm), SimComm):
            self.cuda_aware, self.cuda_aware_reason = False, "a simulated communicator holds NumPy arrays only"
        else:
            self.cuda_aware, self.cuda_aware_reason = cuda_aware_mpi(), cuda_awareness_reason()
        self._shared = _shared if _shared is not None else _Shared(self.device)

    def __getattr__(self, name):
        if name in ("comm", "_shared"):  # not yet set (copying, unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.comm, name)

    def __repr__(self) -> str:
        return f"StagedComm({self.comm!r}, cuda_aware={self.cuda_aware})"

    @property
    def staged_bytes_to_host(self) -> int:
        """Bytes copied from device to host so that MPI could send (or reduce) them."""
        return self._shared.bytes_to_host

    @property
    def staged_bytes_to_device(self) -> int:
        """Bytes copied from host to device after MPI had received them."""
        return self._shared.bytes_to_device

    @property
    def pinned_bytes_allocated(self) -> int:
        return self._shared.pool.allocated_bytes

    def _transfer(self) -> _Transfer:
        return _Transfer(self)

    def _wrap(self, comm):
        """A staged sub-communicator (``None``/``COMM_NULL`` are falsy and pass through)."""
        return StagedComm(comm, self.cuda_aware, self.device, self._shared) if comm else comm

    # --- point to point ------------------------------------------------------------------------------------
    def Send(self, buf, dest: int, tag: int = 0) -> None:
        with self._transfer() as t:
            self.comm.Send(t.send(buf), dest, tag)

    def Recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> None:
        with self._transfer() as t:
            self.comm.Recv(t.recv(buf), source, tag, status)

    def Sendrecv(
        self,
        sendbuf,
        dest: int,
        sendtag: int = 0,
        recvbuf=None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status=None,
    ) -> None:
        with self._transfer() as t:
            self.comm.Sendrecv(t.send(sendbuf), dest, sendtag, t.recv(recvbuf), source, recvtag, status)

    def Isend(self, buf, dest: int, tag: int = 0):
        t = self._transfer()
        return t.request(self.comm.Isend(t.send(buf), dest, tag))

    def Irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG):
        t = self._transfer()
        return t.request(self.comm.Irecv(t.recv(buf), source, tag))

    # --- MPI's own collectives -----------------------------------------------------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=SUM) -> None:
        with self._transfer() as t:
            if sendbuf is IN_PLACE:
                self.comm.Allreduce(sendbuf, t.recv(recvbuf, keep_contents=True), op)
            else:
                self.comm.Allreduce(t.send(sendbuf), t.recv(recvbuf), op)

    def Reduce(self, sendbuf, recvbuf, op=SUM, root: int = 0) -> None:
        with self._transfer() as t:
            if self.comm.Get_rank() != root:  # the receive buffer means nothing off the root: nothing to stage
                self.comm.Reduce(t.send(sendbuf), None, op, root)
            elif sendbuf is IN_PLACE:
                self.comm.Reduce(sendbuf, t.recv(recvbuf, keep_contents=True), op, root)
            else:
                self.comm.Reduce(t.send(sendbuf), t.recv(recvbuf), op, root)

    def Bcast(self, buf, root: int = 0) -> None:
        with self._transfer() as t:
            self.comm.Bcast(t.send(buf) if self.comm.Get_rank() == root else t.recv(buf), root)

    # --- communicators -------------------------------------------------------------------------------------
    def Split(self, color: int = 0, key: int = 0):
        return self._wrap(self.comm.Split(color, key))

    def Split_type(self, split_type: int, key: int = 0, *args, **kwargs):
        return self._wrap(self.comm.Split_type(split_type, key, *args, **kwargs))

    def Dup(self, *args, **kwargs):
        return self._wrap(self.comm.Dup(*args, **kwargs))

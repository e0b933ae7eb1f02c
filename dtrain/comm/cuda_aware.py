"""Is the MPI library CUDA-aware, that is, may a GPU buffer's address be handed to it as it is?

mpi4py hands MPI the *address* of a buffer; for a CuPy array that is an address in GPU memory. A CUDA-aware MPI (Open
MPI or MPICH built with CUDA, over UCX or libfabric) recognises it and moves the data itself: GPU to GPU over NVLink,
or NIC to GPU memory directly (GPUDirect RDMA). Any other MPI reads that address as host memory, which crashes the
process or sends garbage, so GPU buffers must then be staged through host memory (:mod:`dtrain.comm.staging`).

**How it is decided** (:func:`cuda_aware_mpi`, the reason in one line from :func:`cuda_awareness_reason`):

1. ``DTRAIN_CUDA_AWARE=1`` or ``0`` decides, for when you know better than the library (empty counts as unset, any
   other value is an error);
2. otherwise the MPI library that mpi4py loaded is asked through ctypes: ``MPIX_Query_cuda_support()`` (Open MPI's
   extension, also exported by MPICH), else MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``. The
   library is found among the shared objects already mapped into the process (``/proc/self/maps``; mpi4py loads it
   privately, so its symbols are not in the global namespace), then in the global namespace;
3. no such function, or anything going wrong on the way: not CUDA-aware, which is always safe (staging works with
   every MPI, just slower). The library is asked once per process.

The ``mpich`` wheel that ``pip install dtrain`` brings (MPICH 5.0.2, ch4 over UCX/libfabric) exports both query
functions, and both answer 0: it is built without CUDA support, so GPU runs on it stage every message.
"""

from __future__ import annotations

import ctypes
import os

ENV_VAR = "DTRAIN_CUDA_AWARE"
MPIX_GPU_SUPPORT_CUDA = 0  # from MPICH's mpi.h (ZE is 1, HIP is 2)

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

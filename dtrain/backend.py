"""The array module: NumPy by default, CuPy when asked for.

Everything above this file writes ``xp.zeros(...)``, ``xp.exp(...)``: the same code runs on the CPU (NumPy) or the
GPU (CuPy), because CuPy copies NumPy's API. This file decides which ``xp`` a run uses, moves arrays between host
and device, and holds the dtype policy:

* float32 is the training default (what GPUs and BLAS are fastest at, and what PyTorch uses);
* float64 is for checks: finite-difference gradient tests need its 16 digits to see an error of 1e-7.
"""

from __future__ import annotations

import hashlib
import types

import numpy as np

from dtrain.errors import UserError

DEFAULT_DTYPE = np.float32
DTYPES = {"float32": np.float32, "float64": np.float64}
DEVICES = ("cpu", "gpu")


class BackendError(UserError, RuntimeError):
    """A device or dtype that cannot be used here; the message says what to do."""


def get_xp(device: str = "cpu") -> types.ModuleType:
    """The array module for ``device``: ``numpy`` for "cpu", ``cupy`` for "gpu"."""
    if device == "cpu":
        return np
    if device == "gpu":
        try:
            import cupy
        except ImportError as exc:
            raise BackendError(
                "--device gpu needs CuPy, which is not installed: pip install 'dtrain[gpu]' (CUDA 12) or "
                "'dtrain[gpu-cuda13]' (CUDA 13; nvidia-smi says which), or use --device cpu"
            ) from exc
        try:
            cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDA driver missing or no GPU: cupy raises its own runtime errors
            raise BackendError(f"--device gpu: CuPy is installed but found no usable GPU ({exc})") from exc
        return cupy
    raise BackendError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}")


def gpu_missing() -> str | None:
    """Why ``--device gpu`` cannot run here (no CuPy, no GPU), or None when it can: for tests to skip with a reason
    and lessons to say why their GPU part is left out."""
    try:
        get_xp("gpu")
    except BackendError as exc:
        return str(exc)
    return None


def select_gpu(local_rank: int) -> dict:
    """Make GPU ``local_rank % count`` this process's current device (one GPU per rank; when ranks outnumber GPUs,
    several ranks share one: each gets its own CUDA context and memory, and the GPU time-slices their kernels).
    Call it before the first CuPy allocation: arrays live on the device that was current when they were made.
    Returns what a run records: the index, the name, how many GPUs this node has."""
    cupy = get_xp("gpu")
    count = cupy.cuda.runtime.getDeviceCount()
    index = local_rank % count
    cupy.cuda.Device(index).use()
    name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
    return {"index": index, "name": name.decode() if isinstance(name, bytes) else str(name), "count": count}


def array_module(array) -> types.ModuleType:
    """The module an array belongs to (``cupy`` for a CuPy array, else ``numpy``), without importing CuPy."""
    if is_device_array(array):
        import cupy

        return cupy
    return np


def is_device_array(array) -> bool:
    """True for a GPU (CuPy) array."""
    return type(array).__module__.startswith("cupy")


def host_or_device_loss(value):
    """A step's loss, in float64, where it lives: a Python float for a NumPy value, a 0-d float64 CuPy array for a
    GPU one. Reading a GPU value on the host makes the CPU wait until the GPU has run everything queued so far, so a
    loss read at every step would stop the CPU from queueing the next step's kernels while the GPU runs this one's:
    the driver reads GPU losses a few steps at a time instead (:func:`read_losses`)."""
    if is_device_array(value):
        return value.astype(np.float64)
    return float(value)


def read_losses(values) -> list[float]:
    """Python floats of losses from :func:`host_or_device_loss` (and plain numbers): one copy for all GPU ones."""
    out = list(values)
    on_device = [i for i, v in enumerate(out) if is_device_array(v)]
    if on_device:
        import cupy

        for i, v in zip(on_device, cupy.stack([out[i] for i in on_device]).get().tolist()):
            out[i] = v
    return [float(v) for v in out]


def to_host(array) -> np.ndarray:
    """A NumPy array with the same values (a copy only when the array lives on the GPU)."""
    if is_device_array(array):
        return array.get()
    return np.asarray(array)


def to_device(array, xp: types.ModuleType):
    """``array`` moved to the module ``xp`` (no copy when it is already there)."""
    if xp is np:
        return to_host(array)
    return xp.asarray(array)


def resolve_dtype(name) -> np.dtype:
    """``"float32"``/``"float64"`` (or a NumPy dtype) to a dtype; anything else is an error that lists the choices."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise BackendError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
        return np.dtype(DTYPES[name])
    dtype = np.dtype(name)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise BackendError(f"dtype {dtype} is not supported: use float32 (training) or float64 (checks)")
    return dtype


def itemsize(dtype) -> int:
    """Bytes of one number of ``dtype`` (``--dtype``'s "float32" or "float64", or a NumPy dtype): how the cost
    functions size a buffer they do not hold."""
    return resolve_dtype(dtype).itemsize


def weights_digest(flat_params) -> str:
    """SHA-256 of the flat parameter buffer's bytes: equal digests mean bit-identical weights."""
    return hashlib.sha256(np.ascontiguousarray(to_host(flat_params)).tobytes()).hexdigest()

"""Reductions on flat buffers: the arithmetic inside every all-reduce.

Interface (collectives use only these; each works in place on contiguous arrays of one dtype and returns the
destination):

    add_(dst, src)             dst += src
    max_(dst, src)             dst = maximum(dst, src)         (NaN wins, exactly like np.maximum)
    scale_(buf, factor)        buf *= factor
    sum_scale_(out, bufs, s)   out = (bufs[0] + ... + bufs[k-1]) * s      (out may be bufs[0], one pass over memory)
    reduce_(dst, src, op)      add_ for op "sum"/"avg", max_ for "max"

Three implementations sit behind it: Numba loops on the CPU, CuPy on the GPU, and plain NumPy, which always works.

**Why a reduction is memory-bound.** ``dst += src`` on float32 does one addition for every 12 bytes it moves (read
dst, read src, write dst). A core can add 16 floats per instruction with SIMD, but memory delivers only a few floats
per cycle, so the time is *bytes moved / memory bandwidth*. To go faster, move fewer bytes.

**What fusing buys.** NumPy runs one operation per pass over memory. For ``out = (b0 + b1 + b2 + b3) * s``::

    np.add(b0, b1, out=out)      read 2n, write n
    np.add(out, b2, out=out)     read 2n, write n
    np.add(out, b3, out=out)     read 2n, write n
    np.multiply(out, s, out=out) read n,  write n       ->  11 n elements, (3k - 1) n for k inputs

Once the arrays outgrow the caches, every pass goes to main memory. The fused loop below reads each input once, keeps
the running sum in a register, and writes ``out`` once: (k + 1) n elements, 5 n instead of 11 n for k = 4. A single
``add_`` is already one pass in NumPy, so Numba cannot beat it: the same bytes move either way. (What the fused
loops gain in practice, and why it is less than the byte count promises: docs/benchmarks.md.)

**Why no fastmath.** ``fastmath=True`` would let the compiler regroup ``(b0 + b1) + b2`` as ``b0 + (b1 + b2)``.
Floating-point addition is not associative, so the last bit could differ from NumPy's, and ranks (or a test) using
different backends would disagree. Without it each element is computed exactly as NumPy computes it: ``b0 + b1``, then
``+ b2``, ..., each rounded to the array's dtype, then times the factor cast to that dtype. The loop still uses SIMD,
because that needs no regrouping: element i and element i + 1 are independent.

**Which implementation runs (the dispatch rule).** It is written once, in ``_dispatch``; each kernel only supplies
its three implementations.

1. A CuPy array goes to CuPy (its ufuncs; a generated elementwise kernel for ``sum_scale_``).
2. Otherwise the CPU backend decides: environment variable ``DTRAIN_KERNELS`` = ``auto`` (the default: Numba if it
   can be imported, else NumPy), ``numba`` (an error if it is missing) or ``numpy``. :func:`use` switches at run time,
   :func:`backend_name` says which one is active, :func:`describe` says why.
3. With Numba, ``sum_scale_`` of fewer than ``FUSED_MIN_SIZE`` elements still goes to NumPy: checking the arguments
   and entering a compiled function costs about a microsecond, more than NumPy needs for a small job (so does a
   ``sum_scale_`` of one input, a plain scale: one NumPy pass at any size). ``add_``, ``max_`` and ``scale_`` go to
   NumPy below ``NUMBA_MIN_SIZE``, which is large: a single pass moves the same bytes either way, so
   single-threaded the loop only ties with NumPy, and only its prange twin (rule 4) can win. Arrays
   the compiled loops do not handle (non-contiguous, read-only, mixed dtypes or shapes, other dtypes) also go to
   NumPy, which gives them its usual result or error.
4. Large arrays (``PARALLEL_MIN_SIZE`` elements and up) use a ``prange`` twin of each loop, split across Numba's
   threads, but only when there are several threads (ranks under ``mpiexec`` get one each, see
   :mod:`dtrain.comm.mpi`) and only from the main thread (the simulator's ranks are threads, and Numba's default
   thread pool must not be entered by two of them at once). Below that size, starting the threads costs more than
   they save.

Nothing is compiled at import: Numba itself is imported on first use, each loop is compiled on its first call for a
given dtype (and number of inputs), and ``cache=True`` keeps the machine code on disk for the next process.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from dtrain.backend import is_device_array
from dtrain.errors import ConfigError, MissingPackage

ENV_VAR = "DTRAIN_KERNELS"
CHOICES = ("auto", "numba", "numpy")

# Sizes (in elements) from which the Numba loops are used; below them NumPy is faster (rule 3). Measured with
# scripts/bench_kernels.py (docs/bench/kernels.txt): sum_scale_ breaks even between 1e3 and 1e4 elements for k = 8
# and between 1e4 and 1e5 for k = 2 (the ring's case); the single-pass add_/max_/scale_ gain nothing single-threaded
# at any size (add_ and scale_: 0.55-1.07x of NumPy's speed), so they wait until their prange twin can.
FUSED_MIN_SIZE = 1 << 14
NUMBA_MIN_SIZE = 1 << 20
# From this many elements on, and with more than one Numba thread, the prange loops are used.
PARALLEL_MIN_SIZE = 1 << 20
# sum_scale_ fuses at most this many inputs per pass. Numba compiles one loop per number of inputs; more inputs are
# added in groups of this size (the running sum is kept in ``out``, so the order of additions, and the result, do not
# change), which bounds the compile time when a root sums the buffers of 64 ranks.
MAX_FUSED = 8

_NUMBA_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


# ----------------------------------------------------------------------------------------------------------------
# NumPy: the reference. Every other implementation must give these results bit for bit.
# ----------------------------------------------------------------------------------------------------------------


# Every implementation of every kernel takes ``(arrays, factor)``: ``arrays[0]`` is the destination, the rest the
# inputs (``sum_scale_``'s ``bufs``, which may start with the destination itself); ``factor`` is already cast to the
# destination's dtype, and None for add_ and max_, which do not scale.


def _numpy_add(arrays, factor):
    dst, src = arrays
    np.add(dst, src, out=dst)


def _numpy_max(arrays, factor):
    dst, src = arrays
    np.maximum(dst, src, out=dst)


def _numpy_scale(arrays, factor):
    np.multiply(arrays[0], factor, out=arrays[0])


def _numpy_sum_scale(arrays, factor):
    out, bufs = arrays[0], arrays[1:]
    if len(bufs) == 1:
        np.multiply(bufs[0], factor, out=out)
        return
    np.add(bufs[0], bufs[1], out=out)
    for b in bufs[2:]:
        np.add(out, b, out=out)
    np.multiply(out, factor, out=out)


# ----------------------------------------------------------------------------------------------------------------
# Numba: the same arithmetic as one loop over the elements.
# ----------------------------------------------------------------------------------------------------------------


def _compile_numba(parallel: bool) -> SimpleNamespace:
    """The Numba loops, as lazy dispatchers (each compiles on its first call for a new dtype or number of inputs).

    The loops are written once and built twice: with ``range`` (serial) and with ``numba.prange`` (``parallel=True``:
    the iterations are split across threads). ``nogil`` lets the simulator's rank-threads run them at the same time.
    ``bufs`` is a tuple of arrays of one type, so ``len(bufs)`` is known when compiling and the inner loop over the
    inputs is unrolled: for each element, load it from each input, add, scale, store once.
    """
    import numba

    loop = numba.prange if parallel else range
    jit = numba.njit(cache=True, nogil=True, parallel=parallel)  # fastmath stays off: see the module docstring

    @jit
    def add(dst, src):
        for i in loop(dst.size):
            dst[i] += src[i]

    @jit
    def maximum(dst, src):
        for i in loop(dst.size):
            a, b = dst[i], src[i]
            if not (a > b or a != a):  # np.maximum's rule: keep a if it is larger or NaN, else take b (NaN too)
                dst[i] = b

    @jit
    def scale(buf, factor):
        for i in loop(buf.size):
            buf[i] *= factor

    @jit
    def sum_scale(out, bufs, factor):
        first = bufs[0]
        for i in loop(out.size):
            acc = first[i]
            for j in range(1, len(bufs)):
                acc += bufs[j][i]
            out[i] = acc * factor

    # The same sum when out is bufs[0]. A separate loop, because the compiler checks at run time whether the output
    # overlaps an input and, if it does, gives up SIMD and runs element by element, 2x slower. Here the output is
    # only ever compared with the *other* inputs, which do not overlap it.
    @jit
    def sum_scale_into(out, others, factor):
        for i in loop(out.size):
            acc = out[i]
            for j in range(len(others)):
                acc += others[j][i]
            out[i] = acc * factor

    return SimpleNamespace(add=add, max=maximum, scale=scale, sum_scale=sum_scale, sum_scale_into=sum_scale_into)


_numba_loops: dict[bool, SimpleNamespace] = {}  # parallel? -> the loops


def _loops(n: int) -> SimpleNamespace:
    """The serial loops, or their prange twins for a large array when several threads may be used (rule 4)."""
    parallel = (
        n >= PARALLEL_MIN_SIZE
        and threading.current_thread() is threading.main_thread()
        and _numba_module.get_num_threads() > 1
    )
    if parallel not in _numba_loops:
        _numba_loops[parallel] = _compile_numba(parallel)
    return _numba_loops[parallel]


def _flat(arrays):
    """The arrays as 1-D arrays if the Numba loops can take them, else None (NumPy handles them; rule 3).

    They must be plain ndarrays of one supported dtype and one shape, C-contiguous, aligned and writeable
    (``flags.carray``). This runs on every call, so it is written to be cheap (about 0.1 us per array).
    """
    first = arrays[0]
    dtype, shape = first.dtype, first.shape
    if dtype not in _NUMBA_DTYPES:
        return None
    for a in arrays:
        if type(a) is not np.ndarray or not a.flags.carray or a.dtype != dtype or a.shape != shape:
            return None
    return arrays if len(shape) == 1 else tuple(a.reshape(-1) for a in arrays)


# The Numba side of each kernel: ``(loops, flat, arrays, factor)``, ``flat`` being ``arrays`` as 1-D views (_flat).


def _numba_add(loops, flat, arrays, factor):
    loops.add(flat[0], flat[1])


def _numba_max(loops, flat, arrays, factor):
    loops.max(flat[0], flat[1])


def _numba_scale(loops, flat, arrays, factor):
    loops.scale(flat[0], factor)


def _numba_sum_scale(loops, flat, arrays, factor):
    """``sum_scale_`` with the fused loops, ``MAX_FUSED`` inputs per pass (two inputs at least: see sum_scale_)."""
    out_flat, flat_bufs = flat[0], flat[1:]
    one = arrays[0].dtype.type(1)
    if arrays[0] is arrays[1]:  # accumulating into bufs[0] (compare the arrays: their 1-D views are new objects)
        first, rest = out_flat, flat_bufs[1:]
    else:
        first, rest = flat_bufs[0], flat_bufs[1:]
    while rest:
        group, rest = tuple(rest[: MAX_FUSED - 1]), rest[MAX_FUSED - 1 :]
        s = one if rest else factor  # x * 1 == x exactly, so only the last group's scale changes anything
        if first is out_flat:
            loops.sum_scale_into(out_flat, group, s)
        else:
            loops.sum_scale(out_flat, (first, *group), s)
        first = out_flat


# ----------------------------------------------------------------------------------------------------------------
# CuPy: GPU arrays. Its ufuncs are single-pass kernels already; sum_scale_ gets a generated fused kernel.
# ----------------------------------------------------------------------------------------------------------------

_cupy_sum_kernels: dict = {}  # number of inputs -> cupy.ElementwiseKernel


def _cupy_sum_scale_kernel(k: int):
    """An elementwise CUDA kernel ``y = (b0 + b1 + ... + b{k-1}) * f``, built once per k (CuPy compiles on first call).

    C evaluates ``a + b + c`` left to right, the order NumPy uses, and the sum is not a multiply-add, so the
    compiler has nothing to contract into an FMA: results match the CPU's.
    """
    if k not in _cupy_sum_kernels:
        import cupy

        names = [f"b{j}" for j in range(k)]
        _cupy_sum_kernels[k] = cupy.ElementwiseKernel(
            in_params=", ".join(f"T {name}" for name in names) + ", T f",
            out_params="T y",
            operation=f"y = ({' + '.join(names)}) * f",
            name=f"dtrain_sum{k}_scale",
        )
    return _cupy_sum_kernels[k]


def _cupy_add(arrays, factor):
    _cupy().add(arrays[0], arrays[1], out=arrays[0])


def _cupy_max(arrays, factor):
    _cupy().maximum(arrays[0], arrays[1], out=arrays[0])


def _cupy_scale(arrays, factor):
    _cupy().multiply(arrays[0], factor, out=arrays[0])


def _cupy_sum_scale(arrays, factor):
    out, bufs = arrays[0], arrays[1:]
    one = out.dtype.type(1)
    if len(bufs) == 1:
        _cupy().multiply(bufs[0], factor, out=out)
        return
    first, rest = bufs[0], list(bufs[1:])
    while rest:
        group, rest = rest[: MAX_FUSED - 1], rest[MAX_FUSED - 1 :]
        _cupy_sum_scale_kernel(1 + len(group))(first, *group, one if rest else factor, out)
        first = out


def _cupy():
    import cupy

    return cupy


# ----------------------------------------------------------------------------------------------------------------
# Choosing the CPU backend.
# ----------------------------------------------------------------------------------------------------------------

_active: str | None = None  # "numba" or "numpy" once chosen; None until the first kernel call, use() or backend_name()
_why = ""  # how it was chosen, for describe()
_numba_module = None


def use(name: str) -> str:
    """Switch the CPU kernels to ``name`` ("auto", "numba" or "numpy") for this process; return the active backend.

    "numba" raises ImportError when Numba cannot be imported; "auto" then quietly takes NumPy (:func:`describe`
    says why).
    """
    global _active, _why, _numba_module
    if name not in CHOICES:
        raise ConfigError(
            f"unknown kernel backend {name!r} (from {ENV_VAR} or kernels.use): choose one of {', '.join(CHOICES)}"
        )
    if name == "numpy":
        _active, _why = "numpy", "chosen"
        return _active
    try:
        import numba
    except Exception as exc:  # usually ImportError; a broken install can raise anything, and "auto" must survive it
        if name == "numba":
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise MissingPackage(
                f"{ENV_VAR}=numba needs Numba, which cannot be imported ({first_line}): install the numba extra "
                f"(pip install -e '.[numba]'), or unset {ENV_VAR}"
            ) from exc
        _active, _why = "numpy", f"numba cannot be imported: {exc}"
        return _active
    _numba_module = numba
    _active, _why = "numba", "chosen" if name == "numba" else "auto: numba is installed"
    return _active


def _resolve() -> str:
    return _active if _active is not None else use(_asked())


def _asked() -> str:
    return os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"


def check_environment() -> None:
    """Refuse a ``DTRAIN_KERNELS`` that cannot be honoured now, not at the first kernel call, deep in a run. (Only
    an explicit ``numba`` imports Numba here: ``auto`` waits for the first call, as before.)"""
    if _active is None and _asked() != "auto":
        use(_asked())


def backend_name() -> str:
    """The active CPU backend, "numba" or "numpy" (choosing it from ``DTRAIN_KERNELS`` if nothing has yet)."""
    return _resolve()


def load(dtype) -> None:
    """Import Numba and load the two-input fused loops for ``dtype`` now, rather than in a run's first timed step.

    On a fresh process that takes most of a second (importing Numba, then reading the loops from its on-disk cache),
    which in a short run is a large part of its first epoch. Nothing happens with the NumPy
    backend or a dtype the loops do not take; other input counts still load on first use.
    """
    dtype = np.dtype(dtype)
    if _resolve() != "numba" or dtype not in _NUMBA_DTYPES:
        return
    loops, one = _loops(0), dtype.type(1)
    out, a, b = (np.zeros(2, dtype) for _ in range(3))
    loops.sum_scale(out, (a, b), one)
    loops.sum_scale_into(out, (a,), one)


def describe() -> str:
    """One line for a lesson to print: which CPU backend runs reductions, why, and where it hands over to NumPy."""
    if _resolve() == "numpy":
        return f"numpy ({_why})"
    return (
        f"numba {_numba_module.__version__} ({_why}): sum_scale_ from {FUSED_MIN_SIZE} elements, add_/max_/scale_ "
        f"from {NUMBA_MIN_SIZE}, NumPy below; prange loops from {PARALLEL_MIN_SIZE} with several Numba threads"
    )


# ----------------------------------------------------------------------------------------------------------------
# The interface.
# ----------------------------------------------------------------------------------------------------------------


class _Kernel(NamedTuple):
    """One reduction, implemented three times (each with the ``(arrays, factor)`` signature above)."""

    numpy: Callable
    numba: Callable
    cupy: Callable


_ADD = _Kernel(_numpy_add, _numba_add, _cupy_add)
_MAX = _Kernel(_numpy_max, _numba_max, _cupy_max)
_SCALE = _Kernel(_numpy_scale, _numba_scale, _cupy_scale)
_SUM_SCALE = _Kernel(_numpy_sum_scale, _numba_sum_scale, _cupy_sum_scale)


def _dispatch(kernel: _Kernel, numba_from: float, arrays: tuple, factor=None):
    """Run ``kernel`` on ``arrays`` by the dispatch rule of the module docstring; return the destination.

    A CuPy array goes to CuPy (rule 1). Otherwise the Numba loops run from ``numba_from`` elements on (rule 3: the
    caller passes the threshold, read when it is called), when Numba is the backend (rule 2) and the loops can take
    these arrays; everything else goes to NumPy.
    """
    out = arrays[0]
    if type(out) is not np.ndarray and is_device_array(out):
        kernel.cupy(arrays, factor)
    elif out.size >= numba_from and _resolve() == "numba" and (flat := _flat(arrays)) is not None:
        kernel.numba(_loops(out.size), flat, arrays, factor)
    else:
        kernel.numpy(arrays, factor)
    return out


def add_(dst, src):
    """``dst += src`` in place; returns ``dst``."""
    return _dispatch(_ADD, NUMBA_MIN_SIZE, (dst, src))


def max_(dst, src):
    """``dst = maximum(dst, src)`` in place (a NaN in either wins, as with ``np.maximum``); returns ``dst``."""
    return _dispatch(_MAX, NUMBA_MIN_SIZE, (dst, src))


def scale_(buf, factor):
    """``buf *= factor`` in place, the factor cast to ``buf``'s dtype first; returns ``buf``."""
    return _dispatch(_SCALE, NUMBA_MIN_SIZE, (buf,), buf.dtype.type(factor))


def sum_scale_(out, bufs, factor):
    """``out = (bufs[0] + bufs[1] + ... + bufs[k-1]) * factor``, summed left to right in ``out``'s dtype; returns out.

    ``out`` may be ``bufs[0]`` itself (accumulate into your own buffer), but no other input. The factor is cast to the
    dtype first (so an average belongs in a float buffer).
    """
    if not bufs:
        raise ValueError("sum_scale_ needs at least one input buffer")
    numba_from = FUSED_MIN_SIZE if len(bufs) > 1 else math.inf  # one input is a scale: one NumPy pass already
    return _dispatch(_SUM_SCALE, numba_from, (out, *bufs), out.dtype.type(factor))


_REDUCTIONS = {"sum": _ADD, "avg": _ADD, "max": _MAX}  # an average adds: the caller applies its 1/p


def reduce_(dst, src, op):
    """``dst op= src`` for op "sum"/"avg" (an add: the 1/p of an average is applied by the caller) or "max"."""
    kernel = _REDUCTIONS.get(op)
    if kernel is None:
        raise ValueError(f"unknown reduction op {op!r}: choose sum, avg or max")
    return _dispatch(kernel, NUMBA_MIN_SIZE, (dst, src))

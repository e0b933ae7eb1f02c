"""The reduction kernels: every implementation gives NumPy's result bit for bit, and the backend choice behaves.

The Numba loops are compared with the NumPy reference at sizes from 0 to 1e6 + 3 (odd sizes leave a remainder after
the SIMD part of each loop), for every number of inputs from 1 to 8 and past ``MAX_FUSED``. The size thresholds are
set to 0 for that, so the compiled loops run even on arrays the dispatcher would hand to NumPy. The CuPy path is
checked on the CPU with a stand-in ``cupy`` module whose elementwise kernel evaluates the generated CUDA expression
with NumPy. Numba compiles each loop once per dtype and number of inputs and caches it on disk, so the first run
of this file takes ~15 s and later runs ~3 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from typing import ClassVar

import numpy as np
import pytest

from dtrain import kernels

FLOATS = ("float32", "float64")
INTS = ("int32", "int64")
SIZES = (0, 1, 7, 1000, 1_000_003)

_pool: dict = {}


def data(dtype: str, n: int, count: int) -> list[np.ndarray]:
    """``count`` fresh copies of fixed random arrays (made once per dtype and size: 1e6 randoms are not free)."""
    key = (dtype, n)
    if key not in _pool or len(_pool[key]) < count:
        rng = np.random.default_rng(n)
        if dtype in INTS:  # the full range: sums overflow, and both backends must wrap around the same way
            info = np.iinfo(dtype)
            made = [rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for _ in range(count)]
        else:
            made = [(rng.standard_normal(n) * 10).astype(dtype) for _ in range(count)]
        _pool[key] = made
    return [a.copy() for a in _pool[key][:count]]


def assert_same_bits(actual, expected):
    """Equal bit patterns: stricter than ==, which calls -0.0 and 0.0 equal and NaN unequal to itself."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    unsigned = f"u{actual.itemsize}"
    mismatch = np.flatnonzero(actual.view(unsigned) != expected.view(unsigned))
    assert mismatch.size == 0, f"{mismatch.size} elements differ, first at {mismatch[0]}"


def factor_for(dtype: str) -> float:
    return 3 if dtype in INTS else 0.37


@pytest.fixture(autouse=True)
def restore_backend():
    """Leave the backend and the thresholds as they were, whatever a test switched."""
    before = kernels.backend_name()
    thresholds = (kernels.NUMBA_MIN_SIZE, kernels.FUSED_MIN_SIZE, kernels.PARALLEL_MIN_SIZE)
    yield
    kernels.use(before)
    kernels.NUMBA_MIN_SIZE, kernels.FUSED_MIN_SIZE, kernels.PARALLEL_MIN_SIZE = thresholds


@pytest.fixture
def numba_everywhere():
    """Numba on, with the size thresholds at 0, so the compiled loops run at every size."""
    pytest.importorskip("numba")
    kernels.use("numba")
    kernels.NUMBA_MIN_SIZE = kernels.FUSED_MIN_SIZE = 0


def both_backends(run):
    """``run()`` (which makes fresh inputs and returns its result) under NumPy, then under Numba at every size."""
    kernels.use("numpy")
    expected = run()
    kernels.use("numba")
    kernels.NUMBA_MIN_SIZE = kernels.FUSED_MIN_SIZE = 0
    return run(), expected


# ----------------------------------------------------------------------------------------------------------------
# Numba == NumPy, bit for bit
# ----------------------------------------------------------------------------------------------------------------


def sum_scale_case(dtype, n, k, aliased):
    def run():
        bufs = data(dtype, n, k)
        out = bufs[0] if aliased else np.full(n, 99, dtype=dtype)
        result = kernels.sum_scale_(out, bufs, factor_for(dtype))
        assert result is out
        return out

    return run


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("k", range(1, 9))
def test_sum_scale_numba_equals_numpy(numba_everywhere, dtype, k):
    for n in SIZES:
        for aliased in (False, True):
            actual, expected = both_backends(sum_scale_case(dtype, n, k, aliased))
            assert_same_bits(actual, expected)


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("k", (1, 2, 3))
def test_sum_scale_integers_wrap_around_identically(numba_everywhere, dtype, k):
    for aliased in (False, True):
        actual, expected = both_backends(sum_scale_case(dtype, 1000, k, aliased))
        assert_same_bits(actual, expected)


@pytest.mark.parametrize("k", (9, 15, 17))
def test_sum_scale_beyond_max_fused_keeps_the_order(numba_everywhere, k):
    """More inputs than one fused pass takes: summed in groups, still left to right, still NumPy's bits."""
    assert k > kernels.MAX_FUSED
    for aliased in (False, True):
        actual, expected = both_backends(sum_scale_case("float32", 10_001, k, aliased))
        assert_same_bits(actual, expected)


def test_sum_scale_numpy_reference_is_the_plain_expression():
    """The reference itself: ((b0 + b1) + b2) + b3, rounded to float32 at each step, then times the float32 factor."""
    kernels.use("numpy")
    b0, b1, b2, b3 = data("float32", 1000, 4)
    out = np.empty_like(b0)
    kernels.sum_scale_(out, [b0, b1, b2, b3], 0.1)
    assert_same_bits(out, (((b0 + b1) + b2) + b3) * np.float32(0.1))


@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("name", ("add_", "max_", "scale_"))
def test_single_pass_kernels_numba_equal_numpy(numba_everywhere, name, dtype):
    kernel = getattr(kernels, name)

    def run(n):
        dst, src = data(dtype, n, 2)
        result = kernel(dst, factor_for(dtype)) if name == "scale_" else kernel(dst, src)
        assert result is dst
        return dst

    for n in SIZES:
        actual, expected = both_backends(lambda n=n: run(n))
        assert_same_bits(actual, expected)


@pytest.mark.parametrize("dtype", FLOATS)
def test_max_handles_nan_and_signed_zero_like_numpy(numba_everywhere, dtype):
    """np.maximum propagates a NaN from either side and, on a tie (0.0 vs -0.0), takes the second argument."""
    special = np.array([np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 5e-324], dtype=dtype)
    a, b = (x.ravel() for x in np.meshgrid(special, special))
    a, b = np.tile(a, 9), np.tile(b, 9)  # long enough for the SIMD part of the loop, with a remainder

    def run():
        dst = a.copy()
        kernels.max_(dst, b)
        return dst

    actual, expected = both_backends(run)
    assert_same_bits(actual, expected)


def test_reduce_dispatches_on_op(numba_everywhere):
    for op, reference in (("sum", np.add), ("avg", np.add), ("max", np.maximum)):
        dst, src = data("float32", 5000, 2)
        expected = reference(dst, src)
        assert kernels.reduce_(dst, src, op) is dst
        assert_same_bits(dst, expected)
    with pytest.raises(ValueError, match="unknown reduction op 'min'"):
        kernels.reduce_(dst, src, "min")


def test_sum_scale_needs_an_input():
    with pytest.raises(ValueError, match="at least one"):
        kernels.sum_scale_(np.zeros(3, np.float32), [], 1.0)


def test_multidimensional_contiguous_arrays_are_treated_as_flat(numba_everywhere):
    def run():
        bufs = [b.reshape(50, 20) for b in data("float32", 1000, 3)]
        return kernels.sum_scale_(bufs[0], bufs, 0.5)

    actual, expected = both_backends(run)
    assert_same_bits(actual, expected)


def test_arrays_the_loops_cannot_take_go_to_numpy(numba_everywhere, monkeypatch):
    """Strided views, read-only inputs, mixed dtypes and broadcasting get NumPy's own behaviour, never a wrong answer.

    (A strided view flattened with reshape would be a *copy*: an in-place loop on it would be lost.)
    """
    monkeypatch.setattr(kernels, "_loops", lambda n: pytest.fail("these arrays must not reach the Numba loops"))
    a, b = data("float32", 2000, 2)
    strided = a[::2]
    expected = strided + b[:1000]
    kernels.add_(strided, b[:1000])
    assert_same_bits(a[::2], expected)

    readonly = b.copy()
    readonly.flags.writeable = False
    out = np.empty_like(a)
    kernels.sum_scale_(out, [a, readonly], 2.0)
    assert_same_bits(out, (a + readonly) * np.float32(2.0))

    wide = a.astype(np.float64)
    kernels.add_(wide, b)  # float64 += float32: NumPy upcasts
    assert_same_bits(wide, a.astype(np.float64) + b)

    grid = a.reshape(2, 1000)
    kernels.add_(grid, b[:1000])  # broadcast over rows
    with pytest.raises(ValueError):
        kernels.add_(a[:10], b[:7])


def test_dispatch_thresholds(monkeypatch):
    """Small arrays go to NumPy even under Numba (calling a compiled loop costs more than NumPy's whole job)."""
    pytest.importorskip("numba")
    kernels.use("numba")
    calls = []
    real_loops = kernels._loops
    monkeypatch.setattr(kernels, "_loops", lambda n: calls.append(n) or real_loops(n))
    small, big = kernels.FUSED_MIN_SIZE - 1, kernels.FUSED_MIN_SIZE
    kernels.sum_scale_(*data("float32", small, 1), data("float32", small, 2), 0.5)
    assert calls == []
    kernels.sum_scale_(*data("float32", big, 1), data("float32", big, 2), 0.5)
    assert calls == [big]
    kernels.add_(*data("float32", big, 2))  # single-pass kernels have their own, higher threshold
    assert calls == [big] and kernels.NUMBA_MIN_SIZE > big


def test_parallel_loops_give_the_same_bits(numba_everywhere):
    """The prange twins (several Numba threads, main thread, large arrays) compute exactly what the serial loops do."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba has one thread here (NUMBA_NUM_THREADS=1): the parallel loops are never used")
    kernels.PARALLEL_MIN_SIZE = 0
    threads = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        assert kernels._loops(10) is kernels._numba_loops[True]
        for aliased in (False, True):
            actual, expected = both_backends(sum_scale_case("float32", 100_003, 4, aliased))
            assert_same_bits(actual, expected)
        actual, expected = both_backends(lambda: kernels.add_(*data("float32", 100_003, 2)))
        assert_same_bits(actual, expected)
    finally:
        numba.set_num_threads(threads)


def test_other_threads_never_enter_the_parallel_loops(numba_everywhere):
    """The simulator's ranks are threads; Numba's default thread pool must not be entered by two at once."""
    kernels.PARALLEL_MIN_SIZE = 0
    seen = []
    thread = threading.Thread(target=lambda: seen.append(kernels._loops(10**7)))
    thread.start()
    thread.join()
    assert seen == [kernels._numba_loops[False]]


# ----------------------------------------------------------------------------------------------------------------
# The CuPy path, with a stand-in cupy module
# ----------------------------------------------------------------------------------------------------------------


class FakeGpuArray(np.ndarray):
    """A NumPy array that ``dtrain.backend.is_device_array`` takes for a CuPy one (it looks at the type's module)."""

    __module__ = "cupy_stand_in"


class FakeElementwiseKernel:
    """Checks the call against the declared parameters and evaluates the CUDA expression with NumPy."""

    made: ClassVar[list] = []  # every kernel built, newest last

    def __init__(self, in_params, out_params, operation, name):
        self.inputs = [p.split()[1] for p in in_params.split(",")]
        self.outputs = [p.split()[1] for p in out_params.split(",")]
        self.operation, self.name = operation, name
        FakeElementwiseKernel.made.append(self)

    def __call__(self, *args):
        assert len(args) == len(self.inputs) + len(self.outputs)
        names = dict(zip(self.inputs, args))
        scope = {key: (np.asarray(v) if isinstance(v, np.ndarray) else v) for key, v in names.items()}
        target, expression = self.operation.split("=", 1)
        assert target.strip() == self.outputs[0]
        out = np.asarray(args[-1])
        out[...] = eval(expression, {}, scope)  # C and Python both add left to right
        return args[-1]


@pytest.fixture
def fake_cupy(monkeypatch):
    plain = {name: getattr(np, name) for name in ("add", "maximum", "multiply")}
    module = types.SimpleNamespace(ElementwiseKernel=FakeElementwiseKernel, **plain)
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setattr(kernels, "_cupy_sum_kernels", {})
    FakeElementwiseKernel.made = []
    return module


def on_gpu(arrays):
    return [a.view(FakeGpuArray) for a in arrays]


@pytest.mark.parametrize("k", (1, 2, 4, 8, 11))
def test_gpu_sum_scale_uses_fused_kernels(fake_cupy, k):
    kernels.use("numpy")
    bufs = data("float32", 999, k)
    expected = np.empty_like(bufs[0])
    kernels.sum_scale_(expected, bufs, 0.3)
    for aliased in (False, True):
        gpu = on_gpu(data("float32", 999, k))
        out = gpu[0] if aliased else np.zeros(999, np.float32).view(FakeGpuArray)
        assert kernels.sum_scale_(out, gpu, 0.3) is out
        assert_same_bits(np.asarray(out), expected)
    built = sorted(len(kernel.inputs) - 1 for kernel in FakeElementwiseKernel.made)  # inputs minus the factor
    expected_sizes = {1: [], 2: [2], 4: [4], 8: [8], 11: [4, 8]}[k]  # 11 = 8 in one pass, then the sum and 3 more
    assert built == expected_sizes


def test_gpu_single_pass_kernels(fake_cupy, monkeypatch):
    monkeypatch.setattr(kernels, "_loops", lambda n: pytest.fail("GPU arrays must not reach the Numba loops"))
    dst, src = on_gpu(data("float32", 100, 2))
    expected = np.maximum(np.asarray(dst) + np.asarray(src), np.asarray(src)) * np.float32(0.5)
    kernels.add_(dst, src)
    kernels.max_(dst, src)
    kernels.scale_(dst, 0.5)
    assert_same_bits(np.asarray(dst), expected)


# ----------------------------------------------------------------------------------------------------------------
# Choosing the backend
# ----------------------------------------------------------------------------------------------------------------


def test_use_switches_and_rejects_unknown_names():
    assert kernels.use("numpy") == "numpy" == kernels.backend_name()
    assert "numpy" in kernels.describe()
    with pytest.raises(ValueError, match=r"unknown kernel backend 'fortran'.*auto.*numba.*numpy"):
        kernels.use("fortran")
    pytest.importorskip("numba")
    assert kernels.use("numba") == "numba" == kernels.backend_name()
    assert kernels.use("auto") == "numba"


BLOCK_NUMBA = "import sys; sys.modules['numba'] = None\n"  # makes `import numba` fail, as if not installed


def run_python(code: str, env_value: str | None):
    env = {k: v for k, v in os.environ.items() if k != kernels.ENV_VAR}
    if env_value is not None:
        env[kernels.ENV_VAR] = env_value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


SHOW_BACKEND = """
import numpy as np
from dtrain import kernels
out = np.zeros(100_000, np.float32)
kernels.sum_scale_(out, [np.ones(100_000, np.float32)] * 3, 0.5)
assert (out == 1.5).all()
print(kernels.backend_name(), '|', kernels.describe())
"""


@pytest.mark.parametrize(
    ("env_value", "block_numba", "expected"),
    [
        ("numpy", False, "numpy"),
        ("numba", False, "numba"),
        ("auto", False, "numba"),
        (None, False, "numba"),
        (None, True, "numpy"),  # auto falls back when Numba cannot be imported
        ("numpy", True, "numpy"),
    ],
)
def test_environment_variable_picks_the_backend(env_value, block_numba, expected):
    if expected == "numba":
        pytest.importorskip("numba")
    result = run_python((BLOCK_NUMBA if block_numba else "") + SHOW_BACKEND, env_value)
    assert result.returncode == 0, result.stderr
    name, why = result.stdout.strip().split(" | ")
    assert name == expected
    if block_numba and env_value is None:
        assert "numba cannot be imported" in why


def test_environment_variable_errors_are_clear():
    bogus = run_python(SHOW_BACKEND, "fortran")
    assert bogus.returncode != 0 and "ConfigError: unknown kernel backend 'fortran'" in bogus.stderr
    missing = run_python(BLOCK_NUMBA + SHOW_BACKEND, "numba")
    assert missing.returncode != 0
    assert "MissingPackage: DTRAIN_KERNELS=numba needs Numba, which cannot be imported" in missing.stderr
    assert "install the numba extra" in missing.stderr


def test_import_is_cheap():
    """Importing the module neither imports Numba nor compiles anything: that waits for the first kernel call."""
    result = run_python("import sys, dtrain.kernels; print('numba' in sys.modules)", None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_load_brings_in_the_loops_a_first_reduction_needs_and_nothing_for_numpy():
    """In a fresh process: after ``load``, the first fused float32 reduction finds Numba imported and its two-input
    loops ready (their dispatchers hold a compiled signature); with the NumPy backend, Numba is never imported."""
    code = (
        "import sys, numpy as np\n"
        "from dtrain import kernels\n"
        "kernels.use('{backend}')\n"
        "kernels.load(np.float32)\n"
        "loaded = 'numba' in sys.modules and bool(kernels._numba_loops) and "
        "len(kernels._loops(0).sum_scale.signatures) > 0\n"
        "print(loaded)\n"
    )
    ran = {}
    for backend in ("numba", "numpy"):
        if backend == "numba":
            pytest.importorskip("numba")
        out = subprocess.run([sys.executable, "-c", code.format(backend=backend)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        ran[backend] = out.stdout.strip()
    assert ran == {"numba": "True", "numpy": "False"}

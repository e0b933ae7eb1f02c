"""Is the fused Numba reduction worth it? Time dtrain's reduction kernels with Numba against NumPy (and CuPy).

For ``add_``, ``scale_`` and ``sum_scale_`` (k = 2, 4, 8 inputs, plus k = 2 accumulated into ``bufs[0]``, which is
what the ring all-reduce does), float32 from 1e3 to 1e7 elements and a few float64 rows, ONE thread:

* ``numpy``: ``kernels.use("numpy")``: one ufunc per operation, so ``sum_scale_`` makes k passes over memory;
* ``numba``: ``kernels.use("numba")`` with the size thresholds set to 0, so the compiled loops run at *every* size
  and the table shows where they start to win (the real dispatcher hands smaller arrays to NumPy);
* ``cupy``: the same calls on GPU arrays, if CuPy and a GPU are there (times include a device synchronize).

Reported per call: the median time, the effective bandwidth (the bytes the operation must move at least, divided by
the time: ``add_`` reads two arrays and writes one, 3n; ``scale_`` 2n; ``sum_scale_`` reads k and writes one,
(k + 1)n; NumPy's extra passes are not counted, which is why its number is lower), and Numba's speed against NumPy's,
in words: numpy time / numba time, "1.50x faster" or "1.16x slower" (``numpy_over_numba`` in the JSON). The machines
are noisy: the contenders work on the same arrays and are timed interleaved, one sample of each in turn, each sample
long enough to be above the timer's noise and preceded by one untimed call (so both find the arrays equally warm in the
caches). The speed is given twice: of the medians (the typical call) and of the minima (the call least disturbed by
other programs); when they disagree, the machine was busy, so run it again.

    python scripts/bench_kernels.py                  # about half a minute
    python scripts/bench_kernels.py --quick          # sizes up to 1e6, fewer samples: a few seconds
    python scripts/bench_kernels.py --json out.json  # also save every number
    python scripts/bench_kernels.py --device gpu     # on a GPU: the fused kernel against CuPy's own ufuncs

``--device gpu`` compares, on GPU arrays of 1e4 to 1e8 elements, dtrain's kernels (``cupy``: for ``sum_scale_`` one
generated ``cupy.ElementwiseKernel`` that reads the k inputs and writes the output once) with CuPy's own operators
(``ufuncs``: ``out = b0 + b1``, ``out += b2`` ..., ``out *= f``: k passes over the output); the speed is the fused
kernel's against the ufuncs' (ufuncs' time over the fused kernel's: "faster", fusing pays). GPU times are taken to a
device synchronisation after each sample.
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_name] = "1"  # before NumPy and Numba load: one thread for every contender, as under mpiexec

import argparse
import datetime
import platform
import statistics
import time

import numpy as np
from bench_util import faster, run_meta, write_json

from dtrain import kernels, terminal

MIN_SAMPLE_S = 2e-3  # each timing sample repeats the call until it lasts at least this long
DEFAULT_THRESHOLDS = (kernels.NUMBA_MIN_SIZE, kernels.FUSED_MIN_SIZE)  # the dispatcher's, restored for numpy


def cases(quick: bool):
    """(kernel, k, aliased, dtype, n) for every row of the table."""
    sizes = [10**3, 10**4, 10**5, 10**6] + ([] if quick else [10**7])
    rows = []
    for n in sizes:
        rows += [("add_", 1, False, "float32", n), ("scale_", 1, False, "float32", n)]
        rows += [("sum_scale_", k, False, "float32", n) for k in (2, 4, 8)]
        rows.append(("sum_scale_", 2, True, "float32", n))
    big = 10**6 if quick else 10**7
    rows += [("add_", 1, False, "float64", big), ("sum_scale_", 4, False, "float64", big)]
    return rows


def min_bytes(kernel: str, k: int, n: int, itemsize: int) -> int:
    """The bytes any implementation must move: read every input once, write the output once."""
    elements = {"add_": 3 * n, "scale_": 2 * n}.get(kernel, (k + 1) * n)
    return elements * itemsize


def make_arrays(xp, k: int, dtype: str, n: int):
    """k + 1 arrays of n random values (the output first), made with ``xp`` (numpy or cupy)."""
    rng = np.random.default_rng(0)
    return [xp.asarray(rng.standard_normal(n).astype(dtype)) for _ in range(k + 1)]


def ufunc_call(arrays, kernel: str, k: int, aliased: bool):
    """The same operation with CuPy's own operators: one kernel, one pass over the output, per operator."""
    import cupy

    out, bufs = arrays[0], arrays[1:]
    if kernel == "add_":
        return lambda: cupy.add(out, bufs[0], out=out)
    if kernel == "scale_":
        return lambda: cupy.multiply(out, 1.0, out=out)
    inputs, factor = ([out, *bufs[1:]], 0.5) if aliased else (bufs, 1.0 / k)

    def sum_scale():
        cupy.add(inputs[0], inputs[1], out=out)  # (out = b0 + b1, or out += b1 when out is b0)
        for b in inputs[2:]:
            cupy.add(out, b, out=out)
        cupy.multiply(out, factor, out=out)

    return sum_scale


def make_call(arrays, kernel: str, k: int, aliased: bool):
    """A zero-argument function running the kernel once on ``arrays``."""
    out, bufs = arrays[0], arrays[1:]
    if kernel == "add_":
        return lambda: kernels.add_(out, bufs[0])
    if kernel == "scale_":
        return lambda: kernels.scale_(out, 1.0)  # x * 1.0: values stay put however often it runs
    if aliased:
        return lambda: kernels.sum_scale_(out, [out, *bufs[1:]], 0.5)
    return lambda: kernels.sum_scale_(out, bufs, 1.0 / k)


class Contender:
    """One backend: how to switch to it, its call for the current row, and its timing samples (seconds per call)."""

    def __init__(self, name: str, xp, sync=None, make=make_call):
        self.name, self.xp, self.sync, self.make = name, xp, sync or (lambda: None), make
        self.call, self.repeat, self.samples = None, 1, []

    def select(self):
        if self.name == "numba":
            kernels.use("numba")
            kernels.NUMBA_MIN_SIZE = kernels.FUSED_MIN_SIZE = 0
        else:
            kernels.use("numpy")
            kernels.NUMBA_MIN_SIZE, kernels.FUSED_MIN_SIZE = DEFAULT_THRESHOLDS

    def prepare(self, call):
        """Take the row's call, run it once (Numba compiles or loads its cache), and size a sample."""
        self.select()
        self.call, self.samples = call, []
        self.call()
        self.sync()
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < MIN_SAMPLE_S:
            self.call()
            calls += 1
        self.sync()
        self.repeat = calls

    def sample(self):
        """One timing sample, after one untimed call that brings this contender's arrays into the caches."""
        self.select()
        self.call()
        self.sync()
        start = time.perf_counter()
        for _ in range(self.repeat):
            self.call()
        self.sync()
        self.samples.append((time.perf_counter() - start) / self.repeat)


def contenders(device: str = "cpu"):
    if device == "gpu":  # CuPy's own operators first: the ratio is theirs over dtrain's fused kernel
        import cupy

        sync = cupy.cuda.Device().synchronize
        return [Contender("ufuncs", cupy, sync, make=ufunc_call), Contender("cupy", cupy, sync)]
    found = [Contender("numpy", np), Contender("numba", np)]
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        found.append(Contender("cupy", cupy, sync=cupy.cuda.Device().synchronize))
    except Exception as exc:  # no CuPy, or no GPU: the table simply has no cupy column
        print(f"(no cupy column: {type(exc).__name__}: {exc})")
    return found


def run(rows, samples: int, device: str = "cpu"):
    players = contenders(device)
    slow, fast = players[0].name, players[1].name  # the ratio: slow's time over fast's
    results = []
    for row in terminal.progress(rows, len(rows), "kernels"):
        kernel, k, aliased, dtype, n = row
        shared = make_arrays(players[0].xp, k, dtype, n)  # the first two work on the very same arrays
        for player in players:
            arrays = shared if player.xp is players[0].xp else make_arrays(player.xp, k, dtype, n)
            player.prepare(player.make(arrays, kernel, k, aliased))
        for _ in range(samples):
            for player in players:
                player.sample()
        nbytes = min_bytes(kernel, k, n, np.dtype(dtype).itemsize)
        result = {"kernel": kernel, "k": k, "out_is_bufs0": aliased, "dtype": dtype, "n": n, "bytes": nbytes}
        for player in players:
            median = statistics.median(player.samples)
            result[player.name] = {
                "median_s": median,
                "min_s": min(player.samples),
                "gbps": nbytes / median / 1e9,
                "calls_per_sample": player.repeat,
            }
        result[f"{slow}_over_{fast}"] = result[slow]["median_s"] / result[fast]["median_s"]
        result[f"{slow}_over_{fast}_min"] = result[slow]["min_s"] / result[fast]["min_s"]
        if "cupy" in result and "numpy" in result:
            result["numpy_over_cupy"] = result["numpy"]["median_s"] / result["cupy"]["median_s"]
        results.append(result)
    print(table(results, [p.name for p in players]), flush=True)
    return results


def label(result) -> str:
    if result["kernel"] != "sum_scale_":
        return result["kernel"]
    return f"sum_scale_ k={result['k']}" + (" out=b0" if result["out_is_bufs0"] else "")


def table(results: list[dict], names: list[str], width="auto") -> str:
    """The results as a table fitted to ``width`` (:mod:`dtrain.terminal`): a row per kernel, dtype and size, each
    contender's time and bandwidth, and the second contender's speed against the first's (of the medians, of the
    minima)."""
    slow, fast = names[:2]
    header = ["kernel", "dtype", "n"]
    groups = []
    for name in names:
        groups.append(len(header))
        header += [f"{name} us", f"{name} GB/s"]
    groups.append(len(header))
    header += [f"{fast} vs {slow}, medians", f"{fast} vs {slow}, minima"]
    cells = []
    for r in results:
        line = [label(r), r["dtype"], f"{r['n']:.0e}"]
        for name in names:
            line += [f"{r[name]['median_s'] * 1e6:.1f}", f"{r[name]['gbps']:.1f}"]
        ratio = f"{slow}_over_{fast}"
        cells.append([*line, faster(r[ratio]), faster(r[ratio + "_min"])])
    return terminal.table(header, cells, left=(0, 1), keys=3, groups=groups, width=width)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 1e6 and 5 samples each")
    parser.add_argument("--samples", type=int, default=None, help="timing samples per contender and row (21)")
    parser.add_argument("--json", metavar="PATH", help="save every number to this file")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu: fused kernel vs CuPy's ufuncs")
    args = parser.parse_args(argv)
    samples = args.samples or (5 if args.quick else 21)
    if args.device == "gpu":
        gpu_main(args, samples)
        return

    kernels.use("numba")  # an ImportError if Numba is missing: there would be nothing to compare
    import numba

    header = (
        f"{datetime.date.today()}  {platform.machine()} {os.cpu_count()} cpus  python {platform.python_version()}"
        f"  numpy {np.__version__}  numba {numba.__version__}  one thread  {samples} samples per cell"
    )
    print(terminal.paragraph(header, hanging="  "))
    print(terminal.paragraph(f"dispatcher: {kernels.describe()}", hanging="  "), flush=True)
    results = run(cases(args.quick), samples)
    if args.json:
        meta = run_meta(header=header, thresholds=dict(zip(("NUMBA_MIN_SIZE", "FUSED_MIN_SIZE"), DEFAULT_THRESHOLDS)))
        print(f"saved {write_json(args.json, {'meta': meta, 'results': results})}")


def gpu_cases(quick: bool):
    sizes = [10**4, 10**5, 10**6, 10**7] + ([] if quick else [10**8])
    rows = []
    for n in sizes:
        rows += [("add_", 1, False, "float32", n)]
        rows += [("sum_scale_", k, False, "float32", n) for k in (2, 4, 8)]
        rows.append(("sum_scale_", 2, True, "float32", n))
    return rows


def gpu_main(args, samples: int) -> None:
    from dtrain import backend

    missing = backend.gpu_missing()
    if missing:
        raise SystemExit(f"--device gpu: {missing}")
    import cupy

    gpu = backend.select_gpu(0)
    header = f"{datetime.date.today()}  {gpu['name']}  CuPy {cupy.__version__}  {samples} samples per cell"
    print(terminal.paragraph(header, hanging="  "), flush=True)
    results = run(gpu_cases(args.quick), samples, "gpu")
    if args.json:
        print(f"saved {write_json(args.json, {'meta': run_meta(header=header, gpu=gpu), 'results': results})}")


if __name__ == "__main__":
    main()

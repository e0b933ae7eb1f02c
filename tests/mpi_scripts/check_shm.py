"""Check the shared-memory collectives (dtrain/collectives/shm.py) on real ranks against MPI's own Allreduce.

Run under mpiexec (``tests/test_shm.py`` does, for p = 2, 3, 4)::

    python -m dtrain launch -n 3 tests/mpi_scripts/check_shm.py
    mpiexec -n 3 python -m mpi4py tests/mpi_scripts/check_shm.py     # the same, by hand

The oracle is ``comm.Allreduce`` (MPI's own reduction, which knows nothing of our windows) on a copy of the same
input. Two kinds of input, as in check_collectives.py:

* **small integers stored as floats** ("int"): every partial sum is exact in float32 and float64, so the sum and the
  max must equal MPI's bit for bit; so must the average, since both multiply the same exact sum by ``dtype(1/p)``.
* **random normals** ("normal"): MPI adds in its own order, and floating-point addition is not associative. Any order
  of the p - 1 additions of p values is within ``(p-1)/2 * eps * sum_i |x_i|`` of the exact sum (each addition rounds
  by at most eps/2 of a partial sum, and no partial sum exceeds sum_i |x_i|), so two orders differ by at most
  ``(p-1) * eps * sum_i |x_i|``; an average adds the rounding of the product: ``(p+1)/p * eps * sum_i |x_i|``.

Every algorithm runs on buffers in a shared window (zero copy: ``shm.buffer``, at offset 0 and at an offset) and on
plain arrays (copy-in), through the front door and directly. Also checked: every rank ends with the same bits; the
bytes the tracer saw copied and sent equal ``shm.bytes_copied`` and the cost model's; a call made at different
places of the window is a ValueError on every rank; ``release`` frees every window. With ``--fail-on-rank R`` rank R
raises inside the all-reduce, between the fences, while the others wait: the job must end at once (tests/test_shm.py
times it).
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np
import report  # (tests/mpi_scripts/report.py: the script's folder is on the path)

from dtrain import collectives, kernels
from dtrain.collectives import costmodel, hierarchical, shm
from dtrain.comm import windows
from dtrain.comm.names import IN_PLACE, MAX, SUM
from dtrain.comm.trace import TracedComm, Tracer

DTYPES = (np.float32, np.float64)
OFFSET = 3  # elements: a zero-copy view that does not start at the window's first byte


def sizes_for(p):
    return sorted({0, 1, max(p - 1, 0), p + 1, 7, 1000})


def make_input(kind, n, dtype, rank, seed=4321):
    rng = np.random.default_rng([seed, rank, n, 0 if kind == "int" else 1])
    if kind == "int":
        return rng.integers(-8, 9, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


class Checker:
    def __init__(self, comm):
        self.comm, self.p, self.rank = comm, comm.Get_size(), comm.Get_rank()
        self.tracer = Tracer()
        self.tcomm = TracedComm(comm, self.tracer)
        self.failures, self.count = [], 0

    def check(self, what, condition, message):
        self.count += 1
        if not condition:
            self.failures.append(f"rank {self.rank}: {what}: {message}")

    def mpi(self, x, op):
        """MPI's own all-reduce of every rank's ``x`` (the oracle), and sum_i |x_i| for the tolerance."""
        ref = x.copy()
        self.comm.Allreduce(IN_PLACE, ref, op=MAX if op == "max" else SUM)
        if op == "avg":
            ref *= x.dtype.type(1.0 / self.p)
        abs_sum = np.abs(x).astype(np.float64)
        self.comm.Allreduce(IN_PLACE, abs_sum, op=SUM)
        return ref, abs_sum

    def values(self, what, got, ref, abs_sum, op, kind):
        if kind == "int" or op == "max":
            bad = np.flatnonzero(got != ref)
            self.check(what, bad.size == 0, f"{bad.size} elements differ from MPI's, first at {bad[:1]}")
            return
        eps = np.finfo(got.dtype).eps
        tol = (self.p + 1) / self.p * eps * abs_sum if op == "avg" else (self.p - 1) * eps * abs_sum
        bad = np.flatnonzero(np.abs(got.astype(np.float64) - ref) > tol)
        self.check(what, bad.size == 0, f"{bad.size} elements beyond the reduction-order bound, first at {bad[:1]}")

    def identical(self, what, buf):
        digests = self.comm.allgather(hashlib.sha1(buf.tobytes()).hexdigest())
        self.check(what, len(set(digests)) == 1, "ranks ended with different bytes")

    def copied(self, what, label, collective, n, itemsize, p, rank, copy_in, sent=0):
        """The tracer's (bytes copied, bytes sent) for ``label`` against (``shm.bytes_copied``, ``sent``)."""
        stats = self.tracer.stats.get(label)
        got = (stats.bytes_copied, stats.bytes_sent) if stats else (0, 0)
        want = (shm.bytes_copied(collective, n, itemsize, p, rank, copy_in), sent)
        self.check(what, got == want, f"(bytes copied, bytes sent) {got}, the models say {want}")

    # --- the collectives ----------------------------------------------------------------------------------------
    def one_node(self, n, dtype, kind, zero):
        """allreduce, reduce_scatter, allgather: zero copy (at offset 0 and OFFSET) and copy-in, against MPI."""
        x = make_input(kind, n, dtype, self.rank)
        lo, hi = collectives.chunk_bounds(n, self.p)[self.rank]
        places = {"zero-copy": zero[dtype][:n], "zero-copy+offset": zero[dtype][OFFSET : OFFSET + n]}
        places["copy-in"] = np.empty(n, dtype)
        for op in collectives.OPS:
            ref, abs_sum = self.mpi(x, op)
            for place, buf in places.items():
                for door in ("front", "direct"):
                    what = f"allreduce/shm {door} {place} n={n} {np.dtype(dtype).name} {kind} {op}"
                    buf[...] = x
                    self.tracer.reset()
                    if door == "front":
                        out = collectives.allreduce(self.tcomm, buf, op, "shm")
                    else:
                        with self.tracer.operation("allreduce/shm"):
                            out = shm.allreduce(self.tcomm, buf, op)
                    self.check(what, out is buf, "did not return its buffer")
                    self.values(what, buf, ref, abs_sum, op, kind)
                    self.identical(what, buf)
                    copy_in = place == "copy-in"
                    self.copied(what, "allreduce/shm", "allreduce", n, buf.itemsize, self.p, self.rank, copy_in)
                what = f"reduce_scatter/shm {place} n={n} {np.dtype(dtype).name} {kind} {op}"
                buf[...] = x
                self.tracer.reset()
                shard = collectives.reduce_scatter(self.tcomm, buf, op, "shm")
                self.check(what, shard.size == hi - lo and (hi == lo or np.shares_memory(shard, buf)), "wrong view")
                self.values(what, shard, ref[lo:hi], abs_sum[lo:hi], op, kind)
                self.copied(what, "reduce_scatter/shm", "reduce_scatter", n, buf.itemsize, self.p, self.rank, copy_in)
        full = make_input(kind, n, dtype, 0)
        for place, buf in places.items():
            what = f"allgather/shm {place} n={n} {np.dtype(dtype).name} {kind}"
            buf[...] = np.nan
            buf[lo:hi] = full[lo:hi]
            self.tracer.reset()
            collectives.allgather(self.tcomm, buf, "shm")
            self.check(what, np.array_equal(buf, full), "differs from the gathered chunks")
            copy_in = place == "copy-in"
            self.copied(what, "allgather/shm", "allgather", n, buf.itemsize, self.p, self.rank, copy_in)

    def nodes(self, n, dtype, kind, topologies, zero):
        """hierarchical_shm on emulated nodes of 2 (the last one smaller when p is odd) and on the real node."""
        x = make_input(kind, n, dtype, self.rank)
        for op in collectives.OPS:
            ref, abs_sum = self.mpi(x, op)
            for k, topo in topologies.items():
                places = {"zero-copy": zero[k, dtype][:n], "copy-in": np.empty(n, dtype)}
                for place, buf in places.items():
                    what = f"allreduce/hierarchical_shm k={k} {place} n={n} {np.dtype(dtype).name} {kind} {op}"
                    buf[...] = x
                    self.tracer.reset()
                    collectives.allreduce(self.tcomm, buf, op, "hierarchical_shm", topology=topo)
                    self.values(what, buf, ref, abs_sum, op, kind)
                    self.identical(what, buf)
                    node, itemsize, copy_in = topo.node, buf.itemsize, place == "copy-in"
                    sent = costmodel.bytes_sent("hierarchical_shm", n, itemsize, self.p, self.rank, k or self.p)
                    node_size, local = node.Get_size(), node.Get_rank()  # (the real node: one node, k = p)
                    label = "allreduce/hierarchical_shm"
                    self.copied(what, label, "hierarchical_shm", n, itemsize, node_size, local, copy_in, sent)
                what = f"allreduce/hierarchical_shm direct k={k} n={n} {np.dtype(dtype).name} {kind} {op}"
                buf = x.copy()
                shm.hierarchical_allreduce(topo, buf, op)
                self.values(what, buf, ref, abs_sum, op, kind)

    def mismatches(self, zero):
        """The same call at different places of the window (or a different collective): a ValueError everywhere."""
        zero = zero[np.float64]
        cases = {
            "size": lambda: collectives.allreduce(self.comm, zero[: 5 + self.rank], algorithm="shm"),
            "offset": lambda: collectives.allreduce(self.comm, zero[self.rank : self.rank + 5], algorithm="shm"),
            "collective": lambda: (collectives.allgather if self.rank else collectives.allreduce)(
                self.comm, zero[:6], algorithm="shm"
            ),
        }
        for name, call in cases.items():
            try:
                call()
                self.check(f"mismatch: {name}", False, "no ValueError raised")
            except ValueError as exc:
                self.check(f"mismatch: {name}", "every rank must make the same call" in str(exc), str(exc))
            self.comm.Barrier()  # (every rank has left the call before the next case writes its header)


def run_checks(comm, made=None):
    """Run every check on ``comm``; return (number of checks, list of failure messages) on this rank. ``made``: the
    SharedWindows allocated so far (main() records them), to see that ``release`` frees every one."""
    c = Checker(comm)
    biggest = max(sizes_for(c.p)) + OFFSET
    zero = {dtype: shm.buffer(c.tcomm, biggest, dtype) for dtype in DTYPES}
    topologies = {2: hierarchical.topology(c.tcomm, 2), None: hierarchical.topology(c.tcomm)}
    for k, topo in topologies.items():
        for dtype in DTYPES:
            zero[k, dtype] = shm.buffer(topo.node, biggest, dtype)
    for n in sizes_for(c.p):
        for dtype in DTYPES:
            for kind in ("int", "normal"):
                c.one_node(n, dtype, kind, zero)
                c.nodes(n, dtype, kind, topologies, zero)
    if c.p > 1:  # (one rank has nobody to disagree with)
        c.mismatches(zero)
    shm.release(c.tcomm)
    shm.release(c.tcomm)  # a second release: nothing left to free, no error
    for topo in topologies.values():
        shm.release(topo.node)
        topo.free()
    if made is not None:
        c.check("release", len(made) > 6 and all(w.freed for w in made), "a window was not freed")
    x = make_input("int", 10, np.float64, c.rank)  # after release: a fresh scratch window, the right sum
    ref, _ = c.mpi(x, "sum")
    c.check("after release", np.array_equal(collectives.allreduce(comm, x, algorithm="shm"), ref), "wrong sum")
    shm.release(comm)
    return c.count, c.failures


def fail_inside(comm, rank):
    """Rank ``rank`` raises inside a shared-memory all-reduce, after fence 1, while the others wait in fence 2."""
    buf = shm.buffer(comm, 100, np.float64)
    if comm.Get_rank() == rank:

        def broken(*args, **kwargs):
            raise RuntimeError(f"rank {rank} fails inside the shm all-reduce")

        kernels.sum_scale_ = broken
    collectives.allreduce(comm, buf, algorithm="shm")
    print(f"rank {comm.Get_rank()}: left the all-reduce", flush=True)


def main():
    from mpi4py import MPI

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-on-rank", type=int, default=None, help="this rank raises inside the all-reduce")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if args.fail_on_rank is not None:
        fail_inside(comm, args.fail_on_rank)
        return
    made, allocate = [], windows.allocate  # every window this rank allocates, to see that release frees them all
    windows.allocate = lambda *args: made.append(allocate(*args)) or made[-1]
    count, failures = run_checks(comm, made)
    report.finish(comm, "check_shm", count, failures)


if __name__ == "__main__":
    main()

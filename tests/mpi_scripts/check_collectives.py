"""Check every collective on every rank: values against NumPy and MPI's own Allreduce, traffic against the cost model.

Run under mpiexec (``tests/test_collectives.py`` does, for p = 1 .. 8)::

    python -m dtrain launch -n 4 tests/mpi_scripts/check_collectives.py
    mpiexec -n 4 python -m mpi4py tests/mpi_scripts/check_collectives.py     # the same, by hand

The same ``run_checks(comm, ...)`` runs on the simulator (``sim.run(p, run_checks)``). Every rank can regenerate
every rank's input from a seed, so each rank computes the expected result itself. Two kinds of input:

* **small integers stored as floats** ("int"): every partial sum is an integer far below 2^24, so it is exact in
  float32 and float64 whatever order the additions happen in. Sums (and averages: the exact sum times the same
  rounded 1/p) must match NumPy *bit for bit*.
* **random normal values** ("normal"): now the order of additions matters. The ring adds chunk c in the order
  c+1, c+2, ... around the ring, recursive doubling in pairs, MPI in its own order; floating-point addition is not
  associative, so these results can differ in the last bits and none of them is "the" answer. Any order of the p - 1
  additions of p values is within ``(p-1) * eps * sum_i |x_i|`` of the exact sum, elementwise (each addition
  rounds with relative error at most eps/2, and every partial sum is at most sum_i |x_i| in size). We check that
  bound against the exact sum (computed in extended precision), for our result and for MPI's. An average adds the
  rounding of 1/p and of the product: ``(p + 1) * eps * sum_i |x_i| / p``.

Also checked: every rank ends with bit-identical results (all our algorithms compute each element once and copy it),
and the bytes and messages each rank sent, counted by the tracer, equal ``costmodel.traffic`` exactly. All failures
are reported; the exit status is non-zero if there was any.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np
import report  # (tests/mpi_scripts/report.py: the script's folder is on the path)

from dtrain import collectives
from dtrain.collectives import costmodel, hierarchical
from dtrain.comm.names import IN_PLACE, MAX, SUM
from dtrain.comm.trace import TracedComm, Tracer

BIG = 1 << 20  # 4 MiB of float32
DTYPES = (np.float32, np.float64)


def sizes_for(p, big):
    return sorted({0, 1, max(p - 1, 0), p + 1, 7, 13, 1009} | ({BIG} if big else set()))


def allreduce_variants(p):
    """(algorithm, ranks_per_node) pairs to run on p ranks: emulated nodes of 2 and 3, unequal ones included.

    A hierarchical variant runs on a topology the checker builds once per ranks_per_node (None: the real nodes).
    """
    variants = [(a, None) for a in collectives.ALGORITHMS]
    variants += [("hierarchical", 2), ("hierarchical", 3)]
    variants += [("hierarchical_rs", k) for k in (2, 3) if p % k == 0]
    return variants


def make_input(kind, n, dtype, rank, seed):
    rng = np.random.default_rng([seed, rank, n, 0 if kind == "int" else 1])
    if kind == "int":
        return rng.integers(-8, 9, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def expected(xs, op, dtype):
    """(expected result in dtype, exact result, sum of |x_i|) for the inputs of all ranks."""
    stack = np.asarray(xs, dtype=np.longdouble)  # extended precision: the exact sum, to well below eps
    if op == "max":
        result = np.max(np.asarray(xs), axis=0)
        return result, result, np.abs(stack).sum(axis=0)
    exact = stack.sum(axis=0)
    result = exact.astype(dtype)
    if op == "avg":
        result = result * dtype(1.0 / len(xs))
        exact = exact / len(xs)
    return result, exact, np.abs(stack).sum(axis=0)


def tolerance(op, p, dtype, abs_sum):
    eps = np.finfo(dtype).eps
    if np.finfo(np.longdouble).eps >= eps:  # no extended precision here: the reference itself errs as much
        abs_sum = 2 * abs_sum
    return (p + 1) * eps * abs_sum / p if op == "avg" else (p - 1) * eps * abs_sum


class Checker:
    def __init__(self, comm, seed):
        self.comm, self.seed = comm, seed
        self.p, self.rank = comm.Get_size(), comm.Get_rank()
        self.tracer = Tracer()
        self.tcomm = TracedComm(comm, self.tracer)
        self.failures, self.count = [], 0
        self.topologies = {}  # ranks_per_node -> hierarchical.Topology of the traced communicator

    def topology(self, k):
        """The nodes for ranks_per_node ``k``, built on first use (every rank gets here in the same order)."""
        if k not in self.topologies:
            self.topologies[k] = hierarchical.topology(self.tcomm, k)
        return self.topologies[k]

    def free(self):
        for topo in self.topologies.values():
            topo.free()
        self.topologies.clear()

    def fail(self, what, message):
        self.failures.append(f"rank {self.rank}: {what}: {message}")

    def check(self, what, condition, message):
        self.count += 1
        if not condition:
            self.fail(what, message)

    def values(self, what, got, want, exact, abs_sum, op, kind):
        if kind == "int" or op == "max":
            bad = np.flatnonzero(got != want)
            self.check(what, bad.size == 0, f"{bad.size} elements differ, first at {bad[:1]}")
        else:
            err = np.abs(got.astype(np.longdouble) - exact)
            tol = tolerance(op, self.p, got.dtype.type, abs_sum)
            bad = np.flatnonzero(err > tol)
            self.check(what, bad.size == 0, f"{bad.size} elements beyond the reduction-order bound")

    def traffic(self, what, label, algorithm, n, itemsize, k=None, collective="allreduce", root=0):
        stats = self.tracer.stats.get(label)
        got = (stats.messages_sent, stats.bytes_sent) if stats else (0, 0)
        want = costmodel.traffic(algorithm, n, itemsize, self.p, self.rank, k, collective=collective, root=root)
        self.check(what, got == want, f"sent (messages, bytes) {got}, cost model says {want}")
        self.tracer.reset()

    def identical(self, what, buf):
        digests = self.comm.allgather(hashlib.sha1(buf.tobytes()).hexdigest())
        self.check(what, len(set(digests)) == 1, "ranks ended with different bytes")

    # --- the collectives ----------------------------------------------------------------------------------------
    def allreduce(self, n, dtype, kind, ops, variants):
        xs = [make_input(kind, n, dtype, q, self.seed) for q in range(self.p)]
        for op in ops:
            want, exact, abs_sum = expected(xs, op, dtype)
            ref = xs[self.rank].copy()
            self.comm.Allreduce(IN_PLACE, ref, op=MAX if op == "max" else SUM)
            if op == "avg":
                ref *= dtype(1.0 / self.p)
            self.values(f"MPI Allreduce n={n} {dtype.__name__} {kind} {op}", ref, want, exact, abs_sum, op, kind)
            for algorithm, k in variants:
                what = f"allreduce/{algorithm} k={k} n={n} {np.dtype(dtype).name} {kind} {op}"
                buf = xs[self.rank].copy()
                topo = self.topology(k) if algorithm.startswith("hierarchical") else None
                out = collectives.allreduce(self.tcomm, buf, op, algorithm, topology=topo)
                self.check(what, out is buf, "did not return its buffer")
                chosen = costmodel.choose(buf.nbytes, self.p) if algorithm == "auto" else algorithm
                self.traffic(what, f"allreduce/{chosen}", chosen, n, buf.itemsize, k)
                self.values(what, buf, want, exact, abs_sum, op, kind)
                self.identical(what, buf)
                if kind == "int" and op != "avg":  # same inputs, exact arithmetic: MPI's answer too
                    self.check(what + " vs MPI", np.array_equal(buf, ref), "differs from MPI's Allreduce")

    def rooted(self, n, dtype, kind):
        xs = [make_input(kind, n, dtype, q, self.seed) for q in range(self.p)]
        for root in sorted({0, self.p - 1, self.p // 2}):
            for algorithm in collectives.REDUCE_ALGORITHMS:
                for op in collectives.OPS:
                    what = f"reduce/{algorithm} root={root} n={n} {np.dtype(dtype).name} {kind} {op}"
                    want, exact, abs_sum = expected(xs, op, dtype)
                    buf = xs[self.rank].copy()
                    collectives.reduce(self.tcomm, buf, root, op, algorithm)
                    self.traffic(what, f"reduce/{algorithm}", algorithm, n, buf.itemsize, None, "reduce", root)
                    if self.rank == root:
                        self.values(what, buf, want, exact, abs_sum, op, kind)
                what = f"broadcast/{algorithm} root={root} n={n} {np.dtype(dtype).name} {kind}"
                buf = xs[self.rank].copy()
                collectives.broadcast(self.tcomm, buf, root, algorithm)
                self.traffic(what, f"broadcast/{algorithm}", algorithm, n, buf.itemsize, None, "broadcast", root)
                self.check(what, np.array_equal(buf, xs[root]), "differs from the root's buffer")

    def scatter_gather(self, n, dtype, kind):
        xs = [make_input(kind, n, dtype, q, self.seed) for q in range(self.p)]
        lo, hi = collectives.chunk_bounds(n, self.p)[self.rank]
        power_of_two = self.p & (self.p - 1) == 0
        for algorithm in ("ring", "rabenseifner") if power_of_two else ("ring",):
            for op in collectives.OPS:
                what = f"reduce_scatter/{algorithm} n={n} {np.dtype(dtype).name} {kind} {op}"
                want, exact, abs_sum = expected(xs, op, dtype)
                buf = xs[self.rank].copy()
                shard = collectives.reduce_scatter(self.tcomm, buf, op, algorithm)
                self.traffic(what, f"reduce_scatter/{algorithm}", algorithm, n, buf.itemsize, None, "reduce_scatter")
                self.check(what, shard.size == hi - lo and (hi == lo or np.shares_memory(shard, buf)), "wrong view")
                self.values(what, shard, want[lo:hi], exact[lo:hi], abs_sum[lo:hi], op, kind)
        for algorithm in ("ring", "doubling") if power_of_two else ("ring",):
            what = f"allgather/{algorithm} n={n} {np.dtype(dtype).name} {kind}"
            full = xs[0]
            buf = np.full(n, np.nan, dtype=dtype)
            buf[lo:hi] = full[lo:hi]
            collectives.allgather(self.tcomm, buf, algorithm)
            self.traffic(what, f"allgather/{algorithm}", algorithm, n, buf.itemsize, None, "allgather")
            self.check(what, np.array_equal(buf, full), "differs from the gathered chunks")

    def bad_inputs(self):
        """Every rank makes the same mistake: every rank must raise at once, before sending anything."""
        good = np.zeros(8, dtype=np.float32)
        readonly = good.copy()
        readonly.flags.writeable = False
        cases = [
            ("read-only", ValueError, lambda: collectives.allreduce(self.comm, readonly)),
            ("strided", ValueError, lambda: collectives.allreduce(self.comm, np.zeros(16, np.float32)[::2])),
            ("int dtype", TypeError, lambda: collectives.allreduce(self.comm, np.zeros(8, np.int32))),
            ("list", TypeError, lambda: collectives.allreduce(self.comm, [1.0, 2.0])),
            ("op", ValueError, lambda: collectives.allreduce(self.comm, good, op="prod")),
            ("algorithm", ValueError, lambda: collectives.allreduce(self.comm, good, algorithm="butterfly")),
            ("root", ValueError, lambda: collectives.broadcast(self.comm, good, root=self.p)),
            ("reduce root", ValueError, lambda: collectives.reduce(self.comm, good, root=-1)),
            ("ranks_per_node", ValueError, lambda: collectives.allreduce(self.comm, good, ranks_per_node=0.5)),
        ]
        k = 2 if self.p % 2 else self.p - 1  # nodes of unequal size (when p > 2)

        def unequal():
            collectives.allreduce(self.comm, good, "sum", "hierarchical_rs", ranks_per_node=k)

        def unequal_topology():
            collectives.allreduce(self.tcomm, good, "sum", "hierarchical_rs", topology=self.topology(k))

        def topology_and_k():
            collectives.allreduce(self.tcomm, good, "sum", "hierarchical", topology=self.topology(k), ranks_per_node=k)

        def halving():
            collectives.reduce_scatter(self.comm, good, algorithm="rabenseifner")

        self.topology(k)  # (built before the cases: building is a collective call, and cannot fail half-way)
        cases.append(("topology and ranks_per_node", ValueError, topology_and_k))
        if self.p > 2:
            cases.append(("unequal nodes", ValueError, unequal))
            cases.append(("unequal topology", ValueError, unequal_topology))
        if self.p & (self.p - 1):
            cases.append(("rabenseifner p", ValueError, halving))
        for name, error, call in cases:
            try:
                call()
                self.check(f"bad input: {name}", False, f"no {error.__name__} raised")
            except error:
                self.count += 1
        self.comm.Barrier()  # nobody sent anything, so nothing is left unmatched

    def per_call_topology(self):
        """A hierarchical all-reduce with no topology builds one for the call (and frees it): slow, but it works."""
        for k in (None, 2):
            buf = np.full(5, float(self.rank + 1))
            collectives.allreduce(self.tcomm, buf, "sum", "hierarchical", ranks_per_node=k)
            what = f"allreduce/hierarchical per call k={k}"
            self.check(what, np.all(buf == self.p * (self.p + 1) / 2), "wrong result")
            self.traffic(what, "allreduce/hierarchical", "hierarchical", 5, buf.itemsize, k)

    def shapes(self):
        buf = np.full((3, 5), float(self.rank + 1), dtype=np.float64)
        collectives.allreduce(self.comm, buf, "sum", "ring")
        self.check("2-D buffer", buf.shape == (3, 5) and np.all(buf == self.p * (self.p + 1) / 2), "wrong result")


def run_checks(comm, big=True, seed=1234, dtypes=DTYPES, variants=None, extras=True):
    """Run every check on ``comm``; return (number of checks, list of failure messages) on this rank."""
    c = Checker(comm, seed)
    p = c.p
    variants = variants or allreduce_variants(p)
    for n in sizes_for(p, big):
        for dtype in dtypes:
            if n == BIG:  # a subset, to keep the run short: sum of normals for all, avg of ints for the ring
                if dtype is np.float32:
                    c.allreduce(n, dtype, "normal", ["sum"], variants)
                    c.allreduce(n, dtype, "int", ["avg"], [("ring", None)])
                continue
            for kind in ("int", "normal"):
                c.allreduce(n, dtype, kind, collectives.OPS, variants)
                if extras and n < 100:
                    c.rooted(n, dtype, kind)
                    c.scatter_gather(n, dtype, kind)
    if extras:
        c.bad_inputs()
        c.per_call_topology()
        c.shapes()
    c.free()
    return c.count, c.failures


def main():
    from mpi4py import MPI

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-big", action="store_true", help="skip the 4 MiB case")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    count, failures = run_checks(comm, big=not args.no_big, seed=args.seed)
    report.finish(comm, "check_collectives", count, failures)


if __name__ == "__main__":
    main()

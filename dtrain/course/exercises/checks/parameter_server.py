"""Checks of lesson 4's parameter servers: a worker's push and pull, and the stale-synchronous gate (no ranks).

The push and pull runs on ranks of which the last S play the servers inside the check: each receives every worker's
push (whatever its size or tag, so that a wrong one is reported, not waited for), checks it is that worker's slice of
its gradient, waits until every server has its pushes (a real server may hold a reply just so), then answers with
weights of its own. A worker must end with the servers' weights in ``params``, having sent one message per server.

The gate is held against hand-worked cases (bound 0 is lockstep, None asynchronous) and against its definition on
random clocks: worker w may be answered when it is at most ``bound`` steps ahead of *every* running worker.
"""

from __future__ import annotations

import random

import numpy as np

from dtrain.comm import new_status, probe, waitall
from dtrain.comm.names import ANY_TAG
from dtrain.course.exercises.grading import MPI, Exercise
from dtrain.parallel.ps_server import PUSH, WEIGHTS

EXERCISES = (
    Exercise("4.1", "a worker's push and pull", "parameter_server.py", "push_and_pull",
             ("comm", "params", "grads", "servers"), "dtrain.parallel.ps_worker:push_and_pull",
             "dtrain.course.exercises.checks.parameter_server:push_and_pull", (2, 3, 4, 5), MPI,
             "for each (server, (a, b)): comm.Irecv(params[a:b], server, WEIGHTS) and comm.Isend(grads[a:b], server, "
             "PUSH), all posted before any wait; then wait for every request"),
    Exercise("4.2", "the stale-synchronous gate", "parameter_server.py", "stale_synchronous_ready",
             ("waiting", "clock", "running", "bound"), "dtrain.parallel.ps_server:stale_synchronous_ready",
             "dtrain.course.exercises.checks.parameter_server:stale_synchronous_ready",
             hint="the slowest running worker sets the pace: answer w when clock[w] - min(its clock) <= bound; "
                  "bound None answers everyone"),
)  # fmt: skip

# (waiting, clock, running, bound, expected, what the case is about): worked by hand
GATE_CASES = (
    ([0, 1], [3, 3, 2], [0, 1, 2], 0, [], "bound 0 (lockstep): workers 0 and 1 wait for worker 2, a step behind"),
    ([0, 1, 2], [3, 3, 3], [0, 1, 2], 0, [0, 1, 2], "bound 0: everyone at step 3, all are answered"),
    ([2, 0], [3, 3, 3], [0, 1, 2], 0, [2, 0], "bound 0: the answer keeps the order of waiting"),
    ([0, 1], [9, 4, 0], [0, 1, 2], None, [0, 1], "bound None (asynchronous): everyone is answered at once"),
    ([0, 1], [5, 4, 3], [0, 1, 2], 1, [1], "bound 1: worker 1 is one step ahead of the slowest, worker 0 two"),
    ([0, 1], [5, 4, 3], [0, 1, 2], 2, [0, 1], "bound 2: worker 0 is exactly two steps ahead: answered"),
    ([0], [5, 4, 1], [0, 1], 1, [0], "worker 2 has finished (not running): the slowest running is worker 1"),
    ([1], [5, 4, 1], [1, 2], 2, [], "worker 0 is not running; worker 1 is three steps ahead of worker 2"),
    ([0, 3], [2, 6, 6, 2], [0, 1, 2, 3], 0, [0, 3], "bound 0: the slowest are answered, whoever runs ahead"),
    ([], [1, 2], [0, 1], 0, [], "no worker waiting: no answer"),
    ([0, 1], [1, 2], [], 1, [0], "no worker running: the slowest counts as at step 0"),
)


def gate_oracle(waiting, clock, running, bound) -> list[int]:
    """Worker w may go on when no running worker is more than ``bound`` steps behind it (or at step 0, if none is)."""
    behind = [clock[v] for v in running] or [0]
    return [w for w in waiting if bound is None or all(clock[w] - c <= bound for c in behind)]


def random_gate_cases(count: int, seed: int = 4):
    rng = random.Random(seed)
    for _ in range(count):
        workers = rng.randint(1, 6)
        clock = [rng.randint(0, 8) for _ in range(workers)]
        running = sorted(rng.sample(range(workers), rng.randint(0, workers)))
        waiting = rng.sample(range(workers), rng.randint(0, workers))
        yield waiting, clock, running, rng.choice((None, 0, 1, 2, 3))


def stale_synchronous_ready(fn, comm, grade) -> None:
    """``fn(waiting, clock, running, bound)``: the hand-worked cases, then 500 random ones against the definition;
    its arguments are left as they were."""
    cases = [(*case[:4], case[4], case[5]) for case in GATE_CASES]
    cases += [(*case, gate_oracle(*case), "random clocks") for case in random_gate_cases(500)]
    for number, (waiting, clock, running, bound, expected, about) in enumerate(cases, 1):
        call = f"stale_synchronous_ready(waiting={waiting}, clock={clock}, running={running}, bound={bound})"
        with grade.step(number, about, len(cases)):
            arguments = (list(waiting), list(clock), list(running), bound)
            got = fn(*arguments)
            got = list(got) if isinstance(got, (list, tuple)) else got
            if not grade.equal(got, expected, call):
                slowest = min((clock[v] for v in running), default=0)
                grade.note(f"the slowest running worker is at step {slowest}: a waiting worker w is answered when "
                           f"clock[w] - {slowest} <= bound (any, if bound is None), in waiting's order")  # fmt: skip
            grade.equal(arguments[:3], (waiting, clock, running), "waiting, clock, running after the call")


def shards(n: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous, balanced (start, stop) slices of n elements, the first n % servers one longer."""
    cut = np.array_split(np.arange(n), servers)
    return [(int(c[0]), int(c[-1]) + 1) for c in cut]


def gradient(worker: int, n: int) -> np.ndarray:
    """Worker w's gradient: numbers that say whose they are and where (100 w + i % 89 + 1)."""
    return (100 * worker + np.arange(n) % 89 + 1).astype(np.float64)


def weights(server: int, size: int) -> np.ndarray:
    """Server s's reply: its shard's new weights, numbers that say whose they are (-1000 (s + 1) - i)."""
    return -1000.0 * (server + 1) - np.arange(size, dtype=np.float64)


def push_and_pull(fn, comm, grade) -> None:
    """``fn(comm, params, grads, servers)`` on the first W ranks, with S = 1 .. p - 1 servers played by the last S
    ranks, on shards of a few elements each and of 1000 in all."""
    p, r = comm.Get_size(), comm.Get_rank()
    number, cases = 0, 2 * (p - 1)
    for s in range(1, p):
        w = p - s  # workers 0 .. w-1; servers w .. p-1
        for n in (3 * s + 1, 1000):
            number += 1
            bounds = shards(n, s)
            served = [(w + k, bounds[k]) for k in range(s)]
            servers_only = comm.Split(1 if r >= w else 0, r)  # the servers wait for one another before answering
            about = f"{w} worker(s), {s} server(s) (ranks {w}..{p - 1}), {n} float64 elements; servers = {served}"
            with grade.step(number, about, cases):
                if r < w:
                    worker_side(fn, comm, grade, n, served)
                else:
                    server_side(comm, servers_only, grade, n, served[r - w], w)
            servers_only.Free()


def worker_side(fn, comm, grade, n: int, served) -> None:
    r = comm.Get_rank()
    params, grads = np.zeros(n), gradient(r, n)
    before = grade.counts()
    fn(comm, params, grads, list(served))
    sent = grade.counts()[0] - before[0]
    expected = np.concatenate([weights(server, b - a) for server, (a, b) in served])
    if not grade.same(params, expected, f"worker rank {r}'s params after the call (each server's reply in its "
                      "shard)"):  # fmt: skip
        if not params.any():
            grade.note("params still holds zeros: receive each server's WEIGHTS into params[a:b], in place")
    grade.same(grads, gradient(r, n), "grads after the call (a worker only sends it)")
    if sent != len(served):
        grade.fail(f"worker rank {r} sent {sent} messages; a push and pull sends one to each of the {len(served)} "
                   "server(s): its slice of the gradient (and receives one from each)")  # fmt: skip


def server_side(comm, servers_only, grade, n: int, mine, workers: int) -> None:
    """One server of the check: every worker's push received and checked, then (once every server has its pushes)
    the answer to each."""
    server, (a, b) = mine
    status = new_status(comm)
    for w in range(workers):
        probe(comm, status, w, ANY_TAG)
        tag, count = status.Get_tag(), status.Get_count() // 8
        got = np.empty(count)
        comm.Recv(got, w, tag)
        if tag != PUSH:
            grade.fail(f"server rank {server} received a message tagged {tag} from worker rank {w}; a push is "
                       f"tagged PUSH ({PUSH})")  # fmt: skip
        elif count != b - a:
            grade.fail(f"server rank {server} (shard [{a}, {b}) of {n}) received {count} elements from worker rank "
                       f"{w}: expected its slice grads[{a}:{b}], {b - a} elements")  # fmt: skip
        else:
            grade.same(got, gradient(w, n)[a:b], f"the push server rank {server} (shard [{a}, {b})) received from "
                       f"worker rank {w}: expected its slice grads[{a}:{b}]")  # fmt: skip
    servers_only.Barrier()
    waitall([comm.Isend(weights(server, b - a), w, WEIGHTS) for w in range(workers)])

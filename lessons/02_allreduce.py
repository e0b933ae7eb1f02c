"""Lesson 2: all-reduce on real MPI ranks. Every hand-written algorithm, checked, timed and its bytes counted.

Data parallelism ends every step with an all-reduce: each rank holds the gradients of its slice of the batch, and
every rank must end with their sum. dtrain has several algorithms for it (dtrain/collectives/, one per file). This
lesson runs each of them on the ranks mpiexec started:

    dtrain launch -n 4 lessons/02_allreduce.py
    dtrain launch -n 3 lessons/02_allreduce.py                      # p not a power of two: fix-ups, uneven chunks
    dtrain launch -n 4 lessons/02_allreduce.py --ranks-per-node 2   # two emulated "nodes" of 2 ranks
    dtrain launch -n 4 lessons/02_allreduce.py --size-mib 16 --trace allreduce.json
    dtrain launch -n 2 lessons/02_allreduce.py --device gpu         # CuPy buffers, one GPU per rank
    dtrain launch -n 4 lessons/02_allreduce.py --cluster            # + ring against hierarchical on a cluster

What you will see, for one float32 buffer (1 MiB by default; each rank's values come from its own seed):

  1. a table, one row per algorithm:
     * ok: the result, on every rank, is identical to MPI's own MPI_Allreduce and to NumPy's sum of every rank's
       buffer (each rank can regenerate every other rank's input from its seed). The values are small integers
       stored as float32, so any order of additions gives the same bits and "identical" can be taken literally;
     * time: median over a few runs of the slowest rank's time (an all-reduce is done when the last rank is);
     * busbw: bus bandwidth, S / t * 2(p-1)/p (the nccl-tests definition): the bytes each rank's link must carry
       at the least, per second, comparable across p and with a link's bandwidth;
     * bytes sent by rank 0 counted by the tracer, against the exact formula in costmodel.bytes_sent, and whether
       the two agree on every rank; the cost model's predicted time;
  2. the bytes each rank sent, per algorithm: naive piles (p-1) n on rank 0, the ring spreads 2(p-1)/p n evenly;
  3. "On one machine, messages are copies": between two ranks of one machine MPI copies every message twice (into
     shared memory, out again), so the ring's 2(p-1)/p n bytes sent are 4(p-1)/p n copied; the shared-memory
     all-reduce (collectives/shm.py) copies 2(p-1)/p n on a buffer that lives in a shared window (zero copy), or
     2(n - c_r) more when it must copy the buffer in and out (copy-in; c_r: rank r's chunk). The tracer's counts on
     every rank beside the formulas; then ring, shm (zero copy), shm (copy-in) timed against MPI's Allreduce at 1 and
     16 MiB (best of --repeats alternating runs), and why shm needs two fences. With one rank there is nothing to
     copy: the counts come from 4 simulated ranks and the timing is skipped (threads of one process: no MPI to
     compare with). Ranks on several nodes: the part runs on rank 0's node;
  4. with --cluster (as root): "Ring against hierarchical across a 100 Mbit/s link". The lesson makes a cluster on
     this machine (dtrain cluster: 2 nodes that are network namespaces, 2 ranks each, each node's link shaped to
     --link), trains ddp's 784-512-512-10 MLP (batch 256) across it with --allreduce ring and hierarchical, and
     prints each one's measured step (metrics.json's training time) beside the cost model's: the ring sends
     2(p-1)/p n across the link each way, hierarchical 2(m-1)/m n (m nodes), 1.5x fewer bytes where it counts.
     Then it takes the cluster down (without root: it says why and goes on);
  5. last lines `all algorithms agree with MPI_Allreduce: yes` and the part's verdicts (the exit status is non-zero
     if any says NO); --json PATH writes every number and verdict to a file.

`--device gpu` runs the same on GPUs (one per rank, rank % GPUs): each rank's buffer is a CuPy array, all-reduced
through StagedComm (pinned host memory when MPI is not CUDA-aware; the times then include the copies). The oracles,
NumPy's sum and MPI_Allreduce of the host copy, stay on the CPU.

Things to try:
  * -n 3 or -n 6: doubling and rabenseifner fold the extra ranks in first (see doubling.py), and their bytes per
    rank become uneven; the ring's chunks get uneven too, and the formulas still match to the byte;
  * --ranks-per-node 2 (or 3 with -n 5): hierarchical does a tree inside each emulated node and a ring between the
    node leaders; hierarchical_rs needs equal nodes and is skipped otherwise;
  * --size-mib 0.001 against --size-mib 16: which algorithm wins when, and which one "auto" picks;
  * --shm-mib 0.004,0.06,1,64: shm's two fences cost the same at any size, and with many ranks on few cores
    they dominate a small buffer; which of zero copy and copy-in gains more as the buffer grows?
  * --cluster --link 1gbit (or 10mbit): how does the gain of hierarchical change with the link's speed?
  * --trace trace.json, then open https://ui.perfetto.dev and drag the file in: one row per rank, each all-reduce
    as a span with every Send/Recv inside it, and its peer and bytes in the details.

Exercises (write the algorithms yourself; `dtrain exercises init ex` once copies
the stubs into ex/), each graded by the command under it:
  2.1  ring all-reduce, ring_allreduce(comm, buf) in ex/ring.py:
       dtrain exercises check 2.1 --path ex
  2.2  binomial-tree broadcast, tree_broadcast(comm, buf, root) in ex/tree.py:
       dtrain exercises check 2.2 --path ex
  2.3  binomial-tree reduce, tree_reduce(comm, buf, root) in ex/tree.py:
       dtrain exercises check 2.3 --path ex
  2.4  recursive doubling with the fold for any p, in ex/doubling.py:
       dtrain exercises check 2.4 --path ex
  2.5  hierarchical all-reduce, hierarchical_allreduce(topology, buf):
       dtrain exercises check 2.5 --path ex
  2.6  shared-memory all-reduce, shm_allreduce(comm, buf) in ex/shm.py:
       dtrain exercises check 2.6 --path ex
Each check runs on simulated ranks, then under mpiexec -n 2, 3, 4, and counts
who sent what to whom. A ring that passes trains the MLP, with
--allreduce ex/ring.py:ring_allreduce added to
    dtrain launch -n 4 -m dtrain train --paradigm ddp
"""

import argparse
import contextlib
import functools
import json
import statistics

import cluster_util
import numpy as np
from cluster_util import add_cluster_flags, cluster_part, link_problem, rate_words
from lesson_util import (
    add_device_flag,
    everywhere,
    lesson_xp,
    parse_and_start,
    refuse_bad_arguments,
    sleeping_barrier,
    slowest_seconds,
)
from lesson_util import say as lesson_say

from dtrain import terminal
from dtrain.backend import to_host
from dtrain.collectives import ALGORITHMS, allreduce, chunk_bounds, costmodel, hierarchical, shm
from dtrain.comm import sim
from dtrain.comm.names import COMM_TYPE_SHARED, UNDEFINED
from dtrain.comm.staging import StagedComm
from dtrain.comm.trace import TracedComm, Tracer, write_chrome_trace
from dtrain.layout import parameter_count

parser = argparse.ArgumentParser(description="Lesson 2: every all-reduce algorithm on MPI ranks")
parser.add_argument("--size-mib", type=float, default=1.0, help="buffer size in MiB (default %(default)s)")
parser.add_argument("--repeats", type=int, default=10, help="timed runs per algorithm (default %(default)s)")
parser.add_argument(
    "--ranks-per-node",
    type=int,
    default=None,
    metavar="K",
    help="emulate nodes of K ranks for the hierarchical algorithms (default: the real nodes)",
)
parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated (default: all)")
parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of one all-reduce per algorithm")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--shm-mib",
    default="1,16",
    metavar="SIZES",
    help="buffer sizes in MiB at which ring and shm are timed against MPI (default %(default)s)",
)
parser.add_argument("--json", metavar="PATH", help="write every measurement and verdict to this file")
add_device_flag(parser)
add_cluster_flags(parser, "the part 'ring against hierarchical across a slow link'")

args, comm, p, rank = parse_and_start(parser)  # MPI starts here, after argparse: --help works without it
xp = lesson_xp(args, comm)  # numpy, or cupy on this rank's GPU (--device gpu)
from mpi4py import MPI  # for MPI.SUM (MPI has started by now)

K = args.ranks_per_node
algorithms = args.algorithms.split(",")
unknown = [a for a in algorithms if a not in ALGORITHMS]


def sizes_mib(text):
    """--shm-mib's sizes, or () if it is not a list of positive numbers."""
    try:
        sizes = tuple(float(size) for size in text.split(","))
    except ValueError:
        return ()
    return sizes if all(size > 0 for size in sizes) else ()


shm_sizes = sizes_mib(args.shm_mib)
refuse_bad_arguments([(
    unknown or args.size_mib <= 0 or args.repeats < 1 or (K is not None and K < 1),
    f"unknown algorithm(s) {unknown} (choose from {', '.join(ALGORITHMS)}), or --size-mib <= 0, --repeats < 1 or "
    "--ranks-per-node < 1",
), (not shm_sizes, f"--shm-mib must be sizes in MiB > 0, comma-separated (got {args.shm_mib!r})"),
    link_problem(args)])  # fmt: skip

count = max(1, int(args.size_mib * 2**20) // 4)
nbytes = 4 * count


def rank_input(r):
    """Rank r's buffer: small integers as float32, from rank r's own seed (so every rank can rebuild any rank's)."""
    return np.random.default_rng(args.seed + r).integers(-100, 101, size=count).astype(np.float32)


src = rank_input(rank)
# The oracles. NumPy: add every rank's input in float64 (exact for these integers). MPI: its own all-reduce.
expected = sum(rank_input(r).astype(np.float64) for r in range(p)).astype(np.float32)
mpi_result = np.empty_like(src)
comm.Allreduce(src, mpi_result, op=MPI.SUM)
mpi_agrees_with_numpy = bool(np.array_equal(mpi_result, expected))

# The algorithms run on alg_comm: the world itself, or with --device gpu the world wrapped in StagedComm, which hands
# GPU buffers to MPI (through pinned host memory when MPI cannot read GPU memory: dtrain/comm/staging.py).
alg_comm = StagedComm(comm) if args.device == "gpu" else comm
mine = xp.asarray(src)  # this rank's input where the algorithms run (the host array itself on the CPU)
tracer = Tracer()
tcomm = TracedComm(alg_comm, tracer)  # one traced communicator for the whole run
# The hierarchical algorithms run on nodes: split the communicator once (a collective call, slower than a small
# all-reduce) and hand the topology to every call; the other algorithms ignore it. The traced communicator gets its
# own, whose sub-communicators are traced too.
nodes = hierarchical.topology(alg_comm, K)
traced_nodes = hierarchical.topology(tcomm, K)
buf = xp.empty_like(mine)
trace_events = []  # this rank's events, one traced all-reduce per algorithm
rows = []


def correct() -> bool:
    result = to_host(buf)  # (copied from the GPU with --device gpu)
    return bool(np.array_equal(result, mpi_result) and np.array_equal(result, expected))


def finished() -> None:
    """With --device gpu, wait for the GPU's queued work (its kernels run asynchronously): an all-reduce is over
    when its result is."""
    if args.device == "gpu":
        xp.cuda.get_current_stream().synchronize()


def timed_allreduce(alg: str) -> None:
    """One all-reduce of ``buf`` by ``alg``, finished (with --device gpu, the GPU's work too): what is timed."""
    allreduce(alg_comm, buf, algorithm=alg, topology=nodes)
    finished()


say = functools.partial(lesson_say, indent="", hanging=" ")  # lesson_util's, flush left like this lesson's tables


say(f"Lesson 2: all-reduce of {nbytes:,} bytes ({count:,} float32) on {p} rank(s), median of {args.repeats} run(s),"
    " time = slowest rank")  # fmt: skip
if args.device == "gpu":
    staged = "handed to MPI as they are" if alg_comm.cuda_aware else "staged through pinned host memory"
    say(f"--device gpu: each rank's buffer is a CuPy array, {staged} ({alg_comm.cuda_aware_reason}); the times"
        " include the staging (the cost model's do not); every result is checked against MPI_Allreduce of the host"
        " copy")  # fmt: skip
# The cost model numbers the ranks of K-rank nodes node * K + local rank. On real nodes of equal size a rank is priced
# at that place, wherever mpiexec put it (a hostfile fills each machine in turn; --oversubscribe deals ranks round).
real, place = list(nodes.node_sizes), rank
if K is None:
    say(f"hierarchical: the real nodes, as MPI reports them (Split_type): sizes {real}"
        + ("; try --ranks-per-node K to emulate nodes" if len(real) == 1 else ""))  # fmt: skip
    if nodes.equal and len(real) > 1:
        K, place = real[0], nodes.cross.Get_rank() * real[0] + nodes.node.Get_rank()
else:
    say(f"hierarchical: emulated nodes of {K} ranks, sizes {list(hierarchical.node_sizes(p, K))}")

for alg in algorithms:
    if alg == "hierarchical_rs" and K is not None and p % K:
        rows.append({"algorithm": alg, "skipped": f"needs equal nodes, {p} ranks in nodes of {K} are not"})
        continue
    name = costmodel.choose(nbytes, p) if alg == "auto" else alg  # what actually runs

    # 1. warm up (Numba compilation, MPI connections) and check the result
    buf[...] = mine
    allreduce(alg_comm, buf, algorithm=alg, topology=nodes)
    ok = correct()

    # 2. time it: the slowest rank's time of each run, then the median over runs
    times = []
    for _ in range(args.repeats):
        buf[...] = mine
        finished()
        times.append(slowest_seconds(comm, timed_allreduce, alg))
        ok = ok and correct()

    # 3. count what this rank sends, with the tracer (one untimed warm-up first, so only the all-reduce is counted)
    buf[...] = mine
    allreduce(tcomm, buf, algorithm=alg, topology=traced_nodes)
    tracer.reset()
    buf[...] = mine
    label = "allreduce/auto" if alg == "auto" else f"allreduce/{name}"
    span = tracer.operation(label, nbytes=nbytes) if alg == "auto" else contextlib.nullcontext()
    with span:  # auto's own span, so its row in the trace says "auto" around the algorithm it picked
        allreduce(tcomm, buf, algorithm=alg, topology=traced_nodes)
    ok = ok and correct()
    sent = tracer.summary()["operations"][label]["bytes_sent"]
    formula = costmodel.bytes_sent(name, count, 4, p, place if name.startswith("hierarchical") else rank, K)
    trace_events += tracer.events

    sent_by_rank = comm.gather((sent, formula), root=0)
    ok = everywhere(ok, comm)
    if rank == 0:
        t = statistics.median(times)
        rows.append(
            {
                "algorithm": alg,
                "name": name,
                "ok": ok,
                "time_s": t,
                "busbw_GBps": nbytes / t * 2 * (p - 1) / p / 1e9,
                "model_s": costmodel.predict_time(name, nbytes, p, ranks_per_node=K),
                "sent": [s for s, _ in sent_by_rank],
                "formula": [f for _, f in sent_by_rank],
            }
        )

nodes.free()  # collective, like the split
traced_nodes.free()

# ------------------------------------------------------------------------------ on one machine, messages are copies
# Shared memory is one node's: the part runs on the world when every rank shares one node, else on rank 0's node (the
# other ranks wait, asleep); where that is one rank, on simulated ranks (one rank has nothing to copy).
SIMULATED = 4  # ranks
COPIERS = (("ring", "ring", False), ("shm, zero copy", "shm", True), ("shm, copy-in", "shm", False))


def part_buffers(q, r, n):
    """Rank r's n float32 in this part (small integers: base + r) and their exact sum over q ranks."""
    base = (np.arange(n) % 13 - 6).astype(np.float32)
    return base + r, q * base + q * (q - 1) // 2


def count_copies(part):
    """One traced all-reduce of the lesson's buffer (``count`` float32) by the ring, by shm on a buffer in a shared
    window (zero copy) and by shm on a plain one (copy-in), on ``part``'s ranks, real or simulated: this rank's
    bytes sent and copied, the formula's bytes, and whether the result is the exact sum."""
    q, r = part.Get_size(), part.Get_rank()
    tracer = Tracer()
    traced = TracedComm(part, tracer)
    mine, total = part_buffers(q, r, count)
    in_window, plain = shm.buffer(traced, count, np.float32), np.empty(count, np.float32)
    lo, hi = chunk_bounds(count, q)[r]
    c = 4 * (hi - lo)  # c_r: my chunk, in bytes
    formulas = {
        "ring": costmodel.bytes_sent("ring", count, 4, q, r),  # 2(p-1)/p n, exactly for uneven chunks
        "shm, zero copy": 2 * (q - 1) * c,  # load (p-1) chunks c_r to sum, store the sum into p-1 buffers
        "shm, copy-in": 2 * (q - 1) * c + 2 * (nbytes - c),  # + every chunk but mine into the window, and out
    }
    counted = {}
    for name, algorithm, zero_copy in COPIERS:
        buf = in_window if zero_copy else plain
        for _ in range(2):  # the first call warms up (copy-in allocates its scratch window there): not counted
            buf[...] = mine
            tracer.reset()
            allreduce(traced, buf, algorithm=algorithm)
        counts = tracer.summary()["operations"][f"allreduce/{algorithm}"]
        measured = counts["bytes_sent"] if algorithm == "ring" else counts["bytes_copied"]
        counted[name] = {"bytes_sent": counts["bytes_sent"], "bytes_copied": counts["bytes_copied"],
                         "copies": counts["copies"], "measured": measured, "formula": formulas[name],
                         "exact": bool(np.array_equal(buf, total))}  # fmt: skip
    shm.release(traced)
    return counted


def allreduce_once(part, buf, algorithm) -> None:
    allreduce(part, buf, algorithm=algorithm)  # (returns nothing: slowest_seconds would read a returned value)


def time_against_mpi(part, mib):
    """ring, shm (zero copy), shm (copy-in) and MPI's Allreduce on ``mib`` MiB: each one's best time (the slowest
    rank's) over --repeats rounds, every round all four in turn, each round starting one further on."""
    q, r = part.Get_size(), part.Get_rank()
    n = max(q, int(mib * 2**20) // 4)
    mine, total = part_buffers(q, r, n)
    plain, in_window = np.empty(n, np.float32), shm.buffer(part, n, np.float32)
    contenders = [("MPI's Allreduce", "mpi", plain)] + [(name, alg, in_window if zero else plain)
                                                        for name, alg, zero in COPIERS]  # fmt: skip
    best, exact = {}, True
    for round_ in range(args.repeats + 1):  # round 0 warms up (connections, the scratch window): not timed
        turn = round_ % len(contenders)
        for name, algorithm, buf in contenders[turn:] + contenders[:turn]:
            buf[...] = mine
            seconds = slowest_seconds(part, allreduce_once, part, buf, algorithm)
            exact = exact and np.array_equal(buf, total)
            if round_:
                best[name] = min(best.get(name, seconds), seconds)
    shm.release(part)
    best = {name: best[name] for name, _, _ in contenders}  # (MPI's first)
    return {"mib": mib, "bytes": 4 * n, "seconds": best, "exact": everywhere(exact, part)}


node = comm.Split_type(COMM_TYPE_SHARED, key=rank)
one_node, on_rank_0s = node.Get_size() == p, node.bcast(rank, root=0) == 0  # (key=rank: world rank 0 leads its node)
node.Free()
part = comm if one_node else comm.Split(0 if on_rank_0s else UNDEFINED, rank)
copies, timing, untimed = None, [], None  # (rank 0 gets every rank's copies; timing on every rank of the part)
if part:
    if part.Get_size() > 1:
        copies = part.gather(count_copies(part), root=0)
        timing = [time_against_mpi(part, mib) for mib in shm_sizes]
    else:  # one rank: nothing to copy between ranks; simulated ranks, threads of this process, count the copies
        copies = sim.run(SIMULATED, count_copies)
        untimed = (f"{SIMULATED} simulated ranks are threads of this one process, taking turns in one Python, and "
                   "there is no MPI whose Allreduce to compare them with")  # fmt: skip
    if part is not comm:
        part.Free()
sleeping_barrier(comm)  # (ranks outside rank 0's node wait here, asleep)

# --------------------------------------------------------------------------------------------------- report
if args.trace:
    everyone = comm.gather(trace_events, root=0)
    if rank == 0:
        write_chrome_trace(args.trace, everyone)

if rank == 0:
    ran = [r for r in rows if "skipped" not in r]
    mpi_time = next((r["time_s"] for r in ran if r["algorithm"] == "mpi"), None)
    # One row per algorithm: time, bandwidth and speed, then (a group of its own, which a narrow terminal prints as a
    # second table) the bytes rank 0 sent against the formula, and whether every rank's did.
    header = ["algorithm", "ok", "time ms", "busbw GB/s", "vs MPI", "model ms", "rank 0 sent", "formula",
              "all ranks"]  # fmt: skip
    cells = []
    for r in ran:
        title = r["algorithm"] if r["algorithm"] != "auto" else f"auto -> {r['name']}"
        cells.append([
            title, "yes" if r["ok"] else "NO", f"{1e3 * r['time_s']:.3f}",
            f"{r['busbw_GBps']:.2f}" if p > 1 else "-", terminal.speed(r["time_s"], mpi_time) if mpi_time else "-",
            f"{1e3 * r['model_s']:.3f}", f"{r['sent'][0]:,d}", f"{r['formula'][0]:,d}",
            "=" if r["sent"] == r["formula"] else "DIFFER",
        ])  # fmt: skip
    print()
    print(terminal.table(header, cells, wrap=(), groups=(6,)))
    for r in rows:
        if "skipped" in r:
            say(f"{r['algorithm']} skipped: {r['skipped']}")
    say("(all ranks: = where every rank sent what the formula, costmodel.bytes_sent, says)")

    print()
    say("Bytes sent by each rank, KiB (measured by the tracer; * where costmodel.bytes_sent says otherwise):")
    cells = [[r["name"] if r["algorithm"] != "auto" else "auto"]
             + [f"{s / 1024:.1f}" + (" " if s == f else "*") for s, f in zip(r["sent"], r["formula"])]
             for r in ran]  # fmt: skip
    print(terminal.table(["algorithm", *(f"rank {i}" for i in range(p))], cells))
    say(f"(the buffer is {nbytes / 1024:.1f} KiB; a bandwidth-optimal all-reduce sends 2(p-1)/p of it per rank,"
        f" {2 * (p - 1) / p * nbytes / 1024:.1f} KiB here. The mpi row is the logical volume, the buffer once:"
        " MPI's own messages are invisible to the tracer.)")  # fmt: skip
    m = costmodel.default_machine(p)  # the constants measured with p ranks busy: what auto chooses by
    say(f"model: alpha-beta-gamma, alpha = {m.alpha:.1e} s per message, beta = {m.beta:.1e} s per byte sent,"
        f" gamma = {m.gamma:.1e} s per byte reduced (scripts/calibrate.py measures them on this machine, with {p}"
        " ranks busy at once)")  # fmt: skip
    if args.trace:
        print()
        say(f"trace of one all-reduce per algorithm written to {args.trace}: open https://ui.perfetto.dev and drag"
            " the file in (one row per rank; click a Send/Recv to see its peer and bytes)")  # fmt: skip

    # ------------------------------------------------------------------------ on one machine, messages are copies
    q = len(copies)
    print("\nOn one machine, messages are copies")
    where = f"{q} simulated ranks" if untimed else f"the {q} ranks" if one_node else f"the {q} ranks of rank 0's node"
    say("Between two ranks of one machine a message is a memory copy, made twice: MPI copies it from the sender's"
        " buffer into shared memory, and the receiver copies it out. So the ring's 2(p-1)/p n bytes sent are"
        " 4(p-1)/p n bytes copied. shm (collectives/shm.py) keeps the buffers themselves in an MPI-3 shared window,"
        " which every rank maps: rank r sums chunk r straight out of everyone's buffer and stores the sum straight"
        " into everyone's, 2(p-1)/p n copied and nothing sent. A buffer that shm.buffer(comm, count, dtype) did not"
        " allocate in the window is copied in first and the result out: 2(n - c_r) more.")  # fmt: skip
    print()
    say(f"Bytes per rank for one all-reduce of n = {nbytes:,} bytes on {where}"
        + ("" if one_node else " (the ranks span several nodes, and shared memory is one node's)")
        + "; c_r: rank r's chunk, n/p give or take an element:")  # fmt: skip
    first = copies[0]
    copy_rows = [
        ["ring, sent", "2(p-1)/p n", first["ring"]["formula"], first["ring"]["measured"], "ring"],
        ["ring, copied by MPI", "2 x sent", 2 * first["ring"]["formula"], None, None],
        ["shm zero copy, copied", "2(p-1) c_r", first["shm, zero copy"]["formula"],
         first["shm, zero copy"]["measured"], "shm, zero copy"],
        ["shm copy-in, copied", "2(p-1) c_r + 2(n - c_r)", first["shm, copy-in"]["formula"],
         first["shm, copy-in"]["measured"], "shm, copy-in"],
    ]  # fmt: skip
    same = {name: all(mine[name]["measured"] == mine[name]["formula"] for mine in copies) for name, _, _ in COPIERS}
    print(terminal.table(["bytes per rank", "formula", "rank 0", "tracer", "all ranks"], [
        [what, formula, f"{value:,d}", "-" if measured is None else f"{measured:,d}",
         "-" if name is None else "=" if same[name] else "DIFFER"]
        for what, formula, value, measured, name in copy_rows], left=(0, 1)))  # fmt: skip
    ratio = 2 * first["ring"]["formula"] / first["shm, zero copy"]["formula"]  # (rank 0's chunk: >= 1 element)
    say(f"(all ranks: = where the tracer counted the formula's bytes on every rank. MPI's copies are out of the"
        f" tracer's sight: 2 x sent is its shared-memory path, into a shared cell and out; an MPI that moves a"
        f" large message with the kernel's help, CMA or XPMEM, copies it once.) Through MPI the ring copies"
        f" {ratio:.2f}x the bytes that shm copies in place; shm with copy-in copies as much as the ring,"
        f" 4(p-1)/p n, but waits for 2 fences where the ring waits for 2(p-1) = {2 * (q - 1)} messages.")  # fmt: skip
    print()
    if untimed:
        say(f"Timing skipped: {untimed}. Under mpiexec, say dtrain launch -n 4 lessons/02_allreduce.py, this part"
            " times ring and shm against MPI's Allreduce.")  # fmt: skip
    else:
        say(f"The time of one all-reduce on {where} (the slowest rank's), best of {args.repeats} rounds that take"
            " all four in turn:")  # fmt: skip
        cells = []
        for measured in timing:
            mpi_seconds = measured["seconds"]["MPI's Allreduce"]
            for i, (name, seconds) in enumerate(measured["seconds"].items()):
                size = f"{measured['mib']:g} MiB" if not i else ""
                versus = "(the baseline)" if name == "MPI's Allreduce" else terminal.speed(seconds, mpi_seconds)
                cells.append([size, name, f"{1e3 * seconds:.3f}", versus])
        print(terminal.table(["size", "algorithm", "ms", "vs MPI's Allreduce"], cells, left=(0, 1)))
    print()
    say("Why two fences. A store into shared memory is not a message: nothing tells the other ranks that it"
        " happened. Fence 1 comes after every rank has written its buffer and before anyone loads a peer's chunk;"
        " fence 2 after every sum is stored and before anyone returns, so that nobody reads a chunk not yet summed"
        " or overwrites its buffer (the next step's gradients) while a peer still loads from it. A fence is"
        " Win.Sync, Barrier, Win.Sync: the barrier orders the ranks; Win.Sync, a memory barrier, makes this rank's"
        " stores visible before it and the others' after it. Without it a weakly ordered CPU (ARM, POWER) lets a"
        " rank pass the barrier and still load a stale value. dtrain's shm meets in the window itself: each rank"
        " stores its fence's number into a counter and waits until every counter has it, because MPI's Barrier"
        " yields the core and takes 470 us when 4 ranks share 2 cores (counters: 7 us). Write it yourself:"
        " exercise 2.6, below.")  # fmt: skip


# ------------------------------------------------------------------ ring against hierarchical across a slow link
CLUSTER_SIZES = [784, 512, 512, 10]  # ddp's 784-512-512-10 MLP, global batch 256: a gradient of 2,678,824 bytes
CLUSTER_STEPS = 5  # steps an epoch (2 epochs: epoch 2 is timed)
CLUSTER_RUN = {"paradigm": "ddp", "dataset": "synthetic", "features": 784, "classes": 10, "hidden": (512, 512),
               "batch_size": 256, "samples": CLUSTER_STEPS * 256 * 5 // 4, "lr": 0.05, "momentum": 0.0}  # fmt: skip


def across_a_slow_link(cluster):
    """ddp with the ring and with the hierarchical all-reduce, trained across the cluster's link: each one's step
    beside the cost model's, and why the one is faster (rank 0, while the lesson's other ranks sleep)."""
    runs = {algorithm: {**CLUSTER_RUN, "allreduce": algorithm} for algorithm in ("ring", "hierarchical")}
    measured = cluster_util.steps(cluster, runs, CLUSTER_SIZES, CLUSTER_STEPS, "ring", indent="")
    ranks, m = cluster.nodes * cluster.slots, cluster.nodes
    n = 4 * parameter_count(CLUSTER_SIZES)
    ring, hier = measured["ring"], measured["hierarchical"]
    path = " -> ".join(map(str, [*range(ranks), 0]))
    say(f"(ddp, MLP {'-'.join(map(str, CLUSTER_SIZES))}, global batch 256, synthetic data; step ms: epoch 2's"
        f" training time over its {CLUSTER_STEPS} steps, from metrics.json; model ms: DataParallel.step_time with"
        " this machine's calibrated compute, shared by all the cluster's ranks, plus the all-reduce priced at the"
        " link's rate and measured latency)")  # fmt: skip
    say(f"The gradient is n = {n:,} bytes. Ranks fill the nodes in order, so the ring {path} crosses the link once"
        f" each way, and that hop carries what every hop carries, 2(p-1)/p n = {2 * (ranks - 1) / ranks * n / 1e6:.2f}"
        " MB a step: every step of the ring waits for it. Hierarchical sums inside each node first (shared memory,"
        f" next to free), and only the {m} node leaders cross, 2(m-1)/m n = {2 * (m - 1) / m * n / 1e6:.2f} MB each"
        f" way: {(ranks - 1) / ranks * m / (m - 1):.2f}x fewer bytes on the link. Measured, hierarchical is"
        f" {terminal.speed(hier['step_s'], ring['step_s'], 'the ring')}; the model says"
        f" {terminal.speed(hier['model_step_s'], ring['model_step_s'], 'the ring')}.")  # fmt: skip
    return measured


if rank == 0:
    print(f"\nRing against hierarchical across a {rate_words(args.link)} link (a cluster on this machine)")
cluster_measured = cluster_part(args, comm, "2", across_a_slow_link, indent="")

if rank == 0:
    print("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
    results_ok = mpi_agrees_with_numpy and all(r["ok"] for r in ran)
    bytes_ok = all(r["sent"] == r["formula"] for r in ran)
    shm_exact = all(mine[name]["exact"] for mine in copies for name in mine) and all(t["exact"] for t in timing)
    copies_ok = all(same.values())
    print(f"\nMPI_Allreduce agrees with NumPy's sum: {'yes' if mpi_agrees_with_numpy else 'NO'}")
    print(f"bytes sent match costmodel.bytes_sent on every rank: {'yes' if bytes_ok else 'NO'}")
    print(f"ring and shm on one machine give the exact sum: {'yes' if shm_exact else 'NO'}")
    print(f"bytes copied match the formulas on every rank: {'yes' if copies_ok else 'NO'}")
    print(f"all algorithms agree with MPI_Allreduce: {'yes' if results_ok else 'NO'}", flush=True)
    failed = not (results_ok and bytes_ok and shm_exact and copies_ok)
    if args.json:
        checks = {"all algorithms agree with MPI_Allreduce": results_ok,
                  "bytes sent match costmodel.bytes_sent on every rank": bytes_ok,
                  "ring and shm on one machine give the exact sum": shm_exact,
                  "bytes copied match the formulas on every rank": copies_ok}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"world": p, "bytes": nbytes, "algorithms": rows,
                       "copies": {"ranks": q, "simulated": bool(untimed), "one_node": one_node, "per_rank": copies},
                       "timing": timing, "untimed": untimed, "cluster": cluster_measured, "checks": checks}, f,
                      indent=1)  # fmt: skip
        print(f"\nmeasurements written to\n  {args.json}")
else:
    failed = False
if comm.bcast(failed, root=0):
    raise SystemExit(1)  # on every rank, so mpiexec's exit status says so

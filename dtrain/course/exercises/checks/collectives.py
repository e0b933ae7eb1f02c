"""Checks of lesson 2's collectives: the learner's function against the sum over ranks, and the algorithm's traffic.

Every rank starts from values of its own that are small integers (exact in float32 and float64), so the sum over the
ranks is exact whatever order an algorithm adds in, and a result either is the sum or is wrong. The traffic is held
against closed forms written here (a binomial tree's edges, recursive doubling's partners), not against dtrain's own
implementations: the check wraps the communicator in a :class:`Recorder` that notes where every message went, so a
failure can say who sent to whom. Exercise 2.6 (shared memory: no messages, two fences) is graded in
:mod:`.shared_memory`, whose simulated window shows a rank another's stores only after a fence.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dtrain.collectives import hierarchical
from dtrain.course.exercises.checks.ring_diagnosis import ring_went_wrong
from dtrain.course.exercises.checks.traffic import Recorder, messages, tree_traffic
from dtrain.course.exercises.grading import MPI, RINGS, Exercise, plural, rank_values, ring_steps

HERE = __name__  # (each exercise's check is a function of this module)

EXERCISES = (
    Exercise("2.1", "ring all-reduce", "ring.py", "ring_allreduce", ("comm", "buf"),
             "dtrain.collectives.ring:allreduce", f"{HERE}:ring_allreduce", RINGS, MPI,
             "a reduce-scatter (p - 1 steps: send a chunk to the right, add the chunk from the left into yours) "
             "then an all-gather (p - 1 steps: pass the finished chunks on); lessons/02_allreduce.py draws it"),
    Exercise("2.2", "binomial-tree broadcast", "tree.py", "tree_broadcast", ("comm", "buf", "root"),
             "dtrain.collectives.tree:broadcast", f"{HERE}:tree_broadcast", RINGS, MPI,
             "v = (rank - root) % p; receive from v - lowbit(v) (the root receives nothing), then send to v + m for "
             "m = lowbit(v) / 2, lowbit(v) / 4, ..., 1 (the root: every power of two below p) while v + m < p; add "
             "root back (mod p) to every partner"),
    Exercise("2.3", "binomial-tree reduce", "tree.py", "tree_reduce", ("comm", "buf", "root"),
             "dtrain.collectives.tree:reduce", f"{HERE}:tree_reduce", RINGS, MPI,
             "v = (rank - root) % p; for mask = 1, 2, 4, ...: if v & mask, send buf to v - mask and stop; else if "
             "v + mask < p, receive from v + mask and add; partners are (v -/+ mask + root) % p"),
    Exercise("2.4", "recursive-doubling all-reduce", "doubling.py", "doubling_allreduce", ("comm", "buf"),
             "dtrain.collectives.doubling:allreduce", f"{HERE}:doubling_allreduce",
             (1, 2, 3, 4, 5, 6, 7, 8), MPI,
             "p' = the largest power of two <= p, r = p - p'; ranks < 2r fold (odd sends to even - 1, which adds); "
             "the p' left exchange whole buffers with v XOR 1, 2, 4, ...; then each even rank < 2r sends back"),
    Exercise("2.5", "hierarchical all-reduce", "hierarchical.py", "hierarchical_allreduce", ("topology", "buf"),
             "dtrain.collectives.hierarchical:allreduce", f"{HERE}:hierarchical_allreduce",
             (1, 2, 3, 4, 5, 6, 8), MPI,
             "tree.reduce(topology.node, buf, 0); if topology.leaders is not None: ring.allreduce(topology.leaders, "
             "buf); tree.broadcast(topology.node, buf, 0)  (from dtrain.collectives import ring, tree)"),
    Exercise("2.6", "shared-memory all-reduce", "shm.py", "shm_allreduce", ("comm", "buf"),
             "dtrain.collectives.shm:allreduce", "dtrain.course.exercises.checks.shared_memory:shm_allreduce",
             RINGS, MPI,
             "win = windows.allocate(comm, buf.nbytes); copy buf into win.view(r, buf.dtype, 0, n); win.fence(); sum "
             "chunk_bounds(n, p)[r] of every rank's segment; store the sum into that chunk of every segment; "
             "win.fence(); copy your segment back into buf; win.free()"),
)  # fmt: skip
DTYPES = (np.float64, np.float32)


def sizes(p: int) -> tuple[int, ...]:
    """Buffer lengths: fewer elements than ranks, one per rank minus one, exactly p, uneven chunks, a large one."""
    return tuple(dict.fromkeys((1, max(p - 1, 1), p, 7 * p + 3, 1000)))


def elements(n: int, dtype) -> str:
    """``"1 float64 element"``, ``"5 float32 elements"``."""
    return f"{n} {np.dtype(dtype).name} element{'' if n == 1 else 's'}"


UNTOUCHED = "still holds this rank's own values"


def untouched(comm, grade, buf, before, expected, returned=None, what: str = "buf", everywhere: bool = True) -> None:
    """Every rank calls it after the call (``everywhere``: an object all-gather). A note for a failing case, only
    when it is the diagnosis: the function returned the result as a new array and left ``buf`` as it was; or ``buf``
    holds what it held before the call on every rank (``everywhere``; else on this rank), so that the function wrote
    nothing into it. (One rank's ``buf`` may hold its own values again after a wrong algorithm put them back: on its
    own, that says nothing.)"""
    same = bool(np.array_equal(buf, before))
    everyone = comm.allgather(same) if everywhere else [same]
    if not grade.problems or not same:
        return
    place = f"{what} itself, in place (buf[a:b] += ..., comm.Recv(buf[a:b], ...))"
    if isinstance(returned, np.ndarray) and returned.shape == np.shape(expected) and np.allclose(returned, expected):
        grade.note(f"{what} {UNTOUCHED} and the function returned the result as a new array: the caller sees only "
                   f"{what}: write the result into {place}")  # fmt: skip
    elif all(everyone):
        grade.note(f"{what} {UNTOUCHED}{', on every rank' if everywhere else ''}: the function wrote nothing into it; "
                   f"the result must be written into {place}, not into a new array")  # fmt: skip


def summed(call, comm, grade, lengths, first: int = 1, about: str = "", cases: int | None = None):
    """One case per dtype and length (numbered from ``first``, of ``cases``): rank r's own values in ``buf``,
    ``call(buf)``, then ``buf`` must hold the sum over all ranks. Yields ``buf`` inside each case, for the caller's
    traffic comparisons."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    every = [(dtype, n) for dtype in DTYPES for n in lengths]
    cases = len(every) if cases is None else cases
    for number, (dtype, n) in enumerate(every, first):
        buf = rank_values(r, n, dtype)
        expected = sum(rank_values(q, n, dtype) for q in range(p))
        with grade.step(number, f"{ranks}{about}, {elements(n, dtype)}; rank r holds 100 r + 1, 100 r + 2, ...",
                        cases):  # fmt: skip
            returned = call(buf)
            grade.same(buf, expected, "buf after the call (the sum over all ranks)")
            untouched(comm, grade, buf, rank_values(r, n, dtype), expected, returned)
            yield buf


def ring_allreduce(fn, comm, grade) -> None:
    """``fn(comm, buf)`` leaves the sum over all ranks in every rank's ``buf``, sending 2(p - 1) messages per rank and
    2(p - 1) n elements over all ranks (each chunk once around the ring to be reduced, once to be shared). The
    function gets a :class:`~dtrain.course.exercises.grading.StepLog`: a failure names the ring's step it happened
    in."""
    p = comm.Get_size()
    log = grade.log(comm, ring_steps(p), keep=True)
    for buf in summed(lambda buf: fn(log, buf), comm, grade, sizes(p)):
        # (with empty chunks a ring may rightly skip their messages: then the count only explains a failure)
        grade.traffic(2 * (p - 1), 2 * (p - 1) * buf.nbytes, "a ring all-reduce", strict=buf.size >= p)
        everyone = comm.allgather(log.sent)  # (an object all-gather: uncounted)
        if grade.problems:
            # (when buf was left as it was, a note says so already: the end of the ring has nothing to add)
            said = ring_went_wrong(everyone, comm.Get_rank(), buf, not any(UNTOUCHED in n for n in grade.notes))
            if said:
                grade.note(said)


# --- who sent to whom -----------------------------------------------------------------------------------------------


def tree_calls(fn, comm, grade):
    """Call ``fn(comm, buf, root)`` for roots 0, p - 1 and p // 2 and a few buffers, each in a case of its own;
    yields ``(root, buf, every message of the case)`` inside the case, for the caller's comparisons."""
    p, r = comm.Get_size(), comm.Get_rank()
    ranks = plural(p, "rank")
    recorder = Recorder(comm)
    cases = [(root, dtype, n) for root in dict.fromkeys((0, p - 1, p // 2))
             for dtype, n in ((np.float64, 1), (np.float64, 1000), (np.float32, 7 * p + 3))]  # fmt: skip
    for number, (root, dtype, n) in enumerate(cases, 1):
        buf = rank_values(r, n, dtype)
        with grade.step(number, f"{ranks}, root {root}, {elements(n, dtype)}; rank r holds 100 r + 1, 100 r + 2, ...",
                        len(cases)):  # fmt: skip
            recorder.take()
            fn(recorder, buf, root)
            yield root, buf, messages(comm, recorder)


def tree_broadcast(fn, comm, grade) -> None:
    """``fn(comm, buf, root)`` leaves the root's values in every rank's ``buf``, along the binomial tree rooted at
    ``root``: every rank but the root receives one message, the whole buffer, from its parent (p - 1 in all)."""
    p, r = comm.Get_size(), comm.Get_rank()
    for root, buf, sent in tree_calls(fn, comm, grade):
        right = grade.same(buf, rank_values(root, buf.size, buf.dtype), f"buf after the call (the root's, rank "
                           f"{root}'s, values)")  # fmt: skip
        wrong = tree_traffic(sent, p, root, buf.nbytes, False, "a binomial-tree broadcast")
        if wrong:
            (grade.fail if right and r == root else grade.note)(wrong)


def tree_reduce(fn, comm, grade) -> None:
    """``fn(comm, buf, root)`` leaves the sum over all ranks in the root's ``buf`` (the others' are not checked),
    along the binomial tree rooted at ``root``: every rank but the root sends one message, the whole buffer, to its
    parent (p - 1 in all)."""
    p, r = comm.Get_size(), comm.Get_rank()
    for root, buf, sent in tree_calls(fn, comm, grade):
        if r != root:
            continue
        expected = sum(rank_values(q, buf.size, buf.dtype) for q in range(p))
        right = grade.same(buf, expected, f"the root's (rank {root}'s) buf after the call (the sum over all ranks)")
        wrong = tree_traffic(sent, p, root, buf.nbytes, True, "a binomial-tree reduce")
        if wrong:
            grade.fail(wrong)
        elif not right:  # (only the root's buf counts: the others may be used as scratch)
            untouched(comm, grade, buf, rank_values(r, buf.size, buf.dtype), expected, what="the root's buf",
                      everywhere=False)  # fmt: skip


def doubling_partners(p: int, rank: int) -> list[int]:
    """The ranks ``rank`` sends to, in order, in recursive doubling with the fold for a non-power-of-two p: p' the
    largest power of two <= p, r = p - p'; odd ranks < 2r send to the even one below and wait; the others, numbered
    0 .. p'-1, exchange with v XOR 1, 2, 4, ...; each even rank < 2r then sends the result to the odd one above."""
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    if rank < 2 * extra and rank % 2:
        return [rank - 1]
    v = rank // 2 if rank < 2 * extra else rank - extra
    real = [2 * u if u < extra else u + extra for u in range(p2)]
    partners = [real[v ^ d] for d in (1 << k for k in range(p2.bit_length() - 1))]
    return partners + ([rank + 1] if rank < 2 * extra else [])


def doubling_allreduce(fn, comm, grade) -> None:
    """``fn(comm, buf)`` leaves the sum over all ranks in every rank's ``buf``, by recursive doubling: for a power of
    two p, log2 p messages per rank of the whole buffer each; otherwise the fold adds one message on the first 2r
    ranks (an odd one sends once, an even one sends log2 p' + 1 times: costmodel.messages_sent("doubling", ...))."""
    p, r = comm.Get_size(), comm.Get_rank()
    recorder = Recorder(comm)
    partners = doubling_partners(p, r)
    for buf in summed(lambda buf: fn(recorder, buf), comm, grade, tuple(dict.fromkeys((1, p, 7 * p + 3, 1000)))):
        sent = recorder.take()
        dests = [dest for dest, _ in sent]
        if dests != partners:
            (grade.note if grade.problems else grade.fail)(f"rank {r} sent to ranks {dests}; recursive doubling sends "
                                                           f"to {partners}, in that order")  # fmt: skip
        elif any(nbytes != buf.nbytes for _, nbytes in sent):
            grade.fail(f"rank {r} sent messages of {[nb for _, nb in sent]} bytes; recursive doubling sends the whole "
                       f"buffer ({buf.nbytes} bytes) each time")  # fmt: skip
        if grade.problems and p & (p - 1):
            p2 = 1 << (p.bit_length() - 1)
            grade.note(f"p = {p} is not a power of two: the first {2 * (p - p2)} ranks fold first (odd rank q sends "
                       f"its buffer to q - 1, which adds it and stands in for both), the {p2} ranks left run recursive "
                       "doubling under new numbers, and the folded ranks get the result back at the end")  # fmt: skip


NODE_SIZES = (2, 3)  # ranks per emulated node in the hierarchical all-reduce's cases
NODE_LENGTHS = (1, 10, 1000)


def hierarchical_allreduce(fn, comm, grade) -> None:
    """``fn(topology, buf)`` leaves the sum over all ranks in every rank's ``buf`` (nodes of k = 2 and 3 ranks,
    emulated, the last one possibly smaller), and the traffic per level is the algorithm's: across nodes only the m
    leaders send, 2 (m - 1) n elements in all (a ring among them); inside a node of s ranks 2 (s - 1) n elements (a
    tree reduce, then a tree broadcast). Every message is placed by the world ranks of its two ends."""
    first = 1
    for k in NODE_SIZES:
        first = in_nodes(fn, comm, grade, k, first)


def world_rank(level: str, dest: int, rank: int, k: int) -> int:
    """The world rank of ``dest``, a rank of this rank's communicator ``level`` (nodes of k consecutive ranks)."""
    node, local = divmod(rank, k)
    return {"comm": dest, "node": node * k + dest, "leaders": dest * k, "cross": dest * k + local}[level]


def in_nodes(fn, comm, grade, k: int, first: int) -> int:
    """The cases of :func:`hierarchical_allreduce` with nodes of k ranks, numbered from ``first``; returns the next
    case's number."""
    p, r = comm.Get_size(), comm.Get_rank()
    topo = hierarchical.topology(comm, ranks_per_node=k)
    node = r // k
    subs = {"comm": comm, "node": topo.node, "leaders": topo.leaders, "cross": topo.cross}
    recorders = {level: Recorder(sub) for level, sub in subs.items() if sub is not None}
    theirs = dataclasses.replace(topo, **{**recorders, "leaders": recorders.get("leaders")})
    lengths = NODE_LENGTHS
    about = f" in {-(-p // k)} node(s) of {k} (node = rank // {k}; leaders: local rank 0)"
    cases = len(NODE_SIZES) * len(DTYPES) * len(lengths)
    for buf in summed(lambda buf: fn(theirs, buf), comm, grade, lengths, first, about, cases):
        sent = [
            (world_rank(level, dest, r, k), nbytes) for level, rec in recorders.items() for dest, nbytes in rec.take()
        ]
        inter = sum(nbytes for dest, nbytes in sent if dest // k != node)
        everyone = comm.allgather((inter, sum(nbytes for _, nbytes in sent) - inter))
        if r == 0:
            level_traffic(grade, everyone, k, buf.nbytes)
    topo.free()
    return first + len(DTYPES) * len(lengths)


def level_traffic(grade, everyone, k: int, n: int) -> None:
    """The bytes each rank sent to other nodes and within its node (``everyone[rank]``), against the hierarchical
    all-reduce's: between nodes only from the m leaders, 2 (m - 1) n in all; within a node of s ranks 2 (s - 1) n."""
    p = len(everyone)
    nodes = -(-p // k)
    crossing = [q for q in range(p) if q % k and everyone[q][0]]
    between = sum(inter for inter, _ in everyone)
    if crossing:
        grade.fail(f"ranks {crossing} sent bytes to other nodes ({[everyone[q][0] for q in crossing]}) but are not "
                   "leaders: only the leaders (local rank 0) may use the links between nodes")  # fmt: skip
    elif between != 2 * (nodes - 1) * n:
        grade.fail(f"the leaders sent {between} bytes between nodes; a ring all-reduce among the {nodes} leaders sends "
                   f"2 (m - 1) n = {2 * (nodes - 1) * n}")  # fmt: skip
    for node in range(nodes):
        members = range(node * k, min(p, node * k + k))
        within, size = sum(everyone[q][1] for q in members), len(members)
        if within != 2 * (size - 1) * n:
            grade.fail(f"the {size} ranks of node {node} sent {within} bytes to each other; a tree reduce to the "
                       f"leader and a tree broadcast from it send 2 (s - 1) n = {2 * (size - 1) * n}")  # fmt: skip
            break

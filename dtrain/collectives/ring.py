"""Ring all-reduce: a reduce-scatter and then an all-gather, each p - 1 steps around a ring of ranks.

Every rank talks only to its two neighbours, sends to the right and receives from the left::

          +---------> rank 1 ---------+
          |                           v
        rank 0                      rank 2          right = (r + 1) % p,  left = (r - 1) % p
          ^                           |
          +---------- rank 3 <--------+

The buffer is cut into p chunks (``chunk_bounds``: the first n % p chunks are one element longer).

**Reduce-scatter.** At step s (0 .. p-2) rank r sends chunk (r - s - 1) % p to the right, receives chunk
(r - s - 2) % p from the left and adds it into its own copy of that chunk. The chunk a rank sends at step s + 1 is the
one it has just reduced, so each chunk travels once around the ring collecting every rank's contribution, and ends
fully reduced at the rank with its number: **after the reduce-scatter rank r owns chunk r** (the input ``allgather``
expects, and the shard ``reduce_scatter`` returns)::

    p = 4        rank 0     rank 1     rank 2     rank 3
    step 0       sends c3   sends c0   sends c1   sends c2     (each adds what it receives from the left)
    step 1       sends c2   sends c3   sends c0   sends c1
    step 2       sends c1   sends c2   sends c3   sends c0
    now owns     c0         c1         c2         c3           (= the sum over all ranks)

**All-gather.** At step s rank r sends chunk (r - s) % p to the right and receives chunk (r - s - 1) % p from the left
straight into ``buf`` (no reduction, no scratch)::

    step 0       sends c0   sends c1   sends c2   sends c3
    step 1       sends c3   sends c0   sends c1   sends c2
    step 2       sends c2   sends c3   sends c0   sends c1     now everyone holds every reduced chunk

**Cost** (n bytes, p ranks; alpha latency per message, beta seconds per byte, gamma seconds per byte reduced):
``2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma``. The bandwidth term does not grow with p: that is why the ring
is the all-reduce of large gradients. Exact bytes sent by rank r (chunk sizes c_i in bytes): the reduce-scatter sends
every chunk but its own, the all-gather every chunk but chunk r + 1, so ``(n - c_r) + (n - c_{(r+1) % p})``.

**How it is written.** Each step is one exchange (``dtrain.comm.sendrecv``: receive from the left while sending
to the right) and one reduction into ``buf``, through one scratch buffer as long as the longest chunk; the last step
of an "avg" divides while it adds (``sum_scale_``). Why this way and not with overlapped segments: docs/benchmarks.md.
"""

from __future__ import annotations

from dtrain import kernels
from dtrain.collectives._chunks import bounds_for, scratch
from dtrain.comm import sendrecv


def reduce_scatter(comm, buf, op="sum"):
    """Reduce ``buf`` across ranks so that rank r ends owning chunk r; return that chunk as a view of ``buf``.

    The rest of ``buf`` holds partial sums afterwards. With op "avg" the owned chunk is divided by p.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    cut = bounds_for(buf.size, p)
    mine = buf[cut[r][0] : cut[r][1]]
    if p == 1:
        return mine
    right, left = (r + 1) % p, (r - 1) % p
    work = scratch(buf, cut[0][1])  # chunk 0 is the longest
    for s in range(p - 1):
        (a, b), (c, d) = cut[(r - s - 1) % p], cut[(r - s - 2) % p]
        incoming, target = work[: d - c], buf[c:d]
        sendrecv(comm, buf[a:b], right, incoming, left)
        if s == p - 2 and op == "avg":  # last step: this chunk is final, so divide while adding
            kernels.sum_scale_(target, [target, incoming], 1.0 / p)
        else:
            kernels.reduce_(target, incoming, op)
    return mine


def allgather(comm, buf):
    """Rank r contributes chunk r of ``buf`` (``chunk_bounds``); afterwards every rank holds every chunk."""
    p, r = comm.Get_size(), comm.Get_rank()
    cut = bounds_for(buf.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        (a, b), (c, d) = cut[(r - s) % p], cut[(r - s - 1) % p]
        sendrecv(comm, buf[a:b], right, buf[c:d], left)
    return buf


def allreduce(comm, buf, op="sum"):
    """Ring all-reduce of ``buf`` in place (op "sum", "avg" or "max"): reduce-scatter, then all-gather."""
    reduce_scatter(comm, buf, op)
    return allgather(comm, buf)


def allreduce_steps(comm, buf, op="sum", tag=0, work=None):
    """The same ring all-reduce as a *non-blocking* collective: a generator that posts one step and yields.

    Each ``next()`` posts one step's ``Irecv`` (from the left) and ``Isend`` (to the right) and yields the two
    requests; the caller resumes it once both have completed (``Test`` or ``wait``), and it reduces what arrived and
    posts the next step. So the caller decides when the ring moves on: data-parallel training advances several of
    these between the layers of backward (see ``dtrain/parallel/data_parallel.py``), as MPI's ``MPI_Iallreduce``
    is progressed by the library. ``tag`` keeps the messages of several rings in flight on one communicator apart;
    ``work`` is a scratch array as long as chunk 0, of ``buf``'s dtype (each ring in flight needs its own). Same
    messages, same bytes and bit-identical results as :func:`allreduce`.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    cut = bounds_for(buf.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    work = scratch(buf, cut[0][1]) if work is None else work
    for s in range(p - 1):  # reduce-scatter
        (a, b), (c, d) = cut[(r - s - 1) % p], cut[(r - s - 2) % p]
        incoming, target = work[: d - c], buf[c:d]
        yield [comm.Irecv(incoming, source=left, tag=tag), comm.Isend(buf[a:b], dest=right, tag=tag)]
        if s == p - 2 and op == "avg":
            kernels.sum_scale_(target, [target, incoming], 1.0 / p)
        else:
            kernels.reduce_(target, incoming, op)
    for s in range(p - 1):  # all-gather
        (a, b), (c, d) = cut[(r - s) % p], cut[(r - s - 1) % p]
        yield [comm.Irecv(buf[c:d], source=left, tag=tag), comm.Isend(buf[a:b], dest=right, tag=tag)]

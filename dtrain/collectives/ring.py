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

**Making it fast.** A reduce-scatter step is communicate-then-reduce. Three things keep it close to the memory
bandwidth: one scratch buffer reused for every step and call (no allocation, no page faults); the incoming chunk is
split into segments of ~``SEGMENT_BYTES``, all posted at once with ``Irecv``, and each segment is reduced as soon as it
has arrived, while later segments are still moving and while it is still in cache; and the last step fuses the
reduction with the 1/p of an average (``sum_scale_``), so "avg" costs no extra pass over memory.
"""

from __future__ import annotations

from dtrain import kernels
from dtrain.collectives._chunks import chunk_bounds, scratch, segment_bounds
from dtrain.comm import waitall


def _send_reduce_step(comm, buf, send, recv, work, op, factor):
    """Send ``buf[send]`` to the right; receive ``recv``'s chunk from the left segment by segment and reduce it.

    ``factor`` (not None only on the last step of an average) makes the reduction ``(mine + theirs) * factor``.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    start = recv[0]
    segments = segment_bounds(*recv, buf.itemsize)
    recvs = [comm.Irecv(work[a - start : b - start], source=left) for a, b in segments]
    sends = [comm.Isend(buf[a:b], dest=right) for a, b in segment_bounds(*send, buf.itemsize)]
    for request, (a, b) in zip(recvs, segments):
        request.Wait()
        mine, theirs = buf[a:b], work[a - start : b - start]
        if factor is None:
            kernels.reduce_(mine, theirs, op)
        else:
            kernels.sum_scale_(mine, [mine, theirs], factor)
    waitall(sends)


def reduce_scatter(comm, buf, op="sum"):
    """Reduce ``buf`` across ranks so that rank r ends owning chunk r; return that chunk as a view of ``buf``.

    The rest of ``buf`` holds partial sums afterwards. With op "avg" the owned chunk is divided by p.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    bounds = chunk_bounds(buf.size, p)
    mine = buf[bounds[r][0] : bounds[r][1]]
    if p == 1:
        return kernels.scale_(mine, 1.0) if op == "avg" else mine
    work = scratch(buf, bounds[0][1] - bounds[0][0])  # chunk 0 is the longest
    for s in range(p - 1):
        last = s == p - 2
        factor = 1.0 / p if (last and op == "avg") else None
        _send_reduce_step(comm, buf, bounds[(r - s - 1) % p], bounds[(r - s - 2) % p], work, op, factor)
    return mine


def allgather(comm, buf):
    """Rank r contributes chunk r of ``buf`` (``chunk_bounds``); afterwards every rank holds every chunk."""
    p, r = comm.Get_size(), comm.Get_rank()
    bounds = chunk_bounds(buf.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        (a, b), (c, d) = bounds[(r - s) % p], bounds[(r - s - 1) % p]
        comm.Sendrecv(buf[a:b], dest=right, recvbuf=buf[c:d], source=left)
    return buf


def allreduce(comm, buf, op="sum"):
    """Ring all-reduce of ``buf`` in place (op "sum", "avg" or "max"): reduce-scatter, then all-gather."""
    reduce_scatter(comm, buf, op)
    return allgather(comm, buf)

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

**Making it fast.** Each step is one exchange (``dtrain.comm.sendrecv``: receive from the left while sending to
the right) followed by one reduction into ``buf``. Nothing is allocated per step or per call: one scratch buffer, as
long as the longest chunk, is reused (a fresh large array would cost page faults on every call), and the last step
fuses the 1/p of an average into its reduction (``sum_scale_``), so "avg" costs no extra pass over memory. We also
tried overlapping: cutting each step's chunk into segments, posting every ``Irecv`` at once and reducing segment j
while j + 1 arrives. Under MPICH on one machine it was 10-40% *slower*: a large message is copied by the receiving
process itself (``process_vm_readv``), so a process that is busy reducing is not moving data and there is nothing to
overlap, while every extra message and request costs a handshake that, with more ranks than cores, waits for a
descheduled peer. Overlap pays when a NIC or DMA engine moves the bytes while the CPU reduces. What does pay with
more ranks than cores is *how* a rank waits: ``dtrain.comm.waitall`` then sleeps between polls, so the neighbour
whose message it waits for gets the core (see docs/benchmarks.md).
"""

from __future__ import annotations

from dtrain import kernels
from dtrain.collectives._chunks import chunk_bounds, scratch
from dtrain.comm import sendrecv


def reduce_scatter(comm, buf, op="sum"):
    """Reduce ``buf`` across ranks so that rank r ends owning chunk r; return that chunk as a view of ``buf``.

    The rest of ``buf`` holds partial sums afterwards. With op "avg" the owned chunk is divided by p.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    bounds = chunk_bounds(buf.size, p)
    mine = buf[bounds[r][0] : bounds[r][1]]
    if p == 1:
        return mine
    right, left = (r + 1) % p, (r - 1) % p
    work = scratch(buf, bounds[0][1] - bounds[0][0])  # chunk 0 is the longest
    for s in range(p - 1):
        (a, b), (c, d) = bounds[(r - s - 1) % p], bounds[(r - s - 2) % p]
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
    bounds = chunk_bounds(buf.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        (a, b), (c, d) = bounds[(r - s) % p], bounds[(r - s - 1) % p]
        sendrecv(comm, buf[a:b], right, buf[c:d], left)
    return buf


def allreduce(comm, buf, op="sum"):
    """Ring all-reduce of ``buf`` in place (op "sum", "avg" or "max"): reduce-scatter, then all-gather."""
    reduce_scatter(comm, buf, op)
    return allgather(comm, buf)

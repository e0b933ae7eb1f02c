"""Pairwise all-to-all: every rank sends a different chunk to every other rank, p - 1 exchanges in all.

In an all-reduce every rank ends with the same thing; in an all-to-all every rank ends with something different.
The buffer is cut into p chunks (``chunk_bounds``), and **chunk j of rank r is addressed to rank j**. Afterwards
chunk j of rank r's buffer holds what rank j had in *its* chunk r: seen as a p x p matrix of chunks (row r: rank r's
buffer), the all-to-all transposes it. It is MPI's ``MPI_Alltoall`` on one buffer used in place, and what moves
tokens to their experts and back in a mixture-of-experts layer, or switches a sequence-parallel layer from "split by
tokens" to "split by heads"::

    chunk "r.j": rank r's chunk j, addressed to rank j

    before      chunk 0   chunk 1   chunk 2               after      chunk 0   chunk 1   chunk 2
    rank 0      0.0       0.1       0.2                   rank 0     0.0       1.0       2.0
    rank 1      1.0       1.1       1.2        --->       rank 1     0.1       1.1       2.1
    rank 2      2.0       2.1       2.2                   rank 2     0.2       1.2       2.2

**The algorithm ("pairwise").** Chunk r stays where it is (rank r's note to itself). At step s = 1 .. p-1 rank r
sends its chunk (r + s) % p to rank (r + s) % p and, in the same exchange, receives chunk (r - s) % p from rank
(r - s) % p (what that rank sends at step s is its chunk (r - s + s) % p = r: exactly the one addressed to r). Every
rank sends once and receives once per step, and after p - 1 steps every pair of ranks has exchanged its chunks::

    p = 4       rank 0       rank 1       rank 2       rank 3
    step 1      c1 -> 1      c2 -> 2      c3 -> 3      c0 -> 0       (receives from rank r - 1 into chunk r - 1)
    step 2      c2 -> 2      c3 -> 3      c0 -> 0      c1 -> 1       (pairs swap: 0 <-> 2, 1 <-> 3)
    step 3      c3 -> 3      c0 -> 0      c1 -> 1      c2 -> 2       (receives from rank r + 1 into chunk r + 1)

**In place, through one copy.** The chunk received at step s (chunk (r - s) % p) is not the one sent at step s, but
it *is* the one sent at step p - s: for s > p/2 that chunk has already gone, at s = p/2 it goes in the same
exchange (and MPI forbids sending from the memory it receives into), for s < p/2 it has not, and receiving into it
would overwrite it before it is sent. So rank r first copies its whole buffer into its scratch buffer
(``_chunks.scratch``, reused from call to call), sends every chunk from the copy and receives straight into ``buf``.
(Copying only the chunks at risk, those sent at steps s >= p/2, would about halve the copy; the simple way reads
better and costs one memory copy of n bytes, small next to p - 1 messages.)

**Equal chunks only: n % p == 0.** What rank j sends to rank r is rank j's chunk r, and it lands in rank r's chunk
j. With uneven chunks (the first n % p chunks one element longer) those two lengths differ, so the front door
refuses a buffer that does not divide evenly, on every rank, before anything is sent.

**Cost** (n bytes, p ranks; alpha latency per message, beta seconds per byte): ``(p-1) alpha + (p-1)/p n beta``, no
reduction. Exactly: each rank sends p - 1 messages of n/p bytes, every chunk but its own, ``(p-1)/p n`` bytes
(``costmodel.traffic(..., collective="alltoall")``, held against the tracer). No all-to-all can send less: every
rank has (p-1)/p n bytes addressed to others. The p - 1 latencies are the price of sending them directly;
Bruck's algorithm needs only ceil(log2 p) messages but forwards each byte up to log2 p times (small messages).
"""

from __future__ import annotations

from dtrain.collectives._chunks import bounds_for, scratch
from dtrain.comm import sendrecv


def alltoall(comm, buf):
    """Pairwise all-to-all of ``buf`` in place (``buf.size % p == 0``): chunk j goes to rank j, and chunk j of the
    result is what rank j had in its chunk r (r: this rank). Returns ``buf``."""
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return buf
    cut = bounds_for(buf.size, p)
    sent = scratch(buf, buf.size)  # what this rank sends: its buffer as it was, before anything arrives
    sent[:] = buf
    for s in range(1, p):
        dest, source = (r + s) % p, (r - s) % p
        (a, b), (c, d) = cut[dest], cut[source]
        sendrecv(comm, sent[a:b], dest, buf[c:d], source)
    return buf

"""Naive all-reduce: everyone sends everything to one rank, which reduces and sends the result back.

This is "reduction to one device", the pattern of a central parameter server. It is the baseline every other
algorithm in this package improves on::

        reduce (p - 1 messages into the root)          broadcast (p - 1 messages out of the root)

         rank 1 ---n--->+                                   +---n---> rank 1
         rank 2 ---n--->  root (rank 0)         root (rank 0) ---n---> rank 2
         rank 3 ---n--->+   adds each one as it arrives     +---n---> rank 3

The root handles the senders one at a time, in rank order, reusing one scratch buffer::

    p = 4, root 0   rank 0                  rank 1       rank 2       rank 3
    step 1          recv from 1, add        send all     (waits)      (waits)
    step 2          recv from 2, add                     send all
    step 3          recv from 3, add                                  send all
    step 4..6       send all to 1, 2, 3     recv all     recv all     recv all

**Cost** (n bytes, p ranks): the root receives (p - 1) n bytes, reduces (p - 1) n and sends (p - 1) n, all through its
one link and one core, while the other ranks wait. ``reduce``: ``(p-1)(alpha + n beta + n gamma)``; ``broadcast``:
``(p-1)(alpha + n beta)``; ``allreduce``: ``2(p-1) alpha + 2(p-1) n beta + (p-1) n gamma``, linear in p: double the
ranks and the all-reduce takes twice as long. Exact bytes sent per rank by the all-reduce: ``(p - 1) n`` by the root,
``n`` by every other rank (the broadcast alone: ``(p-1) n`` by the root and nothing by the others).
"""

from __future__ import annotations

from dtrain import kernels
from dtrain.collectives._chunks import scratch


def reduce(comm, buf, root=0, op="sum"):
    """Reduce every rank's ``buf`` into the root's ``buf`` (other ranks' buffers are left as they were)."""
    p, r = comm.Get_size(), comm.Get_rank()
    if r != root:
        comm.Send(buf, dest=root)
        return buf
    incoming = scratch(buf, buf.size)
    for source in range(p):
        if source != root:
            comm.Recv(incoming, source=source)
            kernels.reduce_(buf, incoming, op)
    if op == "avg":
        kernels.scale_(buf, 1.0 / p)
    return buf


def broadcast(comm, buf, root=0):
    """Copy the root's ``buf`` into every rank's ``buf``: the root sends it p - 1 times."""
    p, r = comm.Get_size(), comm.Get_rank()
    if r != root:
        comm.Recv(buf, source=root)
        return buf
    for dest in range(p):
        if dest != root:
            comm.Send(buf, dest=dest)
    return buf


def allreduce(comm, buf, op="sum"):
    """Reduce everything on rank 0, then broadcast it from rank 0."""
    reduce(comm, buf, 0, op)
    return broadcast(comm, buf, 0)

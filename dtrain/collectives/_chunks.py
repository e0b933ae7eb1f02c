"""How a flat buffer is cut into pieces, and the one scratch buffer each rank reuses.

Every collective that splits a buffer (ring, Rabenseifner, hierarchical) cuts it the same way, so a shard produced
by one algorithm is the input another expects, and the cost model can count bytes exactly::

    n = 10 elements, p = 4 chunks: the first n % p = 2 chunks get one extra element
    |  0  1  2 |  3  4  5 |  6  7 |  8  9 |
      chunk 0    chunk 1   chunk 2 chunk 3      chunk_offsets(10, 4) == [0, 3, 6, 8, 10]
"""

from __future__ import annotations

import functools
import itertools
import threading

from dtrain.backend import array_module


def chunk_offsets(n: int, p: int) -> list[int]:
    """``p + 1`` offsets: chunk ``c`` is ``buf[offsets[c]:offsets[c + 1]]``; the first ``n % p`` chunks are longer."""
    base, extra = divmod(n, p)
    offsets = [0]
    for c in range(p):
        offsets.append(offsets[-1] + base + (1 if c < extra else 0))
    return offsets


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of the ``p`` chunks of an ``n``-element buffer (first ``n % p`` get one extra)."""
    offsets = chunk_offsets(n, p)
    return list(itertools.pairwise(offsets))


# The algorithms ask for the same cut on every call of a training loop: remember it (as tuples, which nobody can
# change under the next caller). Computing it costs about a microsecond, looking it up a tenth of that.
@functools.lru_cache(maxsize=1024)
def offsets_for(n: int, p: int) -> tuple[int, ...]:
    """:func:`chunk_offsets` as a tuple, remembered."""
    return tuple(chunk_offsets(n, p))


@functools.lru_cache(maxsize=1024)
def bounds_for(n: int, p: int) -> tuple[tuple[int, int], ...]:
    """:func:`chunk_bounds` as a tuple, remembered."""
    return tuple(chunk_bounds(n, p))


# One scratch buffer per thread (simulated ranks are threads of one process) and per (array module, dtype). It only
# grows, so the steady state of a training loop allocates nothing: a fresh large array costs page faults on first
# touch every time, which would be a visible part of a fast all-reduce.
_local = threading.local()


def scratch(like, count: int):
    """A reusable 1-D array of ``count`` elements of ``like``'s dtype and array module (contents undefined)."""
    try:
        pool = _local.pool
    except AttributeError:  # this thread's first call
        pool = _local.pool = {}
    key = (type(like), like.dtype)
    buf = pool.get(key)
    if buf is None or buf.size < count:
        buf = array_module(like).empty(max(count, 1), dtype=like.dtype)
        pool[key] = buf
    return buf if buf.size == count else buf[:count]

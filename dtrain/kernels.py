"""Reductions on flat buffers: the arithmetic inside every all-reduce.

Interface (every collective uses only these; all work in place on contiguous arrays of one dtype):
    add_(dst, src)             dst += src
    max_(dst, src)             dst = maximum(dst, src)
    scale_(buf, factor)        buf *= factor
    sum_scale_(out, bufs, s)   out = (bufs[0] + ... + bufs[k-1]) * s     (one pass over memory)
    reduce_(dst, src, op)      add_ for op "sum"/"avg", max_ for "max"
"""

from __future__ import annotations

import numpy as np


def add_(dst, src):
    np.add(dst, src, out=dst)
    return dst


def max_(dst, src):
    np.maximum(dst, src, out=dst)
    return dst


def scale_(buf, factor):
    np.multiply(buf, buf.dtype.type(factor), out=buf)
    return buf


def sum_scale_(out, bufs, factor):
    np.add(bufs[0], bufs[1], out=out) if len(bufs) > 1 else np.copyto(out, bufs[0])
    for b in bufs[2:]:
        np.add(out, b, out=out)
    return scale_(out, factor)


def reduce_(dst, src, op):
    if op in ("sum", "avg"):
        return add_(dst, src)
    if op == "max":
        return max_(dst, src)
    raise ValueError(f"unknown reduction op {op!r}: choose sum, avg or max")

"""Planted bug: the buckets are filled from the first parameter on, not from the last one back.

exercise: 3.2
file: buckets.py
expect: expected every parameter once in reverse order
"""


def plan_buckets(parameters, bucket_bytes):
    buckets, members, nbytes = [], [], 0
    for index, (offset, size, itemsize) in enumerate(parameters):  # the bug: reversed(...) is backward's order
        members.append(index)
        nbytes += size * itemsize
        if bucket_bytes and nbytes >= bucket_bytes:
            buckets.append((parameters[members[0]][0], offset + size, members))
            members, nbytes = [], 0
    if members:
        last = parameters[members[-1]]
        buckets.append((parameters[members[0]][0], last[0] + last[1], members))
    return buckets

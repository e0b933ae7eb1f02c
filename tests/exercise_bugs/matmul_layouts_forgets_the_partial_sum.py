"""Planted bug: the matmul rule without case 3's partial sum: J split over one axis in both operands multiplies the
blocks and calls C whole, though each rank's product is only its share of the sum over J.

exercise: 14.1
file: spmd.py
expect: C's partial-sum axis is None, expected 'x': case 3: J is split over x in both A and B
"""


def matmul_layouts(a, b):
    (i, ja), (jb, k) = a, b
    sent = []
    if ja != jb:  # case 2: gather the J of each operand that splits it
        if ja is not None:
            sent.append(("all-gather", "A", 1, ja))
        if jb is not None:
            sent.append(("all-gather", "B", 0, jb))
    # case 3 (ja == jb, not None): the blocks are multiplied... and C is taken as whole (the bug: no partial sum)
    if i is not None and i == k:  # case 4
        sent.append(("all-gather", "B", 1, k))
        k = None
    return (i, k), None, sent

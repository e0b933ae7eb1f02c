"""Planted bug: case 2 of the matmul rule gathers the other operand: when B's J is split it all-gathers A's J (which
is whole), and the other way round.

exercise: 14.1
file: spmd.py
expect: ('all-gather', 'A', 1, 'x') gathers A's dimension 1 over x, but that dimension is whole here
"""


def matmul_layouts(a, b):
    (i, ja), (jb, k) = a, b
    sent, partial = [], None
    if ja == jb:
        partial = ja  # case 1 (None) or case 3
    else:  # case 2, with the operands mixed up (the bug)
        if ja is not None:
            sent.append(("all-gather", "B", 0, ja))
        if jb is not None:
            sent.append(("all-gather", "A", 1, jb))
    if i is not None and i == k:  # case 4
        sent.append(("all-gather", "B", 1, k))
        k = None
    return (i, k), partial, sent

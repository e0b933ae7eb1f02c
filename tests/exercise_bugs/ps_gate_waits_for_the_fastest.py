"""Planted bug: the gate measures the lead from the fastest running worker instead of the slowest, so nobody waits.

exercise: 4.2
file: parameter_server.py
expect: stale_synchronous_ready(waiting=[0, 1], clock=[3, 3, 2], running=[0, 1, 2], bound=0) is [0, 1], expected []
"""


def stale_synchronous_ready(waiting, clock, running, bound):
    fastest = max((clock[w] for w in running), default=0)
    return [w for w in waiting if bound is None or clock[w] - fastest <= bound]

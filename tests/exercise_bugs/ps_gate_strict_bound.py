"""Planted bug: ``<`` instead of ``<=``, so a worker exactly ``bound`` steps ahead is held (and bound 0 holds all).

exercise: 4.2
file: parameter_server.py
expect: clock=[3, 3, 3], running=[0, 1, 2], bound=0) is [], expected [0, 1, 2]
"""


def stale_synchronous_ready(waiting, clock, running, bound):
    slowest = min((clock[w] for w in running), default=0)
    return [w for w in waiting if bound is None or clock[w] - slowest < bound]

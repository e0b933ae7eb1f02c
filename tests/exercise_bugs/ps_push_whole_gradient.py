"""Planted bug: every server is pushed the whole gradient instead of its slice (the weights come back right).

exercise: 4.1
file: parameter_server.py
expect: received 7 elements from worker rank 0: expected its slice grads[0:4], 4 elements
"""

from dtrain.comm import waitall
from dtrain.parallel.ps_server import PUSH, WEIGHTS


def push_and_pull(comm, params, grads, servers):
    requests = [comm.Irecv(params[a:b], server, WEIGHTS) for server, (a, b) in servers]
    requests += [comm.Isend(grads, server, PUSH) for server, _ in servers]
    waitall(requests)

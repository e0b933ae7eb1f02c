"""Planted bug: one flat ring over the whole world: the right sum, but every rank sends across nodes.

exercise: 2.5
file: hierarchical.py
expect: ranks [1] sent bytes to other nodes ([16]) but are not leaders
"""

from dtrain.collectives import ring


def hierarchical_allreduce(topology, buf):
    ring.allreduce(topology.comm, buf)  # the bug: reduce in the node, ring among topology.leaders, broadcast

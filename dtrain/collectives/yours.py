"""Your own all-reduce: ``algorithm="ex/ring.py:ring_allreduce"`` runs a function you wrote, in dtrain's place.

A course exercise (``dtrain exercises check 2.1``) has the learner write ``ring_allreduce(comm, buf)``: sum ``buf``
over the ranks, in place. Once it passes, the same function can average DDP's gradients::

    dtrain launch -n 4 -m dtrain train --paradigm ddp --allreduce ex/ring.py:ring_allreduce

The front door (:func:`dtrain.collectives.allreduce`) checks the call as for any algorithm, labels the traffic
``allreduce/yours:ring_allreduce`` for the tracer, and runs the function; "avg" is the sum divided by p afterwards
(the function only sums). The file is loaded once per process (:mod:`dtrain.loading` says what is wrong with it).
"""

from __future__ import annotations

import functools

from dtrain import kernels
from dtrain.loading import is_spec, load_function, split_spec

PARAMETERS = ("comm", "buf")

__all__ = ["entry", "is_spec"]


@functools.cache
def entry(spec: str):
    """What the front door needs to run the function ``spec`` names (``FILE.py:FUNCTION``): ``(run, label)``, the
    function as the front door calls an algorithm (``run(comm, flat, op)``) and the tracer's label of its traffic."""
    path, name = split_spec(spec)
    function = load_function(path, name, PARAMETERS, who="--allreduce: ")

    def run(comm, flat, op):
        if op == "max":
            raise ValueError(f"{spec} sums: op 'max' needs an all-reduce that takes the maximum")
        function(comm, flat)
        if op == "avg":
            kernels.scale_(flat, 1.0 / comm.Get_size())
        return flat

    return run, f"allreduce/yours:{name}"

"""Planted bug: "GPipe" that runs each micro-batch's backward right after its forward: correct and deadlock-free,
but one micro-batch at a time, so the stages idle most of the step.

exercise: 8.2
file: schedules.py
expect: GPipe runs every forward before any backward: it holds 3 there
"""

from dtrain.parallel.instructions import Backward, Forward


def gpipe(stages, microbatches):
    return [[ins for i in range(microbatches) for ins in (Forward(s, i), Backward(s, i))] for s in range(stages)]

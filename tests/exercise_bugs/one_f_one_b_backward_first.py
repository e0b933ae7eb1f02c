"""Planted bug: the steady state runs the backward of a pair before its forward, so the last stage (no warm-up) runs
micro-batch 0's backward before its forward.

exercise: 8.1
file: schedules.py
expect: stage 0 runs the backward of micro-batch 0 before its forward
"""

from dtrain.parallel.instructions import Backward, Forward


def one_f_one_b(stages, microbatches):
    programs = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        order = [Forward(s, i) for i in range(warmup)]
        for k in range(microbatches - warmup):
            order += [Backward(s, k), Forward(s, warmup + k)]  # the bug: the forward comes first
        order += [Backward(s, i) for i in range(microbatches - warmup, microbatches)]
        programs.append(order)
    return programs

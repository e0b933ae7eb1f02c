"""A pipeline's forward of the whole model, for evaluation (:mod:`dtrain.parallel.pipeline` is the training).

Evaluating needs no micro-batches and no backward: each stage in turn runs the whole test batch through its chunks
and sends the activations on, point to point, as the pipeline's forward does, and the last stage broadcasts the
logits, so that every rank computes the same accuracy. Its traffic is counted under "evaluation", not training.
"""

from __future__ import annotations

from dtrain import collectives
from dtrain.autograd import Tensor
from dtrain.backend import array_module
from dtrain.comm import waitall
from dtrain.comm.trace import EVALUATION, labelled


class PipelineForward:
    """The whole model's forward, for evaluation: each stage in turn on the whole test batch (no micro-batches), the
    activations passed on point to point, the logits broadcast from the last stage to every stage."""

    def __init__(self, pipeline):
        """``pipeline``: this rank's :class:`~dtrain.parallel.pipeline.Pipeline`, built (its chunks, the cut)."""
        self.pipeline = pipeline

    def __call__(self, x: Tensor) -> Tensor:
        pipe = self.pipeline
        comm, last, rows = pipe.grid.pp_comm, pipe.stages - 1, x.shape[0]
        xp = array_module(x.data)
        with labelled(pipe.comm, EVALUATION):
            h = x
            for v in pipe.mine:
                if v > 0:
                    h = Tensor(pipe.receive(xp.empty((rows, pipe.width(v)), dtype=pipe.dtype), (v - 1) % pipe.P, v,
                                            f"stage {v}: waiting for the evaluation batch's activations"))  # fmt: skip
                h = pipe.chunks[v](h)
                if v < last:
                    waitall([comm.Isend(h.data, dest=(v + 1) % pipe.P, tag=v + 1)])
            logits = h.data if last in pipe.chunks else xp.empty((rows, pipe.sizes[-1]), dtype=pipe.dtype)
            collectives.broadcast(comm, logits, root=last % pipe.P)
        return Tensor(logits)

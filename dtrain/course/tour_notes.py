"""What to notice in each row of ``dtrain tour``'s table, written from the run's own numbers.

A note is a function of the run's summary ``s`` (:func:`dtrain.report.run_summary`), its metrics.json ``m`` and the
tour's references ``c`` (:class:`Context`): single's curve, the gradient's bytes, ddp's cost on as many ranks. Where a
run's measured bytes per step differ from its ``costs()``, :func:`footnote` says by how much and why.
"""

from __future__ import annotations

import collections
import statistics

from dtrain import parallel
from dtrain.config import TrainConfig


class Context:
    """The numbers a note compares a run with."""

    def __init__(self, single: dict | None):
        self.single = single  # single's summary, if it ran

    def curve(self, s: dict) -> str:
        """How far the run's training loss, epoch by epoch, is from single's."""
        if self.single is None:
            return "(no single run to compare with)"
        gap = max(abs(a - b) / b for a, b in zip(s["train_loss"], self.single["train_loss"]))
        if gap < 1e-3:
            return f"single's curve (to {gap:.0e})"
        return f"its own curve (final loss {s['train_loss'][-1] / self.single['train_loss'][-1] - 1:+.0%} of single's)"

    def accuracy(self, s: dict) -> str:
        if self.single is None:
            return f"accuracy {100 * s['test_accuracy']:.2f}%"
        return f"accuracy {100 * (s['test_accuracy'] - self.single['test_accuracy']):+.2f} points"


def gradient_bytes(m: dict) -> int:
    """The bytes of the whole model's gradient (as many as its parameters)."""
    return ddp_costs(m)["gradients"]


def ddp_costs(m: dict, **flags) -> dict:
    """What ddp (with ``flags``) would cost for this run's model on as many ranks: its ``costs()``."""
    config = TrainConfig(paradigm="ddp", dtype=m["config"]["dtype"], optimizer=m["config"]["optimizer"],
                         momentum=m["config"]["momentum"], **flags)  # fmt: skip
    return parallel.get("ddp").costs(m["model"]["sizes"], m["world_size"], config)


def _share(s: dict, m: dict) -> str:
    """The fullest rank's state against the whole model's (what single and ddp hold)."""
    whole = ddp_costs(m)
    held = max(s["state_bytes"] or s["predicted_state_bytes"])
    return f"{held / (whole['parameters'] + whole['gradients'] + whole['optimizer']):.2f}"


def _x(a: float, b: float) -> str:
    """``a`` as a multiple of ``b``: "1.50x"."""
    return f"{a / b:.2f}x" if b else "-"


def _ddp_ring(s, m, c) -> str:
    ring = _x(max(s["sent_per_step"]), gradient_bytes(m))
    return f"{c.curve(s)}; fewest bytes, 2(p-1)/p = {ring} the gradient, in {max(s['messages_per_step']):.0f} messages"


def _ddp_hier(s, m, c) -> str:
    sent, n = s["sent_per_step"], gradient_bytes(m)
    return f"{c.curve(s)}; a node's leader sends {_x(max(sent), n)} the gradient, the other ranks {_x(min(sent), n)}"


def _central(s, m, c) -> str:
    held = s["state_bytes"] or s["predicted_state_bytes"]
    others = _x(min(held), held[0])
    return f"{c.curve(s)}; rank 0 alone keeps the optimizer state and steps; the others hold {others} its bytes"


def _ps_sync(s, m, c) -> str:
    sent = s["sent_per_step"]
    return f"{c.curve(s)}; the server sends {_x(sent[-1], max(sent[:-1]))} a worker's bytes: its link is the bottleneck"


def _ps_async(s, m, c) -> str:
    pushes = [r["operations"].get("ps/push", {}).get("calls", 0) for r in m["communication"]["per_rank"]]
    staleness = m["communication"]["per_rank"][0]["paradigm"]["staleness"]
    tail = f"staleness mean {staleness['mean']:.1f}, max {staleness['max']}"
    slow = m["config"]["slow_rank"]
    if slow is None:
        return f"each gradient applied as it comes: {tail}"
    others = ", ".join(str(p) for r, p in enumerate(pushes) if p and r != slow)
    return f"the straggler took {pushes[slow]} steps, the others {others}: none waited for it; {tail}"


def _compressed(s, m, c) -> str:
    ring = _x(max(s["sent_per_step"]), max(ddp_costs(m, allreduce="ring")["sent_per_step"]))
    how = {
        "fp16": "every element in 2 bytes",
        "topk": f"the {m['config']['compress_ratio']:.0%} largest entries as "
        "(index, value) pairs, the rest kept for later",
        "powersgd": f"rank-{m['config']['powersgd_rank']} factors of each weight matrix, the rest kept for later",
    }.get(m["config"]["compress"], "compressed")
    return f"{how}: {ring} ddp ring's bytes; {c.accuracy(s)}"


def _local_sgd(s, m, c) -> str:
    ratio = _x(max(s["sent_per_step"]), max(ddp_costs(m)["sent_per_step"]))
    return f"weights averaged every {m['config']['sync_every']} steps: {ratio} ddp's bytes; {c.accuracy(s)}"


def _gossip(s, m, c) -> str:
    each = _x(max(s["sent_per_step"]), gradient_bytes(m))
    return f"the whole model to its neighbours only ({each} the gradient), no global average; {c.accuracy(s)}"


def _zero(s, m, c) -> str:
    ring = _x(max(s["sent_per_step"]), max(ddp_costs(m, allreduce="ring")["sent_per_step"]))
    return f"{c.curve(s)}; holds {_share(s, m)} of ddp's state (1/p + the layer in use), sends {ring} ddp ring's bytes"


def _tp(s, m, c) -> str:
    return f"{c.curve(s)}; holds {_share(s, m)} of the state; sends activations (grow with the batch), not gradients"


def _pipeline(s, m, c) -> str:
    figures = m["communication"]["per_rank"][0]["paradigm"]
    P, M = figures["grid"]["pp"], figures["microbatches"]
    idle = statistics.mean(r["idle_fraction"] for r in figures["per_rank"])
    return (f"{c.curve(s)}; a rank holds {_share(s, m)} of the state at most; idle {idle:.0%} of a step (the "
            f"bubble alone: {(P - 1) / (M + P - 1):.0%})")  # fmt: skip


def _spmd(s, m, c) -> str:
    made = m["communication"]["per_rank"][0]["paradigm"]["collectives_per_step"]
    counted = collections.Counter(f"{x['kind']} over {x['axis']} ({x['phase']})" for x in made)
    derived = ", ".join(f"{n} {what}" if n > 1 else what for what, n in counted.items()) or "nothing"
    return f"{c.curve(s)}; the layouts' collectives, derived: {derived}"


NOTES = {
    "single": lambda s, m, c: "the reference: sends nothing; holds the model, its gradients and momentum",
    "ddp-ring": _ddp_ring,
    "ddp-hier": _ddp_hier,
    "central-storage": _central,
    "ps-sync": _ps_sync,
    "ps-async": _ps_async,
    "ddp-fp16": _compressed,
    "ddp-topk": _compressed,
    "ddp-powersgd": _compressed,
    "local-sgd": _local_sgd,
    "gossip": _gossip,
    "zero-3": _zero,
    "tp": _tp,
    "pp": _pipeline,
    "grid": _pipeline,
    "spmd": _spmd,
}

WHY = {
    "ps-sync": "each worker pulls the weights once before its first push, which costs() leaves out",
    "ps-async": "each worker's first pull, and the pushes in flight when an epoch ends, answered too: the server "
    "applied {updates} pushes, not {workers} x {steps}",
    "gossip": "the final average of the replicas (one all-reduce, once a run) is in the measured bytes",
}


def note(name: str, s: dict, m: dict, c: Context) -> str:
    """The row's note: the tour's own, or a paradigm's summary for one the tour does not know."""
    if name in NOTES:
        return NOTES[name](s, m, c)
    return parallel.get(m["config"]["paradigm"]).summary


def footnote(name: str, label: str, s: dict, m: dict) -> str | None:
    """A line for a run whose busiest rank sent other than ``costs()`` said, with why; None if it did not."""
    if None in s["predicted_sent_per_step"]:  # (costs() cannot say: a learner's all-reduce)
        return None
    measured, predicted = max(s["sent_per_step"]), max(s["predicted_sent_per_step"])
    if abs(measured - predicted) < 0.5:
        return None
    figures = m["communication"]["per_rank"][0]["paradigm"]
    workers = figures.get("roles", []).count("worker")
    why = WHY.get(name, "not explained by the tour: compare its metrics.json's operations with costs()")
    why = why.format(updates=sum(figures.get("server_updates", [0])), workers=workers, steps=s["steps"])
    return f"{label}: {measured:,.0f} B/step, costs() {predicted:,.0f} ({measured / predicted - 1:+.2%}): {why}"

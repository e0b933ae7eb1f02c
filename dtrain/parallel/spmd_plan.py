"""What ``--paradigm spmd --explain`` prints: read off the program's dry run.

The explanation is a query plan: the layout of every tensor and the block a rank holds of it; then every op of one
micro-batch's forward with its operands' layouts, its result's and the case of its rule; then every collective of
one optimizer step (forward, backward, update) with its kind, mesh axis, elements (its result on one rank) and where
in the graph; then what a step sends and a rank holds (``costs()``). With ``--sharding auto``, why the chosen layout
won against the runner-up.
"""

from __future__ import annotations

from dtrain import terminal
from dtrain.parallel import auto_sharding, shardings
from dtrain.parallel.layouts import spec

FORMS = {"matmul": "{} @ {}", "bias add": "{} + {}", "relu": "relu({})", "cross-entropy": "cross-entropy({})"}


def explain(kind, sizes, world: int, config) -> str:
    """The plan of the paradigm ``kind`` (spmd's) for ``config`` on ``world`` ranks, as text for a terminal: its
    dry run (``kind.plan_of``), its ``costs``, and with --sharding auto why the layout chosen won."""
    sharding, k = shardings.sharding_of(config), config.accumulate
    program, costs, laid = kind.plan_of(sizes, world, config), kind.costs(sizes, world, config), kind.layouts_of(
        sizes, world, config)  # fmt: skip
    shape = program.shape
    lines = [terminal.paragraph(
        f"spmd on the device mesh {shape} ({shape.size} ranks), --sharding {sharding}"
        + "".join(f" --shard {s}" for s in config.shard or ()) + f"; the MLP {'-'.join(map(str, sizes))}, global "
        f"batch {config.batch_size}" + (f" in {k} micro-batches" if k > 1 else "") + ":")]  # fmt: skip
    if sharding == "auto":
        lines += ["", auto_sharding.why(tuple(sizes), world, config.mesh, config.batch_size, k, config.dtype,
                                       config.optimizer, config.momentum)]  # fmt: skip
    axis_sizes = dict(shape.axes)
    rows = []
    for name, global_shape in shardings.tensors(sizes, config.batch_size).items():
        local = laid[name].local_shape(global_shape, axis_sizes)
        rows.append([name, " x ".join(map(str, global_shape)), f"[{spec(laid[name].dims)}]",
                     " x ".join(map(str, local))])  # fmt: skip
    lines += ["", terminal.table(["tensor", "shape", "layout", "a rank holds"], rows, left=(0, 2))]
    ops = program.plan[: len(program.plan) // k]  # (one micro-batch's ops)
    lines += ["", terminal.paragraph("the program, op by op (backward runs each op's conjugate; the model's code is "
                                     "the same for every layout):")]  # fmt: skip
    table = [[e["where"], f"{FORMS[e['op']].format(*e['inputs'])} -> {e['output']}", e["case"] or "-"] for e in ops]
    lines.append(terminal.table(["where", "operands -> result", "matmul's case"], table, left=(0, 1, 2)))
    record = program.record
    if record:
        lines += ["", "the collectives of one step, derived from the layouts:"]
        table = [[c["phase"], c["kind"], c["axis"], f"{c['elements']:,}", c["where"]] for c in record]
        lines.append(terminal.table(["phase", "kind", "axis", "elements", "where"], table, left=(0, 1, 2, 4)))
    else:
        lines += ["", "no collective: every rank computes alone (nothing is split, or nothing needs a sum)"]
    sent = costs["sent_per_step"]
    lines += [
        "",
        terminal.paragraph(
            f"a step sends {max(sent):,} bytes from the busiest rank ({sum(sent):,} in all); a rank holds "
            f"{costs['parameters']:,} bytes of parameters, as many of gradients and {costs['optimizer']:,} of "
            f"optimizer state ({config.optimizer})."
        ),
        "nothing was trained (--explain): leave --explain out to train.",
    ]
    return "\n".join(lines)

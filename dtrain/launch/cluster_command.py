"""``dtrain cluster up|status|down``: what the person at the terminal sees of :mod:`dtrain.launch.cluster`.

``up`` ends with the hostfile's path alone on the last line of standard output, so a script can take it::

    hostfile=$(dtrain cluster up --nodes 2 --slots 2 --link 100mbit | tail -n 1)
    dtrain launch -n 4 --hostfile "$hostfile" -m dtrain train --paradigm ddp --allreduce hierarchical
    dtrain cluster down
"""

from __future__ import annotations

from dtrain import terminal
from dtrain.launch import cluster as clusters


def _rate(bits_s: float | None) -> str:
    if bits_s is None:
        return "-"
    return f"{bits_s / 1e9:.3g} Gbit/s" if bits_s >= 1e9 else f"{bits_s / 1e6:.3g} Mbit/s"


def _nodes_table(c: clusters.Cluster) -> str:
    """One row a node; its shaping read from the kernel (tc), its processes from its namespace."""
    rows = []
    for i, node in enumerate(c.names, 1):
        out, into = clusters.shaping(c, i)
        name = node + (" (killed)" if node in c.killed else "")
        rows.append([name, c.address(i), str(c.slots), out, into, str(len(clusters.processes_in(node)))])
    header = ["node", "address", "slots", "sends at", "receives at", "processes"]
    return terminal.table(header, rows, left=(0, 1))


def _about(c: clusters.Cluster) -> list[str]:
    lines = [f"cluster {c.name}: {c.nodes} node(s) x {c.slots} slot(s) on bridge {c.bridge} ({c.subnet})"]
    if c.latency_us is not None:
        lines.append(f"the link measured, node 1 -> node 2: {c.latency_us:.0f} us one way (TCP, 1 byte), a stream at "
                     f"{_rate(c.measured_bits_s)} (link {c.link or 'unshaped'})")  # fmt: skip
    return [terminal.wrapped(line) for line in lines]


def command(args) -> int:
    if args.action == "up":
        c = clusters.up(args.name, args.nodes, args.slots, args.link)
        print("\n".join(_about(c)))
        print(_nodes_table(c))
        print("run on it:")
        print(terminal.command(["dtrain", "launch", "-n", str(c.nodes * c.slots), "--hostfile", str(c.hostfile), "-m",
                                "dtrain.launch.where"], indent="  "))  # fmt: skip
        print("remove it:")
        print(terminal.command(["dtrain", "cluster", "down", "--name", c.name], indent="  "))
        print(c.hostfile)
        return 0
    if args.action == "status":
        c = clusters.status(args.name)
        print("\n".join(_about(c)))
        print(_nodes_table(c))
        print(f"hostfile: {c.hostfile}")
        return 0
    if args.action == "kill":
        pids = clusters.kill(args.name, args.node, args.cut_link)
        cut = "link cut, " if args.cut_link else ""
        print(terminal.paragraph(f"node {args.node} of cluster {args.name}: {cut}{len(pids)} process(es) killed, out "
                                 "of the hostfile", hanging="  "))  # fmt: skip
        return 0
    removed = clusters.down(args.name)  # (the one action left: down)
    if removed:
        print(terminal.paragraph(f"cluster {args.name} removed: " + ", ".join(removed), hanging="  "))
    else:
        print(f"no cluster named {args.name}: nothing to remove")
    return 0

"""Where the ranks go: a hostfile or a ``--hosts`` list, read once, checked, and handed on in either MPI's spelling.

Every MPI's ``mpiexec`` takes a list of machines, each with a number of *slots* (ranks it may place there), but each
spells it its own way::

    # MPICH (hydra)          # Open MPI (prte)           # dtrain reads both, and --hosts a:2,b:2 too
    node1:4                  node1 slots=4
    node2:4                  node2 slots=4

A slot is not a core: it is a place for one rank. ``mpiexec -n 8`` fills node1's slots, then node2's. Asking for more
ranks than slots is *oversubscription*: MPICH's hydra does it silently (it wraps around the list), Open MPI refuses
unless told. dtrain refuses too, in one line and before anything starts, unless ``--oversubscribe`` says it is meant:
a rank count larger than the machines can hold is usually a typo, and an oversubscribed cluster job is slow for a
reason no one will find.

A hostfile whose first line is ``# dtrain cluster NAME: ...`` was written by ``dtrain cluster up``
(:mod:`dtrain.launch.cluster`): its hosts are that cluster's nodes, which only its own launcher can reach, so each
:class:`Host` read from it carries the cluster's name.

A host named without slots has one: MPICH's meaning. (Open MPI would count that machine's cores instead, which dtrain
cannot know before the job starts, so a hostfile for Open MPI should say ``slots=N``.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import UserError


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    cluster: str | None = None  # the dtrain cluster (dtrain cluster up) whose node this is, if it is one


CLUSTER = re.compile(r"^#\s*dtrain cluster (\S+):")  # (the name is checked where the cluster is looked up)


def cluster_comment(name: str, about: str) -> str:
    """The first line of cluster ``name``'s hostfile: what marks it as that cluster's."""
    return f"# dtrain cluster {name}: {about} (dtrain cluster down --name {name} removes it)"


# node1   node1:4   node1 slots=4   node1 slots=4 max_slots=8   (Open MPI's other keys are kept out, not refused)
_LINE = re.compile(r"^(?P<name>[^\s:#]+)(?::(?P<colon>\d+))?(?P<rest>(?:\s+\S+)*)$")
_SLOTS = re.compile(r"^slots=(\d+)$")
_KEPT_OUT = re.compile(r"^max[-_]slots=\d+$")  # Open MPI's cap on oversubscription: read, and left to Open MPI


def parse_hostfile(path) -> list[Host]:
    """The hosts of a hostfile in MPICH's (``host:N``) or Open MPI's (``host slots=N``) spelling; comments allowed."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"hostfile {path} {what}: give a file with one host per line (node1:4, or node1 slots=4)")
    hosts = []
    lines = path.read_text().splitlines()
    cluster = CLUSTER.match(lines[0]) if lines else None
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(_parse_line(line, f"{path}, line {number}"))
    hosts = _check(hosts, f"hostfile {path}")
    return [Host(h.name, h.slots, cluster[1]) for h in hosts] if cluster else hosts


def parse_hosts(text: str) -> list[Host]:
    """``--hosts a,b:2,c:4``: hosts separated by commas, each with ``:slots`` or one slot."""
    hosts = [_parse_line(item.strip(), f"--hosts {text}") for item in text.split(",") if item.strip()]
    return _check(hosts, f"--hosts {text!r}")


def _parse_line(line: str, where: str) -> Host:
    match = _LINE.match(line)
    if match is None:
        raise UserError(f"{where}: cannot read {line!r}: write a host name, host:SLOTS or host slots=SLOTS")
    slots = int(match["colon"]) if match["colon"] is not None else None
    for word in match["rest"].split():
        found = _SLOTS.match(word)
        if found and slots is not None:
            raise UserError(f"{where}: {line!r} gives the slots twice")
        if found:
            slots = int(found[1])
        elif not _KEPT_OUT.match(word):  # a typo (slot=4, " :4") must not quietly mean one slot
            raise UserError(f"{where}: {word!r} in {line!r} is not slots=N: write host:SLOTS or host slots=SLOTS")
    return Host(match["name"], 1 if slots is None else slots)


def _check(hosts: list[Host], what: str) -> list[Host]:
    if not hosts:
        raise UserError(f"{what} names no hosts: write one host per line (node1:4, or node1 slots=4)")
    if sum(h.slots for h in hosts) == 0:
        raise UserError(f"{what} gives no slots (every host has slots=0): a slot is a place for one rank")
    merged: dict[str, int] = {}
    for h in hosts:  # a host named twice adds its slots, as both MPIs do
        merged[h.name] = merged.get(h.name, 0) + h.slots
    return [Host(name, slots) for name, slots in merged.items() if slots > 0]  # a host of 0 slots takes no rank


def total_slots(hosts: list[Host]) -> int:
    return sum(h.slots for h in hosts)


def check_fits(nranks: int, hosts: list[Host], oversubscribe: bool, source: str) -> None:
    """Refuse ``nranks`` ranks on fewer slots, unless oversubscription was asked for."""
    slots = total_slots(hosts)
    if nranks > slots and not oversubscribe:
        listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts[:6]) + (", ..." if len(hosts) > 6 else "")
        raise UserError(
            f"-n {nranks} is more ranks than the {slots} slots of {source} ({listed}): give -n {slots} or fewer, add "
            "slots, or --oversubscribe to place several ranks a slot"
        )


def host_list(hosts: list[Host]) -> str:
    """``a:2,b:2``: the spelling both MPICH's ``-hosts`` and Open MPI's ``--host`` take."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)

"""A cluster on this machine: nodes that are Linux network namespaces on a bridge of their own, each behind a link
shaped to a rate, so that MPI's bytes between nodes cross a (slow) network for real, while the ranks of one node
still share its memory.

``dtrain cluster up --nodes 2 --slots 2 --link 100mbit`` makes::

    this machine (root)        bridge dtb-NAME  10.213.X.1/24  (the launcher's side: mpiexec listens here)
    ──────────────┬───────────────────────────────────────────────┬──────────────────────────────────────
       dtv-NAME-1 │ tbf RATE: what node 1 receives                │ dtv-NAME-2 │ tbf RATE
             veth │                                               │ veth
    ┌─────────────┴─────────────────┐             ┌───────────────┴───────────────┐
    │ node NAME-n1 (a network and a │             │ node NAME-n2                  │
    │ hostname namespace)           │             │                               │
    │ eth0 10.213.X.11, tbf RATE:   │             │ eth0 10.213.X.12, tbf RATE    │
    │ what node 1 sends             │             │                               │
    │ ranks 0, 1: shared memory     │             │ ranks 2, 3: shared memory     │
    └───────────────────────────────┘             └───────────────────────────────┘

Each link is full duplex: RATE out of a node (its ``eth0``) and RATE into it (the bridge's end of its veth), as a
switch port would be. The ranks of one node are processes of this machine, so MPI still puts them together
(``Split_type(COMM_TYPE_SHARED)``); between nodes UCX (MPICH's network layer) is told to use TCP on ``eth0``
(``UCX_TLS=tcp,self``): left alone it would find the same kernel on both sides and use shared memory there too.

How a job gets in: the hostfile names the cluster in its first line; ``dtrain launch --hostfile FILE`` reads it and
starts MPICH's hydra with ``-launcher ssh -launcher-exec NODE_SCRIPT``: hydra calls that script as it would call
ssh (``SCRIPT [options] HOST COMMAND``), and the script runs the command inside the host's namespace, under the
host's own name (:func:`launch_script`). No ssh server is needed. Open MPI is refused (its launcher and network
layer would each need pinning to the namespaces; MPICH is the MPI dtrain installs).

Network safety: addresses only on the cluster's own bridge and in the namespaces it makes, on a /24 no route of this
machine touches; no default route in a node, no NAT, nothing forwarded: a node reaches the other nodes and the
bridge, nothing else. ``down`` removes every namespace, link, process and file ``up`` made, and cleans a half-made
cluster (an ``up`` that was killed) the same way: what belongs to cluster NAME is found by its names.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dtrain.errors import UserError
from dtrain.launch.hosts import cluster_comment

ROOT = Path(os.environ.get("DTRAIN_CLUSTER_ROOT", "/run/dtrain/clusters"))  # (gone at reboot, as namespaces are)
NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # so that "dtv-NAME-64" fits Linux's 15 characters for a link
MAX_NODES, MAX_SLOTS = 64, 256
SUBNETS = [ipaddress.ip_network(f"10.213.{x}.0/24") for x in range(256)]
RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's units: powers of ten, bits per second
NETWORK_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}  # (between nodes: TCP on the node's link)


@dataclass
class Cluster:
    """What ``up`` made, as written to ROOT/NAME/cluster.json (before the first command, so a killed ``up`` is
    known): its name, nodes, slots a node, link rate (None: unshaped), subnet, and what was measured on the link."""

    name: str
    nodes: int
    slots: int
    link: str | None
    subnet: str
    ready: bool = False
    killed: tuple = ()  # the nodes ``dtrain cluster kill`` took down (out of the hostfile, their processes killed)
    latency_us: float | None = None  # one way, a TCP message of one byte between node 1 and node 2
    measured_bits_s: float | None = None  # node 1 to node 2, a stream of 8 MiB (or less on a slow link)

    def node(self, i: int) -> str:  # the node's name: its host name in the hostfile, its namespace and hostname
        return f"{self.name}-n{i}"

    @property
    def names(self) -> list[str]:
        return [self.node(i) for i in range(1, self.nodes + 1)]

    @property
    def bridge(self) -> str:
        return f"dtb-{self.name}"

    def veth(self, i: int) -> str:
        return f"dtv-{self.name}-{i}"

    def address(self, i: int) -> str:  # the bridge is .1, node i is .(10 + i)
        return str(ipaddress.ip_network(self.subnet)[10 + i])

    @property
    def folder(self) -> Path:
        return ROOT / self.name

    @property
    def hostfile(self) -> Path:
        return self.folder / "hostfile"

    @property
    def script(self) -> Path:
        return self.folder / "launch-on-node"

    @property
    def link_bits_s(self) -> float | None:
        return None if self.link is None else rate_bits_s(self.link)


def check_name(name: str) -> str:
    if not NAME.match(name or ""):
        raise UserError(f"cluster name {name!r}: use 1-8 lowercase letters and digits, starting with a letter")
    return name


def rate_bits_s(text: str) -> float:
    """``100mbit`` -> 1e8: tc's spelling of a rate, in bits per second."""
    match = RATE.match(text.strip().lower())
    if match is None or float(match[1]) <= 0:
        raise UserError(f"--link {text!r}: give a rate as tc spells it: 10mbit, 100mbit, 1gbit, 500kbit")
    return float(match[1]) * RATE_UNITS[match[2]]


def missing(what: str = "a cluster on this machine") -> str | None:
    """Why ``what`` cannot be done here (not root, no ``ip``, ``tc`` or ``unshare``), or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"{what} needs root (network namespaces and links are made by root)"
    tools = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if tools:
        return f"{what} needs {' and '.join(tools)} (iproute2, util-linux), not found on PATH"
    return None


def require_tools(what: str) -> None:
    """:func:`missing`'s reason as a UserError (one line, exit 2)."""
    if (why := missing(what)) is not None:
        raise UserError(why)


def _run(*words: str, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(words), capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise UserError(f"{' '.join(words)}: {(done.stderr or done.stdout).strip() or 'failed'}")
    return done


def load(name: str) -> Cluster | None:
    """The record of cluster ``name``, or None if there is none."""
    try:
        record = json.loads((ROOT / check_name(name) / "cluster.json").read_text())
        return Cluster(**{**record, "killed": tuple(record.get("killed", ()))})
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        why = f"{ROOT / name / 'cluster.json'} cannot be read ({exc})"
        raise UserError(f"{why}: dtrain cluster down --name {name}") from None


def _save(cluster: Cluster) -> None:
    cluster.folder.mkdir(parents=True, exist_ok=True)
    part = cluster.folder / "cluster.json.part"
    part.write_text(json.dumps(asdict(cluster), indent=1) + "\n")
    part.replace(cluster.folder / "cluster.json")


def left_of(name: str) -> dict[str, list[str]]:
    """What of cluster ``name`` exists now, found by its names: namespaces, links (the bridge, veths), its folder."""
    node = re.compile(rf"^{re.escape(name)}-n\d+$")
    link = re.compile(rf"^(dtb-{re.escape(name)}|dtv-{re.escape(name)}-\d+)$")
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-o", "link", "show").stdout.splitlines()]
    return {
        "namespaces": sorted((n for n in namespaces if node.match(n)), key=_number),
        "links": sorted((n for n in links if link.match(n)), key=_number),
        "files": [str(ROOT / name)] if (ROOT / name).exists() else [],
    }


def _number(text: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", text))


def _free_subnet() -> str:
    """The first 10.213.X.0/24 that no address or route of this machine (nor another cluster) overlaps."""
    used = []
    for line in _run("ip", "-o", "-4", "route", "show", "table", "all").stdout.splitlines():
        for word in line.split()[:2]:  # "10.0.0.0/8 via ...", or after its type: "local ...", "unreachable ..."
            try:
                used.append(ipaddress.ip_network(word, strict=False))
                break
            except ValueError:  # ("default": overlaps nothing a /24 of our own would shadow)
                continue
    for line in _run("ip", "-o", "-4", "addr").stdout.splitlines():
        used.append(ipaddress.ip_interface(line.split()[3]).network)
    for subnet in SUBNETS:
        if not any(subnet.overlaps(net) for net in used):
            return str(subnet)
    raise UserError("no free subnet in 10.213.0.0/16 for a cluster: take some down (dtrain cluster down --name N)")


# === up, status, down


def up(name: str, nodes: int, slots: int, link: str | None) -> Cluster:
    """Make cluster ``name`` and return it; anything half made is removed again if making it fails."""
    check_name(name)
    if not 1 <= nodes <= MAX_NODES:
        raise UserError(f"--nodes {nodes}: give 1 to {MAX_NODES} nodes")
    if not 1 <= slots <= MAX_SLOTS:
        raise UserError(f"--slots {slots}: give 1 to {MAX_SLOTS} slots a node")
    if link is not None:
        link = link.strip().lower()
        rate_bits_s(link)
    require_tools("dtrain cluster up")
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".lock", "w") as lock:  # two ups at once must not take the same subnet, nor the same name
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _up_locked(name, nodes, slots, link)


def _up_locked(name: str, nodes: int, slots: int, link: str | None) -> Cluster:
    left = left_of(name)
    if any(left.values()):
        known = load(name) if (ROOT / name / "cluster.json").exists() else None
        state = "is up" if known and known.ready and left["namespaces"] else "is half made (an up that was stopped?)"
        raise UserError(f"cluster {name} {state}: dtrain cluster down --name {name} first, or --name another")
    cluster = Cluster(name, nodes, slots, link, _free_subnet())
    _save(cluster)  # first: from here on, a killed up leaves a record for down
    try:
        _make(cluster)
        cluster.latency_us, cluster.measured_bits_s = _measure(cluster) if nodes > 1 else (None, None)
        cluster.ready = True
        _save(cluster)
    except BaseException:
        down(name)
        raise
    return cluster


def _make(c: Cluster) -> None:
    net = ipaddress.ip_network(c.subnet)
    _run("ip", "link", "add", c.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{net[1]}/{net.prefixlen}", "dev", c.bridge)
    _run("ip", "link", "set", c.bridge, "up")
    for i, node in enumerate(c.names, 1):
        _run("ip", "netns", "add", node)
        _run("ip", "link", "add", c.veth(i), "type", "veth", "peer", "name", "eth0", "netns", node)
        _run("ip", "link", "set", c.veth(i), "master", c.bridge, "up")
        _run("ip", "-n", node, "addr", "add", f"{c.address(i)}/{net.prefixlen}", "dev", "eth0")
        _run("ip", "-n", node, "link", "set", "eth0", "up")
        _run("ip", "-n", node, "link", "set", "lo", "up")
        if c.link is not None:  # a token bucket each way: RATE out of the node, RATE into it
            _shape("ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", "eth0", link=c.link)
            _shape("tc", "qdisc", "add", "dev", c.veth(i), link=c.link)
    c.script.write_text(launch_script(c))
    c.script.chmod(0o755)
    _write_hostfile(c)


def _shape(*words: str, link: str) -> None:
    bits = rate_bits_s(link)
    # The bucket's depth: what may leave at once, faster than the rate. A real link sends nothing faster than its rate,
    # so as small as the kernel allows while still reaching the rate: 16 KiB (a 64 KiB bucket let top-k's 54 KB
    # messages through at memory speed), or one millisecond of the rate where that is more (above 131 Mbit/s: with
    # a tenth of a millisecond a stream at 1gbit reached 730 Mbit/s, at 5gbit 3.4 Gbit/s; with one, 969 and 4,988).
    burst = max(16 * 1024, int(bits / 8 * 0.001))
    _run(*words, "root", "tbf", "rate", link, "burst", str(burst), "latency", "50ms")


def launch_script(c: Cluster) -> str:
    """The program hydra runs instead of ssh: ``SCRIPT [ssh's options] HOST COMMAND...`` runs COMMAND in node HOST's
    network namespace, in a hostname namespace of its own whose name is HOST (what MPI_Get_processor_name says)."""
    nodes = "|".join(c.names)
    return f"""#!/bin/bash
# dtrain cluster {c.name}: started by mpiexec (hydra) as it would start ssh: SCRIPT [options] HOST COMMAND...
while [[ "$1" == -* ]]; do shift; done
host="$1"; shift
case "$host" in
  {nodes}) ;;
  *) echo "dtrain cluster {c.name}: no node named $host (nodes: {", ".join(c.names)})" >&2; exit 255 ;;
esac
exec ip netns exec "$host" unshare --uts /bin/bash -c 'hostname "$0" && exec /bin/bash -c "$1"' "$host" "$*"
"""


_PROBE = r"""
import socket, sys, time
role, host, port, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "serve":
    s = socket.create_server((host, port)); c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(200): c.sendall(c.recv(1))
    got = 0
    while got < total: got += len(c.recv(1 << 20))
    c.sendall(b"k")
else:
    for _ in range(100):
        try: c = socket.create_connection((host, port)); break
        except OSError: time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.perf_counter()
    for _ in range(200): c.sendall(b"x"); c.recv(1)
    half_rtt = (time.perf_counter() - t) / 400
    t = time.perf_counter(); c.sendall(bytes(total)); c.recv(1)
    print(half_rtt * 1e6, total * 8 / (time.perf_counter() - t - 2 * half_rtt))
"""


def _measure(c: Cluster) -> tuple[float, float]:
    """One way latency (microseconds) and the rate a TCP stream reaches (bits/s), node 1 to node 2."""
    import sys

    total = 8 << 20 if c.link_bits_s is None or c.link_bits_s >= 4e8 else max(256 << 10, int(c.link_bits_s / 8 / 4))
    port = "47613"
    inside = ["ip", "netns", "exec"]
    server = subprocess.Popen([*inside, c.node(1), sys.executable, "-c", _PROBE, "serve", c.address(1), port,
                               str(total)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        done = _run(*inside, c.node(2), sys.executable, "-c", _PROBE, "call", c.address(1), port, str(total))
        latency, bits = map(float, done.stdout.split())
        return round(latency, 1), round(bits, -3)
    finally:
        server.kill()
        server.wait()


def _write_hostfile(c: Cluster) -> None:
    about = f"{c.nodes} node(s) x {c.slots} slot(s), link {c.link or 'unshaped'}"
    if c.killed:
        about += f"; killed: {', '.join(c.killed)}"
    lines = [cluster_comment(c.name, about), *(f"{node}:{c.slots}" for node in c.names if node not in c.killed)]
    part = c.folder / "hostfile.part"  # (a launcher reading it between two attempts sees the old or the new file)
    part.write_text("\n".join(lines) + "\n")
    part.replace(c.hostfile)


def kill(name: str, node: str, cut_link: bool = False) -> list[int]:
    """A whole node dies: every process in its namespace is killed and the node leaves the hostfile (as a cluster's
    scheduler takes a dead machine out), so that a launcher reading the hostfile again goes on without it
    (``dtrain launch --max-restarts 1 --min-ranks M``). The PIDs killed.

    Killed processes still say goodbye: their kernel closes their connections, so mpiexec learns at once that the
    node's proxy is gone. ``cut_link`` first takes the node's link down, as a power failure would: nothing is said,
    and the other ranks wait until the watchdog (``--timeout``) ends the job."""
    cluster = status(name)
    if node not in cluster.names or node in cluster.killed:
        alive = [n for n in cluster.names if n not in cluster.killed]
        raise UserError(f"cluster {name} has no live node {node!r}: its live nodes are {', '.join(alive) or 'none'}")
    if cut_link:
        _run("ip", "-n", node, "link", "set", "eth0", "down")
    pids = processes_in(node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.killed = (*cluster.killed, node)
    _save(cluster)
    _write_hostfile(cluster)
    return pids


def shaping(c: Cluster, i: int) -> tuple[str, str]:
    """Node ``i``'s shaping as the kernel has it (not as the record says): the rate out of it and into it."""

    def rate(device: str, *netns: str) -> str:
        shown = _run("tc", *netns, "qdisc", "show", "dev", device, check=False).stdout
        found = re.search(r"\btbf\b.*?\brate (\S+)", shown)
        return found[1] if found else "unshaped"

    return rate("eth0", "-n", c.node(i)), rate(c.veth(i))


def processes_in(node: str) -> list[int]:
    return [int(p) for p in _run("ip", "netns", "pids", node, check=False).stdout.split() if p.isdigit()]


def down(name: str) -> list[str]:
    """Remove everything of cluster ``name``: its processes, namespaces, links and files; what was removed."""
    check_name(name)
    require_tools("dtrain cluster down")
    left = left_of(name)
    removed = []
    pids = [pid for node in left["namespaces"] for pid in processes_in(node)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.05)
    if pids:
        removed.append(f"{len(pids)} process(es)")
    for node in left["namespaces"]:  # (its end of the veth goes with it, and so the pair)
        _run("ip", "netns", "delete", node, check=False)
    for link in left["links"]:
        _run("ip", "link", "delete", link, check=False)
    for folder in left["files"]:
        shutil.rmtree(folder, ignore_errors=True)
    still = left_of(name)
    if any(still.values()):
        raise UserError(f"cluster {name}: could not remove {', '.join(x for what in still.values() for x in what)}")
    removed += [*left["namespaces"], *left["links"], *left["files"]]
    return removed


def status(name: str) -> Cluster:
    """Cluster ``name``, checked to be up and whole."""
    check_name(name)
    cluster = load(name)
    if cluster is None:
        raise UserError(f"no cluster named {name} (dtrain cluster up --nodes N --slots K --name {name})")
    left = left_of(name)
    if not cluster.ready or len(left["namespaces"]) != cluster.nodes:
        raise UserError(f"cluster {name} is half made or was broken: dtrain cluster down --name {name}, then up")
    return cluster


def mpiexec_args(name: str) -> list[str]:
    """What MPICH's mpiexec needs to start ranks on cluster ``name``'s nodes (it must be up)."""
    require_tools(f"a job on cluster {name}'s nodes")
    cluster = status(name)
    words = ["-launcher", "ssh", "-launcher-exec", str(cluster.script), "-iface", cluster.bridge]
    for variable, value in NETWORK_ENV.items():
        words += ["-genv", variable, value]
    return words

"""A cluster on this machine: nodes that are Linux network namespaces on a bridge of their own, each behind a link
shaped to a rate, so that MPI's bytes between nodes cross a (slow) network for real, while the ranks of one node
still share its memory.

``dtrain cluster up --nodes 2 --slots 2 --link 100mbit`` makes::

    this machine (root)        bridge dtb-NAME  198.18.X.1/24  (the launcher's side: mpiexec listens here)
    ──────────────┬───────────────────────────────────────────────┬──────────────────────────────────────
       dtv-NAME-1 │ tbf RATE: what node 1 receives                │ dtv-NAME-2 │ tbf RATE
             veth │                                               │ veth
    ┌─────────────┴─────────────────┐             ┌───────────────┴───────────────┐
    │ node NAME-n1 (a network and a │             │ node NAME-n2                  │
    │ hostname namespace)           │             │                               │
    │ eth0 198.18.X.11, tbf RATE:   │             │ eth0 198.18.X.12, tbf RATE    │
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

Network safety: addresses only on the cluster's own bridge and in the namespaces it makes, on a /24 of 198.18.0.0/15
(set aside for benchmarking networks, RFC 2544) that no route or address of this machine touches; no default route in
a node, no NAT, the bridge forwards nothing to the machine's other interfaces (IPv4 forwarding off on it, IPv6 off on
every link made): a node reaches the other nodes and the bridge, nothing else.

What a cluster is, is its record (ROOT/NAME/cluster.json), written before ``up`` makes anything: ``down`` removes
exactly what the record names (a half-made cluster, left by an ``up`` that was killed, too), and touches nothing it
has no record of making. ``up``, ``kill`` and ``down`` take one lock, so they never interleave.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dtrain.errors import UserError
from dtrain.launch.hosts import Host, cluster_comment

ROOT = Path(os.environ.get("DTRAIN_CLUSTER_ROOT", "/run/dtrain/clusters"))  # (gone at reboot, as namespaces are)
NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # so that "dtv-NAME-64" fits Linux's 15 characters for a link
MAX_NODES, MAX_SLOTS = 64, 256
SUBNETS = [ipaddress.ip_network(f"198.18.{x}.0/24") for x in range(256)]
RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's units: powers of ten, bits per second
SLOWEST, FASTEST = 1e6, 1e11  # (below a megabit, a job's start-up alone would take minutes)
NETWORK_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}  # (between nodes: TCP on the node's link)
TOOLS = ("ip", "tc", "unshare")  # iproute2's, and util-linux's
SYSTEM_BIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")  # (where they live, if a root shell's PATH lacks them)


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
    killed: tuple[str, ...] = ()  # the nodes ``dtrain cluster kill`` took down (out of the hostfile, processes ended)
    latency_us: float | None = None  # one way, a TCP message of one byte between node 1 and node 2
    measured_bits_s: float | None = None  # node 1 to node 2, a TCP stream

    def node(self, i: int) -> str:  # the node's name: its host name in the hostfile, its namespace and hostname
        return f"{self.name}-n{i}"

    @property
    def names(self) -> list[str]:
        return [self.node(i) for i in range(1, self.nodes + 1)]

    @property
    def live(self) -> list[str]:
        return [node for node in self.names if node not in self.killed]

    @property
    def bridge(self) -> str:
        return f"dtb-{self.name}"

    def veth(self, i: int) -> str:  # this machine's end of node i's link (the node's end is its eth0)
        return f"dtv-{self.name}-{i}"

    @property
    def links(self) -> list[str]:
        return [self.bridge, *(self.veth(i) for i in range(1, self.nodes + 1))]

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


# === what may be asked, and what this machine needs


def check_name(name: str) -> str:
    if not NAME.match(name or ""):
        raise UserError(f"cluster name {name!r}: use 1-8 lowercase letters and digits, starting with a letter")
    return name


def rate_bits_s(text: str) -> float:
    """``100mbit`` -> 1e8: tc's spelling of a rate, in bits per second (from 1mbit to 100gbit)."""
    match = RATE.match(text.strip().lower())
    if match is None:
        raise UserError(f"--link {text!r}: give a rate as tc spells it: 10mbit, 100mbit, 1gbit, 2500kbit")
    bits = float(match[1]) * RATE_UNITS[match[2]]
    if not SLOWEST <= bits <= FASTEST:
        raise UserError(f"--link {text!r}: give a rate from 1mbit to 100gbit")
    return bits


def missing(what: str = "a cluster on this machine") -> str | None:
    """Why ``what`` cannot be done here (not root, a tool missing), or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"{what} needs root (network namespaces and links are made by root)"
    tools = [name for name in TOOLS if tool(name) is None]
    if tools:
        return f"{what} needs {' and '.join(tools)} (iproute2, util-linux), not found on PATH nor in /usr/sbin, /sbin"
    return None


def tool(name: str) -> str | None:
    """Where the program ``name`` is: on PATH, else where systems keep root's tools."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SYSTEM_BIN))


def require_tools(what: str) -> None:
    """:func:`missing`'s reason as a UserError (one line, exit 2)."""
    if (why := missing(what)) is not None:
        raise UserError(why)


# === the record, and the one lock


def load(name: str) -> Cluster | None:
    """The record of cluster ``name``, or None if there is none."""
    try:
        record = json.loads((ROOT / check_name(name) / "cluster.json").read_text())
        return Cluster(**{**record, "killed": tuple(record.get("killed", ()))})
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        why = f"{ROOT / name / 'cluster.json'} cannot be read ({exc})"
        raise UserError(f"{why}: remove what it made by hand (ip netns, ip link) and then {ROOT / name}") from None


def _save(cluster: Cluster) -> None:
    cluster.folder.mkdir(parents=True, exist_ok=True)
    part = cluster.folder / "cluster.json.part"
    part.write_text(json.dumps(asdict(cluster), indent=1) + "\n")
    part.replace(cluster.folder / "cluster.json")


@contextlib.contextmanager
def _locked():
    """One ``up``, ``kill`` or ``down`` at a time on this machine: none sees another's half-done work, and two ups
    never take the same subnet."""
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def present(c: Cluster) -> dict[str, list[str]]:
    """Which of the namespaces and links cluster ``c``'s record names exist now (and its folder)."""
    namespaces = set(_namespaces())
    links = set(_links())
    return {
        "namespaces": [n for n in c.names if n in namespaces],
        "links": [link for link in c.links if link in links],
        "files": [str(c.folder)] if c.folder.exists() else [],
    }


def _named_like(name: str) -> list[str]:
    """Namespaces and links named as cluster ``name``'s would be: someone else's, if dtrain has no record of them."""
    node = re.compile(rf"^{re.escape(name)}-n\d+$")
    link = re.compile(rf"^(dtb-{re.escape(name)}|dtv-{re.escape(name)}-\d+)$")
    return [n for n in _namespaces() if node.match(n)] + [n for n in _links() if link.match(n)]


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    return [line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-o", "link", "show").stdout.splitlines()]


# === up


def up(name: str, nodes: int, slots: int, link: str | None) -> Cluster:
    """Make cluster ``name`` and return it; what was made is removed again if making it fails."""
    check_name(name)
    if not 1 <= nodes <= MAX_NODES:
        raise UserError(f"--nodes {nodes}: give 1 to {MAX_NODES} nodes")
    if not 1 <= slots <= MAX_SLOTS:
        raise UserError(f"--slots {slots}: give 1 to {MAX_SLOTS} slots a node")
    if link is not None:
        link = link.strip().lower()
        rate_bits_s(link)
    require_tools("dtrain cluster up")
    with _locked():
        known = load(name)
        if known is not None:
            state = "is up" if known.ready else "is half made (an up that was stopped?)"
            raise UserError(f"cluster {name} {state}: dtrain cluster down --name {name} first, or --name another")
        if strays := _named_like(name):
            raise UserError(f"{', '.join(strays)}: named as cluster {name}'s would be, but not made by dtrain cluster "
                            f"up (no record): --name another")  # fmt: skip
        cluster = Cluster(name, nodes, slots, link, _free_subnet())
        _save(cluster)  # first: from here on, a killed up leaves a record for down
        try:
            _make(cluster)
            cluster.latency_us, cluster.measured_bits_s = _measure(cluster) if nodes > 1 else (None, None)
            cluster.ready = True
            _save(cluster)
        except BaseException:
            _remove(cluster)
            raise
    return cluster


def _free_subnet() -> str:
    """The first 198.18.X.0/24 that no address or route of this machine (nor another cluster) overlaps."""
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
    raise UserError("no free subnet in 198.18.0.0/16 for a cluster: take some down (dtrain cluster down --name N)")


def _make(c: Cluster) -> None:
    net = ipaddress.ip_network(c.subnet)
    _run("ip", "link", "add", c.bridge, "type", "bridge")
    _isolate(c.bridge, forwarding=False)
    _run("ip", "addr", "add", f"{net[1]}/{net.prefixlen}", "dev", c.bridge)
    _run("ip", "link", "set", c.bridge, "up")
    for i, node in enumerate(c.names, 1):
        _run("ip", "netns", "add", node)
        _run("ip", "link", "add", c.veth(i), "type", "veth", "peer", "name", "eth0", "netns", node)
        _isolate(c.veth(i))
        _isolate("eth0", node)
        _run("ip", "link", "set", c.veth(i), "master", c.bridge, "up")
        _run("ip", "-n", node, "addr", "add", f"{c.address(i)}/{net.prefixlen}", "dev", "eth0")
        _run("ip", "-n", node, "link", "set", "eth0", "up")
        _run("ip", "-n", node, "link", "set", "lo", "up")
        if c.link is not None:  # a token bucket each way: RATE out of the node, RATE into it
            _shape("ip", "netns", "exec", node, tool("tc"), "qdisc", "add", "dev", "eth0", link=c.link)
            _shape("tc", "qdisc", "add", "dev", c.veth(i), link=c.link)
    c.script.write_text(launch_script(c))
    c.script.chmod(0o755)
    _write_hostfile(c)


def _isolate(device: str, node: str | None = None, forwarding: bool = True) -> None:
    """No IPv6 on ``device`` (no link-local addresses, no router solicitations leaving the bridge), and on the
    bridge no IPv4 forwarding either: a packet from a node is never routed on to the machine's other interfaces,
    whatever the machine's own ip_forward says."""
    settings = [f"/proc/sys/net/ipv6/conf/{device}/disable_ipv6=1"]
    if not forwarding:
        settings.append(f"/proc/sys/net/ipv4/conf/{device}/forwarding=0")
    for setting in settings:
        path, value = setting.split("=")
        if node is None:
            if os.path.exists(path):  # (a kernel without IPv6 has no such file)
                Path(path).write_text(value)
        else:  # (a namespace's /proc/sys/net is its own: written from inside it)
            _run("ip", "netns", "exec", node, "sh", "-c", f"[ ! -e {path} ] || echo {value} > {path}")


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
    network namespace, in a hostname namespace of its own whose name is HOST (what MPI_Get_processor_name says).

    Nothing ties the proxy's life to mpiexec's but their connection, as across real machines: when mpiexec dies,
    hydra's proxy sees the connection close and ends its ranks. (Killing the proxy with mpiexec instead, by a parent
    death signal, would leave its ranks running, orphaned.)"""
    nodes = "|".join(c.names)
    return f"""#!/bin/bash
# dtrain cluster {c.name}: started by mpiexec (hydra) as it would start ssh: SCRIPT [options] HOST COMMAND...
while [[ "$1" == -* ]]; do shift; done
host="$1"; shift
case "$host" in
  {nodes}) ;;
  *) echo "dtrain cluster {c.name}: no node named $host (nodes: {", ".join(c.names)})" >&2; exit 255 ;;
esac
exec {tool("ip")} netns exec "$host" {tool("unshare")} --uts \\
  /bin/bash -c 'hostname "$0" && exec /bin/bash -c "$1"' "$host" "$*"
"""


def _write_hostfile(c: Cluster) -> None:
    about = f"{c.nodes} node(s) x {c.slots} slot(s), link {c.link or 'unshaped'}"
    if c.killed:
        about += f"; killed: {', '.join(c.killed)}"
    lines = [cluster_comment(c.name, about), *(f"{node}:{c.slots}" for node in c.live)]
    part = c.folder / "hostfile.part"  # (a launcher reading it between two attempts sees the old or the new file)
    part.write_text("\n".join(lines) + "\n")
    part.replace(c.hostfile)


def _measure(c: Cluster) -> tuple[float, float]:
    """One way latency (microseconds) and the rate a TCP stream reaches (bits/s), node 1 to node 2: about a second."""
    seconds = 0.5  # of the stream at the link's rate (8 MiB on an unshaped link)
    nbytes = 8 << 20 if c.link_bits_s is None else max(64 << 10, int(c.link_bits_s / 8 * seconds))
    probe = [sys.executable, "-m", "dtrain.launch.linkprobe"]
    where = [c.address(1), "47613", str(nbytes)]
    serve = [tool("ip"), "netns", "exec", c.node(1), *probe, "serve", *where]
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        done = _run("ip", "netns", "exec", c.node(2), *probe, "call", *where, check=False)
    finally:
        server.kill()
        server.wait()
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UserError(f"cluster {c.name}: node 2 cannot reach node 1 over bridge {c.bridge} ({said}); a firewall "
                        "that filters bridged traffic (bridge-nf-call-iptables with a FORWARD policy of DROP, as "
                        "Docker sets) would do this")  # fmt: skip
    latency, bits = map(float, done.stdout.split())
    return round(latency, 1), round(bits, -3)


# === status


def status(name: str) -> Cluster:
    """Cluster ``name``, checked to be up and whole."""
    check_name(name)
    require_tools(f"dtrain cluster status --name {name}")
    cluster = load(name)
    if cluster is None:
        raise UserError(f"no cluster named {name} (dtrain cluster up --nodes N --slots K --name {name})")
    if not cluster.ready or len(present(cluster)["namespaces"]) != cluster.nodes:
        raise UserError(f"cluster {name} is half made or was broken: dtrain cluster down --name {name}, then up")
    return cluster


def shaping(c: Cluster, i: int) -> tuple[str, str]:
    """Node ``i``'s link as the kernel has it (not as the record says): the rate out of it and the rate into it
    ("down": the link is cut)."""

    def rate(device: str, *netns: str) -> str:
        if "state DOWN" in _run("ip", *netns, "-o", "link", "show", device, check=False).stdout:
            return "down"
        shown = _run("tc", *netns, "qdisc", "show", "dev", device, check=False).stdout
        found = re.search(r"\btbf\b.*?\brate (\S+)", shown)
        return found[1] if found else "unshaped"

    return rate("eth0", "-n", c.node(i)), rate(c.veth(i))


def processes_in(node: str) -> list[int]:
    return [int(p) for p in _run("ip", "netns", "pids", node, check=False).stdout.split() if p.isdigit()]


# === kill: a whole node dies


def kill(name: str, node: str, cut_link: bool = False) -> list[int]:
    """A whole node dies: every process in its namespace is killed and the node leaves the hostfile (as a cluster's
    scheduler takes a dead machine out), so that a launcher reading the hostfile again goes on without it
    (``dtrain launch --max-restarts 1 --min-ranks M``). The PIDs killed.

    Killed processes still say goodbye: their kernel closes their connections, so mpiexec learns at once that the
    node's proxy is gone. ``cut_link`` first takes the node's link down, as a power failure would: nothing is said,
    and the other ranks wait until the watchdog (``--timeout``) ends the job."""
    with _locked():
        cluster = status(name)
        if node not in cluster.live:
            raise UserError(f"cluster {name} has no live node {node!r}: its live nodes are "
                            f"{', '.join(cluster.live) or 'none'}")  # fmt: skip
        if cut_link:
            _run("ip", "-n", node, "link", "set", "eth0", "down")
        cluster.killed = (*cluster.killed, node)
        _save(cluster)
        _write_hostfile(cluster)  # (before the kill: a launcher that restarts at once must not find it)
        return _end_processes([node], signal.SIGKILL)


def _end_processes(nodes: list[str], first=signal.SIGTERM) -> list[int]:
    """End every process in ``nodes``' namespaces: ``first``, then SIGKILL after a second (hydra's proxies ignore
    SIGTERM), looking again until none is left (a process may start there meanwhile). The PIDs ended."""
    ended: list[int] = []
    deadline, sig = time.monotonic() + 1, first
    while pids := [pid for node in nodes for pid in processes_in(node)]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        ended += [pid for pid in pids if pid not in ended]
        time.sleep(0.05)
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        if time.monotonic() > deadline + 10:
            raise UserError(f"processes {pids} in {', '.join(nodes)} did not end within 11 s, even killed")
    return ended


# === down


def down(name: str) -> list[str]:
    """Remove everything of cluster ``name`` its record names: its processes, namespaces, links and files, whether
    it is up or half made. What was removed (empty: there was no such cluster)."""
    check_name(name)
    require_tools("dtrain cluster down")
    with _locked():
        cluster = load(name)
        if cluster is None:
            if strays := _named_like(name):
                raise UserError(f"{', '.join(strays)}: named as cluster {name}'s would be, but dtrain has no record "
                                f"of making them ({ROOT / name}/cluster.json): not removed")  # fmt: skip
            return []
        return _remove(cluster)


def _remove(c: Cluster) -> list[str]:
    """``down`` with the lock held (and ``up``'s way back when making fails)."""
    c.hostfile.unlink(missing_ok=True)  # first, so that no new job gets in
    c.script.unlink(missing_ok=True)
    there = present(c)
    pids = _end_processes(there["namespaces"])
    for node in there["namespaces"]:  # (its end of each veth goes with it, and so the pair)
        _run("ip", "netns", "delete", node, check=False)
    for link in there["links"]:
        _run("ip", "link", "delete", link, check=False)
    shutil.rmtree(c.folder, ignore_errors=True)
    still = present(c)
    if any(still.values()):
        raise UserError(f"cluster {c.name}: could not remove {', '.join(x for what in still.values() for x in what)}")
    return [f"{len(pids)} process(es)"] * bool(pids) + [*there["namespaces"], *there["links"], *there["files"]]


# === a job on the nodes


def mpiexec_args(name: str, hosts: list[Host]) -> list[str]:
    """What MPICH's mpiexec needs to start ranks on ``hosts``, live nodes of cluster ``name`` (which must be up)."""
    require_tools(f"a job on cluster {name}'s nodes")
    cluster = status(name)
    strangers = [h.name for h in hosts if h.name not in cluster.live]
    if strangers:
        raise UserError(f"{', '.join(strangers)}: not a live node of cluster {name} (its live nodes: "
                        f"{', '.join(cluster.live) or 'none'}); the hostfile must name only those")  # fmt: skip
    words = ["-launcher", "ssh", "-launcher-exec", str(cluster.script), "-iface", cluster.bridge]
    for variable, value in NETWORK_ENV.items():
        words += ["-genv", variable, value]
    return words


def _run(*words: str, check=True) -> subprocess.CompletedProcess:
    """A command of ``ip``'s or ``tc``'s; a failure (or a minute gone) is one line: the command and its first
    words."""
    words = (tool(words[0]) or words[0], *words[1:])  # (ip and tc: where root's shell keeps them, if not on PATH)
    try:
        done = subprocess.run(list(words), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise UserError(f"{' '.join(words)}: no answer within 60 s") from None
    if check and done.returncode != 0:
        said = ((done.stderr or done.stdout).strip().splitlines() or ["failed"])[0]
        raise UserError(f"{' '.join(words)}: {said}")
    return done

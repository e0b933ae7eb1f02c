"""A job's processes, by PID and start time: the tree of the processes mpiexec started, which of them are ranks (and
on which node of a ``dtrain cluster``), whether each still runs, and the shared memory an aborted job leaves behind.

Linux's /proc gives a process's parent and its start time; elsewhere ``ps`` gives the tree (no start times, so a PID
reused within the grace period would be mistaken for the job's: a risk of seconds, on systems without /proc). A
process is never found by its name, which would find other jobs' too.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def stat_of(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid`` from /proc, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (command name)", which may hold spaces
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def tree(root: int) -> dict[int, int]:
    """``root`` and all its descendants now: pid -> start time (0 where unknown)."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := stat_of(int(entry))) is not None:
                children.setdefault(stat[1], []).append(int(entry))
                started[int(entry)] = stat[2]
    else:
        try:
            listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        for line in listing.splitlines():
            pid, ppid = map(int, line.split())
            children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = started.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return tree


RANK_VARIABLES = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=")  # MPICH's hydra, Open MPI


def rank_of(pid: int) -> int | None:
    """The rank MPI gave process ``pid`` (from its environment, in /proc), or None if it is not a rank."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = f.read().split(b"\0")
    except OSError:
        return None
    for variable in variables:
        if variable.startswith(RANK_VARIABLES) and variable.split(b"=", 1)[1].isdigit():
            return int(variable.split(b"=", 1)[1])
    return None


NAMED_NETWORKS = Path("/run/netns")  # where ``ip netns add NAME`` pins a network namespace (a dtrain cluster's node)


def network_namespace(pid: int) -> str | None:
    """The name of the named network namespace (``ip netns``) process ``pid`` is in: on a ``dtrain cluster``, its
    node. None for this machine's own network, a namespace without a name, a process that has ended, or not Linux.
    (Read while the process lives: a dead one's /proc entry, and so its namespace, is gone.)"""
    try:
        mine = os.stat(f"/proc/{pid}/ns/net")
        names = os.listdir(NAMED_NETWORKS)
    except OSError:
        return None
    for name in sorted(names):
        try:
            pinned = os.stat(NAMED_NETWORKS / name)
        except OSError:  # removed in between
            continue
        if (pinned.st_ino, pinned.st_dev) == (mine.st_ino, mine.st_dev):
            return name
    return None


def running(pid: int, started: int) -> bool:
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    stat = stat_of(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started  # a zombie has ended; another start: reused PID


def send(pid: int, started: int, signum: int) -> None:
    if running(pid, started):
        try:
            os.kill(pid, signum)
        except OSError:  # it ended in between
            pass


SHARED_MEMORY = Path("/dev/shm")
SHARED_MEMORY_GRACE_S = 2.0  # how long an aborted job's ranks may take to let go of their segment


def free_shared_memory(since: float) -> None:
    """Remove the shared-memory segments (``/dev/shm/mpich_shm_*``, ~3 MB each) that MPICH's ranks made since
    ``since`` and that no process maps any more.

    The ranks on a machine share one segment; the last to attach removes its name, so a job that ends normally leaves
    nothing. A job killed or aborted before that leaves it, in memory, until the machine restarts: a test suite that
    aborts jobs on purpose left 2.3 GB here in a day. A segment another job still uses is mapped by its ranks
    (``/proc/PID/maps`` names it), so it is kept.
    """
    try:
        mine = [(path, path.stat()) for path in SHARED_MEMORY.glob("mpich_shm_*")]
        made = {path for path, stat in mine if stat.st_ctime >= since - 1 and stat.st_uid == os.getuid()}
        made -= _mapped(made, [Path("/proc/self/maps")])  # this process's own (importing mpi4py made one)
    except OSError:  # no /dev/shm (not Linux), or a segment removed while we looked
        return
    # mpiexec may end a moment before the ranks it killed have unmapped the segment: look again for a little while.
    deadline = time.monotonic() + SHARED_MEMORY_GRACE_S
    while made:
        mapped = _mapped(made)
        for path in made - mapped:
            try:
                path.unlink()
            except OSError:  # removed in between
                pass
        if not mapped or time.monotonic() > deadline:
            return
        made = mapped
        time.sleep(0.05)


def _mapped(paths: set[Path], maps_files=None) -> set[Path]:
    """Those of ``paths`` that a process maps now (as ``/proc/PID/maps`` says; ``maps_files``: only those)."""
    found = set()
    for maps in Path("/proc").glob("[0-9]*/maps") if maps_files is None else maps_files:
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        found |= {path for path in paths if str(path) in text}
    return found

"""Running a job on N ranks to its end: :func:`launch` (its output captured or passed on) and :func:`launch_watched`
(its output passed on but for MPI's banners, and how it ended kept for the launcher to say).

A crash on one rank would hang the others: the target runs under ``python -m dtrain.comm.run``, so a failure on any
rank ends the whole job, and says why once (see :mod:`dtrain.comm.run` and :mod:`dtrain.comm.mpi`). The rest of a
launch is the other modules of :mod:`dtrain.launch`: the command (:mod:`~dtrain.launch.mpiexec`), a job that always
ends whole (:mod:`~dtrain.launch.jobs`), which rank ended first (:mod:`~dtrain.launch.endings`), MPI's banners
(:mod:`~dtrain.launch.banners`).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from dtrain import terminal
from dtrain.launch import mpiexec, processes
from dtrain.launch.banners import WAIT_S, Banners
from dtrain.launch.endings import Endings
from dtrain.launch.hosts import Host
from dtrain.launch.jobs import GRACE_S, Job, JobInterrupted, signal_name


def launch(
    nranks: int,
    target: list[str],
    timeout: float | None = None,
    capture: bool = False,
    hosts: list[Host] | None = None,
    oversubscribe: bool = False,
    **kwargs,
):
    """Run ``target`` on ``nranks`` ranks (on ``hosts``, see :func:`dtrain.launch.mpiexec.command`) and return the
    ``subprocess.CompletedProcess``.

    ``timeout`` (seconds) kills the whole job if it has not finished, so a bug is a failure, not a hang. SIGINT,
    SIGTERM or SIGHUP sent to this process stop the whole job (module docstring) and raise :class:`JobInterrupted`,
    which carries what the job wrote (``output``, ``stderr``) when ``capture`` is on.
    """
    env = mpiexec.environment(mpiexec.ranks_per_host(nranks, hosts), kwargs.pop("env", None))
    cmd = mpiexec.command(nranks, target, kwargs.get("cwd"), hosts, oversubscribe, env)
    pipe = subprocess.PIPE if capture else None
    with Job(cmd, env=env, stdout=pipe, stderr=pipe, text=True, **kwargs) as job:
        try:
            out, err = job.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.stop(signal.SIGKILL)
            out, err = job.process.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        except JobInterrupted as interrupted:
            job.stop(interrupted.signum)
            interrupted.output, interrupted.stderr = job.process.communicate()  # what it wrote before it ended
            raise
    return subprocess.CompletedProcess(cmd, job.process.returncode, out, err)


@dataclass
class Watched:
    """How a job watched by :func:`launch_watched` ended: its exit status, the end of what it wrote (stdout and stderr
    together, as they came), and which process was which rank (pid -> rank, for the ranks seen on this machine)."""

    returncode: int
    tail: str  # the end of its stdout, then the end of its stderr (MPI's banners included)
    ranks: dict[int, int]
    seconds: float
    ended: list[int]  # the ranks in the order their processes ended (the first: the one that died, if one did)
    first_to_end: int | None  # the rank that ended first, if that is known for sure (see Endings)
    banners: str = ""  # MPI's own words on how the job ended, kept off the terminal (dtrain.launch.banners)
    nodes: dict[int, str] = field(default_factory=dict)  # on a dtrain cluster: rank -> its node (network namespace)
    ended_before_s: dict[int, float] = field(default_factory=dict)  # rank -> how long before mpiexec it ended


TAIL_BYTES = 64 * 1024  # enough for MPI's report of a dead rank and the tracebacks before it


def launch_watched(nranks: int, target: list[str], hosts=None, oversubscribe: bool = False, env=None) -> Watched:
    """:func:`launch`, for a launcher that must say afterwards how the job ended (``dtrain launch``): what the job
    writes goes on to this process's stdout and stderr as it comes, but for MPI's own banners about the ending
    (:class:`Banners`, returned for the caller to explain or show), and its end is kept; every moment the job runs,
    its processes are looked at for the rank MPI gave them (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK`` in their
    environment), since a dead rank can no longer say who it was, and MPICH's report names only its PID.

    SIGINT, SIGTERM and SIGHUP stop the whole job and raise :class:`JobInterrupted`, as with :func:`launch`, after
    one line that says the job has ended (MPI's own lines about it are not shown).

    On a ``dtrain cluster`` each rank's node is noted too, from the network namespace its process is in (while it
    lives: a node killed whole can then be named, :func:`dtrain.launch.restarts.ending`)."""
    on_cluster = any(host.cluster for host in hosts or ())
    nodes: dict[int, str] = {}
    env = mpiexec.environment(mpiexec.ranks_per_host(nranks, hosts), env)
    cmd = mpiexec.command(nranks, target, None, hosts, oversubscribe, env)
    tails = (bytearray(), bytearray())
    banners = (Banners(), Banners())  # (stdout's and stderr's)

    reader_gone = threading.Event()  # stdout's reader has gone (``dtrain launch ... | head``)

    def echo(fd, sink, tail, banner):
        """Copy what comes on ``fd`` to ``sink`` as it comes, but MPI's banners, keeping its end; until the job
        closes the pipe."""

        def show(data: bytes) -> None:
            if not data:
                return
            try:  # a closed terminal, or a stream without bytes, must not stop the reading (the job would block)
                if hasattr(sink, "buffer"):
                    sink.buffer.write(data)
                else:
                    sink.write(data.decode(errors="replace"))
                sink.flush()
            except BrokenPipeError:
                if sink is sys.stdout:  # nobody reads what the job prints: it stops, as under mpiexec alone
                    reader_gone.set()
            except Exception:
                pass

        try:
            while True:
                if not select.select([fd], [], [], WAIT_S)[0]:
                    show(banner.due(time.monotonic()))
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                show(banner.feed(chunk, time.monotonic()))
                tail.extend(chunk)
                del tail[:-TAIL_BYTES]
            show(banner.finish())
        finally:
            os.close(fd)

    started = time.monotonic()
    with Job(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as job, Endings() as endings:
        # The readers own copies of the pipes' descriptors: however the job ends, Popen closing its own never pulls
        # a descriptor from under a reader.
        streams = ((job.process.stdout, sys.stdout, tails[0], banners[0]),
                   (job.process.stderr, sys.stderr, tails[1], banners[1]))  # fmt: skip
        readers = [threading.Thread(target=echo, args=(os.dup(pipe.fileno()), sink, tail, banner), daemon=True)
                   for pipe, sink, tail, banner in streams]  # fmt: skip
        for reader in readers:
            reader.start()
        try:
            while job.process.poll() is None:
                if len(job.ranks) < nranks:  # (until every rank has been seen: then nothing is left to look for)
                    for pid in job.note_ranks():
                        endings.watch(pid, job.ranks[pid])
                        if on_cluster and (node := processes.network_namespace(pid)) is not None:
                            nodes[job.ranks[pid]] = node
                if reader_gone.is_set():
                    job.stop(signal.SIGTERM)
                    raise BrokenPipeError("the reader of stdout has gone")  # (dtrain's main: exit 0, quietly)
                time.sleep(0.1)
            finished = time.monotonic()
        except JobInterrupted as interrupted:
            job.stop(interrupted.signum)
            for reader in readers:
                reader.join(timeout=5)
            name = signal_name(interrupted.signum)
            left = job.left(within=GRACE_S)  # (a process killed a moment ago may take that moment to end)
            terminal.tell(f"dtrain launch: stopped by {name}; every rank ended" if not left else
                 f"dtrain launch: stopped by {name}; processes {left} could not be ended")  # fmt: skip
            raise
        for reader in readers:
            reader.join(timeout=5)  # (what the ranks wrote last is still in the pipes)
    text = "\n".join(bytes(tail).decode(errors="replace") for tail in tails)
    held = "".join(bytes(b.held).decode(errors="replace") for b in banners)
    seconds = time.monotonic() - started
    return Watched(job.process.returncode, text, dict(job.ranks), seconds, list(endings.order),
                   endings.first(nranks), held, nodes,
                   {rank: finished - when for rank, when in endings.when.items()})  # fmt: skip

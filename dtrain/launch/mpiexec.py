"""The ``mpiexec`` command that starts N ranks of a program on this machine (or the hosts given): which
``mpiexec``, the environment each rank needs, and the flags in the spelling of the MPI it belongs to.

What ``mpiexec -n 3 python -m dtrain.comm.run script.py`` starts (MPICH's hydra; Open MPI's prterun looks alike)::

    dtrain launch ── mpiexec ── hydra_pmi_proxy ─┬─ rank 0     each box below the launcher is a session of its own
                    (session)   (session)        ├─ rank 1     (setsid): no one signal, and no process group,
                                                 └─ rank 2     reaches them all

What a learner would otherwise meet, handled once: the ``mpiexec`` installed beside this Python (:func:`path`: one
from another MPI on PATH would start N independent worlds of one rank each); one BLAS/Numba thread per rank and
MPICH's yielding wait when ranks outnumber cores (:func:`environment`); the target run under ``python -m
dtrain.comm.run``, so that a failure on any rank ends the whole job and says why once (:mod:`dtrain.comm.run`).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from dtrain import terminal
from dtrain.comm import usable_cores
from dtrain.errors import UserError
from dtrain.launch import cluster, flavours
from dtrain.launch.flavours import Flavour, Mpich
from dtrain.launch.hosts import Host, check_fits

# One thread per rank for every threaded library a rank may load: BLAS (OpenBLAS, MKL), OpenMP, Numba.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
# How long the ranks have to end on their own after the signal is forwarded, before they are killed. Long enough for
# a rank to write its last lines; short enough that a person at the terminal never wonders whether Ctrl-C worked.


def path() -> Path:
    """The ``mpiexec`` that belongs to this Python's environment, else the first on PATH; an error if neither."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return local
    found = shutil.which("mpiexec")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "no mpiexec found beside this Python or on PATH: install dtrain into a virtualenv "
        "(pip install -e .), which brings the mpich wheel and its mpiexec"
    )


# What a process manager puts in each rank's environment to reach it (MPICH's hydra: PMI_FD, HYDI_CONTROL_FD, ...;
# Open MPI's prte: PMIX_*, OMPI_COMM_WORLD_*). A rank that launches a job of its own (a lesson's part on a cluster)
# must not hand them on: the new job's mpiexec would take them for its own and talk to the wrong manager.
A_RANKS_OWN = ("PMI_", "HYDI_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_", "OMPI_COMM_WORLD_")


def environment(nranks: int, base: dict | None = None, flavour: Flavour | None = None) -> dict:
    """The environment for ``nranks`` ranks on this machine: one thread each, yielding waits when oversubscribed,
    and the launcher's terminal's width as ``COLUMNS`` (what the ranks print is fitted to it, :mod:`dtrain.terminal`).

    ``flavour`` says how the MPI spells the yielding wait (by default: that of :func:`path`'s MPI). Values
    already set by the user win (``setdefault``), so ``OMP_NUM_THREADS=4 dtrain launch ...`` still works.
    """
    env = {name: value for name, value in (os.environ if base is None else base).items()
           if not name.startswith(A_RANKS_OWN)}  # fmt: skip
    for name in THREAD_VARIABLES:
        env.setdefault(name, "1")
    # a rank's stdout is a pipe to mpiexec: tell it how wide the terminal at the end of the launcher's is
    width = terminal.columns(sys.stdout) or terminal.columns(sys.stderr)
    if width is not None:
        env.setdefault("COLUMNS", str(width))
    if nranks > usable_cores():  # the same test as dtrain.comm.wait_mode's, so both agree on 'oversubscribed'
        for name, value in (flavour or _flavour()).yield_env().items():
            env.setdefault(name, value)
    return env


def command(
    nranks: int,
    target: list[str],
    cwd=None,
    hosts: list[Host] | None = None,
    oversubscribe: bool = False,
    env: dict | None = None,
) -> list[str]:
    """The command line that runs ``target`` (a script and its args, or ``-m module ...``) on ``nranks`` ranks.

    The target runs under ``python -m dtrain.comm.run`` (:mod:`dtrain.comm.run`), so a failure on any rank ends the
    whole job, said once. A script that does not exist is refused here, in one line, before mpiexec starts N Pythons
    to say so N times (``cwd``: the folder the ranks start in, where a relative path is looked up).

    ``hosts`` (:mod:`dtrain.launch.hosts`) places the ranks on those machines, at most their slots unless
    ``oversubscribe``; without it every rank runs here, as many as asked. The flags are spelled for the MPI this
    ``mpiexec`` belongs to (:mod:`dtrain.launch.flavours`); ``env`` is the job's environment, whose dtrain settings
    must reach the other machines' ranks too (:func:`forwarded`).
    """
    if nranks < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {nranks}")
    if not target:
        raise ValueError("nothing to launch: give a script path or -m module")
    script = target[0]
    found = Path(cwd or ".") / script
    if not script.startswith("-") and not found.is_file():
        what = "is a folder" if found.is_dir() else "does not exist"
        raise UserError(f"{script} {what}: give a Python script, or -m MODULE to run a module")
    if hosts is not None:
        check_fits(nranks, hosts, oversubscribe, "the hosts given")
    words = flags(hosts, oversubscribe, forwarded(os.environ if env is None else env))
    return [str(path()), "-n", str(nranks), *words, sys.executable, "-m", "dtrain.comm.run", *target]


FORWARDED_TOO = ("PYTHONPATH", "COLUMNS")  # (besides the threads and dtrain's own)


def forwarded(env: dict) -> list[str]:
    """The variables of ``env`` a rank on another machine must see: the threads per rank, dtrain's settings
    (``DTRAIN_TIMEOUT``, ``DTRAIN_DEBUG`` ...), ``PYTHONPATH`` and the terminal's width. (MPICH's hydra passes
    every variable on by itself; Open MPI passes only its own ``OMPI_MCA_*`` unless each other one is named.)"""
    return sorted(
        name for name in env if name in THREAD_VARIABLES or name.startswith("DTRAIN_") or name in FORWARDED_TOO
    )


def flags(hosts: list[Host] | None = None, oversubscribe: bool = False, forward=()) -> list[str]:
    """What goes between ``mpiexec -n N`` and the program, in the spelling of :func:`path`'s MPI: the hosts
    and the variables to ``forward`` to them, oversubscription (always on this machine alone), and what running as
    root needs (said on stderr, once)."""
    flavour = flavours.detect(path())
    words = []
    if hosts is not None:
        words += _cluster_args(hosts, flavour) + flavour.hosts_args(hosts) + flavour.forward_args(forward)
    if hosts is None or oversubscribe:  # one machine: as many ranks as asked, as MPICH's hydra always allows
        words += flavour.oversubscribe_args()
    if flavour.root_args() and flavours.running_as_root():
        words += flavour.root_args()
        _say_once(f"dtrain launch: running as root, so {flavour.name} is given {' '.join(flavour.root_args())}")
    return words


def _cluster_args(hosts: list[Host], flavour: Flavour) -> list[str]:
    """How to reach the nodes of a cluster on this machine (:mod:`dtrain.launch.cluster`), if the hosts are one's."""
    name = hosts[0].cluster  # (a hostfile's hosts are all its cluster's, or none is)
    if name is None:
        return []
    if not isinstance(flavour, Mpich):
        raise UserError(
            f"cluster {name}'s nodes are network namespaces that dtrain reaches through MPICH's hydra "
            f"(-launcher-exec); this mpiexec is {flavour}: use the mpich wheel's (pip install mpich)"
        )
    return cluster.mpiexec_args(name, hosts)


def _flavour() -> Flavour:
    try:
        return flavours.detect(path())
    except FileNotFoundError:  # no mpiexec at all: whoever launches will say so; the environment is MPICH's
        return Mpich("MPICH")


def ranks_per_host(nranks: int, hosts: list[Host] | None) -> int:
    """The most ranks any one machine gets: all of them without hosts, or on a dtrain cluster (its nodes share this
    machine's cores); hosts fill their slots in order, then wrap."""
    if hosts is None or hosts[0].cluster is not None:
        return nranks
    placed = [0] * len(hosts)
    left = nranks
    while left > 0:
        for i, host in enumerate(hosts):
            take = min(max(host.slots, 1), left)
            placed[i] += take
            left -= take
            if left == 0:
                break
    return max(placed)


_said: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        terminal.tell(text)

"""Live ranks for the notebooks: N real MPI processes that ``%%px`` cells run on, started and stopped by the notebook.

A notebook's simulator part steps through an algorithm rank by rank, in one process. Its live part runs the same code
on N real MPI ranks: an ipyparallel cluster whose engines are one ``MPI.COMM_WORLD``, as ``ipcluster start -n 4
--engines=mpi`` starts it, but launched the way ``dtrain launch`` launches (:mod:`dtrain.launch.launcher`): this
environment's ``mpiexec`` and its flags, one thread per rank, MPICH's yielding wait when the ranks outnumber the cores::

    notebook kernel ──── ipcontroller (hub, schedulers)        the kernel's cells go to the controller,
    (client, %%px)  └─── mpiexec ── hydra_pmi_proxy ─┬─ engine = rank 0     which passes them to every engine;
                    └─── watcher                     ├─ engine = rank 1     each engine is one MPI rank
                                                     └─ ...

In a notebook, two lines and the ``%%px`` cells between them::

    from dtrain.course import live
    cluster, view = live.begin(4)    # 4 ranks, or one line saying why the live part is skipped
    ...                              # %%px cells: each runs on every rank at once
    live.end(cluster)                # the section's last cell: every process of the cluster stopped

In a script: ``with live.ranks(4) as view: view.execute("...")``, or :func:`start` and :func:`stop`.

**The switch** (``DTRAIN_LIVE``). Unset: the live part runs if ipyparallel can be imported, else it is skipped with
:data:`MISSING`. ``0``: skipped (the test suite's setting, so nbmake runs the simulator parts only). ``1``: required,
so a cluster that cannot start is an error, not a skip (the test of the live parts sets it). When the part is skipped,
every ``%%px`` cell prints that it was, and the notebook runs on to its end.

**Never a hang, nothing left behind.** If the engines have not all registered within ``timeout`` seconds (or mpiexec
ends first), everything is stopped and the error says so, with mpiexec's last lines. Stopping is: engines, then the
controller, then a SIGKILL for whatever is left of their process trees (known by PID and start time). It happens at
the last cell, on leaving the ``with`` block, at the interpreter's exit (atexit), and, when the kernel dies without
cleaning up (killed, as nbclient kills a kernel whose cell timed out), in a watcher process: the cluster's processes
start sessions of their own, so no signal to the kernel's process group reaches them, but the watcher holds a pipe
from the kernel and kills them all once that pipe closes.

Starting 4 engines on the 2-core machine this was written on took 4.4 to 5.3 s when it was idle, up to 10 s when it
was busy (the controller starts its schedulers; the engines import ipyparallel and mpi4py, then wait for the
controller's heartbeat, which :data:`HEARTBEAT_MS` makes every second instead of every three, and they start no nanny
process: with ipyparallel's defaults, 7 to 10 s idle). Stopping took about 1 s idle, up to 3 s busy.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

ENV = "DTRAIN_LIVE"
MISSING = "the live part needs ipyparallel: pip install -e '.[live]'"
TIMEOUT_S = 60.0  # for the engines to register: far above the 5-10 s they take on a busy 2-core machine
HEARTBEAT_MS = 1000  # an engine is registered at the hub's first heartbeat after it connects (ipyparallel: 3000)
ENGINE_ARGS = ["--IPEngine.enable_nanny=False"]  # no nanny process per engine: a rank stuck in MPI ignores signals

_running: dict = {}  # cluster id -> [cluster, client, watcher, processes seen, time.time() at start]: what to end


class LiveUnavailable(RuntimeError):
    """The live part cannot run here (ipyparallel is missing); the message says what to install."""


def why_skipped() -> str | None:
    """Why the live part is skipped (a sentence), or None if it runs; see the module's docstring for the switch."""
    if os.environ.get(ENV, "").strip() == "0":
        return f"{ENV}=0 turns it off (unset it, or set it to 1, to run it)"
    try:
        import ipyparallel  # noqa: F401
    except ImportError:
        return MISSING
    return None


def required() -> bool:
    """``DTRAIN_LIVE=1``: the live part must run; failing to start it is an error."""
    return os.environ.get(ENV, "").strip() == "1"


def start(n: int = 4, timeout: float = TIMEOUT_S):
    """Start a controller and ``n`` MPI engines (one ``MPI.COMM_WORLD``); return ``(cluster, view)``.

    ``view`` is a blocking DirectView on every engine, in rank order. Raises :class:`LiveUnavailable` without
    ipyparallel, :class:`TimeoutError` when the engines have not all registered within ``timeout`` seconds, and
    RuntimeError when mpiexec or the controller ends first or the engines are not one world of ``n`` ranks; in each
    case, and on Ctrl-C, after stopping whatever had started.
    """
    try:
        import ipyparallel
    except ImportError:
        raise LiveUnavailable(MISSING) from None
    command, flags, env = _engine_launch(n)
    profile = tempfile.mkdtemp(prefix="dtrain-live-")  # the cluster's files, not ~/.ipython's: removed by stop()
    log = logging.getLogger("dtrain.course.live")  # ipyparallel's messages: only its errors (this module says the rest)
    log.setLevel(logging.ERROR)
    cluster = ipyparallel.Cluster(n=n, engines="mpi", profile_dir=profile, delay=0, log=log,
                                  controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"])  # fmt: skip
    cluster.config.MPIEngineSetLauncher.engine_args = list(ENGINE_ARGS)
    cluster.config.MPIEngineSetLauncher.mpi_cmd = [command]
    cluster.config.MPIEngineSetLauncher.mpi_args = flags
    cluster.config.MPIEngineSetLauncher.environment = env
    _running[cluster.cluster_id] = [cluster, None, None, {}, time.time()]
    deadline = time.monotonic() + timeout
    try:
        cluster.start_controller_sync()
        cluster.start_engines_sync(n)
        _running[cluster.cluster_id][2] = _watcher(profile, _running[cluster.cluster_id][4], _roots(cluster))
        client = _running[cluster.cluster_id][1] = cluster.connect_client_sync()
        _wait_for_engines(cluster, client, n, timeout, deadline)
        _note_processes(cluster)
        view = client[:]  # engines by id, and an MPI engine's id is its rank
        view.block = True
        ranks, sizes = view["mpi_rank"], view["mpi_size"]  # what every engine set at its start (ipengine --mpi)
        if ranks != list(range(n)) or sizes != [n] * n:
            raise RuntimeError(f"the engines are not one MPI world of {n} ranks (ranks {ranks}, world sizes {sizes}): "
                               f"{command} belongs to another MPI than mpi4py's")  # fmt: skip
    except BaseException:
        stop(cluster)
        raise
    return cluster, view


def stop(cluster) -> float:
    """Stop every process of ``cluster`` (engines, then the controller, then SIGKILL for any left); the seconds it
    took. Nothing to do for None or a cluster already stopped."""
    if cluster is None or cluster.cluster_id not in _running:
        return 0.0
    began = time.monotonic()
    _, client, watcher, seen, started = _running[cluster.cluster_id]
    _note_processes(cluster)
    try:
        if client is not None:
            client.close()
        cluster.stop_engines_sync()  # mpiexec SIGTERM: its ranks end (SIGKILL after 5 s)
        cluster.stop_controller_sync()
    except Exception as error:  # whatever went wrong, what follows still ends every process
        print(f"dtrain.course.live: stopping the cluster: {error!r}; killing what is left", file=sys.stderr)
    finally:
        _kill(seen.values(), started)
        if watcher is not None:
            watcher.stdin.close()  # the watcher's signal (EOF): it kills what it knows of, all gone by now, and ends
            try:
                watcher.wait(timeout=5)
            except subprocess.TimeoutExpired:
                watcher.kill()
                watcher.wait()
        shutil.rmtree(cluster.profile_dir, ignore_errors=True)
        del _running[cluster.cluster_id]
    return time.monotonic() - began


@contextlib.contextmanager
def ranks(n: int = 4, timeout: float = TIMEOUT_S):
    """``with ranks(4) as view:`` a view on ``n`` live MPI ranks, all stopped on leaving the block, however."""
    cluster, view = start(n, timeout)
    try:
        yield view
    finally:
        stop(cluster)


def begin(n: int = 4, timeout: float = TIMEOUT_S):
    """A notebook's live part: start ``n`` ranks and point ``%%px`` at them; ``(cluster, view)``, or ``(None, None)``
    when the part is skipped, after one line saying why (then every ``%%px`` cell says it was skipped).

    A cluster this kernel started earlier (the cell run twice) is stopped first. With ``DTRAIN_LIVE=1`` a failure to
    start raises; otherwise it is said, and the part skipped.
    """
    for cluster, *_ in list(_running.values()):
        stop(cluster)
    reason = why_skipped()
    if reason is None:
        began = time.monotonic()
        try:
            cluster, view = start(n, timeout)
        except Exception as error:
            if required():
                raise
            reason = f"the cluster did not start: {error}"
        else:
            _point_px_cells_at(view)
            launch = cluster.config.MPIEngineSetLauncher
            env = " ".join(f"{k}={v}" for k, v in launch.environment.items())
            print(f"{n} live ranks up in {time.monotonic() - began:.1f} s: one MPI.COMM_WORLD of {n} ipyparallel "
                  f"engines, started by {launch.mpi_cmd[0]}"
                  + (f" with {env}" if env else "")
                  + f"\n%%px cells run on all {n} of them; live.end(cluster) stops them")  # fmt: skip
            return cluster, view
    if required():
        raise LiveUnavailable(reason)
    print(f"Live part skipped: {reason}.\nEach %%px cell below says so, and the rest of the notebook runs as usual.")
    _skip_px_cells(reason)
    return None, None


def end(cluster) -> None:
    """A notebook's last live cell: stop the cluster :func:`begin` started, and say so (nothing if it was skipped)."""
    if cluster is not None and cluster.cluster_id in _running:
        print(f"cluster stopped in {stop(cluster):.1f} s: engines, mpiexec and the controller")


# ----------------------------------------------------------------------------------------------------------------
# How it is done
# ----------------------------------------------------------------------------------------------------------------


def _engine_launch(n: int) -> tuple[str, list[str], dict]:
    """(mpiexec, its flags, the environment variables to add) for ``n`` engines, as ``dtrain launch`` would run them.

    The flags are those dtrain launch puts between ``mpiexec -n N`` and the program (none for MPICH on one machine;
    Open MPI's --map-by :OVERSUBSCRIBE and, as root, --allow-run-as-root). The environment is
    :func:`dtrain.launch.mpiexec.environment`'s, minus what this process already has (so a value the user set still
    wins).
    """
    from dtrain.launch import mpiexec

    added = {k: v for k, v in mpiexec.environment(n).items() if os.environ.get(k) != v}
    return str(mpiexec.path()), mpiexec.flags(), added


def _wait_for_engines(cluster, client, n: int, timeout: float, deadline: float) -> None:
    while len(client.ids) < n:
        engines = next(iter(cluster.engines.values()))
        if engines.state == "after":
            raise RuntimeError(f"mpiexec ended before the {n} engines registered:\n{_tail(engines.get_output())}")
        if cluster.controller is None or cluster.controller.state == "after":
            raise RuntimeError(f"the controller ended before the engines registered:\n"
                               f"{_tail(cluster.controller.get_output()) if cluster.controller else ''}")  # fmt: skip
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(client.ids)} of {n} engines registered within {timeout:g} s, so the cluster "
                               f"was stopped. mpiexec's output so far:\n{_tail(engines.get_output())}")  # fmt: skip
        time.sleep(0.05)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(none)"


def _roots(cluster) -> list[int]:
    """The PIDs of the controller and of mpiexec: every process of the cluster is one of them or below them."""
    return [cluster.controller.pid] + [engines.pid for engines in cluster.engines.values()]


def _note_processes(cluster) -> None:
    """Add every process of the cluster alive now to those :func:`stop` will make sure have ended."""
    import psutil

    seen = _running[cluster.cluster_id][3]
    for root in _roots(cluster) if cluster.controller is not None else []:
        try:
            top = seen.get(root) or psutil.Process(root)  # the one first seen: a reused PID is not it (is_running)
            if top.is_running():
                for process in [top, *top.children(recursive=True)]:
                    seen.setdefault(process.pid, process)
        except psutil.Error:  # ended meanwhile
            pass


def _kill(processes, since: float) -> None:
    """SIGKILL each of ``processes`` (psutil.Process) still running: psutil checks PID and start time, so a PID
    reused by another program is left alone. If any was, remove the shared memory that MPICH's ranks made since
    ``since`` (time.time()) and that no process maps any more: ranks killed before MPI_Finalize leave it in /dev/shm
    (4 MB for 4 ranks) until the machine restarts."""
    import psutil

    def running(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE  # a zombie has ended already
        except psutil.Error:
            return False

    left = [process for process in processes if running(process)]
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(running(process) for process in left):
        time.sleep(0.02)
    if left:
        from dtrain.launch import processes

        processes.free_shared_memory(since)  # (as dtrain launch cleans up after a killed job)


def _watcher(profile: str, started: float, roots: list[int]) -> subprocess.Popen:
    """Start the watcher (:func:`_watch`) in a session of its own, with a pipe from this process as its stdin."""
    return subprocess.Popen([sys.executable, "-m", "dtrain.course.live", "--watch", profile, repr(started),
                             *map(str, roots)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


def _watch(profile: str, started: float, roots: list[int]) -> None:
    """The watcher's loop (``python -m dtrain.course.live --watch PROFILE STARTED PID...``): once the cluster's
    starter is
    gone, kill the cluster (started at ``started``, time.time()) and remove its profile folder.

    It reads nothing from its stdin, a pipe from the process that started the cluster: the pipe ends (EOF) when that
    process closes it (:func:`stop`) or ends, however it ends. Meanwhile, twice a second, it notes every process at or
    below ``roots`` (the controller and mpiexec), so that it can kill them all.
    """
    import select

    import psutil

    known: dict[int, psutil.Process] = {}
    tops = []
    for root in roots:  # once: a root that ends and whose PID is reused must not bring a stranger's tree in
        with contextlib.suppress(psutil.Error):
            tops.append(psutil.Process(root))
    while True:
        for top in tops:
            with contextlib.suppress(psutil.Error):
                if top.is_running():  # (psutil compares the start time too)
                    for process in [top, *top.children(recursive=True)]:
                        known.setdefault(process.pid, process)
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready and not os.read(sys.stdin.fileno(), 1024):
            break
    _kill(known.values(), started)
    shutil.rmtree(profile, ignore_errors=True)


def _point_px_cells_at(view) -> None:
    """``%%px`` runs on ``view``: waits for every rank, then shows what each printed, in rank order; no progress bar;
    Ctrl-C interrupts the cell, not the ranks (a rank stuck in MPI would not notice: live.end stops them)."""
    view.activate()
    magics = _ipython_magics()
    if magics is not None:
        magics.stream_output, magics.progress_after_seconds, magics.signal_on_interrupt = False, -1, None


def _ipython_magics():
    """The ParallelMagics instance that ``view.activate()`` registered in this IPython, if any."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return None if shell is None else shell.magics_manager.registry.get("ParallelMagics")


def _skip_px_cells(reason: str) -> None:
    """In IPython, make ``%px``/``%%px`` print that they are skipped (instead of failing as unknown magics)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return

    def px(line, cell=None):
        print(f"skipped (no live ranks): {reason}")

    shell.register_magic_function(px, "line_cell", "px")


@atexit.register
def _stop_all() -> None:
    for cluster, *_ in list(_running.values()):
        stop(cluster)


if __name__ == "__main__" and sys.argv[1:2] == ["--watch"]:
    _watch(sys.argv[2], float(sys.argv[3]), [int(pid) for pid in sys.argv[4:]])

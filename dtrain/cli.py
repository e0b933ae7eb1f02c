"""``dtrain`` / ``python -m dtrain``: train, launch on N ranks, plot metrics, take the tour.

    dtrain train --dataset digits --epochs 20 --out runs/single
    dtrain launch -n 4 lessons/02_allreduce.py
    dtrain plot runs/single/metrics.json -o runs/single/curves.png
    dtrain tour                                    every paradigm in turn on 4 ranks, and one table
    dtrain plan --ranks 8 --hidden 4096,4096       which paradigm and grid, predicted time and memory
    dtrain exercises init ex && dtrain exercises check 2.1 --path ex

A mistake in what was asked for (a bad flag value, a missing data file, a diverging loss) is one line on stderr
and exit status 2, never a traceback. Under several ranks it is still one line: a mistake every rank finds is said
by rank 0 and every rank exits 2; one that only some ranks find ends the job through ``MPI_Abort``, naming the rank
(:func:`dtrain.comm.mpi.end_job`). Ctrl-C ends the command as a shell expects (status 130) and,
under ``dtrain launch``, stops every rank.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from dtrain import config
from dtrain.errors import EXIT_USER_ERROR, UsageError, UserError


def build_parser() -> argparse.ArgumentParser:
    from dtrain.backend import DEVICES, DTYPES
    from dtrain.optim import OPTIMIZERS

    defaults = config.TrainConfig(batch_size=None)
    parser = config.Parser(prog="dtrain", description="Distributed training from scratch on NumPy and MPI.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=config.Parser)

    t = sub.add_parser("train", help="train the MLP", description="Train the MLP and write DIR/metrics.json.")
    config.add_train_arguments(t)

    launch = sub.add_parser(
        "launch",
        help="run a script or module on N MPI ranks",
        description="Run TARGET on N ranks with this environment's mpiexec, one thread per "
        "rank, and fail-fast on errors. TARGET is a script path or -m module.",
    )
    launch.add_argument("-n", "--ranks", type=int, required=True)
    where = launch.add_mutually_exclusive_group()
    where.add_argument(
        "--hostfile", metavar="FILE", help="place the ranks on the machines FILE lists (node1:4, or node1 slots=4)"
    )
    where.add_argument("--hosts", metavar="A,B:SLOTS", help="place the ranks on these machines (a,b:2,c:4)")
    launch.add_argument(
        "--oversubscribe", action="store_true", help="allow more ranks than the hosts' slots (several ranks a slot)"
    )
    launch.add_argument(
        "--dry-run", action="store_true", help="print the mpiexec command and the environment it adds; start nothing"
    )
    launch.add_argument(
        "--timeout", type=config.seconds, metavar="S", help=config.TIMEOUT_HELP + "; sets DTRAIN_TIMEOUT"
    )
    restarts = launch.add_argument_group("restarts after a dead rank (dtrain.launch.restarts)")
    restarts.add_argument(
        "--max-restarts",
        type=int,
        metavar="K",
        help="when the job fails (a rank killed, an exception, the watchdog; not exit 2, not Ctrl-C), start it again "
        "from the last checkpoint, up to K times; a `-m dtrain train` target goes on from it with --resume",
    )
    restarts.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where the job's checkpoints are (given to dtrain train; needed by --max-restarts)",
    )
    restarts.add_argument(
        "--min-ranks",
        type=int,
        metavar="M",
        help="elastic: a restart reads the hostfile again and goes on with fewer ranks, at least M, if it lists fewer "
        "slots (default: -n)",
    )
    restarts.add_argument(
        "--restart-delay",
        type=float,
        metavar="S",
        help="seconds to wait before a restart (default 2)",
    )
    # argparse's REMAINDER cannot begin with an option, so "-m MODULE" is an option of its own.
    launch.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m MODULE does")
    launch.add_argument("target", nargs=argparse.REMAINDER, help="script and its arguments (or the module's)")

    from dtrain.course import tour

    t = sub.add_parser(
        "tour",
        help="every paradigm on the digits, one after another, and one table of what each costs",
        description=tour.__doc__.split("\n\n")[0] + " Trains the same MLP with every paradigm on --ranks ranks (its "
        "own mpiexec jobs) and prints one table: accuracy, time, bytes and messages per step, state per rank, each "
        "measured beside the paradigm's own prediction.",
    )
    t.add_argument("--ranks", type=int, default=tour.DEFAULT_RANKS, help="ranks per job (default %(default)s)")
    t.add_argument(
        "--paradigms",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        metavar="A,B,...",
        help=f"only these, in this order: the tour's ({', '.join(tour.entries(tour.DEFAULT_RANKS))}) or any "
        "--paradigm name, with its defaults (default: the whole tour)",
    )
    t.add_argument("--epochs", type=int, default=tour.DEFAULT_EPOCHS, help="epochs per run (default %(default)s)")
    t.add_argument("--out", default="runs/tour", metavar="DIR", help="where everything goes (default %(default)s)")
    t.add_argument(
        "--timeout",
        type=float,
        default=tour.DEFAULT_TIMEOUT_S,
        metavar="S",
        help="a job still running after S seconds is stopped, and its ranks' watchdog ends a wait of S/2 seconds "
        "with a report (default %(default)g)",
    )

    t.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu, or gpu: every run on CuPy arrays, the "
        "ranks sharing the node's GPUs (rank %% GPUs) (default %(default)s)",
    )
    t.add_argument("--hostfile", metavar="FILE", help="every job on FILE's hosts, a `dtrain cluster up`'s too "
                   "(--ranks at most its slots)")  # fmt: skip

    _add_plan(sub, defaults, DTYPES, OPTIMIZERS)

    plot = sub.add_parser("plot", help="plot loss/accuracy of one or more runs")
    plot.add_argument("metrics", nargs="+", help="metrics.json files (or run folders)")
    plot.add_argument("-o", "--output", default="curves.png", help="PNG to write, - for stdout (default %(default)s)")

    _add_cluster(sub)
    ex = sub.add_parser(
        "exercises",
        help="the course's exercises: copy them, list them, check yours",
        description="Write dtrain's algorithms yourself: `init DIR` copies the exercise files into DIR, `list` "
        "shows each exercise's status, `check ID` grades yours with the tests dtrain's own code passes, on "
        "simulated ranks and then under mpiexec.",
    )
    ex_sub = ex.add_subparsers(dest="action", required=True, parser_class=config.Parser)
    ex_init = ex_sub.add_parser("init", help="copy the exercise files into DIR (never overwriting a file)")
    ex_init.add_argument("path", metavar="DIR")
    ex_list = ex_sub.add_parser("list", help="every exercise: its lesson, its file, its status in DIR")
    ex_list.add_argument("--path", default=".", metavar="DIR", help="your exercises' folder (default: here)")
    ex_check = ex_sub.add_parser("check", help="grade exercise ID (e.g. 2.1), or all of them")
    ex_check.add_argument("exercise", metavar="ID", help="an exercise, e.g. 2.1, or all")
    ex_check.add_argument("--path", default=".", metavar="DIR", help="your exercises' folder (default: here)")
    ex_check.add_argument("--sim-only", action="store_true", help="only the simulated ranks (fast), no mpiexec")
    ex_check.add_argument("--hostfile", metavar="FILE", help="the mpiexec parts on FILE's hosts, a `dtrain cluster "
                          "up`'s too (a part with more ranks than its slots is skipped, and said so)")  # fmt: skip
    return parser


def _add_cluster(sub) -> None:
    from dtrain.launch import cluster

    c = sub.add_parser(
        "cluster",
        help="a cluster on this machine: nodes as network namespaces, links shaped (root)",
        description=cluster.__doc__.split("\n\n")[0],
    )
    actions = c.add_subparsers(dest="action", required=True, parser_class=config.Parser)
    up = actions.add_parser("up", help="make the nodes, their links and a hostfile (its path: the last line)")
    up.add_argument("--nodes", type=int, required=True, metavar="N", help="how many nodes")
    up.add_argument("--slots", type=int, required=True, metavar="K", help="slots (ranks) a node")
    up.add_argument("--link", metavar="RATE", help="each node's link, each way: 10mbit, 100mbit, 1gbit (default: "
                    "unshaped)")  # fmt: skip
    kill = actions.add_parser("kill", help="a whole node dies: its processes killed, it leaves the hostfile")
    kill.add_argument("--node", required=True, metavar="NODE", help="the node (its name: dtrain-n2)")
    kill.add_argument("--cut-link", action="store_true", help="cut its link first, as a power failure does: no one is "
                      "told, and the others wait for the watchdog (--timeout)")  # fmt: skip
    status = actions.add_parser("status", help="the nodes, their addresses, links and processes")
    down = actions.add_parser("down", help="remove every namespace, link, process and file of the cluster")
    for action in (up, kill, status, down):
        action.add_argument("--name", default="dtrain", help="the cluster's name: 1-8 lowercase letters and digits "
                            "(default %(default)s)")  # fmt: skip


def _add_plan(sub, defaults, dtypes, optimizers) -> None:
    from dtrain.plan import hardware

    p = sub.add_parser(
        "plan",
        help="which paradigm and grid for a model on some hardware: predicted time, bytes and memory per rank",
        description="Price every registered paradigm's configurations for a model on N ranks of some hardware, from "
        "the formulas the tests hold against measurement: step time (compute, communication, bubble), bytes sent per "
        "rank, memory per rank by kind, whether it fits; the best marked and why. Nothing is run (but with --check).",
    )
    model = p.add_argument_group("the model")
    model.add_argument("--hidden", type=config.hidden_sizes, default=(512, 512), help="hidden widths (default 512,512)")
    model.add_argument("--layers", type=int, metavar="L", help="L hidden layers of --width H (instead of --hidden)")
    model.add_argument("--width", type=int, metavar="H", help="the width of the --layers hidden layers")
    model.add_argument("--features", type=int, default=784, help="inputs (default %(default)s)")
    model.add_argument("--classes", type=int, default=10, help="outputs (default %(default)s)")
    model.add_argument("--batch-size", type=int, default=256, help="the global batch (default %(default)s)")
    model.add_argument("--dtype", choices=tuple(dtypes), default=defaults.dtype)
    model.add_argument("--optimizer", choices=tuple(optimizers), default=defaults.optimizer)
    model.add_argument("--momentum", type=float, default=defaults.momentum)
    world = p.add_argument_group("the world and the hardware")
    world.add_argument("--ranks", type=int, help="ranks (default 4, or the --hostfile's slots)")
    world.add_argument("--hostfile", metavar="FILE", help="the machines: ranks and ranks per node from their "
                       "slots; a dtrain cluster's gives its link between nodes too; --check runs on them")  # fmt: skip
    world.add_argument(
        "--machine",
        "--preset",
        metavar="NAME",
        help=f"the hardware, one of the presets: {', '.join(hardware.presets())} (dtrain/plan/hardware.json, with "
        "sources; this: this machine's CPUs, calibration.json's links and compute rates) (default: this, or "
        f"{hardware.GPU_MEASURED} with --device gpu)",
    )
    world.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="where each rank computes: gpu, one GPU per rank (the commands and --check's runs say --device gpu) "
        "(default: the machine's: gpu for a GPU preset, else cpu)",
    )
    world.add_argument("--ranks-per-node", type=int, metavar="K", help="ranks per node (default: the preset's, or "
                       "the --hostfile's slots a node)")  # fmt: skip
    world.add_argument("--flops", type=float, help="sustained FLOP/s of a rank (overrides the preset)")
    world.add_argument("--memory", type=float, metavar="GIB", help="memory per rank in GiB (overrides the preset)")
    for link in ("intra", "inter"):
        where = "inside a node" if link == "intra" else "between nodes"
        world.add_argument(f"--{link}-latency", type=float, metavar="US", help=f"latency {where}, microseconds")
        world.add_argument(f"--{link}-bandwidth", type=float, metavar="GBS", help=f"bandwidth {where}, GB/s")
    which = p.add_argument_group("which configurations")
    which.add_argument("--paradigms", metavar="A,B", help="only these paradigms (default: every registered one)")
    which.add_argument("--tp", type=int, help="only grids with this tensor-parallel size")
    which.add_argument("--pp", type=int, help="only grids with this many pipeline stages")
    which.add_argument("--all", action="store_true", help="every configuration (default: the 20 fastest)")
    which.add_argument("--configuration", action="append", metavar="LABEL", help="only this one, by its label in the "
                       "table ('ddp ring'); again for more; --check runs each one named")  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the plan as JSON (-: to stdout, the table to stderr)")
    out.add_argument("--png", metavar="FILE", help="draw time and memory per configuration (-: to stdout)")
    out.add_argument(
        "--check",
        type=int,
        nargs="?",
        const=3,
        default=0,
        metavar="K",
        help="run the K best (default 3) here (or across --hostfile's machines) for a few steps and print predicted "
        "beside measured",
    )


def main(argv=None) -> int:
    from dtrain.comm import mpi
    from dtrain.launch.jobs import JobInterrupted

    if mpi.launched_size() > 1:  # a rank of a job: first set up how a failure ends the job (before any mistake)
        mpi.install_excepthook()
    try:
        args = build_parser().parse_args(_module_args_are_the_targets(sys.argv[1:] if argv is None else argv))
        if args.command == "train":
            return _train(args)
        if args.command == "launch":
            return _launch(args)
        if args.command == "exercises":
            return _exercises(args)
        if args.command == "cluster":
            from dtrain.launch import cluster_command

            return cluster_command.command(args)
        if args.command == "tour":
            from dtrain.course.tour import tour

            return tour(args.ranks, args.paradigms, args.epochs, args.out, args.timeout, args.device, args.hostfile)
        if args.command == "plan":
            from dtrain.plan import command

            return command(args)
        if args.command == "plot":
            from dtrain import terminal
            from dtrain.report import plot_metrics

            written = plot_metrics(args.metrics, args.output)
            if not terminal.to_stdout(args.output):  # ("-": the PNG itself went to stdout)
                print(written)
            return 0
    except UsageError as exc:
        return _fail(str(exc), exc.prog)
    except UserError as exc:
        return _fail(str(exc))
    except JobInterrupted as exc:  # dtrain launch: the launcher has stopped the job and said so
        return _die_by(exc.signum)
    except KeyboardInterrupt:  # Ctrl-C in a rank (dtrain train): the launcher or mpiexec stops the others
        mpi.leave_interrupted()  # (returns only in a world of one rank)
        sys.stderr.write("dtrain: interrupted\n")
        return mpi.EXIT_INTERRUPTED
    except BrokenPipeError:  # `dtrain ... | head`: the reader had enough, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so Python's own flush at exit is quiet too)
        return 0
    except OSError as exc:  # a missing input, an --out that is a file
        return _fail(str(exc) or type(exc).__name__)
    except MemoryError as exc:  # what was asked does not fit this machine's memory (NumPy's message says how much)
        return _fail(f"not enough memory: {exc or 'MemoryError'} (a smaller model, batch or dataset fits)")
    return 0


def _train(args) -> int:
    from contextlib import redirect_stdout

    import numpy as np

    from dtrain import terminal
    from dtrain.comm import mpi, watchdog
    from dtrain.train import train

    asked = config.TrainConfig(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})
    if asked.timeout is None and not os.environ.get(watchdog.ENV_VAR, "").strip():
        asked.timeout = config.DEFAULT_TIMEOUT_S
    asked.validate()  # before any communication: a bad flag never reaches it
    comm = mpi.world()
    mpi.install_excepthook()  # (main did already, where its launcher's environment names the ranks; else here)
    # Overflow on the way to a NaN loss is reported once, by train(), as TrainingDiverged: no NumPy warnings first.
    # --trace -: the trace alone on stdout, what is printed for people on stderr
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), redirect_stdout(terminal.human(asked.trace)):
        train(asked, comm)
        if asked.out:
            mpi.print0(f"metrics written to {asked.out}/metrics.json", comm=comm)
        if asked.trace and not terminal.to_stdout(asked.trace):
            mpi.print0(f"trace written to {asked.trace} (open it at https://ui.perfetto.dev)", comm=comm)
    return 0


LAUNCH_VALUED = ("-n", "--ranks", "--timeout", "--hostfile", "--hosts", "--max-restarts", "--checkpoint-dir",
                 "--min-ranks", "--restart-delay")  # fmt: skip  # launch's options that take a value


def _module_args_are_the_targets(argv: list[str]) -> list[str]:
    """``dtrain launch -n 3 -m dtrain.launch.where --json f``: what follows ``-m MODULE`` is the module's, as with
    ``python -m``, even where it looks like an option of ``launch`` (argparse would take ``--json`` as launch's).

    Only a ``-m`` among launch's own options counts (not a script's ``-m`` after the script), and only once ``-n``
    came before it: ``dtrain launch -m MODULE -n 4`` is read as argparse always read it.
    """
    if argv[:1] != ["launch"]:
        return argv
    i, ranks_given = 1, False
    while i < len(argv):
        word = argv[i]
        if word == "-m":
            module = i + 2
            if not ranks_given or argv[module : module + 1] == ["--"]:
                return argv
            return [*argv[:module], "--", *argv[module:]]
        if word == "--" or not word.startswith("-"):  # the script (or an explicit end of options): not -m's case
            return argv
        ranks_given = ranks_given or word.startswith(("-n", "--ranks"))  # -n 4, -n4, --ranks=4
        i += 2 if word in LAUNCH_VALUED else 1
    return argv


def _launch(args) -> int:
    from dtrain.comm import watchdog
    from dtrain.launch import hosts as hostlists
    from dtrain.launch import mpiexec

    target = args.target[1:] if args.target[:1] == ["--"] else args.target  # "launch -n 2 -- -c CODE"
    if args.module:
        target = ["-m", args.module, *target]
    if args.ranks < 1:
        raise UserError(f"-n must be >= 1, got {args.ranks}")
    if not target:
        raise UserError("nothing to launch: give a script path or -m module after -n N")
    if args.oversubscribe and not (args.hostfile or args.hosts):
        raise UserError("--oversubscribe needs --hostfile or --hosts: on this machine alone every -n is allowed")
    hosts = None
    if args.hostfile:
        hosts = hostlists.parse_hostfile(args.hostfile)
    elif args.hosts:
        hosts = hostlists.parse_hosts(args.hosts)
    env = dict(os.environ)
    if args.timeout is not None:
        env[watchdog.ENV_VAR] = f"{args.timeout:g}"
    elif not env.get(watchdog.ENV_VAR, "").strip():
        env[watchdog.ENV_VAR] = f"{config.DEFAULT_TIMEOUT_S:g}"
    restarting = [name for name in ("checkpoint_dir", "min_ranks", "restart_delay") if getattr(args, name) is not None]
    if args.max_restarts is None and restarting:
        flags = ", ".join("--" + name.replace("_", "-") for name in restarting)
        raise UserError(f"{flags}: only with --max-restarts K (the launcher's restarts after a dead rank)")
    if args.max_restarts is not None:
        from dtrain.launch import restarts

        job = restarts.prepare(args.ranks, target, args.checkpoint_dir, args.max_restarts, args.min_ranks,
                                restarts.DEFAULT_RESTART_DELAY_S if args.restart_delay is None else args.restart_delay,
                                args.hostfile, args.hosts, args.oversubscribe, env)  # fmt: skip
        if not args.dry_run:
            return restarts.run(job)
        target = job.target
    if args.dry_run:
        added = mpiexec.environment(mpiexec.ranks_per_host(args.ranks, hosts), env)
        cmd = mpiexec.command(args.ranks, target, hosts=hosts, oversubscribe=args.oversubscribe, env=added)
        print(" ".join(shlex.quote(word) for word in cmd))
        for name in sorted(set(added) - set(os.environ)):
            print(f"  {name}={added[name]}")
        return 0
    return _launch_and_explain(args.ranks, target, hosts, args.oversubscribe, env)


def _launch_and_explain(ranks: int, target: list[str], hosts, oversubscribe: bool, env: dict) -> int:
    """Run the job; if a rank was killed or aborted the job without a word, say so in one line, and keep MPI's
    banners off the terminal where the ending is known (:func:`dtrain.launch.restarts.ending`). Its exit status."""
    from dtrain.launch import launcher, restarts

    watched = launcher.launch_watched(ranks, target, hosts, oversubscribe, env)
    status = watched.returncode
    if status in (0, EXIT_USER_ERROR):  # (a mistake in what was asked: dtrain has said it, once)
        restarts.keep_banners(watched, known=status == EXIT_USER_ERROR)
        return status
    found = restarts.ending(watched)
    restarts.keep_banners(watched, found.known)
    if not found.reported:
        sys.stderr.write(f"dtrain launch: {found.how}; the job ended with mpiexec's exit status {status}\n")
    return status


def _exercises(args) -> int:
    from dtrain.course.exercises import checker

    if args.action == "init":
        return checker.init(args.path)
    if args.action == "list":
        return checker.show_list(args.path)
    return checker.check(args.exercise, args.path, mpi=not args.sim_only, hostfile=args.hostfile)


def _die_by(signum: int) -> int:
    """End this process by ``signum`` itself, its default action restored, as shells expect of a program that was
    interrupted: a shell then reports 128 + signum and stops a script or a loop, which an exit with 130 would not."""
    sys.stdout.flush()
    sys.stderr.flush()
    MPI = sys.modules.get("mpi4py.MPI")  # (imported, MPI made this process a world of one, with a segment in /dev/shm
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():  # that only MPI_Finalize removes)
        MPI.Finalize()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum  # (only if the signal did not end the process)


def _fail(message: str, prog: str = "dtrain") -> int:
    """One line on stderr, said once for the whole job (under several ranks, rank 0 says it if every rank failed
    alike; else the failing rank says it, naming itself, and aborts the job)."""
    from dtrain.comm import mpi

    mpi.end_job(message, EXIT_USER_ERROR, template=f"{prog}: error{{who}}: {{message}}")
    return EXIT_USER_ERROR  # (also when MPICH's Abort returns before the process manager has ended this rank)


if __name__ == "__main__":
    sys.exit(main())

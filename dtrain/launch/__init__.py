"""Starting and stopping a job: what happens outside the ranks, in the process that launches them.

    mpiexec.py     the command: which mpiexec, the environment every rank needs, the flags in its MPI's spelling
    flavours.py    MPICH, Open MPI and others: how each spells hosts, oversubscription, yielding waits, root
    hosts.py       the machines a job may use: a hostfile, --hosts, a Slurm allocation
    launcher.py    running a job to its end: its output passed on or captured, how it ended kept
    jobs.py        a job that always ends whole: Ctrl-C, SIGTERM, SIGHUP and timeouts stop every process of it
    processes.py   the job's processes by PID and start time (/proc), and the shared memory an aborted job leaves
    endings.py     which rank ended first, seen from outside (the one that died)
    banners.py     MPI's own words on how a job ended, kept off the terminal
    restarts.py    dtrain launch --max-restarts: a failed job started again from its last checkpoint
    where.py       ``-m dtrain.launch.where``: which machine, node and cores every rank landed on
    cluster.py     ``dtrain cluster up|status|kill|down``: a cluster on this machine, nodes as network namespaces
                   behind links shaped to a rate (cluster_command.py: what the command prints)

What runs inside a rank (the world, the simulator, the tracer, the watchdog) is :mod:`dtrain.comm`'s.
"""

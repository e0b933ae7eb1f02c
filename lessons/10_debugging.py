"""Lesson 10: finding a hang, and reading a run. What goes wrong in distributed programs, and how to find it.

A program on one process fails with a traceback at the line that is wrong. A program on p ranks has failures of its
own: the ranks disagree about which collective comes next, or with which buffer; two ranks each wait for the other;
one rank stalls or crashes while the others wait for it forever; or nothing fails, and one slow rank sets everyone's
pace. The symptom is rarely where the bug is, and most often it is silence: the job stops printing and never ends.
This lesson makes each of these happen on purpose, shows what you would see, and what turns it into a diagnosis:

    python lessons/10_debugging.py                 # every part, each broken program a job of 4 ranks of its own
    python lessons/10_debugging.py --ranks 3       # the jobs on 3 ranks
    dtrain launch -n 4 --timeout 5 lessons/10_debugging.py --part stall   # one broken program, as you would meet it

It runs with python, not under dtrain launch: its broken programs must fail, so each one runs as a job of its own
(dtrain.launch.launcher.launch, with a time limit), and the lesson prints what the job printed and checks that the
message to look for is there. `--part NAME` runs one of them on the ranks you start yourself (the names: --help).

What you will see:
  1. a mismatched collective, three ways. Rank 1's buffer one element longer: MPI's "Message truncated", raised on
     rank 2, the rank that noticed, not on rank 1, the rank that is wrong. Rank 1 calling broadcast while the others
     all-reduce: rank 1 finishes with a wrong buffer and the others hang until the watchdog ends the job. Rank 1's
     buffer in float32, as many bytes as the others' float64: no error at all, and a wrong answer on every rank.
     Then the same three programs with DTRAIN_DEBUG=1: before any byte moves, the ranks compare their calls, and
     every rank raises the same report, which says what differs and where each rank made its call;
  2. a deadlock on the simulator (dtrain.comm.sim): two ranks that both Recv first; two that both Send first, which
     works for small messages and deadlocks for large ones (the bug that survives small tests); Sendrecv, which
     cannot deadlock. The simulator sees every rank, so its report is exact and immediate: what each rank waits for;
  3. a stalled rank caught by the watchdog (DTRAIN_TIMEOUT=S): its report names the rank that waited, the
     operation and its call number, the rank it waits for and the line it waits at. A report names a neighbour,
     which may itself be waiting: following the chain, with each rank's last line of output, leads to the rank that
     stalled;
  4. an exception on one rank. With Python's own handler: a traceback from rank 1, then the others wait for it
     forever (here the watchdog ends it). Under dtrain's runner (what dtrain launch runs): one traceback, naming the
     rank, and the whole job ends at once. An error every rank meets alike (a bad checkpoint) is said once;
  5. reading a run: training with a straggler (--slow-rank 2), its Chrome trace (--trace), and code that reads the
     trace and names the slow rank from the time each rank spent inside the all-reduces (communicating, and waiting
     for the others) and outside them (computing); then how to see the same at https://ui.perfetto.dev;
  6. a dead rank, and a restart. ddp training in which rank 1 is killed with SIGKILL after step 23 (the fault
     injector, DTRAIN_FAULT=1:23), under `dtrain launch --max-restarts 1 --checkpoint-dir DIR`: MPI ends the job, the
     launcher says which rank died and how, and starts the job again from the checkpoint at step 20 with --resume;
     the run ends with the SHA-256 of the weights of a run that never failed. Then what checkpointing costs: one
     checkpoint's write measured, and the interval that wastes least (Young/Daly: sqrt(2 x checkpoint cost x mean
     time between failures)) against the waste counted step by step;
  7. a whole machine dies (as root: a `dtrain cluster` of 2 nodes x 2 ranks on this machine, else skipped, saying
     why). Node 2 is killed with every process on it, mid-run, under `dtrain launch --max-restarts 1 --min-ranks 2`:
     the launcher says which node mpiexec lost, reads the hostfile again (node 1's 2 slots only now) and goes on
     from the checkpoint on 2 ranks, at the same global batch. Then the same with the node's link cut first, as a
     power failure would: nobody is told, the watchdog ends the job, and the launcher follows its reports;
  8. a parameter server dies in asynchronous training. ps-async's servers are never at one step together, so a
     checkpoint is a consistent snapshot (Chandy-Lamport markers, dtrain/parallel/ps_snapshot.py): the server is
     killed (DTRAIN_FAULT on its rank: its STEP counts the pushes it applied / workers), the job restarts from the
     last snapshot, replays the pushes that were in flight across it, and the servers' counts show every push
     applied exactly once.

Every part checks that the message it tells you to look for really appeared, and prints an OK line (FAIL if it does not
hold); the last line says whether all passed (the exit status is non-zero if not). Timings are printed, never checked.

Things to try:
  * DTRAIN_DEBUG=1 dtrain launch -n 4 lessons/10_debugging.py --part mismatch-size: the report instead of the
    truncation; then --part mismatch-dtype without DTRAIN_DEBUG: nothing fails, look at the answers;
  * dtrain launch -n 4 --timeout 3 lessons/10_debugging.py --part stall: count the reports (several ranks may report
    before the job ends) and follow the chain yourself;
  * --slow-factor 1.5: how small a straggler does the trace still find? And `dtrain train --paradigm ps-async
    --slow-rank 1 --trace t.json` on 4 ranks: an asynchronous server waits for no one; whose bars are long now?
  * DTRAIN_FAULT=2:30:TERM dtrain launch -n 4 --max-restarts 1 --checkpoint-dir ck -m dtrain train --paradigm
    zero --zero-stage 3 --checkpoint-every 25: what does the launcher say, and how many steps are lost? Without
    --checkpoint-every, where does the restart start? Kill it twice with --max-restarts 1 (a script of your own
    that always dies): read the report of every attempt;
  * as root, `dtrain cluster up --nodes 3 --slots 2 --name c`, then dtrain launch -n 6 --hostfile (the path it
    printed) --max-restarts 2 --min-ranks 2 ...: kill two nodes, one at a time (dtrain cluster kill --name c --node
    c-n2): on how many ranks does each attempt run? (dtrain cluster down --name c when done);
  * notebooks/10_debugging.ipynb does parts 1 to 5 on simulated ranks, where every wait can be seen, and part 6 on
    real ranks.

Exercises (find the bug in a given program; `dtrain exercises init ex` once
copies them into ex/):
  10.1  ex/allgather.py: a ring all-gather that passes small tests and hangs on
        large buffers. Delete the raise line, run the check, read the
        simulator's report, fix it:
          dtrain exercises check 10.1 --path ex
  10.2  ex/average.py: averaging through rank 0 (local SGD's --average-via
        master), right on rank 0 and wrong on every other rank:
          dtrain exercises check 10.2 --path ex
Each is checked on simulated ranks (a deadlock is the simulator's report) and
under mpiexec -n 2, 3, 4 (a hang is the watchdog's), against dtrain's own
collectives.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from lesson_util import Checks, conclude, heading, refuse, refuse_bad_arguments, say, table

from dtrain import checkpoint, collectives, faults, terminal
from dtrain.comm import mpi, sim
from dtrain.errors import UserError
from dtrain.launch import cluster, launcher

HERE = Path(__file__).resolve()
STALLED, SLOW = 2, 2  # the rank that stalls in part 3, the straggler of part 5
WATCHDOG_S = 2.0  # DTRAIN_TIMEOUT of the jobs that hang: the watchdog ends them after this long
JOB_LIMIT_S = 120.0  # and the launcher kills any job still running after this long (none should be)


# ---------------------------------------------------------------------------------------- the broken programs
# Each runs on every rank of a job of its own: `dtrain launch -n 4 lessons/10_debugging.py --part NAME`.


def log(text: str) -> None:
    """One line of this rank's output, in one write: mpiexec merges every rank's output into one stream, and a line
    written in two pieces (print writes the text and the newline apart when PYTHONUNBUFFERED is set) can be cut in
    two by another rank's line."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def mismatch_size(comm, rank, p):
    """Rank 1's gradient buffer has one element more than the others' (its model was built with other widths)."""
    grads = np.ones(1000 + (rank == 1))
    collectives.allreduce(comm, grads, algorithm="ring")
    log(f"rank {rank}: done, grads[0] = {grads[0]:g} (expected {p})")


def mismatch_collective(comm, rank, p):
    """Rank 1 takes a branch the others do not, and broadcasts while they all-reduce."""
    grads = np.ones(1000)
    if rank == 1:
        collectives.broadcast(comm, grads, root=0)
    else:
        collectives.allreduce(comm, grads, algorithm="ring")
    log(f"rank {rank}: done, grads[0] = {grads[0]:g} (expected {p})")


def mismatch_dtype(comm, rank, p):
    """Rank 1 holds its gradients in float32: twice as many elements as the others' float64, as many bytes."""
    grads = np.ones(2000, dtype=np.float32) if rank == 1 else np.ones(1000)
    collectives.allreduce(comm, grads, algorithm="ring")
    log(f"rank {rank}: done, grads[0] = {grads[0]:g} (expected {p})")


def stall(comm, rank, p):
    """Three training steps, each ending with an all-reduce; at step 3 rank 2 never arrives (a slow disk, a lock,
    an endless loop: it is not in any communication call)."""
    grads = np.ones(1000)
    for step in (1, 2, 3):
        if rank == STALLED and step == 3:
            log(f"rank {rank}: step {step}: reading the next batch")
            time.sleep(3600)
        log(f"rank {rank}: step {step}: in the all-reduce")
        collectives.allreduce(comm, grads, op="avg", algorithm="ring")


def raise_one(comm, rank, p):
    """Rank 1 finds its slice of the batch empty and raises; the others go on to the all-reduce and wait for it."""
    grads = np.ones(1000)
    if rank == 1:
        raise ValueError("rank 1's slice of the batch is empty")
    collectives.allreduce(comm, grads, algorithm="ring")


def raise_one_bare(comm, rank, p):
    """raise_one with Python's own handler of uncaught exceptions (what a plain `mpiexec python script.py` has)."""
    sys.excepthook = sys.__excepthook__  # undo what dtrain's runner installed (dtrain.comm.mpi.install_excepthook)
    raise_one(comm, rank, p)


def raise_everywhere(comm, rank, p):
    """Every rank reads the same checkpoint and meets the same error."""
    raise ValueError("the checkpoint holds 1,000 parameters and the model 1,001: was it written by another model?")


PARTS = {
    "mismatch-size": mismatch_size,
    "mismatch-collective": mismatch_collective,
    "mismatch-dtype": mismatch_dtype,
    "stall": stall,
    "raise-one": raise_one,
    "raise-one-bare": raise_one_bare,
    "raise-everywhere": raise_everywhere,
}

parser = argparse.ArgumentParser(description="Lesson 10: finding a hang, and reading a run (run it with python)")
parser.add_argument("--ranks", type=int, default=4, help="ranks of each job the lesson starts (default %(default)s)")
parser.add_argument("--slow-factor", type=float, default=5.0,
                    help=f"part 5: rank {SLOW} takes F times its compute time (default %(default)s)")  # fmt: skip
parser.add_argument("--out", default="runs/lesson10", help="part 5's trace and metrics go here (default %(default)s)")
parser.add_argument("--json", metavar="PATH", help="write every part's outcome and every check to this file")
parser.add_argument("--part", choices=PARTS, help="run this broken program on the ranks of this job, and nothing else")
args = parser.parse_args()

# ------------------------------------------------------------------------------------ one part, on a job's ranks
if args.part is not None:
    mpi.install_excepthook()  # (dtrain launch's runner has done so already; a plain mpiexec has not)
    world = mpi.world()
    world.Barrier()  # every rank has started (its imports done): from here only the bug makes a rank wait
    PARTS[args.part](world, world.Get_rank(), world.Get_size())
    raise SystemExit(0)

if mpi.launched_size() > 1:
    refuse("lesson 10 starts jobs of its own, some of which fail on purpose: run it with `python "
           "lessons/10_debugging.py`; `--part NAME` runs one of its broken programs on these ranks")  # fmt: skip
P = args.ranks
refuse_bad_arguments([(P < 3 or args.slow_factor < 1,
                       f"--ranks must be >= 3 (rank {STALLED} stalls in part 3), --slow-factor >= 1")])  # fmt: skip

# ------------------------------------------------------------------------------------------- the lesson itself
checks = Checks()  # this process alone: the lesson's claims, each printed as an OK (or FAIL) line
outcomes = {}


def shell(words, indent: str = "   ") -> None:
    """A command as you would type it: ``$`` and its words, broken where need be with the shell's own continuation
    (dtrain.terminal.command, which puts an option's value on the next line when the two do not fit one)."""
    text = terminal.command([str(w) for w in words], indent + "  ")
    print(indent + "$ " + text[len(indent) + 2 :], flush=True)


def quoted(line: str) -> list[str]:
    """A line a job printed, quoted ("   | "): wrapped at its spaces to the terminal, its later lines standing in by
    four more than it does (whole in a file or a pipe, which has no width)."""
    width = terminal.columns()
    if width is None or len(line) + 5 <= width:
        return ["   | " + line]
    lead = " " * (len(line) - len(line.lstrip()) + 4)
    return ["   | " + piece for piece in textwrap.wrap(line, width - 5, subsequent_indent=lead, break_on_hyphens=False)]


def job(part: str, debug: bool = False, watchdog_s: float = 0.0):
    """Run ``--part part`` on P ranks as a job of its own (DTRAIN_DEBUG and DTRAIN_TIMEOUT as given); return the
    exit status, what it printed (stdout, stderr) and its seconds."""
    env = {**os.environ, "DTRAIN_DEBUG": "1" if debug else "0", "DTRAIN_TIMEOUT": f"{watchdog_s:g}"}
    started = time.perf_counter()
    try:
        done = launcher.launch(P, [str(HERE), "--part", part], timeout=JOB_LIMIT_S, capture=True, env=env)
        status, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:  # (nothing here should hang: that is what this lesson is about)
        status, out, err = "killed", exc.output or "", exc.stderr or ""
    seconds = time.perf_counter() - started
    outcomes[part + (" DTRAIN_DEBUG=1" if debug else "")] = {"status": status, "seconds": round(seconds, 2),
                                                             "stdout": out, "stderr": err}  # fmt: skip
    env_said = ("DTRAIN_DEBUG=1 " if debug else "") + (f"DTRAIN_TIMEOUT={watchdog_s:g} " if watchdog_s else "")
    print()
    shell([*env_said.split(), "dtrain", "launch", "-n", P, "lessons/10_debugging.py", "--part", part])
    print(f"   (exit status {status}, {seconds:.1f} s)")
    return status, out, err


def show(text: str, keep=None, head: int = 3, tail: int = 4) -> None:
    """Print what a job printed, indented; long output shortened to its first and last lines (``keep``: only the
    lines that contain one of these, in order)."""
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    if keep is not None:
        lines = [line for line in lines if any(k in line for k in keep)]
    if len(lines) > head + tail + 1:
        lines = [*lines[:head], f"... ({len(lines) - head - tail} more lines)", *lines[len(lines) - tail :]]
    for line in lines:
        print("\n".join(quoted(line if len(line) <= 220 else line[:217] + "...")))


def last_lines(out: str) -> dict[int, str]:
    """Each rank's last line of output (the part programs start theirs with "rank R:")."""
    last = {}
    for line in out.splitlines():
        found = re.match(r"rank (\d+): ", line)
        if found:
            last[int(found.group(1))] = line
    return last


WAITS = re.compile(r"dtrain watchdog: rank (\d+) waits for rank (\d+)")

say(f"Lesson 10: finding a hang, and reading a run. Jobs of {P} ranks, started by this process.", "", "   ")

# --------------------------------------------------------------------------------------- 1. mismatched collective
heading("1. A mismatched collective: the ranks do not all make the same call (rank 1 differs)")
say("Every rank must make the same collective calls, in the same order, with buffers of the same size and dtype. "
    "Nothing checks that unless you ask: each rank only sends and receives its own messages. What happens when "
    "rank 1 differs depends on how it differs.")  # fmt: skip

status, out, err = job("mismatch-size")
show(err, head=2, tail=3)
checks.ok("a buffer one element longer on rank 1: MPI's truncation error, raised on rank 2 (the rank that received the "
          "longer chunk), and the job ends", "uncaught exception (rank 2), ending the job" in err
          and "message truncated" in err.lower() and status != 0)  # fmt: skip
say(
    "The traceback is rank 2's, and rank 2's code is right: in the ring, rank 1 sent its longer chunk 0 to rank 2, "
    "whose receive buffer had room for the others' length. An error names the rank that noticed."
)

status, out, err = job("mismatch-collective", watchdog_s=WATCHDOG_S)
show(out)
show(err, keep=("dtrain watchdog: rank",), head=3, tail=0)
reports = WAITS.findall(err)
checks.ok("rank 1 broadcasting while the others all-reduce: rank 1 finishes, with a wrong buffer",
          re.search(r"rank 1: done, grads\[0\] = (?!" + str(P) + r" )", out) is not None)  # fmt: skip
checks.ok(
    f"the others hang until the watchdog ends the job after DTRAIN_TIMEOUT={WATCHDOG_S:g} s (exit status 14), "
    "its report naming whom it waits for",
    "dtrain watchdog: rank" in err and bool(reports) and status == 14,
)

status, out, err = job("mismatch-dtype")
show(out)
answers = [float(v) for v in re.findall(r"rank [02-9]\d*: done, grads\[0\] = (\S+)", out)]
checks.ok("rank 1's buffer in float32 (as many bytes): no error, exit status 0, and a wrong answer on the other ranks",
          status == 0 and len(answers) == P - 1 and all(a != P for a in answers))  # fmt: skip
say(
    "The worst of the three: nothing failed. MPI moves bytes; rank 1's float32 bytes were added as float64 (and "
    "the others' float64 bytes as float32 on rank 1), so every rank holds a wrong sum "
    f"({answers[0] if answers else '?'} instead of {P}), and training would go on from it."
)

say(
    "Now the same three programs with DTRAIN_DEBUG=1. Every collective first gathers each rank's call (collective, "
    "algorithm, op, count, dtype, root, call number) and compares: a mismatch raises the same "
    "CollectiveMismatchError on every rank, before anything is sent, and dtrain's runner says it once."
)
for part, differing in (("mismatch-size", "count"), ("mismatch-collective", "collective, algorithm, op, root"),
                        ("mismatch-dtype", "count, dtype")):  # fmt: skip
    status, out, err = job(part, debug=True)
    show(err, keep=("uncaught exception", "CollectiveMismatchError", "  rank ", "differing"), head=7, tail=0)
    checks.ok(f"{part} with DTRAIN_DEBUG=1: one report on every rank, 'differing: {differing}', each rank's call and "
              "where it was made", "uncaught exception on every rank, ending the job" in err
              and "the ranks are not making the same collective call" in err and f"differing: {differing}\n" in err
              and "10_debugging.py:" in err and "dtrain watchdog" not in err and status == 1)  # fmt: skip
say(
    "Each line names a rank's call and the line of the program that made it (10_debugging.py:NN in the function), "
    "so the report points at rank 1's branch. The price is one small object all-gather per collective, which is "
    "why it is off by default: switch it on when a job hangs or a loss goes strange, and leave it on in tests."
)

# --------------------------------------------------------------------------------- 2. a deadlock on the simulator
heading("2. A deadlock on the simulator: every rank waits for a message no rank will send")
say(
    "On real ranks a deadlock is silence. The simulator (dtrain.comm.sim) runs the ranks as threads of this process "
    "and sees every one of them: when the last running rank blocks and no blocked rank can ever be woken, it stops "
    "the run at once and says what each rank waits for. No timer is involved, so it is exact."
)


def both_receive_first(comm):
    other = 1 - comm.Get_rank()
    theirs = np.empty(4)
    comm.Recv(theirs, source=other)  # each rank waits for the other's message ...
    comm.Send(np.full(4, comm.Get_rank(), dtype=float), dest=other)  # ... which comes after its own receive


def both_send_first(comm, n):
    other = 1 - comm.Get_rank()
    theirs = np.empty(n)
    comm.Send(np.full(n, comm.Get_rank(), dtype=float), dest=other)  # a large message waits for its receive
    comm.Recv(theirs, source=other)
    return float(theirs[0])


def send_and_receive(comm, n):
    other = 1 - comm.Get_rank()
    theirs = np.empty(n)
    comm.Sendrecv(np.full(n, comm.Get_rank(), dtype=float), dest=other, recvbuf=theirs, source=other)
    return float(theirs[0])


reports = {}
for name, run in (("both Recv first", lambda: sim.run(2, both_receive_first)),
                  ("both Send first, 100 float64 (800 bytes)", lambda: sim.run(2, both_send_first, 100)),
                  ("both Send first, 100,000 float64 (800 KB)", lambda: sim.run(2, both_send_first, 100_000)),
                  ("Sendrecv, 100,000 float64", lambda: sim.run(2, send_and_receive, 100_000))):  # fmt: skip
    try:
        print()
        say(f"{name}: every rank got {run()}")
        reports[name] = None
    except sim.SimDeadlock as deadlock:
        print()
        say(f"{name}: sim.SimDeadlock")
        show(str(deadlock), head=8, tail=0)
        reports[name] = str(deadlock)
recv_first = reports["both Recv first"] or ""
checks.ok("both ranks Recv first: the simulator's report says each waits in Recv for the other",
          "deadlock: every unfinished rank is blocked" in recv_first and "rank 0: Recv(source=1" in recv_first
          and "rank 1: Recv(source=0" in recv_first)  # fmt: skip
big = reports["both Send first, 100,000 float64 (800 KB)"] or ""
checks.ok(f"both Send first: fine with 800 bytes, a deadlock with 800 KB (above the eager limit, "
          f"{sim.DEFAULT_EAGER_LIMIT // 1024} KiB here), each rank waiting in Send for a matching receive",
          reports["both Send first, 100 float64 (800 bytes)"] is None
          and "rendezvous: waiting for a matching receive" in big
          and "messages waiting for a receive" in big)  # fmt: skip
checks.ok("Sendrecv never deadlocks: it sends and receives at once", reports["Sendrecv, 100,000 float64"] is None)
say(
    "MPI sends a small message at once ('eager') and returns, but holds a large one until the receiver has posted "
    "its receive ('rendezvous'): two ranks that both Send a large buffer first wait for each other forever. With the "
    "small buffers of a unit test the same code works, which is how the bug reaches production. Sendrecv, or "
    "Irecv + Isend + wait, cannot deadlock this way. Exercise 10.1 is such a bug."
)

# ------------------------------------------------------------------------------------- 3. a stalled rank, watched
heading(f"3. A stalled rank: rank {STALLED} never reaches step 3's all-reduce; the watchdog ends the job")
status, out, err = job("stall", watchdog_s=WATCHDOG_S)
show(err, keep=("dtrain watchdog: rank",), head=3 * (P - 1), tail=0)
reports = {int(a): int(b) for a, b in WAITS.findall(err)}
last = last_lines(out)
print("   each rank's last line of output:")
for r in sorted(last):
    print("\n".join(quoted(last[r])))
checks.ok(f"the watchdog reports after DTRAIN_TIMEOUT={WATCHDOG_S:g} s: which rank waited how long in what "
          "(allreduce/ring, call #3), whom it waits for, and where", status == 14 and "has waited" in err
          and "in allreduce/ring (call #3)" in err and "is at dtrain/collectives/ring.py" in err
          and bool(reports))  # fmt: skip
checks.ok(
    "every report names the rank's left neighbour, the rank a ring receives from",
    all(b == (a - 1) % P for a, b in reports.items()),
)
# Follow the chain: a rank whose last line says it is in the all-reduce waits for its left neighbour too.
chain = [min(reports)] if reports else []
while chain and len(chain) <= P and "in the all-reduce" in last.get(chain[-1], ""):
    chain.append(reports.get(chain[-1], (chain[-1] - 1) % P))
say("the chain: " + " waits for ".join(f"rank {r}" for r in chain)
    + ", whose last line says it is not in the all-reduce at all")  # fmt: skip
checks.ok(f"following the reports and the last lines leads to rank {STALLED}, which never reported (it is not waiting)",
          bool(chain) and chain[-1] == STALLED and STALLED not in reports)  # fmt: skip
say(
    "A report names the rank this rank waits for, and that rank may be waiting too: in a ring a stall travels "
    "round, every rank waiting for its left neighbour. Follow the chain until a rank is not in the collective: its "
    "last output, its own traceback or its call number says why. (Several ranks may report before the job ends; "
    "which ones is a race. The rank that stalled never does.) In dtrain train the watchdog is on with 300 s "
    "(--timeout S); in your own scripts DTRAIN_TIMEOUT=S or dtrain launch --timeout S turns it on."
)

# -------------------------------------------------------------------------------------- 4. an exception on a rank
heading("4. An exception on one rank")
status, out, err = job("raise-one-bare", watchdog_s=WATCHDOG_S)
show(err, keep=("Traceback", "Error", "dtrain watchdog: rank"), head=4, tail=0)
checks.ok("with Python's own handler: rank 1's traceback, then the others wait in the all-reduce until the watchdog "
          "ends the job", "ValueError: rank 1's slice of the batch is empty" in err
          and "in allreduce/ring (call #1)" in err and "uncaught exception" not in err and status == 14)  # fmt: skip
status, out, err = job("raise-one")
show(err, head=6, tail=0)
checks.ok(
    "under dtrain's runner: one traceback, naming rank 1, and the job ends with its status (1)",
    "uncaught exception (rank 1), ending the job:" in err and err.count("Traceback") == 1 and status == 1,
)
status, out, err = job("raise-everywhere")
show(err, head=6, tail=0)
checks.ok("an error every rank meets alike: said once, 'on every rank'", status == 1
          and "uncaught exception on every rank, ending the job:" in err and err.count("Traceback") == 1)  # fmt: skip
say(
    "A rank that raises leaves the others waiting for its messages: with Python's own handler a job hangs after "
    "one traceback (a bare `mpiexec python script.py` does that; so does MPICH until killed). dtrain launch runs "
    "every rank under `python -m dtrain.comm.run`, whose handler asks the other ranks whether they are failing too "
    "(for up to 2 s): if all are, rank 0 says it once and every rank exits with the status; if not, this rank "
    "says it, naming itself, and calls MPI_Abort, which ends every rank."
)

# -------------------------------------------------------------------------------------------- 5. reading a run
heading(f"5. Reading a run: which rank is slow? ddp on {P} ranks, rank {SLOW} {args.slow_factor:g}x its compute time")
out_dir = Path(args.out)
out_dir.mkdir(parents=True, exist_ok=True)
trace_path, metrics_dir = out_dir / "trace.json", out_dir / "straggler"
command = ["-m", "dtrain", "train", "--paradigm", "ddp", "--epochs", "1", "--slow-rank", str(SLOW),
           "--slow-factor", f"{args.slow_factor:g}", "--trace", str(trace_path), "--out", str(metrics_dir),
           "--quiet", "--no-progress"]  # fmt: skip
shell(["dtrain", "launch", "-n", P, *command])
started = time.perf_counter()
done = launcher.launch(P, command, timeout=JOB_LIMIT_S, capture=True)
print(f"   (exit status {done.returncode}, {time.perf_counter() - started:.1f} s)")
if done.returncode != 0:
    show(done.stderr)
    raise SystemExit(f"the training run failed (exit status {done.returncode})")


def time_per_rank(path) -> dict[int, dict]:
    """Read a Chrome trace (dtrain train --trace): for each rank, its all-reduces (the operation spans named
    allreduce/...), the seconds inside them (sending, receiving, and waiting for the other ranks) and the seconds
    between its first and its last that it spent outside them (computing)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    spans = defaultdict(list)  # rank (the trace's "pid") -> (start, duration) of each all-reduce, in microseconds
    for event in events:
        if event["ph"] == "X" and event.get("cat") == "operation" and event["name"].startswith("allreduce/"):
            spans[event["pid"]].append((event["ts"], event["dur"]))
    ranks = {}
    for rank, mine in sorted(spans.items()):
        inside = sum(duration for _, duration in mine)
        between = max(start + duration for start, duration in mine) - min(start for start, _ in mine)
        ranks[rank] = {"allreduces": len(mine), "inside_s": inside / 1e6, "outside_s": (between - inside) / 1e6}
    return ranks


ranks = time_per_rank(trace_path)
print()
say(f"from the trace ({trace_path}):")
table(["rank", "all-reduces", "inside them, s", "outside them, s"],
      [[f"{r}", f"{row['allreduces']}", f"{row['inside_s']:.3f}", f"{row['outside_s']:.3f}"]
       for r, row in ranks.items()], left=())  # fmt: skip
slowest = max(ranks, key=lambda r: ranks[r]["outside_s"])
waits_least = min(ranks, key=lambda r: ranks[r]["inside_s"])
say(f"the slow rank: rank {slowest}: it spends the most time outside the all-reduces, and the least inside them")
checks.ok(
    f"the trace names rank {SLOW} as the slow rank (most time computing, least time in the all-reduces)",
    slowest == SLOW and waits_least == SLOW,
)
say(f"In a synchronous step nobody finishes before the slowest rank: the others reach the all-reduce early and wait "
    f"inside it for rank {SLOW}, so their time inside the all-reduces grows by what rank {SLOW} adds outside them. "
    "A slow rank is the one that waits least. To see it, open https://ui.perfetto.dev, 'Open trace file', and pick "
    f"{trace_path}: one row per rank, each all-reduce a bar with its messages inside. The other ranks' all-reduce "
    f"bars are long, rank {SLOW}'s short; select a stretch of a row (drag across it) and the table below sums the "
    "time per name on that rank.")  # fmt: skip

# ------------------------------------------------------------------------------------ 6. a dead rank, and a restart
heading(f"6. A dead rank, and a restart: ddp on {P} ranks, rank 1 killed with SIGKILL after global step 23")
say(
    "A rank that dies (the out-of-memory killer, a node that reboots) takes the job with it: MPI cannot go on without "
    "it. Every 10 steps rank 0 writes a checkpoint (the full flat buffer, the optimizer's state, the position in the "
    "data); `dtrain launch --max-restarts 1` starts the job again from the last one with --resume. The fault is "
    "injected: DTRAIN_FAULT=1:23 makes rank 1 send itself SIGKILL once step 23 is done, and records that it did, so "
    "the restart goes past step 23 alive."
)
restart_dir = out_dir / "restart"
train_flags = ["-m", "dtrain", "train", "--paradigm", "ddp", "--epochs", "2", "--hidden", "32", "--batch-size", "48",
               "--checkpoint-every", "10", "--quiet", "--no-progress"]  # fmt: skip


def dtrain_launch(words, fault=None):
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_FAULT"} | ({"DTRAIN_FAULT": fault} if fault else {})
    command = [sys.executable, "-m", "dtrain", "launch", "-n", str(P), *words]
    print()
    shell([*([f"DTRAIN_FAULT={fault}"] if fault else []), "dtrain", "launch", "-n", P, *words])
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_LIMIT_S, env=env)
    print(f"   (exit status {done.returncode}, {time.perf_counter() - started:.1f} s)")
    return done


shutil.rmtree(restart_dir, ignore_errors=True)
whole_run = dtrain_launch([*train_flags, "--checkpoint-dir", str(restart_dir / "whole-ck"),
                           "--out", str(restart_dir / "whole")])  # fmt: skip
restarted_run = dtrain_launch(["--max-restarts", "1", "--restart-delay", "0.5", "--checkpoint-dir",
                               str(restart_dir / "ck"), *train_flags, "--out", str(restart_dir / "restarted")],
                              fault="1:23")  # fmt: skip
show(
    restarted_run.stdout + restarted_run.stderr, keep=("dtrain launch", "  1. ", "  2. ", "EXIT STRING"), head=8, tail=0
)  # (MPICH's report goes to stdout, the launcher's to stderr)
if whole_run.returncode or restarted_run.returncode:
    show(whole_run.stderr + restarted_run.stderr)
    raise SystemExit("part 6's training runs failed")
whole_metrics = json.loads((restart_dir / "whole" / "metrics.json").read_text())
restarted_metrics = json.loads((restart_dir / "restarted" / "metrics.json").read_text())
restarts = restarted_metrics["restarts"]
print(f"   uninterrupted: weights SHA-256 {whole_metrics['weights_sha256'][:16]}...")
print(f"   restarted:     weights SHA-256 {restarted_metrics['weights_sha256'][:16]}...")
say(f"(the restarted run's metrics.json: restarts {restarts['count']}, steps lost {restarts['steps_lost']})")
checks.ok("the launcher names the dead rank and its signal, and restarts from the checkpoint at step 20",
          "rank 1 was killed by SIGKILL" in restarted_run.stderr
          and "from the checkpoint at global step 20" in restarted_run.stderr)  # fmt: skip
checks.ok("the restarted run ends with the very weights of the uninterrupted one (SHA-256), 3 steps done twice",
          restarted_metrics["weights_sha256"] == whole_metrics["weights_sha256"] and restarts["count"] == 1
          and restarts["steps_lost"] == 3)  # fmt: skip
say(
    "Bit for bit, because resuming repeats exactly the computation the dead run was doing: the same weights and "
    "optimizer state, the same global batches in the same order (each epoch's shuffle is drawn from the seed and the "
    "epoch), summed over the same ranks in the same order. On fewer ranks (--min-ranks) the global batch is the same "
    "but summed in other slices: the same curve, not the same bits."
)

# What checkpointing costs, and how often to do it: one checkpoint of a model of 1M parameters (SGD with momentum:
# 2 buffers of 4 bytes each), written here as the driver writes it.
print()
say("How often to checkpoint (Young/Daly):")
parameters = 1_000_000
state = np.random.default_rng(0).standard_normal(parameters).astype(np.float32)
writes = []
for _ in range(5):
    started = time.perf_counter()
    checkpoint.save(restart_dir / "cost", state, {"steps": 1, "lr": 0.1, "velocity": state}, {"global_step": 1})
    writes.append(time.perf_counter() - started)
C = float(np.median(writes))
step_s = whole_metrics["epochs"][0]["train_time_s"] / (1438 // 48)  # this run's step (digits: 1,438 samples)
M = 3600.0  # a failure every hour, on average
young = math.sqrt(2 * C * M)


def waste(T):
    """The model: the fraction of time lost at interval T, writing checkpoints (C every T) and, after each failure
    (one every M on average), redoing the work since the last checkpoint (T/2 on average)."""
    return C / T + T / (2 * M)


# The oracle: a run simulated failure by failure (times between failures drawn from an exponential law of mean M, the
# same draws for every T). Between two failures the run keeps the work of each complete stretch of T seconds and
# its checkpoint; a failure loses the stretch it falls in; the run is over when the work kept reaches W.
gaps = np.random.default_rng(1).exponential(M, 40_000)
W = 0.95 * gaps.sum()  # (enough failures on the way: the waste is a few percent at most)


def simulated_waste(T):
    kept = np.cumsum(np.floor(gaps / (T + C)) * T)  # work kept by the end of each gap
    k = int(np.searchsorted(kept, W))  # the gap in which the work is done
    before = kept[k - 1] if k else 0.0
    elapsed = gaps[:k].sum() + (W - before) / T * (T + C)
    return elapsed / W - 1


intervals = young * np.geomspace(1 / 8, 8, 97)
simulated = np.array([simulated_waste(T) for T in intervals])
best = float(intervals[np.argmin(simulated)])
say(f"one checkpoint of {parameters:,} float32 parameters and their momentum: C = {C * 1e3:.1f} ms (median of 5)")
say(f"a failure every M = {M:g} s: T = sqrt(2 C M) = {young:.1f} s, about {young / step_s:,.0f} steps of "
    f"{step_s * 1e3:.1f} ms; waste there {100 * waste(young):.2f}% of the time")  # fmt: skip
table(["checkpoint every", "writing", "redone", "waste"],
      [[f"{T:.1f} s", f"{100 * C / T:.3f}%", f"{100 * T / (2 * M):.3f}%", f"{100 * waste(T):.3f}%"]
       for T in (young / 10, young, young * 10)], left=(), indent="      ")  # fmt: skip
say(f"simulated over {len(gaps):,} failures: the least waste {100 * simulated.min():.3f}% at T = {best:.1f} s; at "
    f"T = sqrt(2 C M): {100 * simulated_waste(young):.3f}% (the model says {100 * waste(young):.3f}%)")  # fmt: skip
checks.ok(
    "in a run simulated failure by failure, checkpointing every sqrt(2 C M) wastes within 2% of the least waste of "
    "97 intervals from T/8 to 8T, and the model's waste there is the simulated one within 10%",
    simulated_waste(young) <= 1.02 * simulated.min() and abs(waste(young) / simulated_waste(young) - 1) < 0.1,
)
say(
    "Too often, and the writes cost more than the failures; too rarely, and each failure costs hours of redone "
    "steps. Between them the waste C/T + T/(2M) is least at T = sqrt(2 C M) (Young, 1974; Daly, 2006, adds the "
    "restart's own time and terms for T near M). A job of n nodes fails n times as often as one node: the interval "
    "shrinks as 1/sqrt(n)."
)

# ------------------------------------------------------------------------------------- 7. a whole machine dies
NODES_AT = 30  # the node dies once rank 0 has done this global step (a checkpoint every 20: 10 steps lost, about)
heading("7. A whole machine dies: 2 nodes x 2 ranks (a dtrain cluster), one node killed with every rank on it")
machine: dict = {}
why_not = cluster.missing("part 7 (a cluster of network namespaces)")
if why_not is not None:
    say(f"Skipped: {why_not}. As root, this part makes a cluster of 2 nodes on this machine and kills one.")
    machine["skipped"] = why_not
else:
    say(
        "On a real cluster a machine dies whole: its power, its kernel, its network card. Every rank on it is gone "
        "at once, and so is the process MPI's launcher ran there (hydra's proxy, the parent of those ranks). A "
        "scheduler then takes the machine out of the list of hosts. `dtrain cluster` makes such a cluster on this "
        "machine: each node a network namespace behind a link of its own, and `dtrain cluster kill` kills a node's "
        "every process and takes it out of the hostfile. With --min-ranks 2 the launcher reads the hostfile again "
        "before the restart and goes on with the 2 slots left, at the same global batch."
    )
    machine_dir = out_dir / "machine"
    shutil.rmtree(machine_dir, ignore_errors=True)
    train_words = ["-m", "dtrain", "train", "--paradigm", "ddp", "--dataset", "digits", "--epochs", "4",
                   "--checkpoint-every", "20", "--quiet", "--no-progress"]  # fmt: skip

    def node_dies(name: str, cut_link: bool, timeout_s: float = 0.0) -> dict:
        """Make cluster ``name`` (2 x 2, 100 Mbit/s), train on it under the launcher, kill node 2 once rank 0 has
        done step NODES_AT, and take the cluster down again: what the launcher said, the run's metrics."""
        shell(["dtrain", "cluster", "up", "--nodes", 2, "--slots", 2, "--link", "100mbit", "--name", name])
        made = cluster.up(name, 2, 2, "100mbit")
        try:
            folder = machine_dir / ("cut" if cut_link else "killed")
            words = ["-n", 4, "--hostfile", made.hostfile, "--max-restarts", 1, "--min-ranks", 2, "--restart-delay",
                     0.5, *(["--timeout", f"{timeout_s:g}"] if timeout_s else []), "--checkpoint-dir",
                     folder / "ck", *train_words, "--out", folder / "out"]  # fmt: skip
            shell(["dtrain", "launch", *words])
            started = time.perf_counter()
            run = subprocess.Popen([sys.executable, "-m", "dtrain", "launch", *map(str, words)], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
            progress, step = folder / "ck" / "progress", 0  # (rank 0's last step: what the launcher reads)
            while step < NODES_AT and run.poll() is None and time.perf_counter() - started < JOB_LIMIT_S:
                time.sleep(0.01)
                step = faults.read_progress(progress) or 0
            print(f"   (once rank 0 has done step {step}, {time.perf_counter() - started:.1f} s in:)")
            shell(["dtrain", "cluster", "kill", "--name", name, "--node", made.node(2),
                   *(["--cut-link"] if cut_link else [])])  # fmt: skip
            cluster.kill(name, made.node(2), cut_link=cut_link)
            killed_at = time.time()
            try:
                out, err = run.communicate(timeout=JOB_LIMIT_S)
            except subprocess.TimeoutExpired:
                run.kill()
                out, err = run.communicate()
            print(f"   (exit status {run.returncode}, {time.perf_counter() - started:.1f} s)")
            for line in err.splitlines():  # (the launcher's lines, whole)
                if line.startswith(("dtrain launch", "  1. ", "  2. ")):
                    print("\n".join(quoted(line)))
            metrics_path = folder / "out" / "metrics.json"
            metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
            first = metrics.get("restarts", {}).get("attempts", [None])[0]
            noticed = None if first is None else first["started"] + first["seconds"] - killed_at
            return {"status": run.returncode, "stderr": err, "stdout": out, "metrics": metrics, "noticed_s": noticed,
                    "mpi_log": (folder / "ck" / "mpi.log").read_text() if (folder / "ck" / "mpi.log").exists() else "",
                    "left": cluster.processes_in(made.node(1)), "node": made.node(2)}  # fmt: skip
        finally:
            cluster.down(name)

    def went_on(run: dict) -> bool:
        """The job finished on the 2 ranks of node 1, from the last checkpoint, at the 4 ranks' global batch."""
        m = run["metrics"]
        first = m.get("restarts", {}).get("attempts", [{}])[0]
        checkpointed = (first.get("reached_step") or 0) // 20 * 20  # (a checkpoint every 20 steps)
        return (run["status"] == 0 and m["world_size"] == 2 and len(m["epochs"]) == 4 and first.get("ranks") == 4
                and m["config"]["batch_size"] == 64 and not run["left"]
                and f"on 2 ranks, from the checkpoint at global step {checkpointed}" in run["stderr"])  # fmt: skip

    try:
        killed = node_dies("lesson10", cut_link=False)
    except UserError as exc:  # (a cluster of that name up already, say: its owner's to take down)
        killed = {"status": "refused", "stderr": str(exc), "metrics": {}}
        say(f"could not make the cluster: {exc}")
    machine["killed"] = {k: v for k, v in killed.items() if k != "stdout"}
    lost = f"dtrain launch: mpiexec lost node {killed.get('node')} (its proxy ended with every rank on it: 2, 3)"
    terminal_said = killed["stderr"] + killed.get("stdout", "")
    checks.ok("the launcher says in one line which node was lost; MPICH's own words on it go to the checkpoint "
              "folder's mpi.log, not to the terminal", sum(line.startswith(lost) for line in
              terminal_said.splitlines()) == 1 and "[mpiexec@" not in terminal_said
              and "assert (!closed)" in killed.get("mpi_log", ""))  # fmt: skip
    if killed["metrics"]:
        attempts = killed["metrics"]["restarts"]["attempts"]
        table(["attempt", "ranks", "from step", "reached", "steps lost", "seconds"],
              [*([str(a["number"]), str(a["ranks"]), "start" if a["resumed_from_step"] is None else
                  str(a["resumed_from_step"]), str(a["reached_step"]), str(a["steps_lost"]), f"{a['seconds']:.1f}"]
                 for a in attempts),
               [str(len(attempts) + 1), str(killed["metrics"]["world_size"]),
                str(attempts[-1]["reached_step"] - attempts[-1]["steps_lost"]), "the end", "-", "-"]],
              left=())  # fmt: skip
    checks.ok("the job went on with the other node's 2 ranks (the hostfile lists only its slots now), from the "
              "last checkpoint, the global batch unchanged (64), and finished; no process left on the node",
              "metrics" in killed and bool(killed["metrics"]) and went_on(killed))  # fmt: skip
    say(
        "MPI noticed at once: the dead node's kernel closed its connections, so mpiexec lost its proxy there and "
        "ended the job. A machine that loses its power, or its network, says nothing. `dtrain cluster kill "
        "--cut-link` takes the node's link down first: the ranks left wait for messages that never come, until the "
        "watchdog (--timeout 3 here) ends the job. The launcher follows the watchdog's reports (rank 1 waits for 0, "
        "which waits for 2) and, on this machine, sees which ranks had ended long before."
    )
    try:
        cut = node_dies("lesson10", cut_link=True, timeout_s=3)
    except UserError as exc:
        cut = {"status": "refused", "stderr": str(exc), "metrics": {}}
        say(f"could not make the cluster: {exc}")
    machine["cut"] = {k: v for k, v in cut.items() if k != "stdout"}
    checks.ok("with the link cut, the watchdog ends the job after its 3 s; the launcher names the silent node, "
              "and the job goes on as before", f"node {cut.get('node')}'s ranks 2, 3 had ended" in cut["stderr"]
              and bool(cut["metrics"]) and went_on(cut))  # fmt: skip
    if killed.get("noticed_s") is not None and cut.get("noticed_s") is not None:
        say(f"From the kill to the end of the first attempt: {killed['noticed_s']:.1f} s with the node killed, "
            f"{cut['noticed_s']:.1f} s with its link cut. The watchdog's limit is the price of a silent failure: on a "
            "cluster that fails, set it a few times your longest step, not to its default of 300 s.")  # fmt: skip

# ---------------------------------------------------------------------- 8. a parameter server dies (ps-async)
SERVER, SNAPSHOT_EVERY, SERVER_DIES = P - 1, 10, 25
heading(f"8. A parameter server dies: ps-async on {P} ranks (rank {SERVER} serves), a snapshot every {SNAPSHOT_EVERY} "
        "steps")  # fmt: skip
say(
    "Asynchronous servers apply each push as it comes: no moment has every shard at the same step, and pushes are "
    "always on the wire. A checkpoint is then a consistent snapshot (Chandy and Lamport, 1985): the coordinator "
    "records its shard and marks its next reply to each worker; a worker, at the end of that step, records its "
    "sequence number and sends a marker after its last push; each server records its shard at the first marker, "
    "and every push that reaches it before a worker's marker as in flight. A restart restores the shards and "
    "replays the pushes in flight; each worker goes on from its sequence number. DTRAIN_FAULT="
    f"{SERVER}:{SERVER_DIES} kills the server once it has applied {SERVER_DIES} x {P - 1} pushes."
)
snapshot_dir = out_dir / "snapshot"
shutil.rmtree(snapshot_dir, ignore_errors=True)
ps_flags = ["-m", "dtrain", "train", "--paradigm", "ps-async", "--servers", "1", "--epochs", "2", "--hidden", "32",
            "--batch-size", "48", "--checkpoint-every", str(SNAPSHOT_EVERY), "--quiet", "--no-progress"]  # fmt: skip
server_run = dtrain_launch(["--max-restarts", "1", "--restart-delay", "0.5", "--checkpoint-dir",
                            str(snapshot_dir / "ck"), *ps_flags, "--out", str(snapshot_dir / "out")],
                           fault=f"{SERVER}:{SERVER_DIES}")  # fmt: skip
show(server_run.stdout + server_run.stderr, keep=("dtrain launch", "  1. ", "  2. "), head=8, tail=0)
server_metrics = {}
if (snapshot_dir / "out" / "metrics.json").exists():
    server_metrics = json.loads((snapshot_dir / "out" / "metrics.json").read_text())
pushes = server_metrics.get("communication", {}).get("per_rank", [{}])[0].get("paradigm", {}).get("pushes", {})
if pushes:
    table(["worker", "pushes sent", f"server (rank {SERVER}) applied"],
          [[str(w), str(sent), str(pushes["applied"][0][w])] for w, sent in enumerate(pushes["sent"])],
          left=())  # fmt: skip
    say(f"pushes in flight across the snapshot, replayed by the server after the restart: {pushes['replayed'][0]}")
checks.ok(f"the launcher names the server (rank {SERVER}) and its signal, and restarts from a snapshot",
          f"rank {SERVER} was killed by SIGKILL" in server_run.stderr
          and "from the checkpoint at global step" in server_run.stderr)  # fmt: skip
checks.ok("every push a worker sent was applied exactly once: the server's count of each worker's pushes equals "
          "the worker's sequence number, the pushes in flight at the cut replayed once",
          server_run.returncode == 0 and bool(pushes) and pushes["exactly_once"]
          and server_metrics["restarts"]["count"] == 1)  # fmt: skip
say(
    "Why it holds: the marker travels on the pushes' own communicator and tag, and MPI keeps one sender's messages "
    "in order there, so a push sent before a worker's marker reaches each server before it (in the shard, or "
    "recorded in flight), and one sent after it reaches no recording at all. The notebook's last section takes the "
    "order away and counts a push twice."
)

# ------------------------------------------------------------------------------------------------------- the end
# the docstring's Exercises section, as it is (it keeps to 80 columns: it is printed)
print("\n" + __doc__[__doc__.index("\nExercises") + 1 :].rstrip())
restart_figures = {"restarts": restarts, "checkpoint_s": C, "young_s": young, "best_s": best, "step_s": step_s,
                   "sha_equal": restarted_metrics["weights_sha256"] == whole_metrics["weights_sha256"]}  # fmt: skip
conclude(args.json, {"parts": outcomes, "straggler": ranks, "restart": restart_figures, "machine": machine,
                     "server": {"pushes": pushes, "restarts": server_metrics.get("restarts")}}, checks)  # fmt: skip

"""``dtrain exercises init | list | check``: the learner's side of the course's exercises (see the package docstring).

``check`` runs an exercise's parts in order, each in a process of its own with a time limit (:mod:`.run`): the
simulated ranks first, then ``mpiexec -n P`` for each rank count; the first part that fails ends the check, with its
message and the exercise's hint. What each check found is kept in ``DIR/.dtrain-progress.json``, with a digest of
the exercise's own function (its definition and the top-level definitions it uses: helpers, imports, constants), which
is how ``list`` knows an exercise's status without running anything: editing 8.1's function in schedules.py leaves
8.2's status as it was. Every line printed fits the terminal (``$COLUMNS``; :mod:`dtrain.terminal`).

``check --hostfile FILE`` runs the ``mpiexec`` parts on FILE's hosts, a cluster's from ``dtrain cluster up`` among
them, so that a learner's collective crosses the nodes' links. A part with more ranks than FILE's slots is skipped,
said on its own line and in the exercise's status ("passing (mpiexec -n 4 skipped)"), not refused: the simulated
ranks have already checked every rank count, and a learner who brought a small cluster learns what it can tell now
rather than being sent to make a bigger one (and oversubscribing its nodes would not be the cluster they asked for).
An algorithm inside one node's shared memory (2.6) runs its parts on one host, the first with the most slots: its
ranks cannot span nodes. A FILE on which no part could run is refused, as is ``--sim-only`` with it: nothing would
use it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dtrain import terminal
from dtrain.course import exercises
from dtrain.errors import UserError

STUBS = Path(__file__).parent / "stubs"
PROGRESS = ".dtrain-progress.json"
SIM_LIMIT_S = 120.0  # the whole simulated part (every world size) of one exercise
MPI_LIMIT_S = 90.0  # one mpiexec run, start-up included
WAIT_LIMIT_S = 20.0  # the watchdog's: one wait of one rank under mpiexec
STATUS_WIDTH = 44
INDENT, HANGING = "    ", "      "  # a part's message under it; the message's wrapped lines


# --- init ----------------------------------------------------------------------------------------------------------
def init(folder) -> int:
    """Copy every stub into ``folder`` (made if need be); an existing file is kept, and said so."""
    folder = named(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file, not a folder: give a folder for your exercises")
    folder.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for name in sorted({e.file for e in exercises.catalogue()}):
        target = folder / name
        if target.exists():
            kept.append(name)
        else:
            shutil.copyfile(STUBS / name, target)
            copied.append(name)
    if copied:
        say(f"copied {len(copied)} exercise files into {folder}/: {', '.join(copied)}")
    if kept:
        say(f"kept your {len(kept)} existing files (never overwritten): {', '.join(kept)}")
    print("next:")
    print(terminal.command(["dtrain", "exercises", "list", "--path", str(folder)], "  "))
    print(terminal.command(["dtrain", "exercises", "check", "2.1", "--path", str(folder)], "  "))
    return 0


def named(folder) -> Path:
    """``folder`` as a path; an empty name is refused (``Path("")`` would be the working directory, and ``init ""``
    would copy the stubs into it)."""
    if not str(folder).strip():
        raise UserError("the exercises' folder has an empty name: give a folder, e.g. ex (or . for this one)")
    return Path(folder)


def say(text: str, indent: str = "", hanging: str | None = None) -> None:
    """Print ``text``, each of its lines wrapped to the terminal (:func:`dtrain.terminal.paragraph`)."""
    for line in text.splitlines() or [""]:
        print(terminal.paragraph(line, indent, indent + "  " if hanging is None else hanging), flush=True)


# --- list ----------------------------------------------------------------------------------------------------------
def status_of(exercise, folder: Path, progress: dict) -> str:
    """What ``list`` says of ``exercise``: from its own function in the learner's file, against the stub's and against
    what the last check of it recorded (``progress``)."""
    path = folder / exercise.file
    if not path.is_file():
        return "no file (dtrain exercises init)"
    now = function_digest(path, exercise.function)
    if now == function_digest(STUBS / exercise.file, exercise.function):
        return "not started"
    seen = progress.get(exercise.id)
    if not isinstance(seen, dict) or not isinstance(seen.get("status"), str):
        return "not checked yet"
    if "function" in seen:
        return seen["status"] if seen["function"] == now else "not checked since it changed"
    # recorded by an older dtrain, with a digest of the whole file: still so only if the file is as it was then
    return seen["status"] if seen.get("sha256") == digest(path) else "not checked since its file changed"


def show_list(folder) -> int:
    folder = named(folder)
    progress = read_progress(folder)
    rows = [[e.id, e.file, e.function, status_of(e, folder, progress), f"{e.title} ({e.lesson_script})"]
            for e in exercises.catalogue()]  # fmt: skip
    say(f"your exercises in {folder}/; check one with:")
    print(terminal.command(["dtrain", "exercises", "check", "ID", "--path", str(folder)], "  "))
    print(terminal.table(["exercise", "file", "function", "status", "what (lesson script)"], rows, left=range(5),
                         wrap=(3, 4), notes=4))  # fmt: skip
    return 0


# --- check ---------------------------------------------------------------------------------------------------------
ONE_NODE = ("dtrain.course.exercises.checks.shared_memory:",)  # the checks of an algorithm in one node's memory


@dataclass
class OnHosts:
    """Where the mpiexec parts run when ``--hostfile`` is given: the file, its hosts, in words."""

    hostfile: str
    hosts: list  # of dtrain.launch.hosts.Host
    where: str  # "cluster course (2 node(s) x 2 slot(s), link 100mbit)"
    short: str  # in a part's name: "cluster course", "the hostfile's hosts"

    @property
    def slots(self) -> int:
        return sum(h.slots for h in self.hosts)

    def room(self, exercise) -> tuple[list, int, str]:
        """The hosts ``exercise``'s parts run on, their slots, and their name in a part's line: every host, or for an
        algorithm in one node's memory the first host with the most slots."""
        if not exercise.check.startswith(ONE_NODE):
            return self.hosts, self.slots, self.short
        biggest = max(self.hosts, key=lambda h: h.slots)
        return [biggest], biggest.slots, biggest.name

    def part(self, exercise, ranks: int, path: Path) -> tuple[str, object]:
        """A part's name and what runs it, or (a str) why it is skipped."""
        hosts, slots, name = self.room(exercise)
        if ranks <= slots:
            return f"mpiexec -n {ranks} on {name}", lambda: run_mpi(exercise, path, ranks, hosts)
        why = f"one node has {slots} slots" if len(self.hosts) > 1 and hosts != self.hosts else f"only {slots} slots"
        return f"mpiexec -n {ranks} on {name}", f"skipped: {why}"


def on_hosts(hostfile: str, chosen, which: str) -> OnHosts:
    """``--hostfile``'s hosts, checked before any part runs: a hostfile (a cluster's: up), with the slots for at least
    one of the exercises' mpiexec parts (a larger one is skipped when it comes, and said so)."""
    from dtrain.course.tour import on_hosts as read

    counts = sorted({p for exercise in chosen for p in exercise.mpi_ranks})
    if not counts:
        raise UserError(f"exercise {which} is checked in one process, without mpiexec: nothing would use --hostfile")
    hosts, where = read(hostfile)
    short = f"cluster {hosts[0].cluster}" if hosts[0].cluster else "the hostfile's hosts"
    found = OnHosts(hostfile, hosts, where, short)
    if not any(min(e.mpi_ranks) <= found.room(e)[1] for e in chosen if e.mpi_ranks):
        one = " on one host (its ranks share one node's memory)" if chosen[0].check.startswith(ONE_NODE) else ""
        give = "a host" if one else "a hostfile"
        raise UserError(f"--hostfile {hostfile}: {found.room(chosen[0])[1]} slot(s){one}, and the mpiexec parts need "
                        f"{counts[0]} ranks or more ({', '.join(map(str, counts))}): give {give} with {counts[-1]} "
                        "slots")  # fmt: skip
    skipped = [str(p) for p in counts if p > found.slots]
    say(f"the mpiexec parts run on {where}" + (f"; those on {', '.join(skipped)} ranks are skipped (only "
        f"{found.slots} slots)" if skipped else ""))  # fmt: skip
    return found


def check(which: str, folder, mpi: bool = True, hostfile: str | None = None) -> int:
    """Check one exercise (``which`` = "2.1") or every one ("all"); 0 when all checked pass, 1 otherwise.
    ``hostfile``: the mpiexec parts on its hosts (see the module's docstring)."""
    folder = named(folder)
    if hostfile is not None and not mpi:
        raise UserError("--sim-only runs no mpiexec part, so nothing would use --hostfile: give one or the other")
    chosen = exercises.catalogue() if which == "all" else (exercises.get(which),)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: run `dtrain exercises init {folder}` first")
    if which != "all":
        path = folder / chosen[0].file
        if not path.is_file():
            raise UserError(f"exercise {which}: {path} does not exist: run `dtrain exercises init {folder}` (it "
                            "copies the stubs and never overwrites a file)")  # fmt: skip
    hosts = None if hostfile is None else on_hosts(hostfile, chosen, which)
    results = {}
    for exercise in chosen:
        results[exercise.id] = check_one(exercise, folder, mpi, hosts)
    if which == "all":
        passing = sum(status.startswith("passing") for status in results.values())
        print(
            f"\ncourse progress: {passing} of {len(results)} exercises passing" + ("" if mpi else " (simulated ranks)")
        )
    return 0 if all(status.startswith("passing") for status in results.values()) else 1


def check_one(exercise, folder: Path, mpi: bool, hosts: OnHosts | None = None) -> str:
    path = (folder / exercise.file).resolve()
    say(f"exercise {exercise.id} (lesson {exercise.lesson}): {exercise.title} — {folder / exercise.file}:"
        f"{exercise.function}")  # fmt: skip
    if not path.is_file():
        say_part("your file", {"status": "error", "message": f"{path} does not exist: dtrain exercises init"})
        return "no file"
    parts = [("simulated ranks " + ", ".join(map(str, exercise.sim_ranks)) if exercise.sim_ranks else "one process",
              lambda: run_sim(exercise, path))]  # fmt: skip
    if mpi:
        parts += [(f"mpiexec -n {p}", lambda p=p: run_mpi(exercise, path, p)) if hosts is None else
                  hosts.part(exercise, p, path) for p in exercise.mpi_ranks]  # fmt: skip
    status, skipped = "passing", []
    for number, (name, run) in enumerate(parts):
        if isinstance(run, str):  # more ranks than the hostfile's slots (or one node's)
            print(f"  {name:{STATUS_WIDTH}s} {run}", flush=True)
            skipped.append(name.split()[2])
            continue
        found = run()
        say_part(name, found)
        if found["status"] != "pass":
            status = "not started" if found["status"] == "not started" else "failing"
            if found["status"] == "not started":
                say(f"its docstring says the task, the signature and a hint; lesson: {exercise.lesson_script}", INDENT,
                    HANGING)  # fmt: skip
            elif exercise.hint:
                say(f"hint: {exercise.hint}", INDENT, HANGING)
            rest = parts[number + 1 :]
            if rest:
                print(f"  {'the other parts':{STATUS_WIDTH}s} skipped (fix this one first)")
            break
    if status == "passing" and exercise.mpi_ranks and not mpi:
        status = "passing on simulated ranks"
    elif status == "passing" and skipped:
        status = f"passing (mpiexec -n {', '.join(skipped)} skipped)"
    record_progress(folder, exercise, path, status)
    if status.startswith("passing") and mpi and exercise.id == "2.1":
        where = [] if hosts is None else ["--hostfile", hosts.hostfile]
        print("  train the MLP with it:")
        print(terminal.command(["dtrain", "launch", "-n", str(min(4, hosts.slots if hosts else 4)), *where, "-m",
                                "dtrain", "train", "--paradigm", "ddp", "--allreduce",
                                f"{folder / exercise.file}:{exercise.function}"], INDENT))  # fmt: skip
    return status


def say_part(name: str, found: dict) -> None:
    words = {"pass": "pass", "not started": "not started", "fail": "FAIL", "error": "ERROR", "deadlock": "DEADLOCK",
             "timeout": "TIMEOUT"}  # fmt: skip
    where = (
        f" on {found['ranks']} rank{'s' if found.get('ranks') != 1 else ''}"
        if found.get("ranks") and found["status"] != "not started"
        else ""
    )
    print(f"  {name:{STATUS_WIDTH}s} {words[found['status']]}{where}", flush=True)
    if found["status"] != "pass" and found.get("message"):
        say(found["message"], INDENT, HANGING)


def run_sim(exercise, path: Path) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        sizes = ",".join(map(str, exercise.sim_ranks))
        cmd = [sys.executable, "-m", "dtrain.course.exercises.run", "sim", exercise.id, str(path), str(result), sizes]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=SIM_LIMIT_S, env=child_env())
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "message": f"still running after {SIM_LIMIT_S:g} s: a loop that never "
                    "ends? (a rank that only computes is not a deadlock the simulator can see)"}  # fmt: skip
        if result.is_file():
            return json.loads(result.read_text())
        said = last_lines(done.stderr) or f"the check ended with status {done.returncode}"
        return {"status": "error", "message": said}


def run_mpi(exercise, path: Path, ranks: int, hosts=None) -> dict:
    """One mpiexec part: the exercise's check on ``ranks`` ranks (on ``hosts``, a list of hosts.Host, if given)."""
    from dtrain.launch import launcher

    with tempfile.TemporaryDirectory() as scratch:
        target = ["-m", "dtrain.course.exercises.run", "mpi", exercise.id, str(path), scratch]
        env = {**child_env(), "DTRAIN_TIMEOUT": f"{WAIT_LIMIT_S:g}"}
        try:
            done = launcher.launch(ranks, target, timeout=MPI_LIMIT_S, capture=True, env=env, hosts=hosts)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "message": f"{in_case(scratch)}mpiexec -n {ranks} did not end within "
                    f"{MPI_LIMIT_S:g} s"}  # fmt: skip
        raised = sorted(Path(scratch).glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        if raised:
            return json.loads(raised[0].read_text())
        result = Path(scratch) / "result.json"
        if result.is_file():
            return json.loads(result.read_text())
        stuck = [line for line in done.stderr.splitlines() if line.startswith("dtrain watchdog")]
        if stuck:
            said = (f"{in_case(scratch)}a rank waited more than {WAIT_LIMIT_S:g} s for the others: a deadlock "
                    "(a receive that no rank sends to, or a rank that skipped a call); the watchdog's "
                    "report:")  # fmt: skip
            return {"status": "deadlock", "message": "\n".join([said, *stuck[:3]])}
        return {"status": "error", "message": last_lines(done.stderr) or f"mpiexec ended with {done.returncode}"}


def in_case(scratch) -> str:
    """``"in case 5 of 7 (what it is): "``, the case rank 0 had started when a job under mpiexec stopped ("" if it
    had started none, or did not say)."""
    try:
        where = json.loads((Path(scratch) / "case.json").read_text())["where"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f"in {where}" if where else ""


def child_env() -> dict:
    """One thread per process, and dtrain importable from wherever the learner runs the checker."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


def last_lines(text: str, count: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-count:])


# --- progress ------------------------------------------------------------------------------------------------------
def digest(path: Path) -> str:
    """The whole file's sha256 (what an older dtrain recorded, and what a file that cannot be parsed is known by)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def function_digest(path: Path, function: str) -> str:
    """A digest of what ``function`` is in the file ``path``: its own top-level definition and, by name and in turn,
    the top-level definitions it uses (helpers, imports, constants), as parsed (comments and blank lines do not
    count); the whole file's (:func:`digest`) if it cannot be parsed or binds no ``function`` at its top level."""
    text = path.read_bytes()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return "file:" + digest(path)
    bindings: dict[str, list[ast.stmt]] = {}
    for node in tree.body:
        for name in bound(node):
            bindings.setdefault(name, []).append(node)
    if function not in bindings:
        return "file:" + digest(path)
    used, todo, nodes = set(), [function], []
    while todo:
        name = todo.pop()
        if name in used or name not in bindings:
            continue
        used.add(name)
        for node in bindings[name]:
            if node not in nodes:
                nodes.append(node)
                todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    nodes.sort(key=lambda node: node.lineno)
    return hashlib.sha256("\n".join(ast.dump(node) for node in nodes).encode()).hexdigest()


def bound(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds: a definition's name, an import's names, an assignment's targets (and,
    for an ``if``/``try``/``with``, everything bound inside it)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    names = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
            names.add(inner.id)
        elif isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(inner.name)
        elif isinstance(inner, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in inner.names}
    return names


def read_progress(folder: Path) -> dict:
    """``{exercise id: {"status", "function", "sha256"}}`` from the folder's progress file; {} if there is none or it
    cannot be read (an entry an older dtrain wrote has no "function": :func:`status_of` reads it as such)."""
    try:
        found = json.loads((folder / PROGRESS).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def record_progress(folder: Path, exercise, path: Path, status: str) -> None:
    if not path.is_file():
        return
    progress = read_progress(folder)
    progress[exercise.id] = {"status": status, "function": function_digest(path, exercise.function),
                             "sha256": digest(path)}  # fmt: skip
    (folder / PROGRESS).write_text(json.dumps(progress, indent=1, sort_keys=True))

"""Command lines for fuzzing ``dtrain``, built from its real parsers, run in a fresh folder each, and judged.

tests/test_fuzz_cli.py (the suite's fast profile) and scripts/fuzz_cli.py (the long one) share this module.

**Where the flags come from.** :func:`commands` walks ``dtrain.cli.build_parser()``: every option of ``train``,
``launch``, ``plan``, ``tour`` and ``exercises init|list|check``, its spellings, its type or choices, its mutually
exclusive partners; a paradigm's own flags are found through the registry (``parallel.get(name).flags``). A flag
added to a parser is fuzzed without a word here. What a value may be follows from the option: its choices, its type
(``int``, ``float``, a parsing function such as ``config.hidden_sizes``, which is asked which of the candidate words
it takes), or a path (a ``FILE``/``DIR`` metavar); :data:`DOMAINS` adds words for the options whose type says too
little (a host list, a mesh, an exercise's id). Each value is drawn valid or not: wrong types, numbers out of range
(negative, zero, huge, nan, inf), unknown choices, missing files, folders where files are expected and files where
folders are, empty strings, unicode; flags are duplicated, abbreviated, spelled ``--flag=value``, left without their
value, and paired with flags they exclude (another paradigm's, a mutually exclusive one).

**What each command promises** (read off dtrain/cli.py and the commands it calls), checked by :func:`judge`:

    train                  0, or 2 for a refusal
    plan                   0 or 2; with --check also 1 (a measured count differed from the prediction)
    tour                   0 or 2; also 1 when a run failed (its row says why, and stderr "N run(s) failed")
    exercises init, list   0 or 2
    exercises check        0, 1 (an exercise failing or not started) or 2
    launch                 its target's: the script's own status (0, 1 or 3 here), 0 or 2 for `-m dtrain train`,
                           2 for a refusal; a watchdog that says it aborts the job (exit status 14) must end it so

and everywhere: it ends within the time limit; a refusal (2) is exactly one ``dtrain: error:`` line on stderr (the
(sub)command's name in it for a usage error: ``dtrain train: error:``); no Python traceback, no MPI abort banner; and
nothing is written but under the paths the command was given to write (``--out``, ``--checkpoint-dir``, ``--trace``,
``--json``, ``--png``, ``exercises init``'s folder, ``exercises check``'s progress file in ``--path``, the tour's
``runs/tour`` when it has no ``--out``).

**Cost.** A case that trains is capped (:data:`CAPS`): one epoch, a few hundred samples, widths of 32, 3 ranks at most,
so a valid one ends in a few seconds. A number above its cap is brought down to it, but a size of 2**31 or more is
left as it is (no array can be that large: dtrain must refuse it at once), and so is a value that is not a number;
under mpiexec a watchdog --timeout below 5 s is raised to 5 s (it would end a healthy job).

**How a case runs.** :func:`run_in_process` calls ``dtrain.cli.main(argv)`` in this process (its folder the working
directory, file descriptors 1 and 2 captured, an alarm for the time limit, an audit hook that records every file
written outside the folder); a case that would start a process (mpiexec, a checker's subprocess) is stopped there
(:class:`NeedsProcess`) and run again through :func:`run_subprocess`, ``python -m dtrain ARGV``, the real exit path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import ClassVar

from hypothesis import strategies as st

# --- the folder every case runs in ------------------------------------------------------------------------------
FILE = "file.txt"  # a plain file (where a folder is expected)
FOLDER = "folder"  # an empty folder (where a file is expected)
SCRIPT = "script.py"  # a launch target: exits with the status its first argument names
HOSTS = "hosts.txt"  # a hostfile of this machine
BAD_HOSTS = "bad-hosts.txt"  # a hostfile with a typo
EXERCISES = "ex"  # the exercise stubs, as `dtrain exercises init ex` copies them (made when a case names it)
MNIST = "mnist"  # four MNIST-format IDX files of a few images (made when a case names it)
WORLD = {
    FILE: "# a plain file, not a folder\n",
    SCRIPT: '"""A launch target for the fuzzer: exits with the status its first argument names."""\nimport sys\n\n'
    'if __name__ == "__main__":\n    sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)\n',
    HOSTS: "localhost:3\n",
    BAD_HOSTS: "localhost slot=3\n",
}
SCRIPT_STATUSES = ("0", "1", "3")  # what the script is asked to exit with (2 would read as dtrain's refusal)
OUTPUT_DESTS = ("out", "checkpoint_dir", "trace", "json", "png")  # the options that name where a command writes

# --- caps on what a case that runs may cost ---------------------------------------------------------------------
CAPS = {
    "epochs": 1, "samples": 256, "features": 32, "classes": 10, "accumulate": 4, "ranks": 3, "min_ranks": 3,
    "slow_factor": 2.0, "max_restarts": 1, "restart_delay": 0.1, "check": 1, "microbatches": 8, "virtual_stages": 2,
    "powersgd_rank": 4, "servers": 2, "layers": 3, "width": 32, "batch_size": 128, "dp": 3, "tp": 3, "pp": 3,
}  # fmt: skip
HIDDEN_CAP = (32, 3)  # the widest hidden layer, and how many
# Sizes whose huge values (HUGE: 2**31 and more) are left as they are: no array can have them, so dtrain must refuse
# them at once (or say it has not the memory), never start on them.
SIZES = ("samples", "features", "classes", "batch_size", "hidden", "width", "layers", "accumulate", "microbatches",
         "virtual_stages", "powersgd_rank", "servers", "dp", "tp", "pp")  # fmt: skip
HUGE_FROM = 2**31
BASE = {"train": ["--epochs", "1", "--samples", "256", "--features", "32"], "tour": ["--epochs", "1"]}
WATCHDOG_FLOOR_S = 5.0  # a launched job's --timeout (the watchdog) below this is raised to it: see CAPS
TOUR_PARADIGMS = 2  # a tour runs at most this many paradigms (each an mpiexec job)

# --- values -----------------------------------------------------------------------------------------------------
HUGE = ("2147483648", "9" * 30)
BAD_INTS = ("0", "-1", "-3", *HUGE, "1.5", "1e3", "nan", "inf", "", " ", "x", "٣", "0x10", "1_0", "--1", "+2")
BAD_FLOATS = ("0", "-1", "-0.5", "nan", "NaN", "inf", "-inf", "1e308", "1e309", "1e-320", "", "x", "1,5", "٣.٥")
GOOD_FLOATS = ("0", "0.001", "0.01", "0.5", "0.9", "1", "1.5", "2", "10", "30")
WORDS = ("", " ", ",", "-", "--", "none", "0", "-1", "8", "8,8", "8,,8", "a,b", "nan", "inf", "é", "日本語", "x" * 300,
         "a b", "%s", "{}", "'", '"', "\\", "\t", "auto", "all")  # fmt: skip
IN_PATHS = (HOSTS, BAD_HOSTS, FILE, FOLDER, FOLDER + "/", "./" + FILE, "missing.txt", "missing/deeper.txt", "", "-",
            "données.txt", "a b", "/proc/dtrain-fuzz", "/dev/null")  # fmt: skip
OUT_PATHS = ("out", "runs/a", "out/", "new/deeper/x", "t.json", "p.png", FILE, FOLDER, SCRIPT, "", "-", "-d", "données",
             "a b", "/proc/dtrain-fuzz")  # fmt: skip


def _paradigm_lists() -> tuple[str, ...]:
    from dtrain import parallel
    from dtrain.course import tour

    names = (*tour.entries(3), *parallel.names())
    return (*names, *(f"{a},{b}" for a, b in itertools.pairwise(names)), "nope", "single,nope", ",", " single ")


def _exercise_ids() -> tuple[str, ...]:
    from dtrain.course import exercises

    return (*(e.id for e in exercises.catalogue()), "all", "9.9", "2.1 ", "", "2")


def _machines() -> tuple[str, ...]:
    from dtrain.plan import hardware

    return (*hardware.presets(), "nope", "")


DOMAINS = {  # words for the options whose type says too little (valid ones first, then odd ones)
    "hidden": ("8", "8,8", "16,8,8", "none", "", "0", "-8", "8,,8", "a", "8.5", "1e9", "999999999,999999999"),
    "paradigms": _paradigm_lists,
    "exercise": _exercise_ids,
    "machine": _machines,
    "hosts": ("localhost", "localhost:2", "localhost:3", "localhost slots=3", "localhost:0", "localhost:x", ",", "",
              "localhost,localhost", "localhost:-1", ":3"),
    "mesh": ("x=2,y=2", "x=3", "x=1", "x=2,x=2", "x=0", "y", "", "x=a"),
    "shard": ("w1=_,y", "b1=y", "w1=x,y", "zz=q", "", "w1"),
    "configuration": ("ddp ring", "single (1 rank)", "tp2 x dp2", "nope", ""),
    "allreduce": ("ring", "auto", "mpi", f"{SCRIPT}:main", "missing.py:f", f"{FILE}:f", "x.py:", "nope",
                  f"{EXERCISES}/ring.py:ring_allreduce"),
    "module": ("dtrain", "nosuch_module_fuzz", "", "dtrain.nope", "-x"),
}  # fmt: skip
PATH_DESTS = ("data_dir", "path", "hostfile", "metrics", "output")


# --- the parsers --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Option:
    """One option (or positional) of a (sub)command, as its parser declares it."""

    spellings: tuple[str, ...]  # ("-n", "--ranks"); () for a positional
    dest: str
    kind: str  # "switch" (no value), "value", "optional" (nargs="?"), "append", "positional", "remainder"
    type: object = None
    choices: tuple | None = None
    required: bool = False
    metavar: str | None = None
    excludes: tuple[str, ...] = ()  # the flags of its mutually exclusive group

    @property
    def flag(self) -> str:
        return max(self.spellings, key=len) if self.spellings else self.dest

    @property
    def role(self) -> str:
        """The kind of value: output (where it writes), path (what it reads), choice, int, float or text."""
        if self.dest in OUTPUT_DESTS:
            return "output"
        if self.metavar in ("FILE", "DIR") or self.dest in PATH_DESTS:
            return "path"
        if self.choices:
            return "choice"
        if self.type is int:
            return "int"
        if self.type is float or getattr(self.type, "__name__", "") == "seconds":
            return "float"
        return "text"


def _subcommands(parser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser) -> tuple[Option, ...]:
    excludes = {}
    for group in parser._mutually_exclusive_groups:
        flags = [max(a.option_strings, key=len) for a in group._group_actions]
        for action in group._group_actions:
            excludes[action.dest] = tuple(f for f in flags if f != max(action.option_strings, key=len))
    found = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        if not a.option_strings:
            kind = "remainder" if a.nargs == argparse.REMAINDER else "positional"
        elif a.nargs == 0:
            kind = "switch"
        elif isinstance(a, argparse._AppendAction):
            kind = "append"
        elif a.nargs == "?":
            kind = "optional"
        else:
            kind = "value"
        found.append(Option(tuple(a.option_strings), a.dest, kind, a.type, tuple(a.choices) if a.choices else None,
                            a.required, a.metavar if isinstance(a.metavar, str) else None,
                            excludes.get(a.dest, ())))  # fmt: skip
    return tuple(found)


_COMMANDS: dict | None = None


def commands() -> dict[str, tuple[Option, ...]]:
    """Every fuzzed (sub)command's options, from ``dtrain.cli.build_parser()``: ``{"train": (...), "launch": ...,
    "plan": ..., "tour": ..., "exercises init": ..., "exercises list": ..., "exercises check": ...}``."""
    global _COMMANDS
    if _COMMANDS is None:
        from dtrain.cli import build_parser

        sub = _subcommands(build_parser())
        found = {name: _options(sub[name]) for name in ("train", "launch", "plan", "tour")}
        found.update({f"exercises {name}": _options(p) for name, p in _subcommands(sub["exercises"]).items()})
        _COMMANDS = found
    return _COMMANDS


def paradigm_flags() -> dict[str, set[str]]:
    """Each paradigm's own flags (their dests), from the registry."""
    from dtrain import parallel

    return {name: {flag.name for flag in parallel.get(name).flags} for name in parallel.names()}


def _all_flags(options) -> list[str]:
    return [s for o in options for s in o.spellings]


def _abbreviation(option: Option, options) -> str | None:
    """The shortest prefix of the option's long spelling that no other option of the command starts with."""
    long, others = option.flag, [s for s in _all_flags(options) if s not in option.spellings]
    if not long.startswith("--"):
        return None
    for end in range(3, len(long)):
        if not any(s.startswith(long[:end]) for s in others):
            return long[:end]
    return None


# --- strategies ---------------------------------------------------------------------------------------------------
def _words(source) -> tuple[str, ...]:
    return tuple(source() if callable(source) else source)


def _accepted(option: Option, word: str) -> bool:
    try:
        option.type(word)
    except Exception:  # (argparse refuses it: ArgumentTypeError, ValueError, TypeError)
        return False
    return True


def values(option: Option) -> st.SearchStrategy[str]:
    """A word for ``option``'s value: valid (its choices, its type's numbers, a word its parsing function takes, a
    fixture path) three times in four, else odd (a wrong type, out of range, unknown, empty, unicode)."""
    role, odd = option.role, st.sampled_from(WORDS)
    if option.dest in DOMAINS:
        words = _words(DOMAINS[option.dest])
        good = st.sampled_from(words)
        if option.dest == "hosts":  # (a word that reads as a host name would send mpiexec's ssh out to find it)
            return good
        if option.choices:
            good = st.one_of(good, st.sampled_from([str(c) for c in option.choices]))
    elif role == "output":
        return st.sampled_from(OUT_PATHS)
    elif role == "path":
        return st.sampled_from(IN_PATHS)
    elif role == "choice":
        good = st.sampled_from([str(c) for c in option.choices])
        odd = st.one_of(odd, st.sampled_from([str(c).upper() for c in option.choices] + ["nope", " "]))
    elif role == "int":
        good = st.integers(0, 8).map(str)
        odd = st.sampled_from(BAD_INTS)
    elif role == "float":
        good = st.sampled_from(GOOD_FLOATS)
        odd = st.sampled_from(BAD_FLOATS)
    elif option.type is not None and option.type is not str:  # a parsing function: it says which words it takes
        candidates = (*WORDS, *BAD_INTS, *GOOD_FLOATS, "8", "16,8", "single", "ddp,single")
        good = st.sampled_from([w for w in candidates if _accepted(option, w)] or ["0"])
    else:
        good = st.sampled_from(WORDS)
    return st.one_of(good, good, good, odd)


@st.composite
def spelled(draw, option: Option, options, value=None) -> list[str]:
    """The words that give ``option``: ``--flag value`` mostly, sometimes ``--flag=value``, an abbreviation, the flag
    without its value, or a switch with a value."""
    if option.kind in ("positional", "remainder"):
        return [draw(values(option)) if value is None else value]
    flag = draw(st.sampled_from(option.spellings))
    how = draw(st.sampled_from(["plain"] * 12 + ["equals", "abbreviated", "bare"]))
    if how == "abbreviated":
        flag = _abbreviation(option, options) or flag
    if option.kind == "switch":
        return [f"{flag}=yes"] if how == "equals" else [flag]
    word = draw(values(option)) if value is None else value
    if how == "bare" or (option.kind == "optional" and draw(st.booleans())):
        return [flag]
    if how == "equals" and flag.startswith("--"):
        return [f"{flag}={word}"]
    return [flag, word]


@dataclasses.dataclass
class Case:
    """One command line to run, and what it promises."""

    command: str  # "train", "launch", "plan", "tour", "exercises init", "exercises list", "exercises check"
    argv: list[str]  # the words after `dtrain`
    statuses: frozenset  # the exit statuses it may end with
    launches: bool = False  # it may start mpiexec (or another process): judged through a subprocess in the suite
    needed: str = ""  # what it started when it was run in-process (and so went on in a subprocess)

    @property
    def line(self) -> str:
        return shlex.join(["dtrain", *self.argv])

    def outputs(self) -> list[str]:
        """Where it may write, relative to its folder (a path given as "-" or that is absolute is left out)."""
        words, options = self.argv[1:], commands().get(self.command, ())
        if self.command.startswith("exercises"):
            words = self.argv[2:]
        if self.command == "launch" and is_train_target(words):
            at = words.index("-m")
            pairs = [*scan(words[:at], options), *scan(words[at + 3 :], commands()["train"])]
        else:
            pairs = list(scan(words, options))
        # (--trace, --json, --png: "-" is standard output; --out and --checkpoint-dir are folders, "-" one's name)
        found = [v for o, v in pairs if o.dest in OUTPUT_DESTS and (v != "-" or o.dest in ("out", "checkpoint_dir"))]
        if self.command == "exercises init":  # (its folder: "-" is a folder's name here)
            return [os.path.normpath(w) for w in words[:1] if w and not os.path.isabs(w)]
        if self.command == "exercises check":
            paths = [v for o, v in scan(words, options) if o.dest == "path"]
            found.append(os.path.join(paths[-1] if paths else ".", ".dtrain-progress.json"))
        if self.command == "tour" and not any(o.dest == "out" for o, _ in scan(words, options)):
            found.append("runs/tour")
        return [os.path.normpath(p) for p in found if p and not os.path.isabs(p)]


def is_train_target(words: list[str]) -> bool:
    return any(words[i : i + 3] == ["-m", "dtrain", "train"] for i in range(len(words)))


def resolve(word: str, options) -> Option | None:
    """The option ``word`` names (``--epochs``, ``--epochs=1``, ``--epo``: argparse's abbreviations), else None."""
    name = word.partition("=")[0] if word.startswith("--") else word
    for o in options:
        if name in o.spellings:
            return o
    if not name.startswith("--") or len(name) < 3:
        return None
    found = [o for o in options if any(s.startswith(name) for s in o.spellings if s.startswith("--"))]
    return found[0] if len(found) == 1 else None


def scan(words: list[str], options):
    """(option, value) for each option given in ``words``, as argparse would read them (roughly: a value is what
    follows ``=`` or the next word; "" when it has none)."""
    for i, word in enumerate(words):
        option = resolve(word, options) if word.startswith("-") else None
        if option is None or option.kind == "switch":
            continue
        if "=" in word and word.startswith("--"):
            yield option, word.partition("=")[2]
        elif i + 1 < len(words) and not (option.kind == "optional" and words[i + 1].startswith("-")):
            yield option, words[i + 1]
        else:
            yield option, ""


def _rarely(draw, n: int) -> bool:
    """True once in ``n`` draws (the last value: Hypothesis draws the smallest values most, and shrinks to them)."""
    return draw(st.integers(0, n - 1)) == n - 1


@st.composite
def _flags(draw, options, most: int, weights=None) -> list[str]:
    """Up to ``most`` of ``options`` (the same one twice sometimes: a duplicated flag), each spelled."""
    optional = [o for o in options if o.spellings]
    pool = optional if weights is None else [o for o in optional for _ in range(weights(o))]
    chosen = draw(st.lists(st.sampled_from(pool), max_size=most)) if pool else []
    words = []
    for option in chosen:
        words += draw(spelled(option, options))
        for other in option.excludes if _rarely(draw, 10) else ():  # its mutually exclusive partner
            words += draw(spelled(next(o for o in options if o.flag == other), options))
    return words


@st.composite
def train_words(draw, most: int = 5) -> list[str]:
    """``dtrain train``'s flags: a paradigm (or an unknown one), its own flags mostly, the shared ones, and now and
    then another paradigm's."""
    options = commands()["train"]
    own = paradigm_flags()
    paradigm_option = next(o for o in options if o.dest == "paradigm")
    odd = _rarely(draw, 8)  # an unknown paradigm
    paradigm = draw(st.sampled_from(["nope", "", "DDP", "ps_sync"] if odd else paradigm_option.choices))
    mine, anyone = own.get(paradigm, set()), set().union(*own.values())

    def weight(o: Option) -> int:
        return 6 if o.dest in mine else 1 if o.dest in anyone else 3

    words = draw(_flags(options, most, weight))
    if not _rarely(draw, 8):  # (else no --paradigm: the default)
        words = [*draw(spelled(paradigm_option, options, paradigm)), *words]
    if _rarely(draw, 20):
        words.append(draw(st.sampled_from(["--epochz", "-x", "stray", "--", "--paradigm"])))
    return words


def _cap_number(text: str, cap: float, integer: bool, huge_kept: bool = False) -> str:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        return text
    if value <= cap or not math.isfinite(value) or (huge_kept and value >= HUGE_FROM):
        return text
    return str(int(cap) if integer else cap)


def _cap_hidden(text: str) -> str:
    widest, most = HIDDEN_CAP
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        return text
    if any(s >= HUGE_FROM for s in sizes):
        return text
    return ",".join(str(min(s, widest)) for s in sizes[:most])


def cap(words: list[str], options, launched: bool = False) -> list[str]:
    """``words`` with every number above its cap (:data:`CAPS`) brought down to it: so a valid case that runs ends in
    a few seconds. ``launched``: under mpiexec, where a --timeout below :data:`WATCHDOG_FLOOR_S` is raised to it (the
    watchdog would end a healthy job; :func:`judge` still checks that a job it ends ends with its status)."""
    out = list(words)
    for i, word in enumerate(out):
        option = resolve(word, options) if word.startswith("-") else None
        if option is None or option.kind == "switch":
            continue
        name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        at = i if eq else i + 1
        if not eq and (at >= len(out) or (option.kind == "optional" and out[at].startswith("-"))):
            if option.dest == "check":  # bare --check: 3 configurations; one is enough
                out[i] = f"{name}=1"
            continue
        text = value if eq else out[at]
        if option.dest in CAPS:
            new = _cap_number(text, CAPS[option.dest], option.type is int, option.dest in SIZES)
        elif option.dest == "hidden":
            new = _cap_hidden(text)
        elif option.dest == "timeout" and launched:
            new = text
            with contextlib.suppress(ValueError):
                new = str(WATCHDOG_FLOOR_S) if 0 < float(text) < WATCHDOG_FLOOR_S else text
        elif option.dest == "paradigms":
            new = ",".join(text.split(",")[:TOUR_PARADIGMS])
        else:
            continue
        out[at] = f"{name}={new}" if eq else new
    return out


def given(words: list[str], options, dest: str) -> list[str]:
    """The values ``words`` give the option ``dest`` (every one, if it is given twice)."""
    return [v for o, v in scan(words, options) if o.dest == dest]


@st.composite
def train_cases(draw) -> Case:
    words = cap(draw(train_words()), commands()["train"])
    return Case("train", ["train", *BASE["train"], *words], frozenset({0, 2}))


@st.composite
def launch_cases(draw) -> Case:
    """``dtrain launch``: its options (-n mostly given), and a target: the script with the status it is to exit
    with, ``-m dtrain train`` with train's flags, or a target that is not there (a missing script, a folder, an
    unknown module, nothing)."""
    options = commands()["launch"]
    own = [o for o in options if o.dest != "module"]
    words = draw(_flags(own, 3, lambda o: 1))
    ranks = next(o for o in options if o.dest == "ranks")
    if not _rarely(draw, 10):  # (-n left out: a usage error)
        words = [*draw(spelled(ranks, options, draw(st.sampled_from(["1", "2", "3", "3", "2"])))), *words]
    if given(words, options, "max_restarts") and not given(words, options, "restart_delay"):
        words += ["--restart-delay", "0"]  # (a failing target is started again: not after 2 s)
    target = draw(st.sampled_from(["script", "script", "train", "train", "train", "module", "odd"]))
    statuses = {0, 2}
    if target == "script":
        status = draw(st.sampled_from(SCRIPT_STATUSES))
        tail, statuses = [SCRIPT, status], {int(status), 2}
    elif target == "train":
        tail = ["-m", "dtrain", "train", *BASE["train"], "--no-progress", *draw(train_words(most=4))]
    elif target == "module":
        tail = ["-m", draw(values(next(o for o in options if o.dest == "module")))]
    else:
        tail = draw(st.sampled_from([[], ["missing.py"], [FOLDER], ["--"], ["--", SCRIPT, "0"], ["-m"]]))
    dry = any(getattr(resolve(w, options), "dest", "") == "dry_run" for w in words)
    statuses |= {0} if dry else set()
    argv = ["launch", *cap(words, options, launched=True), *cap(tail, commands()["train"], launched=True)]
    if target == "train" and "--paradigm" not in tail and draw(st.booleans()):
        argv[-len(tail) :] = [*tail[:3], "--paradigm", "ddp", *tail[3:]]
    return Case("launch", argv, frozenset(statuses), launches=not dry)


@st.composite
def plan_cases(draw) -> Case:
    options = commands()["plan"]
    words = draw(_flags(options, 6, lambda o: 1 if o.dest == "check" else 4))
    checks = bool(given(words, options, "check"))
    if checks:
        words = cap(words, options, launched=True)
    return Case("plan", ["plan", *words], frozenset({0, 1, 2} if checks else {0, 2}), launches=checks)


@st.composite
def tour_cases(draw) -> Case:
    options = commands()["tour"]
    words = draw(_flags(options, 4, lambda o: 1))
    paradigms = next(o for o in options if o.dest == "paradigms")
    if not given(words, options, "paradigms"):  # (the whole tour: 16 jobs)
        words += draw(spelled(paradigms, options, draw(st.sampled_from(["single", "ddp-ring", "ps-sync", "gossip"]))))
    words = cap(words, options)
    ranks = next(o for o in options if o.dest == "ranks")
    if not given(words, options, "ranks"):
        words = [*draw(spelled(ranks, options, draw(st.sampled_from(["1", "2", "3"])))), *words]
    words = cap(words, options)
    return Case("tour", ["tour", *BASE["tour"], *words], frozenset({0, 1, 2}), launches=True)


@st.composite
def exercises_cases(draw) -> Case:
    action = draw(st.sampled_from(["init", "list", "check", "check", "check"]))
    options = commands()[f"exercises {action}"]
    words = draw(_flags(options, 3, lambda o: 1))
    positional = [o for o in options if not o.spellings]
    head = [draw(values(o)) if o.role != "path" else draw(st.sampled_from([*OUT_PATHS, EXERCISES, "ex2"]))
            for o in positional]  # fmt: skip
    if action != "init" and not _rarely(draw, 4):
        words += ["--path", draw(st.sampled_from([EXERCISES, EXERCISES, FOLDER, FILE, "missing", "", "données"]))]
    if action == "check" and head == ["all"] and {EXERCISES, EXERCISES + "/"} & set(given(words, options, "path")):
        head = ["2.1"]  # (every exercise, one subprocess each: too long for a case)
    if _rarely(draw, 10):
        head = head[:0]  # (the positional left out)
    statuses = {0, 1, 2} if action == "check" else {0, 2}
    return Case(f"exercises {action}", ["exercises", action, *head, *words], frozenset(statuses),
                launches=action == "check")  # fmt: skip


SUITE = {"train": 10, "plan": 6, "exercises": 4, "launch": 5, "tour": 1}  # a command's share of the cases
LONG = {"train": 8, "plan": 5, "exercises": 3, "launch": 5, "tour": 2}
BUILDERS = {"train": train_cases, "launch": launch_cases, "plan": plan_cases, "tour": tour_cases,
            "exercises": exercises_cases}  # fmt: skip


def cases(weights: dict[str, int] = SUITE) -> st.SearchStrategy[Case]:
    """Command lines of every fuzzed command, ``weights`` their shares."""
    names = [name for name, weight in weights.items() for _ in range(weight)]
    return st.sampled_from(names).flatmap(lambda name: BUILDERS[name]())


def case_of(argv: list[str]) -> Case:
    """The :class:`Case` of a command line given by hand (a regression, a replay): its promises from its words."""
    command = argv[0] if argv[:1] != ["exercises"] else " ".join(argv[:2])
    statuses = {0, 2}
    if command in ("tour", "exercises check") or (command == "plan" and given(argv, commands()["plan"], "check")):
        statuses.add(1)
    launches = command in ("tour", "exercises check", "launch") or 1 in statuses
    dry = command == "launch" and any(getattr(resolve(w, commands()["launch"]), "dest", "") == "dry_run" for w in argv)
    if command == "launch" and SCRIPT in argv and not dry:
        after = argv[argv.index(SCRIPT) + 1 :]
        statuses = {2, int(after[0]) if after and after[0].isdigit() else 0}
    return Case(command, list(argv), frozenset(statuses), launches=launches and not dry)


# --- the folder ---------------------------------------------------------------------------------------------------
def make_world(folder: Path, case: Case) -> None:
    """The files every case finds in its folder; the exercise stubs and a small MNIST only if its words name them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in WORLD.items():
        (folder / name).write_text(text)
    (folder / FOLDER).mkdir()
    words = " ".join(case.argv)
    if re.search(rf"(^|[\s=]){EXERCISES}(/|\s|$)", words):
        from dtrain.course import exercises
        from dtrain.course.exercises.checker import STUBS

        (folder / EXERCISES).mkdir()
        for name in sorted({e.file for e in exercises.catalogue()}):
            shutil.copyfile(STUBS / name, folder / EXERCISES / name)
    if re.search(rf"(^|[\s=]){MNIST}(/|\s|$)", words):
        _fake_mnist(folder / MNIST)


def _fake_mnist(folder: Path) -> None:
    import numpy as np

    from dtrain.data import write_idx

    folder.mkdir()
    rng = np.random.default_rng(0)
    for images, labels, n in (("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 20),
                              ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10)):  # fmt: skip
        write_idx(folder / images, rng.integers(0, 255, size=(n, 28, 28), dtype=np.uint8))
        write_idx(folder / labels, np.arange(n, dtype=np.uint8) % 10)


def listing(folder: Path) -> dict[str, tuple]:
    """Every file and folder under ``folder``: relative path -> (kind, size, mtime)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            with contextlib.suppress(OSError):
                info = path.lstat()
                kind = "dir" if path.is_dir() and not path.is_symlink() else "file"
                found[str(path.relative_to(folder))] = (kind, 0 if kind == "dir" else info.st_size, info.st_mtime_ns)
    return found


def strays(before: dict, after: dict, outputs: list[str]) -> list[str]:
    """What changed in the folder (made, changed or removed) that is not under one of ``outputs`` (nor a folder on
    the way to one)."""

    def allowed(path: str, kind: str) -> bool:
        return any(path == o or path.startswith(o + os.sep) or (kind == "dir" and o.startswith(path + os.sep))
                   for o in outputs)  # fmt: skip

    changed = [p for p in after if before.get(p) != after[p] and not (after[p][0] == "dir" and p in before)]
    removed = [p for p in before if p not in after]
    return sorted({p for p in changed if not allowed(p, after[p][0])} | {f"{p} (removed)" for p in removed
                                                                         if not allowed(p, before[p][0])})  # fmt: skip


# --- running a case -----------------------------------------------------------------------------------------------
IN_PROCESS_LIMIT_S = 30.0
SUBPROCESS_LIMIT_S = 120.0
ENVIRONMENT = {"DTRAIN_KERNELS": "numpy", "COLUMNS": "80"}  # NumPy's reductions: no Numba compilation in a case


@dataclasses.dataclass
class Result:
    case: Case
    how: str  # "in-process" or "subprocess"
    status: int | None  # None: it did not end within the time limit
    stdout: str
    stderr: str
    seconds: float
    strays: list[str]
    problems: list[str] = dataclasses.field(default_factory=list)


class NeedsProcess(BaseException):
    """Raised in a case run in-process where it would start a process: it is run through a subprocess instead."""


class Hang(BaseException):
    """The in-process time limit."""


class _Guard:
    """An audit hook (one per process; inert between cases): records the files a case writes outside its folder,
    and stops a case that would start a process."""

    SPAWN = ("subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.system")
    WRITE: ClassVar[dict] = {  # the event's arguments that name what it writes
        "os.mkdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.remove": (0,), "os.rmdir": (0,),
        "shutil.copyfile": (1,), "shutil.rmtree": (0,), "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,),
    }  # fmt: skip

    def __init__(self):
        self.folder: str | None = None
        self.outside: set[str] = set()
        sys.addaudithook(self)

    def __call__(self, event, args):
        if self.folder is None:
            return
        if event in self.SPAWN and (event != "subprocess.Popen" or _launching(args[1])):
            raise NeedsProcess(f"{event}: {args[1] if event == 'subprocess.Popen' else args[0]}")
        paths = ()
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1] or "", args[2] or 0
            if any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                paths = (args[0],)
        elif event in self.WRITE:
            paths = tuple(args[i] for i in self.WRITE[event] if isinstance(args[i], (str, bytes, os.PathLike)))
        for path in paths:
            full = os.path.abspath(os.fsdecode(path))
            if not (full + os.sep).startswith(self.folder + os.sep) and not os.path.lexists(full):
                self.outside.add(full)  # (made here: whether it is still there is seen at the end)


def _launching(argv) -> bool:
    """Whether a process started with ``argv`` runs dtrain or a learner's code: a Python, or mpiexec (not a query of
    its version, nor a helper such as ``uname -p``, which the platform module asks once)."""
    words = [os.fsdecode(w) for w in argv] if isinstance(argv, (list, tuple)) else [os.fsdecode(argv)]
    first = os.path.basename(words[0]) if words else ""
    return first.startswith("python") or (first.startswith(("mpiexec", "mpirun")) and "--version" not in words)


_guard: _Guard | None = None
IGNORED_OUTSIDE = ("/dev/", f"{os.sep}__pycache__{os.sep}", f"{os.sep}.cache{os.sep}", f"{os.sep}matplotlib")


def _outside_left(paths: set[str]) -> list[str]:
    """The paths made outside the folder that are still there (a scratch folder that was removed, a cache, a device
    are not what a user would find behind)."""
    return sorted(p for p in paths if os.path.lexists(p) and not any(i in p for i in IGNORED_OUTSIDE))


@contextlib.contextmanager
def _captured():
    """File descriptors 1 and 2 (and sys.stdout, sys.stderr) into files; yields a function that reads them."""
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                              errors="backslashreplace", line_buffering=True) for fd in (1, 2))  # fmt: skip

    def read() -> tuple[str, str]:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        out = []
        for f in files:
            f.seek(0)
            out.append(f.read().decode("utf-8", "backslashreplace"))
        return out[0], out[1]

    try:
        yield read
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for f in files:
            f.close()


def run_in_process(case: Case, folder: Path, limit_s: float = IN_PROCESS_LIMIT_S) -> Result | None:
    """``dtrain.cli.main(argv)`` here, in ``folder``; None if the case would start a process (run it with
    :func:`run_subprocess`). An exception that escapes main is a traceback, as it would be in a real process."""
    global _guard
    from dtrain import cli

    if _guard is None:
        _guard = _Guard()
    folder = Path(folder).resolve()
    make_world(folder, case)
    before, cwd, path, environ = listing(folder), os.getcwd(), list(sys.path), dict(os.environ)
    os.environ.update(ENVIRONMENT)

    def alarm(signum, frame):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    started, status, crash = time.monotonic(), None, ""
    armed = signal.getitimer(signal.ITIMER_REAL)  # (pytest-timeout's alarm, if it uses one: put back afterwards)
    try:
        with _captured() as read:
            os.chdir(folder)
            _guard.outside, _guard.folder = set(), str(folder)
            signal.setitimer(signal.ITIMER_REAL, min(limit_s, armed[0] or limit_s))
            try:
                status = cli.main(list(case.argv))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            except NeedsProcess as exc:
                case.needed = str(exc)
                return None
            except Hang:
                status = None
            except BaseException:  # escaped main: what Python would print, and its status
                crash, status = traceback.format_exc(), 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                _guard.folder = None
            stdout, stderr = read()
    finally:
        signal.signal(signal.SIGALRM, previous)
        if armed[0]:
            signal.setitimer(signal.ITIMER_REAL, max(armed[0] - (time.monotonic() - started), 0.001), armed[1])
        os.chdir(cwd)
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environ)
    seconds = time.monotonic() - started
    found = strays(before, listing(folder), case.outputs())
    found += [f"{p} (outside the folder)" for p in _outside_left(_guard.outside)]
    return Result(case, "in-process", status, stdout, stderr + crash, seconds, found)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_subprocess(case: Case, folder: Path, limit_s: float = SUBPROCESS_LIMIT_S) -> Result:
    """``python -m dtrain ARGV`` in ``folder``: the real exit path. Past the time limit it and every process it
    started are killed, and its status is None."""
    folder = Path(folder).resolve()
    make_world(folder, case)
    before = listing(folder)
    env = {**os.environ, **ENVIRONMENT}
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen([sys.executable, "-m", "dtrain", *case.argv], cwd=folder, env=env,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=err)  # fmt: skip
        try:
            status = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            for pid in [process.pid, *_descendants(process.pid)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()
            status = None
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode("utf-8", "backslashreplace") for f in (out, err))
    if status is not None and status < 0:
        status = 128 - status  # (killed by a signal: as a shell reports it)
    return Result(case, "subprocess", status, stdout, stderr, seconds, strays(before, listing(folder), case.outputs()))


# --- judging ------------------------------------------------------------------------------------------------------
ERROR_LINE = re.compile(r"^dtrain(?: [a-z]+)*: error(?: \(ranks? [\d, ]+\))?: ")
TRACEBACK = "Traceback (most recent call last)"
BANNERS = ("BAD TERMINATION", "application called MPI_Abort", "MPI_ABORT", "MPI_Abort(")
WATCHDOG_ABORT = re.compile(r"aborting the job \(exit status (\d+)\)")
KINDS = ("hang", "traceback", "abort banner", "stray file", "wrong status", "error lines")


def judge(result: Result) -> list[str]:
    """What is wrong with how the case ended (empty: nothing), each problem starting with one of :data:`KINDS`."""
    case, problems = result.case, []
    text = result.stdout + result.stderr
    if result.status is None:
        return [f"hang: still running after {result.seconds:.0f} s"]
    if TRACEBACK in text:
        problems.append("traceback: " + _around(text, TRACEBACK))
    for banner in BANNERS:
        if banner in text:
            problems.append(f"abort banner: {_around(text, banner)}")
            break
    problems += [f"stray file: {path}" for path in result.strays]
    aborted = WATCHDOG_ABORT.search(result.stderr)
    statuses = case.statuses | ({int(aborted[1])} if aborted and case.command == "launch" else set())
    if result.status not in statuses:
        problems.append(f"wrong status: {result.status}, not one of {sorted(statuses)}")
    elif aborted and result.status != int(aborted[1]):
        problems.append(f"wrong status: {result.status} after the watchdog said {aborted[0]!r}")
    if case.command == "tour" and result.status == 1 and "run(s) failed" not in result.stderr:
        problems.append("wrong status: 1 without 'N run(s) failed' on stderr")
    errors = [line for line in result.stderr.splitlines() if ERROR_LINE.match(line)]
    if result.status == 2 and len(errors) != 1:
        problems.append(f"error lines: {len(errors)} `dtrain: error:` lines on stderr for a refusal: "
                        f"{_tail(result.stderr)}")  # fmt: skip
    elif result.status == 2 and result.stderr.strip() != errors[0].strip():
        problems.append(f"error lines: more than the `dtrain: error:` line on stderr: {_tail(result.stderr)}")
    elif result.status != 2 and errors:
        problems.append(f"error lines: status {result.status} after {errors[0]!r}")
    return problems


def _around(text: str, needle: str, width: int = 300) -> str:
    at = text.find(needle)
    return repr(text[max(0, at - 40) : at + width])


def _tail(text: str, width: int = 300) -> str:
    return repr(text.strip()[-width:])


def run(case: Case, folder: Path, in_process: bool = True) -> Result:
    """Run ``case`` in the (fresh) ``folder``: in this process if asked and it starts no process, else through a
    subprocess (in a fresh folder beside it); judged."""
    result = run_in_process(case, folder) if in_process else None
    if result is None:
        if in_process:
            folder = Path(str(folder) + "-subprocess")
        result = run_subprocess(case, folder)
    result.problems = judge(result)
    return result


def report(result: Result) -> str:
    """A failing case, with the command line that reproduces it."""
    case = result.case
    lines = [f"{case.command}: {p}" for p in result.problems]
    lines += [
        f"ran {result.how}, exit status {result.status}, {result.seconds:.1f} s",
        f"the command: {case.line}",
        "reproduce it (in a fresh folder with the fuzzer's files): python scripts/fuzz_cli.py --replay -- "
        + shlex.join(case.argv),
        "stdout (its end): " + _tail(result.stdout, 600),
        "stderr (its end): " + _tail(result.stderr, 1200),
    ]
    return "\n".join(lines)

"""The command-line fuzzer's fast profile: a few hundred command lines built from dtrain's real parsers, each run in a
fresh folder and judged (tests/fuzz_cli.py: how they are made, what each command promises, how a case is judged).

Most cases run in this process (``dtrain.cli.main(argv)``, its output captured, an alarm as the time limit, an audit
hook for files written outside the folder); one in :data:`SUBPROCESS_EVERY`, and every case that starts mpiexec or
another process, runs as ``python -m dtrain ARGV``. The cases are the same on every run (``derandomize``); a failing
one prints the command line that reproduces it. The long profile: ``python scripts/fuzz_cli.py`` (2000 cases).

Below them, the command lines the fuzzer found wrong, each kept as a case of its own.
"""

from __future__ import annotations

import shutil

import fuzz_cli
import pytest
from hypothesis import HealthCheck, given, settings

settings.register_profile(
    "dtrain-fuzz-suite",
    max_examples=300,
    derandomize=True,  # the same cases on every run (CI)
    deadline=None,  # a case may train, or start mpiexec: it has its own time limit
    database=None,  # (nothing written into the repository)
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
SUBPROCESS_EVERY = 25  # one case in this many runs as `python -m dtrain` even where it could run here
_count = [0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def check(case: fuzz_cli.Case, root, in_process: bool = True) -> fuzz_cli.Result:
    _count[0] += 1
    folder = root / f"case-{_count[0]}"
    result = fuzz_cli.run(case, folder, in_process=in_process)
    assert not result.problems, fuzz_cli.report(result)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(f"{folder}-subprocess", ignore_errors=True)
    return result


@settings(settings.get_profile("dtrain-fuzz-suite"))
@given(case=fuzz_cli.cases(fuzz_cli.SUITE))
def test_a_fuzzed_command_line_ends_as_its_command_promises(case, root):
    check(case, root, in_process=_count[0] % SUBPROCESS_EVERY != 0)


def test_the_cases_come_from_the_parsers():
    """Every fuzzed command is found in dtrain's parser, with the options that name where it writes."""
    found = fuzz_cli.commands()
    assert set(found) == {"train", "launch", "plan", "tour", "exercises init", "exercises list", "exercises check"}
    dests = {o.dest for options in found.values() for o in options}
    assert set(fuzz_cli.OUTPUT_DESTS) <= dests
    assert set(fuzz_cli.CAPS) <= dests, set(fuzz_cli.CAPS) - dests  # (a cap on a flag that is gone caps nothing)
    assert {"servers", "zero_stage", "mesh"} <= {o.dest for o in found["train"]}  # the paradigms' own flags too


NINES = "9" * 30
# What the fuzzer found, fixed; each (argv, the statuses it may end with, a phrase its stderr must have, or "").
REGRESSIONS = {
    # `exercises init ""` copied the 17 stubs into the working directory (Path("") is ".")
    "init-empty-folder": (["exercises", "init", ""], {2}, "empty name"),
    # an empty folder's name is the working directory: the tour's runs and the restarts' job files landed in it
    "tour-out-empty": (["tour", "--out", "", "--paradigms", "single", "--ranks", "1", "--epochs", "1"], {2},
                       "empty name"),
    "launch-checkpoint-dir-empty": (["launch", "-n", "2", "--max-restarts", "1", "--checkpoint-dir", "", "script.py",
                                     "0"], {2}, "empty name"),
    # sizes beyond what an array can have: tracebacks (ValueError, TypeError) from NumPy
    "train-classes-huge": (["train", "--epochs", "1", "--dataset", "synthetic", "--samples", "5", "--classes", NINES],
                           {2}, "at most 1,000,000,000"),
    "train-features-huge": (["train", "--epochs", "1", "--dataset", "synthetic", "--features", NINES], {2}, "at most"),
    "train-hidden-huge": (["train", "--epochs", "1", "--hidden", NINES], {2}, "at most"),
    # a model that does not fit memory: a MemoryError traceback
    "train-out-of-memory": (["train", "--epochs", "1", "--hidden", "999999999"], {2}, "not enough memory"),
    "plan-out-of-memory": (["plan", "--hidden", "100000,100000"], {2}, "not enough memory"),
    # --bucket-mb 1e308: int(inf) in the bucket size, a traceback
    "train-bucket-huge": (["train", "--epochs", "1", "--paradigm", "ddp", "--bucket-mb", "1e308", "--hidden", "8"],
                          {0}, ""),
    # the planner: a hang (work that grows with the ranks, the layers) or a traceback (OverflowError, ValueError)
    "plan-ranks-huge": (["plan", "--ranks", "2147483648"], {2}, "at most 1,048,576"),
    "plan-layers-huge": (["plan", "--layers", NINES, "--width", "8"], {2}, "at most 1000"),
    "plan-layers-large": (["plan", "--layers", "2147483648", "--width", "8"], {2}, "at most 1000"),
    "plan-features-huge": (["plan", "--features", NINES], {2}, "at most"),
    "plan-batch-huge": (["plan", "--batch-size", NINES], {2}, "at most"),
    # a rate so small that a step takes forever: OverflowError formatting an infinite time
    "plan-bandwidth-tiny": (["plan", "--intra-bandwidth", "1e-320"], {2}, "forever"),
    "plan-flops-tiny": (["plan", "--flops", "1e-320"], {2}, "forever"),
    # --paradigms that names none: "no configuration can run on --ranks 4:" and nothing after it
    "plan-paradigms-none": (["plan", "--paradigms", ","], {2}, "names no paradigm"),
    "tour-paradigms-none": (["tour", "--paradigms", ",", "--ranks", "1", "--epochs", "1"], {2}, "names none"),
    # a folder named like an option: the tour's run got `--out -/single` (argparse: "expected one argument") and
    # failed, and its row did not say why (a subcommand's usage error was not found as the run's error line)
    "tour-out-dash": (["tour", "--out", "-", "--paradigms", "single", "--ranks", "1", "--epochs", "1"], {0}, ""),
    # the same for the launcher's --checkpoint-dir handed to its `-m dtrain train` target: exit 2 after the start
    "launch-checkpoint-dir-dash": (["launch", "-n", "2", "--max-restarts", "1", "--checkpoint-dir=-x", "-m", "dtrain",
                                    "train", "--paradigm", "ddp", "--epochs", "1", "--hidden", "8", "--no-progress",
                                    "--quiet"], {0}, ""),
    # the watchdog said "aborting the job (exit status 14)" and the rank, its work done first, left with 0: now it
    # ends with 14 whenever the watchdog said so (judge() checks that; whether it fires at all is a race)
    "launch-watchdog-status": (["launch", "-n", "3", "-m", "dtrain", "train", "--paradigm", "ddp", "--epochs", "1",
                                "--hidden", "8", "--no-progress", "--quiet", "--timeout", "0.0001"], {0, 14}, ""),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_what_the_fuzzer_found(name, root):
    argv, statuses, phrase = REGRESSIONS[name]
    case = fuzz_cli.case_of(argv)
    case.statuses = frozenset(statuses)
    result = check(case, root)
    assert phrase in result.stderr, fuzz_cli.report(result)


def test_the_tour_finds_a_subcommands_usage_error_as_the_runs_error():
    from dtrain.course import tour

    line = "dtrain train: error: argument --out: expected one argument (see dtrain train --help)"
    assert tour.one_line_error(f"noise\n{line}\n", 2) == line

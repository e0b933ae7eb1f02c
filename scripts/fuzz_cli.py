"""Throw thousands of generated command lines at ``dtrain`` and check how each one ends: the long profile of the
command-line fuzzer (tests/fuzz_cli.py builds the cases from the real parsers and judges them; tests/test_fuzz_cli.py
is the suite's fast profile).

    python scripts/fuzz_cli.py                      2000 cases, seed 0, two at a time
    python scripts/fuzz_cli.py --cases 500 --seed 3
    python scripts/fuzz_cli.py --replay -- train --epochs 1 --lr nan     one case, its folder kept, its output shown

Every case is ``python -m dtrain ARGV`` in a fresh folder of its own (the real exit path), with a time limit. The
summary counts the cases by command and by exit status, and the problems: hangs, tracebacks, MPI abort banners,
stray files (written outside the paths the command was given, or in the repository's working tree: ``git status``
before and after), wrong statuses, refusals that are not exactly one ``dtrain: error:`` line. It exits 1 if there
was any, each failing case printed with the command line that reproduces it.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_cli  # (tests/fuzz_cli.py, found through the path above)
from hypothesis import HealthCheck, Phase, given, seed, settings


def generate(count: int, seed_value: int) -> list[fuzz_cli.Case]:
    """``count`` distinct cases, the same ones for the same seed."""
    found: dict[str, fuzz_cli.Case] = {}

    @seed(seed_value)
    @settings(max_examples=3 * count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(fuzz_cli.cases(fuzz_cli.LONG))
    def collect(case):
        if len(found) < count:
            found.setdefault(case.line, case)

    collect()
    return list(found.values())


def git_status() -> list[str]:
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    return done.stdout.splitlines() if done.returncode == 0 else []


def run_one(case: fuzz_cli.Case, root: Path, number: int, keep: bool) -> fuzz_cli.Result:
    folder = root / f"case-{number:05d}"
    result = fuzz_cli.run(case, folder, in_process=False)
    if not (keep and result.problems):
        shutil.rmtree(folder, ignore_errors=True)
    return result


def table(results: list[fuzz_cli.Result], repo_changes: list[str]) -> str:
    """The summary, 80 columns wide."""
    statuses = sorted({r.status for r in results if r.status is not None})
    shown = [s for s in (0, 1, 2) if s in statuses] + ["other"]
    heads = [f"exit {s}" if s != "other" else s for s in shown]
    lines = [f"{'command':16s} {'cases':>6s} " + " ".join(f"{h:>7s}" for h in heads)
             + f" {'hangs':>6s} {'problems':>9s}"]  # fmt: skip
    by_command = collections.defaultdict(list)
    for r in results:
        by_command[r.case.command].append(r)
    for command, rows in [*sorted(by_command.items()), ("all", results)]:
        ended = [r.status if r.status in (0, 1, 2) else "other" for r in rows if r.status is not None]
        counts = collections.Counter(ended)
        if command == "all":
            lines.append("-" * len(lines[0]))
        hangs, problems = sum(r.status is None for r in rows), sum(bool(r.problems) for r in rows)
        lines.append(f"{command:16s} {len(rows):6d} " + " ".join(f"{counts.get(s, 0):7d}" for s in shown)
                     + f" {hangs:6d} {problems:9d}")  # fmt: skip
    other = collections.Counter(r.status for r in results if r.status not in (0, 1, 2, None))
    if other:
        lines.append("other exit statuses: " + ", ".join(f"{s}: {n}" for s, n in sorted(other.items())))
    kinds = collections.Counter(p.split(":")[0] for r in results for p in set(x.split(":")[0] for x in r.problems))
    lines.append("")
    lines.append("problems: " + ", ".join(f"{kind} {kinds.get(kind, 0)}" for kind in fuzz_cli.KINDS[:3]) + ",")
    lines.append(f"  stray files {kinds.get('stray file', 0)}, wrong statuses {kinds.get('wrong status', 0)}, "
                 f"refusals not one error line {kinds.get('error lines', 0)},")  # fmt: skip
    lines.append(f"  repository's working tree: {'unchanged' if not repo_changes else 'CHANGED (below)'}")
    if repo_changes:  # (git status before and after: an edit someone else made meanwhile shows here too)
        lines += [f"    {line[:74]}" for line in repo_changes]
    return "\n".join(lines)


def replay(argv: list[str]) -> int:
    case = fuzz_cli.case_of(argv)
    folder = Path(tempfile.mkdtemp(prefix="dtrain-fuzz-replay-"))
    result = fuzz_cli.run(case, folder, in_process=False)
    print(f"folder (kept): {folder}\ncommand: {case.line}\nexit status: {result.status} ({result.seconds:.1f} s)")
    print(f"--- stdout\n{result.stdout}--- stderr\n{result.stderr}---")
    print("\n".join(result.problems) or "no problem")
    return 1 if result.problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="how many command lines (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the folders of failing cases")
    parser.add_argument("--replay", action="store_true", help="run the one command line that follows --replay --")
    words = sys.argv[1:]
    if "--replay" in words:  # (everything after it is dtrain's: argparse would read its options as ours)
        at = words.index("--replay")
        rest = words[at + 1 :]
        return replay(rest[1:] if rest[:1] == ["--"] else rest)
    args = parser.parse_args(words)
    started = time.monotonic()
    cases = generate(args.cases, args.seed)
    print(f"dtrain fuzz: {len(cases)} distinct command lines (seed {args.seed}), each `python -m dtrain ARGV` in a "
          f"fresh folder, {args.jobs} at a time", flush=True)  # fmt: skip
    before = git_status()
    root = Path(tempfile.mkdtemp(prefix="dtrain-fuzz-"))
    results, failing = [], []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, case, root, i, args.keep) for i, case in enumerate(cases)]
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            result = future.result()
            results.append(result)
            if result.problems:
                failing.append(result)
                print(f"\n{fuzz_cli.report(result)}\n", flush=True)
            if i % 100 == 0:
                print(f"  {i} of {len(cases)} done, {len(failing)} failing ({time.monotonic() - started:.0f} s)",
                      flush=True)  # fmt: skip
    after = git_status()
    changed = sorted(set(after) - set(before))  # (what appeared: a file committed meanwhile leaves the list)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    slowest = max(results, key=lambda r: r.seconds)
    print(f"\n{table(results, changed)}")
    print(f"\n{len(results)} cases in {time.monotonic() - started:.0f} s; the slowest {slowest.seconds:.1f} s:")
    print("  " + shlex.join(["dtrain", *slowest.case.argv])[:76])
    return 1 if failing or changed else 0


if __name__ == "__main__":
    sys.exit(main())

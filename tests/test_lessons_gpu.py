"""Lesson 12 (GPUs) without a GPU: part 1 gives this MPI's answer, parts 2-3 say why they are skipped, and part 4
prints the numbers of the results file it reads, each one checked against the file.

Every run hides any GPU from the lesson (``CUDA_VISIBLE_DEVICES=""``: CuPy, if installed, then finds none), so the
lesson takes its path for a machine without one, on any machine, in a fraction of a second. Part 4's lines are parsed
back into numbers and held against the JSON to the digits printed: docs/bench/gpu.json (the recorded H100 run) by
default, a file written here with ``--results``. (notebooks/12_gpu.ipynb itself is run by nbmake, with the other
notebooks; the lesson's GPU parts are checked on a GPU by scripts/gpu_check.sh.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from mpi_util import COLUMNS, LESSONS, assert_fits

LESSON = LESSONS / "12_gpu.py"
RECORDED = LESSONS.parent / "docs" / "bench" / "gpu.json"
ENV_VAR = "DTRAIN_CUDA_AWARE"


def environment(**extra) -> dict:
    """This process's environment with no GPU visible and no CUDA-awareness override, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


@pytest.fixture(scope="module", autouse=True)
def no_gpu_visible():
    """Skip, rather than start the lesson's GPU parts and benchmark (minutes), if a GPU can still be seen."""
    code = "from dtrain import backend; print(backend.gpu_missing() is None)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environment())
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "True":
        pytest.skip("CuPy still finds a GPU with CUDA_VISIBLE_DEVICES='': the lesson would run its GPU parts")


def run_lesson(*flags, **extra_env) -> str:
    """What the lesson printed for a terminal of COLUMNS columns (every line fits it)."""
    done = subprocess.run([sys.executable, str(LESSON), *flags], capture_output=True, text=True, timeout=60,
                          env=environment(COLUMNS=str(COLUMNS), **extra_env))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\n2-3. skipped: they need a GPU (" in done.stdout, "a GPU was visible after all?\n" + done.stdout
    assert_fits(done.stdout, COLUMNS)
    return done.stdout


def flat(text: str) -> str:
    """``text`` with its lines joined and its runs of spaces made one: what a paragraph says, however wrapped."""
    return " ".join(text.split())


def said_in_part_1(out: str) -> list[str]:
    """Part 1's paragraphs, each on one line (a paragraph starts three spaces in, its later lines five)."""
    block = out.partition("\n1. Is this MPI CUDA-aware?\n")[2].partition("\n\n")[0]
    said = []
    for line in block.splitlines():
        if line.startswith("     ") and said:
            said[-1] += " " + line.strip()
        else:
            said.append(line.strip())
    return said


@pytest.fixture(scope="module")
def plain():
    """The lesson as a learner runs it first: no flags."""
    return run_lesson()


def close(printed: str, value: float) -> bool:
    """``printed`` is ``value`` rounded to the digits it shows (half a unit of its last digit, and a hair more)."""
    decimals = len(printed.partition(".")[2])
    return abs(float(printed) - value) <= 0.5 * 10**-decimals + 1e-9


# part 4, its lines joined (flat): a sentence per step, then a table per rank count (the rows' cells stay on a line)
STEP = re.compile(
    r"784-(\d+)-(\d+)-10, batch (\d+): CPU ([\d.]+) ms, GPU ([\d.]+) ms(?:, PyTorch ([\d.]+) ms)?: "
    r"the GPU ([\d.]+)x (faster|slower) than the CPU(?:, dtrain ([\d.]+)x (faster|slower) than PyTorch)?"
)
HEADER = re.compile(r"all-reduce of (\d+) MiB on (\d+) ranks sharing the GPU:")
ROW = re.compile(r"\b(ring|mpi) ([\d.]+) ([\d.]+) (\d+)% ([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+)\b")


def part_4(out: str) -> dict:
    """Part 4's numbers as printed: {"where": its source, "step": [match groups], "allreduce": {p: (MiB, {alg:
    groups})}}."""
    _, marker, tail = out.partition("\n4. Where the time goes (")
    assert marker, out
    where, _, body = flat(tail).partition(") ")
    found = {"where": where, "step": [m.groups() for m in STEP.finditer(body)], "allreduce": {}}
    pieces = HEADER.split(body)  # [the steps, MiB, p, its table, MiB, p, its table, ...]
    for mib, p, table in zip(pieces[1::3], pieces[2::3], pieces[3::3]):
        found["allreduce"][p] = (int(mib), {m[1]: m.groups()[1:] for m in ROW.finditer(table)})
    return found


def ratio(printed: str, way: str) -> float:
    """A printed "2.50x faster" (2.5) or "2.50x slower" (0.4): how many times as fast."""
    return float(printed) if way == "faster" else 1 / float(printed)


def assert_part_4_is(out: str, results: dict) -> None:
    """Every number part 4 printed is the results file's, to the digits printed, and nothing is left out."""
    found = part_4(out)
    assert found["where"] == f"recorded on {results['gpu']['name']}, {results['date']}: {results['command']}"
    assert len(found["step"]) == len(results["step"]), out
    for printed, row in zip(found["step"], results["step"]):
        hidden, hidden_again, batch, cpu, gpu, torch, speedup, way, relative, relative_way = printed
        ms = row["step_ms"]
        assert int(hidden) == int(hidden_again) == row["hidden"] and int(batch) == row["batch"]
        assert close(cpu, ms["cpu"]) and close(gpu, ms["gpu"]), (printed, ms)
        expected = row["gpu_speedup_over_cpu"]  # (times as fast: faster above 1, slower below)
        assert way == ("faster" if expected > 1 else "slower"), (printed, expected)
        assert close(speedup, expected if expected > 1 else 1 / expected), (printed, expected)
        if "torch" in ms:
            expected = row["dtrain_over_torch_speed"]
            assert close(torch, ms["torch"]) and relative_way == ("faster" if expected > 1 else "slower"), printed
            assert close(relative, expected if expected > 1 else 1 / expected), (printed, expected)
        else:
            assert torch is None and relative is None, printed
    assert set(found["allreduce"]) == set(results["allreduce"]), out
    for p, (mib, algorithms) in found["allreduce"].items():
        rows = {(r["bytes"], r["case"]): r for r in results["allreduce"][p]["rows"]}
        biggest = max(b for b, _ in rows)
        assert mib << 20 == biggest and set(algorithms) == {"ring", "mpi"}, (p, mib, algorithms)
        for algorithm, (host_bw, staged_bw, percent, total, staging, reduce, mpi) in algorithms.items():
            host, staged = rows[(biggest, f"{algorithm} host")], rows[(biggest, f"{algorithm} staged")]
            assert close(host_bw, host["busbw_GBps"]) and close(staged_bw, staged["busbw_GBps"]), (p, algorithm)
            assert abs(int(percent) - 100 * staged["busbw_GBps"] / host["busbw_GBps"]) <= 0.5, (p, algorithm)
            for text, seconds in ((total, staged["time_s"]), (staging, staged["staging_s"]),
                                  (reduce, staged["gpu_reduce_s"]), (mpi, staged["mpi_s"])):  # fmt: skip
                assert close(text, seconds * 1e3), (p, algorithm, text, seconds)


def expected_answer() -> str:
    """What dtrain.comm.cuda_aware says about this MPI, asked in a process of its own (no override)."""
    code = "from dtrain.comm.cuda_aware import cuda_awareness_reason; print(cuda_awareness_reason())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environment())
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_part_1_gives_this_mpis_answer(plain):
    answer = expected_answer()
    head = said_in_part_1(plain)
    assert head[0] == answer, plain
    asked = re.search(r"MPIX_(Query_cuda_support|GPU_query_support)\(\w*\) in \S+ returned ([01])$", answer)
    assert asked, answer  # the library was asked, and answered
    if asked[2] == "0":  # the mpich wheel here: built without CUDA
        assert head[1] == "-> dtrain stages every GPU message through pinned host memory (two PCIe copies per message)."
    else:
        assert head[1].startswith("-> dtrain hands GPU buffers to MPI as they are")
    assert f"({ENV_VAR}=1 or 0 overrides the library's answer" in head[2]


@pytest.mark.parametrize(("value", "says"), [("1", "-> dtrain hands GPU buffers to MPI as they are"),
                                             ("0", "-> dtrain stages every GPU message")])  # fmt: skip
def test_part_1_follows_the_override(value, says):
    out = run_lesson(**{ENV_VAR: value})
    head = said_in_part_1(out)
    assert head[0] == f"{ENV_VAR}={value} in the environment (the MPI library was not asked)", out
    assert head[1].startswith(says), out


def test_parts_2_and_3_say_why_they_are_skipped(plain):
    skipped = [flat(block) for block in plain.split("\n\n") if block.startswith("2-3. skipped")]
    assert len(skipped) == 1, plain
    reason = skipped[0].removeprefix("2-3. skipped: they need a GPU (").removesuffix(")")
    assert "CuPy" in reason and ("not installed" in reason or "no usable GPU" in reason), skipped
    assert "\n2. The stream" not in plain and "\n3. Host staging" not in plain
    last = "all checks passed: yes (0 checks; the checks belong to parts 2 and 3, which need a GPU)"
    assert flat(plain).endswith(last)


def test_part_4_prints_the_recorded_numbers(plain):
    recorded = json.loads(RECORDED.read_text())
    assert_part_4_is(plain, recorded)
    # the figures a reader takes away, spelled out: the step's speed-up and the staged share at the largest size
    for row in recorded["step"]:
        assert f"the GPU {row['gpu_speedup_over_cpu']:.2f}x faster than the CPU" in flat(plain)
    found = part_4(plain)["allreduce"]
    for p, got in recorded["allreduce"].items():
        biggest = max(r["bytes"] for r in got["rows"])
        busbw = {r["case"]: r["busbw_GBps"] for r in got["rows"] if r["bytes"] == biggest}
        for algorithm in ("ring", "mpi"):
            share = busbw[f"{algorithm} staged"] / busbw[f"{algorithm} host"]
            assert f"{found[p][1][algorithm][2]}%" == f"{share:.0%}", (p, algorithm, share)


def your_results() -> dict:
    """A small results file of bench_gpu.py's schema, with numbers unlike the recorded ones (and no PyTorch)."""
    rows = []
    for size, scale in ((2 << 20, 1.0), (8 << 20, 3.7)):
        for algorithm, host_s, staged_parts in (("ring", 0.00213, (0.00071, 0.0000317, 0.00188)),
                                                ("mpi", 0.00342, (0.00093, 0.0, 0.00377))):  # fmt: skip
            staging, reduce, mpi = (scale * t for t in staged_parts)
            host = (f"{algorithm} host", scale * host_s, (0.0, 0.0, scale * host_s))
            for case, time_s, parts in (host, (f"{algorithm} staged", staging + reduce + mpi, (staging, reduce, mpi))):
                rows.append({"p": 3, "bytes": size, "case": case, "time_s": time_s,
                             "busbw_GBps": size / time_s * 2 * 2 / 3 / 1e9, "staging_s": parts[0],
                             "gpu_reduce_s": parts[1], "mpi_s": parts[2]})  # fmt: skip
    step = {"hidden": 256, "sizes": [784, 256, 256, 10], "batch": 512, "step_ms": {"cpu": 7.31, "gpu": 0.487},
            "ranges_ms": {"cpu": [7.0, 8.0], "gpu": [0.45, 0.6]}, "gpu_speedup_over_cpu": 7.31 / 0.487,
            "gpu_tflops": 1.3}  # fmt: skip
    return {"command": "python scripts/bench_gpu.py --json mine.json", "gpu": {"index": 0, "name": "Test GPU 9000",
            "count": 1}, "cupy": "0.0", "cpu_count": 3, "date": "2031-02-03", "machine": "here", "step": [step],
            "allreduce": {"3": {"rows": rows, "gpu": {"index": 0, "name": "Test GPU 9000", "count": 1},
                                "cuda_aware": False, "why": "a test"}}, "seconds": 1.0}  # fmt: skip


def test_results_flag_prints_your_numbers(tmp_path):
    results = your_results()
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(results))
    out = run_lesson("--results", str(path))
    assert_part_4_is(out, results)
    assert "all-reduce of 8 MiB on 3 ranks" in out and "NVIDIA H100" not in out and "PyTorch" not in out, out
    assert "784-256-256-10, batch 512: CPU 7.3 ms, GPU 0.49 ms: the GPU 15.01x faster than the CPU" in flat(out), out


def test_results_flag_with_no_such_file_says_so(tmp_path):
    missing = tmp_path / "nowhere.json"
    out = run_lesson("--results", str(missing))
    assert f"4. skipped: no GPU here and no recorded results in {missing}" in flat(out), out


def test_json_flag_writes_the_answer_and_the_checks(tmp_path, plain):
    path = tmp_path / "lesson12.json"
    out = run_lesson("--json", str(path))
    written = json.loads(path.read_text())
    assert set(written) == {"cuda_aware", "checks"}  # no stream, no staging: they need a GPU
    assert written["checks"] == {}  # the checks are the GPU parts' (the call returns early; every byte staged)
    assert written["cuda_aware"]["why"] == expected_answer()
    assert said_in_part_1(out)[0] == written["cuda_aware"]["why"]
    assert written["cuda_aware"]["cuda_aware"] is written["cuda_aware"]["why"].endswith("returned 1")
    said = f"\nmeasurements written to\n  {path}\n"  # (lesson_util.conclude's words, as every lesson's)
    assert said in out and out.replace(said, "") == plain  # --json changes nothing else printed

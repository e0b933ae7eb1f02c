"""What a dead rank costs: ``dtrain launch --max-restarts 1`` against the same run never stopped, on 4 real ranks.

For each paradigm (ddp, zero 3, ps-sync, pp) on the 784-512-512-10 MLP (synthetic data, global batch 240, one epoch
of ``--steps`` steps, a checkpoint every ``--every`` steps), three runs through the CLI, each timed whole (the wall
time of ``dtrain launch``: starting the ranks, training, writing, ending), ``--rounds`` times in a rotated order,
medians reported:

* **plain**: no checkpoint before the end; the baseline of the ratios;
* **checkpointed**: ``--checkpoint-every``: what writing the checkpoints costs (the difference, per checkpoint);
* **killed**: the same, with rank 1 killed by SIGKILL (DTRAIN_FAULT) half-way between two checkpoints and the job
  restarted from the last one (``--restart-delay 0``): its weights_sha256 must be the checkpointed run's (checked:
  PASS/FAIL), and its extra time is split into the steps redone (steps lost x the step time of the checkpointed
  run) and the rest: MPI noticing the death and ending the job, starting the ranks again (Python, imports, mpiexec),
  reading the checkpoint.

Then one checkpoint's write (``dtrain.checkpoint.save``: npz, fsync, rename, folder fsync) of 0.1M, 1M and 10M float32
parameters with their momentum, beside the baseline of writing the same bytes raw (``tofile`` + fsync) in the same
run, and the interval Young's formula gives with that write for a failure every hour.

    python scripts/bench_restart.py                       # docs/bench/restart.json: ~3 min on the 2-core VM
    python scripts/bench_restart.py --rounds 1 --json /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_util import exit_if_failed, faster, rotated, run_meta, samples_for, say, write_json

from dtrain import checkpoint, terminal

RANKS, BATCH = 4, 240  # (240: split evenly by 4 ranks, ps-sync's 3 workers, pp's 2 replicas x 4 micro-batches)
PARADIGMS = {
    "ddp": ["--paradigm", "ddp"],
    "zero-3": ["--paradigm", "zero", "--zero-stage", "3"],
    "ps-sync": ["--paradigm", "ps-sync", "--servers", "1"],
    "pp": ["--paradigm", "pp", "--pp", "2", "--microbatches", "4"],  # (2 stages x 2 replicas: 3 layers)
}
MODEL = ["--dataset", "synthetic", "--features", "784", "--classes", "10", "--hidden", "512,512"]
KINDS = ("plain", "checkpointed", "killed")
MTBF_S = 3600.0


def run(kind: str, paradigm: str, steps: int, every: int, folder: Path) -> dict:
    """One timed ``dtrain launch`` of ``kind``; its metrics.json, with the wall time."""
    out, ck = folder / f"{paradigm}-{kind}", folder / f"{paradigm}-{kind}-ck"
    flags = [*PARADIGMS[paradigm], *MODEL, "--samples", str(samples_for(steps, BATCH)), "--batch-size", str(BATCH),
             "--epochs", "1", "--quiet", "--no-progress", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_FAULT"}
    launch = ["-n", str(RANKS)]
    if kind != "plain":
        flags += ["--checkpoint-every", str(every)]
    if kind == "killed":
        launch += ["--max-restarts", "1", "--restart-delay", "0", "--checkpoint-dir", str(ck)]
        env["DTRAIN_FAULT"] = f"1:{2 * every + every // 2}"  # half-way between the 2nd and 3rd checkpoints
    elif kind == "checkpointed":
        flags += ["--checkpoint-dir", str(ck)]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dtrain", "launch", *launch, "-m", "dtrain", "train", *flags],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{paradigm} {kind} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"wall_s": wall, "sha": metrics["weights_sha256"], "train_s": metrics["epochs"][0]["train_time_s"],
            "restarts": metrics.get("restarts")}  # fmt: skip


def write_costs(sizes, repeats: int = 5) -> list[dict]:
    """One checkpoint's write against the same bytes written raw, for each size (medians of ``repeats``)."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for n in sizes:
            params = np.random.default_rng(0).standard_normal(n).astype(np.float32)
            state = {"steps": 1, "lr": 0.1, "velocity": params.copy()}
            saves, raws = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                checkpoint.save(scratch, params, state, {"global_step": 1})
                saves.append(time.perf_counter() - started)
                started = time.perf_counter()
                with open(Path(scratch) / "raw.bin", "wb") as f:
                    params.tofile(f)
                    state["velocity"].tofile(f)
                    f.flush()
                    os.fsync(f.fileno())
                raws.append(time.perf_counter() - started)
            save, raw = statistics.median(saves), statistics.median(raws)
            rows.append({"parameters": n, "bytes": 2 * params.nbytes, "save_s": save, "raw_s": raw,
                         "ratio": save / raw, "young_s": math.sqrt(2 * save * MTBF_S)})  # fmt: skip
    return rows


def runs_table(rows: list[dict], width="auto") -> str:
    """The runs' medians (``runs`` of the JSON) as a table fitted to ``width`` (:mod:`dtrain.terminal`)."""
    header = ["paradigm", "plain s", "ckpt s", "per ckpt s", "killed s", "killed vs plain", "steps lost", "redone s",
              "restart s", "same weights", "plain range s", "killed range s"]  # fmt: skip
    cells = [[r["paradigm"], f"{r['plain_s']:.2f}", f"{r['checkpointed_s']:.2f}", f"{r['per_checkpoint_s']:.3f}",
              f"{r['killed_s']:.2f}", faster(1 / r["killed_vs_plain"]), str(r["steps_lost"]), f"{r['redone_s']:.2f}",
              f"{r['restart_s']:.2f}", "PASS" if r["same_weights"] else "FAIL",
              *("..".join(f"{v:.2f}" for v in r["range_s"][k]) for k in ("plain", "killed"))]
             for r in rows]  # fmt: skip
    return terminal.table(header, cells, left=(0, 9), width=width)


def writes_table(writes: list[dict], width="auto") -> str:
    """One checkpoint's write against the raw write (``writes`` of the JSON), fitted to ``width``."""
    header = ["parameters", "MB", "save ms", "raw ms", "save vs raw", "Young's interval at M = 1 h"]
    cells = [[f"{w['parameters']:,d}", f"{w['bytes'] / 1e6:.1f}", f"{1e3 * w['save_s']:.1f}",
              f"{1e3 * w['raw_s']:.1f}", faster(1 / w["ratio"]), f"{w['young_s']:.1f} s"] for w in writes]  # fmt: skip
    return terminal.table(header, cells, left=(), width=width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of the run (default %(default)s)")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="times each run is made (default %(default)s)")
    parser.add_argument("--paradigms", default=",".join(PARADIGMS), help="comma-separated (default: all four)")
    parser.add_argument("--json", default="docs/bench/restart.json", help="where the results go")
    args = parser.parse_args()
    paradigms = [p.strip() for p in args.paradigms.split(",") if p.strip()]
    if not 3 * args.every < args.steps or args.every < 2:
        raise SystemExit("--steps must exceed 3 x --every (the kill comes between the 2nd and 3rd checkpoints)")
    started = time.time()
    runs = {(p, k): [] for p in paradigms for k in KINDS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for paradigm, kind in rotated(list(runs), round_):
                folder = Path(scratch) / str(round_)
                runs[(paradigm, kind)].append(run(kind, paradigm, args.steps, args.every, folder))
    failed, rows = [], []
    for paradigm in paradigms:
        plain, ckpt, killed = (statistics.median(x["wall_s"] for x in runs[(paradigm, k)]) for k in KINDS)
        checkpoints = args.steps // args.every + 1  # every N steps, and the end's (the plain run writes none)
        lost = runs[(paradigm, "killed")][0]["restarts"]["steps_lost"]
        step_s = statistics.median(x["train_s"] for x in runs[(paradigm, "checkpointed")]) / args.steps
        redone = lost * step_s
        same = all(x["sha"] == runs[(paradigm, "checkpointed")][0]["sha"] for x in runs[(paradigm, "killed")])
        if not same:
            failed.append(f"{paradigm}: the restarted run's weights differ from the uninterrupted run's")
        row = {"paradigm": paradigm, "plain_s": plain, "checkpointed_s": ckpt, "killed_s": killed,
               "per_checkpoint_s": (ckpt - plain) / checkpoints, "killed_vs_plain": killed / plain,
               "steps_lost": lost, "step_s": step_s, "redone_s": redone, "restart_s": killed - ckpt - redone,
               "same_weights": same,
               "range_s": {k: [min(x["wall_s"] for x in runs[(paradigm, k)]),
                               max(x["wall_s"] for x in runs[(paradigm, k)])] for k in KINDS}}  # fmt: skip
        rows.append(row)
    say(f"{RANKS} ranks, 784-512-512-10, batch {BATCH}, {args.steps} steps, a checkpoint every {args.every}; "
        f"medians of {args.rounds} round(s)", hanging="  ")  # fmt: skip
    print(runs_table(rows))
    writes = write_costs([100_000, 1_000_000, 10_000_000])
    print()
    say("one checkpoint's write (params + momentum, float32) against the same bytes written raw (tofile + fsync):")
    print(writes_table(writes))
    meta = run_meta(ranks=RANKS, steps=args.steps, every=args.every, rounds=args.rounds,
                    minutes=round((time.time() - started) / 60, 1))  # fmt: skip
    write_json(args.json, {**meta, "runs": rows, "writes": writes, "failed": failed})
    print(f"\nwritten to {args.json}")
    exit_if_failed(failed)


if __name__ == "__main__":
    main()

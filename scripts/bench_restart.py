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

**On a cluster** (``--cluster NAME``, as root: :mod:`dtrain.launch.cluster`): what losing a whole machine costs. Each
run makes cluster NAME afresh (2 nodes x 2 slots, ``--link``), runs ddp on digits on its 4 ranks under ``dtrain launch
--max-restarts 1 --min-ranks 2`` (a checkpoint every 20 steps), and takes it down again:

* **whole**: never stopped; the baseline;
* **rank**: rank 3 killed (DTRAIN_FAULT) after step ``--kill-at``; the restart runs on the same 4 slots;
* **node**: node 2 killed whole (``dtrain cluster kill``: its proxy and ranks 2, 3) once rank 0 has done step
  ``--kill-at``; mpiexec is told at once, and the restart runs on node 1's 2 slots, the only ones left in the hostfile;
* **cut**: the same with node 2's link cut first (``--cut-link``): nobody is told, the watchdog (``--timeout``) ends
  the job.

Each fault's cost, from the clocks of this machine: *noticed* (from the kill to the end of the first attempt),
*redone* (the steps lost x the restarted run's step, from its metrics.json), and *restart* (the rest: the restart
delay, starting the ranks again, reading the checkpoint); their sum, *lost*, is the time from the kill to the end less
the time the steps still to do take at the restarted run's pace::

    python scripts/bench_restart.py --cluster restart --rounds 3   # docs/bench/cluster/restart.{txt,json}, ~4 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_util import exit_if_failed, faster, rotated, run_meta, samples_for, say, write_json

from dtrain import checkpoint, faults, terminal

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


# --- on a cluster: a whole machine lost -------------------------------------------------------------------------
CLUSTER_KINDS = ("whole", "rank", "node", "cut")
CLUSTER_TRAIN = ["--paradigm", "ddp", "--dataset", "digits", "--checkpoint-every", "20", "--quiet", "--no-progress"]


def cluster_run(kind: str, args, folder: Path) -> dict:
    """One ``dtrain launch -n 4`` of ``kind`` on a fresh 2 x 2 cluster, taken down after: its figures (module
    docstring) and what the launcher said."""
    from dtrain.launch import cluster
    from dtrain.launch.restarts import PROGRESS_FILE

    made = cluster.up(args.cluster, 2, 2, args.link)
    try:
        ck, out = folder / f"{kind}-ck", folder / kind
        launch = ["-n", "4", "--hostfile", str(made.hostfile), "--max-restarts", "1", "--min-ranks", "2",
                  "--restart-delay", str(args.delay), "--checkpoint-dir", str(ck)]  # fmt: skip
        launch += ["--timeout", f"{args.timeout:g}"] if kind == "cut" else []
        env = {k: v for k, v in os.environ.items() if k != "DTRAIN_FAULT"}
        env |= {"DTRAIN_FAULT": f"3:{args.kill_at}"} if kind == "rank" else {}
        train = [*CLUSTER_TRAIN, "--epochs", str(args.epochs), "--out", str(out)]
        job = subprocess.Popen([sys.executable, "-m", "dtrain", "launch", *launch, "-m", "dtrain", "train", *train],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        started, killed_at = time.perf_counter(), None
        if kind in ("node", "cut"):
            step = 0
            while step < args.kill_at and job.poll() is None and time.perf_counter() - started < 300:
                time.sleep(0.005)
                step = faults.read_progress(ck / PROGRESS_FILE) or 0
            cluster.kill(args.cluster, made.node(2), cut_link=kind == "cut")
            killed_at = time.time()
        _, err = job.communicate(timeout=900)
        ended, wall = time.time(), time.perf_counter() - started
    finally:
        cluster.down(args.cluster)
    if job.returncode != 0:
        raise SystemExit(f"{kind} failed ({job.returncode}):\n{err[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    total = checkpoint.load(ck)["meta"]["global_step"]
    step_s = metrics["epochs"][-1]["train_time_s"] / (total / args.epochs)  # (the last epoch: all of it restarted)
    said = [line for line in err.splitlines() if line.startswith(("dtrain launch", "  "))]
    row = {"kind": kind, "wall_s": wall, "train_s": sum(e["train_time_s"] for e in metrics["epochs"]),
           "world_size": metrics["world_size"], "step_s": step_s, "steps": total,
           "test_accuracy": metrics["final"]["test_accuracy"], "said": said}  # fmt: skip
    if kind == "whole":
        return row
    if kind == "rank":
        killed_at = (ck / faults.RECORD).stat().st_mtime  # (written by the rank just before it killed itself)
    first = metrics["restarts"]["attempts"][0]
    first_end = first["started"] + first["seconds"]
    lost = (ended - killed_at) - (total - first["reached_step"]) * step_s
    noticed, redone = first_end - killed_at, first["steps_lost"] * step_s
    return {**row, "first_s": first["seconds"], "reached": first["reached_step"], "steps_lost": first["steps_lost"],
            "ended": first["ended"], "noticed_s": noticed, "redone_s": redone, "restart_s": lost - noticed - redone,
            "lost_s": lost}  # fmt: skip


def cluster_main(args) -> None:
    from dtrain.launch import cluster

    if (why := cluster.missing("bench_restart.py --cluster")) is not None:
        raise SystemExit(why)
    runs = {kind: [] for kind in CLUSTER_KINDS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for kind in rotated(list(CLUSTER_KINDS), round_):
                runs[kind].append(cluster_run(kind, args, Path(scratch) / str(round_)))
                say(f"  round {round_ + 1}, {kind}: {runs[kind][-1]['wall_s']:.1f} s")
    med = {kind: {key: statistics.median(r[key] for r in rs) for key in rs[0] if isinstance(rs[0][key], float | int)}
           for kind, rs in runs.items()}  # fmt: skip
    failed = [f"{kind}: the restart did not end on {want} ranks"
              for kind, want in (("rank", 4), ("node", 2), ("cut", 2))
              if any(r["world_size"] != want for r in runs[kind])]  # fmt: skip
    failed += [f"{kind}: the launcher did not name node {args.cluster}-n2" for kind in ("node", "cut")
               if any(r.get("ended", "").find(f"{args.cluster}-n2") < 0 for r in runs[kind])]  # fmt: skip
    whole = med["whole"]
    header = ["fault", "wall s", "vs whole", "end ranks", "noticed s", "steps lost", "redone s", "restart s", "lost s",
              "lost range s"]  # fmt: skip
    cells = [["none (whole)", f"{whole['wall_s']:.2f}", "-", "4", "-", "-", "-", "-", "-", "-"]]
    names = {"rank": "rank 3 killed", "node": "node 2 killed", "cut": f"node 2 cut, --timeout {args.timeout:g}"}
    for kind in CLUSTER_KINDS[1:]:
        m = med[kind]
        spread = "..".join(f"{f(r['lost_s'] for r in runs[kind]):.2f}" for f in (min, max))
        cells.append([names[kind], f"{m['wall_s']:.2f}", faster(whole["wall_s"] / m["wall_s"]), str(m["world_size"]),
                      f"{m['noticed_s']:.2f}", f"{m['steps_lost']:g}", f"{m['redone_s']:.2f}", f"{m['restart_s']:.2f}",
                      f"{m['lost_s']:.2f}", spread])  # fmt: skip
    about = (f"cluster: 2 nodes x 2 slots, link {args.link}; ddp on digits, {args.epochs} epochs ({whole['steps']:g} "
             f"steps, batch 64), a checkpoint every 20 steps, the fault once rank 0 has done step {args.kill_at}; "
             f"--restart-delay {args.delay:g}; medians of {args.rounds} round(s)")  # fmt: skip
    steps = (f"step: {1e3 * whole['step_s']:.1f} ms on 4 ranks across the link, {1e3 * med['node']['step_s']:.1f} ms "
             "on node 1's 2 ranks (the restarted run's, from its last epoch in metrics.json)")  # fmt: skip
    say(about, hanging="  ")
    print(terminal.table(header, cells, left=(0,)))
    say(steps, hanging="  ")
    lines = [f"python {shlex.join(sys.argv)}", time.strftime("%F"), about, "",
             terminal.table(header, cells, left=(0,), width=None), "", steps, "",
             "what the launcher said (round 1):"]  # fmt: skip
    for kind in CLUSTER_KINDS[1:]:
        lines += [f"--- {names[kind]}", *runs[kind][0]["said"]]
    text = "\n".join(lines)
    meta = run_meta(rounds=args.rounds, link=args.link, kill_at=args.kill_at, timeout_s=args.timeout,
                    epochs=args.epochs, delay_s=args.delay)  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text + "\n")
    write_json(out, {**meta, "medians": med, "runs": runs, "failed": failed})
    print(f"\nwritten to {out} and {out.with_suffix('.txt')}")
    exit_if_failed(failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of the run (default %(default)s)")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="times each run is made (default %(default)s)")
    parser.add_argument("--paradigms", default=",".join(PARADIGMS), help="comma-separated (default: all four)")
    parser.add_argument("--json", help="where the results go (default docs/bench/restart.json; with --cluster "
                        "docs/bench/cluster/restart.json, the table beside it in restart.txt)")  # fmt: skip
    cluster = parser.add_argument_group("on a cluster (as root: a whole machine lost)")
    cluster.add_argument("--cluster", metavar="NAME", help="make cluster NAME (2 x 2) for each run, and take it down")
    cluster.add_argument("--link", default="100mbit", help="its links' rate (default %(default)s)")
    cluster.add_argument("--epochs", type=int, default=4, help="digits epochs of each run (default %(default)s)")
    cluster.add_argument("--kill-at", type=int, default=30, help="the step after which the fault comes (default 30)")
    cluster.add_argument("--timeout", type=float, default=3.0, help="the watchdog's limit, cut link (default 3 s)")
    cluster.add_argument("--delay", type=float, default=0.5, help="--restart-delay (default %(default)s s)")
    args = parser.parse_args()
    if args.cluster is not None:
        args.json = args.json or "docs/bench/cluster/restart.json"
        if not 20 < args.kill_at < 22 * args.epochs - 1:
            raise SystemExit("--kill-at must come after the first checkpoint (step 20) and before the end")
        cluster_main(args)
        return
    args.json = args.json or "docs/bench/restart.json"
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

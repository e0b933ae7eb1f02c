"""The SHA-256 of the final weights of a fixed run of every paradigm: the proof that a restructuring changed nothing.

    python scripts/weights_digests.py --out before.json        # before the change
    python scripts/weights_digests.py --compare before.json    # after it: exit 1 if any digest moved

Each run trains the digits for two epochs on simulated ranks (the simulator and mpiexec give the same weights to
the bit: tests/test_driver.py), float64, with flags that reach each paradigm's own options. A digest is of the whole
flat parameter buffer (metrics.json's ``weights_sha256``), so one ulp anywhere changes it. Digests depend on the
machine's NumPy and BLAS: compare runs made on the same machine and environment. ps-async is left out: its server
applies each gradient as it arrives, so its weights depend on the order the workers' messages happen to arrive in
(even with --staleness 0, which only bounds how far apart they run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dtrain import terminal
from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.train import train

BASE = dict(dataset="digits", hidden=(32, 32, 32), epochs=2, batch_size=48, dtype="float64", progress=False,
            quiet=True, timeout=0)  # fmt: skip
RUNS = {
    "single": (1, dict(paradigm="single")),
    "ddp ring": (3, dict(paradigm="ddp", allreduce="ring")),
    "ddp hierarchical buckets": (4, dict(paradigm="ddp", allreduce="hierarchical", ranks_per_node=2, bucket_mb=0.005)),
    "ddp overlap": (2, dict(paradigm="ddp", overlap=True, bucket_mb=0.005)),
    "zero 1": (4, dict(paradigm="zero", zero_stage=1)),
    "zero 2": (4, dict(paradigm="zero", zero_stage=2)),
    "zero 3 adam": (3, dict(paradigm="zero", zero_stage=3, optimizer="adam", lr=0.01)),
    "ps-sync": (4, dict(paradigm="ps-sync", servers=1)),
    "ps-sync 2 servers": (4, dict(paradigm="ps-sync", servers=2)),
    "central-storage": (4, dict(paradigm="central-storage")),
    "local-sgd": (4, dict(paradigm="local-sgd", sync_every=4)),
    "local-sgd master warmup": (3, dict(paradigm="local-sgd", sync_every=3, average_via="master", warmup_sync_steps=5)),
    "gossip ring": (4, dict(paradigm="gossip", topology="ring")),
    "gossip exponential": (4, dict(paradigm="gossip", topology="exponential")),
    "tp 2": (2, dict(paradigm="tp", tp=2)),
    "tp dp2 x tp2": (4, dict(paradigm="tp", dp=2, tp=2)),
    "pp gpipe": (2, dict(paradigm="pp", pp=2, schedule="gpipe")),
    "pp 1f1b dp2": (4, dict(paradigm="pp", pp=2, dp=2)),
    "pp interleaved": (2, dict(paradigm="pp", pp=2, schedule="interleaved", hidden=(32, 32, 32), microbatches=4)),
    "pp dp2 x tp2 x pp2": (8, dict(paradigm="pp", dp=2, tp=2, pp=2, hidden=(32, 32, 32, 32, 32))),
}


def digests() -> dict[str, str]:
    """Every run's digest; a table of them printed at the end (fitted to the terminal), a progress bar meanwhile."""
    found, cells = {}, []
    for name, (ranks, flags) in terminal.progress(RUNS.items(), len(RUNS), "runs"):
        started = time.perf_counter()
        config = TrainConfig(**{**BASE, **flags})
        metrics = sim.SimWorld(ranks, timeout=300).run(lambda comm, c=config: train(c, comm))[0]
        found[name] = metrics["weights_sha256"]
        cells.append([name, str(ranks), f"{found[name][:16]}...", f"{time.perf_counter() - started:.1f}"])
    print(terminal.table(["run", "ranks", "weights sha256", "s"], cells, left=(0, 2)), flush=True)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="JSON", help="write the digests here")
    parser.add_argument("--compare", metavar="JSON", help="compare with digests written before; exit 1 on a change")
    args = parser.parse_args()
    found = digests()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        moved = [name for name in before if found.get(name) != before[name]]
        print(terminal.paragraph(f"{len(before) - len(moved)} of {len(before)} digests unchanged"
                                 + (f"; changed: {', '.join(moved)}" if moved else ""), hanging="  "))  # fmt: skip
        return 1 if moved else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

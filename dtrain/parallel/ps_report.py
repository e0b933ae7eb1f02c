"""What a parameter-server run tells (:mod:`dtrain.parallel.parameter_server` is the protocol): the roles it prints at
the start, and the figures it adds to metrics.json at the end, put together from what every rank reported."""

from __future__ import annotations

import collections


def roles(name: str, staleness, workers: int, servers) -> str:
    """One line: which ranks work and which serve (and the staleness bound, if any)."""
    mode = name if staleness is None else f"{name}, staleness bound {staleness}"
    return f"{mode}: workers = {_ranks(range(workers))}, servers = {_ranks(servers)}"


def figures(everyone, workers: int, bounds) -> dict:
    """The run's figures from ``everyone``'s report at the end (by rank, the workers first: their ``Worker.done``, then
    the servers' ``Server.done``): the roles, each server's shard, the staleness of every update the servers applied,
    how busy each server was, how long each worker waited, what every rank held."""
    servers = everyone[workers:]
    staleness = collections.Counter()
    for s in servers:
        staleness.update({int(k): v for k, v in s["staleness"].items()})
    updates = sum(staleness.values())
    return {
        "roles": ["worker"] * workers + ["server"] * len(servers),
        "shards": [list(b) for b in bounds],
        "staleness": {
            "histogram": {str(k): staleness[k] for k in sorted(staleness)},
            "mean": sum(k * v for k, v in staleness.items()) / updates if updates else 0.0,
            "max": max(staleness, default=0),
        },
        "server_updates": [s["updates"] for s in servers],
        "pushes": pushes(everyone[:workers], servers),
        "server_busy_fraction": [s["busy_fraction"] for s in servers],
        "worker_wait_s": [e["wait_s"] for e in everyone[:workers]],
        "held_bytes": [e["held"] for e in everyone],
    }


def pushes(workers, servers) -> dict:
    """Every push a worker sent is applied exactly once: each worker's count of the pushes it sent (its sequence
    number: after a resume, the cut's and those since) against each server's count of that worker's pushes it took
    (the cut's, the ones in flight it replayed, those since). Also what the snapshots did."""
    sent = [w["pushes"] for w in workers]
    applied = [s["applied"] for s in servers]
    return {"sent": sent, "applied": applied, "exactly_once": all(a == sent for a in applied),
            "replayed": [s["replayed"] for s in servers], "snapshots": servers[0]["snapshots"]}  # fmt: skip


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"

"""Consistent snapshots of a parameter-server run: ``--checkpoint-every N`` (Chandy and Lamport, 1985).

While servers serve asynchronously there is no one moment to save: each server's shard has taken the pushes that
reached it, and others are on the wire. Stopping everyone would cost a barrier; copying each shard when it feels like
it would save shards that disagree about which pushes they hold. A *consistent cut* records, for every process, a
state, and for every channel, the messages that cross the cut: every message the cut counts as sent is either received
inside it or recorded on its channel, and no message it counts as unsent has been received. Chandy and Lamport find
one without stopping anything, with markers on FIFO channels::

    worker 0  --push 7--------------(W)M---push 8-------------------------->      (R) the coordinator records
                   \\                |                                            (W) a marked reply reaches the
    worker 1  -------\\---push 5-----|------(W)---M---push 6--------------->          worker: it records seq k
                      \\        \\    |        |   \\                                 and sends M on every channel
    server 0  -(R)-----7---------5---M--------|----M-----6------------------>   M   the marker: a PUSH of 0 bytes
    (coord.)    |      ^in flight^   ^w0 done |    ^w1 done: complete              (the same channel, tag, order)
    server 1  --------------7---5------(R)M--------M------6----------------->   after (R), what arrives from w
                                       ^the first marker: it records; 7, 5       before w's M is in flight on
                                        were already in its shard                the channel w -> s: recorded

1. **The coordinator** (server 0), once it has applied m x N x W pushes (ps-sync: m x N updates) and no worker is
   between two epochs, records its state (a copy of its shard, its optimizer's state, its counters), and marks its
   next reply to every worker (its tag | MARKED).
2. **A worker**, at the end of the step whose coordinator reply was marked, records its own state: its sequence
   number k (pushes sent), its epoch, its steps and loss sum in it, where it is in its slices, whether the epoch is
   over. It sends the marker to every server, after its last push and before its next, and its state to rank 0.
3. **A server** records its state when the first marker reaches it (the coordinator has already). From then on,
   every message from worker w that arrives before w's marker (a push, an END) was in flight across the cut: it is
   recorded with its data. A worker's k-th marker is snapshot k's: another worker's marker of k + 1 may come before
   w's of k, and then two recordings are open at once. With all W markers in, the server sends its recording to
   rank 0, which writes the checkpoint once every server's and every worker's are in, between its steps (waiting
   only if the next snapshot reaches it before the last one's recordings, which are then on their way; while it
   writes, the other workers go on, so in ps-async rank 0 takes fewer steps than they do).

**Why consistent.** Take worker w's push j and server s. If j <= k, it was sent before w's marker, so (FIFO) it
reached s before the marker: before s recorded (it is in the shard) or after (it is recorded in flight), never
both. If j > k, it was sent after the marker, so it reached s after s had recorded and stopped recording w's channel:
it is in neither. A restart restores every shard and optimizer, replays the recorded pushes in the order they came,
and each worker goes on from push k + 1: **every push is applied exactly once** (the servers count each worker's
pushes: metrics.json's ``pushes``, ``applied`` equal to ``sent``).

**FIFO is the whole trick.** MPI keeps the order of one sender's messages on one communicator that one receive
could match. The server takes "any source, any tag", and the marker travels on the pushes' own communicator with
their own tag, so it cannot pass a push sent before it, nor be passed by one sent after. Over channels that reorder,
a push sent after the marker could arrive before it and be counted twice: once in the shard, once by the worker that
resends it (the notebook's section shows it on simulated ranks).

**What the cut does not cut.** Server -> worker messages carry copies of the shards. A server that has recorded may
answer a worker that has not with weights holding pushes from after the cut, and that worker's next push (before its
marker) was computed from them: the cut is consistent for the pushes, which is all the servers hold, not for what
each gradient was computed from. A restart needs no more: the workers pull fresh weights, and asynchronous SGD
applies gradients computed on weights other than the current ones anyway; what it must never do is lose or double a
push. The one reply that changes its sender's state is the coordinator's END (the epoch is over for that worker):
a worker that records after a marked END records its epoch as over, and the resume ends that worker's epoch on the
coordinator too (:func:`replay`).

**A full flat buffer still**: the checkpoint's parameters and optimizer state are the servers' recorded shards put
together (what they held at the cut), so evaluation or another paradigm can resume them; only ps-sync and ps-async
on as many workers and servers replay the pushes in flight, which another resume drops (and says so).
"""

from __future__ import annotations

import collections
import json

import numpy as np

from dtrain.backend import array_module, read_losses, to_host
from dtrain.comm import waitall
from dtrain.comm.trace import CHECKPOINT, labelled

MARKED = 16  # a reply's tag | MARKED: the coordinator has recorded its state (the worker records at the step's end)
HEADER, ROWS, WORKER = 1, 2, 3  # tags on the snapshot communicator (a server's counters, its arrays; a worker's state)
HEADER_BYTES, WORKER_BYTES = 1 << 16, 1 << 12  # fixed sizes, so that rank 0 can post its receives before they come


def pack(obj, nbytes: int) -> np.ndarray:
    data = json.dumps(obj).encode()
    if len(data) > nbytes:
        raise RuntimeError(f"ps snapshot: a record of {len(data)} bytes does not fit its {nbytes}-byte message")
    out = np.zeros(nbytes, dtype=np.uint8)
    out[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def unpack(buffer) -> dict:
    data = to_host(buffer).tobytes().rstrip(b"\0")
    return json.loads(data.decode())


# --- a server's side: record the state, then the messages in flight, until every worker's marker is in ------------
class ServerRecording:
    """Server ``loop``'s state at the moment it records for snapshot ``ordinal`` (the coordinator's count of the
    snapshots it began; ``number``: the coordinator's label, global step / N), and the messages that cross the cut on
    its channels."""

    def __init__(self, loop, ordinal: int, number: int | None = None):
        self.ordinal, self.number = ordinal, number
        self.params = loop.params.copy()
        self.optimizer = loop.optimizer.state_dict()  # (host copies)
        self.counters = counters(loop)
        self.awaiting = set(range(loop.workers)) - loop.done  # whose marker has not come
        self.in_flight = []  # (kind, worker, staleness), in the order they came
        self.rows = []  # the pushes' data, in that order: at most two a worker (see the module docstring)

    def note(self, kind: str, w: int, data=None, staleness: int = 0) -> None:
        """A message from w, before w's marker: it crossed the cut."""
        if w in self.awaiting:
            self.in_flight.append((kind, w, staleness))
            if data is not None:
                self.rows.append(to_host(data).copy())

    def marker(self, w: int) -> bool:
        """w's marker is in: w's channel is recorded. True once every worker's is."""
        self.awaiting.discard(w)
        return not self.awaiting

    def send(self, comm, server: int) -> list:
        """Everything recorded, to rank 0 (non-blocking: the server goes on serving): the counters (their size
        fixed, so rank 0 can post their receive first), then the rows they announce: the shard, the optimizer's
        buffers (by name), the pushes in flight."""
        names = sorted(k for k, v in self.optimizer.items() if isinstance(v, np.ndarray))
        rows = np.stack([to_host(self.params), *(self.optimizer[k] for k in names), *self.rows])
        scalars = {k: v for k, v in self.optimizer.items() if not isinstance(v, np.ndarray)}
        header = {"server": server, "ordinal": self.ordinal, "number": self.number, **self.counters,
                  "optimizer_scalars": scalars, "optimizer_buffers": names, "in_flight": self.in_flight,
                  "rows": len(rows)}  # fmt: skip
        with labelled(comm, CHECKPOINT, 0):
            return [comm.Isend(pack(header, HEADER_BYTES), 0, HEADER), comm.Isend(rows, 0, ROWS)]


def counters(loop) -> dict:
    """What a server's loop records of itself beside its arrays (the rest it can rebuild: see :func:`replay`)."""
    return {"version": loop.version, "total": loop.total, "pushes": loop.pushes, "clock": list(loop.clock),
            "ended": sorted(loop.ended), "staleness": {str(k): v for k, v in loop.staleness.items()},
            "snapshots_taken": loop.snapshots_taken, "synchronous": loop.synchronous}  # fmt: skip


def replay(loop, header: dict, rows, ended) -> int:
    """A resumed server: its counters as recorded, then every message that was in flight across the cut, in the order
    it came (pushes applied as they were then, with no reply: the workers pull), then the END replies the coordinator
    sent after it recorded to the workers that had ``ended`` the epoch at the cut (a worker records after the step
    whose reply was marked, so such a reply is on its side of the cut: the coordinator's sending it must be too).
    The number of pushes replayed."""
    loop.version, loop.total, loop.pushes = header["version"], header["total"], header["pushes"]
    loop.clock, loop.ended = list(header["clock"]), set(header["ended"])
    loop.staleness = collections.Counter({int(k): v for k, v in header["staleness"].items()})
    loop.snapshots_taken = header["snapshots_taken"]
    loop.optimizer.steps = int(header["optimizer_scalars"]["steps"])  # (each shard's own: ps-async's may differ)
    loop.sent_version = [loop.version] * loop.workers  # (the workers pull before their next push)
    loop.markers, loop.ordinal, loop.total_before = [header["ordinal"]] * loop.workers, header["ordinal"], loop.total
    pushes = iter(array_module(loop.params).asarray(rows))  # (on the shard's device)
    replayed = 0
    for kind, w, staleness in header["in_flight"]:
        if kind == "push":
            loop.take_push(w, next(pushes), staleness)
            replayed += 1
        else:  # "end": the coordinator had ended w's epoch
            loop.end_epoch([w])
    if loop.server == 0:
        loop.end_epoch([w for w in ended if w not in loop.ended])
    return replayed


# --- a worker's side: its state at the cut, the markers; rank 0 collects everything and writes -------------------
class WorkerSnapshots:
    """A worker's part in snapshots: record its state when asked and send the markers; on rank 0, also collect the
    servers' recordings and the other workers' states, and write the checkpoint through the driver."""

    def __init__(self, comm, snapshot_comm, servers, push_tag: int, every: int):
        """``comm``: the protocol's communicator (the markers go on it, with the pushes' ``push_tag``);
        ``snapshot_comm``: one of its own for the recordings; ``servers``: (server rank, (start, stop)) for each;
        ``every``: --checkpoint-every."""
        self.comm, self.snapshot_comm, self.servers, self.push_tag = comm, snapshot_comm, servers, push_tag
        self.every, self.rank = every, comm.Get_rank()
        self.workers = comm.Get_size() - len(servers)
        self.driver = None  # the driver's epochs (rank 0 records their figures, and writes through it)
        self.pending = None  # rank 0: what it has posted and received of the snapshot being collected
        self.sent = []  # this worker's state's sends, to complete at the end

    def record(self, worker, epoch: int, epoch_over: bool) -> None:
        """Record ``worker``'s state at the cut, and send the markers (rank 0 posts its receives first)."""
        steps0, sum0 = worker.carried
        state = {"worker": self.rank, "seq": worker.seq, "epoch": epoch, "steps": steps0 + worker.steps,
                 "loss_sum": sum0 + sum(read_losses(worker.losses)), "cursor": worker.cursor,
                 "epoch_over": epoch_over}  # fmt: skip
        with labelled(self.comm, CHECKPOINT, 0):
            if self.rank == 0:
                state.update(epochs=list(self.driver.position.epochs), train_time_s=self.driver.time_in_epoch())
                self.post(state, worker.model.flat_params.dtype)
            else:
                self.sent.append(self.snapshot_comm.Isend(pack(state, WORKER_BYTES), 0, WORKER))
            empty = worker.model.flat_params[:0]
            waitall([self.comm.Isend(empty, server, self.push_tag) for server, _ in self.servers])  # the marker

    def post(self, state: dict, dtype) -> None:
        """Rank 0: the receives of the servers' counters and the other workers' states (the rows' come once their
        counters say how many)."""
        if self.pending is not None:  # (the last snapshot's recordings are still coming: they will, without us)
            self.collect(wait=True)
        c = self.snapshot_comm
        headers = [np.zeros(HEADER_BYTES, dtype=np.uint8) for _ in self.servers]
        states = [np.zeros(WORKER_BYTES, dtype=np.uint8) for _ in range(1, self.workers)]
        self.pending = {"dtype": dtype, "state": state, "headers": headers, "states": states, "rows": {},
                        "counters": [c.Irecv(h, s, HEADER) for h, (s, _) in zip(headers, self.servers)],
                        "rest": [c.Irecv(st, w, WORKER) for w, st in zip(range(1, self.workers), states)]}  # fmt: skip

    def poll(self) -> None:
        """Rank 0, between steps: write the snapshot if everything has come (no wait)."""
        if self.pending is not None:
            self.collect(wait=False)

    def collect(self, wait: bool) -> None:
        p = self.pending
        for i, request in enumerate(p["counters"]):  # each server's counters, then the rows they announce
            if request is not None and (wait or request.Test()):
                if wait:
                    waitall([request])
                p["counters"][i], (server, (a, b)) = None, self.servers[i]
                p["headers"][i] = unpack(p["headers"][i])
                p["rows"][i] = np.empty((p["headers"][i]["rows"], b - a), dtype=p["dtype"])
                p["rest"].append(self.snapshot_comm.Irecv(p["rows"][i], server, ROWS))
        if wait:
            waitall(p["rest"])
            p["rest"] = []
        p["rest"] = [r for r in p["rest"] if not r.Test()]  # (each tested until done, never after)
        if p["rest"] or any(r is not None for r in p["counters"]):
            return
        self.pending = None
        states = [p["state"], *(unpack(s) for s in p["states"])]
        rows = [p["rows"][i] for i in range(len(self.servers))]
        self.driver.write_snapshot(*checkpoint_parts(p["headers"], rows, states, self.every))

    def close(self) -> None:
        """At the end of training: the snapshot being collected is completed (every worker records before it says
        DONE), and this worker's own sends."""
        if self.pending is not None:
            self.collect(wait=True)
        waitall(self.sent)
        self.sent = []


def checkpoint_parts(headers, rows, states, every: int):
    """A complete snapshot as a checkpoint: the full flat buffer and optimizer state (the servers' recorded shards
    put together), where training stood, the snapshot's own record (the servers' counters and the pushes in flight,
    every worker's place) and the pushes in flight as arrays. Checks the cut first: each server holds, or has in
    flight, exactly the pushes each worker counts as sent."""
    names = headers[0]["optimizer_buffers"]
    sent = [state["seq"] for state in states]
    if len({h["ordinal"] for h in headers}) > 1:
        raise RuntimeError(f"ps snapshot: recordings of snapshots {sorted({h['ordinal'] for h in headers})} put "
                           "together (a bug)")  # fmt: skip
    for h in headers:
        for w, count in enumerate(sent):
            in_flight = sum(1 for kind, sender, _ in h["in_flight"] if kind == "push" and sender == w)
            if h["clock"][w] + in_flight != count:
                raise RuntimeError(
                    f"ps snapshot {headers[0]['number']}: server {h['server']} holds {h['clock'][w]}, "
                    f"{in_flight} in flight, of worker {w}'s {count} pushes: an inconsistent cut"
                )
    params = np.concatenate([r[0] for r in rows])
    optimizer = {name: np.concatenate([r[1 + i] for r in rows]) for i, name in enumerate(names)}
    optimizer.update(headers[0]["optimizer_scalars"])  # (the coordinator's step count; each shard's is in its header)
    arrays = {}
    for h, r in zip(headers, rows):
        pushes = sum(1 for kind, _, _ in h["in_flight"] if kind == "push")
        arrays[f"ps.in_flight.{h['server']}"] = r[1 + len(names) : 1 + len(names) + pushes]
    steps, loss_sum = sum(s["steps"] for s in states), sum(s["loss_sum"] for s in states)
    workers = len(states)
    position = {"epoch": states[0]["epoch"], "global_step": headers[0]["number"] * every, "epochs": states[0]["epochs"],
                "done": headers[0]["pushes"] // workers, "done_loss": loss_sum / steps if steps else 0.0,
                "train_time_s": states[0]["train_time_s"]}  # fmt: skip
    workers_record = [{k: v for k, v in s.items() if k not in ("epochs", "train_time_s")} for s in states]
    snapshot = {"number": headers[0]["number"], "layout": [workers, len(headers)], "servers": headers,
                "workers": workers_record}  # fmt: skip
    return params, optimizer, position, snapshot, arrays


def restore(paradigm, snapshot: dict, arrays: dict, position) -> bool:
    """Resume from a snapshot: each worker takes its place at the cut (its pushes, its place in the epoch), each
    server its counters and the pushes in flight to replay (its shard and optimizer state came with the flat
    buffers). False, with nothing changed, when the run has other workers or servers than the snapshot's."""
    layout = [paradigm.workers, paradigm.world - paradigm.workers]
    if snapshot["layout"] != layout or snapshot["servers"][0]["synchronous"] != paradigm.synchronous:
        return False
    rank = paradigm.rank
    if rank < paradigm.workers:
        state, side = snapshot["workers"][rank], paradigm.side
        side.seq, side.carried, side.start_at = state["seq"], (state["steps"], state["loss_sum"]), state["cursor"]
        side.resumed_over = state["epoch_over"]
        position.step = state["seq"]  # (this worker's own steps: what its fault and progress count)
    else:
        index = rank - paradigm.workers
        ended = [s["worker"] for s in snapshot["workers"] if s["epoch_over"]]
        paradigm.resumed = (snapshot["servers"][index], arrays[f"ps.in_flight.{index}"], ended)
    position.done, position.done_loss = 0, 0.0
    return True

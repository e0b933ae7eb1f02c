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
    server 1  --------------7---5-------M----(R)---M------6----------------->   after (R), what arrives from w
                                        ^first marker: records; 7, 5 were        before w's M is in flight on
                                         already in its shard                    the channel w -> s: recorded

1. **The coordinator** (server 0), once it has applied m x N x W pushes (ps-sync: m x N updates) and no worker is
   between two epochs, records its state (a copy of its shard, its optimizer's state, its counters), and marks its
   next reply to every worker (its tag | MARKED).
2. **A worker**, at the end of the step whose coordinator reply was marked, records its own state: its sequence
   number k (pushes sent), its epoch, its steps and loss sum in it, where it is in its slices, whether the epoch is
   over. It sends the marker to every server, after its last push and before its next, and its state to rank 0.
3. **A server** records its state when the first marker reaches it (the coordinator has already). From then on,
   every message from worker w that arrives before w's marker (a push, an END) was in flight across the cut: it is
   recorded with its data. With all W markers in, the server sends its recording to rank 0, which writes the
   checkpoint once every server's and every worker's are in (it never waits for them inside a step; while it
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

**The other direction** (server -> worker) carries copies of the servers' weights; a worker restarts by pulling fresh
ones, so nothing on those channels needs recording, and the only marker there is the coordinator's (the MARKED tag,
which starts the snapshot). **A full flat buffer still**: the checkpoint's parameters and optimizer state are the
servers' recorded shards put together (what they held at the cut), so evaluation or another paradigm can resume
them; only ps-sync and ps-async on the same workers and servers replay the pushes in flight, which another resume
drops (and says so).
"""

from __future__ import annotations

import collections
import json

import numpy as np

from dtrain.backend import read_losses, to_host
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
    """Server ``loop``'s state at the moment it records, and the messages that cross the cut on its channels."""

    def __init__(self, loop, number: int):
        self.number = number
        self.params = loop.params.copy()
        state = loop.optimizer.state_dict()
        self.optimizer = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        self.counters = counters(loop)
        self.awaiting = set(range(loop.workers)) - loop.done  # whose marker has not come
        self.in_flight = []  # (kind, worker, staleness), in the order they came
        self.rows = []  # the pushes' data, in that order

    def note(self, kind: str, w: int, data=None, staleness: int = 0) -> None:
        """A message from w, before w's marker: it crossed the cut."""
        if w in self.awaiting:
            self.in_flight.append((kind, w, staleness))
            if data is not None:
                self.rows.append(data.copy())

    def marker(self, w: int) -> bool:
        """w's marker is in: w's channel is recorded. True once every worker's is."""
        self.awaiting.discard(w)
        return not self.awaiting

    def send(self, comm, server: int, workers: int) -> list:
        """Everything recorded, to rank 0 (non-blocking: the server goes on serving): the counters, then one array of
        :func:`recording_rows` rows: the shard, the optimizer's buffers (by name), the pushes in flight."""
        names = sorted(k for k, v in self.optimizer.items() if isinstance(v, np.ndarray))
        rows = np.zeros((recording_rows(len(names), workers), self.params.size), dtype=self.params.dtype)
        if 1 + len(names) + len(self.rows) > len(rows):
            raise RuntimeError(f"ps snapshot: {len(self.rows)} pushes in flight to server {server}, more than two a "
                               "worker: a worker recorded late (a bug)")  # fmt: skip
        for i, row in enumerate([self.params, *(self.optimizer[k] for k in names), *self.rows]):
            rows[i] = to_host(row)
        scalars = {k: v for k, v in self.optimizer.items() if not isinstance(v, np.ndarray)}
        header = {"server": server, "number": self.number, **self.counters, "optimizer_scalars": scalars,
                  "optimizer_buffers": names, "in_flight": self.in_flight}  # fmt: skip
        with labelled(comm, CHECKPOINT, 0):
            return [comm.Isend(pack(header, HEADER_BYTES), 0, HEADER), comm.Isend(rows, 0, ROWS)]


def recording_rows(buffers: int, workers: int) -> int:
    """Rows of a server's recording: its shard, the optimizer's ``buffers``, and room for the pushes in flight: at
    most two a worker. The coordinator marks its next reply to w, so w records at the end of the step whose push was
    outstanding when the coordinator recorded (j) or of the next one (j + 1); a server that recorded early, at another
    worker's marker, can see both arrive after it did (j slow on the wire), never j - 1 (w sent j only once every
    server had answered j - 1)."""
    return 1 + buffers + 2 * workers


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
    pushes = iter(rows)
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

    def __init__(self, comm, snapshot_comm, servers, push_tag: int, rows: int, every: int):
        """``comm``: the protocol's communicator (the markers go on it, with the pushes' ``push_tag``);
        ``snapshot_comm``: one of its own for the recordings; ``servers``: (server rank, (start, stop)) for each;
        ``rows``: of a server's recording (see :meth:`ServerRecording.send`); ``every``: --checkpoint-every."""
        self.comm, self.snapshot_comm, self.servers, self.push_tag = comm, snapshot_comm, servers, push_tag
        self.rows, self.every, self.rank = rows, every, comm.Get_rank()
        self.workers = comm.Get_size() - len(servers)
        self.driver = None  # the driver's epochs (rank 0 records their figures, and writes through it)
        self.pending = None  # rank 0: (requests, headers, rows, states) of the snapshot being collected
        self.sent = []  # this worker's state's sends, to complete at the end

    def record(self, worker, epoch: int, epoch_over: bool) -> None:
        """Record ``worker``'s state at the cut, and send the markers (rank 0 posts its receives first)."""
        steps0, sum0 = worker.carried
        state = {"worker": self.rank, "seq": worker.seq, "epoch": epoch, "steps": steps0 + worker.steps,
                 "loss_sum": sum0 + sum(read_losses(worker.losses)), "cursor": worker.cursor,
                 "epoch_over": epoch_over}  # fmt: skip
        dtype = worker.model.flat_params.dtype
        with labelled(self.comm, CHECKPOINT, 0):
            if self.rank == 0:
                state.update(epochs=list(self.driver.position.epochs), train_time_s=self.driver.time_in_epoch())
                self.post(state, dtype)
            else:
                self.sent.append(self.snapshot_comm.Isend(pack(state, WORKER_BYTES), 0, WORKER))
            empty = worker.model.flat_params[:0]
            waitall([self.comm.Isend(empty, server, self.push_tag) for server, _ in self.servers])  # the marker

    def post(self, state: dict, dtype) -> None:
        if self.pending is not None:  # (the coordinator starts one snapshot at a time, after the last is complete)
            self.finish_pending(wait=True)
        headers = [np.zeros(HEADER_BYTES, dtype=np.uint8) for _ in self.servers]
        rows = [np.zeros((self.rows, b - a), dtype=dtype) for _, (a, b) in self.servers]
        states = [np.zeros(WORKER_BYTES, dtype=np.uint8) for _ in range(1, self.workers)]
        c = self.snapshot_comm
        requests = [c.Irecv(h, s, HEADER) for h, (s, _) in zip(headers, self.servers)]
        requests += [c.Irecv(r, s, ROWS) for r, (s, _) in zip(rows, self.servers)]
        requests += [c.Irecv(st, w, WORKER) for w, st in zip(range(1, self.workers), states)]
        self.pending = (requests, headers, rows, [state, *states])

    def poll(self) -> None:
        """Rank 0, between steps: write the snapshot if everything has come (never a wait inside training)."""
        if self.pending is not None:
            self.finish_pending(wait=False)

    def finish_pending(self, wait: bool) -> None:
        requests, headers, rows, states = self.pending
        if wait:
            waitall(requests)
        else:
            requests[:] = [r for r in requests if not r.Test()]  # (each tested until done, never after)
            if requests:
                return
        self.pending = None
        states = [states[0], *(unpack(s) for s in states[1:])]
        self.driver.write_snapshot(*checkpoint_parts([unpack(h) for h in headers], rows, states, self.every))

    def close(self) -> None:
        """At the end of training: the snapshot being collected is completed (every worker records before it says
        DONE), and this worker's own sends."""
        if self.pending is not None:
            self.finish_pending(wait=True)
        waitall(self.sent)
        self.sent = []


def checkpoint_parts(headers, rows, states, every: int):
    """A complete snapshot as a checkpoint: the full flat buffer and optimizer state (the servers' recorded shards
    put together), where training stood, the snapshot's own record (the servers' counters and the pushes in flight,
    every worker's place) and the pushes in flight as arrays. Checks the cut first: each server holds, or has in
    flight, exactly the pushes each worker counts as sent."""
    names = headers[0]["optimizer_buffers"]
    sent = [state["seq"] for state in states]
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
